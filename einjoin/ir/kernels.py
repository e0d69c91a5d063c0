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

import functools
import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import opt_einsum  # type: ignore[import-untyped]

from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import cast_array, is_half, kind, numpy_dtype
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool,
                             Reshape, ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.window import dilated, out_size
from einjoin.ir.attention import attention_grad_kernel, attention_kernel
from einjoin.ir.opkinds import Attention, AttentionGrad, RotateHalf, SparseEinsum
from einjoin.ir.rotate import rotate_half_kernel
from einjoin.ir.sparse_einsum import sparse_reference
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import Arg, Call, Const, Expr, is_product

__all__ = ["eval_node", "KERNELS", "KernelRule", "MatmulRoute", "matmul_route", "einsum_kernel", "fill_kernel",
           "gather_kernel", "scatter_add_kernel", "broadcast_kernel", "conv_kernel", "pool_kernel", "topk_kernel",
           "align", "partial_dtype", "HALF_DTYPES"]


HALF_DTYPES = ("float16", "bfloat16")
# aggregations whose partial results lose range or precision when rounded to a half type
# (max/min pick one of their arguments: exact in any dtype)
_ACCUMULATING = ("sum", "prod")


def partial_dtype(node: Node) -> str:
    """The dtype ``node``'s partial results are kept, moved and combined in when an aggregated
    label is split: float32 for a float16/bfloat16 einsum that sums or multiplies (as torch and
    cuBLAS accumulate), cast to ``node.dtype`` once, by the last aggregation step; otherwise
    ``node.dtype``. (A gather's row partials are exact: every element but one is 0; a
    scatter-add's partials are sums, kept in float32 as an einsum's.)

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (4, 8), "float16")
    >>> partial_dtype(ops.einsum_node([x], ("ij",), "i", "x0", "sum")), partial_dtype(x)
    ('float32', 'float16')
    """
    op = node.op
    if (node.dtype in HALF_DTYPES and isinstance(op, Einsum)
            and op.agg.name in _ACCUMULATING):
        return "float32"
    if node.dtype in HALF_DTYPES and isinstance(op, (ScatterAdd, Conv)):
        return "float32"  # a conv's partials are sums over input-channel blocks
    return node.dtype


def _widen(x: np.ndarray) -> np.ndarray:
    # half types compute in float32 (numpy sums in float16 lose precision fast)
    if is_half(x.dtype):
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


@dataclass(frozen=True)
class MatmulRoute:
    """Which code path :func:`einsum_kernel` takes for one einsum, decided from the op and its
    input dtypes alone (shapes never change it), so the memory footprint estimate
    (:func:`einjoin.decomp.footprint.kernel_scratch`) reads the same decision instead of copying it.

    ``path`` is one of

    - ``"matmul"``: a two-input product-sum on floats as one ``np.matmul`` over
      (batch, m, k) x (batch, k, n); ``x_sum``/``y_sum`` are the axes of each input summed out
      first (labels the other input and the output lack), ``x_labels``/``y_labels`` the labels
      left, ``batch, m, n, k`` the label groups, and ``copy_x``, ``copy_y``, ``copy_out`` say
      whether an operand or the result is out of matmul order (a transposed copy);
    - ``"diagonal"``: the same, but a label repeats within an input: opt_einsum over the op's
      own equation;
    - ``"einsum"``: another product-sum over int/float inputs: opt_einsum's pairwise BLAS path
      (``np.einsum`` for one input);
    - ``"pick"``: a one-hot pick, ``where(i == r, v, 0)`` summed over the one label ``r`` has,
      ``i`` an int index without it (a cross-entropy's target logit): where ``r``'s block is a
      run of consecutive ints, each output takes ``v`` at its index (:func:`_pick`), else the join
      route; the same values, ``O(out)`` instead of a pass over ``v``;
    - ``"join"``: any other join or aggregation: the joined block is materialised and aggregated.

    >>> from einjoin.ir import ops
    >>> a = ops.input_node("a", (2, 3), "float32"); b = ops.input_node("b", (4, 3), "float32")
    >>> r = matmul_route(ops.einsum_node([a, b], ("ij", "kj"), "ik", "mul", "sum").op,
    ...                  ["float32", "float32"])
    >>> r.path, r.m, r.n, r.k, r.copy_x, r.copy_y, r.copy_out
    ('matmul', ('i',), ('k',), ('j',), False, True, False)
    """

    path: str
    x_sum: tuple[int, ...] = ()
    y_sum: tuple[int, ...] = ()
    x_labels: tuple[str, ...] = ()
    y_labels: tuple[str, ...] = ()
    batch: tuple[str, ...] = ()
    m: tuple[str, ...] = ()
    n: tuple[str, ...] = ()
    k: tuple[str, ...] = ()
    out_labels: tuple[str, ...] = ()  # the op's output labels, the order the result is copied to

    @property
    def copy_x(self) -> bool:
        return self.x_labels != self.batch + self.m + self.k

    @property
    def copy_y(self) -> bool:
        return self.y_labels != self.batch + self.k + self.n

    @property
    def copy_out(self) -> bool:
        return self.batch + self.m + self.n != self.out_labels


