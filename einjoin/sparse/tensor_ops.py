"""The Tensor API on an eager :class:`~einjoin.sparse.tensor.SparseTensor` (issue 24): reductions,
elementwise ops and arithmetic, each equal to the same numpy program on the densified tensor
(a missing entry is 0), in numpy's result dtype.

What comes back:

- an op with ``f(0) == 0`` (``neg``, ``abs``, ``relu``, ``sqrt``, ``square``, ``sin``, ``tanh``,
  ``erf``, ``t * finite scalar``, ``t / finite non-zero scalar``) is applied to the stored values
  and gives a SparseTensor on the same entries; any other (``exp``, ``cos``, ``t + scalar``, ``t / 0``)
  gives the dense ``np.ndarray``;
- ``t + u`` / ``t - u`` of two sparse tensors of one shape: a SparseTensor on the union of their
  entries (co-present ones summed); ``t * u``: on the entries both store; with a dense array,
  ``+`` / ``-`` / ``/`` are dense and ``*`` sparse (dense if the array has an inf or nan: 0 * inf);
- a reduction (``sum``, ``max``, ``min``, ``mean``) over some dims: a SparseTensor (an output entry
  wherever a stored entry falls in its group; ``max`` / ``min`` of a group with a missing entry
  count that 0); over every dim: a dense ``np.ndarray`` (0-d, or all-ones with ``keepdim``).

>>> import numpy as np, einjoin as ej
>>> a = ej.sparse("A", np.array([[0., -2.], [3., 0.]]))
>>> a.sum(1).todense().tolist(), a.max(1).todense().tolist(), float(a.sum())
([-2.0, 3.0], [0.0, 3.0], 1.0)
>>> (a.relu() * 2).todense().tolist(), ej.abs(a).nnz
([[0.0, 0.0], [6.0, 0.0]], 2)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError, ShapeError, UnsupportedOpError
from einjoin.sparse.tensor import TENSOR_OPS, SparseTensor, is_float, key_codes, unique_rows

__all__ = ["OPS", "apply", "unary", "reduce", "add", "mul", "truediv", "power"]


def _erf(v: np.ndarray) -> np.ndarray:
    import scipy.special
    out: np.ndarray = scipy.special.erf(v)
    return out


# f(0) == 0: applied to the stored values (the padded zeros of a block stay 0)
KEEPS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative, "abs": np.abs, "relu": lambda v: np.maximum(v, 0), "sqrt": np.sqrt,
    "square": np.square, "sin": np.sin, "tanh": np.tanh, "erf": _erf,
}
# f(0) != 0 (or undefined): the densified tensor's values
DENSE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp, "cos": np.cos, "log": np.log, "reciprocal": lambda v: 1 / v,
    "rsqrt": lambda v: 1 / np.sqrt(v), "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    "logical_not": np.logical_not,
}


def _with_values(t: SparseTensor, f: Callable[[np.ndarray], np.ndarray], name: str) -> SparseTensor:
    out = SparseTensor(f"{t.name}.{name}", t.shape, t.block, t.keys, np.asarray(f(t.data)), trusted=True)
    coo = t._coo  # the stored entries (explicit zeros of a blocked tensor too) stay the stored ones
    if coo is not None and any(b != 1 for b in t.block):
        out._coo = (coo[0], np.asarray(f(coo[1])))
    return out


def unary(t: SparseTensor, name: str) -> SparseTensor | np.ndarray:
    """``name`` (a key of KEEPS or DENSE) elementwise: sparse where f(0) == 0, else dense."""
    keep = KEEPS.get(name)
    if keep is not None:
        return _with_values(t, keep, name)
    dense = DENSE.get(name)
    if dense is None:
        raise UnsupportedOpError(f"{name} on sparse tensor {t.name!r} {t.shape}: not defined on a sparse "
                                 f"tensor (elementwise: {sorted(KEEPS) + sorted(DENSE)}); use .todense()")
    return dense(t.todense())


def _scalar(x: Any) -> bool:
    return isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.ndarray)


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(complex(x).real) and math.isfinite(complex(x).imag)
    except (TypeError, ValueError, OverflowError):
        return False


def _same_shape(t: SparseTensor, u: SparseTensor, op: str) -> None:
    if tuple(t.shape) != tuple(u.shape):
        raise ShapeError(f"{op}: sparse tensors {t.name!r} {t.shape} and {u.name!r} {u.shape} differ in shape "
                         f"(two sparse tensors combine at one shape; broadcast with ej.einsum)")


def _grouped(coords: np.ndarray, vals: np.ndarray, grid: list[int] | tuple[int, ...]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each group's row, sorted row-major; the values in group order; each group's first
    position) of entries grouped by their ``coords`` rows: one stable sort of their codes, none
    when they come sorted (a block-1 tensor's entries, grouped by its leading dims)."""
    n = len(vals)
    if coords.shape[1] == 0 or n == 0:
        return (np.zeros((min(n, 1), coords.shape[1]), np.int64), vals, np.zeros(min(n, 1), np.int64))
    code = key_codes(coords, grid)
    if code is None:  # a grid too large for one code: rows
        uniq, inv = unique_rows(coords, grid)
        order = np.argsort(inv, kind="stable")
        return uniq, vals[order], np.searchsorted(inv[order], np.arange(len(uniq)))
    if n > 1 and not bool((code[1:] >= code[:-1]).all()):
        order = np.argsort(code, kind="stable")  # timsort: two sorted runs (t + u) merge in O(n)
        code, vals = code[order], vals[order]
    starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
    return np.stack(np.unravel_index(code[starts], tuple(grid)), axis=1).astype(np.int64), vals, starts


