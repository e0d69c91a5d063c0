"""Integer translations of the torch importer (issue 39): bitwise and / or / xor / not, shifts,
``fmod``, ``div(rounding_mode="trunc")``, the logical ops on any dtype, and the scans ``cummax``
/ ``cummin``: :data:`BITS_OPS`, merged into :data:`einjoin.frontend.aten.OPS` (after the table's
older bool-only spellings, which it replaces). Each is one join of an IR scalar function
(``bitand``, ``lshift``, ``fmod``, ``truncdiv``, ... in :mod:`einjoin.ir.scalar`, torch's
numerics) under torch's type promotion, or, for the scans, EinSums over the mask ``j <= i``.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (3,), "int32")
>>> ej.reference(BITS_OPS["bitwise_xor"](x, 6), x=np.array([1, 2, 3], np.int32)).tolist()
[7, 4, 5]
>>> ej.reference(BITS_OPS["cummax"](ej.input("y", (4,)), 0)[1], y=np.array([1, 3, 3, 2], np.float32)).tolist()
[0, 1, 2, 2]
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, UnsupportedOpError
from einjoin.frontend.functions import fill
from einjoin.frontend.routing import elementwise_expr
from einjoin.frontend.tensor import LETTERS, Tensor, _norm_dim, einsum, elementwise
from einjoin.ir.dtypes import kind, numpy_dtype
from einjoin.registry import registrar

__all__ = ["BITS_OPS"]

BITS_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(BITS_OPS)

# torch.cummax returns a named tuple: fx code may read .values / .indices
ScanResult = namedtuple("ScanResult", ["values", "indices"])


def _is_t(v: Any) -> bool:
    return isinstance(v, Tensor)


def _no_floats(what: str, *args: Any) -> None:
    """torch's bitwise ops and shifts take integers and bools only (a float is refused there too)."""
    for a in args:
        dt = a.dtype if _is_t(a) else ("float" if isinstance(a, float) else None)
        if dt is not None and kind(dt) == "float":
            raise DTypeError(f"{what}: a {dt} operand; torch's {what} takes integer or bool tensors only")


def _bitwise(fn: str, py: Callable[[Any, Any], Any], what: str) -> Callable[..., Any]:
    def f(a: Any, b: Any) -> Any:
        if not _is_t(a) and not _is_t(b):
            return py(a, b)  # shape arithmetic in fx graphs
        _no_floats(what, a, b)
        return elementwise(fn, a, b, name=what)
    return f


for _names, _fn, _py in ((("bitwise_and", "__and__", "and_", "__iand__", "bitwise_and_"), "bitand", lambda a, b: a & b),
                         (("bitwise_or", "__or__", "or_", "__ior__", "bitwise_or_"), "bitor", lambda a, b: a | b),
                         (("bitwise_xor", "__xor__", "xor", "__ixor__", "bitwise_xor_"), "bitxor",
                          lambda a, b: a ^ b)):
    _f = _bitwise(_fn, _py, _names[0])  # one translation under every name (one op-table group)
    for _n in _names:
        BITS_OPS[_n] = _f


def _shift(fn: str, py: Callable[[Any, Any], Any], what: str) -> Callable[..., Any]:
    def f(a: Any, b: Any) -> Any:
        if not _is_t(a) and not _is_t(b):
            return py(a, b)
        _no_floats(what, a, b)
        a, b = _unbool(what, a, b)  # a bool beside a non-bool promoted as torch; two refused
        return elementwise(fn, a, b, name=what)
    return f


for _names, _fn, _py in ((("bitwise_left_shift", "__lshift__", "lshift", "__ilshift__", "bitwise_left_shift_"),
                          "lshift", lambda a, b: a << b),
                         (("bitwise_right_shift", "__rshift__", "rshift", "__irshift__", "bitwise_right_shift_"),
                          "rshift", lambda a, b: a >> b)):
    _f = _shift(_fn, _py, _names[0])
    for _n in _names:
        BITS_OPS[_n] = _f


@op("bitwise_not", "__invert__", "invert", "bitwise_not_")
def _bitwise_not(x: Any) -> Any:
    if not _is_t(x):
        return ~x
    _no_floats("bitwise_not", x)
    return elementwise("bitnot", x, name="bitwise_not")


# ---------------------------------------------------------------- logical ops of any dtype


def _truth(v: Any) -> Any:
    """torch's truth of a value: nonzero (NaN is true), as ``.to(torch.bool)``."""
    return v.to("bool") if _is_t(v) else bool(v)


def _logical(fn: str) -> Callable[..., Tensor]:
    def f(a: Any, b: Any) -> Tensor:
        return elementwise(fn, _truth(a), _truth(b))
    return f


BITS_OPS["logical_and"] = _logical("logical_and")
BITS_OPS["logical_or"] = _logical("logical_or")


@op("logical_xor")
def _logical_xor(a: Any, b: Any) -> Tensor:
    return elementwise("ne", _truth(a), _truth(b))


@op("logical_not")
def _logical_not(x: Tensor) -> Tensor:
    return elementwise("logical_not", _truth(x))


# ---------------------------------------------------------------- fmod, truncating division


@op("fmod", "fmod_")
def _fmod(a: Any, b: Any) -> Any:
    if not _is_t(a) and not _is_t(b):
        return float(np.fmod(a, b))
    a, b = _unbool("fmod", a, b)
    return elementwise("fmod", a, b, name="fmod")


