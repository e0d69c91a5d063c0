"""The Ray actor body: :class:`DeviceWorker` holds one device's task graphs (shipped once per
program), a store per run in progress (the same :class:`~einjoin.runtime.local.Store` and task
semantics as the local backends) and the state blocks programs keep between runs.
:class:`~einjoin.runtime.backends.ray.RayBackend` starts one per device with ``ray.remote``.

>>> w = DeviceWorker(0)
>>> w.kept_keys(), w.open_runs()
([], [])
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.exchange import TaskKind

__all__ = ["DeviceWorker"]


class _Run:
    """One run's namespace on one actor."""

    __slots__ = ("tg", "decomps", "feeds", "store", "intervals", "received_from", "delay", "resident")

    def __init__(self, plan: tuple[Any, Any], feeds: Mapping[Any, np.ndarray], device: int, delay: float):
        from einjoin.runtime.local import Store
        self.tg, self.decomps = plan
        self.feeds = feeds
        self.store = Store(device)
        self.intervals: list[tuple[int, float, float]] = []
        self.received_from: dict[int, int] = {}
        self.delay = delay
        self.resident: dict[int, np.ndarray] = {}  # load task id -> the state block kept here


class DeviceWorker:
    """The actor body: one device's plans, a store per run in progress, and the task semantics
    the other backends use. Every task method takes the run id first."""

    def __init__(self, device: int, blas_threads: int = 1):
        from threadpoolctl import threadpool_limits
        self.device = device
        self._limits = threadpool_limits(limits=max(1, blas_threads))
        self.plans: dict[int, tuple[Any, Any]] = {}
        self.runs: dict[int, _Run] = {}
        self.aborted: set[int] = set()   # written by the control thread: the run's tasks are no-ops
        self.kept: dict[int, np.ndarray] = {}  # programs' state blocks, kept between runs by key

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def setup(self, key: int, plan: Any) -> None:
        self.plans[key] = plan

    def forget(self, keys: Sequence[int]) -> None:
        """Drop the plans of programs that are gone (so ``plans`` does not grow for ever)."""
        for k in keys:
            self.plans.pop(k, None)

    def begin(self, run: int, key: int, feeds: Mapping[Any, np.ndarray], delay: float = 0.0,
              resident: Mapping[int, int] | None = None) -> None:
        """Open run ``run`` of plan ``key``; ``delay``: a test hook, seconds slept before every
        kernel (so a fault or a cancel lands while work is outstanding); ``resident``: load task
        id -> the kept state block that load takes (nothing is loaded)."""
        if key not in self.plans:
            raise RuntimeError(f"device {self.device} has no plan {key} (its actor was replaced)")
        r = _Run(self.plans[key], feeds, self.device, float(delay))
        if resident:
            if any(k not in self.kept for k in resident.values()):
                raise RuntimeError(f"device {self.device} no longer holds this program's state (its actor was "
                                   f"replaced): write_state() it again")
            r.resident = {tid: self.kept[k] for tid, k in resident.items()}
        self.runs[run] = r

    def _get(self, run: int) -> _Run | None:
        # None: the run was aborted (or its begin failed, which the driver sees on begin's ref)
        return None if run in self.aborted else self.runs.get(run)

    def abort(self, run: int) -> None:
        """Make the run's remaining tasks no-ops (called on the control thread)."""
        self.aborted.add(run)

    def run(self, run: int, tid: int, *deps: Any) -> None:
        from einjoin.plan.execute import compute
        r = self._get(run)
        if r is None:
            return
        t = r.tg.tasks[tid]
        start = time.time()
        if t.kind.releases:  # a free (memory caps, hence evictions, are refused on Ray)
            r.store.free(t.payload.frees)
        else:
            if t.kind is TaskKind.KERNEL and r.delay:
                time.sleep(r.delay)
            kept = r.resident.get(tid) if t.kind is TaskKind.LOAD else None
            if kept is not None:  # a state block the last run left here: nothing is loaded
                r.store.put(t.writes, kept, kept.nbytes)
            else:
                value = compute(t, r.store.get, r.feeds, r.decomps, r.tg.values[t.writes].shape)
                r.store.put(t.writes, value, value.nbytes)
                if t.kind is TaskKind.LOAD:
                    r.store.loaded += value.nbytes
        r.intervals.append((tid, start, time.time()))

    def send(self, run: int, vid: int, *deps: Any) -> np.ndarray | None:
        r = self._get(run)
        return None if r is None else r.store.get(vid)

    def receive(self, run: int, tid: int, src: int, value: np.ndarray) -> None:
        # a zero-copy, read-only view of the object store: only read by later tasks
        r = self._get(run)
        if r is None:
            return
        t = r.tg.tasks[tid]
        start = time.time()
        r.store.put(t.writes, value, value.nbytes)
        r.store.received += value.nbytes   # counted here, at the receiving device
        r.received_from[src] = r.received_from.get(src, 0) + value.nbytes
        r.intervals.append((tid, start, time.time()))

    def fetch(self, run: int, vid: int) -> np.ndarray | None:
        r = self._get(run)
        return None if r is None else r.store.get(vid)

    def finish(self, run: int, keep: Mapping[int, int] | None = None) -> dict[str, Any] | None:
        """Close the run: its report; its feeds and blocks are dropped, but for ``keep`` (value id
        -> key: a program's new state blocks, kept under those keys for its next runs)."""
        r = self.runs.pop(run, None)
        if r is None or run in self.aborted:
            return None
        s = r.store
        for vid, k in (keep or {}).items():
            self.kept[k] = s.get(vid)
        return {"received": s.received, "loaded": s.loaded, "peak": s.peak, "intervals": r.intervals,
                "received_from": r.received_from}

    def release(self, keys: Sequence[int]) -> None:
        """Drop kept state blocks (replaced by a later run's, or of a failed run)."""
        for k in keys:
            self.kept.pop(k, None)

    def read(self, keys: Sequence[int]) -> list[np.ndarray]:
        """Kept state blocks (``Program.read_state``)."""
        return [self.kept[k] for k in keys]

    def kept_keys(self) -> list[int]:
        """The keys of the state blocks kept here (tests: one step's blocks, none leaked)."""
        return sorted(self.kept)

    def drop(self, run: int) -> None:
        """Forget a failed or cancelled run (idempotent)."""
        self.runs.pop(run, None)
        self.aborted.discard(run)

    def open_runs(self) -> list[int]:
        """The runs with a namespace here (tests: none after every run ended)."""
        return sorted(self.runs)
