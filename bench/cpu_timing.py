"""The sparse benches' timer: the median CPU time (``time.process_time``, every thread of this
process) of ``reps`` calls, robust to other load on a shared machine.

>>> t, out = cpu_median(lambda: sum(range(1000)), 3, warm=True)
>>> out, t >= 0
(499500, True)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def cpu_median(fn: Callable[[], Any], reps: int, warm: bool = False) -> tuple[float, Any]:
    """(median CPU seconds of ``reps`` calls of ``fn``, the last call's result); ``warm``: one
    untimed call first (a sparse tensor's first run derives its join and SpMM order, which it keeps)."""
    if warm:
        fn()
    times, out = [], None
    for _ in range(reps):
        t = time.process_time()
        out = fn()
        times.append(time.process_time() - t)
    return statistics.median(times), out
