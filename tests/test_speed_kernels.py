"""The speed paths of the numpy kernels give the same numbers as the plain ones: join expressions
evaluated with shared sub-expressions and in-place temporaries against a naive recursive
evaluation (bit for bit, inputs untouched), products without a contraction against np.einsum,
and the malloc tuning of the local backends."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej
from einjoin.ir import FUNCTIONS, Arg, Call, Const, ops
from einjoin.ir.kernels import einsum_kernel, matmul_route
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import Expr
from einjoin.runtime import backends


def naive(e: Expr, args: list[Any]) -> Any:
    """The expression's value by plain recursion: every call on fresh arrays, nothing shared."""
    if isinstance(e, Arg):
        return args[e.index]
    if isinstance(e, Const):
        return e.value
    vals = [naive(a, args) for a in e.args]
    if all(isinstance(v, (int, float, bool)) for v in vals):
        return evaluate(Call(e.fn, tuple(Const(v) for v in vals)), [])
    with np.errstate(all="ignore"):
        if e.fn in TORCH_FORMULA and isinstance(vals[0], np.ndarray) and vals[0].dtype.kind == "f":
            return TORCH_FORMULA[e.fn](vals[0])
        if e.fn == "pow" and type(vals[1]) in (int, float) and vals[1] in (2, 3) \
                and isinstance(vals[0], (np.ndarray, np.floating)) and vals[0].dtype in (np.float32, np.float64):
            return vals[0] * vals[0] if vals[1] == 2 else vals[0] * vals[0] * vals[0]  # torch's pow kernel
        return FUNCTIONS[e.fn].impl(*vals)


