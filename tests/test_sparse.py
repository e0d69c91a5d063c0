"""Sparse tensors (issue 24): constructors, the relational executor against numpy.einsum on the
densified data, the layout's choices, explain(), errors.

The differential tests draw random einsums (1-3 operands of rank 2-3, some dense, sum or max,
densities 1e-4 to 0.5, uniform or power-law (Zipf) patterns, duplicates and explicit zeros, random
block pins so that edge padding and every relational / dense mix is met) and compare with numpy on
``todense()``.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import scipy.sparse
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.sparse import SparseTensor
from einjoin.sparse.layout import Operand, choose_layout

DENSITIES = [1e-4, 1e-3, 0.01, 0.05, 0.2, 0.5]
PATTERNS = ["uniform", "power"]  # where the entries fall: random_coo


def dense(x: object) -> np.ndarray:
    return x.todense() if isinstance(x, SparseTensor) else np.asarray(x)


def reference(eq: str, arrays: list[np.ndarray], agg: str) -> np.ndarray:
    """numpy's einsum for sum; for max, the product over every label then max over the summed ones."""
    if agg == "sum":
        return np.einsum(eq, *arrays, optimize=True)
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    labels = list(dict.fromkeys(out + "".join(terms)))
    prod = np.ones([1] * len(labels))
    for t, a in zip(terms, arrays):
        view = np.einsum(f"{t}->{''.join(lab for lab in labels if lab in t)}", a)
        prod = prod * view.reshape([a.shape[t.index(lab)] if lab in t else 1 for lab in labels])
    return prod.max(axis=tuple(range(len(out), len(labels)))) if len(labels) > len(out) else prod


def random_coo(rng: np.random.Generator, shape: tuple[int, ...], density: float, pattern: str = "uniform"
               ) -> tuple[np.ndarray, np.ndarray]:
    """(indices (rank, nnz), values) with duplicates and some explicit zeros. ``pattern``
    ``"uniform"`` draws every coordinate uniformly; ``"power"`` draws each coordinate with Zipf
    weights 1 / rank**a (a in 0.8..2, over a shuffled order of the dim): a few heavy rows / columns
    hold most entries (and repeat cells: more duplicates), as in graphs."""
    size = int(np.prod(shape))
    nnz = rng.binomial(size, density)
    nnz += int(nnz > 0 and rng.random() < 0.5) * rng.integers(1, 4)  # duplicates of drawn cells
    if not nnz:
        idx = np.zeros((len(shape), 0), np.int64)
    elif pattern == "power":
        a = rng.choice([0.8, 1.2, 2.0])
        cols = []
        for n in shape:
            w = 1.0 / np.arange(1, n + 1) ** a
            cols.append(rng.permutation(n)[rng.choice(n, nnz, p=w / w.sum())])
        idx = np.stack(cols)
    else:
        idx = np.stack([rng.integers(0, n, nnz) for n in shape])
    vals = rng.standard_normal(nnz)
    vals[rng.random(nnz) < 0.1] = 0.0  # explicit zeros
    return idx, vals


