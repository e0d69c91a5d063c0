"""The memory planner sees a sparse operand's stored entries (issue 24: "the memory planner and
the offload path see the actual tuple sizes"): a constant's keys and values in each kernel's
rows (its scratch), a fed one's keys and values inputs at their capacity, never the dense size.
Peaks are checked against bytes computed by hand; a cap between the stored and the dense size
compiles and runs (values vs numpy); one below what any cut holds is refused."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse

import einjoin as ej
from einjoin.exchange import TaskKind
from einjoin.memplan import MemoryCapError

N, K = 400, 4


def _adjacency(density: float = 0.01, seed: int = 0) -> scipy.sparse.coo_matrix:
    return scipy.sparse.random(N, N, density=density, random_state=seed, format="coo", dtype=np.float32)


def _kernels(prog: ej.Program) -> list:
    return [t for t in prog.taskgraph.tasks if t.kind is TaskKind.KERNEL]


@pytest.mark.parametrize("block", [1, 4])
def test_constant_peak_is_its_stored_entries_plus_the_dense_blocks(block: int) -> None:
    a = _adjacency()
    A = ej.sparse("A", a, block=block)
    h = ej.input("h", (N, K), "float32")
    prog = ej.compile(ej.einsum("ij,jk->ik", A, h), memory_limit="1MiB")
    assert len(_kernels(prog)) == 1  # one kernel: the whole tensor's entries held at once
    # a stored block: its 2 int64 keys and its block's float32 values
    stored = len(A.keys) * (2 * 8 + block * block * 4)
    dense = N * K * 4  # h's block, and the output's
    # h, the output, and the kernel's scratch: the engine's copy of its dense input and the entries
    assert prog.taskgraph.memory.peak_bytes_per_device[0] == dense + dense + (dense + stored)
    assert _kernels(prog)[0].scratch == dense + stored
    assert stored < N * N * 4  # what a dense A would hold (the planner never counts it)


def test_fed_peak_counts_its_capacity_as_keys_and_values() -> None:
    cap = 2000
    A = ej.sparse_input("A", (N, N), nnz=cap, dtype="float32")
    h = ej.input("h", (N, K), "float32")
    prog = ej.compile(ej.einsum("ij,jk->ik", A, h), memory_limit="1MiB")
    assert len(_kernels(prog)) == 1
    entries = cap * (2 * 8 + 4)  # the keys input (cap, 2) int64 and the values input (cap,) float32
    dense = N * K * 4
    # inputs h, keys, values; the output; the scratch (each input's bytes again: the run's copies)
    assert prog.taskgraph.memory.peak_bytes_per_device[0] == (dense + entries) + dense + (dense + entries)
    a = _adjacency(seed=1)
    assert a.nnz <= cap
    hv = np.random.default_rng(0).normal(size=(N, K)).astype(np.float32)
    np.testing.assert_allclose(prog.run(A=a, h=hv), a.toarray() @ hv, rtol=1e-4, atol=1e-5)


def test_a_cap_fitting_the_entries_but_not_the_dense_size_compiles_and_runs() -> None:
    a = _adjacency(density=0.02)
    A = ej.sparse("A", a)
    h = ej.input("h", (N, K), "float32")
    w = ej.input("w", (K, K), "float32")
    cap = 96 * 1024
    assert A.nnz * (2 * 8 + 4) < cap < N * N * 4  # 64 KB of entries; a dense A is 640 KB
    prog = ej.compile(ej.relu(ej.einsum("ij,jk->ik", A, h @ w)), memory_limit=cap)
    peak = prog.taskgraph.memory.peak_bytes_per_device[0]
    stored = max(t.scratch for t in _kernels(prog) if t.node.kind == "sparseeinsum")
    assert peak <= cap and stored >= A.nnz * 20  # the one kernel holds every entry
    rng = np.random.default_rng(1)
    hv, wv = rng.normal(size=(N, K)).astype(np.float32), rng.normal(size=(K, K)).astype(np.float32)
    want = np.maximum(a.toarray() @ (hv @ wv), 0)
    np.testing.assert_allclose(prog.run(h=hv, w=wv), want, rtol=1e-4, atol=1e-4)


def test_a_cap_below_the_entries_is_cut_by_rows_and_still_counts_them() -> None:
    # 64 KB of entries under a 40 KiB cap: the planner cuts A's rows so each kernel holds its
    # rows' entries only, and every kernel's scratch counts the entries of its rows
    a = _adjacency(density=0.02)
    A = ej.sparse("A", a)
    h = ej.input("h", (N, K), "float32")
    prog = ej.compile(ej.einsum("ij,jk->ik", A, h), memory_limit="40KiB")
    kernels = _kernels(prog)
    assert len(kernels) > 1 and prog.taskgraph.memory.peak_bytes_per_device[0] <= 40 * 1024
    rows = a.tocsr()
    for t in kernels:
        d = prog.decomps[t.node]
        lo, hi = d.out_partition.box(d.kernels[t.payload.kernel].out_key)[0]
        assert hi - lo < N  # A's rows are cut
        entries = int(rows.indptr[hi] - rows.indptr[lo])  # the stored entries in its rows
        assert t.scratch >= entries * (2 * 8 + 4)
    hv = np.random.default_rng(2).normal(size=(N, K)).astype(np.float32)
    np.testing.assert_allclose(prog.run(h=hv), a.toarray() @ hv, rtol=1e-4, atol=1e-5)


def test_a_cap_no_cut_fits_is_refused_naming_the_op() -> None:
    A = ej.sparse("A", _adjacency())
    h = ej.input("h", (N, K), "float32")
    with pytest.raises(MemoryCapError, match="sparse") as info:
        ej.compile(ej.einsum("ij,jk->ik", A, h), memory_limit="2KiB")
    assert info.value.cap == 2048 and info.value.needed > 2048
