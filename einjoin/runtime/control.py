"""Run control, beside the engine: a :class:`CancelToken` cancels the runs it is given to, a
:class:`RunHandle` is a run started by ``Program.run_async`` (its outputs or error, ``done()``,
``cancel()``, its stats), and :class:`RunTimeoutError` is what ``RunHandle.result(timeout)``
raises when the run goes on. The engine (:mod:`einjoin.runtime.engine`) re-exports them.

>>> h = RunHandle(CancelToken()); h.done(), h.cancelled
(False, False)
>>> h.cancel(); h.cancelled
True
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.runtime.backend import wait_event

if TYPE_CHECKING:
    from einjoin.runtime.engine import RunStats

__all__ = ["CancelToken", "RunHandle", "RunTimeoutError"]


class CancelToken:
    """Cancels the runs it is given to (``Program.run(..., cancel=tok)``). Thread-safe.

    ``cancel()`` may be called from any thread, before or during a run: a run whose token is
    already cancelled raises at once without running any task; a running one stops as soon as the
    tasks in flight end. Either way it raises ``EinjoinError("run cancelled ...")`` and the
    program stays usable.

    >>> tok = CancelToken(); tok.cancelled
    False
    >>> tok.cancel(); tok.cancelled
    True
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Cancel (idempotent)."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            listeners, self._listeners = self._listeners, []
        for fn in listeners:  # outside the lock: a listener may take other locks
            fn()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled or ``timeout`` seconds pass; returns ``cancelled``."""
        return self._event.wait(timeout)

    def subscribe(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` once when cancelled (at once if already); returns an unsubscribe function."""
        with self._lock:
            if not self._event.is_set():
                self._listeners.append(fn)

                def unsubscribe() -> None:
                    with self._lock:
                        if fn in self._listeners:
                            self._listeners.remove(fn)
                return unsubscribe
        fn()
        return lambda: None

    def __repr__(self) -> str:
        return f"<CancelToken {'cancelled' if self.cancelled else 'active'}>"


class RunTimeoutError(EinjoinError, TimeoutError):
    """``RunHandle.result(timeout)`` ran out of time; the run goes on."""


class RunHandle:
    """A run started by ``Program.run_async``: ``result(timeout=None)`` (its outputs, or the error
    it raised), ``done()``, ``cancel()`` (this run only) and ``stats`` (its :class:`RunStats`, once
    it finished)."""

    def __init__(self, token: CancelToken) -> None:
        self._token = token
        self._finished = threading.Event()
        self._outcome: tuple[bool, Any] | None = None
        self.stats: RunStats | None = None
        self.thread: threading.Thread | None = None
        self._warnings: list[Warning] = []  # issued by the first result() call, on its thread
        self._traceback: Any = None

    def _set(self, ok: bool, value: Any, stats: RunStats | None) -> None:
        self.stats = stats
        if not ok:
            self._traceback = value.__traceback__  # the run's own frames, without result()'s
        self._outcome = (ok, value)
        self._finished.set()

    def cancel(self) -> None:
        """Cancel this run (no other); ``result()`` then raises ``EinjoinError("run cancelled ...")``."""
        self._token.cancel()

    @property
    def cancelled(self) -> bool:
        return self._token.cancelled

    def done(self) -> bool:
        """Whether the run has ended (finished, failed or cancelled)."""
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """The run's outputs, as ``Program.run`` returns them; re-raises the run's error. Waits at
        most ``timeout`` seconds (None: until the end), then raises :class:`RunTimeoutError`."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number))
                                    or timeout != timeout):  # a str, a bool or nan: never a number of seconds
            raise EinjoinError(f"result(timeout=...) takes seconds (a number) or None, got "
                               f"{type(timeout).__name__} {timeout!r:.40}")
        if not wait_event(self._finished, timeout):  # in slices: a Ctrl-C is seen while waiting
            raise RunTimeoutError(f"the run did not end within timeout={timeout!r} s; it goes on "
                                  f"(handle.cancel() stops it)")
        assert self._outcome is not None
        pending, self._warnings = self._warnings, []
        for w in pending:  # result() < the caller
            warnings.warn(w, stacklevel=2)
        ok, value = self._outcome
        if not ok:
            # the same error on every call: reset its traceback first, else each raise adds to it
            raise value.with_traceback(self._traceback)
        return value

    def __repr__(self) -> str:
        state = "done" if self.done() else ("cancelling" if self.cancelled else "running")
        return f"<RunHandle {state}>"