@st.composite
def sparse_problems(draw: st.DrawFn, max_size: int = 9) -> tuple:
    # hypothesis draws the seed and the coarse choices; the rest comes from the seeded generator
    # (drawing every permutation through hypothesis cost more than the einsums themselves)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    pool = "ijkl"
    sizes = {lab: int(rng.integers(1, max_size + 1)) for lab in pool}
    n_ops = draw(st.integers(1, 3))
    terms = ["".join(rng.permutation(list(pool))[:rng.integers(2, 4)]) for _ in range(n_ops)]
    used = list(dict.fromkeys("".join(terms)))
    out = "".join(rng.permutation(used)[:rng.integers(0, min(3, len(used)) + 1)])
    kinds = [bool(rng.integers(2)) for _ in terms]
    kinds[rng.integers(n_ops)] = True  # at least one sparse operand
    density = draw(st.sampled_from(DENSITIES))
    pattern = draw(st.sampled_from(PATTERNS))
    operands: list[object] = []
    for i, (t, sp) in enumerate(zip(terms, kinds)):
        shape = tuple(sizes[lab] for lab in t)
        if sp:
            idx, vals = random_coo(rng, shape, density, pattern)
            operands.append(ej.sparse(f"S{i}", (idx, vals, shape), block=int(rng.integers(1, 4))))
        else:
            operands.append(rng.standard_normal(shape))
    agg = draw(st.sampled_from(["sum", "max"]))
    blocks = {str(rng.choice(used)): int(rng.integers(1, 6))} if rng.random() < 0.5 else {}
    relational = {str(rng.choice(used))} if rng.random() < 0.5 else set()
    return f"{','.join(terms)}->{out}", operands, agg, blocks, relational


@settings(max_examples=examples(240), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_problems())
def test_random_sparse_einsums_equal_numpy(problem: tuple) -> None:
    eq, operands, agg, blocks, relational = problem
    plan = ej.sparse_compile(eq, *operands, agg=agg, blocks=blocks, relational=relational)
    got = plan.run()
    want = reference(eq, [dense(x) for x in operands], agg)
    out_labels = eq.split("->")[1]
    expect_sparse = any(isinstance(x, SparseTensor) and set(t) & set(out_labels)
                        for x, t in zip(operands, eq.split("->")[0].split(",")))
    assert isinstance(got, SparseTensor) == expect_sparse, plan.explain()
    got_dense = dense(got)
    assert type(got_dense) is np.ndarray and got_dense.shape == want.shape
    np.testing.assert_allclose(got_dense, want, rtol=1e-9, atol=1e-9, err_msg=plan.explain())
    for lab, b in blocks.items():  # a pin holds in every step that has the label
        for step in plan.steps:
            lay = step.layout or step.ran
            assert lay is not None
            if lab in lay.blocks:
                assert lay.blocks[lab] == min(b, plan.sizes[lab])


@settings(max_examples=examples(96), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 31), st.sampled_from(DENSITIES), st.sampled_from(["sum", "max"]),
       st.sampled_from(PATTERNS))
def test_larger_matrices_at_every_density(seed: int, density: float, agg: str, pattern: str) -> None:
    # 90 x 70 x 50 x 30: densities down to 1e-4 leave a few entries (or none); ej.einsum dispatches.
    # The chain's max is a three-way join over j and k (no binary steps for max): sum only, here
    rng = np.random.default_rng(seed)
    if pattern == "uniform":
        a = ej.sparse("A", scipy.sparse.random(90, 70, density=density, random_state=seed))
        c = ej.sparse("C", scipy.sparse.random(50, 30, density=density, random_state=seed + 1))
    else:  # heavy rows and columns, duplicates and explicit zeros
        a = ej.sparse("A", (*random_coo(rng, (90, 70), density, pattern), (90, 70)))
        c = ej.sparse("C", (*random_coo(rng, (50, 30), density, pattern), (50, 30)))
    h = rng.standard_normal((70, 50))
    cases = [("ij,jk->ik", (a, h), agg), ("ij,jk,kl->il", (a, h, c), "sum"),
             ("ij,ik,jk->ij", (a, rng.standard_normal((90, 50)), h), agg)]
    for eq, ops, how in cases:
        got = ej.einsum(eq, *ops, agg=how)
        np.testing.assert_allclose(dense(got), reference(eq, [dense(x) for x in ops], how),
                                   rtol=1e-9, atol=1e-9)


