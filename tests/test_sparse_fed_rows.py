"""A sparse tensor fed at run (``ej.sparse_input``) cut along its own dims (issue 24): each kernel
computes only the fed entries in its rows (``FedSparse.einsum_within``), as a constant tensor's
kernels do, so an SpMV on several devices does not repeat its work. Values checked against
numpy on the densified feed; the work checked by the entries each kernel's sparse plan ran on
(recorded at ``PlanCache.run``: the measured work, not a timing) and by the modelled flops.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.decomp.flops import kernel_flops
from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.sparse_einsum import sparse_flops
from einjoin.sparse.graph_plans import PlanCache


def _adj(n: int, m: int, density: float, seed: int) -> scipy.sparse.coo_array:
    return scipy.sparse.random_array((n, m), density=density, random_state=seed, format="coo")


@pytest.fixture
def entries_run(monkeypatch):
    """Per call of a sparse kernel's plan: (thread, stored entries of the tensor it ran on, box)."""
    calls: list[tuple[str, int, object]] = []
    lock = threading.Lock()
    run = PlanCache.run

    def recording(self, op, dense, tensor, dtype, part=None):
        with lock:
            calls.append((threading.current_thread().name, tensor.nnz, part))
        return run(self, op, dense, tensor, dtype, part)

    monkeypatch.setattr(PlanCache, "run", recording)
    return calls


def _sparse_node(prog: ej.Program) -> ej.Node:
    return next(n for n in prog.graph.nodes if isinstance(n.op, SparseEinsum))


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_a_fed_spmv_splits_its_entries_among_the_devices(devices, entries_run):
    """'ij,j->i' (no feature dim to cut): on p devices the planner cuts the rows; each device's
    kernel runs on the fed entries of its rows only, together every entry once (before: each ran
    on all of them, p times the work), and the modelled flops sum to the op's."""
    sp = _adj(64, 48, 0.12, 1)
    A = ej.sparse_input("Aspmv", sp.shape, nnz=sp.nnz + 10, dtype="float64")
    v = ej.input("vspmv", (48,), "float64")
    y = ej.relu(ej.einsum("ij,j->i", A, v))
    vv = np.random.default_rng(2).normal(size=48)
    prog = ej.compile(y, devices=devices, backend="threads")
    for _ in range(2):  # the second run finds its rows kept with the run's tensor
        entries_run.clear()
        np.testing.assert_allclose(prog.run(Aspmv=sp, vspmv=vv), np.maximum(sp.toarray() @ vv, 0),
                                   rtol=1e-12, atol=1e-12)
        assert sum(n for _, n, _ in entries_run) == sp.nnz
        assert len(entries_run) == len(prog.decomps[_sparse_node(prog)].kernels)
        if devices > 1:
            assert len({t for t, _, _ in entries_run}) == devices  # one kernel on each device's thread
            assert all(box is not None for _, _, box in entries_run)
    node = _sparse_node(prog)
    dec = prog.decomps[node]
    assert len(dec.kernels) == devices
    modelled = sum(kernel_flops(dec, k.index) for k in dec.kernels)  # (each share rounded down)
    assert sparse_flops(node) - devices < modelled <= sparse_flops(node)


