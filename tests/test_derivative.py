"""Symbolic derivatives of join expressions (einjoin.ir.derivative): every rule against central
finite differences in float64 on random compositions, against torch.autograd at kinks and ties,
exact structure of the simple cases, dtypes, and the errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

from einjoin.errors import ExpressionError
from einjoin.ir.derivative import DERIVATIVES, NoDerivative, derivative, simplify, uses_arg, vjp_join
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const, Expr, infer_dtype, parse_join

# functions that differentiate on floats, and where their arguments must lie to be smooth there
SMOOTH = {"add", "sub", "mul", "div", "neg", "exp", "log", "log1p", "expm1", "sqrt", "rsqrt",
          "reciprocal", "pow",
          "ipow", "silu", "gelu", "gelu_tanh", "tanh", "erf", "sigmoid", "sin", "cos", "abs",
          "relu", "max", "min", "mod"}
PIECEWISE = {"where", "lt", "le", "gt", "ge", "eq", "ne", "logical_not", "logical_and",
             "logical_or", "stop_gradient"}


def _f(e: Expr, args: list[np.ndarray]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.broadcast_to(np.asarray(evaluate(e, args), dtype=np.float64), args[0].shape)


def _fd(e: Expr, i: int, args: list[np.ndarray], h: float) -> np.ndarray:
    """Central differences in x_i; stop_gradient's argument is held at its value at ``args``."""
    held: list[np.ndarray] = []

    def hold(x: Expr) -> Expr:
        if isinstance(x, Call) and x.fn == "stop_gradient":
            held.append(_f(x, args))
            return Arg(len(args) + len(held) - 1)
        return Call(x.fn, tuple(hold(a) for a in x.args)) if isinstance(x, Call) else x

    e = hold(e)
    args = args + held
    up = [a + h if k == i else a for k, a in enumerate(args)]
    down = [a - h if k == i else a for k, a in enumerate(args)]
    out: np.ndarray = (_f(e, up) - _f(e, down)) / (2 * h)
    return out


# ---------------------------------------------------------------- random expressions

# a random expression keeps its values in a tame range: each function takes arguments shaped to
# its domain (log of a positive thing), so the finite differences see a smooth function
_TAME = {
    "log": lambda a: Call("add", (Call("mul", (a, a)), Const(0.5))),
    "sqrt": lambda a: Call("add", (Call("mul", (a, a)), Const(0.5))),
    "rsqrt": lambda a: Call("add", (Call("mul", (a, a)), Const(0.5))),
    "reciprocal": lambda a: Call("add", (Call("mul", (a, a)), Const(0.5))),
    "exp": lambda a: Call("tanh", (a,)),
}


def _node(name: str, kids: tuple[Expr, ...]) -> Expr:
    """``name`` over (some of) three drawn sub-expressions, its arguments shaped to its domain."""
    if name in _TAME:
        return Call(name, (_TAME[name](kids[0]),))
    if name == "div":
        return Call("div", (kids[0], Call("add", (Call("mul", (kids[1], kids[1])), Const(0.5)))))
    if name in ("pow", "ipow"):
        base = Call("add", (Call("mul", (kids[0], kids[0])), Const(0.5)))
        return Call(name, (base, Call("tanh", (kids[1],))))
    if name == "mod":
        return Call("mod", (kids[0], Const(7.5)))  # far from the jumps for tame arguments
    if name == "where":
        return Call("where", (Call("gt", (kids[0], Const(0.25))), kids[1], kids[2]))
    if name in ("lt", "le", "gt", "ge", "eq", "ne"):
        return Call("where", (Call(name, (kids[0], kids[1])), kids[0], kids[1]))
    if name in ("logical_not", "logical_and", "logical_or"):
        c = Call("gt", (kids[0], Const(0.0)))
        cond = Call(name, (c,) if name == "logical_not" else (c, Call("lt", (kids[1], Const(0.5)))))
        return Call("where", (cond, kids[0], kids[1]))
    return Call(name, kids[:FUNCTIONS[name].arity])


