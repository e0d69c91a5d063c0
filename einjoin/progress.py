"""Progress display for long plans and runs: a rich status line while compiling a large graph and
a task bar while running a large task graph. Off with ``quiet=True`` and whenever stderr is not
a terminal (CI logs, pipes, notebooks capturing output), so nothing is printed there.

>>> from einjoin.progress import stages, RunBar
>>> with stages(quiet=True, size=10**6) as say:
...     say("planning")
>>> RunBar.maybe(quiet=True, total=10**6) is None
True
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from einjoin.settings import SETTINGS

__all__ = ["enabled", "stages", "RunBar", "PLAN_OPS", "RUN_TASKS"]

PLAN_OPS = SETTINGS.progress_plan_ops    # graphs with at least this many ops show compile stages
RUN_TASKS = SETTINGS.progress_run_tasks  # task graphs with at least this many tasks show a run bar


# one live display at a time: concurrent compiles or runs (several threads) would otherwise draw
# over each other on the terminal; the ones that find it taken show nothing
_display = threading.Lock()


def enabled(quiet: bool) -> bool:
    """Whether to show progress: not ``quiet`` and stderr is a terminal (a replaced or closed
    stderr counts as not a terminal)."""
    if quiet:
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):  # None, a closed stream, an object without isatty
        return False


@contextlib.contextmanager
def stages(quiet: bool, size: int, threshold: int = PLAN_OPS) -> Iterator[Callable[[str], None]]:
    """Yields ``say(stage)``; shows the current stage on stderr when enabled and ``size`` is large."""
    if not enabled(quiet) or size < threshold or not _display.acquire(blocking=False):
        yield lambda stage: None
        return
    try:
        from rich.console import Console
        console = Console(stderr=True)
        with console.status("compiling", spinner="dots") as status:
            yield lambda stage: status.update(f"compiling: {stage} ({size} ops)")
    finally:
        _display.release()


class RunBar:
    """An engine callback advancing a rich progress bar once per finished task."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
        self._progress = Progress("running", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=True)
        self._task = self._progress.add_task("run", total=total)
        self._lock = threading.Lock()
        self._done = 0

    @classmethod
    def maybe(cls, quiet: bool, total: int, threshold: int = RUN_TASKS) -> RunBar | None:
        return cls(total) if enabled(quiet) and total >= threshold else None

    _shown = False

    def __enter__(self) -> RunBar:
        self._shown = _display.acquire(blocking=False)  # another run's bar is up: show nothing
        if self._shown:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._shown:
            self._shown = False
            try:
                self._progress.stop()
            finally:
                _display.release()

    def on_start(self, task: Any) -> None:
        pass

    def on_end(self, task: Any, start: float, end: float) -> None:
        with self._lock:  # the threads backend ends tasks on several threads
            self._done += 1
            done = self._done
        if done % 64 == 0 and self._shown:
            self._progress.update(self._task, completed=done)
