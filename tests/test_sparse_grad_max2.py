"""The gradient of a ``max`` sparse einsum with two (or three) sparse operands (issue 24,
``einjoin/sparse/grad_max.py``): ``plan.vjp`` against torch autograd through ``amax`` of the full
product on the densified operands. The terms that can be nonzero are the sparse operands'
stored entries joined on their shared labels; every other term is an absent one (product 0).

Ties: an output's gradient is split evenly among every term equal to its maximum, absent terms
included (they pass nothing on: a factor of theirs is 0), which is torch's rule for ``amax``
("evenly distributes gradient between equal values"); small integer values make ties, among
stored products and with the absent zeros, in most draws. A sparse operand's gradient is torch's
dense one at its stored entries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.sparse.grad_max import _join
from einjoin.sparse.tensor import SparseTensor

# (equation, positions of the sparse operands)
CASES = [
    ("ij,jk->ik", (0, 1)),        # a sparse-sparse product's max
    ("ij,jk->ki", (0, 1)),
    ("ij,ij->i", (0, 1)),         # both on the same labels: co-present entries only
    ("ij,kl->il", (0, 1)),        # no label shared: every pair of entries
    ("ij,jk,kl->il", (0, 2)),     # a dense operand between them
    ("ij,jk,kl->il", (0, 1)),     # two sparse then a dense one
    ("ijk,jr,kr->ir", (0, 1)),    # rank 3 joined with a matrix
    ("ij,jk,kl->il", (0, 1, 2)),  # three sparse operands
    ("ij,jk->ijk", (0, 1)),       # nothing aggregated
]
SIZES = {"i": 3, "j": 4, "k": 3, "l": 2, "r": 2}


def _torch_amax(eq: str, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    ts = [torch.tensor(v, requires_grad=True) for v in arrays]
    letters = sorted(set("".join(terms)))
    prod = None
    for t, ls in zip(ts, terms):  # the full product over every label, then amax over the reduced ones
        view = t.permute(*[ls.index(lab) for lab in letters if lab in ls])
        view = view[tuple(slice(None) if lab in ls else None for lab in letters)]
        prod = view if prod is None else prod * view
    reduced = [d for d, lab in enumerate(letters) if lab not in rhs]
    out = prod.amax(dim=reduced) if reduced else prod
    keep = [lab for lab in letters if lab in rhs]
    return out.permute(*[keep.index(lab) for lab in rhs]), ts


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2 ** 16),
       densities=st.tuples(*[st.sampled_from([0.0, 0.3, 0.7, 1.0])] * 3), signed=st.booleans())
def test_max_gradient_with_several_sparse_operands_equals_torch_amax(case, seed, densities, signed):
    eq, sparse_at = case
    rng = np.random.default_rng(seed)
    terms = eq.split("->")[0].split(",")
    low = -2 if signed else 0  # all non-negative: the absent zeros tie with many stored products
    arrays, operands = [], []
    for k, ls in enumerate(terms):
        shape = tuple(SIZES[lab] for lab in ls)
        v = rng.integers(low, 3, shape).astype(float)
        if k in sparse_at:
            v = v * (rng.random(shape) < densities[sparse_at.index(k)])
            coords = np.argwhere(v != 0)
            operands.append(ej.sparse(f"S{k}", (coords.T, v[v != 0], shape)))
        else:
            operands.append(v)
        arrays.append(v)
    plan = ej.sparse_compile(eq, *operands, agg="max")
    out = plan.run()
    out = out.todense() if isinstance(out, SparseTensor) else np.asarray(out)
    want, ts = _torch_amax(eq, arrays)
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-12, atol=1e-12)
    g = rng.normal(size=out.shape)
    (want * torch.tensor(g)).sum().backward()
    grads = plan.vjp(g)
    for k, (got, t) in enumerate(zip(grads, ts)):
        if k in sparse_at:
            assert isinstance(got, SparseTensor)
            got, exp = got.todense(), t.grad.numpy() * (arrays[k] != 0)  # on its stored entries
        else:
            exp = t.grad.numpy()
        np.testing.assert_allclose(got, exp, rtol=1e-10, atol=1e-12, err_msg=f"operand {k} of {eq}")


def test_ties_split_evenly_as_torch_and_absent_terms_take_their_share():
    """out = max_j A[0, j] B[j, 0] with A = [1, 1, 0], B = [2, 2, 5]: j=0 and j=1 tie at 2 (the
    absent A[0, 2] gives 0 < 2): each gets half. With B = [-1, -1, 5] the maximum is the absent
    term's 0, so the stored terms get nothing and neither does the absent one pass any on."""
    a = ej.sparse("A", np.array([[1.0, 1.0, 0.0]]))
    for bv, want_a, want_b in (([2.0, 2.0, 5.0], [[1.0, 1.0, 0.0]], [[0.5], [0.5], [0.0]]),
                               ([-1.0, -1.0, 5.0], [[0.0, 0.0, 0.0]], [[0.0], [0.0], [0.0]])):
        b = ej.sparse("B", np.array(bv).reshape(3, 1))
        plan = ej.sparse_compile("ij,jk->ik", a, b, agg="max")
        plan.run()
        da, db = plan.vjp(np.ones((1, 1)))
        np.testing.assert_array_equal(da.todense(), want_a)
        np.testing.assert_array_equal(db.todense(), np.asarray(want_b) * (np.array(bv).reshape(3, 1) != 0))
        out, (ta, tb) = _torch_amax("ij,jk->ik", [np.array([[1.0, 1.0, 0.0]]), np.array(bv).reshape(3, 1)])
        out.sum().backward()
        np.testing.assert_array_equal(da.todense(), ta.grad.numpy() * (ta.detach().numpy() != 0))


