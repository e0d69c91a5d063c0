"""The runtime: one asynchronous engine, adapted by backends."""

from einjoin.runtime.backends import BACKENDS, get_backend
from einjoin.runtime.engine import (ORDERS, CancelToken, Engine, ReadyQueue, RunHandle, RunStats,
                                    RunTimeoutError, Store)

__all__ = ["BACKENDS", "get_backend", "ORDERS", "Engine", "ReadyQueue", "RunStats", "Store", "CancelToken",
           "RunHandle", "RunTimeoutError"]