def _summed(name: str, shape: tuple[int, ...], coords: np.ndarray, vals: np.ndarray) -> SparseTensor:
    """A block-1 tensor of the entries (coords, vals), those at one coordinate summed."""
    keys, vals, starts = _grouped(coords, vals, shape)
    if len(starts) != len(vals):  # in the values' dtype (reduceat widens small ints)
        vals = np.add.reduceat(vals, starts, dtype=vals.dtype if vals.dtype.kind in "iu" else None)
    return SparseTensor(name, shape, (1,) * len(shape), keys, vals.reshape((-1,) + (1,) * len(shape)),
                        trusted=True)


def _dense(t: SparseTensor, op: str, other: Any, f: Callable[[np.ndarray], Any]) -> np.ndarray:
    """``f`` of the densified tensor, numpy's broadcasting refusal an EinjoinError naming both."""
    try:
        return np.asarray(f(t.todense()))
    except ValueError as e:
        raise ShapeError(f"{op} of sparse tensor {t.name!r} {t.shape} and {type(other).__name__} of shape "
                         f"{np.shape(other) if not isinstance(other, SparseTensor) else other.shape}: {e}") from None


def add(t: SparseTensor, other: Any, sign: int = 1, reflected: bool = False) -> SparseTensor | np.ndarray:
    """``t + other`` (``sign=-1``: ``t - other``; ``reflected``: ``other - t``). Two sparse tensors:
    the union of their entries, co-present ones summed; anything else: the dense sum."""
    if isinstance(other, SparseTensor):
        _same_shape(t, other, "add" if sign > 0 else "sub")
        dt = np.result_type(t.dtype, other.dtype)
        (ct, vt), (cu, vu) = t.coo(), other.coo()
        vt, vu = vt.astype(dt, copy=False), vu.astype(dt, copy=False)
        if sign < 0:
            vu = np.negative(vu)
        return _summed(f"{t.name}{'+' if sign > 0 else '-'}{other.name}", tuple(t.shape),
                       np.concatenate([ct, cu]), np.concatenate([vt, vu]))
    op = "add" if sign > 0 else "sub"
    if reflected:
        return _dense(t, op, other, lambda d: other - d if sign < 0 else other + d)
    return _dense(t, op, other, lambda d: d - other if sign < 0 else d + other)


