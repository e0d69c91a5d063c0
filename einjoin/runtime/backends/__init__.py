"""Backends adapt the one engine: ``sync`` (one inline worker, for debugging), ``threads`` (a
worker thread per local device, numpy kernels, BLAS threads limited so that device threads times
BLAS threads fit the cores) and ``null`` (runs the schedule and counts bytes, computes nothing)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

from einjoin.errors import EinjoinError

__all__ = ["BACKENDS", "get_backend", "SyncBackend", "ThreadsBackend", "NullBackend"]


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

    @contextlib.contextmanager
    def context(self, n_devices: int) -> Iterator[None]:
        # device threads x BLAS threads <= cores, process-wide, for the duration of the run
        from threadpoolctl import threadpool_limits
        cores = os.cpu_count() or 1
        with threadpool_limits(limits=max(1, cores // max(1, n_devices))):
            yield


BACKENDS: dict[str, Any] = {"sync": SyncBackend(), "threads": ThreadsBackend(), "null": NullBackend()}


def get_backend(name: Any) -> Any:
    if not isinstance(name, str) and hasattr(name, "parallel"):
        return name
    if name == "ray":  # a fresh one per program: it owns that program's actors
        from einjoin.runtime.backends.ray import RayBackend
        return RayBackend()
    if name not in BACKENDS:
        raise EinjoinError(f"unknown backend {name!r}; known: {', '.join([*BACKENDS, 'ray'])}")
    return BACKENDS[name]