_leaf = st.one_of(st.integers(0, 2).map(Arg),
                  st.sampled_from([0.5, -1.25, 2.0, 3]).map(Const))


def _calls(children: st.SearchStrategy[Expr]) -> st.SearchStrategy[Expr]:
    names = sorted(SMOOTH | PIECEWISE)
    return st.tuples(st.sampled_from(names), children, children, children).map(
        lambda t: _node(t[0], t[1:]))


_exprs = st.recursive(_leaf, _calls, max_leaves=6)


def _kinks(e: Expr, args: list[np.ndarray]) -> np.ndarray:
    """Points near a non-smooth place of any sub-expression (a tie of max, 0 of abs/relu, the
    condition of a where or comparison flipping, a jump of mod): excluded from the check."""
    bad = np.zeros(args[0].shape, bool)
    if not isinstance(e, Call):
        return bad
    vals: list[Any] = [_f(a, args) if not _is_bool(a) else None for a in e.args]
    if e.fn in ("abs", "relu"):
        bad |= np.abs(vals[0]) < 1e-3
    if e.fn in ("max", "min", "lt", "le", "gt", "ge", "eq", "ne"):
        bad |= np.abs(vals[0] - vals[1]) < 1e-3
    if e.fn == "mod":
        r = np.mod(vals[0], vals[1])
        bad |= (r < 1e-3) | (vals[1] - r < 1e-3)
    if e.fn == "gt" and isinstance(e.args[1], Const):
        bad |= np.abs(vals[0] - e.args[1].value) < 1e-3
    if e.fn == "lt" and isinstance(e.args[1], Const):
        bad |= np.abs(vals[0] - e.args[1].value) < 1e-3
    for a in e.args:
        bad |= _kinks(a, args)
    return bad


def _is_bool(e: Expr) -> bool:
    return isinstance(e, Call) and FUNCTIONS[e.fn].rule in ("compare", "logical")


@pytest.mark.parametrize("name", sorted(SMOOTH | PIECEWISE))
@settings(max_examples=examples(25), deadline=None)
@given(st.tuples(_exprs, _exprs, _exprs), st.integers(0, 2), st.integers(0, 2 ** 31))
def test_derivative_matches_finite_differences(name: str, kids: tuple[Expr, Expr, Expr], i: int,
                                               seed: int) -> None:
    """``name`` over random sub-expressions (themselves random compositions of every function):
    the derivative against central differences in float64, away from kinks."""
    e = _node(name, kids)
    rng = np.random.default_rng(seed)
    args = [rng.uniform(-1.5, 1.5, 64) for _ in range(3)]
    d = derivative(e, i, ("float64",) * 3)
    if not uses_arg(e, i):
        assert d == Const(0.0)
    h = 1e-6
    want = _fd(e, i, args, h)
    got = _f(d, args)
    ok = ~_kinks(e, args) & np.isfinite(want)
    # the finite difference is noisy where the function is steep: scale by the values around
    scale = 1 + np.abs(_f(e, args)) + np.abs(got)
    err = np.abs(got[ok] - want[ok]) / scale[ok]
    assert np.all(err < 1e-4), (str(e), str(d), float(err.max()) if err.size else 0.0)
    # vjp_join is the derivative with the cotangent threaded through
    g = rng.uniform(-2, 2, 64)
    v = vjp_join(e, i, Arg(3), ("float64",) * 4)
    np.testing.assert_allclose(_f(v, args + [g])[ok], (got * g)[ok], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SMOOTH - {"mod"}))
