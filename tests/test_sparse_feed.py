"""A sparse tensor fed by name at run in a dense graph (issue 24): ``ej.sparse_input``.

The graph holds it as two plain inputs (values and keys, padded to the declared capacity); each
run's tensor may have another pattern. Checked against numpy on the densified tensor, torch's
sparse matmul and autograd, and the refusals name the input.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.ir.opkinds import SparseEinsum


def _adj(n: int, m: int, density: float, seed: int) -> scipy.sparse.coo_array:
    return scipy.sparse.random_array((n, m), density=density, random_state=seed, format="coo")


def test_a_gnn_layer_runs_on_each_fed_pattern_on_one_and_two_devices():
    A = ej.sparse_input("A", (40, 30), nnz=200, dtype="float64")
    h, w = ej.input("h", (30, 6), "float64"), ej.input("w", (6, 3), "float64")
    y = ej.relu(A @ (h @ w))
    rng = np.random.default_rng(0)
    hv, wv = rng.normal(size=(30, 6)), rng.normal(size=(6, 3))
    mats = [_adj(40, 30, d, s) for d, s in ((0.05, 1), (0.15, 2), (0.0, 3))]  # 60, 180, 0 entries
    for devices in (1, 2):
        prog = ej.compile(y, devices=devices)
        assert any(isinstance(n.op, SparseEinsum) for n in prog.graph.nodes)
        for feed in (mats[0], ej.sparse("A", mats[1]), mats[2], torch.tensor(mats[1].toarray()).to_sparse()):
            dense = feed.toarray() if hasattr(feed, "toarray") else \
                feed.todense() if isinstance(feed, ej.SparseTensor) else feed.to_dense().numpy()
            want = np.maximum(dense @ hv @ wv, 0)
            np.testing.assert_allclose(prog.run(A=feed, h=hv, w=wv), want, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(ej.reference(y, A=feed, h=hv, w=wv), want, rtol=1e-12, atol=1e-12)


def test_threads_and_torch_backends_and_blocked_feeds():
    A = ej.sparse_input("B", (16, 12), nnz=100)
    x = ej.input("x", (12, 4))
    y = ej.einsum("ij,jk->ik", A, x)
    sp = _adj(16, 12, 0.3, 5)
    xv = np.random.default_rng(1).normal(size=(12, 4)).astype(np.float32)
    want = sp.toarray().astype(np.float32) @ xv
    fed = ej.sparse("B", sp.astype(np.float32), block=4)  # a block-sparse tensor: its entries are fed
    (da,) = ej.grad(y.sum(), [A])  # d sum(A x) / dA[i, j] = sum_k x[j, k] on A's entries
    want_da = xv.sum(1)[np.asarray(fed.reblock((1, 1)).keys)[:, 1]]
    for backend in ("threads", "torch"):
        out, g = ej.compile([y, da], devices=2, backend=backend).run(B=fed, x=xv)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g[:len(want_da)], want_da, rtol=1e-5, atol=1e-5)


def test_gradients_of_the_dense_operands_match_torch_with_a_fed_adjacency():
    A = ej.sparse_input("A", (20, 20), nnz=120, dtype="float64")
    h = ej.input("h", (20, 5), "float64")
    w1, w2 = ej.input("w1", (5, 8), "float64"), ej.input("w2", (8, 2), "float64")
    loss = ((A @ ej.relu(A @ (h @ w1)) @ w2) ** 2).mean()
    grads = ej.grad(loss, [w1, w2])
    prog = ej.compile([loss, *grads], devices=2)
    rng = np.random.default_rng(2)
    feeds = {"h": rng.normal(size=(20, 5)), "w1": rng.normal(size=(5, 8)), "w2": rng.normal(size=(8, 2))}
    for seed in (0, 1):  # two graphs through one program
        sp = _adj(20, 20, 0.2, seed)
        ta = torch.sparse_coo_tensor(np.stack([sp.row, sp.col]), sp.data, (20, 20), check_invariants=True)
        th = torch.tensor(feeds["h"])
        tw1, tw2 = (torch.tensor(feeds[k], requires_grad=True) for k in ("w1", "w2"))
        tl = (torch.sparse.mm(ta, torch.relu(torch.sparse.mm(ta, th @ tw1))) @ tw2).square().mean()
        tl.backward()
        lv, d1, d2 = prog.run(A=sp, **feeds)
        np.testing.assert_allclose(lv, tl.item(), rtol=1e-10)
        np.testing.assert_allclose(d1, tw1.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d2, tw2.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_a_fed_tensor_of_another_shape_dtype_or_more_entries_is_refused_naming_the_input():
    A = ej.sparse_input("adj", (10, 8), nnz=20)
    x = ej.input("x", (8, 2))
    prog = ej.compile(A @ x)
    xv = np.ones((8, 2), np.float32)
    ok = _adj(10, 8, 0.2, 0).astype(np.float32)  # 16 entries
    prog.run(adj=ok, x=xv)
    with pytest.raises(ShapeError, match=r"input 'adj': expected a sparse tensor of shape \(10, 8\), got \(8, 10\)"):
        prog.run(adj=ok.T, x=xv)
    with pytest.raises(DTypeError, match=r"input 'adj': expected float32 values, got float64"):
        prog.run(adj=ok.astype(np.float64), x=xv)
    with pytest.raises(EinjoinError, match=r"input 'adj': 40 stored entries, more than the 20"):
        prog.run(adj=_adj(10, 8, 0.5, 1).astype(np.float32), x=xv)
    with pytest.raises(EinjoinError, match=r"input 'adj' is a sparse input .* got ndarray"):
        prog.run(adj=ok.toarray(), x=xv)
    with pytest.raises(EinjoinError, match=r"missing sparse input 'adj'"):
        prog.run(x=xv)
    with pytest.raises(EinjoinError, match=r"missing sparse input 'adj' .*feed it by name, adj=tensor"):
        prog.run(ok, xv)  # positionally: sparse inputs are fed by name
    with pytest.raises(EinjoinError, match=r"missing sparse input 'adj'"):
        ej.reference(A @ x, x=xv)
    nan = ej.sparse("adj", (np.array([[0], [1]]), np.array([np.nan], np.float32), (10, 8)))
    with pytest.raises(EinjoinError, match=r"input 'adj': inf or nan among its stored values"):
        prog.run(adj=nan, x=xv)  # before the run (the engine refuses them too), by name
    # float16 values into a float32 input are exact: accepted
    half = ej.sparse("adj", (np.stack([ok.row, ok.col]), ok.data.astype(np.float16), (10, 8)))
    np.testing.assert_allclose(prog.run(adj=half, x=xv), half.todense().astype(np.float32) @ xv, rtol=1e-6)


def test_declarations_are_checked_and_shared():
    with pytest.raises(EinjoinError, match="nnz"):
        ej.sparse_input("A", (3, 3), nnz=-1)
    with pytest.raises(ShapeError, match="shape"):
        ej.sparse_input("A", (), nnz=1)
    a, b = ej.sparse_input("S", (4, 4), nnz=3), ej.sparse_input("S", (4, 4), nnz=3)
    x = ej.input("x", (4,))
    assert (a @ x).node is (b @ x).node, "the same declaration is one input"
    with pytest.raises(EinjoinError, match="no value until it is fed"):
        np.asarray(a)
    assert "S" in repr(a) and a.values.shape == (3,) and a.keys.shape == (3, 2)


_EQS = [("ij,jk->ik", 0), ("ij,jk->ki", 1), ("ij,jk,kl->il", 1), ("ij,jk->i", 0), ("ij,ij->ij", 0),
        ("ijk,jr,kr->ir", 0)]


@settings(max_examples=examples(12), deadline=None)
@given(st.sampled_from(_EQS), st.integers(1, 7), st.integers(1, 7), st.integers(1, 4),
       st.sampled_from([0.0, 0.1, 0.4, 1.0]), st.integers(0, 2 ** 16))
def test_random_fed_einsums_equal_numpy_on_the_densified_tensor(case, n, m, k, density, seed):
    eq, pos = case
    rng = np.random.default_rng(seed)
    terms = eq.split("->")[0].split(",")
    size = {"i": n, "j": m, "k": k, "l": 3, "r": 2}
    sshape = tuple(size[c] for c in terms[pos])
    dense = (rng.random(sshape) < density) * rng.normal(size=sshape)
    cap = int(np.prod(sshape)) + 2
    A = ej.sparse_input(f"A{len(sshape)}", sshape, nnz=cap, dtype="float64")
    xs = [ej.input(f"x{i}", tuple(size[c] for c in tm), "float64") for i, tm in enumerate(terms) if i != pos]
    feeds = {x.node.op.name: rng.normal(size=x.shape) for x in xs}
    ops = list(xs)
    ops.insert(pos, A)
    y = ej.einsum(eq, *ops)
    arrays = [feeds[x.node.op.name] for x in xs]
    arrays.insert(pos, dense)
    want = np.einsum(eq, *arrays)
    got = ej.compile(y, devices=2).run(**{A.name: ej.sparse(A.name, dense)}, **feeds)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_the_gradient_of_the_values_matches_torchs_sparse_leaf():
    """``ej.grad(loss, [A])``: per stored entry of the fed tensor (padded with 0), as on
    the pattern of torch's ``.grad`` of a sparse leaf through ``torch.sparse.mm`` (A used twice)."""
    A = ej.sparse_input("A", (15, 15), nnz=80, dtype="float64")
    h = ej.input("h", (15, 4), "float64")
    w1, w2 = ej.input("w1", (4, 6), "float64"), ej.input("w2", (6, 2), "float64")
    loss = ((A @ ej.relu(A @ (h @ w1)) @ w2) ** 2).mean()
    grads = ej.grad(loss, [A, w1, w2])
    prog = ej.compile([loss, *grads], devices=2)
    rng = np.random.default_rng(3)
    feeds = {"h": rng.normal(size=(15, 4)), "w1": rng.normal(size=(4, 6)), "w2": rng.normal(size=(6, 2))}
    for seed in (4, 5):
        sp = _adj(15, 15, 0.25, seed)
        fed = ej.sparse("A", sp)
        ta = torch.sparse_coo_tensor(np.stack([sp.row, sp.col]), sp.data, (15, 15),
                                     check_invariants=True).coalesce().requires_grad_(True)
        tw1, tw2 = (torch.tensor(feeds[k], requires_grad=True) for k in ("w1", "w2"))
        th = torch.tensor(feeds["h"])
        tl = (torch.sparse.mm(ta, torch.relu(torch.sparse.mm(ta, th @ tw1))) @ tw2).square().mean()
        tl.backward()
        lv, da, d1, d2 = prog.run(A=fed, **feeds)
        np.testing.assert_allclose(lv, tl.item(), rtol=1e-10)
        assert da.shape == (80,) and not da[fed.nnz:].any(), "unused rows: 0"
        got = A.on_pattern(fed, da)
        tg = ta.grad.coalesce()
        np.testing.assert_array_equal(np.asarray(got.keys), tg.indices().numpy().T)  # A's pattern
        np.testing.assert_allclose(got.todense(), tg.to_dense().numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d1, tw1.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d2, tw2.grad.numpy(), rtol=1e-9, atol=1e-12)


