"""torch sparse tensors through ``ej.from_torch`` (issue 24): a GCN whose adjacency is a torch
sparse COO / CSR tensor, given as a forward argument or held as a buffer, imported as a sparse
input (``einjoin.frontend.aten_sparse``: ``aten._sparse_mm`` and ``A @ h`` become one
``sparse_einsum`` node each) and compared with torch's own forward and autograd."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.ir.graph import Graph

warnings.filterwarnings("ignore", message="Sparse invariant checks")


def power_law_graph(n: int, edges: int, seed: int, csr: bool = False) -> torch.Tensor:
    """A directed graph on ``n`` nodes whose out-degrees follow a power law (node k's share ~
    (k+1)^-1.2), row-normalised as a GCN's propagation matrix (a self loop on every node)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, n + 1, dtype=torch.float64) ** -1.2
    src = torch.multinomial(weights, edges, replacement=True, generator=g)
    dst = torch.randint(0, n, (edges,), generator=g)
    loops = torch.arange(n)
    idx = torch.stack([torch.cat([src, loops]), torch.cat([dst, loops])])
    a = torch.sparse_coo_tensor(idx, torch.ones(idx.shape[1]), (n, n)).coalesce()
    deg = torch.sparse.sum(a, 1).to_dense()
    a = torch.sparse_coo_tensor(a.indices(), a.values() / deg[a.indices()[0]], (n, n)).coalesce()
    return a.to_sparse_csr() if csr else a


class GCN(torch.nn.Module):
    """Two graph convolutions, the adjacency a forward argument: A relu(A X W1) W2."""

    def __init__(self, f: int = 8, hidden: int = 16, out: int = 4) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(f, hidden)
        self.l2 = torch.nn.Linear(hidden, out)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(adj, self.l1(x)))
        return adj @ self.l2(h)


class BufferGCN(torch.nn.Module):
    """The same, the adjacency a registered buffer of the module."""

    def __init__(self, adj: torch.Tensor, f: int = 8, hidden: int = 16, out: int = 4) -> None:
        super().__init__()
        self.register_buffer("adj", adj)
        self.l1 = torch.nn.Linear(f, hidden)
        self.l2 = torch.nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(self.adj, self.l1(x)))
        return torch.sparse.mm(self.adj, self.l2(h))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.as_tensor(got), want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_gcn_with_a_sparse_argument_equals_torch(devices):
    torch.manual_seed(0)
    n = 120
    adj, x = power_law_graph(n, 600, seed=1), torch.randn(n, 8)
    m = GCN().eval()
    fn = ej.from_torch(m, (adj, x))
    graph = Graph([o.node for o in fn.outputs])
    kinds = [nd.kind for nd in graph.nodes]
    assert kinds.count("sparseeinsum") == 2
    # never dense: no graph value of the adjacency's n x n shape
    assert all(nd.shape != (n, n) for nd in graph.nodes)
    prog = ej.compile(fn, devices=devices)
    _close(prog.run(adj, x), m(adj, x))
    # another graph of the same shape and at most as many entries: the same program
    other = power_law_graph(n, 400, seed=2)
    assert other._nnz() <= adj._nnz()
    _close(prog.run(other, x), m(other, x))
    _close(prog.run(adj.to_sparse_csr(), x), m(adj, x))  # a CSR feed of the COO-imported argument


@pytest.mark.parametrize("method", ["export", "fx"])
def test_gcn_imported_with_a_csr_argument_and_its_reference(method):
    n = 60
    adj, x = power_law_graph(n, 250, seed=3, csr=True), torch.randn(n, 8)
    m = GCN().eval()
    fn = ej.from_torch(m, (adj, x), method=method)
    assert [nd.kind for nd in Graph([fn.outputs[0].node]).nodes].count("sparseeinsum") == 2
    _close(ej.compile(fn, devices=2).run(adj, x), m(adj, x))
    _close(fn.reference(adj, x), m(adj, x))


@pytest.mark.parametrize("method", ["export", "fx"])
def test_gcn_with_a_sparse_buffer_follows_the_module(method):
    n = 80
    m = BufferGCN(power_law_graph(n, 300, seed=4)).eval()
    x = torch.randn(n, 8)
    fn = ej.from_torch(m, (x,), method=method)
    assert [nd.kind for nd in Graph([fn.outputs[0].node]).nodes].count("sparseeinsum") == 2
    assert "adj" in fn.bound and fn.arg_names == ("x",)
    assert isinstance(fn.bound["adj"], torch.Tensor) and fn.bound["adj"].is_sparse  # fed sparse, never dense
    prog = ej.compile(fn, devices=2)
    _close(prog.run(x), m(x))
    m.adj = power_law_graph(n, 200, seed=5)  # a new graph in the module: the next run reads it, as torch's
    _close(prog.run(x), m(x))
    _close(fn.reference(x), m(x))


def test_a_buffer_with_more_entries_than_at_import_is_refused_naming_it():
    """(A forward argument with more is imported again: tests/test_sparse_import_capacity.py.)"""
    n = 40
    m, x = BufferGCN(power_law_graph(n, 60, seed=6)).eval(), torch.randn(n, 8)
    prog = ej.compile(ej.from_torch(m, (x,)))
    m.adj = power_law_graph(n, 400, seed=7)
    with pytest.raises(ej.EinjoinError, match="'adj'.*more than the.*import it with the largest graph"):
        prog.run(x)