# sigmoid and silu are evaluated as torch computes them (numpy's vectorised exp; scipy's expit,
# FUNCTIONS' implementation, is not vectorised), and so are x ** 2 and x ** 3 of floats (products)
TORCH_FORMULA = {"sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "silu": lambda x: x / (1.0 + np.exp(-x))}


_FLOAT_FNS = sorted(n for n, f in FUNCTIONS.items()
                    if f.rule in ("arith", "float") and n not in ("ipow", "floordiv", "mod"))
_leaf = st.one_of(st.integers(0, 2).map(Arg), st.sampled_from([0.5, 1.0, -2.0, 3, 0.125]).map(Const))


def _calls(children: st.SearchStrategy) -> st.SearchStrategy:
    plain = st.sampled_from(_FLOAT_FNS).flatmap(
        lambda n: st.tuples(*[children] * FUNCTIONS[n].arity).map(lambda a: Call(n, a)))
    # where over a comparison: a function the in-place path leaves to its implementation
    where = st.tuples(children, children, children).map(
        lambda a: Call("where", (Call("gt", (a[0], Const(0.0))), a[1], a[2])))
    return st.one_of(plain, where)


def _shared(e: Expr) -> st.SearchStrategy:
    # reuse a sub-expression as an equal but distinct object (the derivative rules build such)
    return st.just(e) | st.just(Call("mul", (e, Call("add", (e, Const(1.0)))))) if isinstance(e, Call) else st.just(e)


@settings(max_examples=examples(300), deadline=None)
@given(st.recursive(_leaf, _calls, max_leaves=10).flatmap(_shared),
       st.sampled_from([np.float32, np.float64]),
       st.sampled_from([[(3, 4), (3, 4), (3, 4)], [(3, 4), (4,), (3, 1)], [(2, 1, 4), (3, 4), (1,)]]),
       st.integers(0, 2 ** 31))
def test_evaluate_equals_a_naive_evaluation_bit_for_bit(e: Expr, dtype: Any, shape: list[tuple[int, ...]],
                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    args = [rng.uniform(-2, 2, s).astype(dtype) for s in shape]
    before = [a.copy() for a in args]
    want = naive(e, args)
    got = evaluate(e, args)
    for a, b in zip(args, before):
        np.testing.assert_array_equal(a, b)  # no input was written in place
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_shared_sub_expression_is_computed_once_even_as_distinct_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    sig = FUNCTIONS["sigmoid"]

    def counted(x: np.ndarray) -> np.ndarray:
        calls.append(1)
        return sig.impl(x)

    monkeypatch.setitem(FUNCTIONS, "sigmoid", type(sig)("sigmoid", 1, "float", counted))
    # silu's derivative as the autodiff builds it: two equal sigmoid(x0) objects
    one_minus = Call("sub", (Const(1.0), Call("sigmoid", (Arg(0),))))
    e = Call("mul", (Call("sigmoid", (Arg(0),)), Call("add", (Const(1.0), Call("mul", (Arg(0), one_minus))))))
    x = np.linspace(-3, 3, 7)
    s = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(evaluate(e, [x]), s * (1 + x * (1 - s)), rtol=1e-14)
    assert len(calls) == 1


def test_constants_of_different_kinds_are_not_shared() -> None:
    c = np.array([True, False])
    two = Call("add", (Call("where", (Arg(0), Const(1), Const(0))), Call("where", (Arg(0), Const(1.0), Const(0.0)))))
    assert evaluate(two, [c]).dtype == np.float64
    neg = Call("add", (Call("div", (Const(1.0), Call("mul", (Arg(0), Const(0.0))))),
                       Call("div", (Const(1.0), Call("mul", (Arg(0), Const(-0.0)))))))
    np.testing.assert_array_equal(evaluate(neg, [np.array([1.0])]), naive(neg, [np.array([1.0])]))


@st.composite
def _products(draw: Any) -> tuple[Any, list[np.ndarray]]:
    """Two-input products with no contracted label (elementwise, broadcast and outer products)."""
    labels = "abcd"
    size = {lab: draw(st.integers(1, 4)) for lab in labels}
    lx = "".join(draw(st.permutations(labels))[: draw(st.integers(0, 4))])
    ly = "".join(draw(st.permutations(labels))[: draw(st.integers(0, 4))])
    out = "".join(draw(st.permutations(sorted(set(lx) | set(ly)))))
    dts = [draw(st.sampled_from(["float32", "float64"])) for _ in range(2)]
    a = ops.input_node("a", tuple(size[lab] for lab in lx), dts[0])
    b = ops.input_node("b", tuple(size[lab] for lab in ly), dts[1])
    z = ops.einsum_node([a, b], (lx, ly), out, "mul", "sum")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    return z, [rng.standard_normal(x.shape).astype(x.dtype) for x in (a, b)]


@settings(max_examples=examples(150), deadline=None)
@given(_products())
def test_products_without_a_contraction_equal_einsum(case: tuple[Any, list[np.ndarray]]) -> None:
    z, (x, y) = case
    route = matmul_route(z.op, [x.dtype, y.dtype])
    assert route.path == "matmul" and not route.k
    got = einsum_kernel(z.op, [x, y], z.dtype)
    (lx, ly), out = z.op.in_labels, z.op.out_labels
    want = np.einsum(f"{''.join(lx)},{''.join(ly)}->{''.join(out)}", x, y)  # one product per element: exact either way
    assert got.dtype == want.dtype and got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)


def test_tune_malloc_is_idempotent_and_runs_give_the_same_numbers() -> None:
    first = backends.tune_malloc()
    assert backends.tune_malloc() is first
    x = ej.input("x", (64, 32))
    w = ej.input("w", (32, 48))
    y = ej.sigmoid(x @ w) * (x @ w)
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 48)).astype(np.float32)
    want = ej.reference(y, x=xs, w=ws)
    for backend in ("sync", "threads"):
        got = ej.compile(y, devices=2, backend=backend, quiet=True).run(xs, ws)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fn", ["sigmoid", "silu"])
def test_sigmoid_and_silu_match_torch_and_do_not_depend_on_the_block(fn: str, dtype: Any) -> None:
    import torch

    x = np.concatenate([np.random.default_rng(0).uniform(-30, 30, 4099),
                        [0.0, -0.0, 100.0, -100.0, 1e-30, np.inf, -np.inf, np.nan]]).astype(dtype)
    e = Call(fn, (Arg(0),))
    got = evaluate(e, [x])
    want = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu}[fn](torch.from_numpy(x)).numpy()
    tiny = np.finfo(dtype).tiny  # expit gives denormals where 1 / (1 + inf) is 0, as in torch
    np.testing.assert_allclose(got, want, rtol=4 * np.finfo(dtype).eps, atol=tiny)
    # an element's value does not depend on where its block starts or ends
    for a, b in [(1, 17), (3, 1000), (7, 4099), (13, 14)]:
        np.testing.assert_array_equal(evaluate(e, [x[a:b]]), got[a:b])
    for i in (0, 5, 4100, 4105):  # a 0-d block (a scalar tensor) too
        np.testing.assert_array_equal(evaluate(e, [x[i].reshape(())]), got[i])


