"""A name -> function registry (planners, placers) that answers ``x in registry`` with False for
an unhashable ``x``: a list or an array given as a name is unknown, not a raw TypeError.

>>> from einjoin.registry import Registry
>>> r = Registry(greedy=print)
>>> "greedy" in r, [1] in r
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Registry", "registrar"]

_F = TypeVar("_F", bound=Callable[..., Any])


def registrar(table: dict[str, Any]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator factory registering a function in ``table`` under each of the given names:
    ``op = registrar(OPS)``, then ``@op("view", "reshape")``.

    >>> table = {}
    >>> @registrar(table)("a", "b")
    ... def f(): pass
    >>> sorted(table)
    ['a', 'b']
    """
    def names(*keys: str) -> Callable[[_F], _F]:
        def reg(fn: _F) -> _F:
            for k in keys:
                table[k] = fn
            return fn
        return reg
    return names


class Registry(dict[Any, Any]):
    def __contains__(self, key: object) -> bool:
        try:
            return dict.__contains__(self, key)
        except TypeError:
            return False
