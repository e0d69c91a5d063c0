"""Constant folding for the backward pass: :func:`refold`, now :func:`einjoin.ir.fold.fold`
itself.

A scalar loss's cotangent is a fill (1.0); carried down a chain of elementwise ops it stays a
fill. ``fold`` computes a float64 fill's constant sub-expressions as the fill would at run time
(in float64), so the cotangent stays one number instead of nesting one level deeper per op.
``refold`` is kept as an alias for the backward rules that import it.

>>> from einjoin.ir import ops
>>> g = ops.fill_node((3,), "float64", 1.0)
>>> for _ in range(3):
...     g = refold(ops.einsum_node([g], ("i",), "i", "x0 * 0.5", None))
>>> g.kind, str(g.op.expr)
('fill', '0.125')
"""

from __future__ import annotations

from einjoin.ir.fold import fold

__all__ = ["refold"]

refold = fold  # fold computes float64 fills' constants itself (einjoin.ir.fold)