def test_constructors_agree() -> None:
    m = scipy.sparse.random(7, 5, density=0.4, random_state=3, format="csr")
    want = m.toarray()
    for data in [m, scipy.sparse.coo_matrix(m), scipy.sparse.csr_array(m), want,
                 (np.stack(m.nonzero()), m.data, m.shape)]:
        s = ej.sparse("M", data)
        assert type(s.todense()) is np.ndarray and s.todense().shape == (7, 5)
        np.testing.assert_array_equal(s.todense(), want)
        np.testing.assert_array_equal(s.to_scipy().toarray(), want)
        np.testing.assert_array_equal(s.reblock((2, 3)).todense(), want)
        np.testing.assert_array_equal(ej.sparse("M", data, block=(3, 5)).todense(), want)


def test_duplicates_summed_and_explicit_zeros_kept_rank3() -> None:
    idx = np.array([[0, 0, 1, 1], [2, 2, 0, 0], [3, 3, 1, 1]])
    s = ej.sparse("T", (idx, np.array([1.0, 2.0, 0.0, 0.0]), (2, 3, 4)))
    want = np.zeros((2, 3, 4))
    want[0, 2, 3] = 3.0
    np.testing.assert_array_equal(s.todense(), want)
    assert s.nnz == 2  # (0, 2, 3) and the explicit zero at (1, 0, 1)
    assert s.tuples()[(1, 0, 1)].item() == 0.0


def test_torch_sparse_coo_tensor() -> None:
    torch = pytest.importorskip("torch")
    t = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 0]]), torch.tensor([1.0, 2.0, 3.0]), (2, 3))
    s = ej.sparse("T", t)
    np.testing.assert_array_equal(s.todense(), t.to_dense().numpy())
    assert s.dtype == np.float32


def test_empty_results_and_all_zero_inputs() -> None:
    a = ej.sparse("A", (np.zeros((2, 0), np.int64), np.zeros(0), (4, 5)))
    h = np.random.default_rng(0).standard_normal((5, 3))
    for agg in ["sum", "max"]:
        r = ej.einsum("ij,jk->ik", a, h, agg=agg)
        assert isinstance(r, SparseTensor) and r.nblocks == 0
        np.testing.assert_array_equal(r.todense(), np.zeros((4, 3)))
        np.testing.assert_array_equal(ej.einsum("ij,jk->k", a, h, agg=agg), np.zeros(3))
    # disjoint supports: no tuple survives the join
    b = ej.sparse("B", (np.array([[1], [2]]), np.array([5.0]), (5, 3)))
    a2 = ej.sparse("A", (np.array([[0], [0]]), np.array([7.0]), (4, 5)))
    assert ej.einsum("ij,jk->ik", a2, b).nblocks == 0
    # a size-0 dim
    z = ej.sparse("Z", (np.zeros((2, 0), np.int64), np.zeros(0), (0, 5)))
    assert ej.einsum("ij,jk->ik", z, h).todense().shape == (0, 3)
    np.testing.assert_array_equal(ej.einsum("ij,jk->k", z, h), np.zeros(3))


def test_max_of_a_row_with_missing_entries_is_zero() -> None:
    # every stored value negative: the absent entries (0) win the max, as in the dense program
    a = ej.sparse("A", (np.array([[0, 0, 1], [0, 1, 2]]), np.array([-1.0, -2.0, -3.0]), (2, 3)))
    np.testing.assert_array_equal(ej.einsum("ij->i", a, agg="max").todense(), [0.0, 0.0])
    full = ej.sparse("F", (np.array([[0, 0, 0], [0, 1, 2]]), np.array([-1.0, -2.0, -3.0]), (1, 3)))
    np.testing.assert_array_equal(ej.einsum("ij->i", full, agg="max").todense(), [-1.0])
    np.testing.assert_array_equal(ej.einsum("ij->", a, agg="max"), 0.0)


