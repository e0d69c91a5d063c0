"""Persistent worker threads: one :class:`WorkerPool` per engine (program) runs its runs' lanes,
so a run hands each lane to a thread that is already there instead of starting and joining a
thread per lane (each start waits for the new thread to take the GIL: on a loaded machine the
threads backend's small steps spent a millisecond or more of wall time per run there, serial on
the main thread).

The threads are daemons and die with their pool: :meth:`WorkerPool.close` (``prog.close()``),
the pool's owner being garbage collected, or the interpreter's exit. A run that finds the pool
busy (a concurrent run of the same program) starts its own threads, as before. Nothing of a run
stays with a thread after its lane ended (its job is dropped), so a pool keeps no blocks alive.

>>> pool = WorkerPool(lambda q: f"einjoin-doc{q}")
>>> box = queue.SimpleQueue()
>>> pool.post(0, lambda: box.put("ran")); box.get(timeout=5)
'ran'
>>> pool.alive, pool.close(), pool.alive
(1, None, 0)
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable

__all__ = ["WorkerPool"]

_LIVE: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _serve(inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    """A pool thread: run each job posted to it until told to stop (``None``). It holds its
    inbox only (not the pool, not the engine): a pool whose owner is gone is collected, and its
    finalizer stops the thread."""
    while True:
        job = inbox.get()
        if job is None:
            return
        try:
            job()
        except BaseException:  # noqa: BLE001, S110 - a job reports its own outcome (drive_threads' guard)
            pass
        job = None  # drop the run (its dispatch, session, blocks) before waiting for the next one


def _stop(inboxes: list[queue.SimpleQueue[Callable[[], None] | None]],
          threads: list[threading.Thread] | None = None) -> None:
    """Tell each thread to end; with ``threads``, wait for them (idle, they end at once), except
    the calling thread (a collection that ran on a pool thread)."""
    for inbox in inboxes:
        inbox.put(None)
    me = threading.current_thread()
    for th in threads or ():
        if th is not me:
            with contextlib.suppress(RuntimeError):  # never started (a Ctrl-C cut its start short)
                th.join()


class WorkerPool:
    """Daemon threads reused across runs, one per lane (grown on demand). ``name(q)`` names lane
    ``q``'s thread. :meth:`take` / :meth:`give` mark it in use by one run (non-blocking: a
    second concurrent run gets False and starts its own threads); :meth:`post` hands lane ``q``
    a job; :meth:`close` stops and joins the threads (a later run starts new ones)."""

    def __init__(self, name: Callable[[int], str]) -> None:
        self._name = name
        self._threads: list[threading.Thread] = []
        self._inboxes: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._use = threading.Lock()
        self._grow_lock = threading.Lock()
        # stop the threads when the pool is collected (its owner gone) or at exit
        self._finalizer = weakref.finalize(self, _stop, self._inboxes, self._threads)
        _LIVE.add(self)

    @property
    def alive(self) -> int:
        """The pool's threads still running."""
        return sum(th.is_alive() for th in self._threads)

    def take(self) -> bool:
        """Mark the pool in use by the calling run; False when another run uses it."""
        return self._use.acquire(blocking=False)

    def give(self) -> None:
        self._use.release()

    def post(self, q: int, job: Callable[[], None]) -> None:
        """Run ``job`` on lane ``q``'s thread (started now if it is the lane's first job)."""
        if q >= len(self._inboxes) or not self._threads[q].is_alive():
            self._start(q)
        self._inboxes[q].put(job)

    def _start(self, q: int) -> None:
        """Start lane ``q``'s thread (and those of the lanes before it that have none); a lane
        whose thread is not running (a Ctrl-C cut its start short) gets a new one."""
        with self._grow_lock:
            while len(self._inboxes) <= q:
                self._threads.append(threading.Thread())  # placeholders, never started: replaced below
                self._inboxes.append(queue.SimpleQueue())
            for i in range(q + 1):
                if self._threads[i].is_alive():
                    continue
                self._inboxes[i].put(None)  # a thread still beginning ends at once
                inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
                th = threading.Thread(target=_serve, args=(inbox,), daemon=True, name=self._name(i))
                # listed before its start: a Ctrl-C landing in start() (it waits for the thread to
                # begin) leaves a thread that runs and that close() must still stop
                self._threads[i], self._inboxes[i] = th, inbox
                th.start()

    def close(self) -> None:
        """Stop the threads and wait for them; while a run uses the pool (a callback of that run
        closing its program, another thread closing it mid-run) without waiting: each thread
        ends once its lane of that run ended."""
        with self._grow_lock:
            _stop(self._inboxes, None if self._use.locked() else self._threads)
            self._threads.clear()
            self._inboxes.clear()


@atexit.register
def _close_all() -> None:
    """At exit: stop every pool's threads (they are daemons; this lets them end cleanly)."""
    for pool in list(_LIVE):
        _stop(pool._inboxes)
