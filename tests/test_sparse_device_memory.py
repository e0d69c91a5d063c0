"""Per-device memory of the relational executors (issue 24): ``plan.run_stats`` holds each
device's tuple bytes per step (inputs held at the step's layout plus its output tuples) and their
peak; ``memory_limit=`` refuses a step whose tuples would exceed it on some device, naming the
device and the bytes, before it runs: never a silent overrun (a capped run's bytes are within the
cap, or it was refused).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sparse import dense, reference, sparse_problems

import einjoin as ej
from einjoin.sparse import distribute


@pytest.fixture(autouse=True)
def split_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """These problems are small: split them anyway (MIN_SPLIT_WORK keeps small steps on one device)."""
    monkeypatch.setattr(distribute, "MIN_SPLIT_WORK", 0.0)


def gnn() -> tuple:
    a = ej.sparse("A", scipy.sparse.random(400, 300, density=0.05, random_state=0))
    return a, np.ones((300, 16))


def test_one_device_counts_the_relations_and_the_output() -> None:
    a, h = gnn()
    plan = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, backend="sync")
    plan.run()
    # A: 6000 entries of one float64 and two int64 keys; H: 300 rows of 16 float64 and a j key;
    # out: 400 rows of 16 float64 and an i key
    want = a.nnz * (8 + 16) + 300 * (16 * 8 + 8) + 400 * (16 * 8 + 8)
    assert plan.run_stats is not None and plan.run_stats.peak_bytes == (want,)
    assert plan.run_stats.step_bytes == ((want,),)
    duck = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, engine="duckdb", duckdb_memory="256MB")
    pytest.importorskip("duckdb")
    duck.run()
    assert duck.run_stats is not None and duck.run_stats.peak_bytes == (want,)


@pytest.mark.parametrize("devices", [2, 4])
def test_devices_hold_their_parts(devices: int) -> None:
    a, h = gnn()
    one = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, backend="sync")
    one.run()
    plan = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, devices=devices, backend="threads")
    plan.run()
    assert one.run_stats is not None and plan.run_stats is not None
    peak = plan.run_stats.peak_bytes
    assert len(peak) == devices and all(0 < p < one.run_stats.peak_bytes[0] for p in peak)
    ex = plan.steps[0].exchange
    assert ex is not None
    # the devices' inputs are the whole's plus the replicas; the output rows are split
    assert sum(peak) == one.run_stats.peak_bytes[0] + ex.replica_bytes
    assert "tuple bytes per device" in plan.explain()


def test_a_cap_the_tuples_exceed_is_refused_naming_the_device_and_bytes() -> None:
    a, h = gnn()
    plan = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, devices=2, backend="sync",
                             memory_limit=100_000)
    with pytest.raises(ej.EinjoinError, match=r"ij,jk->ik needs up to \d+ bytes of tuples on device 0 .*"
                                              r"memory_limit of 100000 bytes.*devices="):
        plan.run()
    four = ej.sparse_compile("ij,jk->ik", a, h, relational={"i", "j"}, devices=4, backend="sync",
                             memory_limit="100000")
    np.testing.assert_allclose(four.run().todense(), a.todense() @ h)
    assert four.run_stats is not None and max(four.run_stats.peak_bytes) <= 100_000
    assert four.run_stats.memory_limit == 100_000
    with pytest.raises(ej.EinjoinError, match="duckdb_memory"):
        ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb", memory_limit=100_000)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_problems(max_size=7), st.sampled_from([1, 2, 4]), st.floats(0.2, 1.5))
def test_a_capped_run_stays_within_its_cap_or_is_refused(problem: tuple, devices: int, frac: float) -> None:
    eq, operands, agg, blocks, relational = problem
    free = ej.sparse_compile(eq, *operands, agg=agg, blocks=blocks, relational=relational, devices=devices,
                             backend="sync")
    free.run()
    assert free.run_stats is not None
    if not free.run_stats.step_bytes:  # a zero-size label: nothing ran
        return
    cap = max(1, int(max(free.run_stats.peak_bytes) * frac))
    plan = ej.sparse_compile(eq, *operands, agg=agg, blocks=blocks, relational=relational, devices=devices,
                             backend="sync", memory_limit=cap)
    try:
        got = plan.run()
    except ej.EinjoinError as e:
        assert "bytes of tuples on device" in str(e) and f"memory_limit of {cap} bytes" in str(e)
        return
    assert plan.run_stats is not None
    assert all(b <= cap for step in plan.run_stats.step_bytes for b in step), plan.explain()
    np.testing.assert_allclose(dense(got), reference(eq, [dense(x) for x in operands], agg), rtol=1e-9, atol=1e-9)
