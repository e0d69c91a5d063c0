"""A run callback that counts the tasks started (thread-safe), shared by the runtime tests."""

from __future__ import annotations

import threading
from typing import Any


class TaskCount:
    """``on_start`` counts; ``n`` is the number of tasks started so far."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0

    def on_start(self, task: Any) -> None:
        with self.lock:
            self.n += 1

    def on_end(self, task: Any, start: float, end: float) -> None:
        pass