def test_each_function_against_torch(name: str) -> None:
    """Every differentiable function's partials against torch.autograd in float64, at random
    points of its domain (kinks included for abs, relu, max, min: the tie rules)."""
    rng = np.random.default_rng(5)
    arity = FUNCTIONS[name].arity
    pos = name in ("log", "sqrt", "rsqrt", "pow", "ipow")
    vals = [rng.uniform(0.2, 2, 32) if pos else rng.uniform(-2, 2, 32) for _ in range(arity)]
    if name in ("abs", "relu"):
        vals[0][:4] = 0.0
    if name in ("max", "min"):
        vals[1][:6] = vals[0][:6]
    ts = [torch.tensor(v, requires_grad=True) for v in vals]
    tfn: Any = {"ipow": torch.pow, "max": torch.maximum, "min": torch.minimum,
                "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
                "gelu_tanh": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
                }.get(name) or getattr(torch, name)
    y = tfn(*ts)
    grads = torch.autograd.grad(y.sum(), ts)
    expr = Call(name, tuple(Arg(k) for k in range(arity)))
    for k in range(arity):
        got = _f(derivative(expr, k), vals)
        np.testing.assert_allclose(got, grads[k].numpy(), rtol=1e-12, atol=1e-14, err_msg=f"{name} d{k}")


@pytest.mark.parametrize("name, a, b", [
    ("max", 1.0, 1.0), ("min", 1.0, 1.0), ("max", 2.0, 1.0), ("min", 2.0, 1.0),
    ("pow", 0.0, 0.0), ("pow", 0.0, 2.0), ("pow", 0.0, 0.5), ("pow", -2.0, 3.0),
    ("mod", 3.5, 2.0), ("mod", -3.5, 2.0),
])
def test_kinks_and_edges_match_torch(name: str, a: float, b: float) -> None:
    ta, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (a, b))
    tfn: Any = {"max": torch.maximum, "min": torch.minimum, "pow": torch.pow,
                "mod": torch.remainder}[name]
    want = [g.item() for g in torch.autograd.grad(tfn(ta, tb), (ta, tb))]
    expr = Call(name, (Arg(0), Arg(1)))
    args = [np.array([a]), np.array([b])]
    got = [float(_f(derivative(expr, k), args)[0]) for k in (0, 1)]
    np.testing.assert_array_equal(got, want)
    # max(x, x): the two halves of a tie add up to the whole gradient
    if name in ("max", "min"):
        assert float(_f(derivative(Call(name, (Arg(0), Arg(0))), 0), args)[0]) == 1.0


def test_constant_exponent_matches_torch() -> None:
    x = torch.tensor([0.0, 1.5, -2.0], dtype=torch.float64, requires_grad=True)
    for c in (0.0, 1.0, 2.0, 0.5, -1.0, 3):
        want = torch.autograd.grad((x ** c).sum(), x)[0].numpy()
        got = _f(derivative(Call("pow", (Arg(0), Const(c))), 0), [x.detach().numpy()])
        np.testing.assert_allclose(got, want, rtol=1e-14, err_msg=f"x ** {c}")  # inf, nan alike


def test_masked_cotangent_stays_zero() -> None:
    # torch puts grad inside the mask: an infinite cotangent at a masked position gives 0
    for text, x in (("relu(x0)", -1.0), ("max(x0, 2.0)", 1.0), ("where(x0 > 0, x0, 1.0)", -1.0)):
        v = vjp_join(parse_join(text, 1), 0, Arg(1))
        assert float(_f(v, [np.array([x]), np.array([np.inf])])[0]) == 0.0, text


# ---------------------------------------------------------------- structure


@pytest.mark.parametrize("text, i, want", [
    ("x0 * x1", 0, "x1"),
    ("x0 * x1", 1, "x0"),
    ("x0 + x1", 1, "1.0"),
    ("x0 - x1", 1, "-1.0"),
    ("x0 * 3 * x1", 0, "3.0 * x1"),
    ("2 * (3 * x0)", 0, "6.0"),
    ("x0 / 4", 0, "0.25"),
    ("x0 ** 2", 0, "2 * x0"),
    ("x0 ** 3.0", 0, "3.0 * x0 ** 2.0"),
    ("x0 ** 1", 0, "1.0"),
    ("x0 ** (1 / 2)", 0, "0.5 * rsqrt(x0)"),
    ("-(-x0)", 0, "1.0"),
    ("exp(x0)", 0, "exp(x0)"),
    ("log(x0)", 0, "1.0 / x0"),
    ("sin(x0)", 0, "cos(x0)"),
    ("cos(x0)", 0, "-sin(x0)"),
    ("x0 * x0", 0, "2 * x0"),
    ("x0 * x0 * 0.5", 0, "x0"),
    ("where(x1 > 0, x0, 0.0)", 0, "where(x1 > 0, 1.0, 0.0)"),
    ("where(x0 > 0, x1, 2.0)", 0, "0.0"),
    ("x0 > x1", 0, "0.0"),
    ("stop_gradient(x0) * x0", 0, "stop_gradient(x0)"),
    ("stop_gradient(x0 * x1)", 1, "0.0"),
    ("2 ** x0", 0, f"{math.log(2)!r} * 2 ** x0"),
])
def test_exact_structure(text: str, i: int, want: str) -> None:
    e = parse_join(text, 2)
    d = derivative(e, i)
    assert str(d) == want
    assert simplify(d) == d  # derivatives come out simplified


