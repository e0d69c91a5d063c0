"""What a SparseTensor built directly must hold, and what the sparse entry points accept (issue 24):
keys in range, sorted and unique (refused naming the key otherwise); size-1 dims broadcast by
``sparse_compile`` as ``ej.einsum`` does; other libraries' sparse matrices in ``ej.einsum``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.errors import DTypeError, ShapeError
from einjoin.sparse import SparseTensor


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 4), st.integers(-1, 5)), max_size=8), st.sampled_from([1, 2]))
def test_direct_keys_are_accepted_exactly_when_in_range_sorted_and_unique(rows, b):
    shape, block = (7, 9), (b, b)
    grid = (-(-7 // b), -(-9 // b))
    keys = np.array(rows, np.int64).reshape(-1, 2)
    data = np.arange(len(rows) * b * b, dtype=np.float64).reshape((len(rows), b, b))
    ok = all(0 <= k[0] < grid[0] and 0 <= k[1] < grid[1] for k in rows) and \
        all(tuple(p) < tuple(q) for p, q in zip(rows, rows[1:]))
    if ok:
        t = SparseTensor("A", shape, block, keys, data)
        assert t.nblocks == len(rows)
        want = np.zeros((grid[0] * b, grid[1] * b))
        for (i, j), payload in zip(rows, data):
            want[i * b:(i + 1) * b, j * b:(j + 1) * b] = payload
        np.testing.assert_array_equal(t.todense(), want[:7, :9])
    else:
        with pytest.raises(ShapeError, match=r"out of range|sorted row-major and unique"):
            SparseTensor("A", shape, block, keys, data)


def test_errors_name_the_key_and_what_is_wrong():
    one = np.ones((2, 1, 1))
    with pytest.raises(ShapeError, match=r"key \(3, 0\) \(tuple 1\) is out of range in dim 0"):
        SparseTensor("A", (3, 3), (1, 1), np.array([[0, 0], [3, 0]]), one)
    with pytest.raises(ShapeError, match=r"key \(1, 1\) \(tuple 1\) repeats key \(1, 1\)"):
        SparseTensor("A", (3, 3), (1, 1), np.array([[1, 1], [1, 1]]), one)
    with pytest.raises(ShapeError, match=r"key \(0, 2\) \(tuple 1\) comes before key \(1, 0\)"):
        SparseTensor("A", (3, 3), (1, 1), np.array([[1, 0], [0, 2]]), one)
    with pytest.raises(DTypeError, match="keys must be integers"):
        SparseTensor("A", (3, 3), (1, 1), np.array([[0.0, 1.0], [1.0, 0.0]]), one)
    with pytest.raises(ShapeError, match=r"payloads of shape \(2, 2\), block \(1, 1\)"):
        SparseTensor("A", (3, 3), (1, 1), np.array([[0, 1]]), np.ones((1, 2, 2)))
    # scalar payloads may come flat; the result equals the one ej.sparse builds
    t = SparseTensor("A", (3, 3), (1, 1), np.array([[0, 1], [2, 0]]), np.array([5.0, 6.0]))
    np.testing.assert_array_equal(t.todense(), ej.sparse("A", ([[0, 2], [1, 0]], [5.0, 6.0], (3, 3))).todense())


_BCAST = [("ij,ij->ij", (6, 5), (1, 5)), ("ij,ij->ij", (6, 5), (6, 1)), ("ij,jk->ik", (6, 5), (1, 3)),
          ("ijk,ik->ij", (4, 3, 5), (1, 5)), ("ij,ij->i", (6, 1), (6, 4))]


@pytest.mark.parametrize("eq, sshape, dshape", _BCAST)
def test_sparse_compile_broadcasts_size1_dims_as_ej_einsum_does(eq, sshape, dshape):
    """A plan compiled on the operands as given (size-1 dims) runs on them, and on new ones of
    those shapes (squeezed as at compile); its value and gradients equal numpy / the dense ones,
    each gradient in its operand's own shape."""
    rng = np.random.default_rng(0)
    dense = (rng.random(sshape) < 0.5) * rng.normal(size=sshape)
    a = ej.sparse("A", dense)
    x = rng.normal(size=dshape)
    want = np.einsum(eq, dense, x)
    plan = ej.sparse_compile(eq, a, x)
    got = plan.run()
    np.testing.assert_allclose(getattr(got, "todense", lambda: got)(), want, rtol=1e-12, atol=1e-12)
    eager = ej.einsum(eq, a, x)
    np.testing.assert_allclose(getattr(eager, "todense", lambda: eager)(), want, rtol=1e-12, atol=1e-12)
    x2 = rng.normal(size=dshape)
    dense2 = dense * 3
    got2 = plan.run(ej.sparse("A", dense2), x2)   # the unsqueezed operands at run
    np.testing.assert_allclose(getattr(got2, "todense", lambda: got2)(), np.einsum(eq, dense2, x2),
                               rtol=1e-12, atol=1e-12)
    g = rng.normal(size=want.shape)
    da, dx = plan.vjp(g)
    ta = torch.tensor(dense2, requires_grad=True)
    tx = torch.tensor(x2, requires_grad=True)
    (torch.einsum(eq, ta, tx) * torch.tensor(g)).sum().backward()
    assert da.shape == sshape and dx.shape == dshape
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(da.todense(), np.where(dense2 != 0, ta.grad.numpy(), 0), rtol=1e-10, atol=1e-12)


def test_other_libraries_sparse_matrices_without_an_einjoin_one_are_refused_by_name():
    """ej.einsum / '@' with a scipy, torch or pydata sparse matrix and no SparseTensor: refused the
    same way everywhere, saying to wrap it with ej.sparse (with a SparseTensor among the operands
    they join it as sparse tensors, as sparse_compile takes them)."""
    import scipy.sparse
    m = scipy.sparse.random(4, 3, density=0.5, random_state=0, format="csr")
    h = ej.input("h", (3, 2), "float64")
    ts = torch.tensor(m.toarray()).to_sparse()
    calls = [lambda: ej.einsum("ij,jk->ik", m, np.ones((3, 2))), lambda: ej.einsum("ij,jk->ik", m, h),
             lambda: h.T @ m.T, lambda: ej.einsum("ij,jk->ik", ts, h), lambda: ej.matmul(m, h)]
    for call in calls:
        with pytest.raises(ej.errors.EinjoinError, match=r"sparse .* of shape .*ej\.sparse\('A', m\)"):
            call()
    mixed = ej.einsum("ij,jk->ik", ej.sparse("A", m), scipy.sparse.random(3, 2, density=0.5, random_state=1))
    assert isinstance(mixed, SparseTensor)
