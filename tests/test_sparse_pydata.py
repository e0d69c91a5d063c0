"""pydata ``sparse.COO`` inputs (issue 24's list of inputs). The package is not in this project's
environment, so a stand-in with its module name and attributes (``coords`` of shape (rank, nnz),
``data``, ``shape``) checks what einjoin reads of it: ``ej.sparse`` (any rank, duplicates summed)
and an operand of ``ej.einsum`` beside a SparseTensor, joined as a sparse operand (alone it is
refused, as scipy's and torch's are: tests/test_sparse_checks.py), equal to numpy on the densified
data."""

from __future__ import annotations

import numpy as np

import einjoin as ej


class COO:
    """The attributes of ``sparse.COO`` that einjoin reads."""

    def __init__(self, coords: np.ndarray, data: np.ndarray, shape: tuple[int, ...]) -> None:
        self.coords, self.data, self.shape = coords, data, shape


COO.__module__ = "sparse._coo.core"  # where pydata's class lives


def _dense(coo: COO) -> np.ndarray:
    out = np.zeros(coo.shape)
    np.add.at(out, tuple(coo.coords), coo.data)
    return out


def test_a_rank_3_coo_with_duplicates_is_read_and_summed() -> None:
    coords = np.array([[0, 0, 1, 2], [1, 1, 0, 3], [2, 2, 1, 0]])
    coo = COO(coords, np.array([1.0, 2.0, -1.0, 4.0]), (3, 4, 3))
    t = ej.sparse("X", coo)
    assert t.nnz == 3 and t.todense()[0, 1, 2] == 3.0
    np.testing.assert_array_equal(t.todense(), _dense(coo))


def test_a_coo_operand_of_einsum_equals_numpy() -> None:
    rng = np.random.default_rng(0)
    coords = np.stack([rng.integers(0, 20, 60), rng.integers(0, 15, 60)])
    coo = COO(coords, rng.standard_normal(60), (20, 15))
    other = COO(np.stack([rng.integers(0, 15, 40), rng.integers(0, 6, 40)]), rng.standard_normal(40), (15, 6))
    out = ej.einsum("ij,jk->ik", ej.sparse("A", coo), other)
    np.testing.assert_allclose(out.todense(), _dense(coo) @ _dense(other), rtol=1e-12, atol=1e-12)