def _compute_kind(dtype: np.dtype[Any] | str) -> str:
    """numpy's kind letter of the dtype a kernel computes in: half types are widened to float32."""
    dt = np.dtype(numpy_dtype(dtype)) if isinstance(dtype, str) else np.dtype(dtype)
    return "f" if is_half(dt) else dt.kind


def _pick_args(op: Einsum) -> tuple[int, int, int] | None:
    """(value, index, range) argument positions of a one-hot pick ``where(x_i == x_r, x_v, 0)``
    summed over the one label ``x_r`` has, ``x_i``'s labels among the output's, ``x_v``'s the
    output's and the summed one; else None."""
    j = op.join
    if (op.agg.name != "sum" or len(op.agg_labels) != 1 or len(op.in_labels) != 3 or not isinstance(j, Call)
            or j.fn != "where" or not isinstance(j.args[0], Call) or j.args[0].fn != "eq"
            or not isinstance(j.args[1], Arg) or not isinstance(j.args[2], Const) or j.args[2].value != 0
            or not all(isinstance(a, Arg) for a in j.args[0].args)):
        return None
    b = op.agg_labels[0]
    v = j.args[1].index
    a0, a1 = (a.index for a in j.args[0].args)  # type: ignore[union-attr]
    out = set(op.out_labels)
    for i, r in ((a0, a1), (a1, a0)):
        li, lv = op.in_labels[i], op.in_labels[v]
        if (len({v, i, r}) == 3 and tuple(op.in_labels[r]) == (b,) and len(set(li)) == len(li)
                and set(li) <= out and len(set(lv)) == len(lv) and set(lv) == out | {b}):
            return v, i, r
    return None


def _pick(op: Einsum, xs: Sequence[np.ndarray]) -> np.ndarray | None:
    """The ``pick`` route: ``v`` at each output's index where the range block ``r`` is the ints
    ``start, start + 1, ...`` (else None: the join route). Bit for bit the join route's sum: the
    value picked plus 0 (a ``-0`` becomes ``+0``, as in a sum of zeros), 0 where no ``r`` matches."""
    args = _pick_args(op)
    assert args is not None
    v, i, r = args
    rng = xs[r]
    n = rng.shape[0]
    if n == 0 or rng.ndim != 1:
        return None
    start = int(rng[0])
    if not np.array_equal(rng, np.arange(start, start + n, dtype=rng.dtype)):
        return None
    out = tuple(op.out_labels)
    vals = align(xs[v], op.in_labels[v], out + op.agg_labels)
    pos = np.broadcast_to(align(xs[i], op.in_labels[i], out), vals.shape[:-1]) - start
    valid = (pos >= 0) & (pos < n)
    got = np.take_along_axis(vals, np.where(valid, pos, 0)[..., None], axis=-1)[..., 0]
    picked: np.ndarray = np.where(valid, got, vals.dtype.type(0)) + vals.dtype.type(0)
    return picked


