"""Element types: names, numpy types, sizes, kinds and promotion.

A dtype is named by a short string (``"float32"``, ``"bfloat16"``, ``"int32"``, ``"bool"``);
the integer types are torch's: int8, int16, int32, int64 and uint8 (torch 2.13 has no promotion
nor arithmetic for uint16/32/64, so those are refused);
bfloat16 comes from ``ml_dtypes`` so numpy can hold it; that import costs a second or two
(it registers its ufunc loops with numpy), so it is made on first use of bfloat16's numpy dtype,
not when einjoin is imported.

>>> from einjoin.ir.dtypes import canonical_dtype, promote
>>> canonical_dtype("f32"), promote("float16", "float32")
('float32', 'float32')
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from einjoin.errors import DTypeError

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "canonical_dtype",
    "numpy_dtype",
    "itemsize",
    "kind",
    "promote",
    "compute_dtype",
    "exact_cast",
    "is_bfloat16",
    "is_half",
    "INT_DTYPES",
    "wrap_int",
    "cast_array",
]

class _DTypeTable(Mapping[str, np.dtype]):
    """name -> numpy dtype, a read-only mapping whose bfloat16 entry imports ``ml_dtypes`` when
    it is first looked up (names, membership, sizes and kinds need no import)."""

    def __init__(self, eager: dict[str, np.dtype | None]):
        self._d = eager

    def __getitem__(self, name: str) -> np.dtype:
        d = self._d[name]
        if d is None:
            import ml_dtypes  # ~1-2 s the first time: only a program that uses bfloat16 pays it
            d = self._d[name] = np.dtype(ml_dtypes.bfloat16)
        return d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, name: object) -> bool:
        return name in self._d

    def __repr__(self) -> str:
        return f"DTYPES({', '.join(self._d)})"


# name -> numpy dtype. The order within a kind is promotion order.
DTYPES: Mapping[str, np.dtype] = _DTypeTable({
    "float16": np.dtype(np.float16),
    "bfloat16": None,  # np.dtype(ml_dtypes.bfloat16), on first lookup
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
})
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8")
# torch's unsigned types past uint8: torch 2.13 neither promotes them nor adds them on CPU
# ("add_stub" not implemented for 'UInt16'), so there is no torch result to be exact to
_REFUSED = {"uint16", "uint32", "uint64"}

_ALIASES = {
    "f16": "float16", "half": "float16", "bf16": "bfloat16", "f32": "float32",
    "float": "float32", "f64": "float64", "double": "float64", "i64": "int64",
    "long": "int64", "bool_": "bool", "i32": "int32", "i16": "int16", "short": "int16",
    "i8": "int8", "u8": "uint8", "byte": "uint8",
}
_KIND = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "float",
         "int64": "int", "int32": "int", "int16": "int", "int8": "int", "uint8": "int", "bool": "bool"}
_RANK = {"float16": 0, "bfloat16": 0, "float32": 1, "float64": 2}
# integers: (value bits, signed); two integer types promote to the narrowest signed type that
# holds both (torch's table: int8 with uint8 -> int16, uint8 with int32 -> int32)
_INT_BITS = {"int8": (8, True), "int16": (16, True), "int32": (32, True), "int64": (64, True),
             "uint8": (8, False)}


def canonical_dtype(dtype: Any) -> str:
    """The canonical name of ``dtype`` (a name, alias, numpy dtype or type, or torch dtype).
    A value (a numpy scalar or array, a tensor), bytes or a container is a DTypeError, not a
    dtype numpy would make of it."""
    if dtype is None:
        raise DTypeError(f"dtype None; give one of {', '.join(DTYPES)}")
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
        if name in DTYPES:
            return name
        if name in _REFUSED:
            raise DTypeError(_refused(name))
        raise DTypeError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if isinstance(dtype, (bytes, bytearray, list, tuple, dict, set)):
        # numpy would read b"a" as a deprecated alias, a list or tuple as a structured dtype
        raise DTypeError(f"unknown dtype {dtype!r:.60}; give a str name: {', '.join(DTYPES)}")
    if isinstance(dtype, (np.generic, np.ndarray)) or (
            hasattr(dtype, "dtype") and not isinstance(dtype, (type, np.dtype))):
        # a value, not a type: np.dtype(np.float32(0.5)) would quietly take the value's type
        raise DTypeError(f"dtype: got a value ({type(dtype).__name__} {dtype!r:.60}), not a dtype; "
                         f"give a name ({', '.join(DTYPES)}), a numpy or torch dtype, or the "
                         f"value's .dtype")
    text = str(dtype)
    if text.startswith("torch."):
        return canonical_dtype(text[len("torch."):])
    try:
        npd = np.dtype(dtype)
    except (TypeError, ValueError):  # ValueError: an object whose .dtype is not a numpy dtype
        raise DTypeError(f"unknown dtype {dtype!r:.80}; known: {', '.join(DTYPES)}") from None
    for name in DTYPES:
        if name != "bfloat16" and DTYPES[name] == npd:
            return name
    if is_bfloat16(npd):
        return "bfloat16"
    if npd.kind in "iu":
        raise DTypeError(_refused(str(npd)))
    raise DTypeError(f"dtype {npd} is not supported; known: {', '.join(DTYPES)}")


def _refused(name: str) -> str:
    return (f"dtype {name} is not supported: torch 2.13 has no arithmetic nor promotion for it, so "
            f"einjoin has no result to match; integers are {', '.join(INT_DTYPES)} (cast to int64 "
            f"first, exact for uint16/uint32)")


def numpy_dtype(dtype: str) -> np.dtype:
    return DTYPES[canonical_dtype(dtype)]


def itemsize(dtype: str) -> int:
    """Bytes per element."""
    return _ITEMSIZE[dtype]


def kind(dtype: str) -> str:
    """``"float"``, ``"int"`` or ``"bool"``."""
    return _KIND[dtype]


def promote(a: str, b: str) -> str:
    """The common dtype of two dtypes of one kind, as torch's ``promote_types``: float16 with
    bfloat16 gives float32, int8 with uint8 int16, a narrower integer the wider one.

    >>> promote("int8", "uint8"), promote("uint8", "int32"), promote("int16", "int64")
    ('int16', 'int32', 'int64')
    """
    if a == b:
        return a
    if _KIND[a] != _KIND[b]:
        raise DTypeError(f"cannot mix {a} and {b}; cast one of them first")
    if _KIND[a] == "int":
        (ba, sa), (bb, sb) = _INT_BITS[a], _INT_BITS[b]
        if sa == sb or (sa and ba > bb) or (sb and bb > ba):
            return a if ba >= bb else b
        return {8: "int16", 16: "int32", 32: "int64", 64: "int64"}[max(ba, bb)]  # uint8 with int8
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    return a if _RANK[a] >= _RANK[b] else b


def wrap_int(v: int, dtype: str) -> int:
    """Python int ``v`` as integer dtype ``dtype`` holds it (two's complement, as torch converts a
    Python number meeting a narrow tensor: ``int8 tensor + 1000`` adds -24).

    >>> wrap_int(1000, "int8"), wrap_int(-1, "uint8"), wrap_int(5, "int32")
    (-24, 255, 5)
    """
    bits, signed = _INT_BITS[dtype]
    v %= 1 << bits
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def cast_array(a: Any, dtype: str, copy: bool = True) -> np.ndarray:
    """numpy array ``a`` in einjoin dtype ``dtype`` as torch converts: floats into an integer type
    truncate into int32 (int8, int16, int32) or int64 (uint8, int64) first, a value out of that
    range, inf or nan giving its minimum (torch's CPU conversion), and then wrap (numpy's direct
    float -> int8 cast is C's undefined behaviour: 300.7 may give 44 or -128 by platform, and
    ml_dtypes' bfloat16 -> int8 gives 0); otherwise numpy's ``astype`` (integers wrap in two's
    complement, as torch's); ``copy`` as ``astype``'s.

    >>> cast_array(np.array([300.7, -1.5]), "int8"), cast_array(np.array([-1]), "uint8")
    (array([44, -1], dtype=int8), array([255], dtype=uint8))
    >>> cast_array(np.array([3e9, np.nan, 65541.0]), "int32"), cast_array(np.array([3e9]), "int16")
    (array([-2147483648, -2147483648,       65541], dtype=int32), array([0], dtype=int16))
    """
    a = np.asarray(a)
    npd = DTYPES[dtype]
    if npd.kind in "iu" and (a.dtype.kind == "f" or is_bfloat16(a.dtype)):
        via = np.dtype(np.int64 if npd.itemsize == 8 or npd.kind == "u" else np.int32)
        f = a.astype(np.float64)  # every float dtype exactly
        lo = float(np.iinfo(via).min)
        a = np.where((f > lo - 1) & (f < -lo), f, lo).astype(via)  # nan compares False: lo
    out: np.ndarray = a.astype(npd, copy=copy)
    return out


def compute_dtype(dtype: str) -> np.dtype:
    """The numpy dtype kernels compute in: half types are widened to float32 so sums keep precision."""
    if dtype in ("float16", "bfloat16"):
        return DTYPES["float32"]
    return DTYPES[dtype]


def is_bfloat16(npd: np.dtype) -> bool:
    """Whether numpy dtype ``npd`` is ml_dtypes' bfloat16, without importing ml_dtypes: such a
    dtype exists only once it is imported (by einjoin's first use of bfloat16, or the caller's).

    >>> is_bfloat16(np.dtype(np.float16)), is_bfloat16(numpy_dtype("bfloat16"))
    (False, True)
    """
    return npd.kind == "V" and "ml_dtypes" in sys.modules and npd == DTYPES["bfloat16"]


_F16 = np.dtype(np.float16)


def is_half(npd: np.dtype) -> bool:
    """Whether numpy dtype ``npd`` is float16 or bfloat16 (the types kernels widen to float32)."""
    return npd == _F16 or is_bfloat16(npd)


def _native(npd: np.dtype) -> np.dtype:
    # byte order is storage, not a dtype: '>f4' holds the same values as '<f4'
    return npd.newbyteorder("=") if npd.byteorder not in ("=", "|") else npd


def _int_value_bits(npd: np.dtype) -> int:
    info = np.iinfo(npd)
    return info.bits - (1 if info.min < 0 else 0)


def exact_cast(src: Any, dst: str) -> bool:
    """Whether every value of numpy dtype ``src`` is exactly representable in einjoin dtype
    ``dst``, so feeding such an array to a ``dst`` input cannot change a value.

    bool only into bool (a mask fed where numbers are declared is a mistake, as in torch); an
    integer type into an integer type holding all its values (int32 into int64, uint8 into
    int16; never uint64, nor int64 into int32, nor a signed type into uint8), into a
    float type when its value bits fit the significand (int8/uint8 into float16 and bfloat16,
    16-bit ints into float32, 32-bit ints into float64); a float type into a float type whose
    significand and exponent range both hold it (float16 and bfloat16 into float32, all three
    into float64; float16 and bfloat16 not into each other). Never a float into an int, nor a
    number into bool. Byte order does not matter.

    >>> exact_cast(np.dtype(np.float16), "float32"), exact_cast(np.dtype(np.float64), "float32")
    (True, False)
    >>> exact_cast(np.dtype(np.uint64), "int64"), exact_cast(np.dtype(">i4"), "int64")
    (False, True)
    >>> exact_cast(np.dtype(np.int8), "uint8"), exact_cast(np.dtype(np.uint8), "int16")
    (False, True)
    """
    try:
        s = _native(np.dtype(src))
    except TypeError:
        return False
    d = DTYPES[dst]
    if s == d:
        return True
    if s.kind == "b" or d.kind == "b":
        return False  # truth values are not numbers: a mask fed as weights is a mistake
    if s.kind in "iu":
        if d.kind in "iu":  # a signed type's negatives do not fit an unsigned one (-1 is not 255)
            return _int_value_bits(s) <= _int_value_bits(d) and not (s.kind == "i" and d.kind == "u")
        if d.kind == "f" or dst == "bfloat16":
            return _int_value_bits(s) <= int(np.finfo(d).nmant) + 1
        return False
    if s.kind == "f" or is_bfloat16(s):
        if not (d.kind == "f" or dst == "bfloat16"):
            return False
        try:
            fs, fd = np.finfo(s), np.finfo(d)
        except ValueError:
            return False
        return bool(fd.nmant >= fs.nmant and fd.maxexp >= fs.maxexp and fd.minexp <= fs.minexp)
    return False