@settings(max_examples=examples(12), deadline=None)
@given(st.sampled_from(_EQS + [("ij->i", 0), ("ij,k->ik", 0)]), st.integers(1, 6), st.integers(1, 6),
       st.integers(1, 4), st.sampled_from([0.0, 0.2, 0.6, 1.0]), st.integers(0, 2 ** 16))
def test_random_values_gradients_are_the_dense_gradient_at_the_stored_entries(case, n, m, k, density, seed):
    """The values' gradient equals the gradient w.r.t. the densified tensor as a dense input (the
    dense einsum's adjoint), read at the stored entries, in the feed's order; float32 values under
    float64 operands come back in float32."""
    eq, pos = case
    rng = np.random.default_rng(seed)
    terms = eq.split("->")[0].split(",")
    size = {"i": n, "j": m, "k": k, "l": 3, "r": 2}
    sshape = tuple(size[c] for c in terms[pos])
    dense = ((rng.random(sshape) < density) * rng.normal(size=sshape)).astype(np.float32)
    cap = int(np.prod(sshape)) + 1
    A = ej.sparse_input(f"G{len(sshape)}", sshape, nnz=cap, dtype="float32")
    xs = [ej.input(f"x{i}", tuple(size[c] for c in tm), "float64") for i, tm in enumerate(terms) if i != pos]
    feeds = {x.node.op.name: rng.normal(size=x.shape) for x in xs}
    ops = list(xs)
    ops.insert(pos, A)
    y = ej.einsum(eq, *ops)
    c = ej.input("c", y.shape, "float64")
    feeds["c"] = rng.normal(size=y.shape)
    (dv,) = ej.grad((y * c).sum(), [A.values])
    assert dv.dtype == "float32" and dv.shape == (cap,)
    fed = ej.sparse(A.name, dense)
    got = ej.compile(dv, devices=2).run(**{A.name: fed}, **feeds)
    D = ej.input(f"D{len(sshape)}", sshape, "float64")
    dops = list(xs)
    dops.insert(pos, D)
    yd = ej.einsum(eq, *dops)
    (dd,) = ej.grad((yd * c).sum(), [D])
    want_dense, _ = ej.reference([dd, yd], **feeds, **{D.node.op.name: dense.astype(np.float64)})
    coords = np.asarray(fed.keys)
    want = np.zeros(cap)
    want[:len(coords)] = want_dense[tuple(coords.T)]
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ej.reference(dv, **{A.name: fed}, **feeds), got, rtol=1e-5, atol=1e-5)


