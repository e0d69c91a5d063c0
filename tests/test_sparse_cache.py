"""What the sparse executor keeps between runs (einjoin.sparse.execute's join, the SpMM's column
order, einjoin.sparse.distribute's per-device parts) is kept with the sparse tensor it was derived
from: a run on another tensor with the same block histogram (the plan is reused, the keys are
not the same) computes its own, and results equal numpy on 1 and 2 devices.
"""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej
from einjoin.errors import ShapeError
from einjoin.sparse import SparseTensor, distribute, kernels


@pytest.fixture(autouse=True)
def split_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """These problems are small: split them anyway (MIN_SPLIT_WORK keeps small steps on one device)."""
    monkeypatch.setattr(distribute, "MIN_SPLIT_WORK", 0.0)


def dense(x: SparseTensor | np.ndarray) -> np.ndarray:
    return x.todense() if isinstance(x, SparseTensor) else x


def _pair(n: int = 256, nnz: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two matrices with the same block histogram at every candidate block size and other keys:
    the second is the first with its rows reversed (n a multiple of every block size, so blocks
    map to blocks) and other values."""
    rng = np.random.default_rng(seed)
    a = np.zeros((n, n))
    a[rng.integers(0, n // 8, nnz), rng.integers(0, n, nnz)] = rng.standard_normal(nnz)  # rows skewed
    b = a[::-1].copy()
    b[b != 0] = rng.standard_normal(int((b != 0).sum()))
    return a, b


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("by_column", [False, True])
def test_cached_join_is_not_reused_for_other_keys(devices: int, by_column: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if by_column:  # the SpMM's column order (and its values in that order) kept too
        monkeypatch.setattr(kernels, "BY_COLUMN_MIN", 0)
        monkeypatch.setattr(kernels, "CACHE_BYTES", 64)  # so that the column order is chosen
    a, b = _pair()
    h = np.random.default_rng(1).standard_normal((a.shape[1], 16))
    sa, sb = ej.sparse("A", a), ej.sparse("A", b)
    plan = ej.sparse_compile("ij,jk->ik", sa, h, devices=devices, backend="sync",
                              blocks={"i": 1, "j": 1})
    assert plan.steps[0].layout is not None and plan.steps[0].layout.kernel == "spmm"
    for _ in range(2):  # the second run on the kept structures
        np.testing.assert_allclose(dense(plan.run()), a @ h, rtol=1e-10, atol=1e-10)
    assert any(k[0] == "join" for k in sa.derived) == (devices == 1)
    got = plan.run(A=sb)
    assert plan.last_run.startswith("reused")  # the same histogram: the plan, not the join
    np.testing.assert_allclose(dense(got), b @ h, rtol=1e-10, atol=1e-10)
    h2 = h + 1  # new dense values on the kept join (it depends on the sparse keys alone)
    np.testing.assert_allclose(dense(plan.run(A=sb, x1=h2)), b @ h2, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dense(plan.run(A=sa, x1=h2)), a @ h2, rtol=1e-10, atol=1e-10)


def test_two_devices_keep_their_parts_and_dense_operands_dense() -> None:
    a, _ = _pair()
    h = np.random.default_rng(2).standard_normal((a.shape[1], 8))
    plan = ej.sparse_compile("ij,jk->ik", ej.sparse("A", a), h, devices=2, backend="sync",
                              blocks={"i": 1, "j": 1})
    plan.run()
    (kept,) = plan.distribution._splits.values()
    parts = [c[2] for c in kept.cut if c is not None]
    np.testing.assert_allclose(dense(plan.run()), a @ h, rtol=1e-10, atol=1e-10)
    assert [c[2] for c in kept.cut if c is not None] == parts  # the same part tensors, joins kept
    assert all(any(k[0] == "join" for k in p.derived) for ps in parts for p in ps if len(p.keys))
    lay = plan.steps[0].layout
    assert lay is not None and kept.part(1, 0, h, ("j", "k"), lay, "x1") is h  # H goes whole, as an array


def test_a_pickled_tensor_leaves_its_kept_structures_behind() -> None:
    """A part sent to a Ray actor is pickled every run: its kept join stays on the driver."""
    import pickle
    a, _ = _pair()
    sa = ej.sparse("A", a)
    h = np.ones((a.shape[1], 4))
    ej.sparse_compile("ij,jk->ik", sa, h, blocks={"i": 1, "j": 1}).run()
    assert sa.derived
    back = pickle.loads(pickle.dumps(sa))
    assert back.derived == {} and back.shape == sa.shape and back.block == sa.block and back.name == "A"
    np.testing.assert_array_equal(back.todense(), a)
    np.testing.assert_allclose(dense(ej.sparse_compile("ij,jk->ik", back, h).run()), a @ h, rtol=1e-10, atol=1e-10)



def _dense(x):
    return x.todense() if isinstance(x, SparseTensor) else x


def test_a_sparse_tensor_is_immutable_so_kept_structures_cannot_go_stale():
    # the executor keeps joins, SpMM orders and per-device parts with the tensor: writing its
    # values in place would have left later runs computing with the old ones
    a = ej.sparse("A", np.arange(12.0).reshape(3, 4))
    for arr in (a.data, a.keys):
        with pytest.raises(ValueError, match="read-only"):
            arr *= 2


def test_a_complete_relation_in_another_tuple_order_is_not_taken_for_the_kept_split():
    # a split kept between runs indexes tuples by position: a relation holding every key of its
    # grid, but stored in another order, must get its own split (results were wrong on label j)
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((8, 8)) + 5  # every entry stored: complete at block 1
    h = rng.standard_normal((8, 3))
    a1 = ej.sparse("A", dense)
    rev = np.arange(a1.nnz)[::-1]
    with pytest.raises(ShapeError, match="sorted row-major and unique"):  # built directly: refused
        SparseTensor("A", a1.shape, a1.block, a1.keys[rev].copy(), (2 * a1.data)[rev].copy())
    # (the executor's guard is kept for its own relations: built trusted)
    a2 = SparseTensor("A", a1.shape, a1.block, a1.keys[rev].copy(), (2 * a1.data)[rev].copy(), trusted=True)
    for label in ("i", "j"):
        plan = ej.sparse_compile("ij,jk->ik", a1, h, devices=2, backend="sync", blocks={"i": 1, "j": 1})
        plan.distribution.label = label
        np.testing.assert_allclose(_dense(plan.run()), dense @ h, rtol=1e-10)
        np.testing.assert_allclose(_dense(plan.run(A=a2)), 2 * dense @ h, rtol=1e-10)
