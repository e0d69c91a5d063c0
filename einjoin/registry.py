"""A name -> function registry (planners, placers) that answers ``x in registry`` with False for
an unhashable ``x``: a list or an array given as a name is unknown, not a raw TypeError.

>>> from einjoin.registry import Registry
>>> r = Registry(greedy=print)
>>> "greedy" in r, [1] in r
(True, False)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Registry"]


class Registry(dict[Any, Any]):
    def __contains__(self, key: object) -> bool:
        try:
            return dict.__contains__(self, key)
        except TypeError:
            return False
