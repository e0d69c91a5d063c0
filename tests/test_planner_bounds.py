"""The lower bound's three regimes and batch rule, contraction classification, and the cost
model's join and aggregation terms on golden cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

import einjoin as ej
from einjoin.planner.bounds import (contraction_bound_words, contraction_dims, matmul_bound_words,
                                  node_bound_bytes)
from einjoin.planner.cost import agg_cost, join_cost, repartition_cost


def _by_hand(m: int, n: int, k: int, p: float) -> float:
    d1, d2, d3 = sorted((m, n, k), reverse=True)
    if p <= d1 / d2:
        d = d2 * d3 + (d1 * d2 + d1 * d3) / p
    elif p <= d1 * d2 / d3 ** 2:
        d = 2 * math.sqrt(d1 * d2 * d3 ** 2 / p) + d1 * d2 / p
    else:
        d = 3 * (d1 * d2 * d3 / p) ** (2 / 3)
    return p * d - (m * n + m * k + n * k)


@pytest.mark.parametrize("m, n, k, p, regime", [
    (65536, 4096, 4096, 8, 1),      # tall-skinny: one large dim, 1-D split
    (16384, 16384, 4096, 8, 2),     # two large dims: 2-D split
    (8192, 8192, 8192, 64, 3),      # cube: 3-D split
])
def test_bound_regimes(m: int, n: int, k: int, p: int, regime: int) -> None:
    d1, d2, d3 = sorted((m, n, k), reverse=True)
    got = [p <= d1 / d2, d1 / d2 < p <= d1 * d2 / d3 ** 2, p > d1 * d2 / d3 ** 2].index(True) + 1
    assert got == regime
    assert matmul_bound_words(m, n, k, p) == pytest.approx(_by_hand(m, n, k, p))


def test_tall_skinny_bound_is_replicating_the_small_matrix() -> None:
    # regime 1: the best plan splits m and replicates the k x n matrix: (P - 1) k n words
    assert matmul_bound_words(65536, 4096, 4096, 8) == pytest.approx(7 * 4096 * 4096)


def test_batch_rule() -> None:
    assert contraction_bound_words(8, 512, 512, 64, 8) == 0.0      # one head per device
    assert contraction_bound_words(2, 512, 512, 64, 8) == pytest.approx(2 * matmul_bound_words(512, 512, 64, 4))
    assert matmul_bound_words(10, 10, 10, 1) == 0.0


def test_contraction_classes() -> None:
    q = ej.input("q", (2, 8, 16, 4))
    k = ej.input("k", (2, 8, 16, 4))
    scores = ej.einsum("bhsd,bhtd->bhst", q, k)
    assert contraction_dims(scores.node) == (16, 16, 16, 4)
    x, w = ej.input("x", (32, 64)), ej.input("w", (64, 8))
    assert contraction_dims((x @ w).node) == (1, 32, 8, 64)
    assert contraction_dims((x * 2.0).node) is None
    assert contraction_dims(ej.einsum("ik,kj->ij", x, w, join="x0 + x1", agg="max").node) is None
    assert node_bound_bytes((x @ w).node, 1) == 0.0


def test_megatron_column_parallel_moves_about_1_9x_the_bound() -> None:
    x, w = ej.input("x", (16384, 4096)), ej.input("w", (4096, 16384))
    z = x @ w
    d = ej.decompose(z.node, {"n": 8})          # column-parallel: every device needs all of x
    moved = join_cost(d) + agg_cost(d)
    assert moved == 7 * 16384 * 4096 * 4
    assert moved / node_bound_bytes(z.node, 8) == pytest.approx(1.914, abs=0.01)


def test_3d_matmul_meets_the_bound() -> None:
    z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
    d = ej.decompose(z.node, {"m": 2, "n": 2, "k": 2})
    assert join_cost(d) + agg_cost(d) == pytest.approx(node_bound_bytes(z.node, 8))


def test_k_split_cost_equals_runtime_bytes() -> None:
    # every kernel on its own device, inputs loaded where their readers are: only partials move
    a, b = ej.input("a", (16, 32)), ej.input("b", (32, 8))
    z = a @ b
    prog = ej.compile(z, devices=4, specs={z: {"k": 4}}, backend="null")
    d = prog.decomps[z.node]
    assert join_cost(d) == 0 and agg_cost(d) == 3 * 16 * 8 * 4
    prog.run(a=np.ones((16, 32), np.float32), b=np.ones((32, 8), np.float32))
    assert prog.stats.bytes_moved == prog.run_stats.bytes_moved == agg_cost(d)


def test_repartition_cost_rows_to_columns() -> None:
    rows = ej.Partition.from_counts((8, 8), (4, 1))
    cols = ej.Partition.from_counts((8, 8), (1, 4))
    on = {k: i for i, k in enumerate(rows.keys())}
    assert repartition_cost(rows, cols, "float32", on, {k: i for i, k in enumerate(cols.keys())}) == 192
    assert repartition_cost(rows, rows, "float32") == 0


def test_repartition_estimate_equals_brute_force() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from budget import examples
    from graphgen import all_cuts
    from einjoin.planner.cost import repartition_estimate

    @settings(max_examples=examples(150), deadline=None)
    @given(st.data())
    def check(data: st.DataObject) -> None:
        shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        a = ej.Partition(tuple(tuple(data.draw(st.sampled_from(all_cuts(n)))) for n in shape))
        b = ej.Partition(tuple(tuple(data.draw(st.sampled_from(all_cuts(n)))) for n in shape))
        brute = 0
        for ck in b.keys():
            cbox = b.box(ck)
            best = 0
            for pk in a.keys():
                pbox = a.box(pk)
                vol = math.prod(max(0, min(y, w) - max(x, v)) for (x, y), (v, w) in zip(cbox, pbox))
                best = max(best, vol)
            brute += math.prod(y - x for x, y in cbox) - best
        assert repartition_estimate(a, b, "float32") == 4 * brute

    check()
