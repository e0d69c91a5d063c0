"""The gradient rule of every node kind, as data: :data:`GRAD_RULES`.

A rule takes the node, the cotangent ``g`` of its output (a node of the output's shape and
dtype) and which inputs need a cotangent, and returns one node (or None: no contribution) per
input, built from IR nodes only — the backward pass is an ordinary graph.

- ``Input``, ``Fill``: no inputs.
- ``Einsum``: :func:`einjoin.autodiff.einsum_rule.einsum_adjoints` (contractions, symbolic
  joins, max/min/prod aggregations).
- ``Reshape``: reshape back. ``Cast``: cast back.
- ``Broadcast``: sum over the broadcast dims (an einsum with agg sum), reshaped to the input.
- ``Select``: the cotangent placed in zeros: a concat of fills around it, dim by dim.
- ``Concat``: the select of each input's range.
- ``Gather``: a scatter-add of the cotangent into the table's rows (O(tokens x hidden), never a
  one-hot contraction); nothing for the int64 indices.
- ``ScatterAdd``: a gather of the cotangent (its adjoint w.r.t. the updates).
- ``Conv``, ``Pool``: window ops again (:mod:`einjoin.autodiff.conv_rule`): a transposed conv
  for the input, a conv of the input by the cotangent for the weight, the max pool's cotangent
  routed through an equality mask of its windows.
- ``TopK``: the values' cotangent placed back at their positions (an einsum comparing the
  indices with an iota); nothing for the indices.
- ``Attention``: :class:`~einjoin.ir.opkinds.AttentionGrad` nodes (torch's fused backward in
  their kernels; the score matrix is never a tensor of the graph), read back by selects.
  ``AttentionGrad`` itself has no rule (no second derivative through fused attention).
- ``SparseEinsum``: sparse einsums again, with the same sparse constant
  (:func:`einjoin.ir.sparse_einsum.sparse_adjoints`); the constant itself gets none.

>>> from einjoin.ir import ops
>>> from einjoin.ir.node import rule_for
>>> x = ops.input_node("x", (4, 6), "float64")
>>> y = ops.select_node(x, (1, 0), (3, 6))
>>> g = ops.input_node("g", (2, 6), "float64")
>>> (dx,) = rule_for(GRAD_RULES, y.op, "GRAD_RULES")(y, g, (True,))
>>> dx.kind, dx.shape
('concat', (4, 6))
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from typing import cast

from einjoin.autodiff.conv_rule import conv_adjoints, pool_adjoints
from einjoin.autodiff.einsum_rule import einsum_adjoints
from einjoin.errors import EinjoinError
from einjoin.ir import ops
from einjoin.ir.attention import GRAD_PARTS, attention_grad_node, grad_rows
from einjoin.ir.fold import fold
from einjoin.ir.node import Attention, AttentionGrad, RotateHalf, SparseEinsum
from einjoin.ir.rotate import rotate_half_node
from einjoin.ir.sparse_einsum import sparse_adjoints
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK)

__all__ = ["GRAD_RULES", "GradRule"]

GradRule = Callable[[Node, Node, Sequence[bool]], tuple[Node | None, ...]]

_LETTERS = string.ascii_letters


def _no_inputs(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    return ()


def _reshape(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    return (fold(ops.reshape_node(g, node.inputs[0].shape)),)


def _cast(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    return (fold(ops.cast_node(g, node.inputs[0].dtype)),)


def _broadcast(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    x = node.inputs[0]
    dims: tuple[int, ...] = node.op.dims  # type: ignore[union-attr]
    if node.ndim > len(_LETTERS):
        raise EinjoinError(f"the gradient of a broadcast to rank {node.ndim} (shape {node.shape}): "
                           f"at most {len(_LETTERS)} dims")
    labels = _LETTERS[:node.ndim]
    # output dims that came from an input dim of the same size stay; the rest are summed
    keep = [dims[i] for i in range(x.ndim) if x.shape[i] == node.shape[dims[i]]]
    out = "".join(labels[d] for d in keep)
    s = fold(ops.einsum_node([g], [labels], out, "x0", "sum"))
    return (fold(ops.reshape_node(s, x.shape)),)


def _select(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    x = node.inputs[0]
    starts: tuple[int, ...] = node.op.starts  # type: ignore[union-attr]
    stops: tuple[int, ...] = node.op.stops  # type: ignore[union-attr]
    cur = g
    for d in range(x.ndim):
        before, after = starts[d], x.shape[d] - stops[d]
        if not before and not after:
            continue
        parts = []
        for width in (before, after):
            shape = list(cur.shape)
            shape[d] = width
            parts.append(ops.fill_node(tuple(shape), g.dtype, 0) if width else None)
        cur = ops.concat_node([p for p in (parts[0], cur, parts[1]) if p is not None], d)
    return (cur,)


def _concat(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    axis: int = node.op.axis  # type: ignore[union-attr]
    out: list[Node | None] = []
    offset = 0
    for x, w in zip(node.inputs, wanted):
        n = x.shape[axis]
        if w:
            starts = [0] * node.ndim
            stops = list(node.shape)
            starts[axis], stops[axis] = offset, offset + n
            out.append(fold(ops.select_node(g, starts, stops)))
        else:
            out.append(None)
        offset += n
    return tuple(out)


def _gather(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    table, indices = node.inputs
    return (ops.scatter_add_node(g, indices, table.shape[0]) if wanted[0] else None, None)


def _scatter_add(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    indices = node.inputs[1]
    return (ops.gather_node(g, indices) if wanted[0] else None, None)


def _topk(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """The values' cotangent scattered back to the positions they came from: one einsum over
    (row, output position, input position) with the indices compared to an iota (O(n k) a row)."""
    op = cast(TopK, node.op)
    x = node.inputs[0]
    if op.indices or not wanted[0]:
        return (None,)  # int64 positions have no derivative
    idx = ops.topk_node(x, op.k, op.axis, op.largest, indices=True)
    if x.ndim + 1 > len(_LETTERS):
        raise EinjoinError(f"the gradient of a topk of rank {x.ndim}: at most {len(_LETTERS) - 1} dims")
    labels = _LETTERS[:x.ndim]
    i = _LETTERS[x.ndim]  # the input's position on the axis (the output's is labels[axis])
    iota = ops.fill_node((x.shape[op.axis],), "int64", "x0")
    out = labels[:op.axis] + i + labels[op.axis + 1:]
    dx = ops.einsum_node([g, idx, iota], [tuple(labels), tuple(labels), (i,)], tuple(out),
                         "where(x1 == x2, x0, 0)", "sum")
    return (dx,)


def _rotate_half(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    # rotate_half is orthogonal and its transpose is its negation: the same node, the other sign
    op = cast(RotateHalf, node.op)
    return (rotate_half_node(g, op.axis, -op.sign),)


def _attention(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """dq, dk, dv from as few :class:`~einjoin.ir.opkinds.AttentionGrad` nodes as their widths
    allow, and an additive mask's gradient from one of its own.

    Why stacked: a node has one output, and torch's fused backward makes dq, dk and dv in one
    pass. One node per gradient (as TopK's values and indices) would run that backward three
    times; one node whose output is the wanted gradients stacked along the rows runs it once, and
    a select per gradient reads its rows back (the exchange moves only those rows). Gradients of
    another last dim (``Ev != E``: dv) go to a second node."""
    q, k, v = node.inputs[:3]
    width = {"q": q.shape[-1], "k": k.shape[-1], "v": v.shape[-1]}
    groups: list[list[str]] = []
    for p, w in zip(GRAD_PARTS, wanted):
        if w:
            if groups and width[groups[-1][0]] == width[p]:
                groups[-1].append(p)
            else:
                groups.append([p])
    found: dict[str, Node] = {}
    for parts in groups:
        stacked = attention_grad_node(node, g, parts)
        for p, (a, b) in zip(parts, grad_rows(q, k, parts)):
            found[p] = ops.select_node(stacked, (0,) * (q.ndim - 2) + (a, 0), stacked.shape[:-2] + (b, width[p]))
    out: list[Node | None] = [found.get(p) for p in GRAD_PARTS]
    if len(node.inputs) > 3:
        mask = node.inputs[3]
        out.append(attention_grad_node(node, g, ("mask",)) if wanted[3] and mask.dtype != "bool" else None)
    return tuple(out)


def _no_second(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    raise EinjoinError("the gradient of an attention gradient (a second derivative through fused attention) "
                       "is not supported")


GRAD_RULES: dict[type, GradRule] = {
    Input: _no_inputs,
    Fill: _no_inputs,
    Einsum: einsum_adjoints,
    Reshape: _reshape,
    Broadcast: _broadcast,
    Select: _select,
    Concat: _concat,
    Cast: _cast,
    Gather: _gather,
    ScatterAdd: _scatter_add,
    Conv: conv_adjoints,
    Pool: pool_adjoints,
    TopK: _topk,
    RotateHalf: _rotate_half,
    Attention: _attention,
    AttentionGrad: _no_second,
    SparseEinsum: sparse_adjoints,
}
