"""NumPy/torch-like free functions, and ``ej.einsum``, the extended Einstein summation.

>>> import einjoin as ej
>>> x = ej.input("x", (512, 1024)); w = ej.input("w", (1024, 4096))
>>> y = ej.einsum("ij,jk->ik", x, w).relu()
>>> m = ej.einsum("ij->i", y, agg="max")
>>> z = ej.einsum("ij,i->ij", y, m, join="sub").exp()
>>> z.shape
(512, 4096)
>>> ej.einsum("ik,kj->ij", x, w, join="x0 + x1", agg="max").shape   # max-plus (tropical) product
(512, 4096)
"""

from __future__ import annotations

import builtins
import operator
from typing import Any
from collections.abc import Sequence

import numpy as np

from einjoin.errors import EinjoinError, ShapeError
from einjoin.ir import ops
from einjoin.ir.scalar import Expr, parse_join
from einjoin.ir.dtypes import canonical_dtype
# einsum, matmul and gather are defined beside Tensor (its operators use them) and re-exported here
from einjoin.frontend.tensor import (Scalar, Tensor, _norm_dim, _t, einsum, elementwise, gather, matmul,
                                     permute, reduce, wrap)

__all__ = ["input", "param", "einsum", "matmul", "where", "maximum", "minimum", "exp", "log", "sqrt",
           "rsqrt", "reciprocal", "abs", "relu", "tanh", "sigmoid", "erf", "sin", "cos", "neg",
           "logical_not", "sum", "mean", "max", "min", "prod", "concat", "cat", "stack", "split",
           "chunk", "reshape", "transpose", "permute", "broadcast_to", "full", "zeros", "ones",
           "arange", "fill", "causal_mask", "gather", "embedding", "cast", "dropout_mask", "dropout"]


def input(name: str, shape: Any, dtype: Any = "float32") -> Tensor:
    """A named graph input (a parameter or an activation), fed at run time.

    >>> import einjoin as ej
    >>> ej.input("tokens", (4, 128), "int64")
    Tensor(input 'tokens', int64[4, 128])
    """
    return Tensor(ops.input_node(name, shape, dtype))


def param(name: str, shape: Any, dtype: Any = "float32") -> Tensor:
    """A named parameter (a weight): an input that planners know is not an activation.

    >>> import einjoin as ej
    >>> ej.param("w", (1024, 4096))
    Tensor(param 'w', float32[1024, 4096])
    """
    return Tensor(ops.input_node(name, shape, dtype, param=True))


