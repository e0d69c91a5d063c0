"""Devices in this process: a :class:`Store` per device (its blocks and byte accounting) and the
:class:`LocalSession` that executes a task on them — what the ``sync``, ``threads`` and ``null``
backends open for a run (:mod:`einjoin.runtime.backend`). The Ray actors keep their blocks in
the same :class:`Store`.

>>> s = Store(0); s.put(3, None, 64); s.live, s.peak
(64, 64)
>>> s.free(3); s.live, s.peak
(0, 64)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from einjoin.exchange import Task, TaskKind
from einjoin.ir.attention import ForwardMemo, forward_memo
from einjoin.ir.evaluate import QUIET_FLOATS, quiet_floats
from einjoin.ir.node import Node
from einjoin.plan.execute import assemble_output, assemble_outputs, compute, from_host, to_host
from einjoin.plan.fuse_inplace import engine_donations
from einjoin.runtime import blockpool
from einjoin.runtime.blockpool import engine_pool
from einjoin.runtime.backend import RunSpec
from einjoin.runtime.outputs import OutputSlots, output_plan

if TYPE_CHECKING:
    from einjoin.runtime.engine import RunStats

__all__ = ["Store", "SoloStore", "LocalSession"]

# the kinds and groups execute() asks about, read once (TaskKind's properties stay the definition)
_MOVE, _LOAD, _KERNEL, _RELOAD, _EVICT, _TOUCH, _FREE = (TaskKind.MOVE, TaskKind.LOAD, TaskKind.KERNEL,
                                                         TaskKind.RELOAD, TaskKind.EVICT, TaskKind.TOUCH,
                                                         TaskKind.FREE)
# compute() as imported: _kernel calls a prepared kernel directly only while this module's
# compute is still it (a test or a profiler that wraps local.compute sees every task again)
_COMPUTE = compute
_RELEASES = frozenset(k for k in TaskKind if k.releases)
_TO_HOST = frozenset(k for k in TaskKind if k.to_host)
_CROSSES_HOST = frozenset(k for k in TaskKind if k.crosses_host)


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
        self.copied = 0  # of the received bytes, those copied (not a block handed over)
        self.loaded = 0
        self.evicted = 0
        self.reloaded = 0
        self.lock: Any = threading.Lock()

    @staticmethod
    def make(device: int, shared: bool = True) -> Store:
        """A store for ``device``: locked when several threads write it (a device's compute and
        host lanes, a Ray actor's threads), else a :class:`SoloStore`, which skips the lock (a
        task's bookkeeping is a few dict operations, and an uncontended lock costs as much again)."""
        return Store(device) if shared else SoloStore(device)

    def reserve(self, vid: int, nbytes: int, scratch: int = 0) -> None:
        """Count a value about to be written (once) and the task's scratch, before it runs."""
        with self.lock:
            self._reserve(vid, nbytes, scratch)

    def _reserve(self, vid: int, nbytes: int, scratch: int = 0) -> None:
        if vid >= 0 and vid not in self.sizes:
            self.sizes[vid] = nbytes
            self.live += nbytes
        self.live += scratch
        if self.live > self.peak:
            self.peak = self.live

    def unreserve(self, scratch: int) -> None:
        with self.lock:
            self.live -= scratch

    def _unreserve(self, scratch: int) -> None:
        self.live -= scratch

    def put(self, vid: int, value: Any, nbytes: int) -> None:
        self.reserve(vid, nbytes)
        self.values[vid] = value

    def get(self, vid: int) -> Any:
        return self.values.get(vid)

    def free(self, vid: int) -> None:
        with self.lock:
            self._free(vid)

    def _free(self, vid: int) -> None:
        self.values.pop(vid, None)
        self.live -= self.sizes.pop(vid, 0)


class SoloStore(Store):
    """A :class:`Store` only one thread writes: its bookkeeping without the lock. (A subclass,
    not the unlocked methods bound onto the instance: a store holding its own bound methods is
    a reference cycle, so every run's stores -- and the blocks left in them, such as the last
    step's state -- lived on until the cyclic garbage collector ran: 48 MiB more per step of
    the MLP training benchmark, every allocation then a fresh mapping, 1.10x -> 1.26x torch.)"""

    reserve = Store._reserve
    unreserve = Store._unreserve
    free = Store._free


def _own(value: np.ndarray, t: Task, get: Callable[[int], Any], feeds: Mapping[Node, np.ndarray]
         ) -> np.ndarray:
    """Under a memory cap every block owns its bytes: a load is a real copy of the feed, and a
    kernel output that is a view of an input block (a reshape, a slice, a broadcast) is copied,
    so that freeing or evicting the input really releases it."""
    sources = [feeds[t.node]] if t.kind is TaskKind.LOAD else [get(v) for v in t.reads]
    if any(s is not None and np.may_share_memory(value, s) for s in sources):
        return np.array(value, order="C")
    return value


def _torch_threads_here(n: int) -> None:
    """torch's intra-op threads on this thread: ``n``. With OpenMP, torch's count is a per-thread
    setting (``omp_set_num_threads`` on the thread that asks), so the limit set on the first
    lane in left the other lanes at their own count (2 on 2 cores: their torch kernels opened a
    team of two OpenMP threads on cores the other lane computed on, and spun; the small LLaMA
    step's attention gradients took ~4x their CPU). A lane's thread is the runtime's own, so it
    keeps the share (the next run sets its own)."""
    import torch  # loaded: the limit found it so
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


class LocalSession:
    """One run on devices in this process: a store per device, a host store for a memory-capped
    graph, and the task semantics of :func:`einjoin.plan.execute.compute`. ``threaded``: one
    worker lane per device (plus a host-transfer lane per device when the graph is capped or a
    host link is emulated, so transfers overlap compute), held under ``limit`` (the BLAS share);
    else one inline lane. ``computes`` False: values are not computed, only counted (null)."""

    eager: Literal[False] = False

    def __init__(self, run: RunSpec, computes: bool, threaded: bool,
                 limit: Callable[[int], AbstractContextManager[Any]] | None = None):
        tg = run.engine.tg
        self.tg, self.decomps, self.feeds = tg, run.engine.decomps, run.feeds
        self.n = n = tg.n_devices
        self.capped = tg.memory is not None
        self.computes, self.threaded = computes, threaded
        self.host_link = run.host_link
        self.host_lanes = threaded and (self.capped or run.host_link is not None)
        self.lanes = (2 * n if self.host_lanes else n) if threaded else 1
        if self.lanes == 1:
            self.threaded = False  # one lane: its worker runs inline (no thread to start and hand over to)
        # what lane() depends on besides the task: the engine keeps each task's lane per key
        self.lane_key = ("local", self.threaded, self.host_lanes, n)
        # value id -> its shape (an attribute chain, read per task)
        self.shapes = getattr(run.engine, "shapes", None) or [v.shape for v in tg.values]
        # a store is written by one thread unless a host lane shares it with its compute lane
        self.stores = [Store.make(d, shared=self.host_lanes) for d in range(n)]
        self.planned = getattr(run.engine, "planned", None) or [v.nbytes for v in tg.values]
        # per task, its einsum kernel prepared once per engine (None: the general path)
        fast = getattr(run.engine, "fast_kernels", None) if computes else None
        self.fast: list[Any] = fast() if fast is not None else [None] * len(tg.tasks)
        self.host: dict[int, np.ndarray] = {}  # the host store of a memory-capped graph
        self._limit = limit
        self._stack = contextlib.ExitStack()
        # a threaded run's lanes hold the limit (see _lanes_limit): how many are in, what they entered
        self._lock = threading.Lock()
        self._held = 0
        self._limit_cm: AbstractContextManager[Any] | None = None
        self._limit_error: BaseException | None = None
        self._torch_threads: int | None = None  # torch's intra-op threads under the limit (a lane's share)
        self.state = run.state  # a program's state (einjoin.runtime.state), or None
        # the run's attention forwards, for their gradient kernels (bound to each worker thread)
        self.memo = ForwardMemo() if computes else None
        # outputs of several blocks: allocated now, each block lands in its slot as it is written
        # (einjoin.runtime.outputs); not under a cap (outputs end in the host store) or with state
        self.slots = OutputSlots(output_plan(run.engine)) if computes and not self.capped and self.state is None \
            else None
        self.views = self.slots.views if self.slots is not None else {}
        # kernels computed on numpy blocks that need not own their bytes take _kernel's short path
        self.plain_kernels = computes and not self.capped
        # elementwise kernels that may write into a dying input block (not with state: its blocks live on)
        self.donations = engine_donations(run.engine) if self.plain_kernels and self.state is None else {}
        # large blocks written into a program's arrays kept between runs (einjoin.runtime.blockpool)
        self.pool = engine_pool(run.engine) if blockpool.POOL_BLOCKS and self.plain_kernels \
            and self.state is None else None
        self.pooled = self.pool.kernels if self.pool is not None else {}

    def __enter__(self) -> LocalSession:
        if self._limit is not None and not self.threaded:  # threaded: the lanes hold it (_lanes_limit)
            self._stack.enter_context(self._limit(self.n))
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self.memo is not None:
            self.memo.clear()
        out = self._stack.__exit__(*exc)
        if self._limit_error is not None and exc[0] is None:
            raise self._limit_error
        return out

    @contextlib.contextmanager
    def thread_scope(self) -> Iterator[None]:
        """Entered by each thread that executes this run's tasks: binds the run's
        :class:`~einjoin.ir.attention.ForwardMemo` to it (kernels see no session), and holds
        numpy's ``errstate(all="ignore")`` for the whole run
        (:func:`~einjoin.ir.evaluate.quiet_floats`), which :func:`compute` and ``evaluate``
        otherwise enter around every task; and, threaded, the run's share of the cores."""
        with self._lanes_limit(), forward_memo(self.memo), quiet_floats():
            yield

    @contextlib.contextmanager
    def _lanes_limit(self) -> Iterator[None]:
        """A threaded run's share of the cores (``limit``: BLAS and torch threads), held by its
        lanes: the first lane in enters it before any lane runs a task (the others wait on the
        lock), the last lane out leaves it. On the worker threads, not the caller's: the caller
        waits for no limit change (the BLAS limiter changes limits on the thread that asks, when
        that is not the main thread, without a helper thread), and a Ctrl-C, which only the main
        thread receives, cannot cut a change short. A failure to set the limit runs the tasks
        without it and is raised when the session closes."""
        if self._limit is None or not self.threaded:
            yield
            return
        with self._lock:
            if not self._held and self._limit_cm is None:
                entered = self._limit(self.n)
                try:
                    entered.__enter__()
                    self._limit_cm = entered
                    torch = sys.modules.get("torch")
                    # what the limit gave torch, on this thread: the other lanes take it below
                    self._torch_threads = torch.get_num_threads() if torch is not None else None
                except Exception as e:  # noqa: BLE001 - raised at the session's exit
                    self._limit_error = self._limit_error or e
            self._held += 1
            share = self._torch_threads
        if share is not None:
            _torch_threads_here(share)
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1
                held = self._limit_cm
                if not self._held and held is not None:
                    self._limit_cm = None
                    try:
                        held.__exit__(None, None, None)
                    except Exception as e:  # noqa: BLE001 - raised at the session's exit
                        self._limit_error = self._limit_error or e

    def lane(self, t: Task) -> int:
        if not self.threaded:
            return 0
        if self.host_lanes and t.kind in _CROSSES_HOST:
            return t.device + self.n
        return t.device

    def _throttle(self, start: float, nbytes: int) -> None:
        """An emulated host link: the transfer takes at least its bytes over the link's rate."""
        if self.host_link is not None and nbytes:
            rest = nbytes / self.host_link - (time.perf_counter() - start)
            if rest > 0:
                time.sleep(rest)

    def execute(self, t: Task) -> None:
        # the hot path: enum members and groups are module constants (a class attribute or a
        # property costs as much as the rest of a null task), the clock read only for a host link;
        # the two kinds of most tasks first (a small model's training step: 499 kernels and 628
        # frees of 1325 tasks)
        kind = t.kind
        if kind is _KERNEL and self.plain_kernels:
            self._kernel(t)
            return
        if kind is _FREE:
            self.stores[t.device].free(t.payload.frees)
            return
        start = time.perf_counter() if self.host_link is not None else 0.0
        store = self.stores[t.device]
        if kind in _RELEASES:
            if kind in _TO_HOST:
                if self.computes:
                    to_host(t, store.get(t.payload.frees), self.host)
                self._throttle(start, t.nbytes)
                if kind is _EVICT:
                    store.evicted += t.nbytes
            store.free(t.payload.frees)
            return
        planned = self.planned[t.writes]
        scratch = t.scratch
        store.reserve(t.writes, planned, scratch)
        if kind is _LOAD and self.state is not None and self.state.load(t, store, planned):
            return  # a state block the last run left on this device: nothing loaded
        value = None
        if self.computes:
            if kind is _RELOAD:
                value = from_host(t, self.host, self.feeds)
            elif self.views and t.writes in self.views:
                value = self._landed(t, store)
            elif kind is _MOVE and not self.capped:
                # zero-copy: devices in one process share memory, and a block is never written
                # in place once produced (a reduce copies its first partial, a touch fills its
                # own buffer), so a move hands the source block over; it still counts the plan's
                # bytes as moved. Under a cap every block owns its bytes (freeing one must free
                # them), so a capped move copies.
                value = self.stores[t.payload.src_device].get(t.reads[0])
            else:
                # a move reads on its source device and writes on its destination (the store's
                # dictionary's own get: no method of ours per block read)
                get = self.stores[t.payload.src_device].values.get if kind is _MOVE else store.values.get
                value = compute(t, get, self.feeds, self.decomps, self.shapes[t.writes], self.fast[t.id])
                if self.capped and (kind is _LOAD or kind is _KERNEL):
                    value = _own(value, t, get, self.feeds)
        if scratch:
            store.unreserve(scratch)
        # the value was counted by reserve() above (with the plan's bytes): a put would only
        # find it counted, so the value is stored as it is
        store.values[t.writes] = value
        if kind is _KERNEL:
            return
        # count what really arrived: the array's bytes (the null backend has only the plan's)
        nbytes = value.nbytes if value is not None else planned
        if kind is _MOVE:
            store.received += nbytes
            if self.capped:  # else handed over (zero-copy)
                store.copied += nbytes
        elif kind is _LOAD:
            if self.state is not None and t.node in self.state.on_host:
                store.reloaded += nbytes  # state kept in host RAM (a capped graph): a reload
            else:
                store.loaded += nbytes
            self._throttle(start, nbytes)
        elif kind is _RELOAD:
            store.reloaded += nbytes
            self._throttle(start, nbytes)

    def _kernel(self, t: Task) -> None:
        """A kernel task when its value may be a view of its inputs (no cap): :meth:`execute`'s
        path for a kernel with its tests of other kinds left out, and the kernel prepared for it
        (:mod:`einjoin.runtime.fastkernels`) called here, not through :func:`compute` (which
        calls it the same way, inside ``errstate`` unless the thread holds it already), unless
        this module's ``compute`` was replaced (fault injection, profiling: every task goes
        through it then)."""
        w = t.writes
        store = self.stores[t.device]
        scratch = t.scratch
        store.reserve(w, self.planned[w], scratch)
        if self.views and w in self.views:
            value = self._landed(t, store)
        else:
            get = store.values.get
            shape = self.shapes[w]
            fast = self.fast[t.id]
            value = None
            if fast is not None and compute is _COMPUTE and getattr(QUIET_FLOATS, "on", False):
                into = self.donations.get(t.id)  # into a dying input block (plan.fuse_inplace)
                value = into(store.values, self.pool) if into is not None else None
                if value is None:
                    blocks = [get(v) for v in t.reads]
                    pooled = self.pooled.get(t.id)  # into an array of the program's pool
                    value = pooled(blocks) if pooled is not None else None
                    if value is None:
                        value = fast(blocks)
            if value is None or value.shape != shape:  # not prepared for these blocks: the general path
                value = compute(t, get, self.feeds, self.decomps, shape, fast)
        if scratch:
            store.unreserve(scratch)
        store.values[w] = value

    def _landed(self, t: Task, store: Store) -> Any:
        """The block task ``t`` writes, in its output's slot (:mod:`einjoin.runtime.outputs`): a
        matmul kernel computes into it, a touch fills it as its buffer, anything else is copied
        into it (a move's block too: handed over, it would be copied at the end)."""
        slots = self.slots
        assert slots is not None
        view = self.views[t.writes]
        if t.kind is _MOVE:
            return slots.land(self.stores[t.payload.src_device].get(t.reads[0]), view)
        get = store.values.get
        if t.kind is _KERNEL:
            into = slots.plan.into.get(t.id)
            if into is not None and into([get(v) for v in t.reads], view):
                return view
        elif t.kind is _TOUCH and t.writes in slots.plan.touched and t.writes not in store.values:
            store.values[t.writes] = view  # the touches' buffer (execute.py's _touch fills it)
        value = compute(t, get, self.feeds, self.decomps, self.shapes[t.writes], self.fast[t.id])
        return slots.land(value, view)

    def finish(self, stats: RunStats) -> list[np.ndarray] | None:
        """The run's totals from its stores, and its outputs assembled from the blocks."""
        tg, stores = self.tg, self.stores
        stats.bytes_moved = sum(s.received for s in stores)
        stats.bytes_copied = sum(s.copied for s in stores)
        stats.bytes_loaded = sum(s.loaded for s in stores)
        stats.bytes_evicted = sum(s.evicted for s in stores)
        stats.bytes_reloaded = sum(s.reloaded for s in stores)
        stats.peak_bytes_per_device = {s.device: s.peak for s in stores}
        state = self.state  # new state values are kept where they are, not fetched
        fetched = tg if state is None else state.fetched(tg)
        if not self.computes:
            stats.bytes_fetched = sum(tg.values[v].nbytes for lay in fetched.outputs for v in lay.blocks.values())
            if state is not None:
                state.keep(tg, None, self.capped, self.feeds)
            return None
        get = self.host.__getitem__ if self.capped else (lambda v: stores[tg.values[v].device].get(v))
        if state is not None:
            state.keep(tg, get, self.capped, self.feeds)
        if self.slots is not None:
            feeds = self.feeds
            outs = self.slots.outputs(fetched.outputs, get, lambda lay: assemble_output(lay, get, feeds))
        else:
            outs = assemble_outputs(fetched, get, self.feeds)
        stats.bytes_fetched = sum(o.nbytes for o in outs)
        return outs
