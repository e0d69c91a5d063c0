"""Sparse tensors inside the dense graph (issue 24): the SparseEinsum node kind.

``ej.einsum`` with a SparseTensor and lazy tensors builds one node whose constant is the sparse
tensor; it is evaluated by the sparse engine (a SparsePlan per equation and shapes), planned as
one opaque block, and differentiated w.r.t. its dense operands by sparse einsums again. Checked
against numpy.einsum on the densified tensor, a dense einjoin graph, and torch autograd.
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
from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.decomp.flops import kernel_flops
from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.sparse_einsum import followed_dims, sparse_flops
from einjoin.sparse import GraphSparse
from einjoin.sparse.graph_plans import meeting


def _adjacency(n: int, m: int, density: float, seed: int) -> scipy.sparse.coo_array:
    return scipy.sparse.random_array((n, m), density=density, random_state=seed, format="coo")


def _feeds(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=s) for k, s in shapes.items()}


def test_gnn_layer_compiles_on_one_and_two_devices():
    sp = _adjacency(60, 50, 0.05, 0)
    a = ej.sparse("A", sp)
    h, w = ej.input("h", (50, 8), "float64"), ej.input("w", (8, 4), "float64")
    y = ej.relu(ej.einsum("ij,jk->ik", a, h @ w))
    assert y.node.inputs[0].kind == "sparseeinsum"
    feeds = _feeds({"h": (50, 8), "w": (8, 4)})
    want = np.maximum(np.einsum("ij,jk->ik", sp.toarray(), feeds["h"] @ feeds["w"]), 0)
    np.testing.assert_allclose(ej.reference(y, **feeds), want, rtol=1e-12, atol=1e-12)
    for devices in (1, 2):
        prog = ej.compile(y, devices=devices)
        for _ in range(2):  # the second run reuses the node's compiled sparse plan
            np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-12, atol=1e-12)
        node = next(n for n in prog.graph.nodes if isinstance(n.op, SparseEinsum))
        # never cut along A's own dims (a kernel there repeats the whole product); its feature
        # dim may be cut (each kernel its columns of h @ w)
        assert all(f or len(b) == 2 for f, b in zip(followed_dims(node), prog.specs[node].bounds))


@pytest.mark.parametrize("eq, pos, dense", [
    ("ij,jk->ik", 0, [(30, 5)]),             # A . H
    ("ji,jk->ik", 0, [(40, 5)]),             # A^T . H
    ("ij,jk->ki", 1, [(5, 40)]),             # (H . A)^T, the sparse operand second
    ("ij,jk,kl->il", 1, [(6, 40), (30, 3)]),  # a chain through the sparse operand
    ("ij,jk->i", 0, [(30, 4)]),              # a label only the dense operand carries, summed
    ("ij,ij->ij", 0, [(40, 30)]),            # elementwise: the result keeps A's support
])
def test_equations_equal_numpy_on_the_densified_tensor(eq, pos, dense):
    sp = _adjacency(40, 30, 0.1, 1)
    a = ej.sparse("A", sp)
    xs = [ej.input(f"x{i}", s, "float64") for i, s in enumerate(dense)]
    ops = list(xs)
    ops.insert(pos, a)
    y = ej.einsum(eq, *ops)
    feeds = _feeds({f"x{i}": s for i, s in enumerate(dense)}, 2)
    vals = [feeds[f"x{i}"] for i in range(len(dense))]
    vals.insert(pos, sp.toarray())
    want = np.einsum(eq, *vals)
    np.testing.assert_allclose(ej.reference(y, **feeds), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ej.compile(y, devices=2).run(**feeds), want, rtol=1e-10, atol=1e-12)


def test_a_rank_three_sparse_tensor_mttkrp():
    rng = np.random.default_rng(3)
    coords = np.unique(rng.integers(0, [12, 10, 8], size=(80, 3)), axis=0)
    vals = rng.normal(size=len(coords))
    t = ej.sparse("T", (coords.T, vals, (12, 10, 8)))
    b, c = ej.input("b", (10, 4), "float64"), ej.input("c", (8, 4), "float64")
    y = ej.einsum("ijk,jr,kr->ir", t, b, c)
    feeds = _feeds({"b": (10, 4), "c": (8, 4)}, 4)
    want = np.einsum("ijk,jr,kr->ir", t.todense(), feeds["b"], feeds["c"])
    np.testing.assert_allclose(ej.compile(y, devices=2).run(**feeds), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("eq, pos, dense", [
    ("ij,jk->ik", 0, [(30, 6)]),
    ("ij,jk->ki", 1, [(6, 40)]),
    ("ij,jk,kl->il", 1, [(6, 40), (30, 4)]),
    ("ij,kj->ikj", 0, [(4, 30)]),              # a feature label and a label of A, both kept
])
@pytest.mark.parametrize("fed", [False, True])
def test_every_cut_of_every_output_dim_equals_numpy(eq, pos, dense, fed):
    """A cut of a dim the sparse operand does not carry runs each kernel on its dense blocks (its
    flops a share of the op's, summing to the whole); a cut of the operand's own dims computes the
    operand's entries in the kernel's rows only (a constant's and a fed one's alike), keeping its
    box. Either way the values are numpy's."""
    sp = _adjacency(40, 30, 0.1, 11)
    a = ej.sparse_input("Acut", sp.shape, nnz=200, dtype="float64") if fed else ej.sparse("Acut", sp)
    xs = [ej.input(f"x{i}", s, "float64") for i, s in enumerate(dense)]
    ops = list(xs)
    ops.insert(pos, a)
    y = ej.einsum(eq, *ops)
    feeds = _feeds({f"x{i}": s for i, s in enumerate(dense)}, 12)
    vals = [feeds[f"x{i}"] for i in range(len(dense))]
    vals.insert(pos, sp.toarray())
    want = np.einsum(eq, *vals)
    if fed:
        feeds["Acut"] = sp
    follow = followed_dims(y.node)
    assert any(follow)
    for d in range(y.ndim):
        counts = {lab: (2 if i == d else 1) for i, lab in enumerate("abc"[:y.ndim])}
        prog = ej.compile(y, devices=2, specs={y.node: counts}, fuse=False)
        np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-10, atol=1e-12)
        node = next(n for n in prog.graph.nodes if isinstance(n.op, SparseEinsum))
        dec = prog.decomps[node]
        work = [kernel_flops(dec, k.index) for k in dec.kernels]
        # every operand computes only its entries in the kernel's rows: no work repeated
        assert sum(work) == sparse_flops(node)


