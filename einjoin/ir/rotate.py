"""Rotary embedding's ``rotate_half`` as one node kind (:class:`~einjoin.ir.opkinds.RotateHalf`):
its constructor, its kernels on numpy arrays and torch tensors, and the rewrite that finds it in
a captured graph.

Why a kind of its own: ``cat(-x[h:], x[:h])`` written with the general kinds is two selects, a
negation and a concat (four nodes, each with its tasks and a pass over memory), and its gradient
the same chain again. As one node it is one pass; its adjoint is the same node with the other
sign (``rotate_half`` is orthogonal and its transpose is its negation). Values are only moved and
negated, so every dtype gives the general chain's bits exactly.

A torch model's ``rotate_half`` is captured as that chain (slices, ``neg``, ``cat``);
:func:`as_rotate_half` recognises it (and its gradient's form, ``cat(t[h:], -t[:h])``), and the
compiler's fusion pass (:mod:`einjoin.ir.fuse`) rewrites it before planning.

>>> import numpy as np
>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (2, 4), "float32")
>>> r = rotate_half_node(x)
>>> r.shape, r.op
((2, 4), RotateHalf(axis=1, sign=1))
>>> rotate_half_kernel(np.arange(4.0).reshape(1, 4), 1, 1)
array([[-2., -3.,  0.,  1.]])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from einjoin.errors import DTypeError, ShapeError
from einjoin.ir.dtypes import kind
from einjoin.ir.node import Concat, Einsum, Node, RotateHalf, Select
from einjoin.ir.ops import einsum_node
from einjoin.ir.scalar import Arg, Call

__all__ = ["rotate_half_node", "rotate_half_kernel", "rotate_half_torch", "rotate_half_block",
           "rotate_half_block_torch", "as_rotate_half", "rotated_first"]


def rotate_half_node(x: Node, axis: int = -1, sign: int = 1) -> Node:
    """``sign * cat(-x[h:], x[:h])`` along ``axis`` (of even size ``2h``); ``sign`` is 1 or -1.

    >>> from einjoin.ir import ops
    >>> rotate_half_node(ops.input_node("x", (3, 8), "float16"), sign=-1).op
    RotateHalf(axis=1, sign=-1)
    """
    if not isinstance(x, Node):
        raise ShapeError(f"rotate_half: expected a node, got {type(x).__name__}")
    what = f"rotate_half of input {x.shape} ({x.dtype})"
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ShapeError(f"{what}: the dim must be an int, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ShapeError(f"{what}: dim {axis} out of range for rank {x.ndim}")
    ax = int(axis) % x.ndim
    if x.shape[ax] % 2:
        raise ShapeError(f"{what}: dim {ax} must have an even size, got {x.shape[ax]}")
    if sign not in (1, -1) or isinstance(sign, bool):
        raise ShapeError(f"{what}: sign must be 1 or -1, got {sign!r}")
    if kind(x.dtype) not in ("float", "int"):
        raise DTypeError(f"{what}: negation needs a float or int input, got {x.dtype}")
    return Node(RotateHalf(ax, int(sign)), (x,), x.shape, x.dtype)


def _halves(ndim: int, axis: int, n: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    lead = (slice(None),) * axis
    h = n // 2
    return lead + (slice(0, h),), lead + (slice(h, n),)


def _rotate_into(out: Any, x: Any, axis: int, sign: int, negative: Any) -> Any:
    """``out = sign * cat(-x[h:], x[:h])`` along ``axis``; ``negative(a, out=b)``: numpy's or torch's."""
    lo, hi = _halves(len(x.shape), axis, x.shape[axis])
    if sign == 1:
        negative(x[hi], out=out[lo])
        out[hi] = x[lo]
    else:
        out[lo] = x[hi]
        negative(x[lo], out=out[hi])
    return out


def rotate_half_kernel(x: np.ndarray, axis: int, sign: int) -> np.ndarray:
    """The numpy kernel: ``sign * cat(-x[h:], x[:h])`` along ``axis`` in one output array."""
    x = np.asarray(x)
    out: np.ndarray = _rotate_into(np.empty(x.shape, x.dtype), x, axis, sign, np.negative)
    return out


def rotate_half_torch(x: Any, axis: int, sign: int) -> Any:
    """:func:`rotate_half_kernel` on a torch tensor (any device; the result on x's)."""
    import torch
    return _rotate_into(torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device), x, axis, sign, torch.neg)


def _cut(out: Any, op: RotateHalf, box: Any) -> Any:
    # a block's kernel reads whole rows along the axis (see decomposition's rule): a cut of the
    # axis keeps its columns
    lo, hi = box[op.axis]
    if (lo, hi) == (0, out.shape[op.axis]):
        return out
    return out[(slice(None),) * op.axis + (slice(lo, hi),)]


