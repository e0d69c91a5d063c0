"""The einsum kernel's ``pick`` route (a one-hot pick, ``where(i == r, v, 0)`` summed over ``r``'s
label: a cross-entropy's target logit): the same bits as the join route it replaces, on whole
tensors, cut blocks and the runtime, and the join route where ``r`` is no run of ints."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej
from einjoin.frontend.tensor import Tensor
from einjoin.ir import ops
from einjoin.ir.evaluate import evaluate
from einjoin.ir.kernels import align, einsum_kernel, matmul_route


def _join_route(op, xs):  # the join route as einsum_kernel runs it, for reference
    order = op.all_labels
    aligned = [align(x, ls, order) for x, ls in zip(xs, op.in_labels)]
    val = np.broadcast_to(np.asarray(evaluate(op.join, aligned)), tuple(max(a.shape[d] for a in aligned)
                                                                         for d in range(len(order))))
    return op.agg.reduce(val, tuple(range(len(op.out_labels), len(order))))


def _pick_node(n_rows: int, n_cls: int, join: str = "where(x1 == x2, x0, 0)", vdtype: str = "float32"):
    v = ops.input_node("v", (n_rows, n_cls), vdtype)
    t = ops.input_node("t", (n_rows,), "int64")
    r = ops.input_node("r", (n_cls,), "int64")
    return ops.einsum_node([v, t, r], ("ab", "a", "b"), "a", join, "sum")


@pytest.mark.parametrize("start", [0, 3, -2])
@pytest.mark.parametrize("vdtype", ["float32", "float64", "float16"])
def test_a_pick_is_the_join_routes_sum_bit_for_bit(start: int, vdtype: str) -> None:
    rng = np.random.default_rng(start + 7)
    node = _pick_node(9, 6, vdtype=vdtype)
    assert matmul_route(node.op, ["float32", "int64", "int64"]).path == "pick"
    v = rng.standard_normal((9, 6)).astype(vdtype)
    v[0, :] = -0.0
    v[1, 2], v[2, 1], v[3, 4] = np.nan, np.inf, -np.inf
    t = np.array([1, 2, 1, 4, -100, 5, 8, 0, 3], np.int64)  # -100, 8: no class in some blocks
    r = np.arange(start, start + 6, dtype=np.int64)
    got = einsum_kernel(node.op, [v, t, r], node.dtype)
    want = _join_route(node.op, [v.astype(np.float32) if vdtype == "float16" else v, t, r]).astype(node.dtype)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_arguments_in_any_order_and_a_range_that_is_no_run_of_ints() -> None:
    rng = np.random.default_rng(0)
    v = ops.input_node("v", (4, 5), "float32")
    t = ops.input_node("t", (5,), "int64")
    r = ops.input_node("r", (4,), "int64")
    node = ops.einsum_node([r, v, t], ("b", "ba", "a"), "a", "where(x0 == x2, x1, 0.0)", "sum")
    assert matmul_route(node.op, ["int64", "float32", "int64"]).path == "pick"
    vv, tv = rng.standard_normal((4, 5)).astype(np.float32), np.array([0, 3, 2, 9, 1], np.int64)
    for rv in (np.arange(4, dtype=np.int64), np.array([3, 0, 2, 1], np.int64), np.array([1, 1, 2, 2], np.int64)):
        got = einsum_kernel(node.op, [rv, vv, tv], "float32")
        assert np.array_equal(got, _join_route(node.op, [rv, vv, tv]))
    # not a pick: a float index, another constant, a second summed label
    assert matmul_route(node.op, ["int64", "float32", "float32"]).path == "join"
    other = ops.einsum_node([r, v, t], ("b", "ba", "a"), "a", "where(x0 == x2, x1, 1.0)", "sum")
    assert matmul_route(other.op, ["int64", "float32", "int64"]).path == "join"
    whole = ops.einsum_node([r, v, t], ("b", "ba", "a"), "", "where(x0 == x2, x1, 0.0)", "sum")
    assert matmul_route(whole.op, ["int64", "float32", "int64"]).path == "join"


@pytest.mark.parametrize("spec", [{"b": 3}, {"a": 2, "b": 2}, {"a": 4}])
def test_blocks_and_the_runtime_give_the_whole_pick(spec: dict[str, int]) -> None:
    rng = np.random.default_rng(1)
    logits = ej.input("logits", (8, 12))
    target = ej.input("target", (8,), "int64")
    iota = ej.fill((12,), "x0", "int64")
    picked = Tensor(ops.einsum_node([logits.node, target.node, iota.node], ("ab", "a", "b"), "a",
                                    "where(x1 == x2, x0, 0)", "sum"))
    lv = rng.standard_normal((8, 12)).astype(np.float32)
    tv = np.array([0, 11, 5, -100, 3, 12, 7, 7], np.int64)
    want = np.where((tv >= 0) & (tv < 12), lv[np.arange(8), np.clip(tv, 0, 11)], 0).astype(np.float32) + 0
    (got,) = ej.execute_blocked([picked], {picked: spec}, logits=lv, target=tv)
    assert np.array_equal(got, want)
    prog = ej.compile([picked], devices=ej.local(2), quiet=True)
    (ran,) = prog.run(logits=lv, target=tv)
    assert np.array_equal(ran, want)