def test_a_local_move_hands_the_block_over_and_counts_the_planned_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from einjoin.exchange import TaskKind
    from einjoin.runtime.local import LocalSession

    handed: list[bool] = []
    real = LocalSession.execute

    def execute(self: LocalSession, t: Any) -> None:
        real(self, t)
        if t.kind is TaskKind.MOVE:
            src = self.stores[t.payload.src_device].get(t.reads[0])
            handed.append(self.stores[t.device].get(t.writes) is src)

    monkeypatch.setattr(LocalSession, "execute", execute)
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    y = ej.tanh(x @ w).sum(0)
    rng = np.random.default_rng(0)
    xs, ws = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 48)).astype(np.float32)
    prog = ej.compile(y, devices=2, backend="sync", quiet=True)
    np.testing.assert_allclose(prog.run(xs, ws), ej.reference(y, x=xs, w=ws), rtol=1e-5, atol=1e-5)
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    assert handed and all(handed), "a move copied its block"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_where_selects_the_same_bits_as_np_where(dtype: Any) -> None:
    rng = np.random.default_rng(3)
    special_values = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -2.5], dtype)
    a = np.concatenate([special_values, rng.standard_normal(500)]).astype(dtype).reshape(-1, 1)
    b = rng.standard_normal((1, 7)).astype(dtype)
    cond = rng.random((a.shape[0], 7)) < 0.5
    e = Call("where", (Arg(0), Arg(1), Arg(2)))
    for args in ([cond, a, b], [cond, a, 0.0], [cond, 0.0, b], [cond, -0.0, b], [cond, a, -np.inf],
                 [cond[:, :1], a, b], [cond, 2, b], [cond, a, a.astype(np.float16)], [cond, 1.0, 2.0]):
        want = np.where(*args)
        got = evaluate(e, list(args))
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def test_a_long_contraction_into_a_small_output_is_a_split_k_sum() -> None:
    """A weight gradient's shape ((64 x 2048) x (2048 x 64), float32) is summed over 512-long
    slices of k in order (bit for bit), close to the float64 product; shapes outside the rule
    (a short k, a narrow or a large output, a batch, float64) are one np.matmul, bit for bit."""
    from einjoin.ir import kernels
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2048, 64)).astype(np.float32).transpose(0, 2, 1)  # a transposed view
    y = rng.standard_normal((1, 2048, 64)).astype(np.float32)
    want = x[:, :, :512] @ y[:, :512]
    for s in range(512, 2048, 512):
        want = want + x[:, :, s:s + 512] @ y[:, s:s + 512]
    got = kernels._matmul(x, y)
    np.testing.assert_array_equal(got, want)
    exact = x.astype(np.float64) @ y.astype(np.float64)
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-3)
    # the einsum route reaches it: a weight gradient over (batch, seq)
    a, b = x[0].T.reshape(16, 128, 64), y[0].reshape(16, 128, 64)
    op = ops.einsum_node([ops.input_node("a", a.shape, "float32"), ops.input_node("b", b.shape, "float32")],
                         ("ABo", "ABi"), "oi", "mul", "sum").op
    np.testing.assert_array_equal(einsum_kernel(op, [a, b], "float32"), want[0])
    for xs, ys in [(x[:, :, :640], y[:, :640]), (x[:, :16], y[:, :, :16]), (x[:, :, :1024].repeat(2, 0),
                   y[:, :1024].repeat(2, 0)), (x.astype(np.float64), y.astype(np.float64))]:
        np.testing.assert_array_equal(kernels._matmul(xs, ys), np.matmul(xs, ys))