@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_forced_cuts_of_a_fed_operands_own_dims_equal_numpy(data):
    """Any cut (rows, columns, both; p devices of 1, 2, 4) of an output dim the fed tensor carries,
    on equations where it is first, transposed, keeps both its dims or has rank 3: numpy's values, its
    entries computed once over the kernels (no kernel repeats another's rows)."""
    case = data.draw(st.sampled_from([
        ("ij,j->i", (0,)),
        ("ij,jk->ik", (0,)),
        ("ji,jk->ik", (0,)),          # A's columns are the output's first dim
        ("ij,kj->ikj", (0, 2)),       # A's rows and columns both kept (output dims 0 and 2)
        ("ijk,jr,kr->ir", (0,)),      # rank 3 (MTTKRP)
    ]))
    eq, own_out = case  # the output dims the fed tensor carries: cut at random, the others whole
    devices = data.draw(st.sampled_from([1, 2, 4]))
    ins = eq.split("->")[0].split(",")
    sizes = {lab: data.draw(st.integers(1, 12), label=f"size {lab}") for lab in sorted(set(eq) - set(",->"))}
    shape = tuple(sizes[lab] for lab in ins[0])
    density = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    dense_a = np.where(rng.random(shape) < density, rng.normal(size=shape), 0.0)
    fed = ej.sparse("Aforced", dense_a)
    nnz = fed.reblock((1,) * len(shape)).nnz
    A = ej.sparse_input("Aforced", shape, nnz=nnz + data.draw(st.integers(0, 3)), dtype="float64")
    xs = [ej.input(f"xf{i}", tuple(sizes[lab] for lab in ls), "float64") for i, ls in enumerate(ins[1:])]
    y = ej.einsum(eq, A, *xs)
    feeds = {f"xf{i}": rng.normal(size=x.shape) for i, x in enumerate(xs)}
    want = np.einsum(eq, dense_a, *feeds.values())
    out_labels = eq.split("->")[1]
    counts = {}
    for o in range(len(out_labels)):
        top = min(4, y.shape[o])
        counts["abc"[o]] = data.draw(st.integers(1, top)) if o in own_out else 1
    calls: list[int] = []
    run = PlanCache.run

    def recording(self, op, dense, tensor, dtype, part=None):
        calls.append(tensor.nnz)
        return run(self, op, dense, tensor, dtype, part)

    prog = ej.compile(y, devices=devices, specs={y.node: counts}, fuse=False, backend="threads", quiet=True)
    PlanCache.run = recording  # (not monkeypatch: hypothesis runs many examples in one test call)
    try:
        got = prog.run(Aforced=fed, **feeds)
    finally:
        PlanCache.run = run
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert sum(calls) == nnz


def test_each_run_cuts_its_own_feed_and_gradients_stay_torchs():
    """Two feeds of other patterns through one program on 2 devices cut along A's rows (the kept
    rows belong to the run's tensor, never the last one's); the values' gradient on the fed
    pattern equals the densified product's."""
    A = ej.sparse_input("Arows", (30, 20), nnz=150, dtype="float64")
    x = ej.input("xrows", (20,), "float64")
    y = ej.einsum("ij,j->i", A, x)
    loss = (y * y).sum()
    (dA,) = ej.grad(loss, [A])
    prog = ej.compile([y, dA], devices=2, specs={y.node: {"a": 2}}, backend="threads")
    xv = np.random.default_rng(5).normal(size=20)
    for seed, density in ((6, 0.1), (7, 0.2), (6, 0.1)):
        sp = _adj(30, 20, density, seed).tocsr()
        got_y, got_d = prog.run(Arows=sp, xrows=xv)
        want_y = sp.toarray() @ xv
        np.testing.assert_allclose(got_y, want_y, rtol=1e-12, atol=1e-12)
        coo = sp.tocoo()
        order = np.lexsort((coo.col, coo.row))
        want_d = (2 * want_y[:, None] * xv[None, :])[coo.row[order], coo.col[order]]
        np.testing.assert_allclose(np.asarray(got_d)[:sp.nnz], want_d, rtol=1e-12, atol=1e-12)


@pytest.mark.xdist_group("ray")
def test_a_fed_spmv_on_ray_devices(ray_backend):
    sp = _adj(40, 30, 0.15, 8)
    A = ej.sparse_input("Aray", sp.shape, nnz=sp.nnz, dtype="float64")
    v = ej.input("vray", (30,), "float64")
    y = ej.einsum("ij,j->i", A, v)
    vv = np.random.default_rng(9).normal(size=30)
    prog = ej.compile(y, devices=2, backend=ray_backend, specs={y.node: {"a": 2}}, quiet=True)
    np.testing.assert_allclose(prog.run(Aray=sp, vray=vv), sp.toarray() @ vv, rtol=1e-12, atol=1e-12)
