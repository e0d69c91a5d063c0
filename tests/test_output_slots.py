"""Outputs assembled in place (einjoin/runtime/outputs.py) and loads of column blocks as views
(einjoin/plan/execute.py's load): the same bits as assembling after the run, never an alias of
a feed, and the in-place paths really taken."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import einjoin as ej
import einjoin.runtime.local as local
from einjoin.exchange import TaskKind
from einjoin.runtime.outputs import OutputPlan, output_plan


def _no_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The session without output slots: every output assembled after the run (as before)."""
    monkeypatch.setattr(local, "output_plan", lambda e: OutputPlan((None,) * len(e.tg.outputs), {}, frozenset()))


def _matmul(n: int = 512) -> tuple[Any, ej.Program, dict[str, np.ndarray]]:
    a, b = ej.input("a", (n, n)), ej.input("b", (n, n))
    y = a @ b
    prog = ej.compile(y, devices=2, backend="threads", quiet=True)
    rng = np.random.default_rng(0)
    return y, prog, {"a": rng.standard_normal((n, n), dtype=np.float32),
                     "b": rng.standard_normal((n, n), dtype=np.float32)}


def test_a_split_matmul_computes_into_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    _, prog, feeds = _matmul()
    plan = output_plan(prog._engine)
    (lay,) = plan.layouts
    assert lay is not None and len(lay[2]) == 2  # two blocks, each a slot
    assert len(plan.into) == 2  # both kernels write into their slots
    calls: list[bool] = []
    for tid, fn in list(plan.into.items()):
        def spy(blocks: Any, out: np.ndarray, fn: Any = fn) -> bool:
            calls.append(fn(blocks, out))
            return calls[-1]
        monkeypatch.setitem(plan.into, tid, spy)  # type: ignore[index]
    got = prog.run(**feeds)
    assert calls == [True, True]
    assert prog.run_stats.bytes_fetched == got.nbytes
    monkeypatch.undo()
    _no_slots(monkeypatch)
    want = prog.run(**feeds)
    np.testing.assert_array_equal(got, want)  # the same BLAS call, bit for bit
    np.testing.assert_allclose(got, feeds["a"] @ feeds["b"], rtol=1e-4, atol=1e-3)


def test_column_blocks_of_a_c_ordered_feed_are_loaded_as_views() -> None:
    _, prog, feeds = _matmul()
    loads = [t for t in prog.taskgraph.tasks if t.kind is TaskKind.LOAD]
    seen = []
    orig = local.compute

    def spy(t: Any, *args: Any, **kw: Any) -> Any:
        out = orig(t, *args, **kw)
        if t.kind is TaskKind.LOAD:
            seen.append((t.payload.box, np.shares_memory(out, feeds[t.node.op.name])))
        return out
    local.compute = spy
    try:
        prog.run(**feeds)
        # a Fortran-ordered feed: its blocks are copied to C order (and the result is the same)
        fortran = {k: np.asfortranarray(v) for k, v in feeds.items()}
        got = prog.run(**fortran)
    finally:
        local.compute = orig
    assert len(seen) == 2 * len(loads)
    assert all(view for _, view in seen[:len(loads)])
    assert not any(view for _, view in seen[len(loads):])
    np.testing.assert_array_equal(got, prog.run(**feeds))


def test_an_input_returned_in_blocks_never_aliases_the_feed() -> None:
    x = ej.input("x", (64, 32))
    prog = ej.compile([x, x * 2.0], devices=2, backend="threads", planner="split_largest", quiet=True)
    assert any(lay is not None for lay in output_plan(prog._engine).layouts)
    xv = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    a, b = prog.run(x=xv)
    assert not np.shares_memory(a, xv)
    np.testing.assert_array_equal(a, xv)
    np.testing.assert_array_equal(b, xv * 2)
    a[:] = 0  # the caller's array: writing it changes nothing of the next run
    np.testing.assert_array_equal(prog.run(x=xv)[0], xv)


def test_an_output_twice_is_assembled_as_before() -> None:
    x = ej.input("x", (64, 32))
    y = x * 3.0
    prog = ej.compile([y, y], devices=2, backend="threads", planner="split_largest", quiet=True)
    assert output_plan(prog._engine).layouts == (None, None)
    xv = np.ones((64, 32), np.float32)
    a, b = prog.run(x=xv)
    assert a is not b and not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, 3 * xv)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from([(96, 200, 64), (300, 128, 260), (257, 64, 511)]), st.integers(1, 3),
       st.sampled_from(["threads", "sync"]), st.booleans(), st.sampled_from(["float32", "float64"]))
def test_outputs_in_slots_equal_the_assembled_ones(shape: tuple[int, int, int], devices: int, backend: str,
                                                   transposed: bool, dtype: str) -> None:
    # a matmul (in place where its blocks allow, the transposed result copied), an elementwise
    # op on it (copied into its slot), and a sum over rows (reduced): every output equals the
    # run without slots, bit for bit
    m, k, n = shape
    a, b = ej.input("a", (m, k), dtype), ej.input("b", (k, n), dtype)
    y = ej.einsum("mk,kn->nm", a, b) if transposed else a @ b
    outs = [y, ej.tanh(y), y.sum(dim=0)]
    prog = ej.compile(outs, devices=devices, backend=backend, planner="split_largest", quiet=True)
    rng = np.random.default_rng(m + n)
    feeds = {"a": rng.standard_normal((m, k)).astype(dtype), "b": rng.standard_normal((k, n)).astype(dtype)}
    got = prog.run(**feeds)
    with pytest.MonkeyPatch.context() as mp:
        _no_slots(mp)
        want = prog.run(**feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ref = ej.reference(outs, **feeds)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("late_dtype", [None, np.float64])
def test_a_block_not_in_its_slot_is_copied_at_the_end_or_the_output_assembled(monkeypatch: pytest.MonkeyPatch,
                                                                              late_dtype: Any) -> None:
    # blocks that never landed (as any block of another shape or dtype than its slot's): copied
    # into the output at the end; one of another dtype: the output assembled from its blocks as
    # before the slots (its dtype then the blocks')
    from einjoin.runtime.outputs import OutputSlots
    monkeypatch.setattr(OutputSlots, "land", lambda self, value, view: value if late_dtype is None
                        else np.asarray(value, late_dtype))
    x = ej.input("x", (64, 32))
    prog = ej.compile(x * 2.0, devices=2, backend="threads", planner="split_largest", quiet=True)
    xv = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    got = prog.run(x=xv)
    np.testing.assert_array_equal(got, xv * 2)
    assert got.dtype == (late_dtype or np.float32)


@pytest.mark.parametrize("devices", [1, 2])
def test_no_result_shares_memory_with_another(devices: int) -> None:
    # an output and a reshape / transpose / slice of it were views of one block on one device:
    # writing one result changed another (R1's finding, older than the slots)
    a, b = ej.input("a", (12, 8)), ej.input("b", (8, 6))
    y = a @ b
    outs = [y, y.T, y.reshape((72,)), y[:, :3]]
    prog = ej.compile(outs, devices=devices, quiet=True)
    rng = np.random.default_rng(0)
    av, bv = rng.standard_normal((12, 8)).astype(np.float32), rng.standard_normal((8, 6)).astype(np.float32)
    got = prog.run(a=av, b=bv)
    for i in range(len(got)):
        for j in range(i + 1, len(got)):
            assert not np.shares_memory(got[i], got[j]), (i, j)
    got[0][...] = 0
    for g, w in zip(got[1:], ej.reference(outs, a=av, b=bv)[1:]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
