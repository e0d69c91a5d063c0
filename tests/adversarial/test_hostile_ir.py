"""Issue 16: the IR and composites under hostile values, as properties (split from
``test_hostile.py``): join constants follow Python's numbers, printed joins parse back, random
einsum equations match numpy, composites match torch, constant folding never changes a value,
home-made aggregations are refused, and the models refuse bad arguments."""

from __future__ import annotations

import math
import warnings
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const, infer_dtype, parse_join

torch = pytest.importorskip("torch")

X = np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.6   # the values test_hostile.py feeds
I = np.array([0, 2, 1])


def _x() -> ej.Tensor:
    return ej.input("x", (3, 4))


def _i() -> ej.Tensor:
    return ej.input("i", (3,), "int64")

# derandomize: every run draws the same cases, so a CI run fails only where the code changed; the
# wider random sweeps are run by hand (/tmp/lead39/ir_fuzz.py: 6000 draws, session 40: 8000 more
# over ten dtypes, all passing)
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# ---------------------------------------------------------------- join constants (ir/scalar.py)


@pytest.mark.parametrize("join", ["x0 * 2 ** -1", "x0 * 2 ** 64", "x0 + -True", "x0 * (2 - 5) ** 3",
                                  "x0 + 3 / 0", "x0 * max(2, 2 ** 70) / 2 ** 70", "x0 - abs(-7)",
                                  "where(1 < 2, x0, 0.0)", "x0 * (10 ** 20 - 10 ** 20 + 1)"])
def test_constant_subexpressions_follow_python_numbers(join: str) -> None:
    """A join's constant-only subexpression is worth what Python says (numpy's int64 power
    raised on ``2 ** -1`` and wrapped ``2 ** 64`` to 0; ``-True`` raised a numpy TypeError)."""
    x = ej.input("v", (4,), "float64")
    xs = np.array([1.0, -2.0, 0.5, 3.0])
    got = ej.reference(ej.einsum("i->i", x, join=join), v=xs)
    py = eval(join.replace("x0", "XS").replace("max(", "_max(").replace("where(", "_where(")  # noqa: S307
              .replace("3 / 0", "INF"),
              {"XS": xs, "_max": max, "_where": lambda c, a, b: a if c else b, "INF": math.inf, "abs": abs})
    np.testing.assert_array_equal(got, py)


@pytest.mark.parametrize("value", [2 ** 63, -2 ** 63 - 1, 10 ** 30])
def test_int_constant_outside_int64_is_refused(value: int) -> None:
    """``int64 + 2**63`` raised a raw OverflowError at run time; now a DTypeError names it."""
    with pytest.raises(ej.DTypeError, match=str(value)):
        _i() + value


def test_where_of_constants_outside_int64_is_refused() -> None:
    """``where(c, 2**70, 0)`` is int64 (its branches are ints): it overflowed inside the kernel;
    ``where(c, 1, 0)`` (no dtype of its own, reading the condition) still works."""
    c = ej.input("c", (3,), "bool")
    with pytest.raises(ej.DTypeError, match=str(2 ** 70)):
        ej.where(c, 2 ** 70, 0)
    cs = np.array([True, False, True])
    np.testing.assert_array_equal(ej.reference(ej.where(c, 1, 0), c=cs),
                                  torch.where(torch.from_numpy(cs), 1, 0).numpy())


@pytest.mark.parametrize("expr", [Call("logical_and", (Call("eq", (Arg(0), Arg(1))), Call("lt", (Arg(0), Arg(1))))),
                                  Call("lt", (Call("lt", (Arg(0), Arg(1))), Arg(0))),
                                  Call("logical_or", (Const(False), Call("ne", (Arg(0), Arg(1))))),
                                  Call("pow", (Call("neg", (Arg(0),)), Arg(1)))])
def test_printed_join_parses_back_to_itself(expr: Any) -> None:
    """``(x0 == x1) & (x0 < x1)`` printed without its parentheses (Python's & binds tighter than
    ==, so the text meant something else, or did not parse); ``(-x0) ** x1`` likewise."""
    assert parse_join(str(expr), 2) == expr


def test_int_constant_inside_int64_wraps_as_torch() -> None:
    out = ej.reference(_i() * (-2 ** 63), i=I)
    expect = (torch.from_numpy(I) * (-2 ** 63)).numpy()
    np.testing.assert_array_equal(out, expect)


