"""Routing and indexing ops as the node kinds einjoin has: element lookups are a ``Gather`` from
the flattened tensor at computed linear indices (its gradient a ``ScatterAdd``), scatters are a
``ScatterAdd`` into the flattened tensor, and the scans, arg-reductions and one-hot encodings are
EinSums with an index fill (``iota``) or a triangular mask — so the planner splits every one of
them like any op, and ``ej.grad`` differentiates them with the existing rules.

- ``take_along_dim(x, idx, dim)`` is ``torch.gather(x, dim, idx)`` (and ``torch.take_along_dim``);
- ``scatter``, ``scatter_add`` (the dim form), ``index_add``, ``index_copy``, ``index_select``;
- ``argmax`` / ``argmin`` (the first occurrence, NaN counting as the largest, as torch);
- ``max_dim`` / ``min_dim`` (``torch.max(x, dim)``: values and indices);
- ``cumsum`` / ``cumprod``: an EinSum over the mask ``j <= i`` with a sum / prod aggregation,
  exact (no log tricks; a zero in a cumprod is a zero);
- ``one_hot``; ``pad`` (constant, reflect, replicate, circular: a gather with a fill index).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 4))
>>> out = ej.reference(ej.cumsum(x, 1), x=np.ones((2, 4), np.float32))
>>> out.tolist()
[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]
>>> ej.reference(ej.argmax(x, 1), x=np.array([[0, 3, 3, 1], [5, 0, 0, 0]], np.float32)).tolist()
[1, 0]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.frontend.aten_notes import data_dependent
from einjoin.frontend.functions import concat, fill, full
from einjoin.frontend.tensor import (BUILT_ELSEWHERE, LETTERS, Tensor, _norm_dim, _t, broadcast_shapes, einsum,
                                    elementwise, gather, wrap)
from einjoin.ir import ops
from einjoin.ir.dtypes import exact_cast, kind, numpy_dtype

__all__ = ["take_along_dim", "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_select",
           "argmax", "argmin", "max_dim", "min_dim", "cumsum", "cumprod", "one_hot", "pad", "advanced_index",
           "index_put", "from_the_end"]


def _int_index(value: Any, what: str) -> Tensor:
    idx = _t(value, what)
    if kind(idx.dtype) != "int":
        raise DTypeError(f"{what}: indices must be an integer tensor, got {idx.dtype} (shape {idx.shape})")
    if idx.dtype == "uint8":  # torch's x[i] reads it as a bool mask, its other index ops refuse it
        raise DTypeError(f"{what}: a uint8 index tensor (shape {idx.shape}) is a bool mask to torch's x[i] "
                         f"(deprecated) and refused by its other index ops; cast it to int64 (positions) "
                         f"or bool (a mask)")
    return idx if idx.dtype == "int64" else idx.to("int64")


def _strides(shape: Sequence[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _linear_index(shape: tuple[int, ...], idx: Tensor, d: int, what: str) -> Tensor:
    """The flat position in a tensor of ``shape`` of each element of ``idx`` (which gives the
    coordinate along ``d``; its own position gives the others); -1 where ``idx`` is outside
    ``[0, shape[d])`` so that the gather / scatter's run-time check reports it, as torch does."""
    if idx.ndim != len(shape):
        raise ShapeError(f"{what}: index of rank {idx.ndim} for a tensor of rank {len(shape)} "
                         f"(shape {shape}); torch needs the same rank")
    for k, (m, n) in enumerate(zip(idx.shape, shape)):
        if k != d and m > n:
            raise ShapeError(f"{what}: index shape {idx.shape} exceeds the tensor's {shape} on dim {k}")
    st = _strides(shape)
    base = " + ".join(f"x{k} * {st[k]}" for k in range(len(shape)) if k != d and st[k]) or "0"
    offsets = fill(idx.shape, base, "int64")
    n = shape[d]
    return elementwise_expr(f"where((x0 >= 0) & (x0 < {n}), x0 * {st[d]} + x1, -1)", idx, offsets)


def from_the_end(idx: Tensor, n: int, *, modulo: bool = False) -> Tensor:
    """``idx`` with each negative index ``i`` read as ``n + i`` (torch's ``index_fill``); one still
    outside ``[0, n)`` stays out, for the run-time check to report. ``modulo``: every index taken
    modulo ``n`` (Python's sign), as torch's ``take_along_dim`` with a dim reads them (-1 the last,
    ``n`` the first: it never refuses one)."""
    if n <= 0:
        return idx  # nothing to index: any index is out of range (the run-time check says so)
    # (one below -n stays as given: the run-time check names the index the user wrote)
    return elementwise_expr(f"x0 % {n}" if modulo else f"where((x0 < 0) & (x0 >= -{n}), x0 + {n}, x0)", idx)


def elementwise_expr(expr: str, *args: Tensor) -> Tensor:
    """An elementwise join written out over ``x0, x1, ...`` (broadcasting as ``elementwise``)."""
    from einjoin.ir.scalar import parse_join
    return elementwise(parse_join(expr, len(args)), *args)


