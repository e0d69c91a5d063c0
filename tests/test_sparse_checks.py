"""What a SparseTensor built directly must hold, and what the sparse entry points accept (issue 24):
keys in range, sorted and unique (refused naming the key otherwise); size-1 dims broadcast by
``sparse_compile`` as ``ej.einsum`` does; other libraries' sparse matrices in ``ej.einsum``.
"""

from __future__ import annotations

import numpy as np
import pytest
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
