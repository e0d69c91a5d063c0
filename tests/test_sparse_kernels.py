"""The in-memory sparse executor's own kernels (issue 24, einjoin/sparse/kernels.py): ``rowprod``
(MTTKRP and every product where no label is summed inside a payload) and ``spmm``, against numpy
on the densified data, each test asserting that the kernel under test is the one that ran."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import scipy.sparse
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej

kernels = importlib.import_module("einjoin.sparse.kernels")  # ej.sparse is the function


def tensor(rng: np.random.Generator, shape: tuple[int, ...], nnz: int, name: str = "X") -> ej.SparseTensor:
    coords = np.stack([rng.integers(0, n, nnz) for n in shape]) if nnz else np.zeros((len(shape), 0), np.int64)
    return ej.sparse(name, (coords, rng.standard_normal(nnz), shape))


def kernels_ran(plan: ej.SparsePlan) -> set[str]:
    return {lay.kernel for s in plan.steps if (lay := s.layout or s.ran) is not None}


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 31), st.sampled_from([1, 5, 40, 400]), st.integers(1, 9),
       st.sampled_from(["ijk,jr,kr->ir", "ijk,ir,kr->jr", "ijk,jr,kr->ri", "ijk,jr,ir->kr"]))
def test_mttkrp_equals_numpy(seed: int, nnz: int, rank: int, eq: str) -> None:
    rng = np.random.default_rng(seed)
    shape = tuple(int(n) for n in rng.integers(1, 13, 3))
    x = tensor(rng, shape, nnz)
    sizes = dict(zip("ijk", shape), r=rank)
    factors = [rng.standard_normal((sizes[t[0]], sizes[t[1]])) for t in eq.split("->")[0].split(",")[1:]]
    plan = ej.sparse_compile(eq, x, *factors, blocks={"r": rank} if rng.random() < 0.2 else None)
    got = plan.run()
    want = np.einsum(eq, x.todense(), *factors)
    np.testing.assert_allclose(got.todense(), want, rtol=1e-10, atol=1e-10, err_msg=plan.explain())


def test_mttkrp_runs_the_rowprod_kernel_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    x = tensor(rng, (60, 40, 30), 3000)
    b, c = rng.standard_normal((40, 16)), rng.standard_normal((30, 16))
    plan = ej.sparse_compile("ijk,jr,kr->ir", x, b, c)
    assert len(plan.steps) == 1 and kernels_ran(plan) == {"rowprod"}, plan.explain()
    assert "gathered payload rows" in plan.explain()
    want = np.einsum("ijk,jr,kr->ir", x.todense(), b, c)
    monkeypatch.setattr(kernels, "ROW_CHUNK", 16 * 7)  # chunks of 7 tuples: groups cut across chunks
    np.testing.assert_allclose(plan.run().todense(), want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_rowprod_dtypes(dtype: type) -> None:
    rng = np.random.default_rng(1)
    coords = np.stack([rng.integers(0, n, 200) for n in (9, 8, 7)])
    vals = rng.integers(-3, 4, 200).astype(dtype)
    x = ej.sparse("X", (coords, vals, (9, 8, 7)))
    b, c = rng.integers(-3, 4, (8, 5)).astype(dtype), rng.integers(-3, 4, (7, 5)).astype(dtype)
    plan = ej.sparse_compile("ijk,jr,kr->ir", x, b, c)
    got = plan.run().todense()
    assert kernels_ran(plan) == {"rowprod"} and got.dtype == np.dtype(dtype)
    want = np.einsum("ijk,jr,kr->ir", x.todense().astype(np.float64), b.astype(np.float64), c.astype(np.float64))
    np.testing.assert_array_equal(got.astype(np.float64), want)  # small integers: exact in every dtype


def test_rowprod_with_two_dense_labels_and_blocked_output_keys() -> None:
    # payloads over r and s in different orders (a transposed gather), output keys in 2-blocks
    # with edge padding (i = 9)
    rng = np.random.default_rng(2)
    x = tensor(rng, (9, 8, 6), 150)
    b, c = rng.standard_normal((8, 4, 3)), rng.standard_normal((6, 3, 4))
    eq = "ijk,jsr,krs->isr"
    plan = ej.sparse_compile(eq, x, b, c, blocks={"i": 2, "j": 1, "k": 1})
    got = plan.run()
    assert kernels_ran(plan) == {"rowprod"}, plan.explain()
    np.testing.assert_allclose(got.todense(), np.einsum(eq, x.todense(), b, c), rtol=1e-12)


def test_rowprod_of_two_sparse_operands() -> None:
    # a sampled product (SDDMM-like): both sparse, the dense r kept in the output
    rng = np.random.default_rng(3)
    a = ej.sparse("A", scipy.sparse.random(30, 20, density=0.2, random_state=3))
    h = rng.standard_normal((20, 6))
    g = rng.standard_normal((30, 6))
    plan = ej.sparse_compile("ij,jr,ir->ir", a, h, g)
    got = plan.run()
    np.testing.assert_allclose(got.todense(), np.einsum("ij,jr,ir->ir", a.todense(), h, g), rtol=1e-12)


def test_spmm_in_place_and_unsorted_groups() -> None:
    # A·H keyed per entry (grouped as stored) and A^T·H (the joined tuples need a sort by output key)
    rng = np.random.default_rng(4)
    a = ej.sparse("A", scipy.sparse.random(50, 40, density=0.1, random_state=4))
    h = rng.standard_normal((40, 8))
    for eq, want in [("ij,jk->ik", a.todense() @ h), ("ji,jk->ik", a.todense().T @ rng.standard_normal((50, 8)))]:
        hh = h if eq.startswith("ij") else rng.standard_normal((50, 8))
        want = np.einsum(eq, a.todense(), hh)
        plan = ej.sparse_compile(eq, a, hh, blocks={"i": 1, "j": 1})
        assert kernels_ran(plan) == {"spmm"}, plan.explain()
        np.testing.assert_allclose(plan.run().todense(), want, rtol=1e-12)


def test_csr_add_matches_scipy_for_every_dtype() -> None:
    rng = np.random.default_rng(5)
    mat = scipy.sparse.random(7, 9, density=0.4, random_state=5, format="csr")
    for dt in [np.float64, np.float32, np.int64, np.float16]:
        x = rng.integers(-4, 5, (9, 3)).astype(dt)
        out = np.ones((7, 3), dt)
        kernels.csr_add(out, mat.indptr.astype(np.int64), mat.indices, np.round(mat.data * 4).astype(dt), x)
        want = 1 + (scipy.sparse.csr_array((np.round(mat.data * 4), mat.indices, mat.indptr), shape=(7, 9))
                    @ x.astype(np.float64))
        np.testing.assert_array_equal(out.astype(np.float64), want)


def power_law(n: int, nnz: int, rows_skewed: bool, seed: int) -> scipy.sparse.csr_array:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, n + 1) ** 1.2
    skewed = rng.choice(n, nnz, p=w / w.sum())
    uniform = rng.integers(0, n, nnz)
    r, c = (skewed, uniform) if rows_skewed else (uniform, skewed)
    return scipy.sparse.csr_array((rng.standard_normal(nnz), (r, c)), shape=(n, n))


@pytest.mark.parametrize("rows_skewed", [True, False])
def test_spmm_by_column_order_is_kept_with_the_tensor(monkeypatch: pytest.MonkeyPatch, rows_skewed: bool) -> None:
    # output rows by degree, columns uniform: by columns (the payload rows read once, the hot
    # output rows stay in cache); the transposed pattern: by rows. Small sizes: the thresholds
    # scaled down
    monkeypatch.setattr(kernels, "BY_COLUMN_MIN", 16)
    monkeypatch.setattr(kernels, "CACHE_BYTES", 40 * 8 * 4)  # 40 rows of 4
    g = power_law(400, 3000, rows_skewed, seed=7)
    a = ej.sparse("A", g)
    h = np.random.default_rng(8).standard_normal((400, 4))
    plan = ej.sparse_compile("ij,jk->ik", a, h, blocks={"i": 1, "j": 1})
    want = g @ h
    for _ in range(2):  # the order is worked out on the first run and reused by the second
        np.testing.assert_allclose(plan.run().todense(), want, rtol=1e-12, atol=1e-12)
        assert kernels_ran(plan) == {"spmm"}
        orders = [v for key, v in a.derived.items() if key[0] == "spmm by column"]
        assert len(orders) == 1 and bool(orders[0]) == rows_skewed, orders
    h2 = 3 * h  # new values of the dense operand, the same order
    np.testing.assert_allclose(plan.run(x1=h2).todense(), g @ h2, rtol=1e-12, atol=1e-12)
    b = ej.sparse("B", g * 2.0)  # another tensor of the same pattern: its own order, its own values
    np.testing.assert_allclose(plan.run(A=b).todense(), 2 * want, rtol=1e-12, atol=1e-12)
    assert len(b.derived) >= 1