def test_the_planner_splits_a_fed_product_by_its_features_not_repeating_it():
    """relu(A @ (h @ w)) on 2 devices: eindecomp cuts the product along the feature dim (no device
    repeats it), and the model's bytes fall (6976 -> 5696: h @ w is no longer read whole by both)."""
    from einjoin.planner.cost import model_cost
    from einjoin.planner.search import eindecomp
    a = ej.sparse_input("Aplan", (50, 40), nnz=200, dtype="float64")
    h, w = ej.input("hplan", (40, 8), "float64"), ej.param("wplan", (8, 4), "float64")
    y = ej.relu(a @ (h @ w))
    g = ej.Graph(y)
    specs = eindecomp(g, ej.local(2))
    node = y.node.inputs[0]
    assert specs[node].bounds == ((0, 50), (0, 2, 4))
    assert model_cost(g, ej.local(2), specs) == 5696
    sp = _adjacency(50, 40, 0.08, 13)
    feeds = _feeds({"hplan": (40, 8), "wplan": (8, 4)}, 14)
    prog = ej.compile(y, devices=2, specs=specs)
    want = np.maximum(sp.toarray() @ (feeds["hplan"] @ feeds["wplan"]), 0)
    np.testing.assert_allclose(prog.run(Aplan=sp, **feeds), want, rtol=1e-10, atol=1e-12)


def test_a_planner_cut_is_replicated_work_with_the_same_values():
    sp = _adjacency(24, 20, 0.2, 5)
    a = ej.sparse("A", sp)
    h = ej.input("h", (20, 6), "float64")
    y = ej.einsum("ij,jk->ik", a, h)
    feeds = _feeds({"h": (20, 6)}, 6)
    prog = ej.compile(y, devices=2, specs={y.node: {"a": 2, "b": 2}})
    np.testing.assert_allclose(prog.run(**feeds), sp.toarray() @ feeds["h"], rtol=1e-12, atol=1e-12)