def test_structural_zero_and_unit() -> None:
    assert derivative(parse_join("x0 * x1", 2), 0) == Arg(1)
    assert derivative(parse_join("x0 + x1", 2), 1) == Const(1)
    # an expression that does not read x_i: exactly 0, even with functions that have no derivative
    assert derivative(parse_join("exp(x0) // x1 + floordiv(x0, 2.0)", 3), 2) == Const(0)
    # floordiv inside a condition is never differentiated
    assert str(derivative(parse_join("where(x0 // 2 > 0, x0, 0.0)", 1), 0)) == \
        "where(x0 // 2 > 0, 1.0, 0.0)"


def test_zero_factors_are_kept_unless_structural() -> None:
    # x0 * 0 differentiates to the constant 0; sqrt's rsqrt(0) = inf times it is NaN, as in torch
    e = parse_join("sqrt(x0 * 0)", 1)
    x = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(torch.sqrt(x * 0), x)[0].item()
    got = float(_f(derivative(e, 0), [np.array([1.0])])[0])
    assert math.isnan(want) and math.isnan(got)
    assert str(simplify(parse_join("x0 * 0", 1))) == "0 * x0"
    assert simplify(parse_join("2 * 0 + x0", 1)) == Arg(0)


@pytest.mark.parametrize("text, want", [
    ("x0 * 1", "x0"), ("1 * x0", "x0"), ("x0 + 0", "x0"), ("0 + x0", "x0"), ("x0 - 0", "x0"),
    ("0 - x0", "-x0"), ("-(-x0)", "x0"), ("x0 ** 1", "x0"), ("x0 / 1", "x0"), ("x0 * -1", "-x0"),
    ("x0 + -x1", "x0 - x1"), ("x0 - -x1", "x0 + x1"), ("-x0 * x1", "-(x0 * x1)"),
    ("2 * 3 + x0", "6 + x0"), ("where(x0 > 1, x1, x1)", "x1"), ("where(1 > 0, x0, x1)", "x0"),
    ("(x0 > 0) & (1 < 0)", "False"), ("(x0 > 0) | (1 < 0)", "x0 > 0"), ("x0 // 0", "x0 // 0"),
    ("sqrt(4.0) * x0", "2.0 * x0"), ("x0 * 2 * 3", "6 * x0"), ("x0 + x0", "2 * x0"),
    ("x0 * (2 * x1)", "2 * (x0 * x1)"), ("(x0 * 0.5) * x1", "0.5 * (x0 * x1)"),
    ("where(x0 > 0, 1, 0) + where(x0 > 0, 1.0, 0.0)", "where(x0 > 0, 1, 0) + where(x0 > 0, 1.0, 0.0)"),
])
def test_simplify(text: str, want: str) -> None:
    e = parse_join(text, 2)
    s = simplify(e)
    assert str(s) == want
    # and it computes the same numbers
    rng = np.random.default_rng(3)
    args = [rng.uniform(-2, 2, 16), rng.uniform(-2, 2, 16)]
    np.testing.assert_allclose(_f(s, args), _f(e, args), rtol=1e-15, atol=0)


