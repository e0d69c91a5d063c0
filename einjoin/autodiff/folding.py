"""Constant folding for the backward pass: :func:`refold`.

A scalar loss's cotangent is a fill (1.0); carried down a chain of elementwise ops it stays a
fill, and :func:`einjoin.ir.fold.fold` composes the fills' expressions one level deeper per op
(``0.99 * (0.99 * (... * 1.0))``): a chain of a few hundred float64 ops overflowed Python's
recursion limit in hash-consing. :func:`refold` computes a float64 fill's constant
sub-expressions as the fill itself would at run time (in float64), so the cotangent stays one
number.

>>> from einjoin.ir import ops
>>> g = ops.fill_node((3,), "float64", 1.0)
>>> for _ in range(3):
...     g = refold(ops.einsum_node([g], ("i",), "i", "x0 * 0.5", None))
>>> g.kind, str(g.op.expr)
('fill', '0.125')
"""

from __future__ import annotations

from einjoin.ir import ops
from einjoin.ir.derivative import simplify
from einjoin.ir.fold import fold
from einjoin.ir.node import Node

__all__ = ["refold"]


def refold(node: Node) -> Node:
    """:func:`~einjoin.ir.fold.fold`, then a float64 fill's constant sub-expressions computed
    (other fills are left alone: a float32 fill's arithmetic never folds, and ``simplify``
    computes in float64)."""
    out = fold(node)
    if out.kind == "fill" and out.dtype == "float64":
        expr = out.op.expr  # type: ignore[union-attr]
        simple = simplify(expr)
        if simple is not expr:
            out = ops.fill_node(out.shape, out.dtype, simple)
    return out
