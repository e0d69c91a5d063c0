"""The one engine: every backend's runs go through :meth:`Engine.run`, a short loop over named
steps — check the arguments, open the backend's session, dispatch the tasks, collect, finish,
replay callbacks — with re-runs after a lost device.

Dispatch is one of two (:mod:`einjoin.runtime.backend`): *ready dispatch* keeps a dependency
counter per task and ready queues whose order is a policy (``fifo``, ``lifo``, ``priority`` by
b-level, ``random``) and hands each ready task to the session on a worker (inline, or a thread
per lane: sync, threads, null); *eager dispatch* submits every task in dependency order to a
backend that resolves dependencies itself (Ray) and collects them. Callbacks (``on_start``,
``on_end``) see every task either way: live, or replayed with the measured times after the run.
Run control (:class:`CancelToken`, :class:`RunHandle`, :class:`RunTimeoutError`) lives in
:mod:`einjoin.runtime.control` and is re-exported here.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.decomp.decompose import Decomposition
from einjoin.errors import EinjoinError
from einjoin.exchange import Task, TaskKind
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime.backend import (WAIT_SLICE, Backend, Callback, DeviceLost, EagerSession, ReadySession, RunSpec,
                                    TaskFailed, join_thread, note)
from einjoin.runtime import blockpool
from einjoin.runtime.control import CancelToken, RunHandle, RunTimeoutError
from einjoin.runtime.local import Store
from einjoin.runtime.workers import WorkerPool

if TYPE_CHECKING:
    from einjoin.cluster import Cluster
    from einjoin.runtime.state import StateRun

__all__ = ["Engine", "RunStats", "Store", "ReadyQueue", "ORDERS", "Callback", "Backend", "check_host_link",
           "check_seed", "check_order", "check_callbacks", "CancelToken", "RunHandle", "RunTimeoutError",
           "drive_threads"]

ORDERS = ("fifo", "lifo", "priority", "random")


@dataclass
class RunStats:
    """What the last run measured."""

    bytes_moved: int = 0
    bytes_loaded: int = 0
    bytes_fetched: int = 0
    peak_bytes_per_device: dict[int, int] = field(default_factory=dict)
    wall_time: float = 0.0
    # per device, the time its intervals cover (a BusyTimes: worked out when first read)
    busy_time_per_device: Mapping[int, float] = field(default_factory=dict)
    intervals: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)
    tasks_run: int = 0
    order: str = "fifo"
    recoveries: int = 0        # re-runs after a lost device (Ray)
    bytes_evicted: int = 0     # device -> host copies (memory-capped graphs; not in bytes_moved)
    bytes_reloaded: int = 0    # host -> device copies
    # the physical bytes the moves copied (bytes_moved is the plan's logical bytes): 0 where a move
    # hands the block over (local devices, uncapped), all of them across processes (Ray); the torch
    # backend adds its host copies (TorchBackend.host_copies)
    bytes_copied: int = 0
    source: str = "measured"   # "simulated": every figure from backend="simulate" (simulated seconds)


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
        tid: int
        if self.order == "fifo":
            tid = self.items.popleft()
        elif self.order == "lifo":
            tid = self.items.pop()
        elif self.order == "priority":
            tid = heapq.heappop(self.items)[1]
        else:
            i = self.rng.randrange(len(self.items))
            self.items[i], self.items[-1] = self.items[-1], self.items[i]
            tid = self.items.pop()
        return tid

    def __len__(self) -> int:
        return len(self.items)


_SCHEDULES = 8  # inline schedules kept per engine
_FREE = TaskKind.FREE  # module constant: read per task on the dispatch hot path


def _simulate(tg: TaskGraph, q: ReadyQueue) -> tuple[tuple[Task, ...], int]:
    """The tasks in the order an inline worker with ready queue ``q`` runs them (the queue
    seeded with the tasks without dependencies in id order, each finished task pushing the
    dependents it makes ready in the graph's order), and the count of tasks never ready."""
    tasks, dependents = tg.tasks, tg.dependents
    counters = [len(t.deps) for t in tasks]
    for t in tasks:
        if not t.deps:
            q.push(t.id)
    out = []
    while len(q):
        tid = q.pop()
        out.append(tasks[tid])
        for dep in dependents[tid]:
            counters[dep] -= 1
            if counters[dep] == 0:
                q.push(dep)
    return tuple(out), len(tasks) - len(out)


def _blevels(tg: TaskGraph) -> list[float]:
    """Longest remaining path from each task (work in flops plus bytes), for priority order."""
    level = [0.0] * len(tg.tasks)
    for t in reversed(tg.tasks):
        below = max((level[d] for d in tg.dependents[t.id]), default=0.0)
        level[t.id] = below + t.flops + t.nbytes
    return level


class Engine:
    """Runs a task graph on a backend (:class:`~einjoin.runtime.backend.Backend`). Concurrent
    ``run`` calls are safe and independent: every run keeps its own session (stores, counters,
    queues) and stats (the engine holds only the read-only task graph and decompositions), and a
    :class:`CancelToken` cancels the run it is given to."""

    def __init__(self, tg: TaskGraph, decomps: Mapping[Node, Decomposition]):
        self.tg = tg
        self.decomps = decomps
        self._priority: list[float] | None = None
        self._priority_lock = threading.Lock()
        self._schedules: dict[tuple[str, int], tuple[tuple[Task, ...], int]] = {}
        self.planned = [v.nbytes for v in tg.values]  # value id -> planned bytes (a property, read per task)
        self.shapes = [v.shape for v in tg.values]  # value id -> shape (read per task)
        # each task's dependency count and the tasks without any: a run's counters start as a copy
        self.dep_counts = [len(t.deps) for t in tg.tasks]
        self.roots = [t.id for t in tg.tasks if not t.deps]
        # per task: 0 not a free, 1 a free nothing depends on (every free of an uncapped graph), 2 a
        # free that memory-planned tasks wait for (read per task made ready, see _Dispatch.complete)
        self.frees = [0 if t.kind is not _FREE else 2 if tg.dependents[t.id] else 1 for t in tg.tasks]
        self._fast: list[Any] | None = None
        self._lanes: dict[Any, list[int]] = {}  # a session's lane_key -> the lane of each task
        self._pool: WorkerPool | None = None  # the threads running this engine's lanes, made at the first run

    def workers(self) -> WorkerPool:
        """The persistent threads of this engine's threaded runs (:mod:`einjoin.runtime.workers`):
        made at the first such run, stopped by :meth:`close` or when the engine is collected."""
        pool = self._pool
        if pool is None:
            with self._priority_lock:
                if self._pool is None:
                    n = self.tg.n_devices
                    self._pool = WorkerPool(lambda q: lane_name(q, n))
                pool = self._pool
        return pool

    def close(self) -> None:
        """Stop the engine's worker threads (a later run starts new ones) and drop its pooled
        blocks (:mod:`einjoin.runtime.blockpool`)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
        blockpool.release(self)

    def lanes(self, session: ReadySession) -> list[int]:
        """The lane of each task for ``session``: kept per ``session.lane_key`` (what its lanes
        depend on besides the graph), else worked out for this run."""
        key = getattr(session, "lane_key", None)
        got = self._lanes.get(key) if key is not None else None
        if got is None:
            lane = session.lane
            got = [lane(t) for t in self.tg.tasks]
            if key is not None:
                with self._priority_lock:
                    self._lanes[key] = got
        return got

    def fast_kernels(self) -> list[Any]:
        """Per task id, its einsum kernel prepared once (:mod:`einjoin.runtime.fastkernels`), or None."""
        if self._fast is None:
            from einjoin.runtime.fastkernels import prepare_kernels
            fast = prepare_kernels(self.tg, self.decomps)
            with self._priority_lock:
                if self._fast is None:
                    self._fast = fast
        return self._fast

    def priority(self) -> list[float]:
        with self._priority_lock:
            if self._priority is None:
                self._priority = _blevels(self.tg)
            return self._priority

    def schedule(self, order: str, seed: int) -> tuple[tuple[Task, ...], int]:
        """The order one inline worker runs the tasks in under ``order`` / ``seed`` (the ready
        queue's, simulated once: it depends on the graph alone), and how many tasks never get
        ready (a cycle). Cached per (order, seed), a few of them."""
        key = (order, seed)
        got = self._schedules.get(key)
        if got is None:
            got = _simulate(self.tg, ReadyQueue(order, self.priority() if order == "priority" else (), seed))
            with self._priority_lock:
                if len(self._schedules) >= _SCHEDULES:  # a random order with a new seed each run
                    self._schedules.pop(next(iter(self._schedules)))
                self._schedules[key] = got
        return got

    def run(self, feeds: Mapping[Node, np.ndarray], backend: Backend, order: str = "fifo",
            seed: int = 0, callbacks: Sequence[Callback] = (), host_link: float | None = None,
            cancel: CancelToken | None = None, cluster: Cluster | None = None,
            state: StateRun | None = None) -> tuple[list[np.ndarray] | None, RunStats]:
        """Run every task once. ``order``: the ready-queue policy (backends that resolve
        dependencies themselves, Ray, ignore it). ``host_link``: emulate a host<->device link of
        that many bytes per second (loads, evictions, reloads and write-backs take at least their
        bytes over it), e.g. 16e9 for PCIe 4 x16. ``cancel``: stop when that token is cancelled
        (at once, running nothing, if it already is). ``cluster``: where the devices are (a
        remote backend places its workers on the nodes it names). ``state``: a program's state
        for this run (:mod:`einjoin.runtime.state`): resident blocks its loads take, and where
        the session keeps the new values (returned outputs are then only the user's).

        A lost device re-runs the graph from the inputs, ``backend.retries`` times. A
        ``KeyboardInterrupt`` (or ``SystemExit``) raised by a task or a callback stops every
        worker and is re-raised as it is, not wrapped; any other failure raises an
        :class:`EinjoinError` naming the task."""
        spec = self._check(feeds, backend, order, seed, host_link, cancel, cluster, state)
        callbacks = check_callbacks(callbacks)
        recovery = _Recovery(backend, cancel)
        while True:
            try:
                outs, stats = self._attempt(spec, backend, callbacks)
            except DeviceLost as lost:
                recovery.lost(lost)  # raises when no retry is left
                continue
            except TaskFailed as failed:
                raise _task_error(failed.task, failed.cause) from failed.cause
            stats.recoveries = recovery.attempts
            return outs, stats

    # ---- the steps of a run

    def _check(self, feeds: Mapping[Node, np.ndarray], backend: Backend, order: str, seed: int,
               host_link: float | None, cancel: CancelToken | None, cluster: Cluster | None,
               state: StateRun | None = None) -> RunSpec:
        """Every run argument checked; a token cancelled already runs nothing."""
        check_host_link(host_link)
        check_order(order)
        seed = check_seed(seed)
        if cancel is not None and cancel.cancelled:
            raise EinjoinError(f"run cancelled before it started (none of its {len(self.tg.tasks)} tasks ran)")
        return RunSpec(self, feeds, order, seed, host_link, cancel, cluster, state)

    def _attempt(self, spec: RunSpec, backend: Backend, callbacks: tuple[Callback, ...]
                 ) -> tuple[list[np.ndarray] | None, RunStats]:
        """One attempt: open a session, dispatch every task (ready tasks to workers, or all of them
        in dependency order to a backend that resolves dependencies), collect, finish."""
        n = self.tg.n_devices
        stats = RunStats(order=spec.order, intervals={d: [] for d in range(n)})
        t0 = time.perf_counter()
        with backend.open(spec) as session:
            if session.eager:
                self._submit(session)
                session.collect(spec.cancel)
            elif not session.threaded:
                _Inline(self, spec, session, callbacks, stats).run()
            else:
                _Dispatch(self, spec, session, callbacks, stats).run()
            stats.wall_time = time.perf_counter() - t0
            outs = session.finish(stats)
        stats.busy_time_per_device = BusyTimes(stats.intervals)
        if session.eager:
            _replay(self.tg, stats, callbacks)
        return outs, stats

    def _submit(self, session: EagerSession) -> None:
        """Every task in id order (a topological order): each one's dependencies are submitted
        before it, so the backend can pass their futures."""
        submit = session.submit
        for t in self.tg.tasks:
            submit(t)


class BusyTimes(Mapping[int, float]):
    """Per device, the time its run intervals cover, worked out when first read: two sums per
    device over a step's thousand intervals or more cost the small LLaMA trainer step ~0.4 ms of
    the main thread's serial time per run (after the workers ended), and most runs never read it.

    >>> b = BusyTimes({0: [(0.0, 1.5, 0), (2.0, 2.5, 1)], 1: []}); dict(b), b == {0: 2.0, 1: 0.0}
    ({0: 2.0, 1: 0.0}, True)
    """

    __slots__ = ("_intervals", "_got")

    def __init__(self, intervals: Mapping[int, list[tuple[float, float, int]]]):
        self._intervals = intervals
        self._got: dict[int, float] | None = None

    def _all(self) -> dict[int, float]:
        if self._got is None:
            self._got = {d: _busy(iv) for d, iv in self._intervals.items()}
        return self._got

    def __getitem__(self, device: int) -> float:
        return self._all()[device]

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._intervals)

    def __eq__(self, other: object) -> bool:
        return self._all() == (dict(other) if isinstance(other, Mapping) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[Any, tuple[dict[int, float]]]:
        return dict, (self._all(),)  # pickled as the plain dict it stands for


def _busy(iv: list[tuple[float, float, int]]) -> float:
    """The time a device's intervals cover, added up (two sums over columns: a run has a
    thousand intervals or more, and a generator over them cost ~0.1 ms per run)."""
    if not iv:
        return 0.0
    starts, ends, _ = zip(*iv)
    return float(sum(ends) - sum(starts))


def _task_error(t: Task, exc: BaseException) -> BaseException:
    """The error a failed task raises: the user's KeyboardInterrupt / SystemExit as it is, else
    an :class:`EinjoinError` naming the task, its op and its device."""
    if not isinstance(exc, Exception):
        return exc
    kind = f"kernel {t.payload.kernel}" if t.kind is TaskKind.KERNEL else str(t.kind)
    return EinjoinError(f"task #{t.id} ({kind} of {describe(t.node)}) on device {t.device} failed: "
                        f"{type(exc).__name__}: {exc}")


def _replay(tg: TaskGraph, stats: RunStats, callbacks: tuple[Callback, ...]) -> None:
    """Callbacks of a backend that ran the tasks elsewhere: each task after the run, in start
    order, with its measured times."""
    stats.tasks_run = sum(len(iv) for iv in stats.intervals.values())
    if not callbacks:
        return
    events = sorted((s, e, tid) for iv in stats.intervals.values() for s, e, tid in iv)
    for s, e, tid in events:
        for cb in callbacks:
            cb.on_start(tg.tasks[tid])
            cb.on_end(tg.tasks[tid], s, e)


class _Recovery:
    """Re-runs after lost devices: ``backend.retries`` of them, plus one free replacement of a
    device found dead before the run did anything (it died since the last run)."""

    def __init__(self, backend: Backend, cancel: CancelToken | None):
        self.backend, self.cancel = backend, cancel
        self.retries = max(0, int(backend.retries))  # read per run: it may be set after construction
        self.attempts = 0
        self.spare = 1

    def lost(self, e: DeviceLost) -> None:
        if e.before_start and self.spare:
            self.spare -= 1
        elif self.attempts == self.retries:
            raise EinjoinError(f"{e}; the run failed after {self.retries} re-run(s) ({type(self.backend).__name__}("
                               f"retries=...) allows more); the next run starts fresh devices") from None
        else:
            self.attempts += 1
        note(self.backend, f"{e}; restarting the devices and re-running")
        if self.cancel is not None and self.cancel.cancelled:
            raise EinjoinError(f"run cancelled while recovering from a lost device ({e})") from None


class _Inline:
    """Ready dispatch with one inline worker (sync, null, a one-lane threads run): the tasks in
    the order the ready queue gives them, precomputed once per graph and order
    (:meth:`Engine.schedule`), so a task costs its execution, two clock reads and a flag test:
    no counters, queues or locks. A cancel (from another thread) sets ``stop``; the task in
    flight ends first."""

    def __init__(self, engine: Engine, spec: RunSpec, session: ReadySession, callbacks: tuple[Callback, ...],
                 stats: RunStats):
        self.engine, self.spec, self.session, self.callbacks, self.stats = engine, spec, session, callbacks, stats
        self.stop = False

    def _halt(self) -> None:  # the token's listener
        self.stop = True

    def run(self) -> None:
        sched, never = self.engine.schedule(self.spec.order, self.spec.seed)
        cancel = self.spec.cancel
        unsubscribe = cancel.subscribe(self._halt) if cancel is not None else (lambda: None)
        done = 0
        try:
            with _thread_scope(self.session):
                done = self._loop(sched) if not self.callbacks else self._loop_callbacks(sched)
        finally:
            unsubscribe()
            self.stats.tasks_run = done
        n = len(self.engine.tg.tasks)
        if done < n:
            if cancel is not None and cancel.cancelled:
                raise EinjoinError(f"run cancelled with {n - done} of {n} tasks left")
            raise EinjoinError(f"run stopped with {never} tasks never ready (a cycle?)")

    def _loop(self, sched: tuple[Task, ...]) -> int:
        execute, clock, iv = self.session.execute, time.perf_counter, self.stats.intervals
        done = 0
        t = None
        try:
            for t in sched:
                if self.stop:
                    break
                start = clock()
                execute(t)
                iv[t.device].append((start, clock(), t.id))
                done += 1
        except BaseException as exc:  # noqa: BLE001 - reported with the task's context
            _raise_failed(t, exc)  # type: ignore[arg-type]
        return done

    def _loop_callbacks(self, sched: tuple[Task, ...]) -> int:
        execute, clock, iv, callbacks = self.session.execute, time.perf_counter, self.stats.intervals, self.callbacks
        done = 0
        t = None
        try:
            for t in sched:
                if self.stop:
                    break
                for cb in callbacks:
                    cb.on_start(t)
                start = clock()
                execute(t)
                end = clock()
                iv[t.device].append((start, end, t.id))
                for cb in callbacks:
                    cb.on_end(t, start, end)
                done += 1
        except BaseException as exc:  # noqa: BLE001 - reported with the task's context
            _raise_failed(t, exc)  # type: ignore[arg-type]
        return done


def _thread_scope(session: Any) -> AbstractContextManager[Any]:
    """What a thread executing the session's tasks enters first (a session's per-run context
    for its kernels, :meth:`einjoin.runtime.local.LocalSession.thread_scope`), if it has one."""
    scope = getattr(session, "thread_scope", None)
    return scope() if scope is not None else contextlib.nullcontext()


def _raise_failed(t: Task, exc: BaseException) -> None:
    """A task's failure as the engine reports it: KeyboardInterrupt / SystemExit as they are,
    anything else as :class:`TaskFailed` (named by :func:`_task_error`)."""
    if not isinstance(exc, Exception):
        raise exc
    raise TaskFailed(t, exc) from exc


class _Dispatch:
    """Ready dispatch for one run: a dependency counter per task, ready queues (one per lane of
    the session), and workers that execute ready tasks — inline, or one thread per lane."""

    def __init__(self, engine: Engine, spec: RunSpec, session: ReadySession, callbacks: tuple[Callback, ...],
                 stats: RunStats):
        tg = self.tg = engine.tg
        self.engine = engine
        self.session, self.callbacks, self.stats, self.cancel = session, callbacks, stats, spec.cancel
        prio = engine.priority() if spec.order == "priority" else ()
        self.queues = [ReadyQueue(spec.order, prio, spec.seed + d) for d in range(session.lanes)]
        # per queue, its push bound once (fifo / lifo: the deque's own append, no method of ours)
        self.pushes = [q.items.append if spec.order in ("fifo", "lifo") else q.push for q in self.queues]
        self.lane_of = engine.lanes(session)  # per task, its lane (read for every task made ready)
        self.counters = engine.dep_counts.copy()
        self.roots = engine.roots
        self.dependents = tg.dependents
        self.frees = engine.frees
        self.remaining = len(tg.tasks)
        self.error: tuple[Task, BaseException] | None = None
        self.stop = False
        self.lock = threading.Lock()
        # one condition per queue (all on one lock): a finished task wakes only the workers whose
        # queues it filled, not every thread (each wake-up costs a GIL hand-over)
        self.conds = [threading.Condition(self.lock) for _ in self.queues]
        self.waiting = [False] * len(self.queues)  # per queue: its worker waits on its condition
        # a free made ready by a task of its own lane runs at once, under the lock, in the worker
        # that finished that task (it drops one block from the store only that worker writes):
        # half a step's tasks are frees, and a trip through the queue cost more than the free
        self.free_now = not callbacks

    def run(self) -> None:
        """Seed the queues, drive the workers, raise what stopped the run."""
        lane_of = self.lane_of
        for tid in self.roots:
            self.queues[lane_of[tid]].push(tid)
        unsubscribe = self.cancel.subscribe(self._on_cancel) if self.cancel is not None else (lambda: None)
        try:
            if self.session.threaded:
                pool = self.engine.workers()
                if pool.take():  # else a concurrent run of this engine holds it: threads of its own
                    try:
                        drive_threads(self.worker, len(self.queues), self.tg.n_devices, self.lock, self._halt, pool)
                    finally:
                        pool.give()
                else:
                    drive_threads(self.worker, len(self.queues), self.tg.n_devices, self.lock, self._halt)
            else:
                self.worker(0)
        finally:
            unsubscribe()
        self._outcome()

    def _outcome(self) -> None:
        if self.error is not None:
            t, exc = self.error
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: the user's, as is
                raise exc
            raise TaskFailed(t, exc)
        if self.remaining:
            n = len(self.tg.tasks)
            if self.cancel is not None and self.cancel.cancelled:
                raise EinjoinError(f"run cancelled with {self.remaining} of {n} tasks left")
            raise EinjoinError(f"run stopped with {self.remaining} tasks never ready (a cycle?)")

    def _wake_all(self) -> None:  # under lock
        for c in self.conds:
            c.notify_all()

    def _halt(self) -> None:
        """Stop every worker (a failure, a cancel, a Ctrl-C)."""
        with self.lock:
            self.stop = True
            self._wake_all()

    def _on_cancel(self) -> None:  # the token's listener: wake the waiting workers now
        self._halt()

    def worker(self, q: int) -> None:
        """One lane's worker: pop a ready task, execute it, and — under one hold of the lock —
        release its dependents and pop the next (a lock round trip per task, not two: each
        acquire by a device thread can mean a GIL hand-over)."""
        with _thread_scope(self.session):
            self._work(q)

    def _work(self, q: int) -> None:
        queue, cond, lock, tasks, waiting = self.queues[q], self.conds[q], self.lock, self.tg.tasks, self.waiting
        dispatch = self.dispatch
        # the queue's own container and its pop, bound once (fifo / lifo: the deque's methods)
        items = queue.items
        pop = items.popleft if queue.order == "fifo" else items.pop if queue.order == "lifo" else queue.pop
        complete = self.complete
        plain, execute, clock, iv = not self.callbacks, self.session.execute, time.perf_counter, self.stats.intervals
        t: Task | None = None
        while True:
            with lock:
                if t is not None:
                    complete(t, q)
                # every change a worker waits for notifies it: a task made ready in its queue,
                # the last task done, a failure, a cancel (_on_cancel), a Ctrl-C (drive_threads)
                while not len(items) and self.remaining and not self.stop:
                    if not self.session.threaded:  # one inline worker and nothing ready: stuck
                        self.stop = True
                        break
                    waiting[q] = True
                    try:
                        cond.wait()
                    finally:
                        waiting[q] = False
                if self.stop or not self.remaining:
                    self._wake_all()
                    return
                t = tasks[pop()]
            try:
                if plain:  # dispatch() without callbacks, inline: a call frame and its lookups less per task
                    start = clock()
                    execute(t)
                    iv[t.device].append((start, clock(), t.id))
                else:
                    dispatch(t)
            except BaseException as exc:  # noqa: BLE001 - reported with the task's context
                self.fail(t, exc)
                return

    def dispatch(self, t: Task) -> None:
        """Execute one ready task on the session, between the callbacks, timing it."""
        for cb in self.callbacks:
            cb.on_start(t)
        start = time.perf_counter()
        self.session.execute(t)
        end = time.perf_counter()
        self.stats.intervals[t.device].append((start, end, t.id))
        for cb in self.callbacks:
            cb.on_end(t, start, end)

    def complete(self, t: Task, lane_of: int = -1) -> None:  # under lock
        """Release the task's dependents: those now ready go to their lanes' queues (a worker
        is notified only when it waits: a notify is Python code, and a busy worker finds the
        task when it looks next). ``lane_of``: the lane of the worker that ran ``t``; a free of
        that lane made ready runs now, in this worker (:attr:`free_now`)."""
        counters, lanes, waiting, frees = self.counters, self.lane_of, self.waiting, self.frees
        now = lane_of if self.free_now else -2  # the lane whose frees run here (-2: none)
        done = 1
        for dep in self.dependents[t.id]:
            counters[dep] -= 1
            if counters[dep] == 0:
                q = lanes[dep]
                if q == now and frees[dep]:
                    d = self.tg.tasks[dep]
                    start = time.perf_counter()
                    self.session.execute(d)
                    self.stats.intervals[d.device].append((start, time.perf_counter(), dep))
                    if frees[dep] == 1:  # nothing waits for it
                        done += 1
                    else:
                        self.complete(d, lane_of)
                    continue
                self.pushes[q](dep)
                if waiting[q]:
                    self.conds[q].notify()  # one worker per queue: notify() reaches it
        self.remaining -= done
        self.stats.tasks_run += done
        if not self.remaining:
            self._wake_all()

    def fail(self, t: Task, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = (t, exc)
            self.stop = True
            self._wake_all()


def lane_name(q: int, n_devices: int) -> str:
    """The name of lane ``q``'s thread: a device's compute lane, or its host-transfer lane."""
    return f"einjoin-dev{q}" if q < n_devices else f"einjoin-host{q - n_devices}"


def drive_threads(worker: Callable[[int], None], n_lanes: int, n_devices: int, lock: threading.Lock,
                  halt: Callable[[], None], pool: WorkerPool | None = None) -> None:
    """Run one worker per lane, each on a thread; returns only once every worker has ended, also
    after a Ctrl-C (which then stops the workers and goes on). ``pool``: the lanes run on its
    persistent threads (:mod:`einjoin.runtime.workers`), which live on, idle, after the run (when
    another run holds it, or without one, a thread is started per lane and joined at the end).

    The threads are counted under the run's lock (begun, ended), never waited for with
    ``join()``/``is_alive()``: an interrupt that lands inside ``Thread.join`` marks a live thread
    stopped (CPython bpo-45274), so a join after it returns while the worker still runs tasks.
    Nor does this (the main) thread wait on a condition of the run's lock: a Ctrl-C that lands
    while ``Condition.wait`` re-takes the lock leaves it not taken, and leaving the ``with``
    block then releases the lock a worker holds — two threads in the queues at once, a run that
    never ends. It sleeps on a C-level ``SimpleQueue`` instead, which every ending worker feeds:
    an interrupt there changes nothing shared. It sleeps in slices (:data:`WAIT_SLICE`), never
    unboundedly: a Ctrl-C landing just before it blocks is seen at the end of the slice, not once
    the run ends -- or never, under a tracer (see :mod:`einjoin.runtime.backend`). Every wait, every
    ``halt()`` and the inner loops' back edges are inside the ``try``: an interrupt cuts short only
    an idempotent step, which the next pass repeats (what is left outside is the outer loop's back
    edge, taken right after a caught interrupt: only a second Ctrl-C landing there escapes)."""
    ended: queue.SimpleQueue[int] = queue.SimpleQueue()
    count = {"begun": 0, "ended": 0, "launched": 0}
    began = [threading.Event() for _ in range(n_lanes)]

    def guarded(q: int) -> None:
        with lock:
            count["begun"] += 1
        began[q].set()  # after the count: whoever sees it set finds the thread counted
        try:
            worker(q)
        finally:
            with lock:
                count["ended"] += 1
            ended.put(q)  # wakes the main thread (after the count: it finds this thread counted)

    interrupted: BaseException | None = None
    started: list[threading.Thread | None] = []
    starting: tuple[int, threading.Thread | None] | None = None
    th: threading.Thread | None
    try:  # the starts too: a Ctrl-C may land while the first workers already run
        for q in range(n_lanes):
            starting = None
            if pool is not None:  # a posted job begins at once: its thread waits for it
                starting = (q, None)
                pool.post(q, functools.partial(guarded, q))
                started.append(None)
            else:
                th = threading.Thread(target=guarded, args=(q,), daemon=True, name=lane_name(q, n_devices))
                starting = (q, th)
                th.start()
                started.append(th)
            starting = None
            with lock:
                count["launched"] += 1
    except BaseException as e:  # KeyboardInterrupt, or no thread could be started
        interrupted = e
        halt()  # a worker whose start was cut short but that runs anyway finds stop set (again below)
        if starting is not None:
            # Thread.start() waits for the new thread to begin: an interrupt there leaves one
            # that exists (it begins at once) or, cut before its creation, none
            q, th = starting
            while True:
                try:
                    if began[q].wait(1.0):
                        started.append(th)
                    break
                except KeyboardInterrupt:
                    pass
    def all_ended() -> bool:
        with lock:  # a launched worker always begins; one that began is counted: wait for both
            return count["ended"] >= max(count["launched"], count["begun"])

    while True:  # the back edge is taken only after an interrupt was caught
        try:
            if interrupted is not None:
                halt()  # stop every worker (again, if a second interrupt cut the first halt short)
            while not all_ended():
                try:
                    ended.get(timeout=WAIT_SLICE)  # a worker ended (its put may predate the check)
                except queue.Empty:
                    pass
            # done with the run: let the threads it started end too (only a pool's outlive run())
            for th in started:
                if th is not None:
                    join_thread(th)
            break
        except KeyboardInterrupt as e:  # stop every worker, wait for them, then re-raise
            interrupted = interrupted or e
    if interrupted is not None:
        raise interrupted