def test_torch_backend_and_half_precision():
    sp = _adjacency(30, 20, 0.2, 7)
    a = ej.sparse("A", sp.astype(np.float32))
    h = ej.input("h", (20, 6), "float16")
    y = ej.einsum("ij,jk->ik", a, h)
    assert y.dtype == "float32"  # float32 sparse values with float16 activations: float32, as torch
    hv = np.random.default_rng(8).normal(size=(20, 6)).astype(np.float16)
    want = sp.toarray().astype(np.float32) @ hv.astype(np.float32)
    for backend in ("threads", "torch"):
        out = ej.compile(y, devices=2, backend=backend).run(h=hv)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    a16 = ej.sparse("A16", (np.stack([sp.row, sp.col]), sp.data.astype(np.float16), sp.shape))
    y16 = ej.einsum("ij,jk->ik", a16, h)
    assert y16.dtype == "float16"
    want16 = (a16.todense().astype(np.float32) @ hv.astype(np.float32)).astype(np.float16)
    out16 = ej.compile(y16, backend="torch").run(h=hv)
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float32), want16.astype(np.float32), rtol=2e-3, atol=2e-3)


def test_the_graph_prints_the_sparse_operand():
    a = ej.sparse("A", _adjacency(10, 8, 0.3, 9))
    y = ej.einsum("ij,jk->ik", a, ej.input("h", (8, 3), "float64"))
    text = str(ej.Graph(y))
    assert f"sparse_einsum[A{{ij}},jk->ik | A: sparse float64[10, 8], {a.nnz} stored](h) : float64[10, 3]" in text


def test_errors_name_the_op_the_label_and_the_shapes():
    a = ej.sparse("A", _adjacency(10, 8, 0.3, 9))
    with pytest.raises(ShapeError, match=r"sparse_einsum 'ij,jk->ik'.*'A'.*label 'j' has size 8 in operand 0 "
                                          r"\(shape \(10, 8\)\) but size 7 in operand 1"):
        ej.einsum("ij,jk->ik", a, ej.input("h", (7, 3)))
    with pytest.raises(ShapeError, match=r"sparse_einsum \(sparse operand 'A' \[10, 8\] at 0\).*'jk'.*rank 1"):
        ej.einsum("ij,jk->ik", a, ej.input("v", (8,)))
    with pytest.raises(UnsupportedOpError, match="2 sparse operands"):
        ej.einsum("ij,jk,kl->il", a, ej.input("h", (8, 10)), a)
    with pytest.raises(EinjoinError, match="operand 1 is a ndarray"):
        ej.einsum("ij,jk,kl->il", a, np.ones((8, 2)), ej.input("w", (2, 2)))
    with pytest.raises(UnsupportedOpError, match="join 'add'"):
        ej.einsum("ij,ij->ij", a, ej.input("z", (10, 8)), join="add")
    with pytest.raises(UnsupportedOpError, match="aggregation 'min'"):  # (max: tests/test_sparse_graph_max.py)
        ej.einsum("ij,jk->ik", a, ej.input("h", (8, 3)), agg="min")
    with pytest.raises(ej.EinsumSyntaxError, match="'j' are missing from the output but agg is None"):
        ej.einsum("ij,jk->ik", a, ej.input("h", (8, 3)), agg=None)
    z = ej.input("z", (10, 8), "float64")
    assert ej.einsum("ij,ij->ij", a, z, agg=None).node is ej.einsum("ij,ij->ij", a, z).node  # nothing summed
    with pytest.raises(DTypeError, match="dense operand of dtype int64"):
        ej.einsum("ij,jk->ik", a, ej.input("i", (8, 3), "int64"))
    with pytest.raises(UnsupportedOpError, match="repeats a label"):
        ej.einsum("ij,jj->ij", a, ej.input("q", (8, 8)))
    # eager sparse einsums on arrays are unchanged
    assert isinstance(ej.einsum("ij,jk->ik", a, np.ones((8, 2))), ej.SparseTensor)


def test_the_same_einsum_twice_is_one_node():
    a = ej.sparse("A", _adjacency(10, 8, 0.3, 9))
    h = ej.input("h", (8, 3), "float64")
    assert ej.einsum("ij,jk->ik", a, h).node is ej.einsum("ij,jk->ik", a, h).node


