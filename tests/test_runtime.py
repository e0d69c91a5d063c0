"""The runtime through ``ej.compile`` / ``Program.run``: real overlap of device threads, failures
(from callbacks and from kernels), bad feeds rejected before any task runs, compile-time errors,
cancellation, torch/numpy in and out, ``explain`` and plan stats, and golden exchange byte counts.

Every byte count asserted in the exchange section is derived by hand in the test from the shapes,
the forced specs and the round-robin placement; both the plan (``prog.stats``) and the run
(``prog.run_stats``) must agree with it.

A known bug gets its case marked ``xfail(strict=True)`` with the reason, until it is fixed.
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.exchange import TaskKind
from einjoin.ir.printing import describe

F32 = dict(rtol=1e-5, atol=1e-5)
BACKENDS = ["threads", "sync"]


# ---------------------------------------------------------------- helpers


class Recorder:
    """Records every task started (thread-safe: device threads call it concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[Any] = []
        self.ended: list[Any] = []

    def on_start(self, task: Any) -> None:
        with self.lock:
            self.started.append(task)

    def on_end(self, task: Any, start: float, end: float) -> None:
        with self.lock:
            self.ended.append(task)


class FailFirstKernel(Recorder):
    """Raises RuntimeError when the first kernel task starts; remembers that task."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: Any = None

    def on_start(self, task: Any) -> None:
        super().on_start(task)
        if task.kind is TaskKind.KERNEL:
            with self.lock:
                if self.failed is None:
                    self.failed = task
                    raise RuntimeError("injected failure")


class CancelOnThird(Recorder):
    def __init__(self, prog: Any) -> None:
        super().__init__()
        self.prog = prog

    def on_start(self, task: Any) -> None:
        super().on_start(task)
        with self.lock:
            n = len(self.started)
        if n == 3:
            self.prog.cancel()


def rand(shape: tuple[int, ...], seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def softmax_program(backend: str, devices: int = 4) -> tuple[Any, Any, dict[str, np.ndarray]]:
    x = ej.input("x", (64, 32))
    w = ej.input("w", (32, 16))
    z = x @ w
    out = ej.softmax(z)
    prog = ej.compile(out, devices=devices, backend=backend, specs={z: {"m": 2, "k": 2}})
    feeds = {"x": rand((64, 32), 1), "w": rand((32, 16), 2)}
    return prog, out, feeds


def threads_now() -> int:
    return len(threading.enumerate())


def closed_threads(prog: Any, before: int) -> int:
    """The threads left after a run are the program's own worker threads (idle, reused by its
    next run: einjoin.runtime.workers) and nothing else; ``prog.close()`` ends them. Returns the
    thread count after the close (a later run starts the workers again)."""
    extra = [t for t in threading.enumerate()][before:]
    assert all(t.daemon and t.name.startswith("einjoin-") for t in extra), extra
    prog.close()
    return threads_now()


# ---------------------------------------------------------------- 1. overlap


def test_threads_backend_overlaps_devices() -> None:
    x = ej.input("x", (512, 512), "float64")
    w = ej.input("w", (512, 512), "float64")
    z = x @ w
    prog = ej.compile(z, devices=2, backend="threads", specs={z: {"m": 2}}, placement="round_robin")
    xv, wv = rand((512, 512), 3, np.float64), rand((512, 512), 4, np.float64)
    kernel_ids = {t.id for t in prog.taskgraph.tasks if t.kind is TaskKind.KERNEL}
    assert {prog.taskgraph.tasks[i].device for i in kernel_ids} == {0, 1}

    def overlapped() -> bool:
        iv = prog.run_stats.intervals
        k0 = [(a, b) for a, b, tid in iv[0] if tid in kernel_ids]
        k1 = [(a, b) for a, b, tid in iv[1] if tid in kernel_ids]
        assert k0 and k1
        return any(a0 < b1 and a1 < b0 for a0, b0 in k0 for a1, b1 in k1)

    seen = False
    for _ in range(6):
        out = prog.run(xv, wv)
        np.testing.assert_allclose(out, xv @ wv, rtol=1e-10, atol=1e-9)
        if overlapped():
            seen = True
            break
    assert seen, f"kernel intervals never overlapped: {prog.run_stats.intervals}"


def test_sync_backend_never_overlaps() -> None:
    """The control: one inline worker means no two intervals intersect (so the overlap check
    above is not vacuous)."""
    x = ej.input("x", (128, 128), "float64")
    w = ej.input("w", (128, 128), "float64")
    z = x @ w
    prog = ej.compile(z, devices=2, backend="sync", specs={z: {"m": 2}})
    prog.run(rand((128, 128), 3, np.float64), rand((128, 128), 4, np.float64))
    allv = sorted((a, b) for iv in prog.run_stats.intervals.values() for a, b, _ in iv)
    assert len(allv) == len(prog.taskgraph)
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(allv, allv[1:]))


# ---------------------------------------------------------------- 2. failure injection


@pytest.mark.parametrize("backend", BACKENDS)
def test_callback_failure_names_task_and_run_recovers(backend: str) -> None:
    prog, out, feeds = softmax_program(backend)
    before = threads_now()
    cb = FailFirstKernel()
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(callbacks=[cb], **feeds)
    t = cb.failed
    assert t is not None and t.kind is TaskKind.KERNEL
    msg = str(info.value)
    assert f"task #{t.id}" in msg, msg
    assert "kernel" in msg and "einsum" in msg, msg
    assert f"device {t.device}" in msg, msg
    assert "injected failure" in msg and "RuntimeError" in msg, msg
    assert isinstance(info.value.__cause__, RuntimeError)
    assert closed_threads(prog, before) == before, threading.enumerate()
    # the program is reusable: the next run completes and is right
    got = prog.run(**feeds)
    np.testing.assert_allclose(got, ej.reference(out, **feeds), **F32)
    got2 = prog.run(feeds["x"], feeds["w"], callbacks=[Recorder()])
    np.testing.assert_allclose(got2, ej.reference(out, **feeds), **F32)
    assert closed_threads(prog, before) == before


# ---------------------------------------------------------------- 3. kernel error


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_error_out_of_range_gather(backend: str) -> None:
    table = ej.input("table", (6, 3))
    idx = ej.input("idx", (4,), "int64")
    g = ej.gather(table, idx)
    prog = ej.compile(g, devices=2, backend=backend, specs={g: {"a": 2}})
    tv = rand((6, 3), 5)
    before = threads_now()
    rec = Recorder()
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(tv, np.array([0, 1, 2, 9], np.int64), callbacks=[rec])
    msg = str(info.value)
    m = re.search(r"task #(\d+)", msg)
    assert m, msg
    task = prog.taskgraph.tasks[int(m.group(1))]
    assert task.kind is TaskKind.KERNEL and task.node is g.node, (task, msg)
    assert task in rec.started
    assert "gather" in msg and f"device {task.device}" in msg, msg
    assert "out of range" in msg and re.search(r"\b9\b", msg), msg
    assert closed_threads(prog, before) == before, threading.enumerate()
    good = np.array([5, 0, 3, 3], np.int64)
    np.testing.assert_allclose(prog.run(tv, good), tv[good], **F32)


# ---------------------------------------------------------------- 4. bad feeds


def _feed_prog() -> Any:
    x = ej.input("x", (4, 3))
    ids = ej.input("ids", (2,), "int64")
    return ej.compile(ej.gather(x, ids) * 2.0, devices=2, backend="threads")


X_OK = np.ones((4, 3), np.float32)
IDS_OK = np.array([0, 3], np.int64)

BAD_FEEDS = [
    ("missing", (), dict(x=X_OK), ["ids"]),
    ("unknown-name", (), dict(x=X_OK, ids=IDS_OK, idz=IDS_OK), ["idz"]),
    ("wrong-shape", (), dict(x=np.ones((3, 4), np.float32), ids=IDS_OK), ["x", "(4, 3)", "(3, 4)"]),
    ("wrong-dtype-kind", (), dict(x=X_OK, ids=np.array([0.0, 3.0])), ["ids", "int64", "float64"]),
    ("string-feed", (), dict(x="not an array", ids=IDS_OK), ["x", "str"]),
    ("object-feed", (), dict(x=X_OK, ids=object()), ["ids", "object"]),
    ("too-many-positional", (X_OK, IDS_OK, IDS_OK), {}, ["3 positional", "2"]),
    ("position-and-name", (X_OK,), dict(x=X_OK, ids=IDS_OK), ["x", "both"]),
]


@pytest.mark.parametrize("args,feeds,fragments", [c[1:] for c in BAD_FEEDS], ids=[c[0] for c in BAD_FEEDS])
def test_bad_feeds_rejected_before_any_task(args: Any, feeds: Any, fragments: list[str]) -> None:
    prog = _feed_prog()
    rec = Recorder()
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(*args, callbacks=[rec], **feeds)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    assert rec.started == [] and rec.ended == []
    assert prog.run_stats is None
    # and the good feeds work
    np.testing.assert_allclose(prog.run(X_OK, ids=IDS_OK), X_OK[IDS_OK] * 2.0, **F32)


def test_bad_feed_error_classes() -> None:
    prog = _feed_prog()
    with pytest.raises(ej.ShapeError):
        prog.run(x=np.ones((3, 4), np.float32), ids=IDS_OK)
    with pytest.raises(ej.DTypeError):
        prog.run(x=X_OK, ids=np.array([0.0, 3.0]))


# ---------------------------------------------------------------- 5. compile-time errors


def _mm() -> Any:
    return ej.input("a", (4, 3)) @ ej.input("b", (3, 2))


COMPILE_ERRORS = [
    ("duplicate-input-name", lambda: ej.compile(ej.input("x", (2, 3)) @ ej.input("x", (3, 3))), ["'x'"]),
    ("devices-0", lambda: ej.compile(_mm(), devices=0), ["devices", "0"]),
    ("devices-neg", lambda: ej.compile(_mm(), devices=-1), ["devices", "-1"]),
    ("devices-str", lambda: ej.compile(_mm(), devices="4"), ["devices", "'4'"]),
    ("planner", lambda: ej.compile(_mm(), devices=2, planner="nope"), ["planner", "'nope'"]),
    ("backend", lambda: ej.compile(_mm(), devices=2, backend="gpu9"), ["backend", "'gpu9'"]),
    ("placement", lambda: ej.compile(_mm(), devices=2, placement="scatter"), ["placement", "'scatter'"]),
    ("order", lambda: ej.compile(_mm(), devices=2, order="zigzag"), ["order", "'zigzag'"]),
    ("spec-not-in-graph",
     lambda: ej.compile(_mm(), devices=2, specs={ej.input("stranger", (5,)): {"a": 1}}), ["stranger"]),
]


@pytest.mark.parametrize("build,fragments", [c[1:] for c in COMPILE_ERRORS], ids=[c[0] for c in COMPILE_ERRORS])
def test_compile_errors(build: Any, fragments: list[str]) -> None:
    with pytest.raises(ej.EinjoinError) as info:
        build()
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)


# ---------------------------------------------------------------- 6. cancellation


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_from_callback(backend: str) -> None:
    x = ej.input("x", (64, 64))
    ys = [x]
    for i in range(12):
        ys.append(ys[-1] * 1.01 + float(i))
    out = ys[-1]
    prog = ej.compile(out, devices=4, backend=backend,
                      specs={y: {"a": 8} for y in ys[1:]} | {x: {"a": 8}})
    assert len(prog.taskgraph) > 50
    xv = rand((64, 64), 7)
    before = threads_now()
    cb = CancelOnThird(prog)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["out"] = prog.run(xv, callbacks=[cb])
        except BaseException as e:  # noqa: BLE001
            result["err"] = e

    th = threading.Thread(target=target)
    th.start()
    th.join(10)
    assert not th.is_alive(), "a cancelled run did not return"
    assert "out" not in result, "the run completed although cancelled"
    err = result["err"]
    assert isinstance(err, ej.EinjoinError), repr(err)
    assert "cancel" in str(err), str(err)
    assert len(cb.started) < len(prog.taskgraph)
    assert closed_threads(prog, before) == before, threading.enumerate()
    np.testing.assert_allclose(prog.run(xv), ej.reference(out, x=xv), **F32)


# ---------------------------------------------------------------- 7. torch / numpy in and out


def test_torch_in_torch_out_numpy_in_numpy_out() -> None:
    torch = pytest.importorskip("torch")
    x = ej.input("x", (8, 6))
    w = ej.input("w", (6, 4))
    y = x @ w
    s = ej.softmax(y)
    xv, wv = rand((8, 6), 1), rand((6, 4), 2)
    want_y, want_s = ej.reference([y, s], x=xv, w=wv)

    single = ej.compile(s, devices=2)
    got = single.run(torch.from_numpy(xv), torch.from_numpy(wv))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (8, 4)
    np.testing.assert_allclose(got.numpy(), want_s, **F32)
    got = single.run(x=torch.from_numpy(xv), w=torch.from_numpy(wv))
    assert isinstance(got, torch.Tensor)
    np.testing.assert_allclose(got.numpy(), want_s, **F32)
    got = single.run(xv, wv)
    assert type(got) is np.ndarray and got.shape == (8, 4)
    np.testing.assert_allclose(got, want_s, **F32)

    many = ej.compile([s, y], devices=2)
    got = many.run(torch.from_numpy(xv), w=torch.from_numpy(wv))
    assert isinstance(got, tuple) and len(got) == 2
    assert all(isinstance(g, torch.Tensor) for g in got)
    np.testing.assert_allclose(got[0].numpy(), want_s, **F32)
    np.testing.assert_allclose(got[1].numpy(), want_y, **F32)
    got = many.run(xv, wv)
    assert isinstance(got, tuple) and len(got) == 2 and all(type(g) is np.ndarray for g in got)
    np.testing.assert_allclose(got[0], want_s, **F32)
    np.testing.assert_allclose(got[1], want_y, **F32)


# ---------------------------------------------------------------- 8. explain and stats


def test_explain_prints_to_current_stdout() -> None:
    prog, _, _ = softmax_program("threads")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        text = prog.explain()
    assert text and text in buf.getvalue()


def test_explain_and_stats(capsys: Any) -> None:
    prog, out, feeds = softmax_program("threads")
    text = prog.explain(file=None)
    assert capsys.readouterr().out == ""
    buf = io.StringIO()
    assert prog.explain(file=buf) == text and buf.getvalue() == text + "\n"
    for n in prog.graph.nodes:
        assert str(prog.decomps[n].spec) in text, (n, text)
        if n not in prog.graph.inputs:
            assert describe(n) in text
    assert "bytes in" in text
    assert any(line.startswith("total:") for line in text.splitlines()), text
    s = prog.stats
    assert s.bytes_moved > 0 and s.bytes_per_pair
    for (a, b) in s.bytes_per_pair:
        assert re.search(rf"^\s*{a} -> {b}: ", text, re.M), ((a, b), text)

    assert s.bytes_loaded == (64 * 32 + 32 * 16) * 4
    assert s.bytes_fetched == 64 * 16 * 4
    assert {TaskKind.KERNEL, TaskKind.MOVE, TaskKind.FREE} <= set(s.task_counts)
    assert sum(s.task_counts.values()) == len(prog.taskgraph)
    prog.run(**feeds)
    r = prog.run_stats
    assert r.bytes_loaded == s.bytes_loaded and r.bytes_fetched == s.bytes_fetched
    assert r.bytes_moved == s.bytes_moved and r.tasks_run == len(prog.taskgraph)


def test_explain_without_moves_has_no_pair_lines() -> None:
    x = ej.input("x", (8, 8))
    y = x * 2.0
    prog = ej.compile(y, devices=4, specs={x: {"a": 4}, y: {"a": 4}})
    text = prog.explain(file=None)
    assert prog.stats.bytes_moved == 0
    assert "->" not in text.split("total:")[1], text


# ---------------------------------------------------------------- 9. exchange golden byte counts


F4 = 4  # float32 bytes


def _check_moved(prog: Any, expected: int, *feeds: np.ndarray) -> Any:
    assert prog.stats.bytes_moved == expected
    out = prog.run(*feeds)
    assert prog.run_stats.bytes_moved == expected
    return out


def test_exchange_rows_to_columns_moves_three_quarters() -> None:
    x = ej.input("x", (8, 8))
    y = x * 2.0
    assert ej.decomp.label_sizes(y.node) == {"a": 8, "b": 8}
    prog = ej.compile(y, devices=4, specs={x: {"a": 4}, y: {"b": 4}}, placement="round_robin")
    # row block i lives on device i; column block j is computed on device j: device j needs the
    # 2x2 piece (i, j) of every other row block i: 4 devices x 3 pieces x 4 elements x 4 bytes
    expected = 4 * 3 * (2 * 2) * F4
    assert expected == 8 * 8 * F4 * 3 // 4
    xv = rand((8, 8), 1)
    np.testing.assert_allclose(_check_moved(prog, expected, xv), xv * 2.0, **F32)
    assert prog.stats.bytes_per_pair == {(i, j): 2 * 2 * F4 for i in range(4) for j in range(4) if i != j}


def test_exchange_aligned_moves_nothing() -> None:
    x = ej.input("x", (8, 8))
    y = x * 2.0
    prog = ej.compile(y, devices=4, specs={x: {"a": 4}, y: {"a": 4}}, placement="round_robin")
    xv = rand((8, 8), 1)
    np.testing.assert_allclose(_check_moved(prog, 0, xv), xv * 2.0, **F32)
    assert TaskKind.MOVE not in prog.stats.task_counts


@pytest.mark.parametrize("inputs_whole", [False, True], ids=["inputs-follow", "inputs-whole"])
def test_exchange_contracted_split_aggregation(inputs_whole: bool) -> None:
    a = ej.input("a", (8, 8))
    b = ej.input("b", (8, 8))
    z = a @ b
    assert ej.decomp.label_sizes(z.node) == {"m": 8, "n": 8, "k": 8}
    specs: dict[Any, Any] = {z: {"k": 2}}
    if inputs_whole:
        specs.update({a: {}, b: {}})  # one whole copy of each input, loaded on device 0
    prog = ej.compile(z, devices=2, specs=specs, placement="round_robin")
    assert prog.placement[z.node].kernel_devices == (0, 1)
    # one output block (m, n whole), home device 0: the partial of kernel 1 (device 1) travels once
    partial = 8 * 8 * F4
    if inputs_whole:
        # kernel 1 reads a[:, 4:] and b[4:, :] which live on device 0
        pieces = 8 * 4 * F4 + 4 * 8 * F4
        pairs = {(0, 1): pieces, (1, 0): partial}
    else:
        # the inputs follow their consumer: the k=1 halves are loaded on device 1 already
        pieces = 0
        pairs = {(1, 0): partial}
    av, bv = rand((8, 8), 1), rand((8, 8), 2)
    out = _check_moved(prog, partial + pieces, av, bv)
    np.testing.assert_allclose(out, av @ bv, **F32)
    assert prog.stats.bytes_per_pair == pairs
    assert prog.stats.task_counts.get(TaskKind.REDUCE) == 1


def test_exchange_all_gather() -> None:
    x = ej.input("x", (8, 8))
    v = ej.input("v", (4,))
    w = ej.einsum("ij,k->ijk", x, v)
    assert ej.decomp.label_sizes(w.node) == {"i": 8, "j": 8, "k": 4}
    prog = ej.compile(w, devices=4, specs={x: {"a": 4}, w: {"k": 4}}, placement="round_robin")
    # every kernel (one per device) needs all of x, of which it holds one row block of four: each
    # device receives 3/4 of x; v follows its consumer (k cut 4 ways), so none of v moves
    xbytes = 8 * 8 * F4
    expected = 4 * (xbytes * 3 // 4)
    assert expected == 3 * xbytes
    xv, vv = rand((8, 8), 1), rand((4,), 2)
    out = _check_moved(prog, expected, xv, vv)
    np.testing.assert_allclose(out, np.einsum("ij,k->ijk", xv, vv), **F32)
    assert prog.stats.bytes_in_per_device == {d: xbytes * 3 // 4 for d in range(4)}


def test_exchange_shared_region_moves_once() -> None:
    x = ej.input("x", (8, 8))
    y1 = x * 2.0
    y2 = x + 1.0
    # x: rows 0:4 on device 0, rows 4:8 on device 1; each consumer's column block j runs on device
    # j, so both y1 and y2 on device 1 read x[0:4, 4:8] (64 B) from device 0, and both on device 0
    # read x[4:8, 0:4] from device 1: each piece must travel once
    piece = 4 * 4 * F4
    one = ej.compile(y1, devices=2, specs={x: {"a": 2}, y1: {"b": 2}}, placement="round_robin")
    two = ej.compile([y1, y2], devices=2, specs={x: {"a": 2}, y1: {"b": 2}, y2: {"b": 2}},
                     placement="round_robin")
    xv = rand((8, 8), 1)
    _check_moved(one, 2 * piece, xv)
    got1, got2 = _check_moved(two, 2 * piece, xv)
    np.testing.assert_allclose(got1, xv * 2.0, **F32)
    np.testing.assert_allclose(got2, xv + 1.0, **F32)
    assert two.stats.bytes_per_pair == {(0, 1): piece, (1, 0): piece}
    assert two.stats.task_counts[TaskKind.MOVE] == 2


def test_outputs_do_not_alias_feeds() -> None:
    torch = pytest.importorskip("torch")
    x = ej.input("x", (4, 4))
    aliased = []
    for devices in (1, 2):
        for name, out in (("identity", x), ("cast", ej.cast(x, "float32")), ("reshape", x.reshape(16)),
                          ("slice", x[0:2])):
            prog = ej.compile(out, devices=devices)
            xv = rand((4, 4), 1)
            got = prog.run(xv)
            if np.shares_memory(got, xv):
                aliased.append((devices, name, "numpy"))
            xt = torch.from_numpy(rand((4, 4), 2))
            gt = prog.run(xt)
            if gt.untyped_storage().data_ptr() == xt.untyped_storage().data_ptr():
                aliased.append((devices, name, "torch"))
    assert aliased == [], f"outputs sharing memory with the feed: {aliased}"


# ---------------------------------------------------------------- progress display, concurrent runs


def test_one_progress_bar_at_a_time_and_a_broken_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent runs (several threads) on a terminal: one shows its bar, the others nothing
    (two live displays would draw over each other); the slot is free again afterwards. A stderr
    that is None or closed means no display, not an AttributeError / ValueError."""
    import sys

    from einjoin import progress
    first, second = progress.RunBar(10), progress.RunBar(10)
    with first:
        with second:
            assert first._shown and not second._shown
            second.on_end(None, 0.0, 0.0)  # a hidden bar takes updates quietly
    with second:
        assert second._shown
    monkeypatch.setattr(sys, "stderr", None)
    assert progress.enabled(False) is False
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    assert progress.enabled(False) is False