def test_gcn_gradients_equal_torch_autograd():
    """ej.grad of an imported GCN's loss w.r.t. its parameters and the adjacency's values."""
    n = 70
    adj, x = power_law_graph(n, 300, seed=8), torch.randn(n, 8)
    m = GCN().eval()
    fn = ej.from_torch(m, (adj, x))
    loss = (fn.outputs[0] ** 2).mean()
    params = list(fn.parameters.values())
    adj_in = next(v for v in Graph([loss.node]).input_by_name.values() if v.op.name == "adj")
    grads = ej.grad(loss, [*params, ej.Tensor(adj_in)])
    got = ej.compile(fn.with_outputs([loss, *grads]), devices=2).run(adj, x)
    leaf = adj.detach().clone().requires_grad_(True)
    want = (m(leaf, x) ** 2).mean()
    want.backward()
    _close(got[0], want)
    for g, p in zip(got[1:], m.parameters()):
        _close(g, p.grad)
    # the adjacency's values: one per stored entry, in the coalesced order (torch's gradient read
    # at the stored entries: A @ h's is dense, torch.sparse.mm's on the pattern)
    g = leaf.grad.to_dense()
    rows, cols = adj.indices()
    np.testing.assert_allclose(np.asarray(got[-1])[:adj._nnz()], g[rows, cols].numpy(), rtol=1e-4, atol=1e-6)


def _torch_losses(m: torch.nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> list[float]:
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((m(*batch[:-1]) - batch[-1]) ** 2).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("where", ["batch", "buffer"])
def test_trainer_on_a_gcn_with_a_sparse_adjacency_matches_torch_adamw(where):
    """10 AdamW steps of a GCN whose adjacency is in the batch or a buffer: the losses within 1e-4
    relative of torch's (issue 19's standard), and the trained weights load into the module."""
    n = 90
    adj, x, y = power_law_graph(n, 400, seed=9), torch.randn(n, 8), torch.randn(n, 4)
    torch.manual_seed(1)
    m = GCN() if where == "batch" else BufferGCN(adj)
    ref = GCN() if where == "batch" else BufferGCN(adj)
    ref.load_state_dict(m.state_dict())
    batch = (adj, x, y) if where == "batch" else (x, y)
    want = _torch_losses(ref, batch, 10)
    trainer = ej.Trainer(m, batch, _mse, optimizer=ej.optim.AdamW(lr=0.01), devices=2, leave_idle=False)
    got = [trainer.step(*batch) for _ in range(10)]
    np.testing.assert_allclose(got, want, rtol=1e-4)
    sd = trainer.state_dict()
    assert m.load_state_dict(sd, strict=True) is not None
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-4, atol=1e-5)
    if where == "buffer":
        assert sd["adj"].is_sparse  # the adjacency as it was, sparse
    else:  # another graph in the next batch: the same program, torch's loss
        other = power_law_graph(n, 300, seed=10)
        with torch.no_grad():
            expect = _mse(ref(other, x), y).item()
        np.testing.assert_allclose(trainer.evaluate(other, x, y), expect, rtol=1e-4)


class SpMMLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.sparse.mm(adj, self.lin(x)))


def test_the_adjacency_gradient_as_a_sparse_tensor_as_torch_gives_it():
    """The import's sparse input is ej.sparse_input(name, shape, nnz, dtype) again (one declaration):
    ej.grad w.r.t. it and on_pattern give torch's sparse .grad of the adjacency."""
    n = 50
    adj, x = power_law_graph(n, 200, seed=15), torch.randn(n, 8)
    m = SpMMLayer().eval()
    fn = ej.from_torch(m, (adj, x))
    a = ej.sparse_input("adj", (n, n), nnz=adj._nnz(), dtype="float32")
    assert a.values in Graph([fn.outputs[0].node]).input_by_name.values()  # the import's own input
    (g,) = ej.grad((fn.outputs[0] ** 2).sum(), [a])
    got = a.on_pattern(adj, ej.compile(fn.with_outputs(g), devices=2).run(adj, x))
    leaf = adj.detach().clone().requires_grad_(True)
    (m(leaf, x) ** 2).sum().backward()
    assert leaf.grad.is_sparse and got.nnz == leaf.grad.coalesce()._nnz()
    np.testing.assert_allclose(got.todense(), leaf.grad.to_dense().numpy(), rtol=1e-4, atol=1e-6)


def test_trainer_state_dict_with_a_sparse_buffer_round_trips_and_loads_another_graph(tmp_path):
    n = 60
    adj, x, y = power_law_graph(n, 250, seed=16), torch.randn(n, 8), torch.randn(n, 4)
    m = BufferGCN(adj)
    trainer = ej.Trainer(m, (x, y), _mse, optimizer=ej.optim.AdamW(lr=0.01))
    for _ in range(3):
        trainer.step(x, y)
    sd = trainer.state_dict()
    assert trainer.load_state_dict(sd) == ([], [])
    other = power_law_graph(n, 150, seed=17)  # another adjacency, as torch's module.load_state_dict takes it
    trainer.load_state_dict({**sd, "adj": other})
    ref = BufferGCN(other)
    ref.load_state_dict({**sd, "adj": other})
    with torch.no_grad():
        want = _mse(ref(x), y).item()
    np.testing.assert_allclose(trainer.evaluate(x, y), want, rtol=1e-5)
    with pytest.raises(ej.ShapeError, match="'adj'"):
        trainer.load_state_dict({**sd, "adj": other.to_dense()})
    path = tmp_path / "gcn.safetensors"
    trainer.save(path)
    again = ej.Trainer.load(path, BufferGCN(adj), (x, y), _mse)
    np.testing.assert_allclose(again.step(x, y), trainer.step(x, y), rtol=1e-6)
