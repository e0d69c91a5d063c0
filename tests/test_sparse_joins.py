"""Sparse einsums with a join other than the product (einjoin.sparse.joins, issue 24): ``add``
(a union of the stored entries), joins that are 0 at 0 (relu, abs, neg, x0 * 2: sparse) and
joins that are not (exp, cos, x0 + 1: dense), aggregated by sum or max, equal numpy on the
densified inputs (a missing entry is 0), with explicit zeros and empty operands, in memory and
on DuckDB, on 1 and 2 devices.
"""

from __future__ import annotations

import numpy as np
import pytest
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.errors import EinjoinError
from einjoin.sparse import SparseTensor, joins
from test_sparse import random_coo

# (join, arity, numpy on the densified operands, result sparse when every operand is sparse)
JOINS = [("add", 2, lambda a, b: a + b, True), ("x0 - 2 * x1", 2, lambda a, b: a - 2 * b, True),
         ("max", 2, np.maximum, True), ("relu", 1, lambda a: np.maximum(a, 0), True),
         ("abs", 1, np.abs, True), ("neg", 1, np.negative, True), ("x0 * 2", 1, lambda a: a * 2, True),
         ("exp", 1, np.exp, False), ("cos", 1, np.cos, False), ("x0 + 1", 1, lambda a: a + 1, False),
         ("x0 + x1 + 1", 2, lambda a, b: a + b + 1, False)]
OUTS = ["ij", "ji", "i", "j", ""]


def engines() -> list[str]:
    try:
        import duckdb  # noqa: F401
    except ImportError:
        return ["memory"]
    return ["memory", "duckdb"]


def dense(x: object) -> np.ndarray:
    return x.todense() if isinstance(x, SparseTensor) else np.asarray(x)


def reference(fn, ops: list[np.ndarray], out: str, agg: str) -> np.ndarray:
    full = fn(*ops)
    axes = tuple(k for k, lab in enumerate("ij") if lab not in out)
    if axes:
        full = full.max(axis=axes) if agg == "max" else full.sum(axis=axes)
    kept = [lab for lab in "ij" if lab in out]
    return np.transpose(full, [kept.index(lab) for lab in out])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from(range(len(JOINS))), st.sampled_from(OUTS),
       st.sampled_from(["sum", "max"]), st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.booleans(),
       st.sampled_from(engines()))
def test_joins_equal_numpy_on_densified_inputs(seed: int, j: int, out: str, agg: str, density: float,
                                               dense_second: bool, engine: str) -> None:
    rng = np.random.default_rng(seed)
    join, arity, fn, keeps = JOINS[j]
    shape = (int(rng.integers(1, 7)), int(rng.integers(1, 7)))
    ops: list[object] = []
    for k in range(arity):
        if k == 1 and dense_second:
            ops.append(rng.standard_normal(shape))
        else:
            idx, vals = random_coo(rng, shape, density)  # duplicates (summed) and explicit zeros
            ops.append(ej.sparse(f"A{k}", (idx, vals, shape)))
    eq = ",".join(["ij"] * arity) + "->" + out
    got = ej.einsum(eq, *ops, join=join, agg=agg) if engine == "memory" else \
        ej.sparse_compile(eq, *ops, join=join, agg=agg, engine=engine).run()
    want = reference(fn, [dense(x) for x in ops], out, agg)
    assert dense(got).shape == want.shape
    np.testing.assert_allclose(dense(got), want, rtol=1e-9, atol=1e-12)
    all_sparse = all(isinstance(x, SparseTensor) for x in ops)
    if out == "ij":  # nothing aggregated: the join's result itself
        assert isinstance(got, SparseTensor) == (keeps and all_sparse)
    if isinstance(got, SparseTensor):  # a valid relation: keys in range, sorted, unique (checked untrusted)
        SparseTensor("check", got.shape, got.block, np.array(got.keys), np.array(got.data))
    if isinstance(got, SparseTensor) and out == "ij":  # only the union of the stored entries
        stored = set()
        for x in ops:
            stored |= {tuple(c) for c in x.coo()[0]}
        assert {tuple(c) for c in got.coo()[0]} <= stored