def test_gnn_training_matches_torch_autograd():
    """Two layers relu(A X W1) then A H W2, MSE loss; three SGD steps from ej.grad's gradients
    (compiled on 2 devices) against torch.sparse.mm's autograd doing the same."""
    sp = _adjacency(40, 40, 0.1, 10)
    a = ej.sparse("A", sp)
    x = ej.input("x", (40, 6), "float64")
    t = ej.input("t", (40, 2), "float64")
    w1, w2 = ej.param("w1", (6, 5), "float64"), ej.param("w2", (5, 2), "float64")
    hid = ej.relu(ej.einsum("ij,jk->ik", a, x @ w1))
    out = ej.einsum("ij,jk,kl->il", a, hid, w2)
    loss = ej.mean((out - t) ** 2)
    g1, g2 = ej.grad(loss, [w1, w2])
    prog = ej.compile([loss, g1, g2], devices=2)
    feeds = _feeds({"x": (40, 6), "t": (40, 2), "w1": (6, 5), "w2": (5, 2)}, 11)
    A = torch.sparse_coo_tensor(np.stack([sp.row, sp.col]), sp.data, sp.shape, check_invariants=True)
    tw1 = torch.tensor(feeds["w1"], requires_grad=True)
    tw2 = torch.tensor(feeds["w2"], requires_grad=True)
    opt = torch.optim.SGD([tw1, tw2], lr=0.1)
    for _ in range(3):
        lv, d1, d2 = prog.run(**feeds)
        opt.zero_grad()
        th = torch.relu(torch.sparse.mm(A, torch.tensor(feeds["x"]) @ tw1))
        tl = ((torch.sparse.mm(A, th) @ tw2 - torch.tensor(feeds["t"])) ** 2).mean()
        tl.backward()
        np.testing.assert_allclose(lv, tl.item(), rtol=1e-10)
        np.testing.assert_allclose(d1, tw1.grad.numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d2, tw2.grad.numpy(), rtol=1e-9, atol=1e-12)
        opt.step()
        feeds["w1"], feeds["w2"] = feeds["w1"] - 0.1 * d1, feeds["w2"] - 0.1 * d2
    assert any(isinstance(n.op, SparseEinsum) and n.op.out_labels == ("j", "k") for n in prog.graph.nodes), \
        "the backward holds the transposed sparse einsum (A^T G)"


_EQS = [("ij,jk->ik", 0), ("ij,jk->ki", 1), ("ij,jk,kl->il", 1), ("ij,jk->i", 0), ("ij,ij->ij", 0),
        ("ij,jk,ik->k", 0)]


@settings(max_examples=examples(16), deadline=None)
@given(st.sampled_from(_EQS), st.integers(1, 9), st.integers(1, 9), st.integers(1, 4),
       st.sampled_from([0.0, 0.05, 0.3, 1.0]), st.integers(0, 2 ** 16))
def test_random_sparse_einsums_and_gradients_equal_the_dense_graph(case, n, m, k, density, seed):
    """The sparse node's value and its gradients w.r.t. every dense operand equal the same program
    with the densified tensor as a dense input (the dense einsum's own adjoints), compiled."""
    eq, pos = case
    rng = np.random.default_rng(seed)
    sp = scipy.sparse.random_array((n, m), density=density, random_state=seed, format="coo")
    a = ej.sparse(f"A{seed}", sp)
    terms = eq.split("->")[0].split(",")
    size = {"i": n, "j": m, "k": k, "l": 3}
    if pos == 1:  # the sparse operand reads labels j, k: sizes by its shape
        size = {"i": k, "j": n, "k": m, "l": 3}
    dense_terms = [tm for i, tm in enumerate(terms) if i != pos]
    xs = [ej.input(f"x{i}", tuple(size[c] for c in tm), "float64") for i, tm in enumerate(dense_terms)]
    feeds = {f"x{i}": rng.normal(size=x.shape) for i, x in enumerate(xs)}
    ops = list(xs)
    ops.insert(pos, a)
    y = ej.einsum(eq, *ops)
    dense_in = ej.input(f"D{seed}", a.shape, "float64")
    dops = list(xs)
    dops.insert(pos, dense_in)
    yd = ej.einsum(eq, *dops)
    c = ej.input("c", y.shape, "float64")
    grads = ej.grad((y * c).sum(), xs)
    dgrads = ej.grad((yd * c).sum(), xs)
    feeds["c"] = rng.normal(size=y.shape)
    got = ej.compile([y, *grads], devices=2).run(**feeds)
    want = ej.reference([yd, *dgrads], **feeds, **{f"D{seed}": sp.toarray()})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