def take_along_dim(x: Tensor, idx: Tensor, dim: int) -> Tensor:
    """``torch.gather(x, dim, idx)``: ``out[..., i, ...] = x[..., idx[..., i, ...], ...]`` along
    ``dim``, ``idx`` of ``x``'s rank and no larger elsewhere (torch.take_along_dim's broadcasting
    is done by its translation). One gather of elements from the flattened ``x``; an index
    outside ``[0, x.shape[dim])`` is an error at run time, as in torch.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (2, 3)); i = ej.input("i", (2, 2), "int64")
    >>> ej.reference(ej.take_along_dim(x, i, 1), x=np.arange(6.0, dtype=np.float32).reshape(2, 3),
    ...              i=np.array([[2, 0], [1, 1]])).tolist()
    [[2.0, 0.0], [4.0, 4.0]]
    """
    x = _t(x, "take_along_dim")
    idx = _int_index(idx, "take_along_dim")
    d = _norm_dim(x, dim)
    lin = _linear_index(x.shape, idx, d, "take_along_dim")
    return gather(x.reshape(math.prod(x.shape)), lin)


def _in_dtype(src: Tensor, dtype: str, what: str) -> Tensor:
    """``src`` in the written tensor's ``dtype``: torch refuses another dtype; an exact cast
    (float16 into float32) is taken, any other refused (it changed values silently: 0.7 into
    int64 was 0, 1e300 into float32 inf)."""
    if src.dtype == dtype:
        return src
    if exact_cast(numpy_dtype(src.dtype), dtype):
        return src.to(dtype)
    raise DTypeError(f"{what}: the source is {src.dtype} but the tensor written is {dtype}; the cast "
                     f"would change values (torch refuses any other dtype): cast the source first")


def _sources(src: Any, idx: Tensor, dtype: str, what: str) -> Tensor:
    """The values a scatter writes: ``src[:idx.shape]`` (torch reads the leading part of a larger
    src), or a number broadcast to the index's shape."""
    if not isinstance(src, Tensor):
        return full(idx.shape, src, dtype)
    if src.ndim != idx.ndim or any(s < i for s, i in zip(src.shape, idx.shape)):
        raise ShapeError(f"{what}: src of shape {src.shape} must cover the index's {idx.shape}")
    out: Tensor = src if src.shape == idx.shape else src[tuple(slice(0, n) for n in idx.shape)]
    return _in_dtype(out, dtype, what)


