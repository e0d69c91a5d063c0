"""The local backends' fast paths (issue 22, per-task overhead): einsum kernels prepared once per
task (:mod:`einjoin.runtime.fastkernels`) compute the same bits as the general path (the
reference executor, which never takes it), and fall back on blocks they were not prepared for;
the inline worker (sync, null, a one-device threads run) runs every task once, after its
dependencies, in any ready-queue order, on the caller's thread."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.exchange import TaskKind
from einjoin.plan.execute import run_reference
from einjoin.runtime.engine import CancelToken
from einjoin.runtime.fastkernels import prepare_kernels

RNG = np.random.default_rng(7)


def _graphs() -> dict[str, Any]:
    """name -> (outputs builder, feeds): einsums of every route the prepared kernels take."""
    def f32(*shape: int) -> np.ndarray:
        return RNG.standard_normal(shape).astype(np.float32)

    def build_elementwise() -> Any:
        x, b = ej.input("x", (8, 12)), ej.input("b", (12,))
        return [ej.tanh(x * 1.5 + b) - x, (x * x).sum(dim=1), ej.maximum(x, 0.0).max(dim=0)]

    def build_matmul() -> Any:
        a, w = ej.input("a", (4, 8, 6)), ej.input("w", (6, 10))
        # and a weight gradient's shape (two contracted labels), products with nothing contracted
        return [ej.einsum("bij,jk->bik", a, w), ej.einsum("bij,jk->kbi", a, w), ej.einsum("bij,bij->ji", a, a),
                ej.einsum("bij,bik->kj", a, a), ej.einsum("bij,jk->bkij", a, w), ej.einsum("bij,bij->jbi", a, a)]

    def build_broadcast_join() -> Any:
        x, y = ej.input("x", (6, 5)), ej.input("y", (5, 7))
        # joins that ignore an input or an outer product: the broadcast and aggregation steps
        return [ej.einsum("ij,jk->ik", x, y, join="exp(x0 * 0.1)", agg="max"),
                ej.einsum("ij,jk->ijk", x, y, join="x0 - x1", agg=None)]

    def build_int() -> Any:
        n = ej.input("n", (6, 4), dtype="int64")
        return [(n * 3).sum(dim=0), ej.einsum("ij,ij->i", n, n)]

    def build_one_input() -> Any:
        # one-input einsums (a transposed copy, sums) and reshapes (views of a region)
        x, n = ej.input("x", (4, 6, 8)), ej.input("n", (6, 4), dtype="int64")
        return [ej.einsum("abc->cab", x), ej.einsum("abc->ca", x), ej.einsum("ij->j", n),
                x.reshape(24, 8) * 2.0, x.reshape(4, 48).sum(dim=1)]

    return {
        "one_input": (build_one_input, dict(x=f32(4, 6, 8), n=RNG.integers(-5, 5, (6, 4)).astype(np.int64))),
        "elementwise": (build_elementwise, dict(x=f32(8, 12), b=f32(12))),
        "matmul": (build_matmul, dict(a=f32(4, 8, 6), w=f32(6, 10))),
        "broadcast_join": (build_broadcast_join, dict(x=f32(6, 5), y=f32(5, 7))),
        "int": (build_int, dict(n=RNG.integers(-5, 5, (6, 4)).astype(np.int64))),
    }


GRAPHS = _graphs()


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_prepared_kernels_give_the_general_paths_bits(name: str, devices: int) -> None:
    build, feeds = GRAPHS[name]
    prog = ej.compile(build(), devices, backend="sync", fuse=False, quiet=True)
    fast = prepare_kernels(prog.taskgraph, prog.plan.decomps)
    assert any(f is not None for f in fast), "no kernel took the prepared path"
    ours = prog.run(**feeds)
    by_name = prog.graph.input_by_name
    ref = run_reference(prog.taskgraph, prog.plan.decomps, {by_name[k]: v for k, v in feeds.items()})
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=True)  # the same numpy calls: the same bits
    # and the threads backend (another BLAS share: close, not necessarily the same bits)
    threads = ej.compile(build(), devices, backend="threads", fuse=False, quiet=True).run(**feeds)
    for a, b in zip(threads, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_one_input_einsums_and_reshapes_are_prepared(devices: int) -> None:
    build, _ = GRAPHS["one_input"]
    prog = ej.compile(build(), devices, backend="sync", fuse=False, quiet=True)
    fast = prepare_kernels(prog.taskgraph, prog.plan.decomps)
    kinds = {t.node.kind for t in prog.taskgraph.tasks
             if t.kind is TaskKind.KERNEL and fast[t.id] is None and t.node.kind in ("einsum", "reshape")}
    assert not kinds, f"general path for {kinds}"


def test_a_prepared_kernel_refuses_blocks_it_was_not_prepared_for() -> None:
    x = ej.input("x", (4, 6))
    prog = ej.compile([ej.tanh(x) * 2.0], 1, backend="sync", fuse=False, quiet=True)
    tg = prog.taskgraph
    fast = prepare_kernels(tg, prog.plan.decomps)
    t = next(t for t in tg.tasks if t.kind is TaskKind.KERNEL and fast[t.id] is not None)
    block = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    out = fast[t.id]([block])
    assert out is not None and out.dtype == np.float32 and out.shape == (4, 6)
    assert fast[t.id]([block.astype(np.float64)]) is None   # another dtype
    assert fast[t.id]([block[:2]]) is None                  # another shape
    assert fast[t.id]([block.tolist()]) is None             # not an array
    np.testing.assert_allclose(prog.run(x=block)[0], np.tanh(block) * 2.0, rtol=1e-6)


@pytest.mark.parametrize("order", ["fifo", "lifo", "priority", "random"])
@pytest.mark.parametrize("backend", ["sync", "null"])
def test_inline_runs_every_task_once_after_its_dependencies(order: str, backend: str) -> None:
    build, feeds = GRAPHS["elementwise"]
    prog = ej.compile(build(), 2, backend=backend, fuse=False, quiet=True)
    tg = prog.taskgraph
    seen: list[int] = []

    class Order:
        def on_start(self, task: Any) -> None:
            seen.append(task.id)

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass
    outs = {}
    for seed in (0, 1):
        seen.clear()
        outs[seed] = prog.run(**feeds, order=order, seed=seed, callbacks=[Order()])
        assert sorted(seen) == list(range(len(tg.tasks)))
        at = {tid: i for i, tid in enumerate(seen)}
        assert all(at[d] < at[t.id] for t in tg.tasks for d in t.deps)
        stats = prog.run_stats
        assert stats.tasks_run == len(tg.tasks)
        assert sum(len(iv) for iv in stats.intervals.values()) == len(tg.tasks)
        # the callbacks' order is the recorded intervals' order
        starts = sorted((s, tid) for iv in stats.intervals.values() for s, _, tid in iv)
        assert [tid for _, tid in starts] == seen
    if backend == "sync":
        for a, b in zip(outs[0], outs[1]):
            np.testing.assert_array_equal(a, b)


def test_a_one_device_threads_run_runs_on_the_callers_thread() -> None:
    build, feeds = GRAPHS["matmul"]
    prog = ej.compile(build(), 1, backend="threads", fuse=False, quiet=True)
    threads: set[Any] = set()

    class Where:
        def on_start(self, task: Any) -> None:
            threads.add(threading.current_thread())

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass
    before = threading.active_count()
    out = prog.run(**feeds, callbacks=[Where()])
    assert threads == {threading.current_thread()}
    assert threading.active_count() == before
    ref = ej.compile(build(), 1, backend="sync", fuse=False, quiet=True).run(**feeds)
    for a, b in zip(out, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # under a memory cap a device has a host-transfer lane too: two lanes, two worker threads
    capped = ej.compile(build(), 1, backend="threads", fuse=False, quiet=True,
                        memory_limit=prog.stats.peak_bytes_per_device[0] // 2 + 1)
    threads.clear()
    for a, b in zip(capped.run(**feeds, callbacks=[Where()]), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert threading.current_thread() not in threads


def test_cancel_from_another_thread_stops_an_inline_run() -> None:
    build, feeds = GRAPHS["elementwise"]
    prog = ej.compile(build(), 2, backend="sync", fuse=False, quiet=True)
    n = len(prog.taskgraph.tasks)
    tok = CancelToken()
    release = threading.Event()
    count = [0]

    class Stall:
        def on_start(self, task: Any) -> None:
            count[0] += 1
            if count[0] == 3:  # the third task waits until the token was cancelled elsewhere
                threading.Thread(target=lambda: (tok.cancel(), release.set())).start()
                assert release.wait(30)

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass
    with pytest.raises(ej.EinjoinError, match=rf"run cancelled with {n - 3} of {n} tasks left"):
        prog.run(**feeds, cancel=tok, callbacks=[Stall()])
    np.testing.assert_allclose(prog.run(**feeds)[1], (feeds["x"] ** 2).sum(axis=1), rtol=1e-5)


def test_a_run_that_changes_no_blas_limit_starts_no_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The BLAS limiter counts a run in and out on the caller's thread when no library's limit
    would change (one device: its share is every core); a share that differs still goes through
    the helper, and the limits are the original ones after either run."""
    from threadpoolctl import ThreadpoolController

    from einjoin.runtime.backends import BLAS_LIMITER, BlasLimiter
    build, feeds = GRAPHS["matmul"]
    one = ej.compile(build(), 1, backend="threads", fuse=False, quiet=True)
    one.run(**feeds)  # the first run: the helper finds the libraries
    blas = [lc for lc in ThreadpoolController().lib_controllers if lc.user_api == "blas"]
    before = [lc.num_threads for lc in blas]
    calls: list[bool] = []
    real = BlasLimiter._apply

    def counted(self: Any, ticket: Any, entering: bool) -> None:
        calls.append(entering)
        real(self, ticket, entering)
    monkeypatch.setattr(BlasLimiter, "_apply", counted)
    inside: list[list[int]] = []

    class Limits:
        def on_start(self, task: Any) -> None:
            if not inside:
                inside.append([lc.num_threads for lc in blas])

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass
    if any(n != BlasLimiter._share(1) for n in before):
        pytest.skip("the BLAS libraries are not at all the cores here: a one-device run changes them")
    for _ in range(3):
        one.run(**feeds, callbacks=[Limits()])
    assert calls == [] and BLAS_LIMITER.devices_in_flight == 0
    assert inside == [[BlasLimiter._share(1)] * len(blas)]
    assert [lc.num_threads for lc in blas] == before
    two = ej.compile(build(), 2, backend="threads", fuse=False, quiet=True)
    two.run(**feeds)
    if BlasLimiter._share(2) != BlasLimiter._share(1):
        assert calls == [True, False]  # the share changes: set on the way in, restored on the way out
    assert [lc.num_threads for lc in blas] == before