def test_a_bool_adjacency_fed_to_a_bool_input_takes_the_float_operands_dtype():
    B = ej.sparse_input("B", (4, 3), nnz=5, dtype="bool")
    h = ej.input("h", (3, 2), "float32")
    m = scipy.sparse.coo_array((np.ones(3, bool), ([0, 1, 3], [0, 2, 1])), shape=(4, 3))
    hv = np.arange(6, dtype=np.float32).reshape(3, 2)
    for feed in (m, torch.tensor(m.toarray()).to_sparse()):
        out = np.asarray(ej.compile(B @ h, devices=2).run(B=feed, h=hv))  # (torch in: torch out)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, m.toarray().astype(np.float32) @ hv)


def test_concurrent_runs_with_other_patterns_each_get_their_own():
    """run_async with a different adjacency per run (the operand keeps one last tensor and its
    plans are locked per run): every result and values gradient equals ej.reference's."""
    A = ej.sparse_input("A", (30, 25), nnz=300, dtype="float64")
    h = ej.input("h", (25, 3), "float64")
    y = ej.relu(A @ h)
    outs = [y, *ej.grad((y * y).sum(), [A, h])]
    prog = ej.compile(outs, devices=2)
    hv = np.random.default_rng(0).normal(size=(25, 3))
    mats = [_adj(30, 25, 0.1 + 0.1 * (s % 3), s) for s in range(8)]
    handles = [prog.run_async(A=m, h=hv) for m in mats]
    for m, hd in zip(mats, handles):
        for g, w in zip(hd.result(), ej.reference(outs, A=m, h=hv)):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
