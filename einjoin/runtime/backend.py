"""The Backend protocol: what every backend implements so that the one engine
(:class:`einjoin.runtime.engine.Engine`) runs task graphs on it — ``sync``, ``threads``, ``null``
and ``ray`` today; a simulator or a torch backend next.

A run goes through the engine's steps (check, open, dispatch, collect, finish, replay); the
backend decides *where and how* a task executes, in a session (one run attempt) of one of
two kinds (:data:`Session`):

- **ready dispatch** (a :class:`ReadySession`: sync, threads, null). The engine keeps the
  dependency counters and ready queues and calls ``session.execute(task)`` once every task the
  task depends on has finished, on ``session.lanes`` worker threads (``threaded``) or inline.
  ``session.lane(task)`` says which worker runs it (a device's compute lane, its host lane).
- **eager dispatch** (an :class:`EagerSession`: Ray). The backend resolves dependencies itself
  (Ray passes object references between actors), so the engine hands it every task at once, in
  dependency (task-id) order, with ``session.submit(task)``, then ``session.collect(cancel)``
  waits for them all. Per task this costs one method call; Ray's actors hold each program's
  task graph already, so its ``submit`` does nothing and a run is two calls per actor.

Either way ``session.finish(stats)`` fills the run's :class:`~einjoin.runtime.engine.RunStats`
(bytes, peaks, and for eager sessions the measured intervals, which the engine then replays to
the callbacks) and returns the outputs (None when the backend does not compute). Leaving the
session with an exception abandons whatever of the run is still queued. A session raises
:class:`TaskFailed` for a task that failed (the engine names the task) and :class:`DeviceLost`
for a device that died (the engine re-runs the graph up to ``backend.retries`` times).

>>> from einjoin.runtime.backends import BACKENDS
>>> all(isinstance(b, Backend) for b in BACKENDS.values())
True
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from einjoin.exchange import Task
from einjoin.ir.node import Node

if TYPE_CHECKING:
    from einjoin.cluster import Cluster
    from einjoin.runtime.engine import CancelToken, Engine, RunStats
    from einjoin.runtime.state import StateRun

__all__ = ["Backend", "Session", "ReadySession", "EagerSession", "Callback", "RunSpec", "TaskFailed", "DeviceLost",
           "note", "WAIT_SLICE", "wait_event", "join_thread", "cores"]


class Callback(Protocol):
    """Run callbacks (traces, progress bars): told when each task starts and ends."""

    def on_start(self, task: Task) -> None: ...
    def on_end(self, task: Task, start: float, end: float) -> None: ...


@dataclass(frozen=True)
class RunSpec:
    """One run, as a backend sees it: the engine (its task graph and decompositions; Ray keys
    the plan it ships by it), the bound feeds, the run's options, the cluster (None: local), and
    for a program with state the run's view of it (:class:`einjoin.runtime.state.StateRun`)."""

    engine: Engine
    feeds: Mapping[Node, np.ndarray]
    order: str = "fifo"
    seed: int = 0
    host_link: float | None = None
    cancel: CancelToken | None = None
    cluster: Cluster | None = None
    state: StateRun | None = None


class TaskFailed(Exception):
    """Raised by a session: ``task`` failed with ``cause`` (the engine names both)."""

    def __init__(self, task: Task, cause: BaseException):
        super().__init__(f"task #{task.id} failed: {cause!r}")
        self.task, self.cause = task, cause


class DeviceLost(Exception):
    """Raised by a session: a device died (its process, its actor). The engine re-runs the graph
    from the inputs, ``backend.retries`` times. ``before_start``: found before the run did any
    work (it died since the last run): replacing it costs no retry."""

    def __init__(self, msg: str, before_start: bool = False):
        super().__init__(msg)
        self.before_start = before_start


