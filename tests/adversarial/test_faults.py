"""Fault injection on the local backends (issue 16): a kernel raising mid-run, a trace written to
a full disk, Ctrl-C in the middle of a run.

- a kernel that raises names its task (id, kernel, op, device), stops every worker, and the same
  program then runs again correctly;
- a finished run whose trace cannot be written (``/dev/full``: every write fails with ENOSPC)
  returns its results and warns (:class:`einjoin.program.TraceWriteWarning`); a failed run whose
  trace cannot be written raises its own error, with a note about the trace;
- a ``KeyboardInterrupt`` raised inside a kernel propagates as it is.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import einjoin as ej
import einjoin.runtime.local as local_mod  # where the local backends look up compute
from einjoin.exchange import TaskKind
from einjoin.program import TraceWriteWarning

F32 = dict(rtol=1e-5, atol=1e-5)
BACKENDS = ["threads", "sync"]


def rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def chain(backend: str, devices: int = 4) -> tuple[Any, Any, dict[str, np.ndarray]]:
    x = ej.input("x", (32, 24))
    w = ej.input("w", (24, 24))
    h = ej.gelu(x @ w)
    out = ej.softmax(h @ w)
    prog = ej.compile(out, devices=devices, backend=backend)
    return prog, out, {"x": rand((32, 24), 1), "w": rand((24, 24), 2)}


class FailingKernel:
    """A fault for the engine's ``compute``: the ``at``-th kernel task raises ``exc``."""

    def __init__(self, at: int, exc: BaseException):
        self.at, self.exc = at, exc
        self.lock = threading.Lock()
        self.kernels = 0
        self.failed: Any = None

    def around(self, real: Any) -> Any:
        """``real`` with this fault (its count shared by every function it wraps)."""
        def call(t: Any, *args: Any, **kw: Any) -> Any:
            if t.kind is TaskKind.KERNEL:
                with self.lock:
                    self.kernels += 1
                    hit = self.kernels == self.at
                    if hit:
                        self.failed = t
                if hit:
                    raise self.exc
            return real(t, *args, **kw)
        return call


def patch_compute(monkeypatch: pytest.MonkeyPatch, wrap: Any) -> None:
    """The local backends compute a task with ``compute``: wrapped (``wrap(real)``)."""
    monkeypatch.setattr(local_mod, "compute", wrap(local_mod.compute))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_raising_mid_run_names_the_task_and_the_program_runs_again(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prog, out, feeds = chain(backend)
    n_kernels = sum(t.kind is TaskKind.KERNEL for t in prog.taskgraph.tasks)
    assert n_kernels >= 6
    fault = FailingKernel(at=n_kernels // 2, exc=FloatingPointError("injected"))
    patch_compute(monkeypatch, fault.around)
    before = threading.active_count()
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(**feeds)
    msg = str(info.value)
    t = fault.failed
    for frag in (f"task #{t.id}", f"kernel {t.payload.kernel}", f"device {t.device}", "FloatingPointError", "injected"):
        assert frag in msg, (frag, msg)
    assert isinstance(info.value.__cause__, FloatingPointError)
    assert all(t.name.startswith("einjoin-dev") for t in threading.enumerate()[before:])  # its idle workers
    prog.close()  # which end with it
    assert threading.active_count() == before, threading.enumerate()
    monkeypatch.undo()
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), **F32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_keyboard_interrupt_inside_a_kernel_is_not_wrapped(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prog, out, feeds = chain(backend)
    patch_compute(monkeypatch, FailingKernel(at=2, exc=KeyboardInterrupt()).around)
    with pytest.raises(KeyboardInterrupt) as info:
        prog.run(**feeds)
    assert type(info.value) is KeyboardInterrupt
    monkeypatch.undo()
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), **F32)


