"""Constant folding: an op whose inputs are all fills becomes one fill.

Parameter-free subgraphs (causal masks, position tables, constant scales) then cost nothing to
move: every device computes the blocks it needs from the index grid.

>>> from einjoin.ir import ops
>>> from einjoin.ir.fold import fold
>>> rows = ops.fill_node((4, 4), "int64", "x0"); cols = ops.fill_node((4, 4), "int64", "x1")
>>> mask = fold(ops.einsum_node([rows, cols], ("ij", "ij"), "ij", "x0 >= x1", None))
>>> mask.kind, str(mask.op.expr), mask.dtype
('fill', 'x0 >= x1', 'bool')
"""

from __future__ import annotations

from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import kind
from einjoin.ir.node import Broadcast, Cast, Einsum, Fill, Node, Reshape, Select
from einjoin.ir.ops import fill_node
from einjoin.ir.scalar import Arg, Call, Const, Expr, infer_dtype, substitute

__all__ = ["fold"]


def _remap(e: Expr, args: list[Expr]) -> Expr:
    return substitute(e, args)


_ORDER = {"bool": 0, "int": 1, "float": 2}


def _faithful(fill: Node) -> bool:
    """True when a fill's stored values are its expression's values: a bool fill of ``7`` holds
    True and an int64 fill of ``1e30`` a wrapped integer, so an op folded over the expression
    itself would compute with 7 and 1e30 instead (``fill(7, bool).to(float16)`` gave 7)."""
    idx = "float64" if kind(fill.dtype) == "float" else "int64"
    try:
        natural = kind(infer_dtype(fill.op.expr, [idx] * fill.ndim))  # type: ignore[union-attr]
    except EinjoinError:
        return False
    return _ORDER[natural] <= _ORDER[kind(fill.dtype)]


def fold(node: Node) -> Node:
    """``node`` itself, or an equivalent fill when every input is a fill and the op is elementwise,
    a select, a broadcast or a cast. Folding never changes values: a fill folds into another only
    when its own dtype is bool, int64 or float64 (fills compute in float64, so no intermediate
    rounding is lost)."""
    if not node.inputs or not all(isinstance(i.op, Fill) for i in node.inputs):
        return node
    op = node.op
    fills: list[Fill] = [i.op for i in node.inputs]  # type: ignore[misc]
    # selects and broadcasts only move values; arithmetic and casts would lose the rounding of
    # an intermediate float32/16 result, since fills evaluate in float64
    computes = isinstance(op, (Einsum, Cast))
    if computes and any(kind(i.dtype) == "float" and (i.dtype != node.dtype or i.dtype != "float64")
                        for i in node.inputs):
        return node
    if computes and not all(_faithful(i) for i in node.inputs):
        return node
    if kind(node.dtype) != "float" and any(kind(i.dtype) == "float" for i in node.inputs):
        return node
    if isinstance(op, Einsum):
        if op.agg.reduces or any(len(set(ls)) != len(ls) for ls in op.in_labels):
            return node
        out = op.out_labels
        parts = [_remap(f.expr, [Arg(out.index(lab)) for lab in ls])
                 for f, ls in zip(fills, op.in_labels)]
        return fill_node(node.shape, node.dtype, substitute(op.join, parts))
    if isinstance(op, Select):
        shifted: list[Expr] = [Call("add", (Arg(d), Const(s))) if s else Arg(d)
                               for d, s in enumerate(op.starts)]
        return fill_node(node.shape, node.dtype, _remap(fills[0].expr, shifted))
    if isinstance(op, Broadcast):
        src = node.inputs[0]
        mapped: list[Expr] = [Arg(d) if src.shape[i] != 1 else Const(0) for i, d in enumerate(op.dims)]
        return fill_node(node.shape, node.dtype, _remap(fills[0].expr, mapped))
    if isinstance(op, Cast):
        return fill_node(node.shape, node.dtype, fills[0].expr)
    if isinstance(op, Reshape):
        # only size-1 dims inserted or removed: the index grid maps dim to dim
        src = node.inputs[0].shape
        out_big = [d for d, n in enumerate(node.shape) if n != 1]
        if [n for n in src if n != 1] != [node.shape[d] for d in out_big]:
            return node
        it = iter(out_big)
        unit: list[Expr] = [Const(0) if n == 1 else Arg(next(it)) for n in src]
        return fill_node(node.shape, node.dtype, _remap(fills[0].expr, unit))
    return node
