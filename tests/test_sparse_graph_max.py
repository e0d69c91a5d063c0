"""``agg="max"`` with a sparse tensor inside the dense graph (issue 24): ``ej.einsum(eq, A, x,
agg="max")`` on a SparseTensor (or an ``ej.sparse_input``) and lazy tensors builds a max
``sparse_einsum`` node: each output the largest product over the summed labels, an absent
entry's product being 0 (a row with no stored entries has maximum 0; a full row of negative
products its largest, negative). Checked against numpy's max over the densified product, at 1,
2 and 4 devices under every cut of its output dims.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.errors import UnsupportedOpError

EQUATIONS = [
    "ij,j->i",          # SpMV's max: a row's largest A[i, j] v[j]
    "ij,jk->ik",        # a GNN's max aggregation over neighbours, per feature
    "ji,jk->ik",        # over the transposed tensor
    "ij,jk->i",         # a label only the dense operand carries, maxed over too
    "ij,jk,kl->il",     # a chain through the sparse operand (it second)
    "ijk,jr,kr->ir",    # rank 3
    "ij,ij->ij",        # nothing aggregated: the products themselves
]


def _numpy_max(eq: str, arrays: list[np.ndarray]) -> np.ndarray:
    ins, out = eq.split("->")
    every = "".join(dict.fromkeys(ins.replace(",", "")))
    prod = np.einsum(f"{ins}->{every}", *arrays)
    summed = tuple(d for d, lab in enumerate(every) if lab not in out)
    res = prod.max(axis=summed) if summed else prod
    kept = "".join(lab for lab in every if lab in out)
    return np.transpose(res, [kept.index(lab) for lab in out])


@settings(max_examples=examples(15), deadline=None)
@given(data=st.data())
def test_max_sparse_einsums_in_a_graph_equal_numpy_on_the_densified_tensor(data):
    eq = data.draw(st.sampled_from(EQUATIONS))
    ins, out = eq.split("->")
    terms = ins.split(",")
    pos = 1 if eq == "ij,jk,kl->il" else 0
    sizes = {lab: data.draw(st.integers(1, 6), label=f"size {lab}") for lab in sorted(set(ins) - {","})}
    shapes = [tuple(sizes[lab] for lab in t) for t in terms]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    density = data.draw(st.sampled_from([0.0, 0.2, 0.6, 1.0]))
    small = data.draw(st.booleans())  # small integers: ties among the products
    shape_a = shapes[pos]
    vals = rng.integers(-3, 4, shape_a).astype(float) if small else rng.normal(size=shape_a)
    dense_a = np.where(rng.random(shape_a) < density, vals, 0.0)
    fed = data.draw(st.booleans())
    name = f"Amax{len(shape_a)}"
    tensor = ej.sparse(name, dense_a)
    nnz = tensor.reblock((1,) * len(shape_a)).nnz
    a = ej.sparse_input(name, shape_a, nnz=nnz + 1, dtype="float64") if fed else tensor
    xs = [ej.input(f"xm{i}", s, "float64") for i, s in enumerate(shapes) if i != pos]
    feeds = {f"xm{i}": (rng.integers(-3, 4, s).astype(float) if small else rng.normal(size=s))
             for i, s in enumerate(shapes) if i != pos}
    operands: list = list(xs)
    operands.insert(pos, a)
    y = ej.einsum(eq, *operands, agg="max")
    arrays = list(feeds.values())
    arrays.insert(pos, dense_a)
    want = _numpy_max(eq, arrays)
    if fed:
        feeds[name] = tensor
    np.testing.assert_allclose(ej.reference(y, **feeds), want, rtol=1e-12, atol=1e-12)
    devices = data.draw(st.sampled_from([1, 2, 4]))
    counts = {"abc"[d]: data.draw(st.integers(1, min(4, n)), label=f"cut {d}") for d, n in enumerate(y.shape)}
    prog = ej.compile(y, devices=devices, specs={y.node: counts}, fuse=False, quiet=True)
    np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-12, atol=1e-12)


def test_a_row_without_stored_entries_has_maximum_zero_and_a_full_row_its_largest_product():
    # row 0 empty, row 1 full with every product negative, row 2 half stored with negative products
    dense = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [2.0, 0.0, 1.0]])
    a = ej.sparse("Arows", dense)
    v = ej.input("vrows", (3,), "float64")
    h = ej.input("hrows", (3, 2), "float64")
    vv = np.array([-1.0, -2.0, -0.5])
    hv = np.array([[-1.0, 4.0], [-2.0, 1.0], [-3.0, 0.5]])
    spmv = ej.einsum("ij,j->i", a, v, agg="max")
    gnn = ej.relu(ej.einsum("ij,jk->ik", a, h, agg="max")) + 1.0
    for devices in (1, 2):
        got_v, got_g = ej.compile([spmv, gnn], devices=devices).run(vrows=vv, hrows=hv)
        np.testing.assert_array_equal(got_v, [0.0, -1.0, 0.0])
        np.testing.assert_array_equal(got_g, np.maximum(_numpy_max("ij,jk->ik", [dense, hv]), 0) + 1.0)


def test_a_max_node_prints_its_aggregation_is_not_the_sum_node_and_saves(tmp_path):
    a = ej.sparse("Aprint", np.array([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    x = ej.input("xprint", (3,), "float64")
    m, s = ej.einsum("ij,j->i", a, x, agg="max"), ej.einsum("ij,j->i", a, x)
    assert m.node is not s.node
    assert "->i, agg=max | Aprint" in repr(m.node)
    assert "agg" not in repr(s.node)
    ej.compile(m, devices=2).save(tmp_path / "max.ej")
    xv = np.array([-1.0, 3.0, 5.0])
    np.testing.assert_array_equal(ej.load(tmp_path / "max.ej").run(xprint=xv), [3.0, 0.0, 0.0])


def test_max_refusals_name_the_op():
    a = ej.sparse("Aref", np.eye(3))
    x = ej.param("xref", (3,), "float64")
    with pytest.raises(UnsupportedOpError, match=r"aggregation 'min' with a sparse operand in a graph"):
        ej.einsum("ij,j->i", a, x, agg="min")
    y = ej.einsum("ij,j->i", a, x, agg="max")
    (dx,) = ej.grad(y.sum(), [x])  # differentiated (tests/test_sparse_graph_max_grad.py); not twice
    with pytest.raises(UnsupportedOpError, match=r"gradient of sparse_einsum .*'Aref'.*the gradient of a sparse max"):
        ej.grad(dx.sum(), [x])
