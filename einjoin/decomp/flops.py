"""Modelled flops of a kernel: a pure function of the decomposition (used by the plan's accounting
and by placers that estimate run times)."""

from __future__ import annotations

from einjoin.decomp.decompose import Decomposition
from einjoin.ir.node import Einsum
from einjoin.ir.scalar import Call, is_product

__all__ = ["kernel_flops"]


def _count_calls(e: object) -> int:
    return 1 + sum(_count_calls(a) for a in e.args) if isinstance(e, Call) else 0


def kernel_flops(d: Decomposition, index: tuple[int, ...]) -> int:
    """Modelled flops of one kernel: the joined label box times the join's operations (a
    multiply-add per element for a contraction)."""
    op = d.node.op
    if not isinstance(op, Einsum):
        return 0
    n = 1
    for b, i in zip(d.spec.bounds, index):
        n *= b[i + 1] - b[i]
    if is_product(op.join, len(d.node.inputs)) and op.agg.reduces:
        return 2 * n
    return n * max(1, _count_calls(op.join))
