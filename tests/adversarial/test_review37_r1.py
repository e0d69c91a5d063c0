"""Reviewer R1's checks of session 37's changes (each fails before its fix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.errors import ShapeError
from einjoin.frontend.routing import LAST_WRITE_PAIRS


class _Put(torch.nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[i] = v
        return y


def _last_write(x: np.ndarray, i: np.ndarray, v: np.ndarray) -> np.ndarray:
    y = x.copy()
    for k, t in enumerate(i.tolist()):  # one write after the other: the last one stays
        y[t] = v[k]
    return y


def test_index_put_past_the_pair_limit_keeps_one_write_not_their_mean() -> None:
    # more index positions than LAST_WRITE_PAIRS: a repeated index took the mean of its writes
    # (0.5 for writes 0, 1; inf for two writes of 3e38; any True for bools)
    m = LAST_WRITE_PAIRS + 5
    i = np.array([3, 3] + [5] * (m - 3) + [-1], np.int64)
    x = np.zeros(10, np.float32)
    prog = ej.compile(ej.from_torch(_Put(), tuple(map(torch.from_numpy, (x, i, np.zeros(m, np.float32))))),
                      devices=ej.local(2))
    for v in (np.arange(m, dtype=np.float32), np.full(m, 3e38, np.float32),
              np.random.default_rng(0).standard_normal(m).astype(np.float32)):
        got = np.asarray(prog.run(x, i, v))
        assert np.array_equal(got, _last_write(x, i % 10, v))
    xb, vb = np.zeros(10, bool), np.zeros(m, bool)
    vb[0] = True  # overwritten by the next write to 3
    progb = ej.compile(ej.from_torch(_Put(), tuple(map(torch.from_numpy, (xb, i, vb)))), devices=ej.local(1))
    assert np.array_equal(np.asarray(progb.run(xb, i, vb)), _last_write(xb, i % 10, vb))


def test_sparse_input_refuses_a_shape_of_non_integers_as_ej_input_does() -> None:
    # int() made (6.5, 5) and ("6", 5) a (6, 5) declaration, silently
    for shape in ((6.5, 5), (6.0, 5), ("6", 5), (np.float64(6), 5)):
        with pytest.raises(ShapeError, match="integer sizes"):
            ej.sparse_input("S_r1", shape, nnz=3)
    assert ej.sparse_input("S_r1", (np.int64(6), 5), nnz=3).shape == (6, 5)


def test_a_float32_sparse_input_joins_bfloat16_dense_operands() -> None:
    # (a bfloat16 sparse input was refused here while a SparseTensor held no bfloat16 values;
    # 69dd7f9 made it hold them: test_review39_r1 runs one against torch)
    a = ej.sparse_input("Af_r1", (4, 3), nnz=5, dtype="float32")  # with bfloat16 dense operands
    import ml_dtypes
    out = ej.compile(a @ ej.input("hb_r1", (3, 2), "bfloat16")).run(
        Af_r1=ej.sparse("Af_r1", np.eye(4, 3, dtype=np.float32)), hb_r1=np.ones((3, 2), ml_dtypes.bfloat16))
    assert np.array_equal(np.asarray(out, np.float32), np.eye(4, 3) @ np.ones((3, 2)))