def test_matmul_with_a_sparse_matrix_builds_the_node():
    sp = _adjacency(12, 10, 0.3, 12)
    a = ej.sparse("A", sp)
    h = ej.input("h", (10, 3), "float64")
    v = ej.input("v", (12,), "float64")
    outs = [a @ h, ej.matmul(a, h), v @ a, a @ h[:, 0]]
    assert all(isinstance(o.node.op, SparseEinsum) for o in outs)
    feeds = _feeds({"h": (10, 3), "v": (12,)}, 13)
    d = sp.toarray()
    want = [d @ feeds["h"], d @ feeds["h"], feeds["v"] @ d, d @ feeds["h"][:, 0]]
    for got, w in zip(ej.compile(outs, devices=2).run(**feeds), want):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("block", [1, 3])
def test_a_program_holding_a_sparse_constant_pickles_and_saves(tmp_path, block):
    """Pickled, and saved with prog.save / ej.load (the constant's keys and data with the
    program's arrays, once): the same values, its gradient program too, at blocks 1 and 3."""
    import json
    import pickle
    import struct
    import zipfile
    sp = _adjacency(12, 10, 0.3, 14)
    h = ej.input("h", (10, 3), "float64")
    y = ej.einsum("ij,jk->ik", ej.sparse("A", sp, block=block), h)
    (dh,) = ej.grad((y * y).sum(), [h])
    prog = ej.compile([y, dh], devices=2)
    hv = _feeds({"h": (10, 3)}, 15)["h"]
    want = (sp.toarray() @ hv, 2 * sp.toarray().T @ (sp.toarray() @ hv))
    for got in (pickle.loads(pickle.dumps(prog)).run(h=hv), prog.run(h=hv)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12)
    prog.save(tmp_path / "p.ej")
    back = ej.load(tmp_path / "p.ej")
    for g, w in zip(back.run(h=hv), want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    with zipfile.ZipFile(tmp_path / "p.ej") as z:
        raw = z.read("arrays.safetensors")
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert len([k for k in header if k != "__metadata__"]) == 2, "the constant's keys and data once (two nodes hold it)"


def test_a_program_with_a_fed_sparse_input_saves_and_loads(tmp_path):
    A = ej.sparse_input("A", (12, 10), nnz=60, dtype="float64")
    h = ej.input("h", (10, 3), "float64")
    y = A @ h
    prog = ej.compile([y, *ej.grad((y * y).sum(), [A, h])], devices=2)
    prog.save(tmp_path / "q.ej")
    back = ej.load(tmp_path / "q.ej")
    hv = _feeds({"h": (10, 3)}, 16)["h"]
    for seed in (17, 18):
        fed = _adjacency(12, 10, 0.3, seed)
        for g, w in zip(back.run(A=fed, h=hv), prog.run(A=fed, h=hv)):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ShapeError, match="input 'A': expected a sparse tensor of shape"):
        back.run(A=_adjacency(10, 12, 0.3, 1), h=hv)


def test_the_reference_of_a_large_sparse_operand_runs_the_sparse_engine(monkeypatch):
    import einjoin.ir.sparse_einsum as se
    sp = _adjacency(30, 20, 0.2, 16)
    y = ej.einsum("ij,jk->ik", ej.sparse("A", sp), ej.input("h", (20, 3), "float64"))
    hv = _feeds({"h": (20, 3)}, 17)["h"]
    monkeypatch.setattr(se, "DENSE_REFERENCE", 0)  # every operand counts as large: never densified
    monkeypatch.setattr(GraphSparse, "todense", lambda self: pytest.fail("the sparse operand was densified"))
    np.testing.assert_allclose(ej.reference(y, h=hv), sp.toarray() @ hv, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.int64, bool])