def test_a_stored_zero_product_ties_with_the_absent_terms_zeros():
    """max_j A[0, j] D[j, 0] B[0, 0] with A = [1, 1, (absent)], D = [0, -1, 4], B = 2: the terms are
    0 (stored, D's zero), -2 and 0 (absent): the two zeros tie, so D[0] gets half of the gradient
    times A[0, 0] B[0, 0] (1.0, as torch), not all of it."""
    av, dv, bv = np.array([[1.0, 1.0, 0.0]]), np.array([[0.0], [-1.0], [4.0]]), np.array([[2.0]])
    plan = ej.sparse_compile("ij,jk,kl->il", ej.sparse("A", av), dv, ej.sparse("B", bv), agg="max")
    plan.run()
    da, dd, db = plan.vjp(np.ones((1, 1)))
    out, ts = _torch_amax("ij,jk,kl->il", [av, dv, bv])
    out.sum().backward()
    np.testing.assert_array_equal(dd, [[1.0], [0.0], [0.0]])
    np.testing.assert_array_equal(dd, ts[1].grad.numpy())
    np.testing.assert_array_equal(da.todense(), ts[0].grad.numpy() * (av != 0))
    np.testing.assert_array_equal(db.todense(), ts[2].grad.numpy())


def test_the_join_pairs_every_co_present_entry_once():
    a = ej.sparse("A", np.array([[1.0, 0.0, 2.0], [0.0, 3.0, 4.0]]))
    b = ej.sparse("B", np.array([[5.0, 0.0], [0.0, 0.0], [6.0, 7.0]]))
    labels, coords, entry = _join([a, b], [("i", "j"), ("j", "k")], [0, 1], {"i": 2, "j": 3, "k": 2}, "test")
    assert labels == ("i", "j", "k")
    got = sorted(map(tuple, coords.tolist()))
    # (i, j) in A joined with (j, k) in B on j: j=0 -> (0,0,0); j=2 -> (0|1, 2, 0|1); j=1 has no B entry
    assert got == [(0, 0, 0), (0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    av, bv = a.coo()[1], b.coo()[1]
    for t in range(len(coords)):  # each term reads the entries at its coordinates
        i, j, k = coords[t]
        assert av[entry[0][t]] == a.todense()[i, j] and bv[entry[1][t]] == b.todense()[j, k]


def test_a_label_repeated_within_an_operand_is_still_refused():
    a = ej.sparse("A", np.eye(3))
    with pytest.raises(ej.EinjoinError, match="repeats a label"):
        ej.sparse_compile("ii,ik->ik", a, ej.sparse("B", np.eye(3)), agg="max")
