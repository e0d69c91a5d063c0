"""The runtime: one engine (:mod:`.engine`) running task graphs on backends that implement one
protocol (:mod:`.backend`): ``sync``, ``threads``, ``null`` (:mod:`.local` devices) and ``ray``."""

from einjoin.runtime.backend import (Backend, Callback, DeviceLost, EagerSession, ReadySession, RunSpec, Session,
                                     TaskFailed)
from einjoin.runtime.backends import BACKENDS, get_backend
from einjoin.runtime.engine import (ORDERS, CancelToken, Engine, ReadyQueue, RunHandle, RunStats,
                                    RunTimeoutError)
from einjoin.runtime.local import LocalSession, Store

__all__ = ["BACKENDS", "get_backend", "ORDERS", "Engine", "ReadyQueue", "RunStats", "Store", "CancelToken",
           "RunHandle", "RunTimeoutError", "Backend", "Session", "ReadySession", "EagerSession", "Callback", "RunSpec",
           "TaskFailed",
           "DeviceLost", "LocalSession"]
