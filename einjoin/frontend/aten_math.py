"""Transcendental translations of the torch importer (session 40): the inverse and hyperbolic
trigonometric functions, ``atan2``, ``copysign``, ``xlogy``, ``logaddexp`` / ``logaddexp2``,
``logit`` and ``gcd``: :data:`MATH_OPS`, merged into :data:`einjoin.frontend.aten.OPS`. Each is
one join of an IR scalar function of the same name (:mod:`einjoin.ir.scalar`; torch's formulas
and edge cases, its backward formulas in :mod:`einjoin.ir.derivative`) under torch's type
promotion (integers and bools compute as float32; gcd takes integers only).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (3,))
>>> ej.reference(MATH_OPS["xlogy"](x, 0.0), x=np.array([0, 1, 2], np.float32)).tolist()
[0.0, -inf, -inf]
>>> [round(float(v), 4) for v in ej.reference(MATH_OPS["logit"](x, 0.25), x=np.array([0, 0.5, 1], np.float32))]
[-1.0986, 0.0, 1.0986]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from einjoin.errors import DTypeError
from einjoin.frontend.routing import elementwise_expr
from einjoin.frontend.tensor import Tensor, elementwise
from einjoin.ir.dtypes import kind
from einjoin.registry import registrar

__all__ = ["MATH_OPS"]

MATH_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(MATH_OPS)

# IR scalar function -> the aten names translated to it: numpy's and torch's arc- spellings and
# the in-place forms alike (one translation per function, so the op table shows one row each)
_NAMES = {"sinh": ("sinh",), "cosh": ("cosh",), "asin": ("asin", "arcsin"), "acos": ("acos", "arccos"),
          "atan": ("atan", "arctan"), "asinh": ("asinh", "arcsinh"), "acosh": ("acosh", "arccosh"),
          "atanh": ("atanh", "arctanh"), "atan2": ("atan2", "arctan2"), "copysign": ("copysign",),
          "xlogy": ("xlogy", "special_xlogy"), "logaddexp": ("logaddexp",), "logaddexp2": ("logaddexp2",)}


def _translation(fn: str) -> Callable[..., Tensor]:
    def run(*args: Any) -> Tensor:
        return elementwise(fn, *args, name=fn)
    run.__name__ = fn
    return run


_NO_INPLACE = frozenset({"logaddexp", "logaddexp2", "special_xlogy"})  # torch has no x.logaddexp_()

for _fn, _names in _NAMES.items():
    op(*(n for name in _names for n in (name, name + "_")[:1 if name in _NO_INPLACE else 2]))(
        _translation(_fn))


@op("gcd", "gcd_")
def _gcd(a: Any, b: Any) -> Tensor:
    """torch.gcd of integer tensors (torch refuses floats and bools: so does this)."""
    for v in (a, b):
        if not isinstance(v, Tensor) or kind(v.dtype) != "int":
            raise DTypeError(f"gcd: expected integer tensors, got {getattr(v, 'dtype', type(v).__name__)} "
                             f"(torch refuses it too)")
    return elementwise("gcd", a, b, name="gcd")


@op("logit", "logit_", "special_logit")
def _logit(x: Tensor, eps: float | None = None) -> Tensor:
    """torch.logit: ``log(z / (1 - z))``, ``z`` = x clamped to ``[eps, 1 - eps]`` when eps is
    given (NaN stays NaN; the gradient is 0 outside the bounds, as logit_backward's)."""
    if isinstance(x, Tensor) and kind(x.dtype) != "float":
        x = x.to("float32")  # torch: integer and bool inputs compute as float32
    if eps is not None:
        lo, hi = float(eps), 1.0 - float(eps)
        x = elementwise_expr(f"where(x0 < {lo!r}, {lo!r}, where(x0 > {hi!r}, {hi!r}, x0))", x)
    return elementwise("logit", x, name="logit")