def test_concurrent_run_survives_a_neighbour_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing run stops its own workers only: a run of the same program at the same time ends
    with the right result."""
    prog, out, feeds = chain("threads")
    mark = np.float32(12345.0)
    feeds["x"][0, 0] = mark  # tells the failing run's feeds apart inside compute
    other = {"x": rand((32, 24), 3), "w": rand((24, 24), 4)}
    started = threading.Event()

    def failing(real: Any) -> Any:
        def compute(t: Any, get: Any, fd: Any, *args: Any, **kw: Any) -> Any:
            # the run fed with the mark fails at its first kernel, once the other run is under way
            if t.kind is TaskKind.KERNEL and any(v.size and v.flat[0] == mark for v in fd.values()):
                assert started.wait(30)
                raise RuntimeError("injected")
            return real(t, get, fd, *args, **kw)
        return compute

    class Started:
        def on_start(self, task: Any) -> None:
            started.set()

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass

    patch_compute(monkeypatch, failing)
    bad = prog.run_async(**feeds)
    good = prog.run_async(**other, callbacks=[Started()])
    with pytest.raises(ej.EinjoinError, match="injected"):
        bad.result(timeout=60)
    np.testing.assert_allclose(good.result(timeout=60), ej.reference(out, **other), **F32)


# ---------------------------------------------------------------- traces on a full disk


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


@needs_dev_full
@pytest.mark.parametrize("backend", BACKENDS)
def test_trace_to_a_full_disk_keeps_the_results(backend: str) -> None:
    prog, out, feeds = chain(backend)
    with pytest.warns(TraceWriteWarning, match="/dev/full"):
        got = prog.run(**feeds, trace="/dev/full")
    np.testing.assert_allclose(got, ej.reference(out, **feeds), **F32)
    assert prog.run_stats is not None and prog.run_stats.tasks_run == len(prog.taskgraph)


@needs_dev_full
def test_failed_run_with_trace_to_a_full_disk_raises_the_runs_error(monkeypatch: pytest.MonkeyPatch) -> None:
    prog, out, feeds = chain("threads")
    patch_compute(monkeypatch, FailingKernel(at=3, exc=ValueError("boom")).around)
    with pytest.raises(ej.EinjoinError, match="boom") as info:
        prog.run(**feeds, trace="/dev/full")
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "trace" in notes and "/dev/full" in notes, notes


def test_cancelled_run_still_writes_its_trace(tmp_path: Any) -> None:
    import json
    prog, out, feeds = chain("threads")

    class CancelAtThird:
        def __init__(self) -> None:
            self.n = 0
            self.lock = threading.Lock()

        def on_start(self, task: Any) -> None:
            with self.lock:
                self.n += 1
                if self.n == 3:
                    prog.cancel()

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass

    path = tmp_path / "cancelled" / "run.json"
    with pytest.raises(ej.EinjoinError, match="run cancelled"):
        prog.run(**feeds, trace=path, callbacks=[CancelAtThird()])
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert 3 <= len(events) < len(prog.taskgraph)


# ---------------------------------------------------------------- Ctrl-C: run() outlives its workers


def test_sigint_while_a_task_runs_returns_only_after_every_worker_ended() -> None:
    """Review 9, item 2: a real Ctrl-C while ``run()`` waited for its workers returned at once
    (an interrupt inside ``Thread.join`` marks the live thread stopped, CPython bpo-45274) and a
    worker went on running its task after ``run()`` had raised. Now the interrupt stops the
    workers, ``run()`` waits for the task in flight to end, then raises KeyboardInterrupt."""
    import signal
    import time
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's KeyboardInterrupt here")
    prog, out, feeds = chain("threads", devices=2)
    inside = threading.Event()

    class SlowKernel:
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.in_flight = 0
            self.ended_after_return = 0
            self.returned = False

        def on_start(self, task: Any) -> None:
            with self.lock:
                self.in_flight += 1
            if task.kind is TaskKind.KERNEL and not inside.is_set():
                inside.set()
                time.sleep(0.5)  # the Ctrl-C lands meanwhile

        def on_end(self, task: Any, start: float, end: float) -> None:
            with self.lock:
                self.in_flight -= 1
                self.ended_after_return += self.returned

    cb = SlowKernel()
    main = threading.main_thread().ident

    def interrupt() -> None:
        if inside.wait(30):
            time.sleep(0.05)  # the main thread is waiting for the workers by now
            signal.pthread_kill(main, signal.SIGINT)
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        try:
            prog.run(**feeds, callbacks=[cb])
        finally:
            with cb.lock:
                in_flight_at_return, cb.returned = cb.in_flight, True
    while sender.is_alive():
        time.sleep(0.01)
    time.sleep(0.6)  # a worker left behind would end its task now
    assert in_flight_at_return == 0, "run() returned while a worker still ran a task"
    assert cb.ended_after_return == 0
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), **F32)


# ---------------------------------------------------------------- trace warnings, handles


def test_trace_failure_on_a_failed_run_without_add_note_warns(tmp_path: Any) -> None:
    """Review 9, item 9: ``BaseException.add_note`` is Python >= 3.11 (the project supports
    3.10): a failed run whose trace could not be written raised AttributeError there. Such an
    error (emulated by one whose ``add_note`` is not callable) gets a TraceWriteWarning instead,
    and stays the error."""
    from einjoin.program import Program

    class Recorder:
        def write(self, path: Any) -> None:
            raise OSError(28, "No space left on device")

    class OldError(Exception):
        add_note = None  # as on Python 3.10

    err = OldError("the run's own failure")
    with pytest.warns(TraceWriteWarning, match="could not be written.*the run failed: OldError"):
        Program._write_trace(Recorder(), tmp_path / "t.json", err)
    assert not getattr(err, "__notes__", None)


@needs_dev_full
def test_run_async_trace_warning_comes_from_result_on_the_callers_line() -> None:
    """Review 9: the warning of a run_async run was issued on the run's thread with the stack
    level of ``run()``, pointing into threading's internals (and a ``catch_warnings`` of the
    caller's thread could not see it reliably). ``result()`` issues it now, at the caller's
    line."""
    prog, out, feeds = chain("threads")
    h = prog.run_async(**feeds, trace="/dev/full")
    with pytest.warns(TraceWriteWarning, match="/dev/full") as rec:
        got = h.result(timeout=60)
    np.testing.assert_allclose(got, ej.reference(out, **feeds), **F32)
    assert [w.filename for w in rec.list if w.category is TraceWriteWarning] == [__file__]


def test_run_handle_result_raises_the_same_error_without_growing_its_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 9: each ``result()`` call re-raised the one exception object, and every raise
    added the caller's frames to its traceback."""
    prog, out, feeds = chain("threads")
    patch_compute(monkeypatch, FailingKernel(at=1, exc=ValueError("boom")).around)
    h = prog.run_async(**feeds)
    depths = []
    for _ in range(3):
        with pytest.raises(ej.EinjoinError, match="boom") as info:
            h.result(timeout=60)
        tb, n = info.value.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        depths.append(n)
    assert depths[0] == depths[1] == depths[2], depths