def test_layout_follows_the_data() -> None:
    rng = np.random.default_rng(0)
    # very sparse: every label keyed per entry (CSR-like), the dense operand's k in the payload
    a = ej.sparse("A", scipy.sparse.random(400, 300, density=1e-3, random_state=0))
    h = rng.standard_normal((300, 64))
    assert ej.sparse_compile("ij,jk->ik", a, h).blocks == {"i": 1, "k": None, "j": 1}
    # half full: still per entry. The SpMM kernel (~0.3 ns a multiply-add) beats densifying D on
    # each run (~45 ns an entry) and one threaded BLAS call (~0.45 ns a flop in CPU time): 400 x
    # 300 at density 0.5 x 64, 1.6-1.9 ms vs 4.7 ms CPU (/tmp/h35l/half.py, layout.py's constants)
    d = ej.sparse("D", scipy.sparse.random(400, 300, density=0.5, random_state=0))
    assert ej.sparse_compile("ij,jk->ik", d, h).blocks == {"i": 1, "k": None, "j": 1}
    # 32x32 diagonal blocks times a dense matrix: per entry too (the SpMM beats a BLAS call per
    # block, 0.28 vs 0.99 ms CPU); times another block-diagonal matrix: a label keyed at a block
    # size > 1 (per entry 36 ms, the chosen 1.8 ms: /tmp/h35l/ss.py, layout.py's constants)
    blocks = scipy.sparse.block_diag([rng.standard_normal((32, 32)) for _ in range(12)])
    b = ej.sparse("B", blocks)
    lay = ej.sparse_compile("ij,jk->ik", b, rng.standard_normal((384, 64))).blocks
    assert lay == {"i": 1, "k": None, "j": 1}, lay
    lay = ej.sparse_compile("ij,jk->ik", b, ej.sparse("C", blocks)).blocks
    assert max(v or 0 for v in lay.values()) > 1, lay


def test_layout_estimates_match_counted_blocks() -> None:
    coords = np.array([[0, 0], [1, 5], [399, 299], [3, 6]])
    op = Operand("A", ("i", "j"), (400, 300), coords)
    assert op.tuples([1, 1]) == 4 and op.tuples([4, 4]) == 3 and op.tuples([None, 256]) == 2
    assert op.tuples([None, None]) == 1
    lay = choose_layout([op, Operand("B", ("j", "k"), (300, 8), None)], ("i", "k"), {"j": 4}, {"i"})
    assert lay.blocks["j"] == 4 and lay.blocks["i"] is not None and lay.blocks["k"] is None


def test_pins_and_explain_notation() -> None:
    a = ej.sparse("A", scipy.sparse.random(40, 30, density=0.1, random_state=1))
    h = np.ones((30, 5))
    plan = ej.sparse_compile("ij,jk->ik", a, h, blocks={"j": 8}, relational={"i", "k"})
    lay = plan.steps[0].layout
    assert lay is not None and lay.blocks["j"] == 8 and lay.blocks["i"] is not None and lay.blocks["k"] is not None
    text = plan.explain()
    assert re.search(r"I(i)?Jj, JjK(k)? -> I(i)?K(k)?", text), text
    assert "block histogram" in text and "run() for the actual counts" in text
    res = plan.run()
    assert f"actual {plan.steps[0].counts.joined} joined" in plan.explain()
    np.testing.assert_allclose(res.todense(), a.todense() @ h)
    # the plan runs again on other values of the same pattern (block histogram), keeping its layout
    b = ej.sparse("B", 2 * a.to_scipy())
    np.testing.assert_allclose(plan.run(b, 2 * h).todense(), b.todense() @ (2 * h))
    assert plan.steps[0].layout is lay


def test_three_operands_as_binary_steps() -> None:
    # a dense half-full chain is cheaper in two BLAS steps than in one three-way join
    a = ej.sparse("A", scipy.sparse.random(60, 50, density=0.5, random_state=1))
    rng = np.random.default_rng(1)
    b, c = rng.standard_normal((50, 40)), rng.standard_normal((40, 30))
    plan = ej.sparse_compile("ij,jk,kl->il", a, b, c)
    assert len(plan.steps) == 2
    np.testing.assert_allclose(plan.run().todense(), a.todense() @ b @ c)
    assert "t1 = " in plan.explain()


