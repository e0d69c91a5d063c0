"""Memory sizes: bytes or a string such as ``"2GiB"``, checked (its own module so that the
device models in :mod:`einjoin.cluster.model` read sizes without importing the cluster package,
which imports them).

>>> parse_bytes("2GiB"), parse_bytes("512 MB"), parse_bytes(1e9), parse_bytes(None)
(2147483648, 512000000, 1000000000, None)
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from einjoin.errors import EinjoinError

__all__ = ["MAX_BYTES", "parse_bytes", "short"]

MAX_BYTES = 2**63 - 1  # a device's memory: numpy's and the planner's int64 arithmetic stay exact

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def short(value: Any) -> str:
    """``repr(value)`` cut to a readable length (a hostile 10**400 is 400 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_bytes(value: int | float | str | None) -> int | None:
    """``2147483648``, ``1e9`` (a float only when whole), ``"2GiB"``, ``"512 MB"`` -> bytes (None
    stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise EinjoinError(f"memory size must be bytes or a string such as '2GiB', got {value!r}")
    if isinstance(value, numbers.Integral):  # numpy ints too
        if value <= 0:
            raise EinjoinError(f"memory size must be positive, got {value}")
        if value > MAX_BYTES:
            raise EinjoinError(f"memory size {short(value)} is more than {MAX_BYTES} bytes (2**63 - 1); "
                               f"give None for an unbounded device")
        return operator.index(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return parse_bytes(int(value))  # 1e9 or 2 ** 30.0 as people write sizes; 1.5 is refused below
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        try:
            n = float(num)
        except ValueError:
            n = -1.0
        if unit in _UNITS and n > 0 and math.isfinite(n) and int(n * _UNITS[unit]) > 0:
            return parse_bytes(int(n * _UNITS[unit]))  # the same bounds as an int
    raise EinjoinError(f"memory size {short(value)} is not bytes or a size such as '2GiB'")