def rotate_half_block(d: Any, op: RotateHalf, k: Any, blocks: Any, box: Any) -> np.ndarray:
    """The numpy block kernel (a :data:`~einjoin.decomp.block_kernels.BLOCK_KERNELS` entry)."""
    return np.ascontiguousarray(_cut(rotate_half_kernel(blocks[0], op.axis, op.sign), op, box))


def rotate_half_block_torch(d: Any, op: RotateHalf, k: Any, blocks: Any, box: Any) -> Any:
    """The torch block kernel (a ``TORCH_KERNELS`` entry of the torch backend)."""
    return _cut(rotate_half_torch(blocks[0], op.axis, op.sign), op, box).contiguous()


def _negated(n: Node) -> Node | None:
    """The input of ``n`` when ``n`` is an einsum computing ``-x0`` of it, labels unchanged."""
    op = n.op
    if (isinstance(op, Einsum) and len(n.inputs) == 1 and isinstance(op.join, Call) and op.join.fn == "neg"
            and op.join.args == (Arg(0),) and tuple(op.in_labels[0]) == tuple(op.out_labels)
            and n.dtype == n.inputs[0].dtype and n.shape == n.inputs[0].shape):
        return n.inputs[0]
    return None


def _half_of(n: Node, axis: int) -> tuple[Node, int] | None:
    """(x, 0 or 1) when ``n`` selects the first or second half of ``x`` along ``axis``, whole
    along every other dim."""
    op = n.op
    if not isinstance(op, Select):
        return None
    x = n.inputs[0]
    size = x.shape[axis]
    if size % 2 or any((a, b) != (0, s) for d, (a, b, s) in enumerate(zip(op.starts, op.stops, x.shape))
                       if d != axis):
        return None
    h = size // 2
    span = (op.starts[axis], op.stops[axis])
    return (x, 0) if span == (0, h) else (x, 1) if span == (h, size) else None


def as_rotate_half(n: Node) -> Node | None:
    """``n`` as one :class:`~einjoin.ir.opkinds.RotateHalf` node when it is the general chain for
    one: ``cat(-x[h:], x[:h])`` (sign 1, torch's ``rotate_half``) or ``cat(x[h:], -x[:h])``
    (sign -1, its gradient), halves of one ``x`` along the concat's axis; else None.

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (2, 4), "float32")
    >>> lo, hi = ops.select_node(x, (0, 0), (2, 2)), ops.select_node(x, (0, 2), (2, 4))
    >>> neg = ops.einsum_node([hi], ("ij",), "ij", "-x0", None)
    >>> as_rotate_half(ops.concat_node([neg, lo], 1)).op
    RotateHalf(axis=1, sign=1)
    """
    op = n.op
    if not isinstance(op, Concat) or len(n.inputs) != 2:
        return None
    a, b = n.inputs
    for sign, negated, plain in ((1, a, b), (-1, b, a)):
        inner = _negated(negated)
        if inner is None:
            continue
        first, second = _half_of(inner, op.axis), _half_of(plain, op.axis)
        if first is None or second is None or first[0] is not second[0]:
            continue
        x = first[0]
        if x.dtype != n.dtype:
            continue
        # sign 1: cat(-x[h:], x[:h]); sign -1: cat(x[h:], -x[:h])
        if (sign == 1 and (first[1], second[1]) == (1, 0)) or (sign == -1 and (first[1], second[1]) == (0, 1)):
            return rotate_half_node(x, op.axis, sign)
    return None


def rotated_first(n: Node) -> Node | None:
    """RotateHalf ``n`` of a relabelling einsum (a transpose: one input, join ``x0``, nothing
    aggregated, no diagonal) as the same relabelling of the rotation of that einsum's input (the
    rotation acts along one dim, whichever order the others are in: the same values), else None.
    Fusion then inlines the relabelling into elementwise readers: rotary's transpose of q and k
    to (batch, heads, seq, dim) is no node of its own.

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (2, 3, 4), "float32")
    >>> t = ops.einsum_node([x], ("abc",), "bac", "x0", None)
    >>> y = rotated_first(rotate_half_node(t))
    >>> y.op.equation, y.inputs[0].op
    ('abc->bac', RotateHalf(axis=2, sign=1))
    """
    op, t = n.op, n.inputs[0]
    top = t.op
    if not (isinstance(op, RotateHalf) and isinstance(top, Einsum) and len(t.inputs) == 1
            and top.join == Arg(0) and t.dtype == t.inputs[0].dtype):
        return None
    labels = tuple(top.in_labels[0])
    if len(set(labels)) != len(labels) or set(labels) != set(top.out_labels):
        return None
    inner = rotate_half_node(t.inputs[0], labels.index(top.out_labels[op.axis]), op.sign)
    return einsum_node([inner], [labels], top.out_labels, top.join, top.agg)