@pytest.mark.parametrize("make, err, words", [
    (lambda: ej.sparse("A", (np.array([[0, 5]]), np.ones(2), (4,))), ej.ShapeError, ["index 5", "dim 0", "size 4"]),
    (lambda: ej.sparse("A", (np.array([[0, -1]]), np.ones(2), (4,))), ej.ShapeError, ["index -1"]),
    (lambda: ej.sparse("A", (np.zeros((1, 0), int), np.ones(0), (-3,))), ej.ShapeError, ["negative", "'A'"]),
    (lambda: ej.sparse("A", (np.array([[0, 1]]), np.ones(3), (4,))), ej.ShapeError, ["2 COO indices"]),
    (lambda: ej.sparse("A", (np.array([[0.5]]), np.ones(1), (4,))), ej.DTypeError, ["integers"]),
    (lambda: ej.sparse("A", object()), ej.EinjoinError, ["cannot read"]),
    (lambda: ej.einsum("ij,jk->ik", ej.sparse("A", np.eye(3)), np.ones((4, 2))), ej.ShapeError,
     ["label 'j'", "(4, 2)"]),
    (lambda: ej.einsum("ij->i", ej.sparse("A", np.eye(3)), agg="min"), ej.UnsupportedOpError,
     ["'min'", "'ij->i'"]),
    (lambda: ej.einsum("ij,ij->ij", ej.sparse("A", np.eye(3)), np.eye(3), join="x0 + x2"), ej.ExpressionError,
     ["x2", "2 input(s)"]),  # join="add" works (tests/test_sparse_joins.py)
    # (ej.einsum with a lazy operand builds a graph node: tests/test_sparse_graph.py)
    (lambda: ej.sparse_compile("ij,jk->ik", ej.sparse("A", np.eye(3)), ej.input("h", (3, 2))), ej.UnsupportedOpError,
     ["lazy", "operand 1"]),
    (lambda: ej.sparse_compile("ij->i", ej.sparse("A", np.eye(3)), blocks={"q": 2}), ej.EinjoinError,
     ["'q'"]),
    (lambda: ej.sparse_compile("ij->i", ej.sparse("A", np.eye(3)), blocks={"j": 0}), ej.PartitionError,
     ["'j'", "size 3"]),
    (lambda: ej.einsum("ii->i", ej.sparse("A", np.eye(3))), ej.UnsupportedOpError, ["repeats"]),
    (lambda: ej.sparse_compile("ij,jk->ik", ej.sparse("A", np.eye(3)), np.ones((3, 2))).run(
        np.eye(3), np.ones((3, 2))), ej.ShapeError, ["operand 0"]),
])
def test_errors_name_what_is_at_fault(make, err, words) -> None:
    with pytest.raises(err) as info:
        make()
    for w in words:
        assert w in str(info.value), str(info.value)


def test_readme_sparse_example_runs() -> None:
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "ej.sparse(" in b]
    # the eager sparse einsums, a sparse tensor inside a trained graph, and one fed at run
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_other_libraries_sparse_operands_stay_sparse() -> None:
    # a scipy / torch sparse operand of sparse_compile becomes a SparseTensor (named x<i>), not densified
    import torch
    m = scipy.sparse.random(6, 5, density=0.4, random_state=3, format="csr")
    a = ej.sparse("A", scipy.sparse.random(4, 6, density=0.5, random_state=4))
    for other in (m, torch.from_numpy(m.toarray()).to_sparse()):
        plan = ej.sparse_compile("ij,jk->ik", a, other)
        assert isinstance(plan.operands[1], ej.SparseTensor) and plan.operands[1].name == "x1"
        np.testing.assert_allclose(plan.run().todense(), a.todense() @ m.toarray(), rtol=1e-12, atol=1e-12)
