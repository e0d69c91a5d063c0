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
from typing import Any, Callable, Iterator

__all__ = ["enabled", "stages", "RunBar", "PLAN_OPS", "RUN_TASKS"]

PLAN_OPS = 200       # graphs with at least this many ops show compile stages
RUN_TASKS = 2000     # task graphs with at least this many tasks show a run bar


def enabled(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def stages(quiet: bool, size: int, threshold: int = PLAN_OPS) -> Iterator[Callable[[str], None]]:
    """Yields ``say(stage)``; shows the current stage on stderr when enabled and ``size`` is large."""
    if not enabled(quiet) or size < threshold:
        yield lambda stage: None
        return
    from rich.console import Console
    console = Console(stderr=True)
    with console.status("compiling", spinner="dots") as status:
        yield lambda stage: status.update(f"compiling: {stage} ({size} ops)")


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
    def maybe(cls, quiet: bool, total: int, threshold: int = RUN_TASKS) -> "RunBar | None":
        return cls(total) if enabled(quiet) and total >= threshold else None

    def __enter__(self) -> "RunBar":
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def on_start(self, task: Any) -> None:
        pass

    def on_end(self, task: Any, start: float, end: float) -> None:
        with self._lock:  # the threads backend ends tasks on several threads
            self._done += 1
            done = self._done
        if done % 64 == 0:
            self._progress.update(self._task, completed=done)
