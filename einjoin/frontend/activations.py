"""Elementwise activations as torch defines them, each ONE elementwise EinSum whose join is the
formula torch computes (``log1p`` / ``expm1`` where torch uses them), written so that the
gradient the existing derivative rules give is torch's at the kinks too: the piecewise ones are
``where`` chains on the same comparisons torch's backward uses (hardswish at -3 and 3, hardtanh
at its bounds), and a NaN input gives NaN, as torch.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (4,))
>>> ej.reference(ej.leaky_relu(x, 0.1), x=np.array([-2, -1, 0, 3], np.float32)).tolist()
[-0.20000000298023224, -0.10000000149011612, 0.0, 3.0]
"""

from __future__ import annotations

from typing import Any

from einjoin.errors import EinjoinError, ShapeError
from einjoin.frontend.tensor import Tensor, _norm_dim, _t, elementwise
from einjoin.ir.dtypes import INT_DTYPES
from einjoin.ir.scalar import parse_join

__all__ = ["softplus", "mish", "hardswish", "hardsigmoid", "elu", "selu", "celu", "leaky_relu", "relu6",
           "hardtanh", "log_sigmoid", "softsign", "threshold", "prelu", "glu"]

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _num(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            import numpy as np
            if isinstance(v, np.generic) and v.dtype.kind in "iuf":
                return float(v)
        except ImportError:  # pragma: no cover
            pass
        raise EinjoinError(f"{what} must be a number, got {v!r:.60}")
    return float(v)


def _map(x: Any, expr: str, name: str) -> Tensor:
    x = _t(x, name)
    if x.dtype not in ("float16", "bfloat16", "float32", "float64"):
        x = x.to("float32")
    return elementwise(parse_join(expr, 1), x, name=name)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """``log1p(exp(beta * x)) / beta``, and ``x`` itself where ``beta * x > threshold`` (torch)."""
    b, t = _num(beta, "softplus: beta"), _num(threshold, "softplus: threshold")
    return _map(x, f"where(x0 * {b!r} > {t!r}, x0, log1p(exp(x0 * {b!r})) / {b!r})", "softplus")


def mish(x: Tensor) -> Tensor:
    """``x * tanh(softplus(x))``."""
    return _map(x, "x0 * tanh(where(x0 > 20.0, x0, log1p(exp(x0))))", "mish")


def hardswish(x: Tensor) -> Tensor:
    """``x * relu6(x + 3) / 6``: 0 up to -3 (``x * 0``: -0.0, and NaN at -inf, as torch's
    ``-inf * 0``), ``x`` from 3 on (torch's backward masks: gradient 0 at -3 and 1 at 3)."""
    return _map(x, "where(x0 <= -3.0, x0 * 0.0, where(x0 < 3.0, x0 * (x0 + 3.0) / 6.0, x0))", "hardswish")


def hardsigmoid(x: Tensor) -> Tensor:
    """``relu6(x + 3) / 6``."""
    return _map(x, "where(x0 <= -3.0, 0.0, where(x0 >= 3.0, 1.0, (x0 + 3.0) / 6.0))", "hardsigmoid")


def elu(x: Tensor, alpha: float = 1.0) -> Tensor:
    """``x`` above 0, else ``alpha * (exp(x) - 1)``."""
    a = _num(alpha, "elu: alpha")
    return _map(x, f"where(x0 > 0, x0, {a!r} * expm1(x0))", "elu")


def selu(x: Tensor) -> Tensor:
    """``scale * elu(x, alpha)`` with the self-normalising constants."""
    return _map(x, f"{_SELU_SCALE!r} * where(x0 > 0, x0, {_SELU_ALPHA!r} * expm1(x0))", "selu")


def celu(x: Tensor, alpha: float = 1.0) -> Tensor:
    """``x`` above 0, else ``alpha * (exp(x / alpha) - 1)``."""
    a = _num(alpha, "celu: alpha")
    if a == 0:
        raise EinjoinError("celu: alpha must not be 0")
    return _map(x, f"where(x0 > 0, x0, {a!r} * expm1(x0 * {1.0 / a!r}))", "celu")


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    """``x`` above 0, else ``negative_slope * x``."""
    s = _num(negative_slope, "leaky_relu: negative_slope")
    return _map(x, f"where(x0 > 0, x0, x0 * {s!r})", "leaky_relu")


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """``x`` clamped to ``[min_val, max_val]``; no gradient at or beyond the bounds (torch)."""
    lo, hi = _num(min_val, "hardtanh: min_val"), _num(max_val, "hardtanh: max_val")
    xt = _t(x, "hardtanh")
    if xt.dtype in INT_DTYPES:
        return elementwise(parse_join(f"where(x0 <= {int(lo)}, {int(lo)}, where(x0 >= {int(hi)}, {int(hi)}, x0))",
                                      1), xt, name="hardtanh")
    return _map(xt, f"where(x0 <= {lo!r}, {lo!r}, where(x0 >= {hi!r}, {hi!r}, x0))", "hardtanh")


def relu6(x: Tensor) -> Tensor:
    """``hardtanh(x, 0, 6)``."""
    return hardtanh(x, 0.0, 6.0)


def log_sigmoid(x: Tensor) -> Tensor:
    """``log(sigmoid(x))`` as torch computes it: ``min(x, 0) - log1p(exp(-|x|))``."""
    return _map(x, "min(x0, 0) - log1p(exp(-abs(x0)))", "log_sigmoid")


def softsign(x: Tensor) -> Tensor:
    """``x / (1 + |x|)``."""
    return _map(x, "x0 / (1 + abs(x0))", "softsign")


def threshold(x: Tensor, threshold: float, value: float) -> Tensor:
    """``value`` where ``x <= threshold``, else ``x`` (NaN stays NaN)."""
    t, v = _num(threshold, "threshold: threshold"), _num(value, "threshold: value")
    xt = _t(x, "threshold")
    return elementwise(parse_join(f"where(x0 <= {t!r}, {v!r}, x0)", 1), xt, name="threshold")


def prelu(x: Tensor, weight: Tensor) -> Tensor:
    """``x`` above 0, else ``weight * x``, with one weight per channel (dim 1) or one shared."""
    x, w = _t(x, "prelu"), _t(weight, "prelu weight")
    if w.ndim > 1 or (w.ndim == 1 and w.shape[0] != 1 and (x.ndim < 2 or w.shape[0] != x.shape[1])):
        raise ShapeError(f"prelu: weight of shape {w.shape} for input {x.shape} (one per channel, dim 1)")
    if w.ndim == 1 and w.shape[0] != 1:
        w = w.reshape((w.shape[0],) + (1,) * (x.ndim - 2))
    elif w.ndim == 1:
        w = w.reshape(())
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    return elementwise(parse_join("where(x0 > 0, x0, x0 * x1)", 2), x, w, name="prelu")


def glu(x: Tensor, dim: int = -1) -> Tensor:
    """``a * sigmoid(b)`` of the two halves of ``dim``."""
    x = _t(x, "glu")
    d = _norm_dim(x, dim)
    n = x.shape[d]
    if n % 2:
        raise ShapeError(f"glu: dim {d} of shape {x.shape} must have an even size")
    a = x[(slice(None),) * d + (slice(0, n // 2),)]
    b = x[(slice(None),) * d + (slice(n // 2, n),)]
    return elementwise(parse_join("x0 * sigmoid(x1)", 2), a, b, name="glu")