def test_an_int_or_bool_adjacency_takes_the_float_operands_dtype(dtype):
    m = (_adjacency(12, 10, 0.3, 18).toarray() > 0).astype(dtype)
    a = ej.sparse("A", m)
    h = ej.input("h", (10, 3), "float32")
    y = a @ h
    assert y.dtype == "float32"  # torch's promotion
    loss = (y * y).sum()
    (gh,) = ej.grad(loss, [h])
    hv = np.random.default_rng(19).normal(size=(10, 3)).astype(np.float32)
    d = m.astype(np.float32)
    out, g = ej.compile([y, gh], devices=2).run(h=hv)
    np.testing.assert_allclose(out, d @ hv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g, 2 * d.T @ (d @ hv), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ej.reference(y, h=hv), d @ hv, rtol=1e-6, atol=1e-6)
    from einjoin.ir.sparse_einsum import sparse_einsum_node
    from einjoin.sparse.node import graph_operand
    if a.dtype.kind != "f":  # (ej.sparse stores bool values as float32)
        with pytest.raises(DTypeError, match="no operand is float"):  # (ej.einsum("ij->i", a) runs eagerly)
            sparse_einsum_node(graph_operand(a), 0, [], "ij->i")


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_rank0_dense_operands_and_scalar_outputs(backend):
    # a quadratic form x^T A x (a graph-Laplacian regulariser): its gradient's cotangent is 0-d,
    # and a 0-d dense operand was made 1-d on the way to the sparse engine (a ShapeError at run)
    rng = np.random.default_rng(0)
    ad = rng.standard_normal((6, 6)) * (rng.random((6, 6)) < 0.4)
    a = ej.sparse("A", ad)
    x, s = ej.input("x", (6,), "float64"), ej.input("s", (), "float64")
    q = ej.einsum("i,ij,j->", x, a, x)
    scaled = ej.einsum("ij,->ij", a, s)
    (g,) = ej.grad(q, [x])
    xv = rng.standard_normal(6)
    got = ej.compile([q, g, scaled], devices=2, backend=backend, quiet=True).run(x=xv, s=np.float64(2.5))
    xt = torch.tensor(xv, requires_grad=True)
    want_q = xt @ torch.tensor(ad) @ xt
    want_q.backward()
    np.testing.assert_allclose(got[0], want_q.item(), rtol=1e-12)
    np.testing.assert_allclose(got[1], xt.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(got[2], 2.5 * ad, rtol=1e-12)


def test_matmul_of_a_sparse_matrix_with_a_batch_names_the_shapes():
    # it said "expected an einjoin tensor, got SparseTensor"
    a, h = ej.sparse("A", np.eye(4)), ej.input("h", (2, 4, 3), "float64")
    for left, right in ((a, h), (h.transpose(-2, -1), a)):
        with pytest.raises(ShapeError, match=r"matmul of shapes .* with a sparse operand"):
            left @ right
    hv = np.arange(24.0).reshape(2, 4, 3)
    got = ej.compile(ej.einsum("ij,bjk->bik", a, h), quiet=True).run(h=hv)
    np.testing.assert_allclose(got, np.einsum("ij,bjk->bik", np.eye(4), hv))


def test_a_row_cut_of_a_constant_block_sparse_operand_computes_its_rows_only():
    """einsum_within keeps the stored blocks meeting the kernel's box (blocks of 3 straddling a cut
    at 20): an SpMV ('ij,j->i', no feature dim to cut) on 2 devices splits its work, numpy's values."""
    sp = _adjacency(40, 30, 0.15, 18)
    a = ej.sparse("Ablk", sp, block=3)
    v = ej.input("v", (30,), "float64")
    y = ej.einsum("ij,j->i", a, v)
    vv = np.random.default_rng(19).normal(size=30)
    for spec in ({"a": 2}, {"a": 4}):
        prog = ej.compile(y, devices=2, specs={y.node: spec}, fuse=False)
        np.testing.assert_allclose(prog.run(v=vv), sp.toarray() @ vv, rtol=1e-12, atol=1e-12)
    op = y.node.op
    whole = op.operand.einsum(op, [vv], "float64")
    part = op.operand.einsum_within(op, [vv], "float64", [(20, 40), None])
    np.testing.assert_allclose(part[20:], whole[20:], rtol=1e-12, atol=1e-12)
    assert meeting(op.operand.tensor, ((20, 40), None)).nnz < a.nnz
