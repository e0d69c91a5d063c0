"""The layout translations of the torch importer: views and reshapes, permutes and transposes,
squeeze/unsqueeze, expand, repeat, cat/stack/split, slices, select and index_select, and the
like: :data:`LAYOUT_OPS` by ATen op / torch function name, merged into
:data:`einjoin.frontend.aten.OPS`.

>>> import einjoin as ej
>>> LAYOUT_OPS["permute"](ej.input("x", (2, 3, 4)), 2, 0, 1).shape
(4, 2, 3)
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from einjoin.errors import ShapeError, UnsupportedOpError
from einjoin.frontend import functions as F
from einjoin.frontend import routing as R
from einjoin.frontend.aten_notes import data_dependent
from einjoin.frontend.tensor import Tensor, _norm_dim, elementwise
from einjoin.registry import registrar

__all__ = ["LAYOUT_OPS", "torch_dtype"]

LAYOUT_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(LAYOUT_OPS)


def torch_dtype(dt: Any) -> str:
    """einjoin's name for a torch dtype (``torch.float32`` -> ``"float32"``)."""
    name = str(dt).removeprefix("torch.")
    if name in ("float", "double", "half", "long", "int", "bool"):
        name = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                "int": "int32", "bool": "bool"}[name]
    return name


def _shape(args: tuple[Any, ...]) -> tuple[int, ...]:
    """A size given as varargs ``(2, 3)`` or as one sequence ``([2, 3],)``."""
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return tuple(int(s) for s in args[0])
    return tuple(int(s) for s in args)


def _dims(dim: Any) -> Any:
    """A dim argument: a list or tuple of dims as a tuple (an empty one: all dims, None)."""
    if isinstance(dim, (list, tuple)):
        return tuple(dim) if dim else None
    return dim



