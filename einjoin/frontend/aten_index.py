"""The routing and indexing translations of the torch importer (ATen ops as ``torch.export``
records them, torch functions and tensor methods as ``torch.fx`` does): gather / take_along_dim,
scatter, scatter_add, scatter_reduce (sum, mean), index_add / index_copy / index_fill,
argmax / argmin, ``max`` / ``min`` in all three forms, cumsum / cumprod, one_hot, pad and the
ATen pad ops, flip, roll, masked_fill with a tensor value: :data:`INDEX_OPS`, merged into
:data:`einjoin.frontend.aten.OPS`. The ops themselves are :mod:`einjoin.frontend.routing`'s.

>>> import einjoin as ej
>>> INDEX_OPS["gather"](ej.input("x", (2, 3)), 1, ej.input("i", (2, 2), "int64")).shape
(2, 2)
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

from einjoin.errors import ShapeError
from einjoin.frontend import functions as F
from einjoin.frontend import routing as R
from einjoin.frontend.aten_layout import torch_dtype
from einjoin.frontend.tensor import Tensor, _norm_dim, broadcast_shapes, elementwise
from einjoin.registry import registrar

__all__ = ["INDEX_OPS"]

INDEX_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(INDEX_OPS)

# torch.max(x, dim) returns a named tuple: fx code may read .values / .indices
MaxResult = namedtuple("MaxResult", ["values", "indices"])


def _dt(dtype: Any) -> Any:
    """A dtype argument (``cumsum(x, 0, dtype=torch.int16)`` accumulates in int16, as torch's)."""
    return None if dtype is None else torch_dtype(dtype)


@op("gather")
def _gather(x: Tensor, dim: int, index: Tensor, **_: Any) -> Tensor:  # sparse_grad: no value change
    return R.take_along_dim(x, index, dim)


@op("take_along_dim")
def _take_along_dim(x: Tensor, indices: Tensor, dim: Any = None) -> Tensor:
    if dim is None:
        return R.take_along_dim(x.flatten(), indices.flatten(), 0)
    d = _norm_dim(x, dim)
    # torch takes the indices modulo the dim's size here (not in gather, nor without a dim)
    indices = R.from_the_end(R._int_index(indices, "take_along_dim"), x.shape[d], modulo=True)
    # torch broadcasts every dim but ``dim``
    xs, ix = list(x.shape), list(indices.shape)
    if len(xs) != len(ix):
        return R.take_along_dim(x, indices, d)  # the shape error names the ranks
    xs[d] = ix[d] = 1
    common = broadcast_shapes(tuple(xs), tuple(ix), what="take_along_dim")
    want_x = common[:d] + (x.shape[d],) + common[d + 1:]
    want_i = common[:d] + (indices.shape[d],) + common[d + 1:]
    xt = x if x.shape == want_x else x.expand(want_x)
    it = indices if indices.shape == want_i else indices.expand(want_i)
    return R.take_along_dim(xt, it, d)


@op("scatter", "scatter_")
def _scatter(x: Tensor, dim: int, index: Tensor, src: Any = None, *, value: Any = None,
             reduce: Any = None) -> Tensor:
    return R.scatter(x, dim, index, src, value=value, reduce=reduce)


@op("scatter_add", "scatter_add_")
def _scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    return R.scatter_add(x, dim, index, src)


@op("scatter_reduce", "scatter_reduce_")
def _scatter_reduce(x: Tensor, dim: int, index: Tensor, src: Tensor, reduce: str, *,
                    include_self: bool = True) -> Tensor:
    return R.scatter_reduce(x, dim, index, src, reduce, bool(include_self))


@op("index_add", "index_add_")
def _index_add(x: Tensor, dim: int, index: Tensor, source: Tensor, *, alpha: Any = 1) -> Tensor:
    return R.index_add(x, dim, index, source, alpha)


@op("index_copy", "index_copy_")
def _index_copy(x: Tensor, dim: int, index: Tensor, source: Tensor) -> Tensor:
    return R.index_copy(x, dim, index, source)


@op("index_fill", "index_fill_")
def _index_fill(x: Tensor, dim: int, index: Tensor, value: Any) -> Tensor:
    d = _norm_dim(x, dim) if x.ndim else 0
    n = index.shape[0] if index.ndim else 1
    shape = x.shape[:d] + (n,) + x.shape[d + 1:] if x.ndim else ()
    src = value.to(x.dtype).expand(shape) if isinstance(value, Tensor) else F.full(shape, value, x.dtype)
    # torch reads a negative index from the end here (index_copy refuses it)
    return R.index_copy(x, dim, R.from_the_end(R._int_index(index, "index_fill"), x.shape[d] if x.ndim else 1), src)


@op("argmax")
def _argmax(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return R.argmax(x, dim, keepdim)


@op("argmin")
def _argmin(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return R.argmin(x, dim, keepdim)


def _extremum(which: str) -> Callable[..., Any]:
    def f(x: Tensor, dim: Any = None, keepdim: bool = False) -> Any:
        if isinstance(dim, Tensor):  # torch.max(a, b): the elementwise maximum
            return elementwise(which, x, dim, name="maximum" if which == "max" else "minimum")
        if dim is None:  # torch.max(x): the whole reduction
            return x.max() if which == "max" else x.min()
        values, indices = (R.max_dim if which == "max" else R.min_dim)(x, dim, keepdim)
        return MaxResult(values, indices)
    return f


INDEX_OPS["max"] = _extremum("max")
INDEX_OPS["min"] = _extremum("min")


@op("cumsum", "cumsum_")
def _cumsum(x: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    return R.cumsum(x, dim, _dt(dtype))


@op("cumprod", "cumprod_")
def _cumprod(x: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    return R.cumprod(x, dim, _dt(dtype))


@op("one_hot")
def _one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
    return R.one_hot(x, num_classes)


@op("pad")
def _pad(x: Tensor, pad: Any, mode: str = "constant", value: Any = None) -> Tensor:
    return R.pad(x, pad, mode, value)


@op("constant_pad_nd")
def _constant_pad_nd(x: Tensor, pad: Any, value: Any = 0) -> Tensor:
    return R.pad(x, pad, "constant", value)


for _name, _mode in (("reflection_pad1d", "reflect"), ("reflection_pad2d", "reflect"),
                     ("reflection_pad3d", "reflect"), ("replication_pad1d", "replicate"),
                     ("replication_pad2d", "replicate"), ("replication_pad3d", "replicate"),
                     ("_pad_circular", "circular")):
    INDEX_OPS[_name] = (lambda mode: lambda x, padding: R.pad(x, padding, mode))(_mode)


@op("flip")
def _flip(x: Tensor, *dims: Any) -> Tensor:
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])  # flip(x, [0, 2]) or x.flip(0, 2)
    for d in dims:
        dd = _norm_dim(x, d)
        n = x.shape[dd]
        if n > 1:
            x = R.index_select(x, dd, F.fill((n,), f"{n - 1} - x0", "int64"))
    return x


@op("roll")
def _roll(x: Tensor, shifts: Any, dims: Any = None) -> Tensor:
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        s = shifts[0] if isinstance(shifts, (list, tuple)) else shifts
        return _roll(x.flatten(), s, 0).reshape(x.shape)
    sh = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    ds = (dims,) if isinstance(dims, int) else tuple(dims)
    for s, d in zip(sh, ds):
        dd = _norm_dim(x, d)
        n = x.shape[dd]
        if n and s % n:
            x = R.index_select(x, dd, F.fill((n,), f"(x0 + {n - s % n}) % {n}", "int64"))
    return x


@op("diff")
def _diff(x: Tensor, n: int = 1, dim: int = -1, prepend: Any = None, append: Any = None) -> Tensor:
    """``torch.diff``: ``n`` times the difference of neighbours along ``dim`` (after laying
    ``prepend`` / ``append`` beside ``x``)."""
    d = _norm_dim(x, dim)
    parts = [p for p in (prepend, x, append) if p is not None]
    if len(parts) > 1:
        parts = [p if isinstance(p, Tensor) else F.full(x.shape[:d] + (1,) + x.shape[d + 1:], p, x.dtype)
                 for p in parts]
        x = F.concat(parts, d)
    for _ in range(int(n)):
        m = x.shape[d]
        hi = x[(slice(None),) * d + (slice(1, m),)]
        lo = x[(slice(None),) * d + (slice(0, max(m - 1, 0)),)]
        x = elementwise("ne", hi, lo) if x.dtype == "bool" else hi - lo  # bools: xor, as torch
    return x


@op("linspace")
def _linspace(start: Any, end: Any, steps: int, *, dtype: Any = None, **_: Any) -> Tensor:
    """torch's linspace: the first half counted up from ``start``, the second down from ``end``
    (torch's kernel), a fill."""
    dt = _dt(dtype) or "float32"
    n = int(steps)
    if n == 1:
        return F.full((1,), start, dt)
    step = (float(end) - float(start)) / (n - 1)
    expr = f"where(x0 < {n // 2}, {float(start)!r} + x0 * {step!r}, {float(end)!r} - ({n - 1} - x0) * {step!r})"
    return F.fill((n,), expr, "float64").to(dt)


@op("masked_fill", "masked_fill_")
def _masked_fill(x: Tensor, mask: Tensor, value: Any) -> Tensor:
    """``x`` with ``value`` where ``mask`` (broadcast to ``x``): a number, or a 0-d tensor taken
    in ``x``'s dtype (as torch)."""
    if isinstance(value, Tensor) and value.dtype != x.dtype:
        value = value.to(x.dtype)
    out = F.where(mask, value, x)
    if out.shape != x.shape:
        raise ShapeError(f"masked_fill: mask of shape {mask.shape} does not broadcast to the input's {x.shape}")
    return out if out.dtype == x.dtype else out.to(x.dtype)  # an int tensor keeps its dtype
