"""Backends adapt the one engine: ``sync`` (one inline worker, for debugging), ``threads`` (a
worker thread per local device, numpy kernels, BLAS threads limited so that device threads times
BLAS threads fit the cores) and ``null`` (runs the schedule and counts bytes, computes nothing)."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from einjoin.errors import EinjoinError

__all__ = ["BACKENDS", "get_backend", "SyncBackend", "ThreadsBackend", "NullBackend", "BlasLimiter", "BLAS_LIMITER"]


class BlasLimiter:
    """The process-wide BLAS thread limit while parallel runs are in flight.

    threadpoolctl's limits are process-wide, so nesting one ``threadpool_limits`` per run breaks
    when concurrent runs end out of order (each restores what it saw on entry: the first run to
    end restores the original, the last restores the first run's limit, for ever). Here the
    first run in saves the original limits, every entry and exit sets cores // (devices of all
    runs in flight), and the last run out restores the original limits exactly.

    Every change is made on a short-lived helper thread: threadpoolctl (>= 3.6) lets only one
    live thread at a time change a pthreads OpenBLAS's limit (others are silently ignored), so
    changes made on the caller's thread would pin that control to it (a user's main thread,
    or a run's thread that is not the last one out, whose restore would then be ignored). A
    helper takes control and dies. When some other live thread holds the control (the user's
    own ``threadpool_limits``), einjoin leaves the limits alone. Only BLAS libraries are limited:
    the kernels are numpy's, and an OpenMP limit is per thread (a helper's would die with it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices = 0
        self._original: Any = None  # the threadpool_limits of the first run in: it restores

    @staticmethod
    def _share(devices: int) -> int:
        return max(1, (os.cpu_count() or 1) // max(1, devices))

    @property
    def devices_in_flight(self) -> int:
        """Device threads of the parallel runs in progress (0: the original limits hold)."""
        return self._devices

    @staticmethod
    def _on_helper(fn: Any) -> tuple[Any, BaseException | None]:
        """``fn()`` on a helper thread; returns its value and a KeyboardInterrupt that arrived
        meanwhile (deferred: the change lands and is counted before the interrupt goes on)."""
        box: list[Any] = []

        def target() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append((False, e))
        th = threading.Thread(target=target, name="einjoin-blas-limit", daemon=True)
        th.start()
        interrupted = None
        while th.is_alive():
            try:
                th.join()
            except KeyboardInterrupt as e:
                interrupted = e
        ok, value = box[0]
        if not ok:
            raise value
        return value, interrupted

    def _enter(self, n_devices: int) -> BaseException | None:
        from threadpoolctl import threadpool_limits
        n = max(1, n_devices)
        with self._lock:
            limit = self._share(self._devices + n)
            limiter, interrupted = self._on_helper(lambda: threadpool_limits(limits=limit, user_api="blas"))
            if self._devices == 0:
                self._original = limiter  # the first run's limiter restores; the others are dropped
            self._devices += n
            return interrupted

    def _exit(self, n_devices: int) -> BaseException | None:
        from threadpoolctl import threadpool_limits
        with self._lock:
            self._devices = max(0, self._devices - max(1, n_devices))
            if self._devices == 0:
                original, self._original = self._original, None
                if original is None:
                    return None
                return self._on_helper(original.restore_original_limits)[1]
            limit = self._share(self._devices)
            return self._on_helper(lambda: threadpool_limits(limits=limit, user_api="blas"))[1]

    @contextlib.contextmanager
    def limit(self, n_devices: int) -> Iterator[None]:
        """Hold a share of the cores for ``n_devices`` device threads while the block runs (the
        last run out restores the original limits)."""
        pending = self._enter(n_devices)
        try:
            if pending is not None:
                raise pending
            yield
        except BaseException:
            self._exit(n_devices)  # an interrupt meanwhile is dropped: one is on its way already
            raise
        late = self._exit(n_devices)
        if late is not None:
            raise late


BLAS_LIMITER = BlasLimiter()


@dataclass(frozen=True)
class SyncBackend:
    name: str = "sync"
    parallel: bool = False
    computes: bool = True

    def context(self, n_devices: int) -> Any:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class NullBackend:
    name: str = "null"
    parallel: bool = False
    computes: bool = False

    def context(self, n_devices: int) -> Any:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class ThreadsBackend:
    name: str = "threads"
    parallel: bool = True
    computes: bool = True

    def context(self, n_devices: int) -> Any:
        # device threads x BLAS threads <= cores, process-wide, while runs are in flight
        return BLAS_LIMITER.limit(n_devices)


BACKENDS: dict[str, Any] = {"sync": SyncBackend(), "threads": ThreadsBackend(), "null": NullBackend()}


def get_backend(name: Any) -> Any:
    """The backend named ``name`` (``sync``, ``threads``, ``null``, ``ray``), or ``name`` itself
    when it already is a backend object."""
    if not isinstance(name, str) and hasattr(name, "parallel"):
        return name
    if isinstance(name, str) and name == "ray":  # a fresh one per program: it owns that program's actors
        from einjoin.runtime.backends.ray import RayBackend
        return RayBackend()
    if not isinstance(name, str) or name not in BACKENDS:  # a list would be unhashable
        raise EinjoinError(f"unknown backend {name!r}; known: {', '.join([*BACKENDS, 'ray'])}")
    return BACKENDS[name]