_leaf = st.one_of(st.integers(0, 1).map(Arg),
                  st.one_of(st.integers(-3, 3), st.floats(-4, 4, allow_nan=False), st.booleans(),
                            st.sampled_from([0.0, -0.0, math.inf, -math.inf])).map(Const))


def _calls(children: st.SearchStrategy) -> st.SearchStrategy:
    names = sorted(FUNCTIONS)
    return st.sampled_from(names).flatmap(
        lambda n: st.tuples(*[children] * FUNCTIONS[n].arity).map(lambda a: Call(n, a)))


@settings(max_examples=examples(150), deadline=None, derandomize=True)
@given(st.recursive(_leaf, _calls, max_leaves=6),
       st.sampled_from(["float32", "float64", "int64", "bool"]))
def test_any_join_expression_types_or_refuses(e: Any, dtype: str) -> None:
    """Random expression trees over every function: parse_join + infer_dtype either raise an
    EinjoinError, or the expression prints, parses back to itself and evaluates without a raw
    error (an integer division by zero is the EinjoinError torch's error becomes) to an array of
    the inferred dtype's kind."""
    try:
        expr = parse_join(e, 2)
        dt = infer_dtype(expr, (dtype, dtype))
    except ej.EinjoinError:
        return
    assert parse_join(str(expr), 2) == expr
    a = np.array([0, 1, 2, 3]).astype(ej.ir.dtypes.numpy_dtype(dtype))
    b = np.array([3, 0, 1, 2]).astype(ej.ir.dtypes.numpy_dtype(dtype))
    try:
        with np.errstate(all="ignore"):
            val = np.asarray(evaluate(expr, [a, b]))
    except ej.EinjoinError as err:  # integer // or % by zero: an error, as in torch
        assert "by zero" in str(err)
        return
    assert val.dtype.kind in {"bool": "b", "int": "iu", "float": "f"}[ej.ir.dtypes.kind(dt)] or \
        val.dtype == object or val.ndim == 0


# ---------------------------------------------------------------- einsum equations vs np.einsum


_LABELS = "abcijkAB"


@st.composite
def _equations(draw: Any) -> tuple[str, list[tuple[int, ...]]]:
    n = draw(st.integers(1, 3))
    terms, shapes = [], []
    # capital labels may be size 1 too: only '...' dims broadcast, a written capital does not
    sizes = {c: draw(st.integers(1, 3)) for c in _LABELS}
    ell = draw(st.lists(st.integers(1, 3), max_size=2))
    for _ in range(n):
        labels = draw(st.lists(st.sampled_from(_LABELS), max_size=3))
        use_ell = draw(st.booleans()) and bool(ell)
        k = draw(st.integers(0, len(ell))) if use_ell else 0
        shape = [sizes[c] for c in labels]
        # a wrong size now and then: the equation must then be refused
        if shape and draw(st.integers(0, 6)) == 0:
            shape[0] += 1  # (never makes a size 1)
        eshape = [draw(st.sampled_from([1, d])) for d in ell[len(ell) - k:]]
        pos = draw(st.integers(0, len(labels)))
        term = "".join(labels[:pos]) + ("..." if use_ell else "") + "".join(labels[pos:])
        terms.append(term)
        shapes.append(tuple(shape[:pos]) + tuple(eshape) + tuple(shape[pos:]))
    eq = ",".join(terms)
    mode = draw(st.sampled_from(["implicit", "explicit", "explicit", "junk"]))
    if mode == "explicit":
        seen = sorted({c for t in terms for c in t if c.isalpha()})
        out = draw(st.lists(st.sampled_from(seen), unique=True)) if seen else []
        if any("..." in t for t in terms) and draw(st.booleans()):
            out.insert(draw(st.integers(0, len(out))), "...")
        eq += "->" + "".join(out)
    elif mode == "junk":
        eq += draw(st.sampled_from(["->->", "-", ">", "->..", "->a.", ",", "->aa", "->z", " -> ",
                                    "->1", "->é"]))
    return eq, shapes


