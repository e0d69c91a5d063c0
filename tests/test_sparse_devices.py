"""Sparse einsums on several devices (einjoin.sparse.distribute): the random problems of
test_sparse (uniform and power-law patterns) on 1, 2 and 4 devices (sync and threads; a few on
Ray) equal numpy on the densified inputs, every split label (output keys, or summed keys whose
partial sums are combined by key), the exchange's accounting, explain(), errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sparse import dense, reference, sparse_problems

import einjoin as ej
from einjoin.sparse import SparseTensor
from einjoin.sparse.distribute import Split, _split_of
from einjoin.sparse import distribute


@pytest.fixture(autouse=True)
def split_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """These problems are small: split them anyway (MIN_SPLIT_WORK keeps small steps on one device)."""
    monkeypatch.setattr(distribute, "MIN_SPLIT_WORK", 0.0)


def check(plan: ej.SparsePlan, eq: str, operands: list, agg: str) -> None:
    got = plan.run()
    want = reference(eq, [dense(x) for x in operands], agg)
    got_dense = dense(got)
    assert type(got_dense) is np.ndarray and got_dense.shape == want.shape
    np.testing.assert_allclose(got_dense, want, rtol=1e-9, atol=1e-9, err_msg=plan.explain())
    for step in plan.steps:
        ex, counts = step.exchange, step.counts
        if plan.distribution.devices == 1:
            assert ex is None
            continue
        assert ex is not None and counts is not None
        assert len(ex.tuples) == len(ex.joined) == plan.distribution.devices
        # every joined combination runs on exactly one device
        assert sum(ex.joined) == counts.joined, plan.explain()
        # each input tuple is on at least one device (or joins nowhere); copies beyond it are the replicas
        assert sum(ex.tuples) - ex.replicas <= sum(counts.tuples)


@settings(max_examples=examples(96), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_problems(), st.sampled_from([1, 2, 4]), st.sampled_from(["sync", "threads"]),
       st.sampled_from([None, "i", "j", "k", "l"]))
def test_random_sparse_einsums_on_devices_equal_numpy(problem: tuple, devices: int, backend: str,
                                                       label: str | None) -> None:
    eq, operands, agg, blocks, relational = problem
    plan = ej.sparse_compile(eq, *operands, agg=agg, blocks=blocks, relational=relational, devices=devices,
                             backend=backend)
    plan.distribution.label = label  # a pinned split label (where the step has it), else the histogram's
    check(plan, eq, operands, agg)


def power_law(nodes: int, edges: int, seed: int = 0) -> scipy.sparse.csr_array:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, nodes + 1) ** 0.8
    src = rng.choice(nodes, edges, p=w / w.sum())
    return scipy.sparse.csr_array((rng.standard_normal(edges), (src, rng.integers(0, nodes, edges))),
                                  shape=(nodes, nodes))


@pytest.mark.parametrize("label", ["i", "j"])
def test_split_labels_and_their_exchange(label: str) -> None:
    g = power_law(300, 400)  # each device's rows touch about half of the columns
    a = ej.sparse("A", g)
    h = np.random.default_rng(0).standard_normal((300, 16))
    plan = ej.sparse_compile("ij,jk->ik", a, h, devices=2, backend="threads", relational={"i", "j"})
    plan.distribution.label = label
    np.testing.assert_allclose(plan.run().todense(), g.toarray() @ h)
    ex = plan.steps[0].exchange
    assert ex is not None and ex.split is not None and ex.split.label == label
    if label == "i":  # output keys: no partials; H's rows replicated only where both devices touch them
        assert ex.partials == 0 and 0 < ex.replicas <= 300
        # a dense operand gets only the blocks its device's keys touch: H's rows of A's columns there
        cols = [set(g.tocoo().col[ex.split.owner(g.tocoo().row) == d]) for d in range(2)]
        assert ex.replicas == len(cols[0] & cols[1])
    else:  # summed keys: A and H partitioned (no replica), partial rows combined by key
        assert ex.replicas == 0 and ex.partials > 0
        assert ex.partial_bytes == ex.partials * (16 * 8 + 8)
    text = plan.explain()
    assert f"split on {label} by" in text and "2 devices on backend threads" in text
    assert f"moved {ex.moved} tuple(s)" in text
    assert f"(last run moved {ex.moved} tuple(s)," in text.splitlines()[0]  # the run's totals, one step


def test_a_dense_operand_mostly_touched_goes_whole() -> None:
    # 2000 edges on 300 nodes: each device's rows touch over 90% of H's rows (distribute.WHOLE)
    g = power_law(300, 2000)
    h = np.random.default_rng(0).standard_normal((300, 16))
    plan = ej.sparse_compile("ij,jk->ik", ej.sparse("A", g), h, devices=2, backend="sync", relational={"i", "j"})
    plan.distribution.label = "i"
    np.testing.assert_allclose(plan.run().todense(), g.toarray() @ h)
    ex = plan.steps[0].exchange
    coo = g.tocoo()
    touched = [len(set(coo.col[ex.split.owner(coo.row) == d])) / 300 for d in range(2)]
    assert min(touched) >= 0.9 and ex.replicas == 300  # whole on both: one copy beyond the first
    assert plan.run() is not None and plan.steps[0].exchange.split is ex.split  # kept: same keys
    # other data of the same shapes: the split is chosen again on its keys
    g2 = power_law(300, 400, seed=1)
    np.testing.assert_allclose(plan.run(ej.sparse("B", g2), h).todense(), g2.toarray() @ h)
    assert plan.steps[0].exchange.split is not ex.split and plan.steps[0].exchange.replicas < 300


def test_split_balances_a_power_law_histogram() -> None:
    # a heavy head of keys (Zipf): the range split's cut follows the cumulative weight
    w = 1.0 / np.arange(1, 1001) ** 0.8
    s = _split_of("i", w, 4)
    load = np.bincount(s.owner(np.arange(1000)), weights=w, minlength=4)
    assert s.imbalance == pytest.approx(load.max() / load.mean())
    assert s.imbalance < 1.05
    # one key carrying most of the weight: no split balances it, the better of the two is kept
    w2 = np.ones(100)
    w2[7] = 1000
    s2 = _split_of("i", w2, 2)
    assert s2.imbalance == min(_imb(Split("i", k, 2, b, 0), w2) for k, b in [("range", s2.bounds), ("hash", ())])


def _imb(s: Split, w: np.ndarray) -> float:
    load = np.bincount(s.owner(np.arange(len(w))), weights=w, minlength=s.n)
    return float(load.max() / load.mean())


def test_max_splits_output_keys_only_and_dense_results_sum_partials() -> None:
    rng = np.random.default_rng(1)
    a = ej.sparse("A", scipy.sparse.random(60, 50, density=0.1, random_state=2))
    h = -np.abs(rng.standard_normal((50, 7)))  # every product <= 0: absent tuples (0) win the max
    plan = ej.sparse_compile("ij,jk->ik", a, h, agg="max", devices=2, backend="sync", relational={"i", "j"})
    plan.distribution.label = "j"  # not an output label: max does not split on it
    res = plan.run()
    np.testing.assert_allclose(res.todense(), reference("ij,jk->ik", [a.todense(), h], "max"))
    assert plan.steps[0].exchange.split is None and plan.steps[0].exchange.joined[1] == 0
    plan.distribution.label = None
    np.testing.assert_allclose(plan.run().todense(), reference("ij,jk->ik", [a.todense(), h], "max"))
    assert plan.steps[0].exchange.split.label == "i"
    # no relational output label: one partial block per device, summed on device 0
    p2 = ej.sparse_compile("ij,jk->k", a, h, devices=4, backend="threads", relational={"j"})
    np.testing.assert_allclose(p2.run(), a.todense().sum(0) @ h)
    ex = p2.steps[0].exchange
    assert ex.split is not None and ex.partials == sum(1 for j in ex.joined[1:] if j)


def test_float16_partials_add_in_float32() -> None:
    a = ej.sparse("A", (np.array([[0, 0, 0, 0], [0, 1, 2, 3]]), np.full(4, 1024.0, np.float16), (1, 4)))
    x = np.array([[1.0], [1.0], [0.5], [0.5]], np.float16)
    plan = ej.sparse_compile("ij,jk->ik", a, x, devices=2, backend="sync", relational={"i", "j"})
    plan.distribution.label = "j"  # each device sums 1024 + 1024 or 512 + 512; the partials meet in float32
    got = plan.run().todense()
    assert got.dtype == np.float16 and got[0, 0] == np.float16(3072.0)


def test_errors_name_devices_and_backend() -> None:
    a = ej.sparse("A", np.eye(3))
    with pytest.raises(ej.EinjoinError, match="devices=0"):
        ej.sparse_compile("ij->i", a, devices=0)
    with pytest.raises(ej.UnsupportedOpError, match="'null'"):
        ej.sparse_compile("ij->i", a, devices=2, backend="null")
    with pytest.raises(ej.EinjoinError, match="unknown backend"):
        ej.sparse_compile("ij->i", a, devices=2, backend="gpu")
    # the torch backend (CPU) and DuckDB on several devices run: tests/test_sparse_matrix.py


def test_einsum_sparse_path_takes_devices() -> None:
    a = ej.sparse("A", scipy.sparse.random(30, 20, density=0.2, random_state=4))
    h = np.ones((20, 3))
    from einjoin.sparse import sparse_einsum
    got = sparse_einsum("ij,jk->ik", a, h, devices=2, backend="sync")
    assert isinstance(got, SparseTensor)
    np.testing.assert_allclose(got.todense(), a.todense() @ h)


@pytest.mark.xdist_group("ray")
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(sparse_problems(), st.sampled_from([None, "j"]))
def test_random_sparse_einsums_on_ray(ray_backend, problem: tuple, label: str | None) -> None:
    eq, operands, agg, blocks, relational = problem
    plan = ej.sparse_compile(eq, *operands, agg=agg, blocks=blocks, relational=relational, devices=2,
                             backend=ray_backend)
    plan.distribution.label = label
    check(plan, eq, operands, agg)
    assert "2 devices on backend ray" in plan.explain()


@pytest.mark.parametrize("label", ["i", "j"])
def test_hypersparse_labels_split_on_the_keys_present(label: str) -> None:
    # a grid of 10**9 keys: the histogram holds only the keys present (no bincount of the grid)
    rng = np.random.default_rng(0)
    n = 10 ** 9
    ia = rng.integers(0, n, (2, 300))
    ib = np.stack([ia[1][:200], rng.integers(0, 7, 200)])
    a = ej.sparse("A", (ia, rng.standard_normal(300), (n, n)))
    b = ej.sparse("B", (ib, rng.standard_normal(200), (n, 7)))
    plan = ej.sparse_compile("ij,jk->ik", a, b, devices=4, backend="threads", relational={"i", "j"})
    plan.distribution.label = label
    got, want = plan.run(), ej.sparse_compile("ij,jk->ik", a, b).run()
    (cg, vg), (cw, vw) = got.coo(), want.coo()
    og, ow = np.lexsort(cg.T[::-1]), np.lexsort(cw.T[::-1])
    np.testing.assert_array_equal(cg[og], cw[ow])
    np.testing.assert_allclose(vg[og], vw[ow], rtol=1e-12)
    ex = plan.steps[0].exchange
    assert ex.split.label == label and ex.split.imbalance < 1.5
    assert sum(ex.joined) == plan.steps[0].counts.joined
