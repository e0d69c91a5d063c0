"""What each node kind means, as numpy kernels on dense arrays.

The same functions evaluate a whole tensor (the reference) and one block (the blocked
executor and, later, the runtime): block-level variants take the block's box as data
(where a fill starts, which table rows a gather block holds).

>>> import numpy as np
>>> from einjoin.ir import ops
>>> from einjoin.ir.kernels import eval_node
>>> a = ops.input_node("a", (2, 3), "float32"); b = ops.input_node("b", (3, 2), "float32")
>>> z = ops.einsum_node([a, b], ("ij", "jk"), "ik", "mul", "sum")
>>> eval_node(z, [np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)])
array([[3., 3.],
       [3., 3.]], dtype=float32)
"""

from __future__ import annotations

from typing import Sequence

import ml_dtypes
import numpy as np
import opt_einsum

from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import kind, numpy_dtype
from einjoin.ir.node import (Broadcast, Cast, Concat, Einsum, Fill, Gather, Input, Node, Reshape,
                             Select)
from einjoin.ir.scalar import Expr, evaluate, is_product

__all__ = ["eval_node", "einsum_kernel", "fill_kernel", "gather_kernel", "broadcast_kernel",
           "align", "partial_dtype", "HALF_DTYPES"]


_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
HALF_DTYPES = ("float16", "bfloat16")
# aggregations whose partial results lose range or precision when rounded to a half type
# (max/min pick one of their arguments: exact in any dtype)
_ACCUMULATING = ("sum", "prod")


def partial_dtype(node: Node) -> str:
    """The dtype ``node``'s partial results are kept, moved and combined in when an aggregated
    label is split: float32 for a float16/bfloat16 einsum that sums or multiplies (as torch and
    cuBLAS accumulate), cast to ``node.dtype`` once, by the last aggregation step; otherwise
    ``node.dtype``. (A gather's row partials are exact: every element but one is 0.)

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (4, 8), "float16")
    >>> partial_dtype(ops.einsum_node([x], ("ij",), "i", "x0", "sum")), partial_dtype(x)
    ('float32', 'float16')
    """
    op = node.op
    if (node.dtype in HALF_DTYPES and isinstance(op, Einsum)
            and op.agg.name in _ACCUMULATING):
        return "float32"
    return node.dtype


def _widen(x: np.ndarray) -> np.ndarray:
    # half types compute in float32 (numpy sums in float16 lose precision fast)
    if x.dtype in _HALF:
        return x.astype(np.float32)
    return x


def align(x: np.ndarray, labels: Sequence[str], order: Sequence[str]) -> np.ndarray:
    """View ``x`` (dims named ``labels``) with one axis per label of ``order``: repeated labels
    become their diagonal, axes are permuted to ``order``, absent labels get size 1."""
    ls = list(labels)
    while len(set(ls)) < len(ls):
        a = next(i for i, lab in enumerate(ls) if ls.index(lab) != i)
        b = ls.index(ls[a])
        x = np.diagonal(x, axis1=b, axis2=a)
        lab = ls[a]
        ls = [l for k, l in enumerate(ls) if k not in (a, b)] + [lab]
    perm = sorted(range(len(ls)), key=lambda k: order.index(ls[k]))
    x = x.transpose(perm)
    present = {ls[k] for k in perm}
    it = iter(x.shape)
    return x.reshape(tuple(next(it) if lab in present else 1 for lab in order))


def einsum_kernel(op: Einsum, arrays: Sequence[np.ndarray], out_dtype: str) -> np.ndarray:
    """One einsum on (blocks of) its inputs: join every tuple, aggregate the missing labels."""
    xs = [_widen(np.asarray(a)) for a in arrays]
    n = len(xs)
    if (is_product(op.join, n) and op.agg.name in ("sum", "none")
            and all(x.dtype.kind in "fi" for x in xs)):
        # the contraction case: BLAS through opt_einsum's pairwise order
        sym = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(op.all_labels)}
        eq = ",".join("".join(sym[lab] for lab in ls) for ls in op.in_labels)
        eq += "->" + "".join(sym[lab] for lab in op.out_labels)
        if n == 2 and xs[0].dtype.kind == "f" and xs[1].dtype.kind == "f":
            out = _batched_matmul(op, xs[0], xs[1])
        else:
            out = opt_einsum.contract(eq, *xs, optimize="auto") if n > 1 else np.einsum(eq, xs[0])
    else:
        order = op.all_labels
        aligned = [align(x, ls, order) for x, ls in zip(xs, op.in_labels)]
        full = tuple(min(s) if 0 in s else max(s)  # an empty label has size 0, not 1
                     for s in ([a.shape[d] for a in aligned] for d in range(len(order))))
        val = np.asarray(evaluate(op.join, aligned))
        if val.shape != full:  # a join that ignores an input still ranges over its labels
            val = np.broadcast_to(val, full)
        axes = tuple(range(len(op.out_labels), len(order)))
        out = op.agg.reduce(val, axes) if axes else val
    # C order: opt_einsum may hand back a transposed view, and outputs get copied and sliced
    return np.asarray(out, order="C").astype(numpy_dtype(out_dtype), copy=False)


