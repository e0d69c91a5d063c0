"""Translations of the torch importer written as compositions of other translations (session 40):
``trace``, ``diag`` (a vector onto a diagonal, a matrix's diagonal, with an offset), ``var_mean``
/ ``std_mean``, ``dist``, ``cosine_similarity``, ``linalg_matrix_norm`` (its sum and max orders),
``cdist``, ``median`` (of every element). :func:`compose_ops` builds them over the op table they
join (so this module does not import :mod:`einjoin.frontend.aten` back); their gradients are
those of the ops they are made of (a ``where`` against a diagonal mask: 0 off the diagonal, as
torch's).

>>> import numpy as np, einjoin as ej
>>> from einjoin.frontend.aten import OPS
>>> x = ej.input("x", (2, 3))
>>> ej.reference(OPS["diag"](x, 1), x=np.arange(6.0, dtype=np.float32).reshape(2, 3)).tolist()
[1.0, 5.0]
>>> float(ej.reference(OPS["trace"](x), x=np.arange(6.0, dtype=np.float32).reshape(2, 3)))
4.0
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable, Mapping
from typing import Any

from einjoin.errors import DTypeError, ShapeError, UnsupportedOpError
from einjoin.frontend.aten_layout import torch_dtype
from einjoin.frontend.functions import fill
from einjoin.frontend.routing import elementwise_expr
from einjoin.frontend.tensor import Tensor, broadcast_shapes, einsum, elementwise
from einjoin.ir.dtypes import kind

__all__ = ["compose_ops"]

# torch.median(x, dim) returns a named tuple: fx code may read .values / .indices
MedianResult = namedtuple("MedianResult", ["values", "indices"])

Ops = Mapping[str, Callable[..., Any]]


def _zero(x: Tensor) -> bool | int:
    return False if x.dtype == "bool" else 0  # a where's other branch, in x's dtype (torch's zeros)


def compose_ops(ops: Ops) -> dict[str, Callable[..., Any]]:
    """The composed translations over ``ops`` (the importer's table, holding ``sum``, ``mean``,
    ``var``, ``std``, ``where``, ``constant_pad_nd`` and ``linalg_vector_norm``)."""

    def diagonal_mask(shape: tuple[int, ...], offset: int) -> Tensor:
        return fill(shape, f"x1 == x0 + {offset}" if offset >= 0 else f"x0 == x1 + {-offset}", "bool")

    def trace(x: Tensor) -> Tensor:
        """torch.trace: the sum of a matrix's main diagonal (any shape; integers sum to int64)."""
        if x.ndim != 2:
            raise ShapeError(f"trace: expected a matrix, got a {x.ndim}-d tensor of shape {x.shape}")
        out: Tensor = ops["sum"](ops["where"](diagonal_mask(x.shape, 0), x, _zero(x)))
        return out

    def diag(x: Tensor, diagonal: int = 0) -> Tensor:
        """torch.diag: a vector onto the ``diagonal``-th diagonal of a square matrix (zeros
        elsewhere), or a matrix's ``diagonal``-th diagonal as a vector."""
        k = int(diagonal)
        if x.ndim == 1:
            n = x.shape[0] + abs(k)
            padded = ops["constant_pad_nd"](x, [0, abs(k)])  # x[i] at row i (k >= 0) or column i
            vals = padded.reshape((n, 1)) if k >= 0 else padded
            out: Tensor = ops["where"](diagonal_mask((n, n), k), vals, _zero(x))
            return out
        if x.ndim != 2:
            raise ShapeError(f"diag: expected a 1-d or 2-d tensor, got shape {x.shape}")
        r0, c0 = max(-k, 0), max(k, 0)
        length = max(0, min(x.shape[0] - r0, x.shape[1] - c0))
        return einsum("ii->i", x[r0:r0 + length, c0:c0 + length])

    def var_mean(x: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,
                 correction: Any = None) -> tuple[Tensor, Tensor]:
        """torch.var_mean: (var, mean) over the same dims (var(x, unbiased) spelled positionally)."""
        if isinstance(dim, bool):
            dim, unbiased = None, dim
        return (ops["var"](x, dim, unbiased, keepdim, correction=correction),
                ops["mean"](x, dim, keepdim))

    def std_mean(x: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,
                 correction: Any = None) -> tuple[Tensor, Tensor]:
        if isinstance(dim, bool):
            dim, unbiased = None, dim
        return (ops["std"](x, dim, unbiased, keepdim, correction=correction),
                ops["mean"](x, dim, keepdim))

    def dist(a: Tensor, b: Any, p: float = 2) -> Tensor:
        """torch.dist: the p-norm of ``a - b`` over every element."""
        out: Tensor = ops["linalg_vector_norm"](a - b, p)
        return out

    def cosine_similarity(x1: Any, x2: Any, dim: int = 1, eps: float = 1e-8) -> Tensor:
        """torch's cosine_similarity: ``sum(x1 / n1 * x2 / n2)`` over ``dim`` of the broadcast
        operands, ``n`` each one's 2-norm clamped below at ``eps``; torch clamps in place under
        no_grad, so the gradient flows through the norm as if unclamped (``n - stop_gradient(n) +
        stop_gradient(max(n, eps))``: the clamped value, the norm's derivative)."""
        if not isinstance(x1, Tensor) or not isinstance(x2, Tensor):
            raise UnsupportedOpError("cosine_similarity of a Python number (tensors only)")
        if kind(x1.dtype) != "float" and kind(x2.dtype) != "float":
            raise DTypeError(f"cosine_similarity: expected a float operand, got {x1.dtype} and {x2.dtype} "
                             f"(torch refuses it too)")
        common = x1.dtype if kind(x2.dtype) != "float" else x2.dtype if kind(x1.dtype) != "float" else None
        if common is not None:  # torch casts an integer operand to the other's float dtype
            x1, x2 = x1.to(common), x2.to(common)
        shape = broadcast_shapes(x1.shape, x2.shape, what="cosine_similarity")
        x1, x2 = x1.broadcast_to(shape), x2.broadcast_to(shape)
        parts = []
        for x in (x1, x2):
            n = ops["linalg_vector_norm"](x, 2, dim, True)
            n = elementwise_expr(f"x0 - stop_gradient(x0) + stop_gradient(max(x0, {float(eps)!r}))", n)
            parts.append(x / n)
        out: Tensor = ops["sum"](parts[0] * parts[1], dim)
        return out

    def matrix_norm(x: Tensor, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *,
                    dtype: Any = None) -> Tensor:
        """torch.linalg.matrix_norm for ord 'fro', 1, -1, inf, -inf (the extreme absolute column /
        row sum); the singular-value orders ('nuc', 2, -2) are refused."""
        if dtype is not None:
            x = x.to(torch_dtype(dtype))
        d0, d1 = (int(d) % x.ndim for d in dim)
        if ord == "fro":
            out: Tensor = ops["linalg_vector_norm"](x, 2, [d0, d1], keepdim)
            return out
        if isinstance(ord, str) or ord not in (1, -1, math.inf, -math.inf):
            raise UnsupportedOpError(f"linalg.matrix_norm with ord={ord!r} (singular values; 'fro', 1, -1, "
                                     f"inf and -inf only)")
        summed, over = (d0, d1) if abs(ord) == 1 else (d1, d0)  # ord 1: column sums; inf: row sums
        sums = ops["sum"](elementwise("abs", x), [summed], True)
        out = ops["amax" if ord > 0 else "amin"](sums, [over], True)
        if not keepdim:
            out = out.reshape(tuple(n for i, n in enumerate(out.shape) if i not in (d0, d1)))
        return out

    def cdist(x1: Tensor, x2: Tensor, p: float = 2.0, compute_mode: Any = None) -> Tensor:
        """torch.cdist: the p-norm of every row difference, ``(..., P, M), (..., R, M) -> (..., P,
        R)``, as the vector norm of the broadcast differences (P x R x M elements held)."""
        del compute_mode  # torch's choice of a matrix-product path for p = 2: one exact path here
        if x1.ndim < 2 or x2.ndim < 2 or x1.shape[-1] != x2.shape[-1]:
            raise ShapeError(f"cdist: expected (..., P, M) and (..., R, M), got {x1.shape} and {x2.shape}")
        if kind(x1.dtype) != "float" or kind(x2.dtype) != "float":
            raise DTypeError(f"cdist: only float tensors, got {x1.dtype} and {x2.dtype} (as torch)")
        diff = x1.reshape(x1.shape[:-1] + (1, x1.shape[-1])) - x2.reshape(x2.shape[:-2] + (1,) + x2.shape[-2:])
        out: Tensor = ops["linalg_vector_norm"](diff, p, [-1], False)
        return out

    def median_dim(x: Tensor, dim: int, keepdim: bool = False) -> Any:
        """torch.median over ``dim``: (values, indices) of the lower median, the element at
        (n - 1) // 2 of a stable sort (torch's index among ties, checked on random ties), or the
        first NaN when the row holds one (NaNs sort last, in order)."""
        if x.ndim == 0:  # torch: the value itself at index 0 (dim 0 or -1)
            if int(dim) not in (0, -1):
                raise ShapeError(f"median: dim {dim} out of range for a 0-d tensor")
            return MedianResult(x, fill((), 0, "int64"))
        d = int(dim) % x.ndim
        n = x.shape[d]
        if n == 0:
            raise ShapeError(f"median over dim {dim} of size 0 (torch raises too)")
        vals, idx = ops["sort"](x, d, False, True)
        k = (n - 1) // 2
        shape = tuple(1 if i == d else m for i, m in enumerate(x.shape))
        if kind(x.dtype) == "float":
            nans = ops["sum"](ops["isnan"](x), [d], True)
            pos = elementwise_expr(f"where(x0 > 0, {n} - x0, {k})", nans)
        else:
            pos = fill(shape, k, "int64")
        v, i = ops["gather"](vals, d, pos), ops["gather"](idx, d, pos)
        if not keepdim:
            out_shape = tuple(m for j, m in enumerate(x.shape) if j != d)
            v, i = v.reshape(out_shape), i.reshape(out_shape)
        return MedianResult(v, i)

    def median(x: Tensor, *args: Any, **kwargs: Any) -> Any:
        """torch.median of every element (the lower median; NaN if any element is NaN; over a dim:
        :func:`median_dim`'s values and indices). The gradient
        is torch's evenly_distribute_backward: shared evenly by the elements equal to the result
        (the NaNs when it is NaN), written as ``m + sum(where(eq, x - stop_gradient(x), 0)) / count``
        with ``m`` the sorted pick under stop_gradient (its value exactly ``m``)."""
        if args or kwargs:
            return median_dim(x, *args, **kwargs)
        size = math.prod(x.shape)
        if size == 0:
            raise ShapeError("median of an empty tensor (torch gives NaN)")
        flat = x.reshape((size,))
        picked: Tensor = ops["sort"](flat)[0][(size - 1) // 2]
        if kind(x.dtype) != "float":
            return picked
        m = elementwise_expr("stop_gradient(where(x1, nan, x0))", picked, ops["any"](ops["isnan"](flat)))
        eq = elementwise_expr("(x0 == x1) | ((x0 != x0) & (x1 != x1))", flat, m)
        count = ops["sum"](eq.to(x.dtype))
        share = ops["sum"](ops["where"](eq, elementwise_expr("x0 - stop_gradient(x0)", flat), 0))
        out: Tensor = m + share / count
        return out

    return {"median": median, "trace": trace, "diag": diag, "var_mean": var_mean, "std_mean": std_mean, "dist": dist,
            "cosine_similarity": cosine_similarity, "linalg_matrix_norm": matrix_norm, "cdist": cdist,
            "_cdist_forward": cdist}
