"""Gradients of sparse einsums (einjoin.sparse.grad, issue 24) against torch autograd on the
densified data: a GNN layer (dense and torch.sparse references), random 2-3 operand einsums of
rank 2-3 (hypothesis), sparse gradients on exactly the operand's stored entries, reruns on new
operands, a sparse grad_out, devices, and the refusals (max aggregation, a wrong grad_out)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.errors import EinjoinError, ShapeError
from einjoin.sparse import SparseTensor, sparse_vjp


# small problems split over the devices anyway (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("split_small_sparse_steps")


def _torch_grads(eq: str, dense: list[np.ndarray], g: np.ndarray) -> list[np.ndarray]:
    ts = [torch.tensor(d, dtype=torch.float64, requires_grad=True) for d in dense]
    out = torch.einsum(eq, *ts)
    grads = torch.autograd.grad(out, ts, torch.tensor(g, dtype=torch.float64), allow_unused=True)
    return [np.zeros(d.shape) if gr is None else gr.numpy() for d, gr in zip(dense, grads)]


def _support_mask(s: SparseTensor) -> np.ndarray:
    mask = np.zeros(s.shape, bool)
    mask[tuple(s.coo()[0].T)] = True
    return mask


def _check(operands: list, grads: tuple, expected: list[np.ndarray]) -> None:
    for x, got, want in zip(operands, grads, expected):
        if isinstance(x, SparseTensor):
            assert isinstance(got, SparseTensor) and got.shape == x.shape and got.block == x.block
            mask = _support_mask(x)
            # nothing off the operand's stored entries; the torch gradient on them
            assert not np.any(got.todense()[~mask])
            np.testing.assert_allclose(got.todense(), want * mask, rtol=1e-9, atol=1e-9)
        else:
            assert isinstance(got, np.ndarray) and got.shape == np.shape(x) and got.dtype == np.asarray(x).dtype
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def _gnn(n: int = 40, f: int = 8, c: int = 3, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    adj = scipy.sparse.random(n, n, density=0.1, format="csr", random_state=seed)
    return adj, rng.standard_normal((n, f)), rng.standard_normal((f, c)), rng.standard_normal((n, c))


def test_gnn_layer_matches_torch_autograd() -> None:
    """out = A·H·W, loss = mean((out - Y)^2): dH, dW (and dA on A's entries) equal torch's."""
    adj, h, w, y = _gnn()
    a = ej.sparse("A", adj)
    plan = ej.sparse_compile("ij,jk,kl->il", a, h, w)
    out = plan.run()
    assert isinstance(out, SparseTensor)
    g = 2 * (out.todense() - y) / y.size
    da, dh, dw = plan.vjp(g)

    ta = torch.tensor(adj.toarray(), requires_grad=True)
    th, tw = torch.tensor(h, requires_grad=True), torch.tensor(w, requires_grad=True)
    loss = ((ta @ th @ tw - torch.tensor(y)) ** 2).mean()
    loss.backward()
    np.testing.assert_allclose(dh, th.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert da.nnz == a.nnz
    np.testing.assert_allclose(da.todense(), ta.grad.numpy() * (adj.toarray() != 0), rtol=1e-10, atol=1e-12)

    # torch.sparse's own autograd (the adjacency stays sparse there too)
    sa = torch.sparse_coo_tensor(np.stack(adj.nonzero()), adj.data, adj.shape,
                                 check_invariants=True).coalesce()
    th2, tw2 = torch.tensor(h, requires_grad=True), torch.tensor(w, requires_grad=True)
    ((torch.sparse.mm(sa, th2) @ tw2 - torch.tensor(y)) ** 2).mean().backward()
    np.testing.assert_allclose(dh, th2.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, tw2.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_gnn_training_steps_rerun_the_gradient_plans() -> None:
    """A few gradient-descent steps on W (run(x2=W) each step): the loss falls, and each step's
    gradient is torch's at that step's W (the cached gradient einsums see the new operands)."""
    adj, h, w, y = _gnn(seed=1)
    a = ej.sparse("A", adj)
    plan = ej.sparse_compile("ij,jk,kl->il", a, h, w)
    losses = []
    for _ in range(4):
        out = plan.run(x2=w).todense()
        losses.append(float(((out - y) ** 2).mean()))
        (dw,) = plan.vjp(2 * (out - y) / y.size, wrt=["x2"])  # A is data: no dA needed
        tw = torch.tensor(w, requires_grad=True)
        ((torch.tensor(adj.toarray() @ h) @ tw - torch.tensor(y)) ** 2).mean().backward()
        np.testing.assert_allclose(dw, tw.grad.numpy(), rtol=1e-10, atol=1e-12)
        w = w - 0.5 * dw
    assert losses[-1] < losses[0]


@st.composite
def grad_problems(draw: st.DrawFn) -> tuple:
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    pool = "ijkl"
    sizes = {lab: int(rng.integers(1, 6)) for lab in pool}
    n_ops = draw(st.integers(2, 3))
    terms = ["".join(rng.permutation(list(pool))[:rng.integers(2, 4)]) for _ in range(n_ops)]
    used = list(dict.fromkeys("".join(terms)))
    out = "".join(rng.permutation(used)[:rng.integers(0, min(3, len(used)) + 1)])
    kinds = [bool(rng.integers(2)) for _ in terms]
    kinds[rng.integers(n_ops)] = True  # at least one sparse operand
    density = draw(st.sampled_from([0.05, 0.3, 0.7]))
    operands: list = []
    for i, (t, sp) in enumerate(zip(terms, kinds)):
        shape = tuple(sizes[lab] for lab in t)
        dense = rng.standard_normal(shape)
        if sp:
            dense = dense * (rng.random(shape) < density)
            operands.append(ej.sparse(f"S{i}", dense, block=int(rng.integers(1, 4))))
        else:
            operands.append(dense)
    g = rng.standard_normal(tuple(sizes[lab] for lab in out))
    return ",".join(terms) + "->" + out, operands, g


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grad_problems())
def test_random_sparse_einsum_gradients_match_torch(problem: tuple) -> None:
    eq, operands, g = problem
    plan = ej.sparse_compile(eq, *operands)
    grads = plan.vjp(g)
    dense = [x.todense() if isinstance(x, SparseTensor) else x for x in operands]
    _check(operands, grads, _torch_grads(eq, dense, g))


def test_sparse_grad_out_equals_dense_grad_out() -> None:
    """A sparse result's gradient given as a SparseTensor (only some entries): the same gradients
    as the dense array it holds."""
    adj, h, _, _ = _gnn(seed=2)
    a = ej.sparse("A", adj)
    rng = np.random.default_rng(3)
    g = rng.standard_normal((40, 8)) * (rng.random((40, 8)) < 0.3)
    plan = ej.sparse_compile("ij,jk->ik", a, h)
    da_s, dh_s = plan.vjp(ej.sparse("G", g))
    da_d, dh_d = sparse_vjp(plan, g)
    np.testing.assert_allclose(dh_s, dh_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(da_s.todense(), da_d.todense(), rtol=1e-12, atol=1e-12)
    _check([a, h], (da_d, dh_d), _torch_grads("ij,jk->ik", [adj.toarray(), h], g))


def test_scalar_result_label_only_one_operand_has_and_float32() -> None:
    """A scalar result takes a number; ``l`` (only the dense operand has it) gets the gradient
    broadcast; float32 operands get float32 gradients."""
    rng = np.random.default_rng(4)
    s = rng.standard_normal((5, 4)) * (rng.random((5, 4)) < 0.4)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    a = ej.sparse("A", s.astype(np.float32))
    ds, dx = ej.sparse_compile("ij,jl->", a, x).vjp(2.0)
    want = _torch_grads("ij,jl->", [s.astype(np.float32).astype(np.float64), x.astype(np.float64)], np.array(2.0))
    assert dx.dtype == np.float32 and ds.dtype == np.float32
    np.testing.assert_allclose(dx, want[1], rtol=1e-5)
    np.testing.assert_allclose(ds.todense(), want[0] * (s != 0), rtol=1e-5, atol=1e-6)


def test_gradients_on_two_devices_equal_one() -> None:
    adj, h, w, _ = _gnn(seed=5)
    a = ej.sparse("A", adj)
    g = np.random.default_rng(6).standard_normal((40, 3))
    one = ej.sparse_compile("ij,jk,kl->il", a, h, w).vjp(g)
    two = ej.sparse_compile("ij,jk,kl->il", a, h, w, devices=2, backend="sync").vjp(g)
    np.testing.assert_allclose(one[0].todense(), two[0].todense(), rtol=1e-12, atol=1e-12)
    for p, q in zip(one[1:], two[1:]):
        np.testing.assert_allclose(p, q, rtol=1e-12, atol=1e-12)


def test_refusals() -> None:
    a = ej.sparse("A", np.eye(3))
    h = np.ones((3, 2))
    # (a max with two sparse operands is differentiated: tests/test_sparse_grad_max2.py)
    with pytest.raises(ShapeError, match=r"grad_out of shape \(2, 3\) where the result has shape \(3, 2\)"):
        ej.sparse_compile("ij,jk->ik", a, h).vjp(np.ones((2, 3)))
    with pytest.raises(EinjoinError):
        ej.sparse_compile("ij,jk->ik", a, h).vjp(np.ones(6))
    with pytest.raises(EinjoinError, match=r"wrt 'B' is not one operand \(operands A, x1"):
        ej.sparse_compile("ij,jk->ik", a, h).vjp(np.ones((3, 2)), wrt=["B"])
    dh, da = ej.sparse_compile("ij,jk->ik", a, h).vjp(np.ones((3, 2)), wrt=[1, "A"])
    assert isinstance(da, SparseTensor) and dh.shape == (3, 2)


def test_sparse_operand_gradient_never_densifies() -> None:
    """dA of A·H·W is an SDDMM: n = 3000 and 3000 entries, so an n x n intermediate (72 MB in
    float64, what pairing G with H·W first builds) would show in the peak of numpy's allocations."""
    import tracemalloc
    n = 3000
    rng = np.random.default_rng(7)
    a = ej.sparse("A", (rng.integers(0, n, (2, n)), rng.standard_normal(n), (n, n)))
    h, w, g = rng.standard_normal((n, 4)), rng.standard_normal((4, 2)), rng.standard_normal((n, 2))
    plan = ej.sparse_compile("ij,jk,kl->il", a, h, w)
    tracemalloc.start()
    try:
        da, _, _ = plan.vjp(g)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2 ** 20, peak
    coords, _ = a.coo()
    want = np.einsum("nl,nl->n", g[coords[:, 0]], (h @ w)[coords[:, 1]])
    np.testing.assert_allclose(da.coo()[1], want, rtol=1e-10, atol=1e-12)


def test_duckdb_engine_and_float16() -> None:
    """The gradient einsums run on the plan's engine (DuckDB here); float16 operands get float16
    gradients, computed in float32."""
    pytest.importorskip("duckdb")
    rng = np.random.default_rng(8)
    s = rng.standard_normal((6, 5)) * (rng.random((6, 5)) < 0.4)
    h, w, g = rng.standard_normal((5, 4)), rng.standard_normal((4, 3)), rng.standard_normal((6, 3))
    a = ej.sparse("A", s)
    grads = ej.sparse_compile("ij,jk,kl->il", a, h, w, engine="duckdb").vjp(g)
    _check([a, h, w], grads, _torch_grads("ij,jk,kl->il", [s, h, w], g))
    a16, h16 = ej.sparse("A", s.astype(np.float16)), h.astype(np.float16)
    da, dh = ej.sparse_compile("ij,jk->ik", a16, h16).vjp(g[:, :1].repeat(4, 1).astype(np.float16))
    want = _torch_grads("ij,jk->ik", [s.astype(np.float16).astype(np.float64), h16.astype(np.float64)],
                        g[:, :1].repeat(4, 1).astype(np.float16).astype(np.float64))
    assert da.dtype == dh.dtype == np.float16
    np.testing.assert_allclose(dh, want[1], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(da.todense(), want[0] * (s != 0), rtol=2e-3, atol=2e-3)


MAX_EQUATIONS = [
    ("ij,jk->ik", 0),      # a GNN's max aggregation over neighbours
    ("ij,jk->ki", 1),      # the sparse operand second
    ("ij,j->i", 0),
    ("ijk,jr->ir", 0),     # rank 3, k reduced inside the sparse operand
    ("ij,jk,kl->il", 0),
]


@pytest.mark.parametrize("eq, pos", MAX_EQUATIONS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), density=st.sampled_from([0.0, 0.3, 0.8, 1.0]))
def test_max_gradient_equals_torch_amax_on_the_densified_operands(eq, pos, seed, density):
    """Small integer values make ties (among stored terms, and with the absent entries' zeros):
    torch splits an output's gradient evenly among its maximal terms, and so must the vjp."""
    rng = np.random.default_rng(seed)
    lhs = eq.split("->")[0].split(",")
    sizes = {"i": 3, "j": 4, "k": 3, "l": 2, "r": 2}
    sshape = tuple(sizes[lab] for lab in lhs[pos])
    dense = [tuple(sizes[lab] for lab in ls) for k, ls in enumerate(lhs) if k != pos]
    a = rng.integers(-2, 3, sshape).astype(float) * (rng.random(sshape) < density)
    xs = [rng.integers(-2, 3, s).astype(float) for s in dense]
    ops = list(xs)
    ops.insert(pos, ej.sparse("A", a) if a.any() else ej.sparse("A", (np.zeros((len(sshape), 0), np.int64),
                                                                       np.zeros(0), sshape)))
    plan = ej.sparse_compile(eq, *ops, agg="max")
    out = plan.run()
    g = rng.normal(size=np.shape(out.todense() if isinstance(out, SparseTensor) else out))
    grads = plan.vjp(g)
    ts = [torch.tensor(v, requires_grad=True) for v in [*xs[:pos], a, *xs[pos:]]]
    letters = sorted(set("".join(lhs)))
    prod = None
    for t, ls in zip(ts, lhs):  # the full product over every label, then amax over the reduced ones
        full = torch.einsum(f"{ls}->{ls}", t)
        idx = [slice(None) if lab in ls else None for lab in letters]
        view = full.permute(*[ls.index(lab) for lab in letters if lab in ls])[tuple(idx)]
        prod = view if prod is None else prod * view
    rhs = eq.split("->")[1]
    reduced = [d for d, lab in enumerate(letters) if lab not in rhs]
    want = prod.amax(dim=reduced) if reduced else prod
    keep = [lab for lab in letters if lab in rhs]
    want = want.permute(*[keep.index(lab) for lab in rhs])
    np.testing.assert_allclose(out.todense() if isinstance(out, SparseTensor) else out, want.detach().numpy())
    (want * torch.tensor(g)).sum().backward()
    for k, (gr, t) in enumerate(zip(grads, ts)):
        got = gr.todense() if isinstance(gr, SparseTensor) else gr
        exp = t.grad.numpy() * (a != 0) if k == pos else t.grad.numpy()  # a sparse operand: its entries
        np.testing.assert_allclose(got, exp, rtol=1e-10, atol=1e-12, err_msg=f"operand {k}")