@functools.lru_cache(maxsize=4096)
def _route(op: Einsum, kinds: tuple[str, ...]) -> MatmulRoute:
    n = len(kinds)
    pick = _pick_args(op)
    if pick is not None and kinds[pick[0]] == "f" and kinds[pick[1]] == kinds[pick[2]] == "i":
        return MatmulRoute("pick")
    if not (is_product(op.join, n) and op.agg.name in ("sum", "none")
            and all(k in "fi" for k in kinds)):
        return MatmulRoute("join")
    if n != 2 or kinds != ("f", "f"):
        return MatmulRoute("einsum")
    (lx, ly), out = op.in_labels, op.out_labels
    if len(set(lx)) != len(lx) or len(set(ly)) != len(ly):
        return MatmulRoute("diagonal")  # diagonals: leave them to einsum
    sx, sy, so = set(lx), set(ly), set(out)
    x_sum = tuple(i for i, lab in enumerate(lx) if lab not in sy and lab not in so)
    y_sum = tuple(i for i, lab in enumerate(ly) if lab not in sx and lab not in so)
    lx = tuple(lab for i, lab in enumerate(lx) if i not in x_sum)
    ly = tuple(lab for i, lab in enumerate(ly) if i not in y_sum)
    sx, sy = set(lx), set(ly)
    return MatmulRoute(
        "matmul", x_sum, y_sum, lx, ly,
        batch=tuple(lab for lab in out if lab in sx and lab in sy),
        m=tuple(lab for lab in out if lab in sx and lab not in sy),
        n=tuple(lab for lab in out if lab in sy and lab not in sx),
        k=tuple(lab for lab in lx if lab in sy and lab not in so),
        out_labels=out)


def matmul_route(op: Einsum, dtypes: Sequence[np.dtype[Any] | str]) -> MatmulRoute:
    """The :class:`MatmulRoute` :func:`einsum_kernel` takes for ``op`` on inputs of ``dtypes``
    (dtype names such as ``"bfloat16"`` or numpy dtypes); the one place that decides it."""
    return _route(op, tuple(_compute_kind(dt) for dt in dtypes))


def einsum_kernel(op: Einsum, arrays: Sequence[np.ndarray], out_dtype: str) -> np.ndarray:
    """One einsum on (blocks of) its inputs: join every tuple, aggregate the missing labels
    (by the code path :func:`matmul_route` names)."""
    xs = [_widen(np.asarray(a)) for a in arrays]
    route = matmul_route(op, [x.dtype for x in xs])
    out: Any = _pick(op, xs) if route.path == "pick" else None
    if out is not None:
        pass
    elif route.path == "matmul":
        out = _batched_matmul(route, xs[0], xs[1])
    elif route.path == "diagonal":
        out = opt_einsum.contract(op.equation, xs[0], xs[1])
    elif route.path == "einsum":
        # the contraction case: BLAS through opt_einsum's pairwise order
        sym = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(op.all_labels)}
        eq = ",".join("".join(sym[lab] for lab in ls) for ls in op.in_labels)
        eq += "->" + "".join(sym[lab] for lab in op.out_labels)
        out = opt_einsum.contract(eq, *xs, optimize="auto") if len(xs) > 1 else np.einsum(eq, xs[0])
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