def mul(t: SparseTensor, other: Any) -> SparseTensor | np.ndarray:
    """``t * other``: sparse on the entries both store (another sparse tensor), on ``t``'s entries
    (a finite scalar, an array of finite values broadcasting to ``t``'s shape), else dense."""
    if isinstance(other, SparseTensor):
        _same_shape(t, other, "mul")
        shape = tuple(t.shape)
        (ka, va, _), (kb, vb, _) = (_grouped(*x.coo(), shape) for x in (t, other))  # sorted, unique
        if t.ndim == 0:
            ia = ib = np.arange(min(len(ka), len(kb)))
        else:
            ca, cb = key_codes(ka, shape), key_codes(kb, shape)
            if ca is None or cb is None:  # a shape too large for one code: ranks of both's rows
                _, inv = unique_rows(np.concatenate([ka, kb]), shape)
                ca, cb = inv[:len(ka)], inv[len(ka):]
            pos = np.minimum(np.searchsorted(cb, ca), max(len(cb) - 1, 0))  # both sorted: a merge
            ia = np.flatnonzero(cb[pos] == ca) if len(cb) else np.zeros(0, np.int64)
            ib = pos[ia]
        return _summed(f"{t.name}*{other.name}", shape, ka[ia], va[ia] * vb[ib])
    if _scalar(other):
        if _finite(other):
            return _with_values(t, lambda v: v * other, "mul")
        return np.asarray(t.todense() * other)
    arr = np.asarray(other)
    try:
        fits = np.broadcast_shapes(arr.shape, tuple(t.shape)) == tuple(t.shape)
    except ValueError:
        fits = False
    if not fits or (arr.dtype.kind in "fc" and not np.isfinite(arr).all()):
        return _dense(t, "mul", arr, lambda d: d * arr)  # 0 * inf is nan
    coords, vals = t.coo()
    picked = np.broadcast_to(arr, tuple(t.shape))[tuple(coords.T)]
    return _summed(f"{t.name}*", tuple(t.shape), coords, vals * picked)


def truediv(t: SparseTensor, other: Any, reflected: bool = False) -> SparseTensor | np.ndarray:
    """``t / other``: sparse for a finite non-zero scalar, else dense (``0 / 0`` is nan)."""
    if reflected:
        return _dense(t, "div", other, lambda d: other / d)
    if _scalar(other) and _finite(other) and other != 0:
        return _with_values(t, lambda v: v / other, "div")
    den = other.todense() if isinstance(other, SparseTensor) else other
    return _dense(t, "div", other, lambda d: d / den)


def power(t: SparseTensor, p: Any, reflected: bool = False) -> SparseTensor | np.ndarray:
    """``t ** p``: sparse for a finite scalar ``p > 0`` (``0 ** p == 0``), else dense (``p ** t`` too)."""
    try:
        if reflected:
            return np.asarray(p ** t.todense())
        if _scalar(p) and not isinstance(p, complex) and _finite(p) and p > 0:
            return _with_values(t, lambda v: v ** p, "pow")
        return np.asarray(t.todense() ** p)
    except ValueError as e:  # numpy's "Integers to negative integer powers are not allowed" (torch refuses too)
        raise EinjoinError(f"pow of sparse tensor {t.name!r} {t.shape} ({t.dtype}) and {p!r:.40}: {e} "
                           f"(cast to a float dtype first)") from None


def _dims(t: SparseTensor, dim: Any, op: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(t.ndim))
    raw = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    out = []
    for d in raw:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or not -t.ndim <= d < max(t.ndim, 1):
            raise ShapeError(f"{op}: dim {d!r} out of range for sparse tensor {t.name!r} of shape {t.shape}")
        out.append(int(d) % max(t.ndim, 1))
    if len(set(out)) != len(out):
        raise ShapeError(f"{op}: repeated dimension in {raw} for sparse tensor {t.name!r} of shape {t.shape}")
    return tuple(sorted(out))


