"""glibc's malloc tuned for block-sized allocations: freed block memory stays in the process.

Below the backends (the local ``sync`` / ``threads`` and ``torch`` all call :func:`tune_malloc`
when a session opens), so that a backend module never imports the backend registry
(:mod:`einjoin.runtime.backends`) for it: the registry imports the backends.

>>> from einjoin.runtime.malloc import tune_malloc
>>> tune_malloc() == tune_malloc()  # once per process: the second call reports the first's outcome
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["TUNE_MALLOC", "tune_malloc"]

# glibc's malloc parameters set by the first local run (see tune_malloc); False leaves them alone
TUNE_MALLOC = True
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_tuned: bool | None = None  # the first call's outcome


def tune_malloc() -> bool:
    """Keep freed block memory in the process (glibc only; once per process, unless
    :data:`TUNE_MALLOC` is False): blocks up to 32 MiB come from the heap rather than fresh
    ``mmap``s, and up to 1 GiB of free heap is kept rather than handed back to the OS. A run
    allocates and frees blocks of the same few sizes all the time; by default glibc returns
    them to the OS and the next kernel page-faults its output in again, and with a worker
    thread per device those faults and unmaps contend on the process's memory map (measured:
    the LLaMA block's forward+backward on two threads ~30% faster). Peak memory is unchanged
    (what is kept was in use before); True when the parameters were set.

    >>> isinstance(tune_malloc(), bool)
    True
    """
    global _tuned
    if _tuned is None and TUNE_MALLOC:
        _tuned = _mallopt()
    return bool(_tuned)


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1  # 32 MiB: glibc's largest dynamic threshold
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok)