def _unbool(what: str, a: Any, b: Any) -> tuple[Any, Any]:
    """torch's promotion of a bool tensor with a non-bool operand: the bool cast to the other
    tensor's dtype (int8 with int8), or to int64 beside a Python number (then the number's
    promotion: float32 with a float); two bools are refused, as torch's kernels refuse them."""
    def is_bool(v: Any) -> bool:
        return (_is_t(v) and v.dtype == "bool") or isinstance(v, bool)
    if is_bool(a) and is_bool(b):
        raise DTypeError(f"{what}: bool operands; torch's {what} is not implemented for bool")

    def cast(v: Any, other: Any) -> Any:
        if _is_t(v) and v.dtype == "bool":
            return v.to(other.dtype if _is_t(other) else "int64")
        return v
    return cast(a, b), cast(b, a)


def trunc_div(a: Any, b: Any) -> Any:
    """``torch.div(a, b, rounding_mode="trunc")``: the quotient rounded toward zero, in the
    operands' promoted dtype (integers exactly; an integer divisor of 0 is an error, as torch)."""
    if not _is_t(a) and not _is_t(b):
        return int(a / b) if isinstance(a, int) and isinstance(b, int) else float(np.trunc(a / b))
    a, b = _unbool("div(rounding_mode='trunc')", a, b)
    q = elementwise("truncdiv", a, b, name="div")
    if q.dtype in _HALF:  # torch rounds the quotient to the half dtype, then truncates it
        return elementwise("truncdiv", elementwise("div", a, b), 1, name="div")
    return q


_HALF = ("float16", "bfloat16")


def floor_div(a: Any, b: Any) -> Any:
    """``a // b`` and ``torch.div(a, b, rounding_mode="floor")``; for float16 / bfloat16 every step
    of torch's algorithm (``mod = fmod(a, b)``, ``div = (a - mod) / b``, minus 1 where ``mod``'s
    sign is not ``b``'s, its floor rounded to nearest) rounded to the half dtype, as torch's
    kernel: one rounding at the end (numpy's) gave another integer for 5% of bfloat16 pairs."""
    q = elementwise("floordiv", a, b)
    if q.dtype not in _HALF:
        return q
    a, b = (x if not _is_t(x) or x.dtype == q.dtype else x.to(q.dtype) for x in (a, b))
    if not _is_t(b):  # (the joins below read b as a tensor)
        b = fill(a.shape, b, q.dtype)
    mod = elementwise("fmod", a, b)
    div = elementwise("div", elementwise("sub", a, mod), b)
    div = elementwise_expr("where((x1 != 0) & ((x2 < 0) != (x1 < 0)), x0 - 1, x0)", div, mod, b)
    if not _is_t(a):
        a = fill(b.shape, a, q.dtype)
    fl = "where(abs(x0) == inf, x0, x0 // 1)"  # floor (numpy's -inf // 1 is nan)
    return elementwise_expr(f"where(x2 == 0, x3 / x2, where(x0 == 0, x3 / x2 * 0.0, where("
                            f"x0 - {fl} > 0.5, {fl} + 1, {fl})))", div, mod, b, a)


# ---------------------------------------------------------------- cummax / cummin


def _extreme_value(dtype: str, low: bool) -> Any:
    """The identity of a max (``low``) or min scan over ``dtype``: -inf / +inf, the integer
    dtype's bounds, False / True."""
    if dtype == "bool":
        return not low
    if kind(dtype) == "float":
        return "-inf" if low else "inf"
    info = np.iinfo(numpy_dtype(dtype))
    return int(info.min) if low else int(info.max)


def _cum_extreme(x: Tensor, dim: int, is_max: bool, what: str) -> ScanResult:
    """torch's cummax / cummin: ``values[i]`` the running extremum of ``x[:i + 1]`` along ``dim``,
    ``indices[i]`` the last position ``j <= i`` holding it (torch updates on ``>=`` / ``<=``); a
    NaN is the extremum from where it appears, its index the last NaN's. Three EinSums over the
    mask ``j <= i``: the running extremum, its index, and the values picked at the indices (so a
    tie of -0.0 and 0.0 gives the element torch's index names)."""
    if not _is_t(x):
        raise UnsupportedOpError(f"{what} of a {type(x).__name__}")
    if x.ndim == 0:
        return ScanResult(x, fill((), "0", "int64"))
    d = _norm_dim(x, dim)
    if x.ndim >= len(LETTERS):
        raise UnsupportedOpError(f"{what}: rank {x.ndim} is above the supported 25")
    n = x.shape[d]
    if n == 0:  # nothing to scan: torch's empty values and indices (the max below has no value)
        return ScanResult(x, fill(tuple(x.shape), "0", "int64"))
    ls = LETTERS[:x.ndim]
    i = LETTERS[x.ndim]
    out = ls[:d] + i + ls[d + 1:]
    agg = "max" if is_max else "min"
    unit = _extreme_value(x.dtype, is_max)
    mask = fill((n, n), "x1 <= x0", "bool")  # (i, j): j is at or before i
    run = einsum(f"{ls},{i}{ls[d]}->{out}", x, mask, join=f"where(x1, x0, {unit})", agg=agg)
    nan = "((x0 != x0) & (x1 != x1))" if kind(x.dtype) == "float" else "False"
    iota = fill((n,), "x0", "int64")
    idx = einsum(f"{ls},{out},{i}{ls[d]},{ls[d]}->{out}", x, run, mask, iota,
                 join=f"where(x2 & ((x0 == x1) | {nan}), x3, -1)", agg="max")
    values = einsum(f"{ls},{out},{ls[d]}->{out}", x, idx, iota, join=f"where(x1 == x2, x0, {unit})", agg=agg)
    return ScanResult(values, idx)


@op("cummax")
def _cummax(x: Tensor, dim: int) -> ScanResult:
    return _cum_extreme(x, dim, True, "cummax")


@op("cummin")
def _cummin(x: Tensor, dim: int) -> ScanResult:
    return _cum_extreme(x, dim, False, "cummin")