def where(cond: Tensor, a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    """``a`` where ``cond`` is true, else ``b`` (broadcasting; numbers allowed for a and b)."""
    return elementwise("where", _t(cond, "where"), a, b, name="where")


def maximum(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    return elementwise("max", a, b, name="maximum")


def minimum(a: Tensor | Scalar, b: Tensor | Scalar) -> Tensor:
    return elementwise("min", a, b, name="minimum")


def _own(x: Any) -> Any:
    """The op hook of a tensor that computes its functional forms itself (an eager sparse tensor's
    ``__einjoin_op__(op, *args)``: ``ej.sum(s, 1)``, ``ej.relu(s)``), else None; a protocol, so the
    frontend neither imports nor type-tests the sparse engine."""
    return getattr(x, "__einjoin_op__", None) if not isinstance(x, Tensor) else None


def _unary(fn: str):  # type: ignore[no-untyped-def]
    def f(x: Tensor) -> Tensor:
        if (own := _own(x)) is not None:
            return own(fn)  # type: ignore[no-any-return]
        return elementwise(fn, _t(x, fn))
    f.__name__ = fn
    f.__doc__ = f"Elementwise ``{fn}``."
    return f


exp, log, sqrt, rsqrt, reciprocal = (_unary(n) for n in ("exp", "log", "sqrt", "rsqrt", "reciprocal"))
abs, relu, tanh, sigmoid, erf = (_unary(n) for n in ("abs", "relu", "tanh", "sigmoid", "erf"))
sin, cos, neg, logical_not = (_unary(n) for n in ("sin", "cos", "neg", "logical_not"))


def sum(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    if (own := _own(x)) is not None:
        return own("sum", dim, keepdim)  # type: ignore[no-any-return]
    return reduce(_t(x, "sum"), "sum", dim, keepdim)


def prod(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    if (own := _own(x)) is not None:
        return own("prod", dim, keepdim)  # type: ignore[no-any-return]
    return reduce(_t(x, "prod"), "prod", dim, keepdim)


def max(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    if (own := _own(x)) is not None:
        return own("max", dim, keepdim)  # type: ignore[no-any-return]
    return reduce(_t(x, "max"), "max", dim, keepdim)


def min(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    if (own := _own(x)) is not None:
        return own("min", dim, keepdim)  # type: ignore[no-any-return]
    return reduce(_t(x, "min"), "min", dim, keepdim)


def mean(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    if (own := _own(x)) is not None:
        return own("mean", dim, keepdim)  # type: ignore[no-any-return]
    return _t(x, "mean").mean(dim, keepdim)


def _tensors(xs: Any, what: str) -> list[Tensor]:
    # torch.cat / torch.stack take a list or tuple: a tensor, a number or None is a mistake
    if not isinstance(xs, (list, tuple)):
        raise EinjoinError(f"{what}: expected a list or tuple of einjoin tensors, got "
                           f"{type(xs).__name__} {xs!r:.60}")
    return [_t(x, f"{what}: item {i}") for i, x in enumerate(xs)]


def concat(xs: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Lay tensors end to end along ``dim``."""
    ts = _tensors(xs, "concat")
    return wrap(ops.concat_node([t.node for t in ts], dim))


cat = concat


def stack(xs: Sequence[Tensor], dim: int = 0) -> Tensor:
    ts = _tensors(xs, "stack")
    if not ts:
        raise ShapeError("stack: needs at least one tensor")
    return concat([t.unsqueeze(dim) for t in ts], dim)


def split(x: Tensor, split_size_or_sections: Any, dim: int = 0) -> tuple[Tensor, ...]:
    """torch.split: pieces of ``split_size`` (the last may be smaller) or of the given sizes."""
    x = _t(x, "split")
    d = _norm_dim(x, dim)
    n = x.shape[d]
    if isinstance(split_size_or_sections, bool) or not isinstance(
            split_size_or_sections, (int, list, tuple)):
        raise ShapeError(f"split: expected an int size or a list of sizes, got {split_size_or_sections!r}")
    if isinstance(split_size_or_sections, int):
        step = split_size_or_sections
        if step <= 0:
            raise ShapeError(f"split: size must be positive, got {step}")
        sizes = [step] * (n // step) + ([n % step] if n % step else []) or [0]
    else:
        sizes = list(split_size_or_sections)
        try:
            if any(isinstance(s, bool) for s in sizes):
                raise TypeError
            sizes = [operator.index(s) for s in sizes]
        except TypeError:
            raise ShapeError(f"split: sizes must be ints, got {sizes}") from None
        if builtins.sum(sizes) != n or any(s < 0 for s in sizes):
            raise ShapeError(f"split: sizes {sizes} do not add up to {n} (dim {d} of {x.shape})")
    out = []
    start = 0
    for s in sizes:
        starts = [0] * x.ndim
        stops = list(x.shape)
        starts[d], stops[d] = start, start + s
        out.append(wrap(ops.select_node(x.node, starts, stops)))
        start += s
    return tuple(out)


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    x = _t(x, "chunk")
    n = x.shape[_norm_dim(x, dim)]
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ShapeError(f"chunk: chunks must be positive, got {chunks}")
    if n == 0:  # torch: as many empty chunks as asked for
        return split(x, [0] * chunks, dim)
    return split(x, -(-n // chunks), dim)


def reshape(x: Tensor, shape: Any) -> Tensor:
    return _t(x, "reshape").reshape(shape)


def transpose(x: Tensor, a: int = 0, b: int = 1) -> Tensor:
    return _t(x, "transpose").transpose(a, b)


def broadcast_to(x: Tensor, shape: Any) -> Tensor:
    return _t(x, "broadcast_to").expand(shape)


def fill(shape: Any, expr: str | Expr | float | int | bool, dtype: Any = "float32") -> Tensor:
    """A constant tensor from an expression over the index variables ``x0, x1, ...``."""
    return Tensor(ops.fill_node(shape, dtype, expr))


def full(shape: Any, value: float | int | bool, dtype: Any = "float32") -> Tensor:
    """A tensor of ``shape`` holding ``value`` (a number the dtype can hold, as torch.full)."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        value = value.item()
    if not isinstance(value, (builtins.bool, int, float)):
        # a string would be parsed as an index expression (that is ej.fill's job)
        raise EinjoinError(f"full: value must be a number, got {type(value).__name__} {value!r:.60}"
                           + ("; for an expression over the indices use ej.fill"
                              if isinstance(value, str) else ""))
    if canonical_dtype(dtype) == "bool" and not isinstance(value, builtins.bool):
        value = builtins.bool(value)  # a bool fill holds True/False, not 1/0
    return fill(shape, value, dtype)


def zeros(shape: Any, dtype: Any = "float32") -> Tensor:
    return full(shape, 0, dtype)


def ones(shape: Any, dtype: Any = "float32") -> Tensor:
    return full(shape, 1, dtype)


def arange(n: int, dtype: Any = "int64") -> Tensor:
    """``0, 1, ..., n - 1``."""
    return fill((_size(n, "arange: n"),), "x0", dtype)


def _size(v: Any, what: str) -> int:
    # a dimension size: an int >= 0 (numpy ints and 0-d int arrays too), never a bool or float
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "iu":
        v = v.item()
    if isinstance(v, builtins.bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ShapeError(f"{what} must be a non-negative int, got {type(v).__name__} {v!r:.60}")
    return int(v)


def causal_mask(rows: int, cols: int | None = None) -> Tensor:
    """Bool ``[rows, cols]``, true where query ``i`` may attend key ``j`` (``j <= i + cols - rows``),
    torch's ``tril`` aligned to the bottom right as in ``is_causal`` attention with a KV cache."""
    rows = _size(rows, "causal_mask: rows")
    cols = rows if cols is None else _size(cols, "causal_mask: cols")
    shift = cols - rows
    return fill((rows, cols), f"x1 <= x0 + {shift}" if shift else "x1 <= x0", "bool")


def embedding(indices: Tensor, weight: Tensor) -> Tensor:
    """torch.nn.functional.embedding's argument order."""
    return gather(weight, indices)


def cast(x: Tensor, dtype: Any) -> Tensor:
    return _t(x, "cast").to(dtype)



# ---- dropout: a keep-mask from a hash of (seed, stream, element index), computed in the graph.
# Why a hash and not a random input: the mask is then computed where each block is needed (no
# mask is loaded or moved), it is the same on every plan and backend (blocks hash their global
# indices), and the seed is an ordinary int64 graph input, so one compiled program serves every
# step. The hash works modulo the prime 2**31 - 1 so every product fits int64.
_HASH_M = 2147483647


def _hash_expr(p: float, stream: int) -> str:
    """``x0`` (an int64 element index) and ``x1`` (the int64 seed) -> True where kept: a hash of
    the index keyed by (seed, stream), uniform on [0, M), compared with ``round(p * M)``."""
    m = _HASH_M
    key = f"((x1 % {m}) * 48271 + {stream % m * 69621 % m + 1}) % {m}"
    n = f"(x0 % {m})"
    h = f"({n} * 16807 + {key}) % {m}"
    h = f"({h} * {h} + 12345) % {m}"
    h = f"({h} * 48271 + {n}) % {m}"
    h = f"({h} * {h} + {key}) % {m}"
    return f"{h} >= {round(p * m)}"


def _check_p(p: Any) -> float:
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(p) <= 1.0:
        raise EinjoinError(f"dropout: p must be a probability in [0, 1], got {p!r:.60}")
    return float(p)


def dropout_mask(shape: Any, p: float, seed: Tensor | int = 0, stream: int = 0) -> Tensor:
    """The bool keep-mask of :func:`dropout`: True with probability ``1 - p`` per element,
    independently (a hash of the element's index keyed by ``seed`` and ``stream``). ``seed`` is an
    int64 scalar tensor (a graph input: a new seed per step, one compiled program) or an int;
    ``stream`` tells apart the masks of several dropouts of one graph.

    >>> import numpy as np, einjoin as ej
    >>> keep = ej.dropout_mask((1000,), 0.25, ej.input("seed", (), "int64"))
    >>> m = ej.reference(keep, seed=np.int64(7))
    >>> m.dtype, bool(0.7 < m.mean() < 0.8)
    (dtype('bool'), True)
    """
    dims = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    p = _check_p(p)
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise EinjoinError(f"dropout: stream must be an int, got {stream!r:.60}")
    strides, acc = [], 1
    for n in reversed(dims):
        strides.append(acc)
        acc *= n
    linear = " + ".join(f"x{d} * {s}" for d, s in zip(range(len(dims)), reversed(strides))) or "0"
    index = fill(dims, linear, "int64")
    if isinstance(seed, Tensor):
        if seed.ndim != 0 or seed.dtype != "int64":
            raise EinjoinError(f"dropout: seed must be an int64 scalar tensor, got "
                               f"{seed.dtype}{list(seed.shape)}")
        return elementwise(parse_join(_hash_expr(p, int(stream)), 2), index, seed, name="dropout mask")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise EinjoinError(f"dropout: seed must be an int or an int64 scalar tensor, got {seed!r:.60}")
    return elementwise(parse_join(_hash_expr(p, int(stream)).replace("x1", f"({int(seed)})"), 1), index,
                       name="dropout mask")


def dropout(x: Tensor, p: float = 0.5, seed: Tensor | int = 0, training: bool = True,
            stream: int = 0) -> Tensor:
    """torch's dropout: in training, each element is kept with probability ``1 - p`` and scaled
    by ``1 / (1 - p)``, else 0 (the mask is :func:`dropout_mask`'s); the identity otherwise. Its
    gradient is the same mask, scaled alike.

    >>> import numpy as np, einjoin as ej
    >>> y = ej.dropout(ej.input("x", (4, 256)), 0.5, seed=3)
    >>> out = ej.reference(y, x=np.ones((4, 256), np.float32))
    >>> sorted(set(out.ravel().tolist()))
    [0.0, 2.0]
    """
    x = _t(x, "dropout")
    p = _check_p(p)
    if not training or p == 0.0:
        return x
    if p == 1.0:  # nothing kept (torch returns zeros)
        return full(x.shape, 0, x.dtype) if x.dtype != "bool" else x
    keep = dropout_mask(x.shape, p, seed, stream)
    return elementwise(parse_join(f"where(x1, x0 * {1.0 / (1.0 - p)!r}, 0)", 2), x, keep, name="dropout")
