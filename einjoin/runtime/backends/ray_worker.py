"""The Ray actor body: :class:`DeviceWorker` holds one device's part of each program's task graph
(:class:`Part`, built once per program from the plan shipped once), runs it on an executor
thread of its own, and keeps the state blocks programs leave between runs.
:class:`~einjoin.runtime.backends.ray.RayBackend` starts one per device with ``ray.remote``.

Per run the driver sends each actor one ``go`` (the run id, the feeds' object reference, the
state keys) and waits on one ``finish`` (the actor's report and its output blocks). The actor
runs its tasks as their dependencies finish (a ready queue, as a device thread of the
``threads`` backend does); a ``move`` is a *send* on its source actor, which writes the block to
the destination's block channel when both run on one host (:mod:`.ray_channel`, a Unix socket),
else hands it to the destination's ``deliver`` (a Ray actor call: the block goes through the
object store; never through the driver either way), and a *receive* on the destination that
completes when it has arrived. A
dependency on another device that is not a move's (none in the graphs the planner makes today)
is a ``signal`` from the device that ran it. Runs are independent: each has its own namespace
(store, feeds, intervals, byte counts), and the executor interleaves the ready tasks of every
run in flight, so no run waits for another's to end.

>>> w = DeviceWorker(0)
>>> w.kept_keys(), w.open_runs()
([], [])
"""

from __future__ import annotations