def _scatter_sum(values: Tensor, lin: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``values`` added at flat positions ``lin`` into zeros of ``shape`` (bools counted as int64)."""
    v = values if values.dtype != "bool" else values.to("int64")
    return wrap(ops.scatter_add_node(v.node, lin.node, math.prod(shape))).reshape(shape)


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """``torch.scatter_add``: ``out = x``, then ``out[..., index[..., i, ...], ...] += src[..., i, ...]``
    along ``dim`` (duplicates accumulate). A ``ScatterAdd`` into the flattened tensor.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (3,)); i = ej.input("i", (2,), "int64")
    >>> ej.reference(ej.scatter_add(x, 0, i, x[:2]), x=np.ones(3, np.float32), i=np.array([2, 2])).tolist()
    [1.0, 1.0, 3.0]
    """
    x = _t(x, "scatter_add")
    idx = _int_index(index, "scatter_add")
    d = _norm_dim(x, dim)
    lin = _linear_index(x.shape, idx, d, "scatter_add")
    vals = _scatter_sum(_sources(src, idx, x.dtype, "scatter_add"), lin, x.shape)
    return (x.to("int64") + vals).to("bool") if x.dtype == "bool" else x + vals.to(x.dtype)


def scatter(x: Tensor, dim: int, index: Tensor, src: Any = None, *, value: Any = None,
            reduce: str | None = None) -> Tensor:
    """``torch.scatter``: ``x`` with ``src`` (a tensor, or a number ``value``) written at ``index``
    along ``dim``; where ``index`` repeats a position, the last write wins (torch leaves it
    unspecified; its CPU kernel keeps the last). EinSums along ``dim``: the winning source
    position per target (a ``max`` over ``where(index == t, j, -1)``), then its value — O(n·m) per
    row for a dim of n written from m positions. ``reduce="add"`` adds instead (a scatter-add);
    ``"multiply"`` is not supported."""
    x = _t(x, "scatter")
    if src is None:
        src = value
    if src is None:
        raise EinjoinError("scatter: needs src (a tensor) or value (a number)")
    if reduce not in (None, "add", "sum"):
        raise UnsupportedOpError(f"scatter with reduce={reduce!r} (only 'add')")
    idx = _int_index(index, "scatter")
    d = _norm_dim(x, dim)
    lin = _linear_index(x.shape, idx, d, "scatter")
    if reduce is not None:
        return scatter_add(x, d, idx, _sources(src, idx, x.dtype, "scatter"))
    if x.ndim >= len(LETTERS):
        raise ShapeError(f"scatter: rank {x.ndim} is above the supported 25")
    m, n = idx.shape[d], x.shape[d]
    if m == 0 or math.prod(idx.shape) == 0:
        return x
    # an index outside [0, n) is an error at run time, as in torch: a gather of the flat
    # positions checks them (its zeros are added to the winners, so it runs)
    check = gather(full((math.prod(x.shape),), 0, "int64"), lin).sum()
    # idx (and src) cover the leading part of x's other dims: -1 (no target) beyond
    pads = [(k, 0, x.shape[k] - idx.shape[k]) for k in range(x.ndim) if k != d and idx.shape[k] < x.shape[k]]
    idx_p = idx
    for k, lo, hi in pads:
        idx_p = _pad_constant(idx_p, k, lo, hi, -1)
    ls = LETTERS[:x.ndim]
    j = LETTERS[x.ndim]
    ils = ls[:d] + j + ls[d + 1:]
    winner = einsum(f"{ils},{ls[d]},{j}->{ls}", idx_p, fill((n,), "x0", "int64"), fill((m,), "x0", "int64"),
                    join="where(x0 == x1, x2, -1)", agg="max") + check
    if not isinstance(src, Tensor):
        return _where(winner >= 0, full((), src, x.dtype), x)
    vals = _sources(src, idx, x.dtype, "scatter")
    for k, lo, hi in pads:
        vals = _pad_constant(vals, k, lo, hi, False if vals.dtype == "bool" else 0)
    zero, agg = ("False", "max") if x.dtype == "bool" else ("0", "sum")
    new = einsum(f"{ils},{ls},{j}->{ls}", vals, winner, fill((m,), "x0", "int64"),
                 join=f"where(x2 == x1, x0, {zero})", agg=agg)
    return _where(winner >= 0, new, x)


_REDUCE_AGG = {"prod": ("prod", "1"), "amax": ("max", "-inf"), "amin": ("min", "inf")}


def scatter_reduce(x: Tensor, dim: int, index: Tensor, src: Tensor, reduce: str, include_self: bool = True
                   ) -> Tensor:
    """``torch.scatter_reduce`` along ``dim``: ``sum`` and ``mean`` by scatter-adds; ``prod``,
    ``amax`` and ``amin`` as one EinSum along ``dim`` with that aggregation over
    ``where(index == t, src, identity)`` (O(n·m) per row), combined with ``x`` where
    ``include_self`` and kept as ``x`` where nothing is written."""
    x = _t(x, "scatter_reduce")
    idx = _int_index(index, "scatter_reduce")
    if x.ndim == 0 and dim in (0, -1) and idx.ndim == 0:  # torch: a 0-d tensor as one element of 1-D
        s = _t(src, "scatter_reduce src")
        return scatter_reduce(x.reshape((1,)), 0, idx.reshape((1,)), s.reshape((1,)) if s.ndim == 0 else s,
                              reduce, include_self).reshape(())
    d = _norm_dim(x, dim)
    vals = _sources(_t(src, "scatter_reduce src"), idx, x.dtype, "scatter_reduce")
    if reduce in ("sum", "mean"):
        base = x if include_self else scatter(x, d, idx, value=0)
        total = scatter_add(base, d, idx, vals)
        if reduce == "sum":
            return total
        count = scatter_add(full(x.shape, 1 if include_self else 0, x.dtype), d, idx, full(idx.shape, 1, x.dtype))
        count = elementwise("max", count, 1)  # untouched positions keep their value (torch)
        out = total / count
        return out if out.dtype == x.dtype else elementwise("floordiv", total, count).to(x.dtype)
    if reduce not in _REDUCE_AGG:
        raise UnsupportedOpError(f"scatter_reduce with reduce={reduce!r} (sum, mean, prod, amax, amin)")
    if x.dtype == "bool" and x.ndim < len(LETTERS):  # 0/1 in uint8: prod / amin are and, amax or
        return scatter_reduce(x.to("uint8"), d, idx, vals.to("uint8"), reduce, include_self).to("bool")
    if x.ndim >= len(LETTERS) or x.dtype == "bool":
        raise UnsupportedOpError(f"scatter_reduce {reduce!r} of a {x.dtype} tensor of rank {x.ndim}")
    agg, ident = _REDUCE_AGG[reduce]
    if kind(x.dtype) == "int" and reduce != "prod":
        info = np.iinfo(numpy_dtype(x.dtype))  # the dtype's own bounds (int64's do not fit an int32)
        ident = str(int(info.min)) if reduce == "amax" else str(int(info.max))
    m, n = idx.shape[d], x.shape[d]
    if m == 0 or math.prod(idx.shape) == 0:
        return x
    lin = _linear_index(x.shape, idx, d, "scatter_reduce")
    check = gather(full((math.prod(x.shape),), 0, "int64"), lin).sum()
    pads = [(k, 0, x.shape[k] - idx.shape[k]) for k in range(x.ndim) if k != d and idx.shape[k] < x.shape[k]]
    idx_p, vals_p = idx, vals
    for k, lo, hi in pads:
        idx_p = _pad_constant(idx_p, k, lo, hi, -1)
        vals_p = _pad_constant(vals_p, k, lo, hi, 0)
    ls = LETTERS[:x.ndim]
    j = LETTERS[x.ndim]
    ils = ls[:d] + j + ls[d + 1:]
    iota = fill((n,), "x0", "int64")
    count = einsum(f"{ils},{ls[d]}->{ls}", idx_p, iota, join="where(x0 == x1, 1, 0)") + check
    red = einsum(f"{ils},{ils},{ls[d]}->{ls}", vals_p, idx_p, iota, join=f"where(x1 == x2, x0, {ident})", agg=agg)
    if include_self:
        red = elementwise({"prod": "mul", "amax": "max", "amin": "min"}[reduce], red, x)
    return _where(count > 0, red, x)


def _where(c: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return elementwise("where", c, a, b)


def _to_front(x: Tensor, d: int) -> Tensor:
    return x if d == 0 else x.permute([d] + [k for k in range(x.ndim) if k != d])


def _from_front(y: Tensor, d: int) -> Tensor:
    return y if d == 0 else y.permute(list(range(1, d + 1)) + [0] + list(range(d + 1, y.ndim)))


def _row_index(index: Any, x: Tensor, d: int, source: Tensor | None, what: str) -> Tensor:
    idx = _int_index(index, what)
    if idx.ndim > 1:
        raise ShapeError(f"{what}: index must be 1-D, got shape {idx.shape}")
    idx = idx.reshape(idx.shape or (1,))
    if source is not None:
        want = x.shape[:d] + (idx.shape[0],) + x.shape[d + 1:]
        if source.shape != want and not (x.ndim == 0 and source.ndim == 0):
            raise ShapeError(f"{what}: source of shape {source.shape} must be {want} (index of {idx.shape[0]})")
    return idx


def index_add(x: Tensor, dim: int, index: Tensor, source: Tensor, alpha: Any = 1) -> Tensor:
    """``torch.index_add``: ``out = x``, then ``out[index[i]] += alpha * source[i]`` along ``dim``
    (rows of ``source`` along ``dim``; duplicates accumulate): one ``ScatterAdd`` of whole rows.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (3, 2)); i = ej.input("i", (2,), "int64")
    >>> ej.reference(ej.index_add(x, 0, i, x[:2]), x=np.ones((3, 2), np.float32), i=np.array([0, 0])).tolist()
    [[3.0, 3.0], [1.0, 1.0], [1.0, 1.0]]
    """
    x, source = _t(x, "index_add"), _t(source, "index_add source")
    d = _norm_dim(x, dim) if x.ndim else 0
    idx = _row_index(index, x, d, source, "index_add")
    source = _in_dtype(source, x.dtype, "index_add")
    if kind(x.dtype) != "float":
        if not float(alpha).is_integer():
            # alpha * source in float, truncated per element, was neither torch's index_add (which
            # truncates alpha) nor torch.add (which refuses): refused
            raise DTypeError(f"index_add: alpha={alpha!r} is not an integer but the tensor is {x.dtype}")
        alpha = int(alpha)  # 3.0 * int64 in float32 would round values beyond 2**24
    if alpha != 1:
        source = (source * alpha).to(x.dtype)
    rows = _to_front(source.reshape(x.shape[:d] + (idx.shape[0],) + x.shape[d + 1:]) if x.ndim else
                     source.reshape((1,)), d)
    n = x.shape[d] if x.ndim else 1
    added = wrap(ops.scatter_add_node(rows.node if rows.dtype != "bool" else rows.to("int64").node, idx.node, n))
    added = _from_front(added, d).reshape(x.shape)
    return (x.to("int64") + added).to("bool") if x.dtype == "bool" else x + added.to(x.dtype)


def index_copy(x: Tensor, dim: int, index: Tensor, source: Tensor) -> Tensor:
    """``torch.index_copy``: ``x`` with ``x[index[i]] = source[i]`` along ``dim``; a repeated index
    keeps its last row (torch leaves it unspecified; its CPU kernel keeps the last). The winning
    row per target is a ``max`` EinSum over (targets, index), then one gather of whole rows."""
    x, source = _t(x, "index_copy"), _t(source, "index_copy source")
    source = _in_dtype(source, x.dtype, "index_copy")
    d = _norm_dim(x, dim) if x.ndim else 0
    idx = _row_index(index, x, d, source, "index_copy")
    n, k = (x.shape[d] if x.ndim else 1), idx.shape[0]
    if k == 0:
        return x
    check = gather(full((n,), 0, "int64"), idx).sum()  # an index outside [0, n): error at run time
    winner = einsum("j,t,j->t", idx, fill((n,), "x0", "int64"), fill((k,), "x0", "int64"),
                    join="where(x0 == x1, x2, -1)", agg="max") + check
    if not x.ndim:
        return _where(winner.reshape(()) >= 0, source.reshape(()).to(x.dtype), x)
    rows = index_select(source, d,
                        elementwise("max", winner, 0))
    shape = [1] * x.ndim
    shape[d] = n
    return _where((winner >= 0).reshape(tuple(shape)), rows, x)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """``torch.index_select``: the rows ``index`` (1-D) along ``dim``: a gather of whole rows."""
    x = _t(x, "index_select")
    d = _norm_dim(x, dim)
    idx = _int_index(index, "index_select")
    if idx.ndim > 1:
        raise ShapeError(f"index_select: index must be 1-D, got shape {idx.shape}")
    y = gather(_to_front(x, d), idx.reshape(idx.shape or (1,)))
    return _from_front(y, d)


def _arg(x: Tensor, dim: Any, keepdim: bool, agg: str, what: str) -> Tensor:
    x = _t(x, what)
    if dim is None:
        flat = x.reshape(math.prod(x.shape))
        out = _arg(flat, 0, False, agg, what)
        return out.reshape((1,) * x.ndim) if keepdim else out
    if x.ndim == 0:
        return full((), 0, "int64")
    d = _norm_dim(x, dim)
    n = x.shape[d]
    if n == 0:
        raise ShapeError(f"{what} over an empty dim {d} (shape {x.shape})")
    ls = LETTERS[:x.ndim]
    red = ls.replace(ls[d], "")
    best = einsum(f"{ls}->{red}", x, agg=agg)
    # the first position holding the extremum; NaN is the largest and the smallest (torch)
    nan = "(x0 != x0)" if kind(x.dtype) == "float" else "False"
    idx = einsum(f"{ls},{red},{ls[d]}->{red}", x, best, fill((n,), "x0", "int64"),
                 join=f"where((x0 == x1) | {nan}, x2, {n})", agg="min")
    return idx.unsqueeze(d) if keepdim else idx


def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """``torch.argmax``: the index (int64) of the first largest element along ``dim`` (of the
    flattened tensor when ``dim`` is None); a NaN counts as the largest. Two EinSums: the max, then
    the smallest index holding it (a ``min`` aggregation over ``where(x == max, iota, n)``)."""
    return _arg(x, dim, keepdim, "max", "argmax")


def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """``torch.argmin``: as :func:`argmax` for the smallest element."""
    return _arg(x, dim, keepdim, "min", "argmin")


def _pick(x: Tensor, idx: Tensor, d: int, keepdim: bool) -> Tensor:
    """``x``'s element at ``idx`` along ``d`` (idx without that dim): one EinSum that keeps the
    picked element and adds zeros, so the gradient reaches that element only (as torch's max.dim)."""
    ls = LETTERS[:x.ndim]
    red = ls.replace(ls[d], "")
    zero = "False" if x.dtype == "bool" else "0"
    agg = "max" if x.dtype == "bool" else "sum"
    v = einsum(f"{ls},{red},{ls[d]}->{red}", x, idx, fill((x.shape[d],), "x0", "int64"),
               join=f"where(x1 == x2, x0, {zero})", agg=agg)
    return v.unsqueeze(d) if keepdim else v


def max_dim(x: Tensor, dim: int, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """``torch.max(x, dim)``: (values, indices of the first maximum)."""
    return _extreme_dim(_t(x, "max"), dim, keepdim, argmax)


def min_dim(x: Tensor, dim: int, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """``torch.min(x, dim)``: (values, indices of the first minimum)."""
    return _extreme_dim(_t(x, "min"), dim, keepdim, argmin)


def _extreme_dim(x: Tensor, dim: int, keepdim: bool, arg: Any) -> tuple[Tensor, Tensor]:
    """(values, indices) of ``arg`` (argmax or argmin) along ``dim``: the values picked at the indices."""
    if x.ndim == 0:
        return x, full((), 0, "int64")
    d = _norm_dim(x, dim)
    idx = arg(x, d)
    return _pick(x, idx, d, keepdim), (idx.unsqueeze(d) if keepdim else idx)


def _scan(x: Tensor, dim: int, dtype: Any, agg: str, what: str) -> Tensor:
    x = _t(x, what)
    if dtype is not None:
        x = x.to(dtype)
    elif kind(x.dtype) in ("int", "bool"):
        x = x.to("int64")  # torch: integer scans accumulate in int64
    if x.ndim == 0:
        return x
    d = _norm_dim(x, dim)
    n = x.shape[d]
    ls = LETTERS[:x.ndim]
    if x.ndim >= len(LETTERS):
        raise ShapeError(f"{what}: rank {x.ndim} is above the supported 25")
    i = LETTERS[x.ndim]  # the output position; the input's label along d is the summed one
    mask = fill((n, n), "x1 <= x0", "bool")  # (i, j): j contributes to i
    out = ls[:d] + i + ls[d + 1:]
    unit = "0" if agg == "sum" else "1"
    return einsum(f"{ls},{i}{ls[d]}->{out}", x, mask, join=f"where(x1, x0, {unit})", agg=agg)


def cumsum(x: Tensor, dim: int, dtype: Any = None) -> Tensor:
    """``torch.cumsum``: ``out[i] = sum_{j <= i} x[j]`` along ``dim``, one EinSum over the mask
    ``j <= i`` (O(n²) per row, decomposable along every label). Integers and bools give int64."""
    return _scan(x, dim, dtype, "sum", "cumsum")


def cumprod(x: Tensor, dim: int, dtype: Any = None) -> Tensor:
    """``torch.cumprod``: ``out[i] = prod_{j <= i} x[j]``, one EinSum with a ``prod`` aggregation
    (exact with zeros; its gradient is the prod rule's, with no division)."""
    return _scan(x, dim, dtype, "prod", "cumprod")


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    """``torch.nn.functional.one_hot``: int64 ``x.shape + (num_classes,)`` with a 1 at each class.
    ``num_classes=-1`` (``x.max() + 1``) is a data-dependent shape: give the number. A class
    outside ``[0, num_classes)`` is an error at run time (as torch)."""
    x = _int_index(x, "one_hot")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise UnsupportedOpError(f"one_hot with num_classes={num_classes!r}: the number of classes must "
                                 f"be given (-1, the largest value + 1, is a data-dependent shape)")
    if x.ndim >= len(LETTERS):
        raise ShapeError(f"one_hot: rank {x.ndim} is above the supported 25")
    # rows of the identity (a fill) gathered by class: an index outside [0, num_classes) is an
    # error at run time, as torch raises
    return gather(fill((num_classes, num_classes), "where(x0 == x1, 1, 0)", "int64"), x)


_PAD_INDEX = {
    # the source position of output position x0 along a dim of n, padded by lo before it
    "reflect": "{m} - abs({m} - abs(x0 - {lo}))",
    "replicate": "min(max(x0 - {lo}, 0), {m})",
    "circular": "(x0 - {lo}) % {n}",
}


def _pad_pairs(x: Tensor, pad: Any, what: str) -> list[tuple[int, int, int]]:
    try:
        p = [operator.index(v) for v in pad]
    except TypeError:
        raise ShapeError(f"{what}: pad must be a sequence of ints, got {pad!r:.60}") from None
    if len(p) % 2 or len(p) // 2 > x.ndim:
        raise ShapeError(f"{what}: pad {tuple(p)} must have an even length of at most 2 * rank ({x.ndim})")
    return [(x.ndim - 1 - k, p[2 * k], p[2 * k + 1]) for k in range(len(p) // 2)]


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: Any = None) -> Tensor:
    """``torch.nn.functional.pad``: ``pad`` is (before, after) pairs from the last dim backwards.
    ``constant`` lays fills of ``value`` (0 by default) beside ``x`` (a negative pad crops);
    ``reflect``, ``replicate`` and ``circular`` gather each output row from a fill of source
    positions (one gather per padded dim; its gradient a scatter-add).

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (1, 3))
    >>> ej.reference(ej.pad(x, (2, 1), "reflect"), x=np.array([[1, 2, 3]], np.float32)).tolist()
    [[3.0, 2.0, 1.0, 2.0, 3.0, 2.0]]
    """
    x = _t(x, "pad")
    what = f"pad (mode {mode!r})"
    if mode not in ("constant", *_PAD_INDEX):
        raise UnsupportedOpError(f"pad with mode={mode!r} (constant, reflect, replicate, circular)")
    y = x
    for d, lo, hi in _pad_pairs(x, pad, what):
        n = y.shape[d]
        if mode == "constant":
            y = _pad_constant(y, d, lo, hi, 0 if value is None else value)
            continue
        if value not in (None, 0, 0.0):
            raise EinjoinError(f"{what}: value={value!r} is only for mode 'constant'")
        if mode == "reflect" and (lo >= n or hi >= n):
            raise ShapeError(f"{what}: padding ({lo}, {hi}) must be below the size {n} of dim {d}")
        if lo < 0 or hi < 0 or n == 0:
            raise ShapeError(f"{what}: padding ({lo}, {hi}) of dim {d} of size {n}")
        src = fill((n + lo + hi,), _PAD_INDEX[mode].format(m=n - 1, lo=lo, n=n), "int64")
        y = index_select(y, d, src)
    return y


def _pad_constant(y: Tensor, d: int, lo: int, hi: int, value: Any) -> Tensor:
    if lo < 0 or hi < 0:  # a negative pad crops
        n = y.shape[d]
        a, b = max(0, -lo), n - max(0, -hi)
        if b < a:
            raise ShapeError(f"pad: cropping ({lo}, {hi}) of dim {d} of size {n}")
        y = y[(slice(None),) * d + (slice(a, b),)]
        lo, hi = max(0, lo), max(0, hi)
    parts = []
    if lo:
        parts.append(full(y.shape[:d] + (lo,) + y.shape[d + 1:], value, y.dtype))
    parts.append(y)
    if hi:
        parts.append(full(y.shape[:d] + (hi,) + y.shape[d + 1:], value, y.dtype))
    return concat(parts, d) if len(parts) > 1 else y


# ---------------------------------------------------------------- advanced indexing (x[i, j], x[i, j] = v)


def _advanced(x: Tensor, indices: Sequence[Any], what: str
              ) -> tuple[list[int], list[int], Tensor, Tensor, tuple[int, ...], list[int]]:
    """The layout of ``x[indices]`` (ATen's form: one entry per leading dim, None for a whole dim):
    (indexed dims, other dims, the table — ``x`` with the indexed dims first and merged into one
    — the flat row of each indexed element (-1 when out of range), the index shape, and the
    order of the result's dims relative to [index dims..., other dims...])."""
    idx = list(indices) + [None] * (x.ndim - len(indices))
    if len(idx) > x.ndim:
        raise ShapeError(f"{what}: {len(indices)} indices for a tensor of rank {x.ndim}")
    dims = [d for d, i in enumerate(idx) if i is not None]
    rest = [d for d in range(x.ndim) if d not in dims]
    ts = [_int_index(idx[d], what) for d in dims]
    bshape = broadcast_shapes(*(t.shape for t in ts), what=f"{what}: index tensors")
    sizes = [x.shape[d] for d in dims]
    st = _strides(sizes)
    valid = " & ".join(f"(x{k} >= {-n}) & (x{k} < {n})" for k, n in enumerate(sizes))
    terms = " + ".join(f"where(x{k} < 0, x{k} + {n}, x{k}) * {s}" for k, (n, s) in enumerate(zip(sizes, st)))
    lin = elementwise_expr(f"where({valid}, {terms}, -1)", *ts)
    if lin.shape != bshape:
        lin = lin.expand(bshape)
    table = x.permute(dims + rest) if dims + rest != list(range(x.ndim)) else x
    table = table.reshape((math.prod(sizes),) + tuple(x.shape[d] for d in rest))
    nb = len(bshape)
    order = list(range(nb + len(rest)))
    if dims == list(range(dims[0], dims[-1] + 1)) and dims[0] > 0:
        # adjacent indexed dims: the index dims take their place (numpy's and torch's rule)
        before = dims[0]
        order = list(range(nb, nb + before)) + list(range(nb)) + list(range(nb + before, nb + len(rest)))
    return dims, rest, table, lin, bshape, order


def advanced_index(x: Tensor, indices: Sequence[Any]) -> Tensor:
    """``x[i0, i1, ...]`` with integer index tensors (broadcast together; None keeps a dim), as
    ATen's ``index``: one gather of rows from ``x`` with the indexed dims merged; negative
    indices count from the end, out-of-range ones are an error at run time (as torch).

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (3, 4)); i = ej.input("i", (2,), "int64"); j = ej.input("j", (2,), "int64")
    >>> ej.reference(advanced_index(x, [i, j]), x=np.arange(12.0, dtype=np.float32).reshape(3, 4),
    ...              i=np.array([0, 2]), j=np.array([-1, 1])).tolist()
    [3.0, 9.0]
    """
    x = _t(x, "index")
    if any(isinstance(i, Tensor) and i.dtype == "bool" for i in indices):
        raise data_dependent("boolean-mask indexing x[mask]")
    _, _, table, lin, _, order = _advanced(x, indices, "index")
    y = gather(table, lin)
    return y if order == list(range(y.ndim)) else y.permute(order)


def getitem_with_tensors(x: Tensor, index: tuple[Any, ...]) -> Tensor:
    """``x[...]`` with index tensors among ints, slices and ``...`` (``Tensor.__getitem__``, and
    ``x[...]`` as torch.fx records it): the slices and ints first, then the tensors in one gather
    (:func:`advanced_index`: negative indices count from the end, as torch).

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (2, 3)); j = ej.input("j", (2,), "int64")
    >>> ej.reference(x[1, j], x=np.arange(6.0, dtype=np.float32).reshape(2, 3), j=np.array([-1, 0])).tolist()
    [5.0, 3.0]
    """
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    items: list[Any] = []
    for i in index:
        if i is Ellipsis:
            items += [slice(None)] * (x.ndim - n_real)
        elif i is None:
            raise UnsupportedOpError("indexing with None (a new axis) among index tensors")
        else:
            items.append(i)
    items += [slice(None)] * (x.ndim - len(items))
    # slices and ints first, as torch does (an int selects before the tensors index: x[2, :, j]
    # is x[2][:, j], unlike numpy, which would count the int as an index array)
    if any(not isinstance(i, Tensor) and i != slice(None) for i in items):
        x = x[tuple(slice(None) if isinstance(i, Tensor) else i for i in items)]
    idx = [i for i in items if not isinstance(i, int) or isinstance(i, bool)]
    return advanced_index(x, [i if isinstance(i, Tensor) else None for i in idx])


BUILT_ELSEWHERE["getitem_with_tensors"] = getitem_with_tensors  # Tensor.__getitem__ calls it


LAST_WRITE_PAIRS = 256
"""index_put without accumulate finds repeated indices (last write wins) by an EinSum over pairs of
index positions for up to this many positions (65k compares at the limit); beyond, by a stable
sort of the positions' targets (:func:`_last_writes`): its few more tasks cost more below ~200
positions, the pairs' O(m^2) more above (CPU per run, 1 device: 1024 positions 2.3 vs 0.75 ms, 4000
positions 45 vs 2.9 ms and 169 MB vs 2 MB of peak memory)."""


def _last_writes(flat: Tensor, m: int) -> Tensor:
    """Bool ``(m,)``: True at each index position that no later position repeats. A stable sort
    of the targets keeps each target's writes in position order, so a write is the last of its
    target where the next sorted target differs; a scatter-add puts the flags back by position
    (the sort's positions are a permutation: exact). O(m log m)."""
    order = wrap(ops.topk_node(flat.node, m, 0, False, indices=True))
    s = gather(flat, order)
    last = concat([(s[:-1] != s[1:]).to("int64"), full((1,), 1, "int64")], 0)
    return wrap(ops.scatter_add_node(last.node, order.node, m)) > 0


def index_put(x: Tensor, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Tensor:
    """``x[i0, i1, ...] = values`` (``+=`` with ``accumulate``), functional, as ATen's
    ``index_put``: a scatter-add of ``values`` (broadcast to ``x[indices]``'s shape) into ``x``
    with the indexed dims merged. Without ``accumulate`` a repeated index keeps its last write, as
    torch's CPU kernel does (torch's documentation leaves it unspecified): the writes that a later
    one repeats are dropped first (an EinSum over pairs of index positions, for up to
    :data:`LAST_WRITE_PAIRS` positions; beyond, a stable sort of their targets). A bool mask index
    with one value is ``where(mask, value, x)``.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (4,)); i = ej.input("i", (3,), "int64")
    >>> ej.reference(index_put(x, [i], 7.0), x=np.zeros(4, np.float32), i=np.array([1, 1, -1])).tolist()
    [0.0, 7.0, 0.0, 7.0]
    """
    x = _t(x, "index_put")
    if any(isinstance(i, Tensor) and i.dtype == "bool" for i in indices):
        return _masked_put(x, indices, values, accumulate)
    dims, rest, table, lin, bshape, order = _advanced(x, indices, "index_put")
    shape_r = bshape + tuple(x.shape[d] for d in rest)
    res_shape = tuple(shape_r[k] for k in order)  # the shape of x[indices]
    v = values if isinstance(values, Tensor) else full((), values, x.dtype)
    v = (v if v.dtype == x.dtype else v.to(x.dtype))
    if v.shape != res_shape:
        v = v.expand(res_shape)
    inverse = [order.index(k) for k in range(len(order))]
    v = v if inverse == list(range(v.ndim)) else v.permute(inverse)  # to [index dims..., other dims...]
    vv = v if v.dtype != "bool" else v.to("int64")
    m = math.prod(bshape)
    if not accumulate and m > 1:  # a write that a later one repeats: dropped
        flat = lin.reshape((m,))
        if m <= LAST_WRITE_PAIRS:
            iota = fill((m,), "x0", "int64")
            later = einsum("j,k,j,k->j", flat, flat, iota, iota, join="where((x0 == x1) & (x3 > x2), 1, 0)",
                           agg="max")
            keep = later == 0
        else:
            keep = _last_writes(flat, m)
        keep = keep.reshape(bshape + (1,) * (vv.ndim - len(bshape)))
        vv = _where(keep, vv, full((), 0, vv.dtype))
    placed = wrap(ops.scatter_add_node(vv.node, lin.node, table.shape[0]))
    if accumulate:
        new = (table.to("int64") + placed).to("bool") if table.dtype == "bool" else table + placed.to(table.dtype)
    else:
        count = wrap(ops.scatter_add_node(full(bshape, 1, "int64").node, lin.node, table.shape[0]))
        count = count.reshape((table.shape[0],) + (1,) * (table.ndim - 1))
        new = _where(count > 0, placed.to(table.dtype), table)
    new = new.reshape(tuple(x.shape[d] for d in dims) + tuple(x.shape[d] for d in rest))
    perm = dims + rest
    back = [perm.index(d) for d in range(x.ndim)]
    return new if back == list(range(x.ndim)) else new.permute(back)


def _masked_put(x: Tensor, indices: Sequence[Any], values: Any, accumulate: bool) -> Tensor:
    ts = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(ts) != 1 or ts[0][1].dtype != "bool":
        raise UnsupportedOpError("index_put mixing a bool mask with other index tensors")
    d, mask = ts[0]
    if isinstance(values, Tensor) and math.prod(values.shape) != 1:
        raise data_dependent("x[mask] = values with more than one value (their count depends on the mask)")
    if x.shape[d:d + mask.ndim] != mask.shape:
        raise ShapeError(f"index_put: mask of shape {mask.shape} does not fit dims {d}.. of {x.shape}")
    m = mask.reshape(mask.shape + (1,) * (x.ndim - d - mask.ndim))
    v = values.reshape(()) if isinstance(values, Tensor) else values
    if isinstance(v, Tensor) and v.dtype != x.dtype:
        v = v.to(x.dtype)
    if accumulate:
        return x + _where(m, v if isinstance(v, Tensor) else full((), v, x.dtype), full((), 0, x.dtype))
    out = _where(m, v if isinstance(v, Tensor) else full((), v, x.dtype), x)
    return out if out.dtype == x.dtype else out.to(x.dtype)
