"""A GNN training step with the sparse adjacency inside the dense graph (issue 24): the loss of
``relu(A·X·W1)·W2`` against targets and its gradients w.r.t. W1 and W2, built with ``ej.einsum`` on
a SparseTensor (``sparse_einsum`` nodes) and ``ej.grad``, compiled once and run on 1 and 2 devices
(threads backend). Peer: torch autograd through ``torch.sparse.mm`` on the same data, all cores.
CPU seconds (``time.process_time``, every thread), median of ``--reps``: the ratio is einjoin over
torch. The sparse nodes run on one device each (the planner keeps them whole); the dense matmuls
around them are planned as usual.

The adjacency is a constant of the program (``ej.sparse``), then an input fed at each run
(``ej.sparse_input``: the keys and values travel as graph inputs and each run rebuilds the
sparse tensor from them). A second table: an SpMV ``relu(A @ v)`` (its rows cut on 2 devices).

    .venv/bin/python bench/sparse_graph.py --nodes 20000 --edges 200000 --reps 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
import einjoin as ej  # noqa: E402
from cpu_timing import cpu_median  # noqa: E402


def graph(n: int, e: int, seed: int = 0) -> scipy.sparse.csr_array:
    """A power-law graph: destinations drawn by a Zipf-like weight, sources uniform."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n + 1) ** 0.8
    dst = rng.choice(n, size=e, p=weights / weights.sum())
    src = rng.integers(0, n, e)
    mat = scipy.sparse.coo_array((np.full(e, 1.0 / 8), (dst, src)), shape=(n, n)).tocsr()
    mat.sum_duplicates()
    return mat


def step_graph(a: ej.SparseTensor | ej.SparseInput, n: int, f: int, hid: int, out: int) -> list[ej.Tensor]:
    x, y = ej.input("x", (n, f), "float64"), ej.input("y", (n, out), "float64")
    w1, w2 = ej.param("w1", (f, hid), "float64"), ej.param("w2", (hid, out), "float64")
    h = ej.relu(a @ (x @ w1))
    loss = ej.mean((a @ (h @ w2) - y) ** 2)
    return [loss, *ej.grad(loss, [w1, w2])]


def torch_step(ta: Any, feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
    import torch
    w1 = torch.from_numpy(feeds["w1"]).requires_grad_(True)
    w2 = torch.from_numpy(feeds["w2"]).requires_grad_(True)
    x, y = torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["y"])
    h = torch.relu(torch.sparse.mm(ta, x @ w1))
    loss = ((torch.sparse.mm(ta, h @ w2) - y) ** 2).mean()
    loss.backward()
    return loss.detach(), w1.grad, w2.grad


def gcn_parser(doc: str | None) -> argparse.ArgumentParser:
    """The GCN benchmarks' options (this file's and sparse_torch.py's): graph and layer sizes, reps."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--edges", type=int, default=200000)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    return p


def main(argv: list[str] | None = None) -> None:
    args = gcn_parser(__doc__).parse_args(argv)
    import torch
    n = args.nodes
    mat = graph(n, args.edges)
    a = ej.sparse("A", mat)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((n, args.features)), "y": rng.standard_normal((n, args.out)),
             "w1": 0.1 * rng.standard_normal((args.features, args.hidden)),
             "w2": 0.1 * rng.standard_normal((args.hidden, args.out))}
    coo = mat.tocoo()
    ta = torch.sparse_coo_tensor(np.stack([coo.row, coo.col]), coo.data, mat.shape, check_invariants=True).coalesce()
    t_torch, ref = cpu_median(lambda: torch_step(ta, feeds), args.reps, warm=True)
    print(f"GNN step (loss, dW1, dW2), {n} nodes, {mat.nnz} edges, X {n}x{args.features}, "
          f"hidden {args.hidden}, out {args.out}; CPU ms, median of {args.reps}")
    print(f"{'case':34s} {'CPU ms':>9s} {'x torch':>8s} {'compile s':>10s}")
    print(f"{'torch autograd (torch.sparse.mm)':34s} {t_torch * 1e3:9.1f} {1.0:8.2f}")
    outs = step_graph(a, n, args.features, args.hidden, args.out)
    for devices in (1, 2):
        c = time.process_time()
        prog = ej.compile(outs, devices=devices)
        compile_s = time.process_time() - c
        t, got = cpu_median(lambda p=prog: p.run(**feeds), args.reps, warm=True)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r.numpy(), rtol=1e-8, atol=1e-10)
        print(f"{f'einjoin graph, {devices} device(s)':34s} {t * 1e3:9.1f} {t / t_torch:8.2f} {compile_s:10.2f}")
    # the adjacency fed at each run (ej.sparse_input): the same program for any graph of <= nnz edges
    fed_in = ej.sparse_input("A", (n, n), nnz=mat.nnz, dtype="float64")
    outs = step_graph(fed_in, n, args.features, args.hidden, args.out)
    for devices in (1, 2):
        c = time.process_time()
        prog = ej.compile(outs, devices=devices)
        compile_s = time.process_time() - c
        t, got = cpu_median(lambda p=prog: p.run(A=a, **feeds), args.reps, warm=True)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r.numpy(), rtol=1e-8, atol=1e-10)
        print(f"{f'einjoin, A fed at run, {devices} dev':34s} {t * 1e3:9.1f} {t / t_torch:8.2f} {compile_s:10.2f}")
    spmv_table(mat, a, args.reps)


def spmv_table(mat: scipy.sparse.csr_array, a: ej.SparseTensor, reps: int) -> None:
    """An SpMV ``relu(A @ v)``: no feature dim to cut, so on 2 devices the planner cuts A's rows;
    each device computes its rows' entries (a constant's, and since 00fea45 a fed one's: before,
    each device ran every fed entry). CPU ms next to scipy's ``A @ v``."""
    n = mat.shape[0]
    v = np.random.default_rng(2).standard_normal(n)
    t_scipy, ref = cpu_median(lambda: np.maximum(mat @ v, 0), reps, warm=True)
    print(f"\nSpMV relu(A @ v), {n} nodes; CPU ms, median of {reps}")
    print(f"{'case':34s} {'CPU ms':>9s} {'x scipy':>8s}")
    print(f"{'scipy.sparse':34s} {t_scipy * 1e3:9.1f} {1.0:8.2f}")
    fed_in = ej.sparse_input("A", (n, n), nnz=mat.nnz, dtype="float64")
    vin = ej.input("v", (n,), "float64")
    for label, src, feeds in (("constant", a, {}), ("A fed at run", fed_in, {"A": a})):
        y = ej.relu(ej.einsum("ij,j->i", src, vin))
        for devices in (1, 2):
            prog = ej.compile(y, devices=devices, quiet=True)
            t, got = cpu_median(lambda p=prog, f=feeds: p.run(v=v, **f), reps, warm=True)
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
            print(f"{f'einjoin, {label}, {devices} dev':34s} {t * 1e3:9.1f} {t / t_scipy:8.2f}")


if __name__ == "__main__":
    main()
