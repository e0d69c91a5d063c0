"""The graph-level reverse pass: cotangents of outputs -> cotangents of chosen nodes, as IR.

Nodes are visited in reverse topological order; a node's cotangent is the sum of what its
consumers sent it (one n-ary ``add`` einsum); only nodes on a path from a ``wrt`` node to an
output are differentiated, and only float nodes carry cotangents (an int or bool value is
piecewise constant). Each node's rule comes from :data:`einjoin.autodiff.rules.GRAD_RULES`.
Forward values the rules read are the forward nodes themselves, shared by hash-consing, so the
backward graph never recomputes them.

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (3,), "float64")
>>> y = ops.einsum_node([x, x], ("i", "i"), "", "mul", "sum")     # y = sum(x * x)
>>> (dx,) = backward([y], [ops.fill_node((), "float64", 1.0)], [x])
>>> dx.kind, dx.shape
('einsum', (3,))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from einjoin.autodiff.rules import GRAD_RULES
from einjoin.errors import EinjoinError
from einjoin.ir import ops
from einjoin.ir.dtypes import kind
from einjoin.ir.fold import fold
from einjoin.ir.node import Node, rule_for
from einjoin.ir.scalar import parse_join

__all__ = ["backward", "RULE_HITS", "topological"]

# node kind -> how many times its rule ran (read by the tests' coverage check)
RULE_HITS: Counter[str] = Counter()


def topological(outputs: Sequence[Node]) -> list[Node]:
    """Every ancestor of ``outputs`` (themselves included), inputs before consumers."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in outputs:
        if root in seen:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        seen.add(root)
        while stack:  # iterative: a deep chain must not hit Python's recursion limit
            node, k = stack.pop()
            if k < len(node.inputs):
                stack.append((node, k + 1))
                child = node.inputs[k]
                if child not in seen:
                    seen.add(child)
                    stack.append((child, 0))
            else:
                order.append(node)
    return order


# cotangents summed by one n-ary add einsum at most: a tensor read by hundreds of ops (a weight
# shared by every step of an unrolled loop) would make one join nested too deep to parse
_FAN_IN = 16


def _padded(x: Node) -> tuple[int, list[tuple[int, int, Node]]] | None:
    """(axis, [(start, stop, piece)]) of a cotangent that is pieces placed in zeros along one axis
    (a concat whose other inputs are zero fills: what a select's rule sends back), else None."""
    axis = ops.concat_axis(x)
    if axis is None or not any(ops.is_zero_fill(p) for p in x.inputs):
        return None
    at, pieces = 0, []
    for p in x.inputs:
        width = p.shape[axis]
        if not ops.is_zero_fill(p):
            pieces.append((at, at + width, p))
        at += width
    return axis, pieces


def _merge_padded(parts: list[Node]) -> list[Node]:
    """``parts`` with the cotangents that are pieces in zeros along the same axis, whose pieces do
    not overlap, made one concat of all their pieces (zeros only in the gaps left): the select
    rule's ``concat(a, zeros) + concat(zeros, b)`` (rotary's ``rotate_half`` reads both halves of
    one tensor) is ``concat(a, b)``, one concat and no zero fills, and one addend fewer. Adding a
    zero is exact but for the sign of a zero (``-0 + 0`` is ``+0``): the merged sum keeps a
    piece's ``-0`` where the parts' sum gave ``+0``."""
    by_axis: dict[int, list[int]] = {}
    found: dict[int, tuple[int, list[tuple[int, int, Node]]]] = {}
    for i, x in enumerate(parts):
        got = _padded(x)
        if got is not None:
            found[i] = got
            by_axis.setdefault(got[0], []).append(i)
    out: list[Node | None] = list(parts)
    for axis, idx in by_axis.items():
        if len(idx) < 2:
            continue
        pieces = sorted((p for i in idx for p in found[i][1]), key=lambda p: p[0])
        if any(a[1] > b[0] for a, b in zip(pieces, pieces[1:])):
            continue  # pieces overlap: summed as they are
        like = parts[idx[0]]
        inputs: list[Node] = []
        at = 0
        ends: list[tuple[int, int, Node | None]] = [*pieces, (like.shape[axis], like.shape[axis], None)]
        for start, stop, piece in ends:
            if start > at:  # a gap: zeros
                shape = list(like.shape)
                shape[axis] = start - at
                inputs.append(ops.fill_node(tuple(shape), like.dtype, 0))
            if piece is not None:
                inputs.append(piece)
            at = stop
        merged = inputs[0] if len(inputs) == 1 else ops.concat_node(inputs, axis)
        for i in idx:
            out[i] = None
        out[idx[0]] = merged
    return [x for x in out if x is not None]


def _total(parts: list[Node]) -> Node:
    """The sum of a node's incoming cotangents: n-ary adds of at most :data:`_FAN_IN` parts, in
    a tree (parts that are pieces in zeros first merged, :func:`_merge_padded`)."""
    if len(parts) > 1:
        parts = _merge_padded(parts)
    if parts[0].ndim > 26:
        raise EinjoinError(f"summing cotangents of rank {parts[0].ndim}: at most 26 dims")
    labels = "".join(chr(ord("a") + d) for d in range(parts[0].ndim))
    while len(parts) > 1:
        parts = [group[0] if len(group) == 1 else
                 fold(ops.einsum_node(group, [labels] * len(group), labels,
                                        parse_join("add", len(group)), None))
                 for group in (parts[k:k + _FAN_IN] for k in range(0, len(parts), _FAN_IN))]
    return parts[0]


def _fit(adj: Node, x: Node, node: Node) -> Node:
    if adj.shape != x.shape:  # a rule's bug, not the user's: say which
        raise EinjoinError(f"gradient rule of {node.kind} gave shape {adj.shape} for an input of "
                           f"shape {x.shape}")
    if adj.dtype != x.dtype:
        adj = fold(ops.cast_node(adj, x.dtype))
    return adj


def backward(outputs: Sequence[Node], cotangents: Sequence[Node], wrt: Sequence[Node]
             ) -> list[Node]:
    """The cotangent of each ``wrt`` node (an exact zero fill where none reaches it), given the
    cotangent of each output (same shape and dtype as the output)."""
    order = topological(outputs)
    targets = set(wrt)
    carries: dict[Node, bool] = {}
    for node in order:  # on a path from a wrt node, and a float value
        carries[node] = kind(node.dtype) == "float" and (
            node in targets or any(carries[x] for x in node.inputs))
    pending: dict[Node, list[Node]] = {}
    for y, g in zip(outputs, cotangents):
        if carries[y]:
            pending.setdefault(y, []).append(g)
    totals: dict[Node, Node] = {}
    for node in reversed(order):
        parts = pending.pop(node, None)
        if not parts:
            continue
        g = _total(parts)
        if node in targets:
            totals[node] = g
        wanted = tuple(carries[x] for x in node.inputs)
        if node.inputs and not any(wanted):
            continue  # a wrt node computed from no wrt node: its inputs need nothing
        RULE_HITS[type(node.op).__name__] += 1
        adjoints = rule_for(GRAD_RULES, node.op, "the gradient rules (einjoin.autodiff.rules.GRAD_RULES)"
                            )(node, g, wanted)
        for x, adj, w in zip(node.inputs, adjoints, wanted):
            if w and adj is not None:
                pending.setdefault(x, []).append(_fit(adj, x, node))
    return [totals[x] if x in totals else ops.fill_node(x.shape, x.dtype, 0) for x in wrt]