def _batched_matmul(r: MatmulRoute, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A two-input product-sum einsum as one ``np.matmul`` over (batch, m, k) x (batch, k, n):
    numpy's einsum loop (which opt_einsum falls back to when a batch label is shared) runs far
    below BLAS speed. Labels only one input has and the output lacks are summed first."""
    if r.x_sum:
        x = x.sum(axis=r.x_sum)
    if r.y_sum:
        y = y.sum(axis=r.y_sum)
    lx, ly = r.x_labels, r.y_labels
    if not r.k:
        # nothing contracted (an elementwise or outer product): one broadcast multiply, which
        # computes the same single products as a matmul with k = 1, at memory speed (a matmul
        # over (batch, m, 1) x (batch, 1, n) runs ~20x slower per element)
        outer: np.ndarray = np.multiply(align(x, lx, r.out_labels), align(y, ly, r.out_labels))
        return outer
    if not r.m and not r.n and lx[-1] in r.batch and ly[-1] in r.batch:
        # dot products along k per batch element, the batch innermost (a norm's weight
        # gradient, "abc,abc->c"): numpy's einsum loop runs down the contiguous batch axis,
        # ~4x faster than one strided matmul per batch element
        bd: np.ndarray = np.einsum(_dot_equation(lx, ly, r.out_labels), x, y)
        return bd
    size = dict(zip(lx, x.shape)) | dict(zip(ly, y.shape))

    def prod(labels: tuple[str, ...]) -> int:
        return math.prod(size[lab] for lab in labels)

    batch, m, nn, k = r.batch, r.m, r.n, r.k
    xm = np.transpose(x, [lx.index(lab) for lab in batch + m + k]).reshape(prod(batch), prod(m), prod(k))
    ym = np.transpose(y, [ly.index(lab) for lab in batch + k + nn]).reshape(prod(batch), prod(k), prod(nn))
    order = batch + m + nn
    z = _matmul(xm, ym).reshape([size[lab] for lab in order])
    return np.transpose(z, [order.index(lab) for lab in r.out_labels])


@functools.lru_cache(maxsize=1024)
def _dot_equation(lx: tuple[str, ...], ly: tuple[str, ...], out: tuple[str, ...]) -> str:
    sym = {lab: chr(ord("a") + i) for i, lab in enumerate(dict.fromkeys(lx + ly))}
    return ",".join("".join(sym[lab] for lab in ls) for ls in (lx, ly)) + "->" + "".join(sym[lab] for lab in out)


SPLIT_K = 512  # the contraction slice of a split-k product (see _matmul)


def _matmul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``np.matmul`` of (batch, m, k) x (batch, k, n), in float32 with a long k and a small
    output (a weight gradient: k = batch x sequence) as a split-k sum: the products of
    :data:`SPLIT_K`-long slices of k added in order, in float32 (cuBLAS's split-k).
    OpenBLAS (0.3.31, Haswell kernels) runs a single product of those shapes at 1/2-1/2.5 of its
    speed on slices (a (64 x 2048) x (2048 x 64) product: 1.2 ms, split: 0.5 ms; torch's MKL:
    0.5 ms); with a batch, a short k, or an output under 32 wide or over 256 x 256 it is not
    slower, and the plain product is kept. The same shapes always take the same path: the
    bits depend on the shapes alone."""
    b, m, k = x.shape
    n = y.shape[2]
    if not (b == 1 and k >= 768 and m >= 32 and n >= 32 and m * n <= 65536
            and x.dtype == np.float32 and y.dtype == np.float32):
        out: np.ndarray = np.matmul(x, y)
        return out
    z: np.ndarray = np.matmul(x[:, :, :SPLIT_K], y[:, :SPLIT_K])
    for s in range(SPLIT_K, k, SPLIT_K):
        np.add(z, np.matmul(x[:, :, s:s + SPLIT_K], y[:, s:s + SPLIT_K]), out=z)
    return z


def fill_kernel(expr: Expr, starts: Sequence[int], shape: Sequence[int], dtype: str) -> np.ndarray:
    """The block of a fill whose corner is ``starts``: ``expr`` over the global index grid."""
    idx_dt = np.float64 if kind(dtype) == "float" else np.int64
    grids = [np.arange(s, s + n, dtype=idx_dt).reshape([n if k == d else 1 for k in range(len(shape))])
             for d, (s, n) in enumerate(zip(starts, shape))]
    val = np.asarray(evaluate(expr, grids))
    return cast_array(np.broadcast_to(val, tuple(shape)), dtype)


def gather_kernel(table: np.ndarray, indices: np.ndarray, row_start: int, n_rows: int) -> np.ndarray:
    """Rows of ``table`` (which holds table rows ``[row_start, row_start + len(table))``) picked by
    ``indices``; indices outside the block give the sum identity 0, so blocks over the rows are
    partial results that add up. ``n_rows`` is the whole table's row count, for the range check."""
    idx = np.asarray(indices)
    _check_rows("gather", idx, n_rows, "a table")
    if row_start == 0 and len(table) == n_rows:
        return np.take(table, idx, axis=0)
    local = idx - row_start
    inside = (local >= 0) & (local < len(table))
    out = np.asarray(np.take(table, np.where(inside, local, 0), axis=0))  # (0-d indices into rows: a 0-d array)
    out[~inside] = 0
    return out


def _check_rows(what: str, idx: np.ndarray, n_rows: int, noun: str) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        bad = idx[(idx < 0) | (idx >= n_rows)].flat[0]
        raise EinjoinError(f"{what}: index {int(bad)} out of range for {noun} of {n_rows} rows")


def scatter_add_kernel(updates: np.ndarray, indices: np.ndarray, row_start: int, block_rows: int,
                       n_rows: int, dtype: str) -> np.ndarray:
    """Rows ``[row_start, row_start + block_rows)`` of ``scatter_add(updates, indices, n_rows)``,
    in ``dtype``: the updates whose index falls in that range, added at it (``np.add.at``:
    duplicates accumulate, in index order); the rest ignored, so kernels over the rows make
    disjoint blocks and kernels over the indices partial sums. Half types accumulate in float32
    and round once, to ``dtype``. ``n_rows`` is the whole output's row count, for the range check.

    >>> scatter_add_kernel(np.array([1., 2., 4.]), np.array([0, 2, 0]), 0, 3, 3, "float64")
    array([5., 0., 2.])
    """
    idx = np.asarray(indices)
    _check_rows("scatter_add", idx, n_rows, "an output")
    upd = _widen(np.asarray(updates))
    rest = upd.shape[idx.ndim:]
    flat_idx = idx.reshape(-1)
    flat_upd = upd.reshape((flat_idx.size,) + rest)
    if row_start != 0 or block_rows != n_rows:
        inside = (flat_idx >= row_start) & (flat_idx < row_start + block_rows)
        flat_idx, flat_upd = flat_idx[inside] - row_start, flat_upd[inside]
    out = np.zeros((block_rows,) + rest, dtype=upd.dtype)
    rounds = _add_rounds(flat_idx, rest)
    if rounds is None:
        np.add.at(out, flat_idx, flat_upd)
    else:
        for pick in rounds:  # each index at most once per round: a plain fancy-index add
            at = flat_idx[pick]
            got = out[at]
            got += flat_upd[pick]
            out[at] = got
    return out.astype(numpy_dtype(dtype), copy=False)


ROUND_ROWS = 16  # the fewest rows a round of _add_rounds must add on average (else np.add.at)


def _add_rounds(idx: np.ndarray, rest: tuple[int, ...]) -> list[np.ndarray] | None:
    """``np.add.at(out, idx, upd)`` with rows (``rest`` non-empty) as rounds of positions into
    ``idx`` (non-negative): round r holds each index's r-th occurrence, so within a round no
    index repeats and ``out[idx[p]] += upd[p]`` adds every row once, and rows of one index meet
    ``out`` in the order ``np.add.at`` adds them (the same bits). ``np.add.at`` with rows goes
    row by row (the small LLaMA's embedding gradient, 1024 rows of 64 into 256: 0.6 ms; in
    rounds 0.17 ms). None where the rounds would be short (an index repeated more often than
    there are rows / :data:`ROUND_ROWS`) or a row is a few elements: ``np.add.at`` then. The
    scratch (a few index-sized arrays, two copies of a round's rows) is in
    :func:`einjoin.decomp.footprint.kernel_scratch`."""
    n = idx.size
    if not rest or math.prod(rest) < 8 or n < 2 * ROUND_ROWS:
        return None
    if int(np.bincount(idx).max()) * ROUND_ROWS > n:
        return None
    order = np.argsort(idx, kind="stable")  # positions grouped by index, in their order
    s = idx[order]
    first = np.empty(n, dtype=bool)
    first[0] = True
    np.not_equal(s[1:], s[:-1], out=first[1:])
    del s
    starts = np.flatnonzero(first)
    del first
    rank = np.arange(n)  # each position's occurrence number among its index's
    rank -= np.repeat(starts, np.diff(np.append(starts, n)))
    counts = np.bincount(rank)
    pos = order[np.argsort(rank, kind="stable")]
    return np.split(pos, np.cumsum(counts)[:-1])


def broadcast_kernel(x: np.ndarray, shape: Sequence[int], dims: Sequence[int]) -> np.ndarray:
    view = x.reshape([x.shape[dims.index(d)] if d in dims else 1 for d in range(len(shape))])
    return np.broadcast_to(view, tuple(shape))


def _torch_view(x: np.ndarray) -> Any:
    """``x`` as a torch tensor sharing its memory (a copy only of a read-only or strided view:
    torch refuses to alias those)."""
    import torch  # the window kernels run on torch's conv and pool loops
    if not (x.flags.c_contiguous and x.flags.writeable):
        x = np.array(x, order="C")
    return torch.from_numpy(x)


def _arrange(x: np.ndarray, pads: Sequence[tuple[int, int]], ld: Sequence[int], fill: float) -> np.ndarray:
    """``x`` (N, C, *spatial) with each spatial dim dilated by ``ld`` and padded by ``(lo, hi)``
    (negative: cropped), the new positions set to ``fill``; ``x`` itself when nothing changes."""
    if all(a == 1 for a in ld) and all(p == (0, 0) for p in pads):
        return x
    sizes = [max(0, lo + dilated(n, a) + hi) for n, (lo, hi), a in zip(x.shape[2:], pads, ld)]
    out = np.full(x.shape[:2] + tuple(sizes), fill, dtype=x.dtype)
    dst: list[slice] = [slice(None), slice(None)]
    src: list[slice] = [slice(None), slice(None)]
    for n, (lo, _), a, m in zip(x.shape[2:], pads, ld, sizes):
        j0 = max(0, -(lo // a))                       # first source element inside [0, m)
        j1 = min(n, (m - 1 - lo) // a + 1) if m - 1 - lo >= 0 else 0
        if j1 <= j0:
            return out  # every element cropped away
        dst.append(slice(lo + a * j0, lo + a * (j1 - 1) + 1, a))
        src.append(slice(j0, j1))
    out[tuple(dst)] = x[tuple(src)]
    return out


def _conv_shape(x_shape: Sequence[int], w_shape: Sequence[int], op: Conv) -> tuple[int, ...]:
    spatial = tuple(out_size(n, k, s, lo, hi, a, b) for n, k, s, (lo, hi), a, b in
                    zip(x_shape[2:], w_shape[2:], op.stride, op.padding, op.lhs_dilation, op.rhs_dilation))
    return (x_shape[0], w_shape[0]) + spatial


def conv_kernel(x: np.ndarray, w: np.ndarray, op: Conv, dtype: str) -> np.ndarray:
    """The convolution ``op`` of ``x`` by ``w`` (see :class:`~einjoin.ir.opkinds.Conv`), in
    ``dtype``: half types computed in float32 and rounded once, float64 in float64. The input is
    dilated and padded here (any padding, negative included), then torch's conv loop runs.

    >>> x = np.arange(5.0).reshape(1, 1, 5); w = np.ones((1, 1, 2))
    >>> conv_kernel(x, w, Conv((1,), ((1, 0),), (1,), (1,), 1), "float64")
    array([[[0., 1., 3., 5., 7.]]])
    """
    # torch itself first: a thread that takes torch.nn.functional's import lock and then waits for
    # torch, which another thread is importing, deadlocks Python's import locks (one of the two is
    # then handed a partially initialised torch)
    import torch  # noqa: F401
    import torch.nn.functional as tf
    xs, ws = _widen(np.asarray(x)), _widen(np.asarray(w))
    shape = _conv_shape(xs.shape, ws.shape, op)
    if 0 in xs.shape or 0 in ws.shape or 0 in shape:  # a sum over nothing
        return np.zeros(shape, numpy_dtype(dtype))
    nd = xs.ndim - 2
    if all(a == 1 for a in op.lhs_dilation) and all(lo == hi >= 0 for lo, hi in op.padding):
        pad: Any = tuple(lo for lo, _ in op.padding)  # torch pads symmetric padding itself
    else:
        xs, pad = _arrange(xs, op.padding, op.lhs_dilation, 0.0), 0
    fn = (tf.conv1d, tf.conv2d, tf.conv3d)[nd - 1]
    out = fn(_torch_view(xs), _torch_view(ws.astype(xs.dtype, copy=False)), None, op.stride, pad,
             op.rhs_dilation, op.groups)
    return np.asarray(out.numpy(), order="C").astype(numpy_dtype(dtype), copy=False)


def pool_kernel(x: np.ndarray, op: Pool, dtype: str) -> np.ndarray:
    """The window aggregation ``op`` of ``x`` (see :class:`~einjoin.ir.opkinds.Pool`), in
    ``dtype`` (half types computed in float32): max over the window with -inf padding, or the
    sum with 0 padding (as a depthwise conv by ones, so sums are exact float32 accumulations).

    >>> from einjoin.ir.agg import get_agg
    >>> pool_kernel(np.arange(6.0).reshape(1, 1, 6), Pool(get_agg("max"), (2,), (2,), ((0, 0),), (1,)), "float64")
    array([[[1., 3., 5.]]])
    """
    import torch
    import torch.nn.functional as tf
    xs = _widen(np.asarray(x))
    nd = xs.ndim - 2
    spatial = tuple(out_size(n, k, s, lo, hi, 1, d) for n, k, s, (lo, hi), d in
                    zip(xs.shape[2:], op.window, op.stride, op.padding, op.dilation))
    kt = math.prod(op.window) if op.agg.name == "none" else 1
    if 0 in xs.shape[:2] or 0 in spatial:
        return np.zeros((xs.shape[0], xs.shape[1] * kt) + spatial, numpy_dtype(dtype))
    xs = _arrange(xs, op.padding, (1,) * nd, float(op.agg.identity or 0.0))
    if op.agg.name == "none":  # the windows, by strides: copied, never multiplied
        st = xs.strides[2:]
        view = np.lib.stride_tricks.as_strided(
            xs, xs.shape[:2] + op.window + spatial,
            xs.strides[:2] + tuple(d * s for d, s in zip(op.dilation, st))
            + tuple(k * s for k, s in zip(op.stride, st)), writeable=False)
        return view.reshape((xs.shape[0], xs.shape[1] * kt) + spatial).astype(numpy_dtype(dtype))
    t = _torch_view(xs)
    if op.agg.name == "max":
        fn = (tf.max_pool1d, tf.max_pool2d, tf.max_pool3d)[nd - 1]
        out = fn(t, op.window, op.stride, 0, op.dilation)
    else:
        c = xs.shape[1]
        ones = torch.ones((c, 1) + op.window, dtype=t.dtype)
        out = (tf.conv1d, tf.conv2d, tf.conv3d)[nd - 1](t, ones, None, op.stride, 0, op.dilation, c)
    return np.asarray(out.numpy(), order="C").astype(numpy_dtype(dtype), copy=False)


def topk_kernel(x: np.ndarray, op: TopK, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Positions ``[start, stop)`` of the order ``op`` asks for along its axis: the values (in
    ``x``'s dtype) or the int64 indices. A stable sort by torch (NaN largest, as torch's); half
    types are sorted as float32, which holds them exactly.

    >>> topk_kernel(np.array([[3., 1., 2., 3.]]), TopK(1, 2, True, True))
    array([[0, 3]])
    """
    import torch
    xs = _widen(np.asarray(x))
    stop = op.k if stop is None else stop
    if xs.shape[op.axis] == 0 or stop <= start:
        shape = list(xs.shape)
        shape[op.axis] = stop - start
        return np.zeros(shape, np.int64 if op.indices else x.dtype)
    _, order = torch.sort(_torch_view(xs), dim=op.axis, descending=op.largest, stable=True)
    idx = order.numpy()[(slice(None),) * op.axis + (slice(start, stop),)]
    if op.indices:
        return np.ascontiguousarray(idx)
    return np.take_along_axis(np.asarray(x), idx, axis=op.axis)


def eval_node(node: Node, args: Sequence[np.ndarray]) -> np.ndarray:
    """Evaluate ``node`` on the dense values of its inputs (the reference semantics).
    Floating-point edge cases (overflow, log 0, 0/0) give inf/nan as IEEE says, without numpy
    warnings, as on every backend."""
    with np.errstate(all="ignore"):
        return _eval_node(node, args)


def _eval_input(node: Node, op: Input, args: Sequence[np.ndarray]) -> np.ndarray:
    raise EinjoinError(f"input {op.name!r} has no kernel; it is fed")


def _eval_einsum(node: Node, op: Einsum, args: Sequence[np.ndarray]) -> np.ndarray:
    return einsum_kernel(op, args, node.dtype)


def _eval_reshape(node: Node, op: Reshape, args: Sequence[np.ndarray]) -> np.ndarray:
    return np.reshape(args[0], node.shape)


def _eval_broadcast(node: Node, op: Broadcast, args: Sequence[np.ndarray]) -> np.ndarray:
    return broadcast_kernel(args[0], node.shape, op.dims)


def _eval_select(node: Node, op: Select, args: Sequence[np.ndarray]) -> np.ndarray:
    return args[0][tuple(slice(a, b) for a, b in zip(op.starts, op.stops))]


def _eval_concat(node: Node, op: Concat, args: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate(list(args), axis=op.axis)


def _eval_fill(node: Node, op: Fill, args: Sequence[np.ndarray]) -> np.ndarray:
    return fill_kernel(op.expr, (0,) * node.ndim, node.shape, node.dtype)


def _eval_gather(node: Node, op: Gather, args: Sequence[np.ndarray]) -> np.ndarray:
    return gather_kernel(args[0], args[1], 0, node.inputs[0].shape[0])


def _eval_scatter_add(node: Node, op: ScatterAdd, args: Sequence[np.ndarray]) -> np.ndarray:
    return scatter_add_kernel(args[0], args[1], 0, node.shape[0], node.shape[0], node.dtype)


def _eval_cast(node: Node, op: Cast, args: Sequence[np.ndarray]) -> np.ndarray:
    return cast_array(args[0], node.dtype)  # floats into int8 as torch: via int64


def _eval_conv(node: Node, op: Conv, args: Sequence[np.ndarray]) -> np.ndarray:
    return conv_kernel(args[0], args[1], op, node.dtype)


def _eval_pool(node: Node, op: Pool, args: Sequence[np.ndarray]) -> np.ndarray:
    return pool_kernel(args[0], op, node.dtype)


def _eval_topk(node: Node, op: TopK, args: Sequence[np.ndarray]) -> np.ndarray:
    return topk_kernel(args[0], op)


def _eval_rotate_half(node: Node, op: RotateHalf, args: Sequence[np.ndarray]) -> np.ndarray:
    return rotate_half_kernel(args[0], op.axis, op.sign)


def _eval_attention(node: Node, op: Attention, args: Sequence[np.ndarray]) -> np.ndarray:
    return attention_kernel(args[0], args[1], args[2], args[3] if len(args) > 3 else None, op.scale, op.causal,
                            window=op.window)


def _eval_attention_grad(node: Node, op: AttentionGrad, args: Sequence[np.ndarray]) -> np.ndarray:
    return attention_grad_kernel(args[0], args[1], args[2], args[3], args[4] if len(args) > 4 else None,
                                 op.scale, op.causal, op.parts, op.window)


# the whole-tensor kernel of each node kind: (node, its op, its inputs' values) -> its value
KernelRule = Callable[[Node, Any, Sequence[np.ndarray]], np.ndarray]
KERNELS: dict[type, KernelRule] = {
    Input: _eval_input,
    Einsum: _eval_einsum,
    Reshape: _eval_reshape,
    Broadcast: _eval_broadcast,
    Select: _eval_select,
    Concat: _eval_concat,
    Fill: _eval_fill,
    Gather: _eval_gather,
    ScatterAdd: _eval_scatter_add,
    Cast: _eval_cast,
    Conv: _eval_conv,
    Pool: _eval_pool,
    TopK: _eval_topk,
    RotateHalf: _eval_rotate_half,
    Attention: _eval_attention,
    AttentionGrad: _eval_attention_grad,
    SparseEinsum: sparse_reference,  # numpy.einsum on the densified sparse constant
}


def _eval_node(node: Node, args: Sequence[np.ndarray]) -> np.ndarray:
    return rule_for(KERNELS, node.op, "the reference kernels (einjoin.ir.kernels.KERNELS)")(
        node, node.op, args)
