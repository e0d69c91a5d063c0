"""``ej.einsum`` on sparse operands, with the plans of recent calls kept: a call with the same
equation, join, aggregation, operand shapes, dtypes, block sizes and block histograms runs the
kept plan on its operands (``plan.run(*operands)``: the layout reused, as ``run(A=other)`` reuses
it for the same histogram, :mod:`einjoin.sparse.replan`) instead of compiling again. Compiling
dominates small einsums: 400 x 300 at 1% times 300 x 16, 0.8 ms a call compiled vs 0.16 ms kept
(CPU, /tmp/h7/cache.py, session 36). ``SparseTensor.__einjoin_einsum__`` calls it through
``EINSUM["cached"]`` (registered here: this module sits above the plan, which it compiles with).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.ir.equation import parse_equation
from einjoin.sparse.plan import sparse_compile
from einjoin.sparse.replan import pattern_of
from einjoin.sparse.tensor import EINSUM, SparseTensor

__all__ = ["einsum_cached", "EINSUM_PLANS", "EINSUM_PLAN_BYTES"]

EINSUM_PLANS = 8  # plans kept for ej.einsum calls (the least recently used dropped first)
# a kept plan holds its compile-time operands and its last run's: only calls whose operands
# together are at most this size are kept (compiling dominates only small einsums: 400 x 300 at
# 1% times 300 x 16, compile 0.68 ms, run 0.12 ms CPU)
EINSUM_PLAN_BYTES = 1 << 22
_plans: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_plans_lock = threading.Lock()


def _einsum_key(equation: str, operands: Sequence[Any], join: Any, agg: Any) -> tuple[Any, ...] | None:
    """What a plan for ``ej.einsum`` depends on: the equation, join, aggregation, each operand's
    kind, shape and dtype, and each sparse operand's block size and histogram; None when the call
    is not kept (an operand neither a SparseTensor nor an ndarray, or operands too large)."""
    if not isinstance(equation, str) or not isinstance(agg, (str, type(None))) or \
            not isinstance(join, (str, type(None))):
        return None
    if not all(isinstance(x, (SparseTensor, np.ndarray)) for x in operands):
        return None
    size = sum(x.data.nbytes + x.keys.nbytes if isinstance(x, SparseTensor) else x.nbytes for x in operands)
    if size > EINSUM_PLAN_BYTES:
        return None
    try:
        labels, _ = parse_equation(equation, [tuple(x.shape) for x in operands])
        if any(len(ls) != len(x.shape) for ls, x in zip(labels, operands)):
            return None
        pattern = pattern_of(operands, labels)
    except EinjoinError:
        return None  # the compiler names what is wrong
    kinds = tuple((type(x).__name__, tuple(x.shape), np.dtype(x.dtype).str,
                   x.block if isinstance(x, SparseTensor) else None) for x in operands)
    return (equation, join, agg, kinds, pattern)


def einsum_cached(equation: str, operands: Sequence[Any], join: Any = None, agg: Any = "sum") -> Any:
    """``ej.einsum`` on sparse operands: the plan of an earlier call with the same equation,
    shapes, dtypes and block histograms is run on these operands (``plan.run(*operands)``, its
    layout reused) instead of compiling again; other calls compile (``sparse_einsum``). A plan is
    taken out of the cache while it runs, so that concurrent calls never share one.

    >>> import numpy as np, einjoin as ej
    >>> a = ej.sparse("A", np.eye(3))
    >>> r1 = ej.einsum("ij,jk->ik", a, np.ones((3, 2)))
    >>> r2 = ej.einsum("ij,jk->ik", a, 2 * np.ones((3, 2)))  # the same key: the kept plan runs
    >>> r2.todense().tolist()
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """
    key = _einsum_key(equation, operands, join, agg)
    if key is None:
        return EINSUM["sparse_einsum"](equation, *operands, join=join, agg=agg)
    with _plans_lock:
        plan = _plans.pop(key, None)
    if plan is None:
        plan = sparse_compile(equation, *operands, join=join, agg=agg)
        out = plan.run()
    else:
        out = plan.run(*operands)
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > EINSUM_PLANS:
            _plans.popitem(last=False)
    return out


EINSUM["cached"] = einsum_cached
