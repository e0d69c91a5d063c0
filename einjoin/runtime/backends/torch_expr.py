"""Scalar join expressions (:mod:`einjoin.ir.scalar`) as torch functions, for the torch backend:
an expression is translated once (cached by identity, as :mod:`einjoin.ir.evaluate` caches its
numpy form) into straight-line steps over value slots, equal sub-expressions computed once, each
step a torch op from :data:`TORCH_FUNCTIONS`. A function torch has no exact equivalent for
(``ipow``'s integer rule) runs its numpy implementation on the CPU (:func:`_via_numpy`).

Floating-point edge cases give inf/nan as IEEE says, as the numpy kernels do; an integer division
by zero raises the same :class:`~einjoin.errors.EinjoinError` as there.

>>> import torch
>>> from einjoin.ir.scalar import parse_join
>>> torch_evaluate(parse_join("x0 * x0 + 1", 1), [torch.arange(3.0)])
tensor([1., 2., 5.])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as tf

from einjoin.errors import EinjoinError
from einjoin.ir.scalar import FUNCTIONS, Arg, Const, Expr, _eval_consts
from einjoin.ir.evaluate import SlotProgram

__all__ = ["torch_evaluate", "TORCH_FUNCTIONS", "compile_expr"]

_WEAK = (int, float, bool)


_CONSTS: dict[tuple[str, str], torch.Tensor] = {}


def _const(x: Any) -> torch.Tensor:
    """A Python number as a 0-d CPU tensor of numpy's type for it (float64, int64, bool): a 0-d
    tensor keeps the other operand's dtype within its category, and sets it across categories,
    which is numpy's rule for a Python scalar (an int tensor times 0.5 is float64 in both; a
    float32 tensor times 0.5 stays float32). A CPU 0-d tensor combines with a tensor on any
    device. Made once per constant."""
    key = (type(x).__name__, repr(x))
    got = _CONSTS.get(key)
    if got is None:
        dt = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float64
        got = _CONSTS[key] = torch.tensor(x, dtype=dt, device="cpu")  # not the default device (a CUDA run sets it)
    return got


def _first_tensor(xs: Sequence[Any]) -> torch.Tensor | None:
    return next((x for x in xs if isinstance(x, torch.Tensor)), None)


def _int_division(fn: Callable[..., torch.Tensor], what: str) -> Callable[..., torch.Tensor]:
    """Floor division / remainder with Python's signs (torch's as numpy's); an integer divisor of
    0 is an EinjoinError, as on the numpy backend."""
    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not (a.is_floating_point() or b.is_floating_point()) and bool((b == 0).any()):
            raise EinjoinError(f"integer {what} by zero (torch raises too; use float tensors for inf/nan)")
        return fn(a, b)
    return run


def _rsqrt(x: Any) -> torch.Tensor:
    return 1.0 / torch.sqrt(x)  # as the numpy kernel computes it (torch.rsqrt rounds differently)


def _relu(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(x, 0) if x.dtype != torch.bool else x


def _via_numpy(name: str) -> Callable[..., torch.Tensor]:
    """The numpy implementation on the CPU (a function torch computes differently)."""
    impl = FUNCTIONS[name].impl

    def run(*xs: Any) -> torch.Tensor:
        like = _first_tensor(xs)
        args = [x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x for x in xs]
        with np.errstate(all="ignore"):
            out = np.asarray(impl(*args))
        if out.dtype == object:  # Python ints: exact, then int64 as the numpy kernels cast
            out = out.astype(np.int64)
        got = torch.from_numpy(np.ascontiguousarray(out).reshape(out.shape))  # (a 0-d value stays 0-d)
        if len(xs) == 2 and like is not None:  # a constant (a 0-d tensor) is weak as in torch:
            got = got.to(torch.result_type(xs[0], xs[1]))  # int8 ** 2 stays int8 (numpy: int64)
        return got.to(like.device) if like is not None else got
    return run


# each scalar function of einjoin.ir.scalar.FUNCTIONS as a torch function of tensors (Python
# numbers come as 0-d tensors, see _const; a test checks that every function has one)
TORCH_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "floordiv": _int_division(torch.floor_divide, "floor division"),
    "mod": _int_division(torch.remainder, "remainder"),
    "pow": torch.pow, "ipow": _via_numpy("ipow"),
    "max": torch.maximum, "min": torch.minimum,
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "log1p": torch.log1p,
    "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": _rsqrt, "reciprocal": lambda x: 1.0 / x,
    "relu": _relu, "silu": tf.silu, "gelu": tf.gelu, "gelu_tanh": lambda x: tf.gelu(x, approximate="tanh"),
    "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
    "where": torch.where,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "logical_not": torch.logical_not, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
    "stop_gradient": torch.clone,
    "sinh": torch.sinh, "cosh": torch.cosh, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan,
    "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh, "logit": torch.logit,
    "atan2": torch.atan2, "copysign": torch.copysign, "xlogy": torch.xlogy,
    "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2,
    # issue 39's integer functions: numpy's (torch's numerics, checked by tests/adversarial/test_issue39_*)
    **{n: _via_numpy(n) for n in ("fmod", "truncdiv", "bitand", "bitor", "bitxor", "bitnot", "lshift", "rshift",
                                         "gcd")},
}


class _TorchCompiled(SlotProgram):
    """An expression as steps over value slots (the slots and last reads of
    :class:`einjoin.ir.evaluate.SlotProgram`), run on torch tensors."""

    def run(self, args: Sequence[Any]) -> Any:
        vals: list[Any] = [None] * self.size
        for s, is_arg, v in self.leaves:
            vals[s] = args[v] if is_arg else v
        owned: set[int] = set()  # slots holding tensors this evaluation allocated
        for s, fn, a, dying in self.steps:
            xs = [vals[i] for i in a]
            if all(isinstance(x, _WEAK) for x in xs):  # constants only: Python numbers
                vals[s] = _eval_consts(FUNCTIONS[fn], xs)
                continue
            ts = [_const(x) if isinstance(x, _WEAK) else x for x in xs]
            out = None
            if fn in _OUT_FORMS:
                out = next((vals[i] for i in dying if i in owned and _fits(vals[i], ts)), None)
            if out is not None:  # written into a temporary nothing reads later: no new memory
                vals[s] = _OUT_FORMS[fn](*ts, out=out)
            else:
                vals[s] = TORCH_FUNCTIONS[fn](*ts)
            owned.add(s)
            for i in dying:
                if i != s:
                    vals[i] = None
        return vals[self.result]


# the elementwise functions with an ``out=`` form that computes what TORCH_FUNCTIONS' does
_OUT_FORMS: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide, "pow": torch.pow,
    "max": torch.maximum, "min": torch.minimum, "neg": torch.neg, "abs": torch.abs, "exp": torch.exp,
    "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt, "tanh": torch.tanh,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
}


def _fits(t: Any, xs: Sequence[Any]) -> bool:
    """Whether a function of ``xs`` gives exactly ``t``'s dtype and shape, so that writing into
    ``t`` changes no number: a float tensor, every other argument of its dtype (or a 0-d
    constant, which takes it) broadcasting into it."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.is_contiguous()):
        return False
    for x in xs:
        if x is t:
            continue
        if x.ndim == 0 and x.device.type == "cpu" and x.dtype in (torch.float64, torch.int64, torch.bool):
            continue  # a constant (_const): t's dtype wins within its category, and t is a float
        if x.dtype != t.dtype or x.ndim > t.ndim:
            return False
        if any(a != b and a != 1 for a, b in zip(tuple(x.shape)[::-1], tuple(t.shape)[::-1])):
            return False
    return True


_COMPILED: dict[int, tuple[Expr, _TorchCompiled]] = {}


def compile_expr(expr: Expr) -> Callable[[Sequence[Any]], Any]:
    """``expr`` translated once into a function of its argument tensors (cached by identity)."""
    if isinstance(expr, Arg):
        i = expr.index
        return lambda args: args[i]
    if isinstance(expr, Const):
        v = expr.value
        return lambda args: v
    hit = _COMPILED.get(id(expr))
    if hit is not None and hit[0] is expr:
        return hit[1].run
    if len(_COMPILED) > 4096:
        _COMPILED.clear()
    c = _TorchCompiled(expr)
    _COMPILED[id(expr)] = (expr, c)
    return c.run


def torch_evaluate(expr: Expr, args: Sequence[Any]) -> Any:
    """Evaluate ``expr`` elementwise over tensors that broadcast together (a Python number for
    an expression of constants only)."""
    return compile_expr(expr)(args)

