"""``ej.grad`` through a max sparse einsum inside a graph (issue 24): each output's cotangent goes
to the products equal to its maximum, split evenly among ties as torch's ``amax`` splits them, an
absent entry's product (0) being a term too (it takes its share and passes nothing on). Checked
against torch autograd of ``amax`` over the densified product, under forced cuts at 1, 2 and 4
devices, for a constant and a fed sparse operand (and the fed operand's values, torch's gradient of
the densified tensor at its stored entries); the second derivative is refused naming the op.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.errors import UnsupportedOpError

EQUATIONS = [
    "ij,j->i",          # SpMV's max
    "ij,jk->ik",        # a GNN's max aggregation, per feature
    "ji,jk->ik",        # over the transposed tensor
    "ij,jk->i",         # a label only the dense operand carries, maxed over too
    "ij,jk,kl->il",     # the sparse operand second, two dense operands
    "ijk,jr,kr->ir",    # rank 3
    "ij,ij->ij",        # nothing aggregated
]


def _torch_grads(eq: str, arrays: list[np.ndarray], pos: int, cot: np.ndarray):
    """torch autograd of sum(amax(dense product) * cot): w.r.t. every operand but ``pos``, and
    w.r.t. the densified operand ``pos``."""
    ins, out = eq.split("->")
    every = "".join(dict.fromkeys(ins.replace(",", "")))
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    prod = torch.einsum(f"{ins}->{every}", *ts)
    summed = tuple(d for d, lab in enumerate(every) if lab not in out)
    res = prod.amax(dim=summed) if summed else prod
    kept = "".join(lab for lab in every if lab in out)
    res = res.permute([kept.index(lab) for lab in out]) if out else res
    (res * torch.tensor(cot)).sum().backward()
    return [t.grad.numpy() for i, t in enumerate(ts) if i != pos], ts[pos].grad.numpy()


@settings(max_examples=examples(20), deadline=None)
@given(data=st.data())
def test_the_gradient_through_a_graphs_sparse_max_is_torchs_amax_gradient(data):
    eq = data.draw(st.sampled_from(EQUATIONS))
    ins, out = eq.split("->")
    terms = ins.split(",")
    pos = 1 if eq == "ij,jk,kl->il" else 0
    sizes = {lab: data.draw(st.integers(1, 5), label=f"size {lab}") for lab in sorted(set(ins) - {","})}
    shapes = [tuple(sizes[lab] for lab in t) for t in terms]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    small = data.draw(st.booleans())  # small integers: many ties, and zero products tying absent ones

    def draw(shape):
        return rng.integers(-2, 3, shape).astype(float) if small else rng.normal(size=shape)

    density = data.draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    dense_a = np.where(rng.random(shapes[pos]) < density, draw(shapes[pos]), 0.0)
    name = f"Amg{len(shapes[pos])}"
    tensor = ej.sparse(name, dense_a)
    fed = data.draw(st.booleans())
    a = (ej.sparse_input(name, shapes[pos], nnz=tensor.reblock((1,) * len(shapes[pos])).nnz + 1, dtype="float64")
         if fed else tensor)
    xs = {i: ej.param(f"xmg{i}", s, "float64") for i, s in enumerate(shapes) if i != pos}
    feeds = {f"xmg{i}": draw(s) for i, s in enumerate(shapes) if i != pos}
    operands: list = list(xs.values())
    operands.insert(pos, a)
    y = ej.einsum(eq, *operands, agg="max")
    cot = rng.normal(size=y.shape)
    loss = (y * ej.input("cotmg", y.shape, "float64")).sum()
    grads = ej.grad(loss, list(xs.values()) + ([a] if fed else []))
    feeds["cotmg"] = cot
    if fed:
        feeds[name] = tensor
    arrays = [feeds[f"xmg{i}"] for i in xs]
    arrays.insert(pos, dense_a)
    want, want_a = _torch_grads(eq, arrays, pos, cot)
    if fed:  # the values' gradient: torch's dense gradient of A at its stored entries
        want.append(np.where(dense_a != 0, want_a, 0.0))

    def check(got):
        if fed:
            got = list(got[:-1]) + [a.on_pattern(tensor, got[-1]).todense()]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)

    check(ej.reference(list(grads), **feeds))
    devices = data.draw(st.sampled_from([1, 2, 4]))
    specs = {}
    for gi, gnode in enumerate(grads):  # force cuts of every output dim of each gradient's max node
        node = gnode.node if gnode.node.kind == "sparseeinsum" else gnode.node.inputs[0]
        if node.kind == "sparseeinsum":
            specs[node] = {"abcd"[d]: data.draw(st.integers(1, min(3, n)), label=f"cut {gi} {d}")
                           for d, n in enumerate(node.shape)}
    prog = ej.compile(list(grads), devices=devices, specs=specs, fuse=False, quiet=True)
    check(prog.run(**feeds))


def test_a_gnn_layer_with_max_aggregation_trains_its_weights_as_torch():
    rng = np.random.default_rng(7)
    dense_a = np.where(rng.random((30, 30)) < 0.15, 1.0, 0.0)  # an adjacency of ones: ties wherever features tie
    a = ej.sparse("Amgnn", dense_a)
    h = ej.input("hmgnn", (30, 6), "float32")
    w = ej.param("wmgnn", (6, 4), "float32")
    y = ej.relu(ej.einsum("ij,jk->ik", a, h @ w, agg="max"))
    loss = (y * y).sum()
    (dw,) = ej.grad(loss, [w])
    hv = rng.integers(-2, 3, (30, 6)).astype(np.float32)
    wv = rng.integers(-1, 2, (6, 4)).astype(np.float32)
    got = ej.compile([loss, dw], devices=2, quiet=True).run(hmgnn=hv, wmgnn=wv)
    W = torch.tensor(wv, requires_grad=True)
    Y = torch.relu((torch.tensor(dense_a, dtype=torch.float32)[:, :, None] * (torch.tensor(hv) @ W)[None]).amax(1))
    (Y * Y).sum().backward()
    np.testing.assert_allclose(got[0], float((Y * Y).sum().detach()), rtol=1e-6)
    np.testing.assert_allclose(got[1], W.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_what_a_max_node_does_not_differentiate_is_refused_naming_it():
    a = ej.sparse("Amgref", np.eye(3))
    x = ej.param("xmgref", (3,), "float64")
    y = ej.einsum("ij,j->i", a, x, agg="max")
    (dx,) = ej.grad(y.sum(), [x])
    with pytest.raises(UnsupportedOpError, match=r"gradient of sparse_einsum .*'Amgref'.*gradient of a sparse max"):
        ej.grad((dx * dx).sum(), [x])
    A = ej.sparse_input("Amgfed", (3, 3), nnz=4, dtype="float64")
    z = ej.einsum("ij,j->i", A, x, agg="max")
    da, dxf = ej.grad(z.sum(), [A, x])
    with pytest.raises(UnsupportedOpError, match=r"'Amgfed'.*maxgradvalues: the gradient of a sparse max"):
        ej.grad((da * da).sum(), [x])
    fed = ej.sparse("Amgfed", np.diag([1.0, 2.0, 3.0]))
    got_a, got_x = ej.compile([da, dxf], quiet=True).run(Amgfed=fed, xmgref=np.array([1.0, -1.0, 2.0]))
    # row 1's max is 0, its two absent entries' (its stored product -2 loses): they take the cotangent and
    # pass nothing on; rows 0 and 2 their diagonal's product; the fourth (unused) values row gets 0
    np.testing.assert_array_equal(got_x, [1.0, 0.0, 3.0])
    np.testing.assert_array_equal(got_a, [1.0, 0.0, 2.0, 0.0])


def test_a_fed_operands_values_gradient_through_a_max_is_the_eager_vjps():
    # grad_max's example: row 0's max per feature is 2 * h[1] (its absent entry's 0 loses), row 1's
    # 3 * h[0, 0] and -1 * h[1, 1]; the values' gradient is each entry's winning features' h, summed
    dense_a = np.array([[0.0, 2.0], [3.0, -1.0]])
    hv = np.array([[1.0, -2.0], [4.0, 1.0]])
    A = ej.sparse_input("Amgvj", (2, 2), nnz=4, dtype="float64")
    h = ej.param("hmgvj", (2, 2), "float64")
    da, dh = ej.grad(ej.einsum("ij,jk->ik", A, h, agg="max").sum(), [A, h])
    fed = ej.sparse("Amgvj", dense_a)
    plan = ej.sparse_compile("ij,jk->ik", fed, hv, agg="max")
    plan.run()
    want_a, want_h = plan.vjp(np.ones((2, 2)))
    for got in (ej.reference([da, dh], Amgvj=fed, hmgvj=hv),
                ej.compile([da, dh], devices=2, quiet=True).run(Amgvj=fed, hmgvj=hv)):
        np.testing.assert_array_equal(got[0], [5.0, 1.0, 1.0, 0.0])  # the fed pattern's rows, one unused
        np.testing.assert_array_equal(A.on_pattern(fed, got[0]).todense(), want_a.todense())
        np.testing.assert_array_equal(got[1], want_h)