def reduce(t: SparseTensor, agg: str, dim: Any = None, keepdim: bool = False) -> SparseTensor | np.ndarray:
    """``agg`` (sum, max, min, mean, prod) over ``dim`` (None: every dim) of the densified tensor."""
    dims = _dims(t, dim, agg)
    shape = tuple(t.shape)
    kept = [d for d in range(t.ndim) if d not in dims]
    n = math.prod(shape[d] for d in dims)
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(shape)) if keepdim else \
        tuple(shape[d] for d in kept)
    probe = np.zeros(1, t.dtype)
    dt = {"sum": probe.sum().dtype, "mean": probe.mean().dtype, "prod": probe.prod().dtype}.get(agg, t.dtype)
    if n == 0:
        if agg in ("max", "min") and 0 not in out_shape:
            raise ShapeError(f"{agg} over dims {dims} of sparse tensor {t.name!r} {shape}: a zero-size "
                             f"reduction has no identity (as numpy's)")
        fill = {"mean": np.nan, "prod": 1}.get(agg, 0)
        return np.full(out_shape, fill, dt)
    coords, vals = t.coo()
    grid = [shape[d] for d in kept]
    if agg in ("sum", "mean") and kept and is_float(dt) and 0 < math.prod(grid) <= 4 * len(vals):
        # a float sum onto few groups: counted by code, no sort (float64 accumulation)
        code = key_codes(coords[:, kept], grid)
        assert code is not None
        hit = np.flatnonzero(np.bincount(code, minlength=math.prod(grid)))
        tot = np.bincount(code, weights=vals.astype(np.float64), minlength=math.prod(grid))[hit]
        uniq = np.stack(np.unravel_index(hit, tuple(grid)), axis=1).astype(np.int64)
        return _reduced(t, agg, dims, out_shape, keepdim, uniq, (tot / n if agg == "mean" else tot).astype(dt))
    uniq, vals, starts = _grouped(coords[:, kept], vals, grid)
    if not len(vals):
        res = np.zeros(0, dt)
    elif agg in ("sum", "mean"):
        acc = np.float64 if agg == "mean" and dt.kind != "c" else dt
        res = np.add.reduceat(vals.astype(acc), starts)
        res = (res / n).astype(dt) if agg == "mean" else res.astype(dt, copy=False)
    elif agg == "prod":  # a group with a missing entry: 0, or nan where it holds an inf or nan (0 * inf)
        res = np.multiply.reduceat(vals.astype(dt, copy=False), starts)
        partial = np.diff(np.r_[starts, len(vals)]) < n
        if dt.kind in "fc":
            bad = np.logical_or.reduceat(~np.isfinite(vals), starts)
            res = np.where(partial, np.where(bad, np.nan, 0), res).astype(dt)
        else:
            res = np.where(partial, 0, res).astype(dt)
    else:
        res = (np.maximum if agg == "max" else np.minimum).reduceat(vals, starts)
        partial = np.diff(np.r_[starts, len(vals)]) < n  # a missing entry is a 0 in the group
        res = np.where(partial, (np.maximum if agg == "max" else np.minimum)(res, 0), res).astype(dt)
    return _reduced(t, agg, dims, out_shape, keepdim, uniq, res)


def _reduced(t: SparseTensor, agg: str, dims: tuple[int, ...], out_shape: tuple[int, ...], keepdim: bool,
             uniq: np.ndarray, res: np.ndarray) -> SparseTensor | np.ndarray:
    """A reduction's result from its groups' rows (over the kept dims) and values."""
    kept = [d for d in range(t.ndim) if d not in dims]
    if not kept:  # every dim reduced: a dense value
        return np.full(out_shape, res[0] if len(res) else 0, res.dtype)
    keys = np.zeros((len(uniq), len(out_shape)), np.int64)
    keys[:, kept if keepdim else list(range(len(kept)))] = uniq
    return SparseTensor(f"{t.name}.{agg}", out_shape, (1,) * len(out_shape), keys,
                        res.reshape((-1,) + (1,) * len(out_shape)), trusted=True)


def _elementwise(name: str) -> Callable[[SparseTensor], Any]:
    def f(t: SparseTensor) -> Any:
        return unary(t, name)
    return f


def _reduction(agg: str) -> Callable[..., Any]:
    def f(t: SparseTensor, dim: Any = None, keepdim: bool = False) -> Any:
        return reduce(t, agg, dim, keepdim)
    return f


# the ops the frontend's functional forms ask of a sparse tensor (ej.sum(t, 1), ej.relu(t), ...),
# through SparseTensor.__einjoin_op__: one table, no type tests in the frontend
OPS: dict[str, Callable[..., Any]] = {
    **{agg: _reduction(agg) for agg in ("sum", "max", "min", "mean", "prod")},
    **{name: _elementwise(name) for name in (*KEEPS, *DENSE)},
}


def apply(t: SparseTensor, op: str, *args: Any, **kwargs: Any) -> Any:
    """The functional form ``op`` (a key of OPS) on ``t``, or an UnsupportedOpError naming it."""
    fn = OPS.get(op)
    if fn is None:
        raise UnsupportedOpError(f"{op} on sparse tensor {t.name!r} {t.shape}: not defined on a sparse tensor "
                                 f"(defined: {', '.join(sorted(OPS))}); use .todense() for the dense array")
    try:
        return fn(t, *args, **kwargs)
    except TypeError as e:
        raise EinjoinError(f"{op} on sparse tensor {t.name!r}: {e}") from None


TENSOR_OPS.update(apply=apply, add=add, mul=mul, truediv=truediv, power=power)
