"""The one asynchronous engine: dependency counters, a ready queue whose order is free, per-device
block stores with byte accounting, frees after the last reader, and callbacks.

Backends only adapt it: how many workers run tasks (one inline worker, or one thread per
device) and whether tasks compute (the ``null`` backend only counts).
"""

from __future__ import annotations

import heapq
import random
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from einjoin.decomp.decompose import Decomposition
from einjoin.errors import EinjoinError
from einjoin.exchange import Task
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.plan.execute import HOST_KINDS, assemble_outputs, compute, from_host, to_host
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["Engine", "RunStats", "Store", "ReadyQueue", "ORDERS", "Callback", "Backend", "check_host_link",
           "check_seed", "check_order", "check_callbacks", "CancelToken", "RunHandle", "RunTimeoutError"]

ORDERS = ("fifo", "lifo", "priority", "random")


class Callback(Protocol):
    def on_start(self, task: Task) -> None: ...
    def on_end(self, task: Task, start: float, end: float) -> None: ...


class Backend(Protocol):
    name: str
    parallel: bool   # one worker thread per device (else one inline worker)
    computes: bool   # False: run the schedule and count bytes only

    def context(self, n_devices: int) -> Any: ...


@dataclass
class RunStats:
    """What the last run measured."""

    bytes_moved: int = 0
    bytes_loaded: int = 0
    bytes_fetched: int = 0
    peak_bytes_per_device: dict[int, int] = field(default_factory=dict)
    wall_time: float = 0.0
    busy_time_per_device: dict[int, float] = field(default_factory=dict)
    intervals: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)
    tasks_run: int = 0
    order: str = "fifo"
    recoveries: int = 0        # re-runs after a lost device (Ray)
    bytes_evicted: int = 0     # device -> host copies (memory-capped graphs; not in bytes_moved)
    bytes_reloaded: int = 0    # host -> device copies


class Store:
    """One device's blocks, with the bytes it holds (a task's output and scratch count from the
    moment it starts), its peak and the bytes it received. Thread-safe: a device's compute and
    host-transfer lanes share it."""

    def __init__(self, device: int):
        self.device = device
        self.values: dict[int, Any] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.received = 0
        self.loaded = 0
        self.evicted = 0
        self.reloaded = 0
        self.lock = threading.Lock()

    def reserve(self, vid: int, nbytes: int, scratch: int = 0) -> None:
        """Count a value about to be written (once) and the task's scratch, before it runs."""
        with self.lock:
            if vid >= 0 and vid not in self.sizes:
                self.sizes[vid] = nbytes
                self.live += nbytes
            self.live += scratch
            self.peak = max(self.peak, self.live)

    def unreserve(self, scratch: int) -> None:
        with self.lock:
            self.live -= scratch

    def put(self, vid: int, value: Any, nbytes: int) -> None:
        self.reserve(vid, nbytes)
        self.values[vid] = value

    def get(self, vid: int) -> Any:
        return self.values.get(vid)

    def free(self, vid: int) -> None:
        with self.lock:
            self.values.pop(vid, None)
            self.live -= self.sizes.pop(vid, 0)


def check_host_link(host_link: Any) -> None:
    """An emulated host link is a positive rate in bytes per second (or None: no emulation)."""
    # a bool is an int to Python, but host_link=True (1 byte/s) would make a run crawl for hours
    ok = isinstance(host_link, (int, float, np.integer, np.floating)) and not isinstance(host_link, (bool, np.bool_))
    if host_link is not None and not (ok and host_link > 0):
        raise EinjoinError(f"host_link must be a positive rate in bytes per second (e.g. 16e9) or None, "
                           f"got {host_link!r}")


