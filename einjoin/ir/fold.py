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

from typing import Any
from collections.abc import Callable

from einjoin.errors import EinjoinError
from einjoin.ir.derivative import simplify
from einjoin.ir.dtypes import kind
from einjoin.ir.node import Attention, AttentionGrad, RotateHalf, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool,
                             Reshape, ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.ops import fill_node
from einjoin.ir.scalar import Arg, Call, Const, Expr, infer_dtype, substitute

__all__ = ["fold", "FOLD_RULES"]


def _remap(e: Expr, args: list[Expr]) -> Expr:
    return substitute(e, args)


_ORDER = {"bool": 0, "int": 1, "float": 2}


def _faithful(fill: Node) -> bool:
    """True when a fill's stored values are its expression's values: a bool fill of ``7`` holds
    True and an int64 fill of ``1e30`` a wrapped integer, so an op folded over the expression
    itself would compute with 7 and 1e30 instead (``fill(7, bool).to(float16)`` gave 7)."""
    idx = "float64" if kind(fill.dtype) == "float" else "int64"
    try:
        natural = kind(infer_dtype(_fill(fill).expr, [idx] * fill.ndim))
    except EinjoinError:
        return False
    return _ORDER[natural] <= _ORDER[kind(fill.dtype)]


def fold(node: Node) -> Node:
    """``node`` itself, or an equivalent fill when every input is a fill and the op is elementwise,
    a select, a broadcast or a cast. Folding never changes values: a fill folds into another only
    when its own dtype is bool, int64 or float64 (fills compute in float64, so no intermediate
    rounding is lost)."""
    if not node.inputs or not all(i.facts.free for i in node.inputs):
        return node
    fills = [_fill(i) for i in node.inputs]
    # selects and broadcasts only move values; arithmetic and casts would lose the rounding of
    # an intermediate float32/16 result, since fills evaluate in float64
    computes = node.facts.computes
    if computes and any(kind(i.dtype) == "float" and (i.dtype != node.dtype or i.dtype != "float64")
                        for i in node.inputs):
        return node
    if computes and not all(_faithful(i) for i in node.inputs):
        return node
    if computes and any(kind(i.dtype) == "int" and i.dtype != "int64" for i in node.inputs):
        return node  # fills compute ints in int64: an int32 intermediate would not wrap before a //
    if kind(node.dtype) != "float" and any(kind(i.dtype) == "float" for i in node.inputs):
        return node
    out = rule_for(FOLD_RULES, node.op, "constant folding (einjoin.ir.fold.FOLD_RULES)")(
        node, node.op, fills)
    if out is not node and out.kind == "fill" and out.dtype == "float64":
        # compute the composed expression's constants (in float64, as the fill would at run
        # time): a chain of constant ops then stays one number instead of nesting one level
        # deeper per op until hash-consing it overflows the stack
        expr = _fill(out).expr
        simple = simplify(expr)
        if simple is not expr:
            out = fill_node(out.shape, out.dtype, simple)
    return out


def _fill(node: Node) -> Fill:
    assert isinstance(node.op, Fill)
    return node.op


def _fold_einsum(node: Node, op: Einsum, fills: list[Fill]) -> Node:
    if op.agg.reduces or any(len(set(ls)) != len(ls) for ls in op.in_labels):
        return node
    out = op.out_labels
    parts = [_remap(f.expr, [Arg(out.index(lab)) for lab in ls])
             for f, ls in zip(fills, op.in_labels)]
    return fill_node(node.shape, node.dtype, substitute(op.join, parts))


def _fold_select(node: Node, op: Select, fills: list[Fill]) -> Node:
    shifted: list[Expr] = [Call("add", (Arg(d), Const(s))) if s else Arg(d)
                           for d, s in enumerate(op.starts)]
    return fill_node(node.shape, node.dtype, _remap(fills[0].expr, shifted))


def _fold_broadcast(node: Node, op: Broadcast, fills: list[Fill]) -> Node:
    src = node.inputs[0]
    mapped: list[Expr] = [Arg(d) if src.shape[i] != 1 else Const(0) for i, d in enumerate(op.dims)]
    return fill_node(node.shape, node.dtype, _remap(fills[0].expr, mapped))


def _fold_cast(node: Node, op: Cast, fills: list[Fill]) -> Node:
    # the expression must give values of the new kind, or an op folded over it later reads the
    # old kind (a bool mask cast to int64 and multiplied: ``mul`` refuses bools): bool -> number
    # is where(e, 1, 0), number -> bool is e != 0
    expr = fills[0].expr
    idx = "float64" if kind(node.dtype) == "float" else "int64"
    try:
        natural = kind(infer_dtype(expr, [idx] * node.ndim))
    except EinjoinError:
        return node
    if natural == "bool" and kind(node.dtype) != "bool":
        expr = Call("where", (expr, Const(1), Const(0)))
    elif natural != "bool" and kind(node.dtype) == "bool":
        expr = Call("ne", (expr, Const(0)))
    return fill_node(node.shape, node.dtype, expr)


def _fold_reshape(node: Node, op: Reshape, fills: list[Fill]) -> Node:
    # only size-1 dims inserted or removed: the index grid maps dim to dim
    src = node.inputs[0].shape
    out_big = [d for d, n in enumerate(node.shape) if n != 1]
    if [n for n in src if n != 1] != [node.shape[d] for d in out_big]:
        return node
    it = iter(out_big)
    unit: list[Expr] = [Const(0) if n == 1 else Arg(next(it)) for n in src]
    return fill_node(node.shape, node.dtype, _remap(fills[0].expr, unit))


def _kept(node: Node, op: object, fills: list[Fill]) -> Node:
    """Not folded: a concat, gather, scatter-add, conv, pool or topk of fills stays as it is (inputs and
    fills have no inputs)."""
    return node


# constant folding per node kind: (node, its op, its inputs' fills) -> the node or a fill
FOLD_RULES: dict[type, Callable[[Node, Any, list[Fill]], Node]] = {
    Input: _kept,
    Einsum: _fold_einsum,
    Reshape: _fold_reshape,
    Broadcast: _fold_broadcast,
    Select: _fold_select,
    Concat: _kept,
    Fill: _kept,
    Gather: _kept,
    ScatterAdd: _kept,
    Cast: _fold_cast,
    Conv: _kept,
    Pool: _kept,
    TopK: _kept,
    RotateHalf: _kept,
    Attention: _kept,
    AttentionGrad: _kept,
    SparseEinsum: _kept,
}
