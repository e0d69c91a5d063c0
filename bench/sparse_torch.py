"""A torch GCN imported with ``ej.from_torch`` (issue 24): its adjacency a torch sparse COO tensor
given as a forward argument (a sparse input of the graph, fed at each run), two graph
convolutions ``A · relu(A · X W1) W2``. The forward on 1 and 2 devices, and ``ej.Trainer``'s AdamW
step on 2 devices, against torch on the same data (all cores). CPU milliseconds
(``time.process_time``, every thread), median of ``--reps``; each einjoin row checked against
torch first (forward values; the trainer's first losses within 1e-4 relative).

    .venv/bin/python bench/sparse_torch.py --nodes 20000 --edges 200000 --reps 5
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import einjoin as ej  # noqa: E402
from cpu_timing import cpu_median  # noqa: E402
from sparse_graph import gcn_parser  # noqa: E402


def power_law_graph(n: int, edges: int, seed: int = 0) -> torch.Tensor:
    """Out-degrees by a power law (node k's share ~ (k+1)^-1.2), self loops, rows normalised."""
    g = torch.Generator().manual_seed(seed)
    src = torch.multinomial(torch.arange(1, n + 1, dtype=torch.float64) ** -1.2, edges, replacement=True,
                            generator=g)
    idx = torch.stack([torch.cat([src, torch.arange(n)]), torch.cat([torch.randint(0, n, (edges,), generator=g),
                                                                    torch.arange(n)])])
    a = torch.sparse_coo_tensor(idx, torch.ones(idx.shape[1]), (n, n)).coalesce()
    deg = torch.zeros(n).index_add_(0, a.indices()[0], a.values())
    return torch.sparse_coo_tensor(a.indices(), a.values() / deg[a.indices()[0]], (n, n)).coalesce()


class GCN(torch.nn.Module):
    def __init__(self, f: int, hidden: int, out: int) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(f, hidden), torch.nn.Linear(hidden, out)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.l2(torch.relu(torch.sparse.mm(adj, self.l1(x)))))


def main(argv: list[str] | None = None) -> None:
    args = gcn_parser(__doc__).parse_args(argv)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    torch.manual_seed(0)
    adj = power_law_graph(args.nodes, args.edges)
    x, y = torch.randn(args.nodes, args.features), torch.randn(args.nodes, args.out)
    m = GCN(args.features, args.hidden, args.out).eval()
    print(f"GCN via ej.from_torch, {args.nodes} nodes, {adj._nnz()} stored entries, X {args.nodes}x{args.features}, "
          f"hidden {args.hidden}, out {args.out}; CPU ms, median of {args.reps}")
    print(f"{'case':36s} {'einjoin':>9s} {'torch':>9s} {'ratio':>7s}")
    with torch.no_grad():
        t_torch, want = cpu_median(lambda: m(adj, x), args.reps, warm=True)
    for devices in (1, 2):
        prog = ej.compile(ej.from_torch(m, (adj, x)), devices=devices)
        t, got = cpu_median(lambda pr=prog: pr.run(adj, x), args.reps, warm=True)
        torch.testing.assert_close(torch.as_tensor(got), want, rtol=1e-4, atol=1e-5)
        print(f"{f'forward, {devices} device(s)':36s} {t * 1e3:9.1f} {t_torch * 1e3:9.1f} {t / t_torch:7.2f}")

    def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).mean()

    ref = GCN(args.features, args.hidden, args.out)
    mine = GCN(args.features, args.hidden, args.out)
    mine.load_state_dict(ref.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)

    def torch_step() -> float:
        opt.zero_grad()
        loss = mse(ref(adj, x), y)
        loss.backward()
        opt.step()
        return loss.item()

    trainer = ej.Trainer(mine, (adj, x, y), mse, optimizer=ej.optim.AdamW(lr=0.01), devices=2)
    t_torch, first = cpu_median(torch_step, args.reps, warm=True)
    t, got = cpu_median(lambda: trainer.step(adj, x, y), args.reps, warm=True)
    np.testing.assert_allclose(got, first, rtol=1e-4)  # the same step of both, from the same weights
    print(f"{'Trainer AdamW step, 2 devices':36s} {t * 1e3:9.1f} {t_torch * 1e3:9.1f} {t / t_torch:7.2f}")


if __name__ == "__main__":
    main()