@runtime_checkable
class ReadySession(Protocol):
    """One run attempt whose tasks the engine hands over once they are ready (a context manager;
    an exception leaving it abandons the run). ``lanes`` worker lanes, each a thread when
    ``threaded`` (else one inline worker); ``lane(task)`` is the lane that runs ``task``;
    ``execute(task)`` runs it (every task it depends on has finished); ``finish(stats)`` fills
    the stats and returns the outputs (None when nothing is computed)."""

    eager: Literal[False]
    lanes: int
    threaded: bool

    def __enter__(self) -> ReadySession: ...
    def __exit__(self, *exc: Any) -> Any: ...
    def lane(self, task: Task) -> int: ...
    def execute(self, task: Task) -> None: ...
    def finish(self, stats: RunStats) -> list[np.ndarray] | None: ...


@runtime_checkable
class EagerSession(Protocol):
    """One run attempt on a backend that resolves dependencies itself (a context manager; an
    exception leaving it abandons the run). ``submit(task)`` takes every task, in dependency
    order, before its inputs exist (the backend passes its own futures); ``collect(cancel)``
    waits for all of them (raising ``EinjoinError("run cancelled ...")`` once ``cancel`` is);
    ``finish(stats)`` fills the stats, the measured ``intervals`` included (the engine replays
    them to the callbacks), and returns the outputs."""

    eager: Literal[True]

    def __enter__(self) -> EagerSession: ...
    def __exit__(self, *exc: Any) -> Any: ...
    def submit(self, task: Task) -> None: ...
    def collect(self, cancel: CancelToken | None) -> None: ...
    def finish(self, stats: RunStats) -> list[np.ndarray] | None: ...


Session = ReadySession | EagerSession


@runtime_checkable
class Backend(Protocol):
    """A backend: ``name``; ``computes`` (False: the schedule runs and bytes are counted, nothing
    is computed); ``remote`` (its devices are other processes: no memory caps yet); ``retries``
    (re-runs after a lost device); ``open(run)`` a :class:`Session` for one run attempt;
    ``close()`` releases what it holds (actors; nothing for local backends)."""

    name: str
    computes: bool
    remote: bool
    retries: int

    def open(self, run: RunSpec) -> Session: ...
    def close(self) -> None: ...


def note(backend: Backend, message: str) -> None:
    """Tell the user on stderr what a backend did on its own (a recovery), unless it is quiet."""
    if not getattr(backend, "quiet", True):
        import sys
        print(f"einjoin: {message}", file=sys.stderr)


# Waiting for another thread during a run (the engine for its workers, the BLAS limiter for its
# helper, a caller for its run): never in one unbounded sleep. A Ctrl-C wakes a sleeping main
# thread, except one whose signal lands just before the thread blocks: Python's handler then runs
# only when the sleep ends. Unbounded, that is when the other thread ends -- the run's end, or
# never: under a tracer on CPython 3.11 (coverage, a debugger) a signal left pending makes every
# other traced thread spin at its next function entry (it cannot run the handler, and the eval
# loop re-checks the pending signal before the entry's trace event, for ever), so the workers
# never end and the sleep never ends. Sleeping in slices, the main thread sees such a signal
# within WAIT_SLICE seconds.
WAIT_SLICE = 0.1


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)`` in slices of :data:`WAIT_SLICE` seconds (a Ctrl-C that lands just
    before a slice is seen at its end); returns whether the event is set.

    >>> e = threading.Event(); wait_event(e, 0.01)
    False
    >>> e.set(); wait_event(e)
    True
    """
    if timeout is None:
        while not event.wait(WAIT_SLICE):
            pass
        return True
    deadline = time.monotonic() + timeout
    while not event.wait(max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return False
    return True


def cores() -> int:
    """The machine's cores (``os.cpu_count()``, read once: each read is a file read of ~12 us,
    and a threaded run's share of the cores asked for it up to six times per run).

    >>> cores() >= 1
    True
    """
    n = _CORES[0]
    if n is None:
        n = _CORES[0] = os.cpu_count() or 1
    return n


_CORES: list[int | None] = [None]


def join_thread(th: threading.Thread) -> None:
    """``th.join()`` in slices of :data:`WAIT_SLICE` seconds (see :func:`wait_event`)."""
    while th.is_alive():
        th.join(WAIT_SLICE)
