"""The compiled sparse plans of a graph's sparse operand (a constant, ``einjoin.sparse.node``, or
one fed at run, ``einjoin.sparse.feed``): what a ``SparseEinsum`` kernel runs."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.ir.dtypes import is_half, numpy_dtype
from einjoin.ir.opkinds import SparseEinsum
from einjoin.sparse.plan import SparsePlan, sparse_compile
from einjoin.sparse.tensor import SparseTensor

__all__ = ["PlanCache"]


class PlanCache:
    """The compiled sparse plans of one graph operand: one per (equation, dense shapes and
    dtypes), each run under its own lock (a plan's run keeps per-run state)."""

    __slots__ = ("_plans", "_lock")

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], tuple[SparsePlan, threading.Lock]] = {}
        self._lock = threading.Lock()

    def run(self, op: SparseEinsum, dense: Sequence[np.ndarray], tensor: SparseTensor, dtype: str) -> np.ndarray:
        """The einsum of ``op`` on ``tensor`` and the dense blocks ``dense``, as a dense array of
        ``dtype``: half blocks computed in float32 and rounded once."""
        arrays = [np.asarray(a.astype(np.float32) if is_half(a.dtype) else a, order="C") for a in dense]
        key = (op.in_labels, op.out_labels, op.position, tuple((a.shape, a.dtype.str) for a in arrays))
        operands: list[Any] = list(arrays)
        operands.insert(op.position, tensor)
        with self._lock:
            found = self._plans.get(key)
            if found is None:
                # one device: the dense engine runs this kernel on its device's thread; compiled
                # once per shapes, so later calls skip the layout choice (a fed tensor of another
                # pattern is replanned by the plan's run, cached per block histogram)
                plan = sparse_compile(op.equation, *operands, backend="sync")
                found = self._plans[key] = (plan, threading.Lock())
        plan, lock = found
        with lock:
            out = plan.run(*operands)
        res = out.todense() if isinstance(out, SparseTensor) else np.asarray(out)
        return res.astype(numpy_dtype(dtype), copy=False)