def test_dot_products_along_an_inner_batch_take_the_einsum_loop() -> None:
    """A norm's weight gradient ("abc,abc->c": a dot product per c, c innermost) is numpy's
    einsum loop, close to float64; with the batch outermost it stays a matmul, bit for bit."""
    rng = np.random.default_rng(6)
    x, y = (rng.standard_normal((8, 128, 64)).astype(np.float32) for _ in range(2))
    a, b = ops.input_node("a", x.shape, "float32"), ops.input_node("b", y.shape, "float32")
    op = ops.einsum_node([a, b], ("ijc", "ijc"), "c", "mul", "sum").op
    got = einsum_kernel(op, [x, y], "float32")
    np.testing.assert_array_equal(got, np.einsum("ijc,ijc->c", x, y))
    np.testing.assert_allclose(got, np.einsum("ijc,ijc->c", x.astype(np.float64), y.astype(np.float64)),
                               rtol=1e-4, atol=1e-4)
    xt, yt = x.reshape(1024, 64).T.copy(), y.reshape(1024, 64).T.copy()   # (c, k): the batch outermost
    at, bt = ops.input_node("at", xt.shape, "float32"), ops.input_node("bt", yt.shape, "float32")
    outer = ops.einsum_node([at, bt], ("ck", "ck"), "c", "mul", "sum").op
    np.testing.assert_array_equal(einsum_kernel(outer, [xt, yt], "float32"),
                                  np.matmul(xt[:, None, :], yt[:, :, None]).reshape(64))


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 400), st.integers(1, 40), st.sampled_from([(3,), (8,), (4, 5), (64,)]),
       st.sampled_from(["float32", "float64", "int64"]), st.integers(0, 2**31 - 1), st.booleans())
def test_scatter_add_in_rounds_adds_the_bits_np_add_at_adds(n: int, rows: int, rest: tuple[int, ...], dtype: str,
                                                           seed: int, skewed: bool) -> None:
    """The rows of one index meet the output in np.add.at's order whichever path runs (the rounds
    of _add_rounds, or np.add.at itself where an index repeats too often): the same bits, -0.0
    included; a row block of the output adds only the rows that fall in it."""
    from einjoin.ir.kernels import _add_rounds, scatter_add_kernel
    rng = np.random.default_rng(seed)
    idx = (rng.zipf(1.5, n) - 1) % rows if skewed else rng.integers(0, rows, n)
    scale = 10.0 ** rng.integers(-6, 6, (n,) + (1,) * len(rest))
    upd = (rng.standard_normal((n,) + rest) * scale).astype(dtype) if dtype != "int64" else \
        rng.integers(-5, 5, (n,) + rest)
    if dtype != "int64":
        upd[rng.random(n) < 0.1] = -0.0
    want = np.zeros((rows,) + rest, upd.dtype)
    np.add.at(want, idx, upd)
    got = scatter_add_kernel(upd, idx, 0, rows, rows, dtype)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    lo, hi = rows // 3, rows // 3 + max(1, rows // 2)
    part = scatter_add_kernel(upd, idx, lo, hi - lo, rows, dtype)
    assert part.tobytes() == want[lo:hi].tobytes()
    if _add_rounds(idx, rest) is not None:  # the rounds cover every position once
        assert sorted(np.concatenate(_add_rounds(idx, rest)).tolist()) == list(range(n))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_squares_and_cubes_are_torchs_products(dtype: Any) -> None:
    """x ** 2 and x ** 3 of floats are x * x and x * x * x, the bits torch's pow kernel gives
    (numpy's powf differs in the last bit now and then), special values included; another
    exponent, and integers, keep np.power."""
    import torch
    from einjoin.ir.scalar import parse_join
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-20, 20, 20000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(dtype)
    for c in ("2", "3", "2.0", "3.0"):
        got = evaluate(parse_join(f"x0 ** {c}", 1), [x])
        assert got.dtype == x.dtype
        assert got.tobytes() == (torch.from_numpy(x) ** float(c)).numpy().tobytes()
        assert evaluate(parse_join(f"x0 ** {c}", 1), [dtype(1.5)]) == dtype(1.5) ** int(float(c))
    with np.errstate(all="ignore"):
        assert evaluate(parse_join("x0 ** 0.5", 1), [x]).tobytes() == np.power(x, 0.5).tobytes()
    assert evaluate(parse_join("x0 ** 3.0", 1), [np.arange(4)]).tolist() == [0.0, 1.0, 8.0, 27.0]