@settings(SETTINGS, max_examples=examples(150))
@given(_equations())
def test_einsum_equation_matches_numpy(case: tuple[str, list[tuple[int, ...]]]) -> None:
    """Random equations (implicit and explicit outputs, ``...`` anywhere, size-1 broadcast dims,
    wrong sizes, junk): einjoin agrees with np.einsum, or raises an EinjoinError."""
    eq, shapes = case
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in shapes]
    ts = [ej.input(f"t{k}", s, "float64") for k, s in enumerate(shapes)]
    try:
        expect = np.einsum(eq, *arrays)
    except Exception:  # numpy refuses: einjoin must refuse too, unless torch takes it
        try:  # (torch sums '...' dims missing from the output, which numpy refuses)
            expect = torch.einsum(eq, *map(torch.from_numpy, arrays)).numpy()
        except Exception:
            expect = None
    try:
        out = ej.einsum(eq, *ts)
    except ej.EinjoinError:
        return  # refusing is allowed (einjoin is stricter about some broadcasts)
    assert expect is not None, f"einjoin accepted {eq!r} {shapes}, which numpy and torch refuse"
    got = ej.reference(out, *arrays)
    np.testing.assert_allclose(got, expect, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- composites vs torch


@SETTINGS
@given(eps=st.one_of(st.floats(-1e-3, 1e3), st.sampled_from([0.0, math.inf, math.nan, 1e-30])),
       dim=st.integers(-2, 1))
def test_norms_and_softmax_match_torch(eps: float, dim: int) -> None:
    x, t = _x(), torch.from_numpy(X.astype(np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = ej.reference([ej.layer_norm(x, eps=eps), ej.rms_norm(x, eps=eps), ej.softmax(x, dim),
                            ej.log_softmax(x, dim)], x=X)
    F = torch.nn.functional
    expect = [F.layer_norm(t, (4,), eps=eps), t * torch.rsqrt((t * t).mean(-1, keepdim=True) + eps),
              F.softmax(t, dim), F.log_softmax(t, dim)]
    for g, e in zip(got, expect):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-5, equal_nan=True)


@SETTINGS
@given(base=st.floats(1.0001, 1e6), start=st.integers(-1000, 10 ** 6))
def test_rope_matches_torch(base: float, start: int) -> None:
    x = ej.input("r", (2, 5, 6), "float64")
    xs = np.random.default_rng(1).standard_normal((2, 5, 6))
    got = ej.reference(ej.rope(x, base=base, start=start), r=xs)
    t = torch.from_numpy(xs)
    inv = 1.0 / (base ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    ang = torch.outer(torch.arange(start, start + 5, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], -1)
    rot = torch.cat([-t[..., 3:], t[..., :3]], -1)
    np.testing.assert_allclose(got, (t * emb.cos() + rot * emb.sin()).numpy(), rtol=1e-6, atol=1e-6)


@SETTINGS
@given(scale=st.one_of(st.none(), st.floats(-4, 4), st.sampled_from([np.float32(0.25), 2])),
       causal=st.sampled_from([True, False, np.bool_(True)]))
def test_attention_matches_torch(scale: Any, causal: Any) -> None:
    q = ej.input("q", (2, 3, 4), "float64")
    qs = np.random.default_rng(2).standard_normal((2, 3, 4))
    got = ej.reference(ej.attention(q, q, q, causal=causal, scale=scale), q=qs)
    t = torch.from_numpy(qs)
    expect = torch.nn.functional.scaled_dot_product_attention(
        t, t, t, is_causal=bool(causal), scale=None if scale is None else float(scale))
    np.testing.assert_allclose(got, expect.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- constant folding (ir/fold.py)


def _to(dtype: str) -> Callable[[Any], Any]:
    return lambda t: t.to(dtype)


_FOLD_OPS: dict[str, Callable[[Any], Any]] = {
    "neg": lambda t: ~t if t.dtype == "bool" else -t,
    "plus_one": lambda t: t & True if t.dtype == "bool" else t + 1,
    "square": lambda t: t & t if t.dtype == "bool" else t * t,
    "select": lambda t: t[1:, 2:],
    "expand": lambda t: t.unsqueeze(0).expand(2, 3, 4),
    "transpose": lambda t: t.T,
    "reshape": lambda t: t.reshape(3, 1, 4),
    **{f"to_{d}": _to(d) for d in ("float64", "float32", "float16", "int64", "bool")},
}


@settings(SETTINGS, max_examples=examples(60))
@given(expr=st.sampled_from(["x0", "x1", "x0 - x1", "x0 * 0.1", "x0 >= x1", "sin(x0 * 0.3)",
                             "x0 * x1 + 3", "where(x0 > x1, x0, -x1)", "7", "-0.0", "1e30"]),
       dtype=st.sampled_from(["float64", "float32", "float16", "bfloat16", "int64", "bool"]),
       op=st.sampled_from(sorted(_FOLD_OPS)))
def test_folding_never_changes_values(expr: str, dtype: str, op: str) -> None:
    """An op on a fill folds into one fill: its values and dtype must be those of the same op on
    an input fed the fill's values (which does not fold)."""
    try:
        f = ej.fill((3, 4), expr, dtype)
        folded = _FOLD_OPS[op](f)
    except ej.EinjoinError:
        return
    fed = ej.input("fold_in", (3, 4), dtype)
    plain = _FOLD_OPS[op](fed)
    a = ej.reference(folded)
    b = ej.reference(plain, fold_in=ej.reference(f))
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- aggregations, printing, models


@pytest.mark.parametrize("agg", [ej.ir.Agg("sum", np.multiply, 0.0, True, True),
                                 ej.ir.Agg("logaddexp", np.logaddexp, -math.inf, True, True),
                                 ej.ir.Agg("max", np.maximum, 0.0, True, True)])
def test_home_made_agg_is_refused(agg: Any) -> None:
    """An Agg instance that is not einjoin's was taken as is: ``Agg("sum", np.multiply, ...)``
    summed in the kernel and would multiply partials across blocks."""
    with pytest.raises(ej.ExpressionError, match="aggregation"):
        ej.einsum("ij->i", _x(), agg=agg)


def test_registered_agg_instances_still_work() -> None:
    for name in ("sum", "max", "min", "prod"):
        got = ej.reference(ej.einsum("ij->i", _x(), agg=ej.ir.AGGS[name]), x=X)
        np.testing.assert_allclose(got, getattr(np, name)(X, axis=1), rtol=1e-6)


@pytest.mark.parametrize("name", ["%0", "a b", "a\nb", "x)", ""])
def test_printed_graph_quotes_odd_input_names(name: str) -> None:
    """An input named "%0" printed as the op %0; "a\nb" broke the line."""
    if not name:
        with pytest.raises(ej.EinjoinError):
            ej.input(name, (2,))
        return
    text = str(ej.Graph(ej.input(name, (2,)) * 2))
    assert repr(name) in text and len(text.splitlines()) == 4


@pytest.mark.parametrize("call, fragment", [
    (lambda: build("matmul", foo=1), "'foo'"),
    (lambda: build(["matmul"]), "unknown model"),
    (lambda: build("chain", n=4, length=0), "length"),
    (lambda: build("chain", n=4, length=1.5), "length"),
    (lambda: build("llama-block", d=64, heads=0, hidden=8, seq=4), "heads"),
    (lambda: build("llama-block", d=64, heads=4, kv_heads=0, hidden=8, seq=4), "kv_heads"),
    (lambda: build("llama-7b-layers", layers=-1, d=64, heads=4, hidden=8, seq=4), "layers"),
    (lambda: llama_block(ej.input("x2", (4, 8))), "(batch, seq, d)"),
    (lambda: llama_block(None), "(batch, seq, d)"),
    (lambda: zoo_example("nope"), "unknown zoo model"),
    (lambda: zoo_example("mlp", foo=1), "'foo'"),
    (lambda: zoo_example("llama", foo=1), "'foo'"),
])
def test_models_refuse_bad_arguments(call: Callable[[], Any], fragment: str) -> None:
    """ZeroDivisionError (heads=0), TypeError (unknown keyword, float length), KeyError (zoo
    name), ValueError (a 2-D x) before; kv_heads=0 and layers <= 0 were silently accepted."""
    with pytest.raises(ej.EinjoinError) as info:
        call()
    assert fragment in str(info.value)


def test_models_still_build_and_match_torch() -> None:
    from einjoin.models.zoo import example
    module, args = example("mlp", dim=8, hidden=16, layers=2, batch=4)
    fn = ej.from_torch(module, args)
    got = ej.compile(fn, 2, quiet=True).run(*args)
    np.testing.assert_allclose(np.asarray(got), module(*args).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert build("chain", n=4, length=1).shape == (4, 4)


def build(*a: Any, **kw: Any) -> Any:
    from einjoin.models.graphs import build as b
    return b(*a, **kw)


def llama_block(*a: Any, **kw: Any) -> Any:
    from einjoin.models.graphs import llama_block as f
    return f(*a, **kw)


def zoo_example(*a: Any, **kw: Any) -> Any:
    from einjoin.models.zoo import example
    return example(*a, **kw)