# ---------------------------------------------------------------- 8. persistent worker threads


class _Lanes:
    """Callbacks that record the threads the tasks ran on; closes ``prog`` at task ``close_at``."""

    def __init__(self, prog: Any = None, close_at: int = -1) -> None:
        self.prog, self.close_at, self.threads = prog, close_at, set()

    def on_start(self, task: Any) -> None:
        self.threads.add(threading.current_thread())
        if task.id == self.close_at:
            self.prog.close()

    def on_end(self, task: Any, start: float, end: float) -> None:
        pass


def test_threads_backend_reuses_its_worker_threads_until_the_program_is_closed() -> None:
    prog, out, feeds = softmax_program("threads")
    before = threads_now()
    first, second = _Lanes(), _Lanes()
    prog.run(callbacks=[first], **feeds)
    np.testing.assert_allclose(prog.run(callbacks=[second], **feeds), ej.reference(out, **feeds), **F32)
    assert first.threads == second.threads and len(first.threads) == prog.taskgraph.n_devices, first.threads
    assert all(t.is_alive() and t.daemon for t in first.threads)
    assert closed_threads(prog, before) == before
    assert not any(t.is_alive() for t in first.threads)
    third = _Lanes()  # a closed program runs again, on new threads
    np.testing.assert_allclose(prog.run(callbacks=[third], **feeds), ej.reference(out, **feeds), **F32)
    assert not third.threads & first.threads
    prog.close()


def test_closing_a_program_from_its_own_runs_callback_finishes_that_run() -> None:
    prog, out, feeds = softmax_program("threads")
    before = threads_now()
    cb = _Lanes(prog, close_at=3)
    np.testing.assert_allclose(prog.run(callbacks=[cb], **feeds), ej.reference(out, **feeds), **F32)
    for t in cb.threads:  # told to end with the run they were running
        t.join(10)
        assert not t.is_alive()
    assert threads_now() == before
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), **F32)
    assert closed_threads(prog, before) == before
