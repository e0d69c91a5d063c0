"""SparsePlan.run on new operands (issue 24): the same block histogram reuses the plan, another
one replans (cached per histogram); explain() and the log say which; bad operands are refused
by name. Results are checked against numpy on the densified data."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse

import einjoin as ej


def perm_matrix(n: int, seed: int) -> scipy.sparse.csr_array:
    """A permutation matrix: n entries, one per row and column (every such matrix has the same
    block histogram at block size 1, and, from 4 on, one that depends on the permutation)."""
    p = np.random.default_rng(seed).permutation(n)
    return scipy.sparse.csr_array((np.arange(1.0, n + 1), (np.arange(n), p)), shape=(n, n))


def test_same_histogram_reuses_the_plan() -> None:
    rng = np.random.default_rng(0)
    h = rng.standard_normal((64, 8))
    a = ej.sparse("A", np.eye(64))
    plan = ej.sparse_compile("ij,jk->ik", a, h)
    steps = plan.steps
    b = ej.sparse("A", 3 * np.eye(64)[::-1].copy())  # the anti-diagonal: the same histogram
    got = plan.run(A=b)
    np.testing.assert_allclose(got.todense(), b.todense() @ h)
    assert plan.steps is steps and "reused the compiled plan" in plan.last_run
    assert "last run: reused the compiled plan" in plan.explain()
    got2 = plan.run(b, 2 * h)  # by position, the same pattern
    np.testing.assert_allclose(got2.todense(), b.todense() @ (2 * h))
    assert plan.steps is steps


def test_pattern_change_replans_and_caches() -> None:
    # A and H are 16 diagonal 16-blocks (the layout keys a label at blocks > 1: k); B has its
    # entries scattered one per row: 16-blocks would be almost all padding, so the replan must
    # key per entry
    rng = np.random.default_rng(1)
    blocks = scipy.sparse.block_diag([rng.standard_normal((16, 16)) for _ in range(16)], format="csr")
    hs = ej.sparse("H", scipy.sparse.block_diag([rng.standard_normal((16, 16)) for _ in range(16)]))
    h = hs.todense()
    a = ej.sparse("A", blocks)
    plan = ej.sparse_compile("ij,jk->ik", a, hs)
    compiled = plan.steps[0].layout
    assert compiled is not None and max(v or 0 for v in compiled.blocks.values()) > 1, compiled.blocks
    b = ej.sparse("A", perm_matrix(256, 2))
    got = plan.run(A=b)
    np.testing.assert_allclose(got.todense(), b.todense() @ h)
    new = plan.steps[0].layout
    assert new is not None and set(new.blocks.values()) == {1}, new.blocks
    assert plan.last_run.startswith("replanned for a new block histogram"), plan.last_run
    assert "operand 0" in plan.last_run and "replanned" in plan.explain()
    replanned = plan.steps
    # back to the compiled pattern: its plan, not a replan
    np.testing.assert_allclose(plan.run(A=a).todense(), a.todense() @ h)
    assert plan.steps[0].layout is compiled and "reused the compiled plan" in plan.last_run
    # the first new pattern again: the cached replan
    np.testing.assert_allclose(plan.run(A=b).todense(), b.todense() @ h)
    assert plan.steps is replanned and "(cached)" in plan.last_run
    # run() without operands is the compiled one again
    np.testing.assert_allclose(plan.run().todense(), a.todense() @ h)
    assert plan.steps[0].layout is compiled


def test_replan_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    a = ej.sparse("A", np.eye(32))
    plan = ej.sparse_compile("ij,jk->ik", a, np.ones((32, 4)))
    with caplog.at_level(logging.INFO, logger="einjoin.sparse"):
        plan.run(A=ej.sparse("A", np.ones((32, 32))))
    assert any("replanned" in r.getMessage() and "'ij,jk->ik'" in r.getMessage() for r in caplog.records)


def test_three_operand_chain_replans_on_new_pattern() -> None:
    rng = np.random.default_rng(4)
    a = ej.sparse("A", scipy.sparse.random(60, 50, density=0.5, random_state=1))
    b, c = rng.standard_normal((50, 40)), rng.standard_normal((40, 30))
    plan = ej.sparse_compile("ij,jk,kl->il", a, b, c)
    sparse_a = ej.sparse("A", scipy.sparse.random(60, 50, density=0.01, random_state=2))
    got = plan.run(A=sparse_a, x2=2 * c)
    np.testing.assert_allclose(got.todense(), sparse_a.todense() @ b @ (2 * c))
    assert "replanned" in plan.last_run


@pytest.mark.parametrize("call, err, words", [
    (lambda p: p.run(B=np.eye(3)), ej.EinjoinError, ["'B'", "none of the plan's operands", "A, x1"]),
    (lambda p: p.run(np.eye(3)), ej.EinjoinError, ["1 operand(s) by position", "2"]),
    (lambda p: p.run(ej.sparse("A", np.eye(3)), np.ones((3, 2)), A=ej.sparse("A", np.eye(3))),
     ej.EinjoinError, ["both by position and by name"]),
    (lambda p: p.run(A=ej.sparse("A", np.eye(4))), ej.ShapeError, ["operand 0", "(4, 4)", "(3, 3)"]),
    (lambda p: p.run(A=np.eye(3)), ej.ShapeError, ["operand 0", "ndarray", "SparseTensor"]),
    (lambda p: p.run(x1=np.ones((3, 2), np.int64)), ej.DTypeError, ["operand 1", "int64", "float64"]),
])
def test_bad_run_operands_are_refused(call, err, words) -> None:
    plan = ej.sparse_compile("ij,jk->ik", ej.sparse("A", np.eye(3)), np.ones((3, 2)))
    with pytest.raises(err) as info:
        call(plan)
    for w in words:
        assert w in str(info.value), str(info.value)