import importlib
import os
import pickle
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.exchange import Task, TaskKind
from einjoin.ir.node import (Attention, AttentionGrad, Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input,
                             Pool, Reshape, ScatterAdd, Select, SparseEinsum, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.ir.evaluate import quiet_floats
from einjoin.plan.execute import compute
from einjoin.runtime.backends.ray_channel import Channel, available

__all__ = ["DeviceWorker", "Part", "RUN", "RECEIVE", "SEND", "FREE", "PRELOAD_FACTS", "preload_modules"]

# what an item of a part does: run a task, take a move's block, send one, free a value
RUN, RECEIVE, SEND, FREE = 0, 1, 2, 3
_KERNEL, _LOAD, _MOVE = TaskKind.KERNEL, TaskKind.LOAD, TaskKind.MOVE
_DEAD_KEPT = 4096              # run ids remembered as aborted (late deliveries for them are dropped)

# What a kind's block kernels import on first use beyond einjoin and numpy: an actor imports it
# ahead of a program's first run (torch costs ~2.3 s of CPU to import, more than such a run), so
# a program without these kinds never loads torch into its actors.
PRELOAD_FACTS: dict[type, tuple[str, ...]] = {
    Input: (), Einsum: (), Reshape: (), Broadcast: (), Select: (), Concat: (), Fill: (), Gather: (),
    ScatterAdd: (), Cast: (),
    Conv: ("torch",), Pool: ("torch",), TopK: ("torch",),        # torch's conv, pool and sort loops
    RotateHalf: (),
    Attention: ("torch",), AttentionGrad: ("torch",),            # torch's fused flash kernels
    SparseEinsum: ("einjoin.sparse",),                           # the sparse engine (scipy.sparse)
}


def preload_modules(nodes: Iterable[Any]) -> tuple[str, ...]:
    """The modules the kernels of ``nodes`` (a graph's) import on first use: their kinds' (:data:`PRELOAD_FACTS`),
    and ml_dtypes for a bfloat16 value (its numpy dtype; ~2 s to import).

    >>> import einjoin as ej
    >>> x = ej.input("x", (4, 4))
    >>> preload_modules(ej.Graph(x @ x)), preload_modules(ej.Graph(ej.attention(x, x, x)))
    ((), ('torch',))
    """
    found: dict[str, None] = {}
    for n in nodes:
        found.update(dict.fromkeys(rule_for(PRELOAD_FACTS, n.op, "the modules its kernels import "
                                            "(einjoin.runtime.backends.ray_worker.PRELOAD_FACTS)")))
        if n.dtype == "bfloat16":
            found["ml_dtypes"] = None
    return tuple(found)


class Part:
    """Device ``device``'s part of a task graph: its *items* (its tasks; the receive of each move
    to it; the send of each move from it), each with the count of what it waits for and the
    items that wait for it, the remote events each item waits for (a move's block, another
    device's signal), and whom each item signals when done.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (4, 4)); prog = ej.compile([(x @ x).sum()], 2, planner="split_largest", quiet=True)
    >>> parts = [Part(prog.taskgraph, prog.plan.decomps, d) for d in range(2)]
    >>> sum(len(p.items) for p in parts) == len(prog.taskgraph.tasks) + sum(
    ...     t.kind.value == "move" for t in prog.taskgraph.tasks)
    True
    """

    def __init__(self, tg: Any, decomps: Mapping[Any, Any], device: int):
        from einjoin.runtime.fastkernels import prepare_kernels
        tasks: Sequence[Task] = tg.tasks
        self.device = d = device
        self.items: list[tuple[int, int]] = []      # (RUN | RECEIVE | SEND, task id)
        at: dict[tuple[int, int], int] = {}          # (device, task id) -> the item completing it there
        for t in tasks:
            if t.device == d:
                at[(d, t.id)] = len(self.items)
                self.items.append((RECEIVE if t.kind is _MOVE else FREE if t.kind.releases else RUN, t.id))
            if t.kind is _MOVE and t.payload.src_device == d:
                at[(d, -1 - t.id)] = len(self.items)  # the send, a dependency of the source's own tasks
                self.items.append((SEND, t.id))
        self.waiting = [0] * len(self.items)        # per item: what it waits for
        self.then: list[list[int]] = [[] for _ in self.items]  # per item: the items waiting for it
        self.events: dict[int, list[int]] = {}      # task id -> the items its remote event releases
        self.signals: dict[int, list[int]] = {}     # item -> devices to signal when it is done
        for w, tid, u in _edges(tasks):             # every "item on device w waits for task u"
            done_on, key = _provider(tasks, w, u)
            if w == d:
                i = at[(d, tid)]
                self.waiting[i] += 1
                if done_on == d:
                    self.then[at[(d, key)]].append(i)
                else:
                    self.events.setdefault(u, []).append(i)
            elif done_on == d:  # another device waits for a task of ours: tell it when done
                self.signals.setdefault(at[(d, key)], []).append(w)
        for i, (kind, tid) in enumerate(self.items):
            if kind == RECEIVE:  # its block, sent by the source
                self.waiting[i] += 1
                self.events.setdefault(tid, []).append(i)
        self.tasks = {tid: tasks[tid] for _, tid in self.items}
        self.n_local = sum(kind != SEND for kind, _ in self.items)
        self.shapes = {t.writes: tg.values[t.writes].shape for t in self.tasks.values() if t.writes >= 0}
        self.decomps = {t.node: decomps[t.node] for t in self.tasks.values()
                        if t.kind is _KERNEL and t.node in decomps}
        fast = prepare_kernels(tg, self.decomps) if self.decomps else []
        self.fast = {tid: fast[tid] for kind, tid in self.items if kind == RUN and fast and fast[tid] is not None}


def _edges(tasks: Sequence[Task]) -> Any:
    """Every dependency as (device of the waiting item, its key, task waited for): a task's on its
    device (key: its id); a move's split between its sides: those on its destination are the
    receive's, every other the send's (on the source; key: -1 - id)."""
    for t in tasks:
        if t.kind is _MOVE:
            src = t.payload.src_device
            for u in t.deps:
                if tasks[u].device == t.device:
                    yield t.device, t.id, u
                else:
                    yield src, -1 - t.id, u
        else:
            for u in t.deps:
                yield t.device, t.id, u


def _provider(tasks: Sequence[Task], w: int, u: int) -> tuple[int, int]:
    """Where device ``w`` learns that task ``u`` is done, and that item's key there: its own item
    (u on ``w``, or the send of a move from ``w``: the block is handed over), else u's device."""
    t = tasks[u]
    if t.device != w and t.kind is _MOVE and t.payload.src_device == w:
        return w, -1 - u
    return t.device, u


class _Run:
    """One run's namespace on one actor."""

    __slots__ = ("id", "part", "feeds", "store", "intervals", "received_from", "delay", "resident", "keep",
                 "fetch", "waiting", "left", "tasks_left", "blocks", "blas", "out_to")

    def __init__(self, run: int, part: Part, feeds: Mapping[Any, np.ndarray], delay: float,
                 resident: dict[int, np.ndarray], keep: Mapping[int, int], fetch: Sequence[int], blas: int = 0):
        from einjoin.runtime.local import Store
        self.id, self.part, self.feeds = run, part, feeds
        self.store = Store.make(part.device, shared=False)  # only the executor thread writes it
        self.intervals: list[tuple[int, float, float]] = []
        self.received_from: dict[int, int] = {}
        self.delay = delay
        self.resident = resident     # load task id -> the state block kept here (nothing is loaded)
        self.keep, self.fetch = keep, fetch
        self.waiting = list(part.waiting)
        self.left = len(part.items)
        self.tasks_left = part.n_local      # of them, the tasks of this device (not the sends)
        self.blocks: dict[int, tuple[int, np.ndarray]] = {}  # move id -> (source, block) arrived
        self.blas = blas
        self.out_to: str | None = None   # the driver's channel, for the fetch blocks


class DeviceWorker:
    """The actor body: one device's parts of the programs' task graphs (``plans``: key ->
    :class:`Part`), the runs in flight, an executor thread, and the state blocks kept between
    runs. Ray calls ``go`` / ``deliver`` / ``signal`` on the actor's default thread (they only
    queue work), ``finish`` on a thread of a group of its own (it waits), ``abort`` on the
    control thread."""

    def __init__(self, device: int, blas_threads: int = 1, channel: str | None = None, secret: bytes = b""):
        from einjoin.runtime.malloc import tune_malloc
        # (wall, CPU) when the actor began (its class loaded: einjoin imported) and when preload
        # ended: where a first run's time goes (bench/ray_exec.py's first-run table reads them)
        self.started: tuple[float, float] = (time.time(), time.process_time())
        self.preloaded: tuple[float, float] | None = None
        tune_malloc()  # as the local backends: freed blocks stay in the process (no fault-in per kernel output)
        self.device = device
        self._blas = 0
        self._limit_blas(blas_threads)
        self.plans: dict[int, Part] = {}
        self.peers: list[Any] = []
        self.names: list[str | None] = []   # per device, the name its actor's channel listens on
        self._channel: Channel | None = None
        if channel is not None and available():
            self._channel = Channel(channel, secret, self._from_channel)
        self.kept: dict[int, np.ndarray] = {}  # programs' state blocks, kept between runs by key
        self._cv = threading.Condition()
        self._runs: dict[int, _Run] = {}
        self._early: dict[int, list[tuple[Any, ...]]] = {}  # events that came before their run's go
        self._reports: dict[int, dict[str, Any]] = {}   # finished runs' reports, until ``finish`` takes them
        self._ending: list[tuple[_Run, dict[str, Any]]] = []  # runs done, their outputs not yet sent
        self._dead: OrderedDict[int, None] = OrderedDict()  # aborted or failed runs
        self._ready: deque[tuple[_Run, int]] = deque()
        self._executor: threading.Thread | None = None
        # held by the executor thread around each item and by ``preload`` around its imports: two
        # threads importing torch at once can deadlock in Python's per-module import locks, which
        # Python breaks by handing one of them the partially initialised module (a kernel then
        # failed with "partially initialized module 'torch'")
        self._imports = threading.Lock()

    def _limit_blas(self, threads: int) -> None:
        """BLAS threads of this process (the actor serves programs of several device counts: each
        run says what its own wants, applied when it differs from the last)."""
        from threadpoolctl import threadpool_limits
        threads = max(1, threads)
        if threads != self._blas:
            self._limits = threadpool_limits(limits=threads)
            self._blas = threads

    def pid(self) -> int:
        return os.getpid()

    def preload(self, modules: Sequence[str]) -> None:
        """Import ``modules`` now (the driver calls it on a thread of the ``wait`` group when the
        actor starts, so it overlaps the driver's planning and never holds up the calls of a
        run): the first run's kernels then find them loaded. A module that fails to import is
        left to the kernel that needs it, which says why."""
        with self._imports:
            for m in modules:
                try:
                    importlib.import_module(m)
                except Exception:  # noqa: BLE001 - the kernel's own import raises it, named, in its run
                    pass
            self.preloaded = (time.time(), time.process_time())

    def call(self, fn: Any, args: Sequence[Any], blas_threads: int = 0) -> Any:
        """``fn(*args)`` on this device's process (work that is no task graph: a sparse einsum's
        per-device part, :mod:`einjoin.sparse.distribute`), BLAS at ``blas_threads`` when > 0."""
        if blas_threads > 0:
            self._limit_blas(blas_threads)
        with self._imports:  # as the executor's items: never beside preload's imports
            return fn(*args)

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def set_peers(self, peers: Sequence[Any], names: Sequence[str | None] = ()) -> None:
        """The actor handles of the pool, by device: where sends go; ``names``: the names their
        channels listen on (:mod:`~einjoin.runtime.backends.ray_channel`: a block for a peer on this
        host goes over a socket, else by a Ray call of its ``deliver``)."""
        self.peers = list(peers)
        self.names = list(names) or [None] * len(self.peers)

    def setup(self, key: int, plan: Any) -> None:
        """Build and keep this device's part of the plan (task graph, decompositions) ``key``."""
        tg, decomps = plan
        self.plans[key] = Part(tg, decomps, self.device)

    def forget(self, keys: Sequence[int]) -> None:
        """Drop the parts of programs that are gone (so ``plans`` does not grow for ever)."""
        for k in keys:
            self.plans.pop(k, None)

    # -- a run: go (queue its first tasks), events from the peers, finish (wait for its report)
    def go(self, run: int, key: int, feeds: Mapping[Any, np.ndarray], delay: float = 0.0,
           resident: Mapping[int, int] | None = None, keep: Mapping[int, int] | None = None,
           fetch: Sequence[int] = (), blas: int = 0, fresh: Mapping[Any, np.ndarray] | None = None,
           outputs_to: str | None = None) -> None:
        """Start run ``run`` of plan ``key``. ``delay``: a test hook, seconds slept before every
        kernel (so a fault or a cancel lands while work is outstanding); ``resident``: load task
        id -> the kept state block that load takes (nothing is loaded); ``keep``: value id -> the
        key its block is kept under when the run ends (a program's new state); ``fetch``: the
        output blocks returned by ``finish``; ``blas``: the BLAS threads its kernels use (0: as
        they are); ``fresh``: feeds that replace some of ``feeds`` (the driver puts only the feeds that
        differ from an earlier run's, whose object ``feeds`` is); ``outputs_to``: the name of the
        driver's channel, where the ``fetch`` blocks go when it can be reached (the report lists
        them as ``sent``), else in the report."""
        part = self.plans.get(key)
        if part is None:
            raise RuntimeError(f"device {self.device} has no plan {key} (its actor was replaced)")
        with self._cv:
            if run in self._dead:  # aborted before it began here
                return
            if resident and any(k not in self.kept for k in resident.values()):
                raise RuntimeError(f"device {self.device} no longer holds this program's state (its actor was "
                                   f"replaced): write_state() it again")
            if fresh:
                feeds = {**feeds, **fresh}
            r = _Run(run, part, feeds, float(delay), {t: self.kept[k] for t, k in (resident or {}).items()},
                     dict(keep or {}), list(fetch), blas)
            r.out_to = outputs_to
            self._runs[run] = r
            self._ready.extend((r, i) for i, n in enumerate(r.waiting) if n == 0)
            for event in self._early.pop(run, ()):
                self._event(r, *event)
            if r.left == 0:
                self._complete(r)
            self._start()
            self._cv.notify_all()
        if self._ending:
            self._publish()

    def deliver(self, run: int, tid: int, src: int, block: np.ndarray) -> None:
        """Move ``tid``'s block, sent by device ``src`` (a zero-copy, read-only view of the object
        store: only read by later tasks)."""
        self._arrive(run, tid, (src, block))

    def _from_channel(self, run: int, tid: int, src: int, block: np.ndarray) -> None:
        """A block that came over the channel (on its reader thread): as ``deliver``."""
        self._arrive(run, tid, (src, block))

    def signal(self, run: int, tid: int) -> None:
        """Task ``tid`` of another device is done (a dependency that moves no block)."""
        self._arrive(run, tid, None)

    def _arrive(self, run: int, tid: int, block: tuple[int, np.ndarray] | None) -> None:
        with self._cv:
            r = self._runs.get(run)
            if r is not None:
                self._event(r, tid, block)
                self._cv.notify_all()
            elif run not in self._dead and run not in self._reports:
                self._early.setdefault(run, []).append((tid, block))

    def _event(self, r: _Run, tid: int, block: tuple[int, np.ndarray] | None) -> None:  # under _cv
        if block is not None:
            r.blocks[tid] = block
        for i in r.part.events.get(tid, ()):
            r.waiting[i] -= 1
            if r.waiting[i] == 0:
                self._ready.append((r, i))

    def finish(self, run: int) -> dict[str, Any] | None:
        """Wait for the run's end here: its report (bytes, peak, intervals, the ``fetch`` blocks),
        ``{"failed": (task id, error)}`` for a task that raised, None when it was aborted."""
        with self._cv:
            while run not in self._reports and run not in self._dead:
                self._cv.wait()
            report: dict[str, Any] | None = self._reports.pop(run, None)
            return report

    def abort(self, run: int) -> int:
        """Drop the run here (called on the control thread, at once): its queued tasks are
        skipped, its blocks dropped, a late ``go`` or block for it ignored, a waiting ``finish``
        answered None. Returns how many of its tasks had not run here, or -1 when the run is not
        here (its ``go`` has not run yet, or it finished): the driver tells which."""
        with self._cv:
            r = self._runs.pop(run, None)
            self._bury(run)
            self._early.pop(run, None)
            self._reports.pop(run, None)
            self._cv.notify_all()
            return r.tasks_left if r is not None else -1

    def _bury(self, run: int) -> None:  # under _cv
        self._dead[run] = None
        while len(self._dead) > _DEAD_KEPT:
            self._dead.popitem(last=False)

    # -- the executor thread
    def _start(self) -> None:  # under _cv
        if self._executor is None:
            self._executor = threading.Thread(target=self._execute, name=f"einjoin-device-{self.device}",
                                              daemon=True)
            self._executor.start()

    def _execute(self) -> None:
        # numpy's errstate held for the thread's life (it only runs items), as a local device's
        # worker holds it per run: compute() then skips entering it per task (~2 us each)
        with quiet_floats():
            self._loop()

    def _loop(self) -> None:
        # one lock section per item: the last item's dependents released, the next item taken
        cv, ready, runs, ending = self._cv, self._ready, self._runs, self._ending
        item, done, imports = _unshimmed(self, "_item"), _unshimmed(self, "_done"), self._imports
        last: tuple[_Run, int] | None = None
        while True:
            with cv:
                if last is not None:
                    done(*last)
                    last = None
                publish = bool(ending)
                if not publish:
                    while not ready:
                        cv.wait()
                    r, i = ready.popleft()
                    if runs.get(r.id) is not r:  # aborted or failed: its items are skipped
                        continue
            if publish:  # a run ended here: its outputs go out, outside the lock
                self._publish()
                continue
            try:
                with imports:  # never beside preload's imports (see __init__)
                    item(r, i)
            except BaseException as e:  # noqa: BLE001 - the run fails, the actor carries on
                with cv:
                    if runs.pop(r.id, None) is r:
                        self._bury(r.id)
                        self._reports[r.id] = {"failed": (r.part.items[i][1], _picklable(e))}
                        cv.notify_all()
                continue
            for w in r.part.signals.get(i, ()):  # outside the lock: a Ray call
                self.peers[w].signal.remote(r.id, r.part.items[i][1])
            last = (r, i)

    def _done(self, r: _Run, i: int) -> None:  # under _cv: item i of run r ran
        if self._runs.get(r.id) is not r:
            return
        part, waiting, ready = r.part, r.waiting, self._ready
        for j in part.then[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                if part.items[j][0] == SEND:
                    ready.appendleft((r, j))  # a send first: another device waits for it
                else:
                    ready.append((r, j))
        r.left -= 1
        if part.items[i][0] != SEND:
            r.tasks_left -= 1
        if r.left == 0:
            self._complete(r)

    def _item(self, r: _Run, i: int) -> None:
        """Do item ``i`` of run ``r`` (on the executor thread)."""
        part = r.part
        kind, tid = part.items[i]
        t = part.tasks[tid]
        store = r.store
        if kind == SEND:
            # over the channel to a peer on this host (written out before send returns); else by
            # Ray: the block goes into the object store as the call is made. The source may free it now
            block, name, ch = store.get(t.reads[0]), self.names[t.device], self._channel
            if ch is None or name is None or not ch.send(name, r.id, tid, self.device, block):
                self.peers[t.device].deliver.remote(r.id, tid, self.device, block)
            return
        start = time.time()
        if kind == RECEIVE:
            src, block = r.blocks.pop(tid)
            store.put(t.writes, block, block.nbytes)
            store.received += block.nbytes   # counted here, at the receiving device
            r.received_from[src] = r.received_from.get(src, 0) + block.nbytes
        elif kind == FREE:  # memory caps, hence evictions, are refused on Ray
            store.free(t.payload.frees)
        else:
            tk = t.kind
            if tk is _KERNEL:
                if r.blas and r.blas != self._blas:
                    self._limit_blas(r.blas)
                if r.delay:
                    time.sleep(r.delay)
            kept = r.resident.get(tid) if tk is _LOAD else None
            if kept is not None:  # a state block the last run left here: nothing is loaded
                store.put(t.writes, kept, kept.nbytes)
            else:
                value = compute(t, store.get, r.feeds, part.decomps, part.shapes[t.writes], part.fast.get(tid))
                store.put(t.writes, value, value.nbytes)
                if tk is _LOAD:
                    store.loaded += value.nbytes
        r.intervals.append((tid, start, time.time()))

    def _complete(self, r: _Run) -> None:  # under _cv: every item ran
        del self._runs[r.id]
        s = r.store
        for vid, k in r.keep.items():
            self.kept[k] = s.get(vid)
        self._ending.append((r, {"received": s.received, "loaded": s.loaded, "peak": s.peak,
                                 "intervals": r.intervals, "received_from": r.received_from,
                                 "fetch": {v: s.get(v) for v in r.fetch}}))

    def _publish(self) -> None:
        """Send the output blocks of the runs that ended (:meth:`_complete`), then make their reports,
        which ``finish`` returns. Not under ``_cv``: a send waits while the driver's socket buffer is
        full, and the actor's other calls (``abort``, ``deliver``, other runs' items) go on meanwhile."""
        with self._cv:
            ending = self._ending[:]
            del self._ending[:]
        for r, report in ending:
            report.update(self._outputs(r, report.pop("fetch")))
            with self._cv:
                if r.id not in self._dead:  # else aborted meanwhile: nobody waits for it
                    self._reports[r.id] = report
                    self._cv.notify_all()

    def _outputs(self, r: _Run, fetch: Mapping[int, np.ndarray]) -> dict[str, Any]:
        """The run's output blocks: over the channel to the driver when it is on this host (a
        block in a Ray reply goes through the object store: ~2 ms more for 512 KB, measured),
        else in the report."""
        blocks, sent, ch = {}, [], self._channel
        for v, b in fetch.items():
            if r.out_to is not None and ch is not None and ch.send(r.out_to, r.id, v, self.device, b):
                sent.append(v)
            else:
                blocks[v] = b
        return {"blocks": blocks, "sent": sent}

    # -- state kept between runs
    def release(self, keys: Sequence[int]) -> None:
        """Drop kept state blocks (replaced by a later run's, or of a failed run)."""
        with self._cv:
            for k in keys:
                self.kept.pop(k, None)

    def read(self, keys: Sequence[int]) -> list[np.ndarray]:
        """Kept state blocks (``Program.read_state``)."""
        with self._cv:
            return [self.kept[k] for k in keys]

    def kept_keys(self) -> list[int]:
        """The keys of the state blocks kept here (tests: one step's blocks, none leaked)."""
        with self._cv:
            return sorted(self.kept)

    def open_runs(self) -> list[int]:
        """The runs with anything here (tests: none after every run ended)."""
        with self._cv:
            return sorted({*self._runs, *self._early, *self._reports})


def _unshimmed(worker: DeviceWorker, name: str) -> Any:
    """``worker``'s method ``name`` as its class defines it (a subclass's override included), without
    the tracing shim ``ray.remote`` wraps every method of the actor's class in (~1-2 us a call; the
    executor makes two per item): looked up on the class the actor was made from."""
    cls = getattr(type(worker), "__ray_actor_class__", type(worker))
    return getattr(cls, name).__get__(worker, cls)


def _picklable(e: BaseException) -> BaseException:
    """``e``, or a RuntimeError saying what it was when it cannot travel back to the driver."""
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")
