"""Issue 35 (session 35): wrong answers and raw errors in the features that landed this session:
sparse einsums on devices, ``SparsePlan.run(A=other)``, sparse gradients, the sparse kernels,
sliding-window attention (and imported masks that become windows), the Ray block channel, the
Trainer fixes and the fusion rules. Differential against numpy / torch on the densified data.
Each test here failed before its fix (or is an ``xfail(strict=True)`` naming whose module holds
the bug)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.frontend.composites import fused_attention


def _sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.tensor(q), torch.tensor(k), torch.tensor(v), attn_mask=torch.tensor(mask))
    return torch.nan_to_num(out).numpy()  # a query with no allowed key: zeros, as einjoin's


# ---- finding 1: a constant mask that broadcasts over the queries or the keys (shape (1, S) or
# (L, 1)) whose one row / column reads as a causal band was dropped for causal=True: a (1, 5)
# mask allowing only key 0 to every query became "query i sees keys j <= i", an all-True (5, 1)
# column (every key allowed) became causal too. Only a mask of the scores' own (L, S) is a band.


@pytest.mark.parametrize("rows, cols", [(1, 5), (5, 1)])
def test_a_broadcast_mask_is_not_taken_for_a_causal_band(rows: int, cols: int) -> None:
    n = 5
    q, k, v = (ej.input(x, (1, 2, n, 4)) for x in "qkv")
    i, j = ej.arange(rows).reshape((rows, 1)), ej.arange(cols).reshape((1, cols))
    out = fused_attention(q, k, v, mask=(j <= i).reshape((1, 1, rows, cols)))
    rng = np.random.default_rng(0)
    qq, kk, vv = (rng.standard_normal((1, 2, n, 4)).astype(np.float32) for _ in range(3))
    got = np.asarray(ej.compile(out).run(q=qq, k=kk, v=vv))
    ii, jj = np.arange(rows)[:, None], np.arange(cols)[None, :]
    mask = np.broadcast_to(jj <= ii, (n, n)).copy()
    np.testing.assert_allclose(got, _sdpa(qq, kk, vv, mask), atol=1e-5)


# ---- finding 2: SparsePlan.vjp(g, wrt=np.int64(1)) (a position computed with numpy) was a raw
# "TypeError: 'numpy.int64' object is not iterable": only a Python int was taken for one position


def test_vjp_takes_one_numpy_integer_position() -> None:
    a = ej.sparse("A", np.array([[0., 2.], [3., 0.]]))
    plan = ej.sparse_compile("ij,j->i", a, np.array([1., 10.]))
    (dx,) = plan.vjp(np.array([1., -1.]), wrt=np.int64(1))
    np.testing.assert_array_equal(dx, [-3., 2.])


# ---- finding 3: an integer or bool gradient of the result (grad_out=[1, -1], a list; an int64
# array) on a float plan was "einsum 'i,ij->j': x0 * x1: cannot mix int64 and float64", the
# message of an internal gradient einsum the user never wrote. A grad_out of another kind is
# converted to the plan's dtype when every value is kept exactly, else refused naming grad_out.


@pytest.mark.parametrize("g", [[1, -1], np.array([1, -1]), np.array([True, False])])
def test_vjp_converts_an_exact_integer_grad_out(g: object) -> None:
    ad = np.array([[0., 2.], [3., 0.]])
    plan = ej.sparse_compile("ij,j->i", ej.sparse("A", ad), np.array([1., 10.]))
    da, dx = plan.vjp(g)
    gd = np.asarray(g, np.float64)
    np.testing.assert_array_equal(da.todense(), np.outer(gd, [1., 10.]) * (ad != 0))
    np.testing.assert_array_equal(dx, ad.T @ gd)


def test_vjp_refuses_a_grad_out_that_would_change() -> None:
    plan = ej.sparse_compile("ij,j->i", ej.sparse("A", np.eye(2, dtype=np.float16)), np.ones(2, np.float16))
    with pytest.raises(ej.EinjoinError, match="grad_out"):
        plan.vjp(np.array([2049, 1]))  # 2049 is no float16
