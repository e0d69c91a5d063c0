"""Aggregations: how an einsum combines the values of the labels missing from its output.

The algebraic facts (associative, commutative, identity element) are data on :class:`Agg`,
so decomposition, exchange and the optimizer read them instead of special-casing names.

>>> from einjoin.ir.agg import get_agg
>>> s = get_agg("sum")
>>> s.identity, s.associative, float(s.combine(1.0, 2.0))
(0.0, True, 3.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einjoin.errors import ExpressionError

__all__ = ["Agg", "AGGS", "get_agg"]


@dataclass(frozen=True)
class Agg:
    """An aggregation. ``ufunc`` combines two partial results elementwise and reduces along axes."""

    name: str
    ufunc: np.ufunc | None = field(compare=False)
    identity: float | None
    associative: bool
    commutative: bool

    @property
    def reduces(self) -> bool:
        return self.ufunc is not None

    def combine(self, a: Any, b: Any) -> Any:
        """Combine two partial results (arrays or scalars)."""
        assert self.ufunc is not None
        return self.ufunc(a, b)

    def reduce(self, x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
        """Aggregate ``x`` over ``axes``."""
        if not axes:
            return x
        assert self.ufunc is not None
        out: np.ndarray = self.ufunc.reduce(x, axis=axes)
        return out

    def __str__(self) -> str:
        return self.name


AGGS: dict[str, Agg] = {
    "sum": Agg("sum", np.add, 0.0, True, True),
    "prod": Agg("prod", np.multiply, 1.0, True, True),
    "max": Agg("max", np.maximum, -math.inf, True, True),
    "min": Agg("min", np.minimum, math.inf, True, True),
    "none": Agg("none", None, None, True, True),
}


def get_agg(agg: str | Agg | None) -> Agg:
    """The registered aggregation named ``agg`` (``None`` is ``none``). An :class:`Agg` instance
    must be one of :data:`AGGS`: every layer (kernels, partial sums, the optimizer) reads its
    facts, so a home-made ``Agg("sum", np.multiply, ...)`` would be summed in one place and
    multiplied in another."""
    if isinstance(agg, Agg):
        known = AGGS.get(agg.name)
        if known is None or agg.ufunc is not known.ufunc or agg != known:
            raise ExpressionError(f"aggregation {agg!r} is not one of einjoin's; use a name: "
                                  f"{', '.join(AGGS)}")
        return known
    if agg is None:
        return AGGS["none"]
    if isinstance(agg, str) and agg in AGGS:
        return AGGS[agg]
    raise ExpressionError(f"unknown aggregation {agg!r}; known: {', '.join(AGGS)}")