@settings(max_examples=examples(150), deadline=None)
@given(_exprs)
def test_simplify_keeps_values(e: Expr) -> None:
    rng = np.random.default_rng(4)
    args = [rng.uniform(-1.5, 1.5, 16) for _ in range(3)]
    s = simplify(e)
    assert simplify(s) == s
    np.testing.assert_allclose(_f(s, args), _f(e, args), rtol=1e-12, atol=1e-12, equal_nan=True)


# ---------------------------------------------------------------- dtypes and errors


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("text", ["x0 * x1", "exp(x0 - x1) / x1", "gelu(x0) + silu(x1)",
                                  "relu(x0) * 0.5", "max(x0, x1) ** 2", "rsqrt(x0 * x0 + 1e-6)",
                                  "where(x0 > x1, tanh(x0), sigmoid(x1))", "gelu_tanh(x0)",
                                  "x0 ** x1", "abs(x0)", "erf(x0)"])
def test_gradient_joins_keep_the_input_dtype(dtype: str, text: str) -> None:
    """Float constants are weak: no derivative constant promotes float16/32 to float64. The
    cotangent types the join (relu' alone is where(x0 <= 0, 0.0, 1.0): constants only)."""
    e = parse_join(text, 2)
    for i in (0, 1):
        if not uses_arg(e, i):
            continue
        v = vjp_join(e, i, Arg(2), (dtype,) * 3)
        assert infer_dtype(v, (dtype,) * 3) == dtype, str(v)
        d = derivative(e, i, (dtype,) * 2)
        if dtype == "float32" or uses_arg(d, 0) or uses_arg(d, 1):
            assert infer_dtype(d, (dtype,) * 2) in (dtype, "float32"), str(d)


def test_integer_and_bool_inputs_have_no_gradient() -> None:
    e = parse_join("x0 + x1", 2)
    with pytest.raises(ExpressionError, match="gradients need float inputs, x1 is int64"):
        derivative(e, 1, ("float32", "int64"))
    with pytest.raises(ExpressionError, match="x0 is bool"):
        vjp_join(parse_join("where(x0, x1, 0.0)", 2), 0, Arg(2), ("bool", "float32", "float32"))


def test_functions_without_derivative_are_named() -> None:
    with pytest.raises(ExpressionError, match="floordiv has no derivative"):
        derivative(parse_join("x0 // x1 + x0", 2), 1)


def test_every_function_has_a_rule_or_a_reason() -> None:
    assert set(DERIVATIVES) == set(FUNCTIONS)
    none = {n for n, r in DERIVATIVES.items() if isinstance(r, NoDerivative)}
    assert none == {"floordiv"}
    # issue 39's integer functions and trunc division (their rules are
    # tests/adversarial/test_issue39_intops.py's)
    bits = {"fmod", "truncdiv", "bitand", "bitor", "bitxor", "bitnot", "lshift", "rshift"}
    # session 40's transcendental functions (checked against torch.autograd, edge points included,
    # by tests/adversarial/test_s40_newops.py)
    trig = {"sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "logit", "atan2",
            "copysign", "xlogy", "logaddexp", "logaddexp2", "gcd"}
    assert SMOOTH | PIECEWISE | none | bits | trig == set(FUNCTIONS)


def test_stop_gradient_is_an_identity_function() -> None:
    e = parse_join("stop_gradient(x0)", 1)
    assert e == Call("stop_gradient", (Arg(0),)) and str(e) == "stop_gradient(x0)"
    x = np.arange(4.0)
    out = evaluate(e, [x])
    assert isinstance(out, np.ndarray) and out is not x
    np.testing.assert_array_equal(out, x)
    assert infer_dtype(e, ("float16",)) == "float16"
    assert derivative(e, 0) == Const(0)


def test_deep_expressions_raise_cleanly() -> None:
    e: Expr = Arg(0)
    for _ in range(5000):
        e = Call("exp", (e,))
    with pytest.raises(ExpressionError, match="nests too deeply"):
        derivative(e, 0)


def test_uses_arg() -> None:
    e = parse_join("where(x2 > 0, x0, 1.0)", 3)
    assert [uses_arg(e, i) for i in range(4)] == [True, False, True, False]
