"""Join expressions: each scalar function against torch, dtype rules, printing round trips,
aggregation facts, constant folding and half-precision dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej
from einjoin.ir import AGGS, FUNCTIONS, Arg, Call, Const
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import infer_dtype, parse_join, substitute

X = np.random.default_rng(0).uniform(-3, 3, 64)
Y = np.random.default_rng(1).uniform(0.5, 3, 64)
TORCH = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
    "max": torch.maximum, "min": torch.minimum, "neg": torch.neg, "abs": torch.abs,
    "exp": torch.exp, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal, "relu": torch.relu, "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos,
    "stop_gradient": torch.Tensor.detach,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
}
POSITIVE = {"log", "log1p", "sqrt", "rsqrt", "pow"}  # domains: first argument positive


@pytest.mark.parametrize("name", sorted(TORCH))
def test_function_matches_torch(name: str) -> None:
    f = FUNCTIONS[name]
    a = Y if name in POSITIVE else X
    args = [a, Y][: f.arity]
    ours = f.impl(*args)
    theirs = TORCH[name](*(torch.from_numpy(v) for v in args)).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_where_and_logical_functions() -> None:
    c = X > 0
    np.testing.assert_array_equal(FUNCTIONS["where"].impl(c, X, Y), torch.where(torch.from_numpy(c),
                                  torch.from_numpy(X), torch.from_numpy(Y)).numpy())
    np.testing.assert_array_equal(FUNCTIONS["logical_and"].impl(c, X < 1), c & (X < 1))
    np.testing.assert_array_equal(FUNCTIONS["logical_not"].impl(c), ~c)


@pytest.mark.parametrize("expr, dtypes, expected", [
    ("mul", ("float16", "float32"), "float32"),
    ("add", ("float16", "bfloat16"), "float32"),
    ("x0 * 0.5", ("bfloat16",), "bfloat16"),
    ("x0 > x1", ("float32", "float32"), "bool"),
    ("where(x0, x1, -inf)", ("bool", "float64"), "float64"),
    ("x0 + 1", ("int64",), "int64"),
    ("logical_not(x0)", ("bool",), "bool"),
    ("max", ("int64", "int64"), "int64"),
])
def test_dtype_rules(expr: str, dtypes: tuple[str, ...], expected: str) -> None:
    assert infer_dtype(parse_join(expr, len(dtypes)), dtypes) == expected


_leaf = st.one_of(st.integers(0, 2).map(Arg),
                  st.floats(-4, 4, allow_nan=False).map(lambda v: Const(round(v, 3))))


def _calls(children: st.SearchStrategy) -> st.SearchStrategy:
    names = sorted(n for n, f in FUNCTIONS.items() if f.rule in ("arith", "float"))
    return st.sampled_from(names).flatmap(
        lambda n: st.tuples(*[children] * FUNCTIONS[n].arity).map(lambda a: Call(n, a)))


@settings(max_examples=examples(200), deadline=None)
@given(st.recursive(_leaf, _calls, max_leaves=8))
def test_printing_round_trips(e) -> None:  # type: ignore[no-untyped-def]
    assert parse_join(str(e), 3) == e
    # and the printed form evaluates to the same numbers
    args = [X[:8], Y[:8], X[8:16]]
    with np.errstate(all="ignore"):
        a = np.asarray(evaluate(e, args), dtype=np.float64)
        b = np.asarray(evaluate(parse_join(str(e), 3), args), dtype=np.float64)
    np.testing.assert_array_equal(a, b)


def test_shared_subexpressions_are_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    tanh = FUNCTIONS["tanh"]

    def counted(x: np.ndarray) -> np.ndarray:
        calls.append(1)
        return np.tanh(x)

    monkeypatch.setitem(FUNCTIONS, "tanh", type(tanh)("tanh", 1, "float", counted))
    t = Call("tanh", (Arg(0),))
    e = Call("sub", (Const(1.0), Call("mul", (t, t))))  # tanh's derivative shares tanh(x0)
    np.testing.assert_allclose(evaluate(e, [X]), 1 - np.tanh(X) ** 2, rtol=1e-14)
    assert len(calls) == 1
    moved = substitute(e, [Call("neg", (Arg(1),))])  # renumbering keeps the sharing
    np.testing.assert_allclose(evaluate(moved, [X, Y]), 1 - np.tanh(-Y) ** 2, rtol=1e-14)
    assert len(calls) == 2
    # equal but distinct objects are not merged: their constants may differ in kind
    two = Call("add", (Call("where", (Arg(0), Const(1), Const(0))),
                       Call("where", (Arg(0), Const(1.0), Const(0.0)))))
    assert evaluate(two, [np.array([True])]).dtype == np.float64


def test_named_join_folds_over_inputs() -> None:
    assert str(parse_join("mul", 3)) == "x0 * x1 * x2"
    assert str(parse_join("max", 3)) == "max(max(x0, x1), x2)"
    assert str(parse_join("exp", 1)) == "exp(x0)"


def test_aggregation_facts_are_data() -> None:
    for name in ("sum", "prod", "max", "min"):
        agg = AGGS[name]
        assert agg.associative and agg.commutative
        x = np.random.default_rng(2).standard_normal(7)
        assert agg.combine(agg.identity, x[0]) == x[0]  # the identity really is one
        np.testing.assert_allclose(agg.reduce(x, (0,)), agg.combine(agg.reduce(x[:3], (0,)),
                                                                  agg.reduce(x[3:], (0,))))
    assert not AGGS["none"].reduces


def test_constant_subgraphs_fold_into_fills() -> None:
    s = 6
    mask = ej.causal_mask(s)
    bias = ej.where(mask, 0.0, float("-inf"))      # where over a fill -> fill
    window = bias[1:5, :]                           # select of a fill -> fill
    grown = window.expand(2, 4, s)                  # broadcast of a fill -> fill
    for t in (bias, window, grown):
        assert t.node.kind == "fill"
    want = np.where(np.tril(np.ones((s, s), bool)), 0.0, -np.inf)[1:5]
    np.testing.assert_array_equal(ej.reference(grown), np.broadcast_to(want, (2, 4, s)))
    # a fill meeting an input stays an einsum
    x = ej.input("x", (s, s))
    assert (x + bias).node.kind == "einsum"


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-2), ("bfloat16", 5e-2)])
def test_half_precision_matmul_softmax(dtype: str, tol: float) -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((8, 32)), rng.standard_normal((32, 5))
    x, w = ej.input("x", a.shape, dtype), ej.input("w", b.shape, dtype)
    y = ej.softmax(x @ w)
    npd = ej.ir.dtypes.numpy_dtype(dtype)
    feeds = {"x": a.astype(npd), "w": b.astype(npd)}
    ref = ej.reference(y, **feeds)
    assert ref.dtype == npd
    want = torch.softmax(torch.from_numpy(feeds["x"].astype(np.float32)) @
                         torch.from_numpy(feeds["w"].astype(np.float32)), -1).numpy()
    np.testing.assert_allclose(ref.astype(np.float32), want, atol=tol)
    blocked = ej.execute_blocked(y, lambda n: {lab: 2 for lab in ej.decomp.label_sizes(n)}, **feeds)
    np.testing.assert_allclose(blocked.astype(np.float32), want, atol=tol)


def test_a_deep_call_hashes_and_compares_without_recursing() -> None:
    # Call caches its hash and depth at construction: hash-consing a deep expression (or the
    # cycle collector freeing one deep in another recursion) no longer recurses
    import pickle
    import sys

    from einjoin.ir.scalar import MAX_DEPTH

    def chain(n: int) -> Call:
        e: Call = Call("exp", (Arg(0),))
        for k in range(n - 1):
            e = Call("add", (e, Const(k)))
        return e

    deep = chain(3 * sys.getrecursionlimit())
    assert deep.depth == 3 * sys.getrecursionlimit()
    assert hash(deep) == hash(deep) and deep == deep
    assert chain(5) == chain(5) and hash(chain(5)) == hash(chain(5)) and chain(5) != chain(6)
    small = chain(5)
    back = pickle.loads(pickle.dumps(small))
    assert back == small and hash(back) == hash(small) and back.depth == 5
    with pytest.raises(ej.ExpressionError, match=f"nests too deeply: calls {MAX_DEPTH + 1} deep"):
        parse_join(chain(MAX_DEPTH + 1), 1)
    assert parse_join(chain(MAX_DEPTH), 1).depth == MAX_DEPTH
    text = "x0" + " + 1" * (MAX_DEPTH + 1)  # Python's parser allows ~200 nested parentheses
    with pytest.raises(ej.ExpressionError, match=r"^join expression 'x0 \+ 1 \+ 1.*nests too deep"):
        parse_join(text, 1)