def _batched_matmul(op: Einsum, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A two-input product-sum einsum as one ``np.matmul`` over (batch, m, k) x (batch, k, n):
    numpy's einsum loop (which opt_einsum falls back to when a batch label is shared) runs far
    below BLAS speed. Labels only one input has and the output lacks are summed first."""
    (lx, ly), out = op.in_labels, op.out_labels
    if len(set(lx)) != len(lx) or len(set(ly)) != len(ly):
        return opt_einsum.contract(op.equation, x, y)  # diagonals: leave them to einsum
    sx, sy, so = set(lx), set(ly), set(out)
    if sx - sy - so:
        keep = [lab for lab in lx if lab in sy or lab in so]
        x = x.sum(axis=tuple(i for i, lab in enumerate(lx) if lab not in keep))
        lx = tuple(keep)
    if sy - sx - so:
        keep = [lab for lab in ly if lab in sx or lab in so]
        y = y.sum(axis=tuple(i for i, lab in enumerate(ly) if lab not in keep))
        ly = tuple(keep)
    sx, sy = set(lx), set(ly)
    batch = [lab for lab in out if lab in sx and lab in sy]
    m = [lab for lab in out if lab in sx and lab not in sy]
    nn = [lab for lab in out if lab in sy and lab not in sx]
    k = [lab for lab in lx if lab in sy and lab not in so]
    size = dict(zip(lx, x.shape)) | dict(zip(ly, y.shape))

    def prod(labels: list[str]) -> int:
        r = 1
        for lab in labels:
            r *= size[lab]
        return r

    xm = np.transpose(x, [lx.index(lab) for lab in batch + m + k]).reshape(prod(batch), prod(m), prod(k))
    ym = np.transpose(y, [ly.index(lab) for lab in batch + k + nn]).reshape(prod(batch), prod(k), prod(nn))
    z = np.matmul(xm, ym).reshape([size[lab] for lab in batch + m + nn])
    order = batch + m + nn
    return np.transpose(z, [order.index(lab) for lab in out])


def fill_kernel(expr: Expr, starts: Sequence[int], shape: Sequence[int], dtype: str) -> np.ndarray:
    """The block of a fill whose corner is ``starts``: ``expr`` over the global index grid."""
    idx_dt = np.float64 if kind(dtype) == "float" else np.int64
    grids = [np.arange(s, s + n, dtype=idx_dt).reshape([n if k == d else 1 for k in range(len(shape))])
             for d, (s, n) in enumerate(zip(starts, shape))]
    val = np.asarray(evaluate(expr, grids))
    return np.broadcast_to(val, tuple(shape)).astype(numpy_dtype(dtype))


def gather_kernel(table: np.ndarray, indices: np.ndarray, row_start: int, n_rows: int) -> np.ndarray:
    """Rows of ``table`` (which holds table rows ``[row_start, row_start + len(table))``) picked by
    ``indices``; indices outside the block give the sum identity 0, so blocks over the rows are
    partial results that add up. ``n_rows`` is the whole table's row count, for the range check."""
    idx = np.asarray(indices)
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        bad = idx[(idx < 0) | (idx >= n_rows)].flat[0]
        raise EinjoinError(f"gather: index {int(bad)} out of range for a table of {n_rows} rows")
    if row_start == 0 and len(table) == n_rows:
        return np.take(table, idx, axis=0)
    local = idx - row_start
    inside = (local >= 0) & (local < len(table))
    out = np.take(table, np.where(inside, local, 0), axis=0)
    out[~inside] = 0
    return out


def broadcast_kernel(x: np.ndarray, shape: Sequence[int], dims: Sequence[int]) -> np.ndarray:
    view = x.reshape([x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
    return np.broadcast_to(view, tuple(shape))


def eval_node(node: Node, args: Sequence[np.ndarray]) -> np.ndarray:
    """Evaluate ``node`` on the dense values of its inputs (the reference semantics).
    Floating-point edge cases (overflow, log 0, 0/0) give inf/nan as IEEE says, without numpy
    warnings, as on every backend."""
    with np.errstate(all="ignore"):
        return _eval_node(node, args)


def _eval_node(node: Node, args: Sequence[np.ndarray]) -> np.ndarray:
    op = node.op
    if isinstance(op, Einsum):
        return einsum_kernel(op, args, node.dtype)
    if isinstance(op, Reshape):
        return np.reshape(args[0], node.shape)
    if isinstance(op, Broadcast):
        return broadcast_kernel(args[0], node.shape, op.dims)
    if isinstance(op, Select):
        return args[0][tuple(slice(a, b) for a, b in zip(op.starts, op.stops))]
    if isinstance(op, Concat):
        return np.concatenate(list(args), axis=op.axis)
    if isinstance(op, Fill):
        return fill_kernel(op.expr, (0,) * node.ndim, node.shape, node.dtype)
    if isinstance(op, Gather):
        return gather_kernel(args[0], args[1], 0, node.inputs[0].shape[0])
    if isinstance(op, Cast):
        return np.asarray(args[0]).astype(numpy_dtype(node.dtype))
    if isinstance(op, Input):
        raise EinjoinError(f"input {op.name!r} has no kernel; it is fed")
    raise AssertionError(f"unknown op {op!r}")  # pragma: no cover