def check_seed(seed: Any, where: str = "seed") -> int:
    """A seed is an integer (numpy integers too); returns it as an ``int``. A string, float or bool
    would otherwise fail deep inside a ready queue or a placer, at run time."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise EinjoinError(f"{where} must be an integer, got {type(seed).__name__} {seed!r}")
    return int(seed)


def check_order(order: Any, where: str = "order") -> str:
    """A ready-queue order is one of :data:`ORDERS`."""
    if not isinstance(order, str) or order not in ORDERS:
        raise EinjoinError(f"{where} must name a ready-queue order, one of {', '.join(ORDERS)}; got {order!r}")
    return order


def check_callbacks(callbacks: Any) -> tuple[Any, ...]:
    """Callbacks are a list (any iterable) of objects with ``on_start(task)`` and
    ``on_end(task, start, end)``; returns them as a tuple."""
    if callbacks is None:
        return ()
    if hasattr(callbacks, "on_start") or isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
        raise EinjoinError(f"callbacks must be a list of objects with on_start(task) and on_end(task, start, "
                           f"end) methods, got {type(callbacks).__name__} {callbacks!r:.80} (wrap a single "
                           f"callback in a list)")
    out = tuple(callbacks)
    for i, cb in enumerate(out):
        if not (callable(getattr(cb, "on_start", None)) and callable(getattr(cb, "on_end", None))):
            raise EinjoinError(f"callbacks[{i}] ({type(cb).__name__}) lacks an on_start(task) or on_end(task, "
                               f"start, end) method")
    return out


class CancelToken:
    """Cancels the runs it is given to (``Program.run(..., cancel=tok)``). Thread-safe.

    ``cancel()`` may be called from any thread, before or during a run: a run whose token is
    already cancelled raises at once without running any task; a running one stops as soon as the
    tasks in flight end. Either way it raises ``EinjoinError("run cancelled ...")`` and the
    program stays usable.

    >>> tok = CancelToken(); tok.cancelled
    False
    >>> tok.cancel(); tok.cancelled
    True
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Cancel (idempotent)."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            listeners, self._listeners = self._listeners, []
        for fn in listeners:  # outside the lock: a listener may take other locks
            fn()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` seconds pass; returns ``cancelled``."""
        return self._event.wait(timeout)

    def subscribe(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` once when cancelled (at once if already); returns an unsubscribe function."""
        with self._lock:
            if not self._event.is_set():
                self._listeners.append(fn)

                def unsubscribe() -> None:
                    with self._lock:
                        if fn in self._listeners:
                            self._listeners.remove(fn)
                return unsubscribe
        fn()
        return lambda: None

    def __repr__(self) -> str:
        return f"<CancelToken {'cancelled' if self.cancelled else 'active'}>"


class RunTimeoutError(EinjoinError, TimeoutError):
    """``RunHandle.result(timeout)`` ran out of time; the run goes on."""


class RunHandle:
    """A run started by ``Program.run_async``: ``result(timeout=None)`` (its outputs, or the error
    it raised), ``done()``, ``cancel()`` (this run only) and ``stats`` (its :class:`RunStats`, once
    it finished)."""

    def __init__(self, token: CancelToken) -> None:
        self._token = token
        self._finished = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self.stats: RunStats | None = None
        self.thread: threading.Thread | None = None
        self._warnings: list[Warning] = []  # issued by the first result() call, on its thread
        self._traceback: Any = None

    def _set(self, ok: bool, value: Any, stats: "RunStats | None") -> None:
        self.stats = stats
        if not ok:
            self._traceback = value.__traceback__  # the run's own frames, without result()'s
        self._outcome = (ok, value)
        self._finished.set()

    def cancel(self) -> None:
        """Cancel this run (no other); ``result()`` then raises ``EinjoinError("run cancelled ...")``."""
        self._token.cancel()

    @property
    def cancelled(self) -> bool:
        return self._token.cancelled

    def done(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """The run's outputs, as ``Program.run`` returns them; re-raises the run's error. Waits at
        most ``timeout`` seconds (None: until the end), then raises :class:`RunTimeoutError`."""
        if not self._finished.wait(timeout):
            raise RunTimeoutError(f"the run did not end within timeout={timeout!r} s; it goes on "
                                  f"(handle.cancel() stops it)")
        assert self._outcome is not None
        pending, self._warnings = self._warnings, []
        for w in pending:  # result() < the caller
            warnings.warn(w, stacklevel=2)
        ok, value = self._outcome
        if not ok:
            # the same error on every call: reset its traceback first, else each raise adds to it
            raise value.with_traceback(self._traceback)
        return value

    def __repr__(self) -> str:
        state = "done" if self.done() else ("cancelling" if self.cancelled else "running")
        return f"<RunHandle {state}>"


def _own(value: np.ndarray, t: Task, get: Callable[[int], Any], feeds: Mapping[Node, np.ndarray]
         ) -> np.ndarray:
    """Under a memory cap every block owns its bytes: a load is a real copy of the feed, and a
    kernel output that is a view of an input block (a reshape, a slice, a broadcast) is copied,
    so that freeing or evicting the input really releases it."""
    sources = [feeds[t.node]] if t.kind == "load" else [get(v) for v in t.reads]
    if any(s is not None and np.may_share_memory(value, s) for s in sources):
        return np.array(value, order="C")
    return value


class ReadyQueue:
    """Ready tasks; the order they leave in is a policy. Every policy must give correct results."""

    def __init__(self, order: str, priority: Sequence[float], seed: int):
        if order not in ORDERS:
            raise EinjoinError(f"unknown ready-queue order {order!r}; known: {', '.join(ORDERS)}")
        self.order = order
        self.priority = priority
        self.rng = random.Random(seed)
        self.items: Any = [] if order in ("priority", "random") else deque()

    def push(self, tid: int) -> None:
        if self.order == "priority":
            heapq.heappush(self.items, (-self.priority[tid], tid))
        else:
            self.items.append(tid)

    def pop(self) -> int:
        if self.order == "fifo":
            return self.items.popleft()
        if self.order == "lifo":
            return self.items.pop()
        if self.order == "priority":
            return heapq.heappop(self.items)[1]
        i = self.rng.randrange(len(self.items))
        self.items[i], self.items[-1] = self.items[-1], self.items[i]
        return self.items.pop()

    def __len__(self) -> int:
        return len(self.items)


def _blevels(tg: TaskGraph) -> list[float]:
    """Longest remaining path from each task (work in flops plus bytes), for priority order."""
    level = [0.0] * len(tg.tasks)
    for t in reversed(tg.tasks):
        below = max((level[d] for d in tg.dependents[t.id]), default=0.0)
        level[t.id] = below + t.flops + t.nbytes
    return level


class Engine:
    """Runs a task graph on a backend. Concurrent ``run`` calls are safe and independent: every
    run keeps its own stores, counters, queues and stats (the engine holds only the read-only
    task graph and decompositions), and a :class:`CancelToken` cancels the run it is given to."""

    def __init__(self, tg: TaskGraph, decomps: Mapping[Node, Decomposition]):
        self.tg = tg
        self.decomps = decomps
        self._priority: list[float] | None = None
        self._priority_lock = threading.Lock()

    def priority(self) -> list[float]:
        with self._priority_lock:
            if self._priority is None:
                self._priority = _blevels(self.tg)
            return self._priority

    def run(self, feeds: Mapping[Node, np.ndarray], backend: Backend, order: str = "fifo",
            seed: int = 0, callbacks: Sequence[Callback] = (), host_link: float | None = None,
            cancel: CancelToken | None = None) -> tuple[list[np.ndarray] | None, RunStats]:
        """Run every task once in an order the ready queue picks. ``host_link``: emulate a
        host<->device link of that many bytes per second (loads, evictions, reloads and
        write-backs take at least their bytes over it), e.g. 16e9 for PCIe 4 x16. ``cancel``:
        stop when that token is cancelled (at once, running nothing, if it already is).

        A ``KeyboardInterrupt`` (or ``SystemExit``) raised by a task or a callback stops every
        worker and is re-raised as it is, not wrapped; any other failure raises an
        :class:`EinjoinError` naming the task."""
        tg = self.tg
        n = tg.n_devices
        capped = tg.memory is not None
        check_host_link(host_link)
        check_order(order)
        seed = check_seed(seed)
        callbacks = check_callbacks(callbacks)
        if cancel is not None and cancel.cancelled:
            raise EinjoinError(f"run cancelled before it started (none of its {len(tg.tasks)} tasks ran)")
        prio = self.priority() if order == "priority" else ()
        # host transfers get a lane (thread) of their own per device, so they overlap compute
        lanes = backend.parallel and (capped or host_link is not None)
        n_queues = (2 * n if lanes else n) if backend.parallel else 1
        queues = [ReadyQueue(order, prio, seed + d) for d in range(n_queues)]
        if not backend.parallel:
            qi: Callable[[Task], int] = lambda t: 0
        elif lanes:
            qi = lambda t: t.device + n if t.kind in HOST_KINDS else t.device
        else:
            qi = lambda t: t.device
        stores = [Store(d) for d in range(n)]
        host: dict[int, np.ndarray] = {}  # the host store of a memory-capped graph
        counters = [len(t.deps) for t in tg.tasks]
        stats = RunStats(order=order, intervals={d: [] for d in range(n)})
        state = {"remaining": len(tg.tasks), "error": None, "stop": False}
        lock = threading.Lock()
        # one condition per queue (all on one lock): a finished task wakes only the workers whose
        # queues it filled, not every thread (each wake-up costs a GIL hand-over)
        conds = [threading.Condition(lock) for _ in queues]

        def wake_all() -> None:  # under lock
            for c in conds:
                c.notify_all()

        def cancelled() -> bool:
            return cancel is not None and cancel.cancelled

        def on_cancel() -> None:  # the token's listener: wake the waiting workers now
            with lock:
                state["stop"] = True
                wake_all()
        for t in tg.tasks:
            if not t.deps:
                queues[qi(t)].push(t.id)

        def throttle(start: float, nbytes: int) -> None:
            if host_link is not None and nbytes:
                rest = nbytes / host_link - (time.perf_counter() - start)
                if rest > 0:
                    time.sleep(rest)

        def execute(t: Task) -> None:
            for cb in callbacks:
                cb.on_start(t)
            start = time.perf_counter()
            store = stores[t.device]
            if t.kind == "free":
                store.free(t.frees)
            elif t.kind in ("evict", "writeback"):
                if backend.computes:
                    to_host(t, store.get(t.frees), host)
                throttle(start, t.nbytes)
                store.evicted += t.nbytes if t.kind == "evict" else 0
                store.free(t.frees)
            else:
                planned = tg.values[t.writes].nbytes
                store.reserve(t.writes, planned, t.scratch)
                value = None
                if backend.computes:
                    if t.kind == "reload":
                        value = from_host(t, host, feeds)
                    else:
                        # a move reads on its source device and writes on its destination
                        get: Callable[[int], Any] = stores[t.src_device].get if t.kind == "move" else store.get
                        value = compute(t, get, feeds, self.decomps, tg.values[t.writes].shape)
                        if capped and t.kind in ("load", "kernel"):
                            value = _own(value, t, get, feeds)
                store.unreserve(t.scratch)
                # count what really arrived: the array's bytes (the null backend has only the plan's)
                nbytes = value.nbytes if value is not None else planned
                store.put(t.writes, value, nbytes)
                if t.kind == "move":
                    store.received += nbytes
                elif t.kind == "load":
                    store.loaded += nbytes
                    throttle(start, nbytes)
                elif t.kind == "reload":
                    store.reloaded += nbytes
                    throttle(start, nbytes)
            end = time.perf_counter()
            stats.intervals[t.device].append((start, end, t.id))
            for cb in callbacks:
                cb.on_end(t, start, end)

        def complete(t: Task) -> None:  # under lock
            for dep in tg.dependents[t.id]:
                counters[dep] -= 1
                if counters[dep] == 0:
                    q = qi(tg.tasks[dep])
                    queues[q].push(dep)
                    conds[q].notify()  # one worker per queue: notify() reaches it
            state["remaining"] -= 1
            if not state["remaining"]:
                wake_all()

        def fail(t: Task, exc: BaseException) -> None:
            with lock:
                if state["error"] is None:
                    state["error"] = (t, exc)
                state["stop"] = True
                wake_all()

        def worker(q: int) -> None:
            while True:
                with lock:
                    # every change a worker waits for notifies it: a task made ready in its queue,
                    # the last task done, a failure, a cancel (on_cancel), a Ctrl-C (_drive)
                    while not len(queues[q]) and state["remaining"] and not state["stop"]:
                        if not backend.parallel:  # one inline worker and nothing ready: stuck
                            state["stop"] = True
                            break
                        conds[q].wait()
                    if state["stop"] or not state["remaining"]:
                        wake_all()
                        return
                    t = tg.tasks[queues[q].pop()]
                try:
                    execute(t)
                except BaseException as exc:  # noqa: BLE001 - reported with the task's context
                    fail(t, exc)
                    return
                with lock:
                    complete(t)
                    stats.tasks_run += 1

        t0 = time.perf_counter()
        unsubscribe = cancel.subscribe(on_cancel) if cancel is not None else (lambda: None)
        try:
            self._drive(backend, n, worker, len(queues), lock, state, wake_all)
        finally:
            unsubscribe()
        stats.wall_time = time.perf_counter() - t0
        if state["error"] is not None:
            t, exc = state["error"]
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: the user's, as is
                raise exc
            kind = f"kernel {t.kernel}" if t.kind == "kernel" else t.kind
            msg = (f"task #{t.id} ({kind} of {describe(t.node)}) on device {t.device} failed: "
                   f"{type(exc).__name__}: {exc}")
            raise EinjoinError(msg) from exc
        if state["remaining"]:
            if cancelled():
                raise EinjoinError(f"run cancelled with {state['remaining']} of {len(tg.tasks)} tasks left")
            raise EinjoinError(f"run stopped with {state['remaining']} tasks never ready (a cycle?)")
        return self._finish(stores, stats, backend, host, feeds, capped)

    @staticmethod
    def _drive(backend: Backend, n: int, worker: Callable[[int], None], n_queues: int,
               lock: threading.Lock, state: dict[str, Any], wake_all: Callable[[], None]) -> None:
        """Run the workers: inline (one queue) or one thread per queue; returns only once every
        worker thread has ended, also after a Ctrl-C (which then stops the workers and goes on).

        The threads are counted under the run's lock (begun, ended) and waited for on a
        condition, never with ``join()``/``is_alive()``: an interrupt that lands inside
        ``Thread.join`` marks a live thread stopped (CPython bpo-45274), so a join after it
        returns while the worker still runs tasks."""
        with backend.context(n):
            if not backend.parallel:
                worker(0)
                return
            ended = threading.Condition(lock)
            state.update(begun=0, ended=0, launched=0)

            began = [threading.Event() for _ in range(n_queues)]

            def guarded(q: int) -> None:
                with lock:
                    state["begun"] += 1
                began[q].set()  # after the count: whoever sees it set finds the thread counted
                try:
                    worker(q)
                finally:
                    with lock:
                        state["ended"] += 1
                        ended.notify_all()

            def stop() -> None:
                with lock:
                    state["stop"] = True
                    wake_all()
            interrupted: BaseException | None = None
            started: list[threading.Thread] = []
            starting: tuple[int, threading.Thread] | None = None
            try:  # the starts too: a Ctrl-C may land while the first workers already run
                for q in range(n_queues):
                    starting = None
                    th = threading.Thread(target=guarded, args=(q,), daemon=True,
                                          name=f"einjoin-dev{q}" if q < n else f"einjoin-host{q - n}")
                    starting = (q, th)
                    th.start()
                    started.append(th)
                    starting = None
                    with lock:
                        state["launched"] += 1
            except BaseException as e:  # KeyboardInterrupt, or no thread could be started
                interrupted = e
                stop()  # a worker whose start was cut short but that runs anyway finds stop set
                if starting is not None:
                    # Thread.start() waits for the new thread to begin: an interrupt there leaves
                    # one that exists (it begins at once) or, cut before its creation, none
                    q, th = starting
                    while True:
                        try:
                            if began[q].wait(1.0):
                                started.append(th)
                            break
                        except KeyboardInterrupt:
                            pass
            while True:
                try:
                    with lock:
                        # a launched worker always begins; one that began is counted: wait for both
                        while state["ended"] < max(state["launched"], state["begun"]):
                            ended.wait()
                    break
                except KeyboardInterrupt as e:  # stop every worker, wait for them, then re-raise
                    interrupted = interrupted or e
                    stop()
            for th in started:  # done with the run: let them end too (no thread outlives run())
                while True:
                    try:
                        th.join()
                        break
                    except KeyboardInterrupt as e:
                        interrupted = interrupted or e
            if interrupted is not None:
                raise interrupted

    def _finish(self, stores: list[Store], stats: RunStats, backend: Backend, host: dict[int, np.ndarray],
                feeds: Mapping[Node, np.ndarray], capped: bool) -> tuple[list[np.ndarray] | None, RunStats]:
        """The run's totals from its stores, and its outputs assembled from the blocks."""
        tg = self.tg
        stats.bytes_moved = sum(s.received for s in stores)
        stats.bytes_loaded = sum(s.loaded for s in stores)
        stats.bytes_evicted = sum(s.evicted for s in stores)
        stats.bytes_reloaded = sum(s.reloaded for s in stores)
        stats.peak_bytes_per_device = {s.device: s.peak for s in stores}
        stats.busy_time_per_device = {d: sum(b - a for a, b, _ in iv) for d, iv in stats.intervals.items()}
        if not backend.computes:
            stats.bytes_fetched = sum(tg.values[v].nbytes for lay in tg.outputs for v in lay.blocks.values())
            return None, stats
        outs = assemble_outputs(tg, host.__getitem__ if capped else lambda v: stores[tg.values[v].device].get(v),
                                feeds)
        stats.bytes_fetched = sum(o.nbytes for o in outs)
        return outs, stats
