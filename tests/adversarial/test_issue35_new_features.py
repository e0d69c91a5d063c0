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


# small problems split over the devices anyway (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("split_small_sparse_steps")


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


# ---- guards (no bug found; kept as differential checks of today's sparse features): a GNN-like
# 'ij,jk->ik' on devices > tuples, a size-0 / size-1 dim, an empty relation, explicit zeros and
# duplicate entries, rerun with run(A=other) of the same histogram but other keys and of float32
# values, and vjp against torch autograd on the densified operands (the gradient of a sparse
# operand: only at its stored entries)


def _coo(coords: list[list[int]], vals: list[float], shape: tuple[int, int]) -> ej.SparseTensor:
    return ej.sparse("A", (np.array(coords, np.int64).reshape(2, -1), np.array(vals), shape))


@pytest.mark.parametrize("devices", [1, 3, 7])
@pytest.mark.parametrize("case", ["plain", "zero_dim", "one", "empty", "explicit_zero_and_dup"])
def test_sparse_devices_rerun_and_vjp_match_torch(case: str, devices: int) -> None:
    rng = np.random.default_rng(len(case) + devices)
    n, m, r = {"zero_dim": (4, 0, 3), "one": (1, 1, 1)}.get(case, (5, 4, 3))
    if case == "empty":
        a = _coo([], [], (n, m))
    elif case == "explicit_zero_and_dup":
        a = _coo([[0, 0, 2, 4], [1, 1, 3, 0]], [1., 2., 0., -1.], (n, m))
    else:
        a = ej.sparse("A", np.where(rng.random((n, m)) < 0.5, rng.standard_normal((n, m)), 0.))
    h = rng.standard_normal((m, r))
    plan = ej.sparse_compile("ij,jk->ik", a, h, devices=devices, backend="sync")
    ad = a.todense()
    np.testing.assert_allclose(np.asarray(plan.run().todense()), ad @ h, atol=1e-12)
    other = ej.sparse("A", ad[::-1].astype(np.float32))  # other keys, a narrower float
    np.testing.assert_allclose(np.asarray(plan.run(A=other).todense()), ad[::-1] @ h, rtol=1e-6, atol=1e-6)
    g = rng.standard_normal((n, r))
    da, dh = plan.vjp(g)
    ta, th = (torch.tensor(x, requires_grad=True) for x in (np.array(ad[::-1], np.float32).astype(np.float64), h))
    wa, wh = torch.autograd.grad(ta @ th, [ta, th], torch.tensor(g))
    stored = np.zeros((n, m), bool)
    coords, _ = other.coo()
    stored[tuple(coords.T)] = True
    np.testing.assert_allclose(da.todense(), wa.numpy() * stored, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh, wh.numpy(), rtol=1e-5, atol=1e-5)
