"""Symbolic derivatives of scalar join expressions: the base of relational autodiff.

The adjoint of input ``i`` of an elementwise einsum ``f(x0, ..., xn)`` is the einsum over the op's
labels with join ``g * ∂f/∂x_i`` (``g`` the cotangent), aggregated onto input i's labels; this
module builds that join. Each function of :data:`einjoin.ir.scalar.FUNCTIONS` has one entry in
:data:`DERIVATIVES` (data, not an if-chain): a forward-mode rule ``(call, tangent) -> Expr`` that
builds the derivative of the call from the call and (lazily) its arguments' derivatives, or a
:class:`NoDerivative` saying why there is none. The rules follow torch's backward formulas, tie and
kink rules included (``max``/``min`` ties split the gradient evenly; ``abs'(0) = relu'(0) = 0``;
``d/dx x**0 = 0``; ``mod`` as torch's ``remainder``), so gradients agree with ``torch.autograd``
at those points too. Comparisons and logical ops are piecewise constant (derivative 0), a
``where``'s condition is never differentiated, ``stop_gradient`` cuts (0), and ``floordiv`` has no
derivative (torch's ``floor_divide`` has none either): an :class:`ExpressionError` naming it, but
only when it lies on a path to ``x_i``.

Results are simplified as they are built (constants fold, ``x*1``, ``x+0``, ``--x``, ``x**1``,
``x/1`` disappear), so ``∂(x0*x1)/∂x0`` is exactly ``x1``. A sub-expression that does not read
``x_i`` is a structural zero: its term is dropped and never multiplied out. A product with a zero
constant that is *not* structural (``∂(sqrt(x0*0))/∂x0``) is kept, because IEEE (and torch's
autograd, which multiplies too) gives NaN where the other factor is infinite.

>>> from einjoin.ir.scalar import parse_join
>>> print(derivative(parse_join("x0 * x1", 2), 0))
x1
>>> print(derivative(parse_join("exp(x0 - x1)", 2), 1))
-exp(x0 - x1)
>>> print(derivative(parse_join("relu(x0)", 1), 0))
where(x0 <= 0, 0.0, 1.0)
>>> print(vjp_join(parse_join("relu(x0)", 1), 0, Arg(1)))
where(x0 <= 0, 0.0, x1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from einjoin.errors import EinjoinError, ExpressionError
from einjoin.ir.dtypes import kind
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import Arg, Call, Const, Expr

__all__ = ["derivative", "vjp_join", "simplify", "uses_arg", "DERIVATIVES", "NoDerivative"]

# the derivative of argument k of a call, built on demand; None when it is a structural zero
Tangent = Callable[[int], "Expr | None"]
# a forward-mode rule: (the call, its arguments' derivatives) -> the call's derivative or None
Rule = Callable[[Call, Tangent], "Expr | None"]


@dataclass(frozen=True)
class NoDerivative:
    """A :data:`DERIVATIVES` entry for a function that has none; ``reason`` goes in the error."""

    reason: str


# ---------------------------------------------------------------- public API


def derivative(expr: Expr, i: int, dtypes: Sequence[str] | None = None) -> Expr:
    """``∂expr/∂x_i`` as a simplified expression over the same arguments; ``Const(0.0)`` when
    ``expr`` does not read ``x_i``. ``dtypes`` (the arguments' dtypes), when given, are checked:
    gradients need a float ``x_i``. A function without a derivative (``floordiv``) on the path to
    ``x_i`` is an :class:`ExpressionError` naming it.

    >>> from einjoin.ir.scalar import parse_join
    >>> print(derivative(parse_join("x0 / x1", 2), 0), "|", derivative(parse_join("x0 + x1", 2), 1))
    1.0 / x1 | 1.0
    >>> print(derivative(parse_join("max(x0, x1)", 2), 0))
    where(x0 < x1, 0.0, where(x0 == x1, 0.5, 1.0))
    """
    return _differentiate(expr, i, Const(1.0), dtypes)


def vjp_join(expr: Expr, i: int, cotangent: Expr, dtypes: Sequence[str] | None = None) -> Expr:
    """The join of input ``i``'s adjoint einsum: ``cotangent * ∂expr/∂x_i``, with the cotangent
    placed where torch's backward puts ``grad`` — inside the branches of a mask (``relu``,
    ``max``, ``where``), so a masked position gets an exact 0 even under an infinite cotangent.
    ``cotangent`` is usually ``Arg(n)`` for an einsum of ``n`` inputs; its dtype types the result,
    which :func:`derivative` alone cannot always do (``relu'`` is ``where(x0 <= 0, 0.0, 1.0)``,
    constants only in its values). ``Const(0.0)`` when ``expr`` does not read ``x_i``.

    >>> from einjoin.ir.scalar import parse_join
    >>> print(vjp_join(parse_join("tanh(x0)", 1), 0, Arg(1)))
    (1.0 - tanh(x0) * tanh(x0)) * x1
    """
    return _differentiate(expr, i, cotangent, dtypes)


def uses_arg(expr: Expr, i: int) -> bool:
    """True when ``expr`` reads ``x_i`` anywhere (a where's condition included).

    >>> from einjoin.ir.scalar import parse_join
    >>> uses_arg(parse_join("x0 * 2", 2), 0), uses_arg(parse_join("x0 * 2", 2), 1)
    (True, False)
    """
    if isinstance(expr, Arg):
        return expr.index == i
    if isinstance(expr, Call):
        return any(uses_arg(a, i) for a in expr.args)
    return False


def simplify(expr: Expr) -> Expr:
    """``expr`` with constant sub-expressions folded (computed as :func:`evaluate` would, in
    float64 as weak scalars) and the neutral elements removed: ``x*1``, ``x+0``, ``x-0``,
    ``x/1``, ``x**1``, ``x**0``, ``--x``, ``where(True, a, b)``, ``where(c, a, a)``; constant factors
    gather on the left (``2 * (3 * x)`` is ``6 * x``) and negations move out of products.
    ``x*0`` stays unless ``x`` is a constant: it is NaN where ``x`` is infinite.

    >>> from einjoin.ir.scalar import parse_join
    >>> print(simplify(parse_join("1 * x0 + 0 * 2 - -x1 ** 1", 2)))
    x0 + x1
    """
    memo: dict[int, Expr] = {}  # by identity: a shared sub-expression stays shared

    def go(e: Expr) -> Expr:
        if not isinstance(e, Call):
            return e
        out = memo.get(id(e))
        if out is None:
            out = memo[id(e)] = _mk(e.fn, *(go(a) for a in e.args))
        return out

    return go(expr)


# ---------------------------------------------------------------- differentiation


def _differentiate(expr: Expr, i: int, seed: Expr, dtypes: Sequence[str] | None) -> Expr:
    if dtypes is not None:
        if not 0 <= i < len(dtypes):
            raise ExpressionError(f"derivative: x{i} is not among the {len(dtypes)} argument(s)")
        if kind(dtypes[i]) != "float":
            raise ExpressionError(f"derivative of {expr} with respect to x{i}: gradients need "
                                  f"float inputs, x{i} is {dtypes[i]}")
    # by identity, not equality: Const(1) == Const(1.0) == Const(True) in Python
    memo: dict[int, Expr | None] = {}

    def d(e: Expr) -> Expr | None:
        if id(e) in memo:
            return memo[id(e)]
        out: Expr | None
        if isinstance(e, Arg):
            out = seed if e.index == i else None
        elif isinstance(e, Const) or not uses_arg(e, i):
            out = None  # a structural zero: dropped, never multiplied out
        else:
            rule = DERIVATIVES.get(e.fn)
            if rule is None:
                raise ExpressionError(f"{e.fn} has no derivative rule (add one to "
                                      f"einjoin.ir.derivative.DERIVATIVES)")
            if isinstance(rule, NoDerivative):
                raise ExpressionError(f"{e.fn} has no derivative ({rule.reason}); it is on the "
                                      f"path to x{i} in {expr}")
            call = e
            out = rule(call, lambda k: d(call.args[k]))
        memo[id(e)] = out
        return out

    try:
        out = d(expr)
        return Const(0.0) if out is None else simplify(out)
    except RecursionError:
        raise ExpressionError("derivative: the join expression nests too deeply") from None


# ---------------------------------------------------------------- simplifying constructors


def _is(e: Expr, v: float) -> bool:
    """``e`` is the numeric constant ``v`` (bools excluded: ``True == 1`` in Python)."""
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == v


def _is_bool(e: Expr, v: bool) -> bool:
    return isinstance(e, Const) and isinstance(e.value, bool) and e.value is v


def _neg_of(e: Expr) -> Expr | None:
    return e.args[0] if isinstance(e, Call) and e.fn == "neg" else None


def _id_add(a: Expr, b: Expr) -> Expr | None:
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    if (nb := _neg_of(b)) is not None:
        return _mk("sub", a, nb)
    if (na := _neg_of(a)) is not None:
        return _mk("sub", b, na)  # IEEE addition commutes exactly
    if not isinstance(a, Const) and _same(a, b):
        return _mk("mul", Const(2), a)  # x + x is 2x exactly; an int 2 is weak for any dtype
    return None


def _id_sub(a: Expr, b: Expr) -> Expr | None:
    if _is(b, 0):
        return a
    if _is(a, 0):
        return _mk("neg", b)
    if (nb := _neg_of(b)) is not None:
        return _mk("add", a, nb)
    return None


def _const_factor(e: Expr) -> tuple[Const, Expr] | None:
    """``c * y`` as ``(c, y)``."""
    if isinstance(e, Call) and e.fn == "mul" and isinstance(e.args[0], Const):
        return e.args[0], e.args[1]
    return None


def _id_mul(a: Expr, b: Expr) -> Expr | None:
    if isinstance(b, Const) and not isinstance(a, Const):
        return _mk("mul", b, a)  # constants on the left (IEEE multiplication commutes exactly)
    if _is(a, 1):
        return b
    if _is(a, -1):
        return _mk("neg", b)
    if (na := _neg_of(a)) is not None:
        return _mk("neg", _mk("mul", na, b))
    if (nb := _neg_of(b)) is not None:
        return _mk("neg", _mk("mul", a, nb))
    # a constant factor moves to the front, where it folds with the others: c1 * (c2 * y) is
    # (c1 * c2) * y, and x * (c * y) is c * (x * y)
    if (fb := _const_factor(b)) is not None:
        if isinstance(a, Const):
            return _mk("mul", _mk("mul", a, fb[0]), fb[1])
        return _mk("mul", fb[0], _mk("mul", a, fb[1]))
    if not isinstance(a, Const) and (fa := _const_factor(a)) is not None:
        return _mk("mul", fa[0], _mk("mul", fa[1], b))
    return None


def _id_div(a: Expr, b: Expr) -> Expr | None:
    if _is(b, 1):
        return a
    if _is(b, -1):
        return _mk("neg", a)
    return None


def _id_neg(a: Expr) -> Expr | None:
    return _neg_of(a)


def _id_pow(a: Expr, b: Expr) -> Expr | None:
    if _is(b, 0):
        return Const(1.0)  # IEEE: x ** 0 is 1 for every x, NaN and inf included
    return a if _is(b, 1) else None


def _id_where(c: Expr, a: Expr, b: Expr) -> Expr | None:
    if isinstance(c, Const):
        return a if c.value else b
    if _same(a, b):
        return a
    return None


def _same(a: Expr, b: Expr) -> bool:
    """Equal expressions with equal constant kinds (``Const(1) == Const(1.0) == Const(True)`` in
    Python, but ``where(c, 1, 0)`` is int64 and ``where(c, 1.0, 0.0)`` a float)."""
    return a is b or (a == b and str(a) == str(b))


def _id_and(a: Expr, b: Expr) -> Expr | None:
    for x, y in ((a, b), (b, a)):
        if _is_bool(x, False):
            return x
        if _is_bool(x, True):
            return y
    return None


def _id_or(a: Expr, b: Expr) -> Expr | None:
    for x, y in ((a, b), (b, a)):
        if _is_bool(x, True):
            return x
        if _is_bool(x, False):
            return y
    return None


# the identities that simplification applies, per function: args -> a simpler equal expression
_IDENTITIES: dict[str, Callable[..., Expr | None]] = {
    "add": _id_add, "sub": _id_sub, "mul": _id_mul, "div": _id_div, "neg": _id_neg,
    "pow": _id_pow, "where": _id_where, "logical_and": _id_and, "logical_or": _id_or,
}


def _mk(fn: str, *args: Expr) -> Expr:
    """``Call(fn, args)``, constant-folded and simplified."""
    if all(isinstance(a, Const) for a in args):
        try:
            v = evaluate(Call(fn, args), ())
        except (EinjoinError, ArithmeticError, ValueError, TypeError):
            v = None  # an integer division by zero, say: left for run time to report
        if isinstance(v, (bool, int, float)):
            return Const(v)
    ident = _IDENTITIES.get(fn)
    out = ident(*args) if ident is not None else None
    return Call(fn, args) if out is None else out


def _c(v: float) -> Const:
    return Const(v)


def _add(a: Expr, b: Expr) -> Expr:
    return _mk("add", a, b)


def _sub(a: Expr, b: Expr) -> Expr:
    return _mk("sub", a, b)


def _mul(a: Expr, b: Expr) -> Expr:
    return _mk("mul", a, b)


def _div(a: Expr, b: Expr) -> Expr:
    return _mk("div", a, b)


def _where(c: Expr, a: Expr, b: Expr) -> Expr:
    return _mk("where", c, a, b)


def _sum(*terms: Expr | None) -> Expr | None:
    out: Expr | None = None
    for t in terms:
        if t is not None:
            out = t if out is None else _add(out, t)
    return out


def _or_zero(e: Expr | None) -> Expr:
    return _c(0.0) if e is None else e


# ---------------------------------------------------------------- the rules


def _unary(partial: Callable[[Call], Expr]) -> Rule:
    """The chain rule of a one-argument function: ``f'(a) * da`` (``partial`` gets the call
    ``f(a)`` itself, so a derivative that reuses the value, ``exp' = exp``, shares it)."""
    def rule(e: Call, t: Tangent) -> Expr | None:
        da = t(0)
        return None if da is None else _mul(partial(e), da)
    return rule


def _zero(e: Call, t: Tangent) -> Expr | None:
    """Piecewise constant (comparisons, logical ops) or cut (stop_gradient): a structural zero;
    the arguments are not differentiated at all."""
    return None


def _d_add(e: Call, t: Tangent) -> Expr | None:
    return _sum(t(0), t(1))


def _d_sub(e: Call, t: Tangent) -> Expr | None:
    da, db = t(0), t(1)
    if db is None:
        return da
    return _mk("neg", db) if da is None else _sub(da, db)


def _d_mul(e: Call, t: Tangent) -> Expr | None:
    a, b = e.args
    da, db = t(0), t(1)
    return _sum(None if da is None else _mul(da, b), None if db is None else _mul(a, db))


def _d_div(e: Call, t: Tangent) -> Expr | None:
    a, b = e.args
    da, db = t(0), t(1)
    ta = None if da is None else _div(da, b)
    if db is None:
        return ta
    tb = _mul(db, _div(_div(a, b), b))  # torch: -grad * ((a / b) / b), no b*b to overflow
    return _mk("neg", tb) if ta is None else _sub(ta, tb)


def _pow_const(a: Expr, c: Expr) -> Expr:
    """``a ** c`` for a constant ``c`` as torch's pow kernel computes it: the exponents 0.5 and
    -0.5 as sqrt and rsqrt (NaN at -inf, -0.0 / -inf at -0.0, where IEEE pow gives +inf / 0)."""
    if _is(c, 0.5):
        return _mk("sqrt", a)
    if _is(c, -0.5):
        return _mk("rsqrt", a)
    return _mk("pow", a, c)


def _d_pow(e: Call, t: Tangent) -> Expr | None:
    """torch's pow_backward: ``b * a**(b-1)``, masked to 0 where ``b == 0``; for the exponent
    ``a**b * log(a)``, masked to 0 where ``a == 0 and b >= 0`` (no 0 * -inf)."""
    a, b = e.args
    da, db = t(0), t(1)
    ta = tb = None
    if da is not None:
        c = simplify(b) if db is None else b  # x0 ** (1 / 2): a constant exponent
        if isinstance(c, Const):
            if not _is(c, 0):
                ta = _mul(_mul(c, _pow_const(a, _mk("sub", c, _c(1)))), da)
        else:
            ta = _where(_mk("eq", b, _c(0)), _c(0.0),
                        _mul(_mul(b, _mk("pow", a, _sub(b, _c(1)))), da))
    if db is not None:
        cond = _mk("logical_and", _mk("eq", a, _c(0)), _mk("ge", b, _c(0)))
        tb = _where(cond, _c(0.0), _mul(_mul(_mk("pow", a, b), _mk("log", a)), db))
    return _sum(ta, tb)


def _remainder(quotient: str) -> Rule:
    """torch's remainder / fmod backward: ``da - q(a, b) * db``, ``q`` the rounded quotient the
    remainder takes off (``floordiv`` for remainder, ``truncdiv`` for fmod)."""
    def rule(e: Call, t: Tangent) -> Expr | None:
        a, b = e.args
        da, db = t(0), t(1)
        if db is None:
            return da
        tb = _mul(_mk(quotient, a, b), db)
        return _mk("neg", tb) if da is None else _sub(da, tb)
    return rule


def _extremum(loses: str, beats: str) -> Rule:
    """max (min): torch's backward ``where(a == b, grad / 2, grad)`` masked to 0 where the
    argument loses; so a tie splits the gradient evenly and a NaN passes it to both."""
    def rule(e: Call, t: Tangent) -> Expr | None:
        a, b = e.args
        da, db = t(0), t(1)
        tie = _mk("eq", a, b)
        ta = None if da is None else _where(_mk(loses, a, b), _c(0.0),
                                            _where(tie, _mul(_c(0.5), da), da))
        tb = None if db is None else _where(_mk(beats, a, b), _c(0.0),
                                            _where(tie, _mul(_c(0.5), db), db))
        return _sum(ta, tb)
    return rule


def _d_relu(e: Call, t: Tangent) -> Expr | None:
    da = t(0)  # torch's threshold_backward: where(x <= 0, 0, grad); relu'(0) = 0
    return None if da is None else _where(_mk("le", e.args[0], _c(0)), _c(0.0), da)


def _d_where(e: Call, t: Tangent) -> Expr | None:
    da, db = t(1), t(2)  # the condition is piecewise constant: never differentiated
    if da is None and db is None:
        return None
    return _where(e.args[0], _or_zero(da), _or_zero(db))


def _sign(e: Call) -> Expr:
    a = e.args[0]
    # torch's sgn: 0 at 0 (and at NaN), so abs'(0) = 0
    return _where(_mk("gt", a, _c(0)), _c(1.0), _where(_mk("lt", a, _c(0)), _c(-1.0), _c(0.0)))


def _silu(e: Call) -> Expr:
    a = e.args[0]
    s = _mk("sigmoid", a)  # torch: sigmoid(x) * (1 + x * (1 - sigmoid(x)))
    return _mul(s, _add(_c(1.0), _mul(a, _sub(_c(1.0), s))))


_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _gelu(e: Call) -> Expr:
    a = e.args[0]
    # torch's gelu_backward (erf form): cdf(x) + x * pdf(x)
    cdf = _mul(_c(0.5), _add(_c(1.0), _mk("erf", _mul(a, _c(_SQRT1_2)))))
    pdf = _mul(_c(_INV_SQRT_2PI), _mk("exp", _mul(_c(-0.5), _mul(a, a))))
    return _add(cdf, _mul(a, pdf))


def _gelu_tanh(e: Call) -> Expr:
    a = e.args[0]
    # torch's gelu_backward (tanh form): 0.5 (1 + tanh u) + 0.5 x (1 - tanh² u) β (1 + 3κ x²)
    inner = _mul(_c(_BETA), _add(a, _mul(_c(_KAPPA), _mul(_mul(a, a), a))))
    th = _mk("tanh", inner)
    left = _mul(_c(0.5), _add(_c(1.0), th))
    inner_d = _mul(_c(_BETA), _add(_c(1.0), _mul(_c(3.0 * _KAPPA), _mul(a, a))))
    right = _mul(_mul(_mul(_c(0.5), a), _sub(_c(1.0), _mul(th, th))), inner_d)
    return _add(left, right)


def _tanh(e: Call) -> Expr:
    return _sub(_c(1.0), _mul(e, e))  # torch: 1 - tanh²


def _sigmoid(e: Call) -> Expr:
    return _mul(_sub(_c(1.0), e), e)  # torch: (1 - s) s


def _rsqrt(e: Call) -> Expr:
    return _mul(_c(-0.5), _mk("pow", e, _c(3.0)))  # torch: -0.5 * rsqrt(x)**3


def _reciprocal(e: Call) -> Expr:
    return _mk("neg", _mul(e, e))  # torch: -(1/x)²


def _d_sqrt(e: Call, t: Tangent) -> Expr | None:
    da = t(0)  # torch: grad / (2 * sqrt(x))
    return None if da is None else _div(da, _mul(_c(2.0), e))


def _d_log(e: Call, t: Tangent) -> Expr | None:
    da = t(0)
    return None if da is None else _div(da, e.args[0])


def _d_log1p(e: Call, t: Tangent) -> Expr | None:
    da = t(0)  # torch: grad / (1 + x)
    return None if da is None else _div(da, _add(e.args[0], _c(1.0)))


def _d_neg(e: Call, t: Tangent) -> Expr | None:
    da = t(0)
    return None if da is None else _mk("neg", da)


def _partials(pa: Callable[[Call], Expr], pb: Callable[[Call], Expr] | None) -> Rule:
    """The chain rule of a two-argument function: ``pa * da + pb * db`` (a structural zero tangent
    drops its term; ``pb`` None: the second argument gets torch's zeros)."""
    def rule(e: Call, t: Tangent) -> Expr | None:
        da = t(0)
        db = None if pb is None else t(1)
        return _sum(None if da is None else _mul(da, pa(e)),
                    None if db is None or pb is None else _mul(db, pb(e)))
    return rule


def _sq(a: Expr) -> Expr:
    return _mul(a, a)


def _atan2_recip(e: Call) -> Expr:
    a, b = e.args  # torch's atan2_backward: 1 / (a² + b²), 0 where that sum is 0 (the origin)
    den = _add(_sq(a), _sq(b))
    return _where(_mk("eq", den, _c(0)), _c(0.0), _div(_c(1.0), den))


def _d_xlogy(e: Call, t: Tangent) -> Expr | None:
    """torch's xlogy backward: ``xlogy(grad, y)``, 0 where ``x == 0 and y <= 0``, for x (so
    d/dx at x = 0 is log y for y > 0); ``grad * x / y`` for y."""
    x, y = e.args
    dx, dy = t(0), t(1)
    tx = None if dx is None else _where(_mk("logical_and", _mk("eq", x, _c(0)), _mk("le", y, _c(0))),
                                        _c(0.0), _mk("xlogy", dx, y))
    ty = None if dy is None else _div(_mul(dy, x), y)
    return _sum(tx, ty)


def _d_logit(e: Call, t: Tangent) -> Expr | None:
    da = t(0)  # torch's logit_backward (no eps): NaN outside [0, 1], else grad / (x (1 - x))
    if da is None:
        return None
    x = e.args[0]
    out = _mk("logical_or", _mk("lt", x, _c(0)), _mk("gt", x, _c(1)))
    return _where(out, _c(math.nan), _div(da, _mul(x, _sub(_c(1.0), x))))


def _one_over(den: Callable[[Call], Expr]) -> Callable[[Call], Expr]:
    return lambda e: _div(_c(1.0), den(e))


_NO_INT_GRAD = ("its result is piecewise constant and torch.floor_divide has no derivative "
                "either; detach its inputs with stop_gradient")

# one entry per function of FUNCTIONS (tests check the coverage): a forward-mode rule or why not
DERIVATIVES: dict[str, Rule | NoDerivative] = {
    "add": _d_add,
    "sub": _d_sub,
    "mul": _d_mul,
    "div": _d_div,
    "floordiv": NoDerivative(_NO_INT_GRAD),
    "mod": _remainder("floordiv"),
    "fmod": _remainder("truncdiv"),
    "truncdiv": _zero,  # only div(rounding_mode="trunc") makes it: torch's gradient is 0 there
    "bitand": _zero, "bitor": _zero, "bitxor": _zero, "bitnot": _zero, "lshift": _zero, "rshift": _zero,
    "gcd": _zero,
    "pow": _d_pow,
    "ipow": _d_pow,  # float arguments compute as pow; integers have no gradient to ask for
    "max": _extremum("lt", "gt"),
    "min": _extremum("gt", "lt"),
    "neg": _d_neg,
    "abs": _unary(_sign),
    "exp": _unary(lambda e: e),
    "log": _d_log,
    "log1p": _d_log1p,
    "expm1": _unary(lambda e: _add(e, _c(1.0))),  # torch: grad * (result + 1)
    "sqrt": _d_sqrt,
    "rsqrt": _unary(_rsqrt),
    "reciprocal": _unary(_reciprocal),
    "relu": _d_relu,
    "silu": _unary(_silu),
    "gelu": _unary(_gelu),
    "gelu_tanh": _unary(_gelu_tanh),
    "tanh": _unary(_tanh),
    "erf": _unary(lambda e: _mul(_c(_TWO_OVER_SQRT_PI),
                                 _mk("exp", _mk("neg", _mul(e.args[0], e.args[0]))))),
    "sigmoid": _unary(_sigmoid),
    "sin": _unary(lambda e: _mk("cos", e.args[0])),
    "cos": _unary(lambda e: _mk("neg", _mk("sin", e.args[0]))),
    # torch's derivatives.yaml formulas
    "sinh": _unary(lambda e: _mk("cosh", e.args[0])),
    "cosh": _unary(lambda e: _mk("sinh", e.args[0])),
    "asin": _unary(lambda e: _mk("rsqrt", _sub(_c(1.0), _sq(e.args[0])))),
    "acos": _unary(lambda e: _mk("neg", _mk("rsqrt", _sub(_c(1.0), _sq(e.args[0]))))),
    "atan": _unary(_one_over(lambda e: _add(_sq(e.args[0]), _c(1.0)))),
    "asinh": _unary(lambda e: _mk("rsqrt", _add(_sq(e.args[0]), _c(1.0)))),
    "acosh": _unary(lambda e: _mk("rsqrt", _sub(_sq(e.args[0]), _c(1.0)))),
    "atanh": _unary(_one_over(lambda e: _sub(_c(1.0), _sq(e.args[0])))),
    "logit": _d_logit,
    "atan2": _partials(lambda e: _mul(e.args[1], _atan2_recip(e)),
                       lambda e: _mul(_mk("neg", e.args[0]), _atan2_recip(e))),
    # copysign: result / a, 0 where a == 0; the sign argument gets 0 (torch's zeros_like)
    "copysign": _partials(lambda e: _where(_mk("eq", e.args[0], _c(0)), _c(0.0), _div(e, e.args[0])),
                          None),
    "xlogy": _d_xlogy,
    "logaddexp": _partials(_one_over(lambda e: _add(_c(1.0), _mk("exp", _sub(e.args[1], e.args[0])))),
                           _one_over(lambda e: _add(_c(1.0), _mk("exp", _sub(e.args[0], e.args[1]))))),
    "logaddexp2": _partials(
        _one_over(lambda e: _add(_c(1.0), _mk("pow", _c(2.0), _sub(e.args[1], e.args[0])))),
        _one_over(lambda e: _add(_c(1.0), _mk("pow", _c(2.0), _sub(e.args[0], e.args[1]))))),
    "where": _d_where,
    "lt": _zero, "le": _zero, "gt": _zero, "ge": _zero, "eq": _zero, "ne": _zero,
    "logical_not": _zero, "logical_and": _zero, "logical_or": _zero,
    "stop_gradient": _zero,
}