@pytest.mark.parametrize("engine", engines())
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("agg", ["sum", "max"])
def test_add_and_relu_on_engines_and_devices(engine: str, devices: int, agg: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from einjoin.sparse import distribute
    monkeypatch.setattr(distribute, "MIN_SPLIT_WORK", 0.0)  # split these small steps anyway
    if engine == "duckdb":  # the union runs in SQL (UNION ALL, GROUP BY), not in numpy
        monkeypatch.setattr(joins, "_union_memory", None)
    rng = np.random.default_rng(devices)
    shape = (30, 20)
    a = ej.sparse("A", random_coo(rng, shape, 0.1) + (shape,))
    b = ej.sparse("B", random_coo(rng, shape, 0.1) + (shape,))
    da, db = a.todense(), b.todense()
    kw = dict(engine=engine, devices=devices, backend="sync", agg=agg)
    for eq, ops, want in [("ij,ij->i", (a, b), da + db), ("ij,ij->j", (a, b), (da + db)),
                          ("ij->i", (a,), np.maximum(da, 0))]:
        plan = ej.sparse_compile(eq, *ops, join="add" if len(ops) == 2 else "relu", **kw)
        assert plan.sparse_result
        axis = 1 if eq.endswith("i") else 0
        ref = want.max(axis=axis) if agg == "max" else want.sum(axis=axis)
        np.testing.assert_allclose(dense(plan.run()), ref, rtol=1e-9, atol=1e-12, err_msg=plan.explain())
    # run() on new operands of the same shapes
    c = ej.sparse("C", random_coo(rng, shape, 0.2) + (shape,))
    plan = ej.sparse_compile("ij,ij->ij", a, b, join="add", **kw)
    np.testing.assert_allclose(dense(plan.run(c, a)), c.todense() + da)


def test_empty_and_all_zero_operands() -> None:
    shape = (4, 3)
    empty = ej.sparse("E", (np.zeros((2, 0), np.int64), np.zeros(0), shape))
    zeros = ej.sparse("Z", (np.array([[0, 1], [2, 0]]), np.zeros(2), shape))  # explicit zeros only
    r = ej.einsum("ij,ij->ij", empty, empty, join="add")
    assert isinstance(r, SparseTensor) and r.nnz == 0 and r.todense().shape == shape
    r = ej.einsum("ij,ij->ij", empty, zeros, join="add")
    assert np.array_equal(r.todense(), np.zeros(shape))
    assert np.array_equal(dense(ej.einsum("ij,ij->i", empty, zeros, join="add", agg="max")), np.zeros(4))
    assert np.array_equal(ej.einsum("ij->j", empty, join="exp"), np.full(3, 4.0))


def test_a_dense_result_over_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joins, "DENSE_JOIN_LIMIT", 1000)
    a = ej.sparse("A", (np.array([[0], [0]]), np.ones(1), (100, 100)))
    with pytest.raises(EinjoinError, match=r"\(100, 100\).*80000 bytes"):
        ej.sparse_compile("ij->i", a, join="exp")
    assert ej.sparse_compile("ij->i", a, join="relu").sparse_result  # sparse: no limit
    monkeypatch.setattr(joins, "DENSE_JOIN_LIMIT", 1 << 30)
    with pytest.raises(EinjoinError, match=r"\(100, 100\).*80000 bytes, over memory_limit= \(50000 bytes\)"):
        ej.sparse_compile("ij->i", a, join="exp", memory_limit=50_000)
    assert ej.sparse_compile("ij->i", a, join="exp", memory_limit="1MiB").run().shape == (100,)


def test_product_joins_keep_the_product_plan() -> None:
    a = ej.sparse("A", np.eye(3))
    assert isinstance(ej.sparse_compile("ij,jk->ik", a, a, join="mul"), ej.SparsePlan)
    assert isinstance(ej.sparse_compile("ij,jk->ik", a, a, join="x1 * x0"), ej.SparsePlan)
    assert isinstance(ej.sparse_compile("ij->i", a, join="x0"), ej.SparsePlan)


def test_half_sums_accumulate_in_float32_and_dtype_changes_are_refused() -> None:
    rng = np.random.default_rng(0)
    d = (rng.random((3, 4000)) < 0.01) * rng.standard_normal((3, 4000))
    a = ej.sparse("A", d.astype(np.float16))
    got = ej.einsum("ij->i", a, join="exp")  # dense: 4000 terms near 1 per row
    want = np.exp(a.todense().astype(np.float32)).sum(1).astype(np.float16)
    assert got.dtype == np.float16 and np.array_equal(got, want)
    plan = ej.sparse_compile("ij,ij->i", a, a, join="add")
    with pytest.raises(EinjoinError, match="float64.*compiled for.*float16"):
        plan.run(ej.sparse("B", d), a)


@pytest.mark.parametrize("eq,join,fn", [
    ("ij,ji->ij", "add", lambda a, b: a + b.T),
    ("ijk,ij->ki", "add", lambda c, a: np.transpose((c + a[:, :, None]).max(1))),  # agg max below
    ("ij,j->i", "add", lambda a, e: (a + e).sum(1)),  # an operand lacking a label: dense
    ("ij,ij,ij->ij", "x0 + x1 - x2", lambda a, b, c: a + b - c),
])
def test_label_orders_ranks_and_three_operands(eq: str, join: str, fn) -> None:
    rng = np.random.default_rng(len(eq))
    ins = eq.split("->")[0].split(",")
    sizes = {"i": 4, "j": 5, "k": 3}
    ops = []
    for k, ls in enumerate(ins):
        shape = tuple(sizes[lab] for lab in ls)
        ops.append(ej.sparse(f"A{k}", random_coo(rng, shape, 0.3) + (shape,)))
    agg = "max" if eq == "ijk,ij->ki" else "sum"
    got = dense(ej.einsum(eq, *ops, join=join, agg=agg))
    np.testing.assert_allclose(got, fn(*[x.todense() for x in ops]), rtol=1e-9, atol=1e-12)
    with pytest.raises(ej.UnsupportedOpError, match="gradients"):
        ej.sparse_compile(eq, *ops, join=join, agg=agg).vjp(np.ones(got.shape))


@pytest.mark.parametrize("engine", engines())
def test_nan_and_inf_meet_missing_entries_as_on_the_densified_data(engine: str) -> None:
    a = ej.sparse("A", (np.array([[0, 1], [0, 1]]), np.array([np.nan, np.inf]), (2, 2)))
    b = ej.sparse("B", (np.array([[0], [1]]), np.array([2.0]), (2, 2)))
    got = ej.sparse_compile("ij,ij->ij", a, b, join="add", engine=engine).run()
    np.testing.assert_array_equal(got.todense(), a.todense() + b.todense())