@op("view", "_unsafe_view", "reshape", "view_copy")
def _view(x: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and not isinstance(shape[0], (list, tuple)) and not isinstance(shape[0], int):
        raise UnsupportedOpError(f"view with {type(shape[0]).__name__} (a dtype view)")
    return x.reshape(_shape(shape))


@op("view_as", "reshape_as")
def _view_as(x: Tensor, other: Tensor) -> Tensor:
    return x.reshape(other.shape)


@op("permute")
def _permute(x: Tensor, *dims: Any) -> Tensor:
    return x.permute(*dims)


@op("transpose", "swapaxes", "transpose_")
def _transpose(x: Tensor, a: int, b: int) -> Tensor:
    return x.transpose(a, b)


@op("t", "numpy_T")
def _t(x: Tensor) -> Tensor:
    return x if x.ndim < 2 else x.transpose(0, 1)


@op("contiguous", "clone", "alias", "lift_fresh_copy", "lift_fresh", "_to_dim_order_copy", "identity")
def _identity(x: Any, *_: Any, **__: Any) -> Any:
    return x


@op("detach", "detach_")
def _detach(x: Any, *_: Any, **__: Any) -> Any:
    # torch's detach cuts the gradient: ej.grad must not flow through it either (the
    # stop_gradient scalar function; only float tensors carry gradients)
    if not isinstance(x, Tensor) or not x.dtype.startswith(("float", "bfloat")):
        return x
    return elementwise("stop_gradient", x)


@op("unsqueeze")
def _unsqueeze(x: Tensor, dim: int) -> Tensor:
    return x.unsqueeze(dim)


@op("squeeze")
def _squeeze(x: Tensor, dim: Any = None) -> Tensor:
    if isinstance(dim, (list, tuple)) and not dim:
        return x  # torch squeezes no dim for an empty list (a reduction's empty list is every dim)
    return x.squeeze(_dims(dim))


@op("flatten")
def _flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    return x.flatten(start_dim, end_dim)


@op("unflatten")
def _unflatten(x: Tensor, dim: int, sizes: Any) -> Tensor:
    d = _norm_dim(x, dim)
    sizes = list(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.shape[d] // known
    return x.reshape(x.shape[:d] + tuple(sizes) + x.shape[d + 1:])


@op("expand", "expand_copy", "broadcast_to")
def _expand(x: Tensor, *shape: Any, implicit: bool = False) -> Tensor:
    return x.expand(_shape(shape))


@op("expand_as")
def _expand_as(x: Tensor, other: Tensor) -> Tensor:
    return x.expand(other.shape)


def _repeat_interleave(x: Tensor, repeats: int, dim: int) -> Tensor:
    d = _norm_dim(x, dim)
    y = x.unsqueeze(d + 1)
    y = y.expand(y.shape[:d + 1] + (repeats,) + y.shape[d + 2:])
    return y.reshape(x.shape[:d] + (x.shape[d] * repeats,) + x.shape[d + 1:])


@op("repeat_interleave")
def _repeat_interleave_op(x: Tensor, repeats: Any, dim: Any = None, *, output_size: Any = None) -> Tensor:
    if isinstance(repeats, Tensor):
        raise data_dependent("repeat_interleave with tensor repeats")
    if dim is None:  # torch: of the flattened tensor
        return _repeat_interleave(x.flatten(), int(repeats), 0)
    return _repeat_interleave(x, int(repeats), dim)


@op("repeat")
def _repeat(x: Tensor, *sizes: Any) -> Tensor:
    reps = _shape(sizes)
    lead = len(reps) - x.ndim
    y = x.reshape((1,) * lead + x.shape)
    # tile: each dim d becomes (reps[d], n[d]) then merges
    inter = []
    for _, n in zip(reps, y.shape):
        inter += [1, n]
    y = y.reshape(tuple(inter))
    target = []
    for r, n in zip(reps, y.shape[1::2]):
        target += [r, n]
    return y.expand(tuple(target)).reshape(tuple(r * n for r, n in zip(reps, y.shape[1::2])))


@op("cat", "concat", "concatenate")
def _cat(tensors: Any, dim: int = 0) -> Tensor:
    """torch.cat: the inputs' common dtype (bool < int < float, then the wider type; torch's
    promotion, the skipped inputs included), and 1-d empty tensors of shape (0,) skipped beside
    tensors of another rank, as torch does (Hugging Face's DynamicCache starts as ``tensor([])``
    and is concatenated with the first keys along dim -2)."""
    from einjoin.ir.dtypes import kind, promote
    ts = list(tensors)
    if ts and all(isinstance(t, Tensor) for t in ts):
        rank = {"bool": 0, "int": 1, "float": 2}
        top = max(rank[kind(t.dtype)] for t in ts)
        target = ""
        for t in ts:
            if rank[kind(t.dtype)] == top:
                target = t.dtype if not target else promote(target, t.dtype)
        kept = [t for t in ts if t.shape != (0,)]
        if kept and any(t.ndim != 1 for t in kept):
            ts = kept
        ts = [t if t.dtype == target else t.to(target) for t in ts]
    return F.concat(ts, dim)


@op("stack")
def _stack(tensors: Any, dim: int = 0) -> Tensor:
    return F.stack(list(tensors), dim)


@op("split", "split_with_sizes")
def _split(x: Tensor, size: Any, dim: int = 0) -> tuple[Tensor, ...]:
    return F.split(x, list(size) if isinstance(size, (list, tuple)) else size, dim)


@op("chunk")
def _chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    return F.chunk(x, chunks, dim)


@op("unbind")
def _unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
    d = _norm_dim(x, dim)
    return tuple(x[(slice(None),) * d + (i,)] for i in range(x.shape[d]))


@op("slice")
def _slice(x: Tensor, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Tensor:
    d = _norm_dim(x, dim)
    a, b, s = slice(start, end, step).indices(x.shape[d])
    if (a, b, s) == (0, x.shape[d], 1):
        return x
    return x[(slice(None),) * d + (slice(a, b, s),)]


@op("narrow", "narrow_copy")
def _narrow(x: Tensor, dim: int, start: Any, length: Any) -> Tensor:
    """``x.narrow(dim, start, length)``: ``length`` elements of ``dim`` from ``start`` (from the end
    when negative), checked as torch checks them."""
    d = _norm_dim(x, dim)
    n = x.shape[d]
    try:
        s, k = operator.index(start), operator.index(length)
    except TypeError:
        raise UnsupportedOpError(f"narrow: start {start!r} and length {length!r} must be ints (a tensor start is "
                                 f"data-dependent: no static graph holds it)") from None
    if not -n <= s <= n:
        raise ShapeError(f"narrow: start out of range (expected to be in range of [{-n}, {n}], but got {s}) "
                         f"for dim {d} of shape {tuple(x.shape)}")
    s = s + n if s < 0 else s
    if k < 0 or s + k > n:
        raise ShapeError(f"narrow: start ({s}) + length ({k}) exceeds dimension size ({n}) of dim {d} of shape "
                         f"{tuple(x.shape)}" if k >= 0 else f"narrow: length must be non-negative, got {k}")
    return _slice(x, d, s, s + k)


@op("slice_scatter")
def _slice_scatter(x: Tensor, src: Tensor, dim: int = 0, start: Any = None, end: Any = None,
                   step: int = 1) -> Tensor:
    """``x`` with ``x[..., start:end:step, ...] = src`` (the functional form of a slice
    assignment): a concat of the untouched parts and ``src`` for step 1, an index_copy else."""
    d = _norm_dim(x, dim)
    a, b, s = slice(start, end, step).indices(x.shape[d])
    count = len(range(a, b, s))
    want = x.shape[:d] + (count,) + x.shape[d + 1:]
    if tuple(src.shape) != want:
        raise ShapeError(f"slice_scatter: src has shape {tuple(src.shape)}, the slice [{a}:{b}:{s}] of dim {d} "
                         f"of {tuple(x.shape)} has shape {want}")
    if src.dtype != x.dtype:
        src = src.to(x.dtype)
    if count == 0:
        return x
    if s == 1:
        lead, tail = (slice(None),) * d + (slice(0, a),), (slice(None),) * d + (slice(b, x.shape[d]),)
        parts = ([x[lead]] if a > 0 else []) + [src] + ([x[tail]] if b < x.shape[d] else [])
        return F.concat(parts, d) if len(parts) > 1 else src
    index = F.fill((count,), f"{a} + {s} * x0", "int64")
    return R.index_copy(x, d, index, src)


@op("select_scatter")
def _select_scatter(x: Tensor, src: Tensor, dim: int, index: int) -> Tensor:
    """``x`` with ``x[..., index, ...] = src`` (``src`` without dim ``dim``)."""
    d = _norm_dim(x, dim)
    n = x.shape[d]
    i = int(index)
    if not -n <= i < n:
        raise ShapeError(f"select_scatter: index {i} out of range for dim {d} of size {n}")
    i %= n
    return _slice_scatter(x, src.unsqueeze(d), d, i, i + 1)


@op("copy", "copy_")
def _copy(x: Tensor, src: Any, non_blocking: bool = False) -> Tensor:
    """``x.copy_(src)`` functionalised: ``src`` broadcast to ``x``'s shape, in ``x``'s dtype."""
    del non_blocking  # torch's hint for device copies; a graph value has no copy to overlap
    t: Tensor = src if isinstance(src, Tensor) else F.full((), src, x.dtype)
    if t.dtype != x.dtype:
        t = t.to(x.dtype)
    return t if tuple(t.shape) == tuple(x.shape) else t.expand(tuple(x.shape))


@op("fill", "fill_")
def _fill(x: Tensor, value: Any) -> Tensor:
    """``x.fill_(value)`` functionalised (``value`` a number or a 0-d tensor)."""
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise ShapeError(f"fill: the value must be a 0-d tensor, got shape {tuple(value.shape)}")
        return _copy(x, value)
    return F.full(tuple(x.shape), value, x.dtype)


@op("meshgrid")
def _meshgrid(tensors: Any, indexing: str = "ij") -> tuple[Tensor, ...]:
    """torch.meshgrid of 1-d (or 0-d) tensors; ``indexing`` "ij" or "xy" (the first two swapped)."""
    ts = [t.reshape((-1,)) if t.ndim == 0 else t for t in tensors]
    if any(t.ndim != 1 for t in ts):
        raise ShapeError(f"meshgrid: expects 0-d or 1-d tensors, got shapes {[tuple(t.shape) for t in tensors]}")
    if indexing not in ("ij", "xy"):
        raise ShapeError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    order = list(range(len(ts)))
    if indexing == "xy" and len(ts) >= 2:
        order[0], order[1] = 1, 0
    shape = tuple(ts[i].shape[0] for i in order)
    grids = []
    for k, t in enumerate(ts):
        at = order.index(k)
        view = [1] * len(ts)
        view[at] = t.shape[0]
        grids.append(t.reshape(tuple(view)).expand(shape))
    return tuple(grids)


@op("select")
def _select(x: Tensor, dim: int, index: int) -> Tensor:
    d = _norm_dim(x, dim)
    return x[(slice(None),) * d + (int(index),)]


@op("index_select")
def _index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    if x.ndim == 0:  # torch: dim 0 or -1, one index (0-d or 1 element), a 0-d result
        if len(index.shape) > 1 or math.prod(index.shape) != 1 or dim not in (0, -1):
            raise ShapeError(f"index_select of a 0-d tensor takes dim 0 and one index, got dim {dim}, "
                             f"index shape {tuple(index.shape)}")
        return F.gather(x.reshape((1,)), index.reshape((1,))).reshape(())
    index = index if index.shape else index.reshape((1,))  # a 0-d index keeps the dim (length 1)
    d = _norm_dim(x, dim)
    if d == 0:
        return F.gather(x, index)
    order = [d] + [i for i in range(x.ndim) if i != d]
    y = F.gather(x.permute(order), index)  # (len(index), rest...)
    back = list(range(1, d + 1)) + [0] + list(range(d + 1, x.ndim))
    return y.permute(back)


@op("index", "_unsafe_index")
def _index(x: Tensor, indices: Any) -> Tensor:
    """ATen's ``index``: one entry per leading dim, an index tensor or None (the whole dim)."""
    return R.advanced_index(x, list(indices))




@op("index_put", "index_put_", "_unsafe_index_put")
def _index_put(x: Tensor, indices: Any, values: Any, accumulate: bool = False) -> Tensor:
    return R.index_put(x, list(indices), values, bool(accumulate))


@op("getitem")
def _getitem(x: Any, index: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return x[index]  # None for results only the backward reads (logsumexp, mean, rstd)
    if isinstance(index, Tensor) and index.dtype == "bool":  # fx records x[mask] as getitem(x, mask)
        raise data_dependent("boolean-mask indexing x[mask]")
    if isinstance(index, tuple) and any(isinstance(i, Tensor) for i in index):
        return R.getitem_with_tensors(x, index)
    return x[index]


def _triangle(upper: bool) -> Callable[..., Tensor]:
    def f(x: Tensor, diagonal: int = 0) -> Tensor:
        if x.ndim < 2:
            raise ShapeError(f"{'triu' if upper else 'tril'} of a tensor of rank {x.ndim}")
        rel = ">=" if upper else "<="
        keep = F.fill(x.shape[-2:], f"x1 {rel} x0 + {int(diagonal)}", "bool")
        zero: Any = False if x.dtype == "bool" else 0
        return F.where(keep, x, zero)
    return f


LAYOUT_OPS["tril"] = _triangle(False)
LAYOUT_OPS["triu"] = _triangle(True)
