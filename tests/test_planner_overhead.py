"""``ej.compile(..., leave_idle=True)``: plans on fewer devices when the work per block is below
the per-task overhead (einjoin.planner.overhead), says so in explain(), and computes the same."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.compiler import CompileOptions
from einjoin.planner.overhead import device_ladder, plan_time, time_floor


def _small() -> tuple[ej.Tensor, dict[str, np.ndarray]]:
    x, w = ej.input("x", (16, 8)), ej.param("w", (8, 8))
    rng = np.random.default_rng(0)
    return ej.softmax((x @ w).relu() @ w), {"x": rng.standard_normal((16, 8)).astype(np.float32),
                                              "w": rng.standard_normal((8, 8)).astype(np.float32)}


def test_a_small_model_is_planned_on_one_device_and_explain_says_so() -> None:
    out, feeds = _small()
    spread = ej.compile(out, devices=4, quiet=True)
    idle = ej.compile(out, devices=4, quiet=True, leave_idle=True)
    assert spread.cluster.size == 4 and spread.plan.devices_note is None
    assert idle.cluster.size == 1
    assert "planned on 1 of the 4 devices" in idle.explain(file=None)
    assert "planned on" not in spread.explain(file=None)
    want = ej.reference(out, **feeds)
    np.testing.assert_allclose(idle.run(**feeds), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(spread.run(**feeds), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cores", [1, 4, 6, 8])
def test_enough_work_keeps_every_core_busy(cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds of work are planned on devices that get every core (with fewer devices than cores
    the threads backend gives each device's kernels its share of them): on 6 cores not 4 devices
    of one core each."""
    monkeypatch.setattr("einjoin.compiler.os.cpu_count", lambda: cores)  # the choice reads the cores
    z = ej.input("a", (4096, 4096)) @ ej.input("b", (4096, 4096))  # 137 GFLOP: seconds of work
    prog = ej.compile(z, devices=4, backend="null", quiet=True, leave_idle=True)
    k = prog.cluster.size
    assert min(cores, k * max(1, cores // k)) == cores, (cores, k)  # every core computes
    assert (prog.plan.devices_note is None) == (k == 4)


def test_devices_are_left_idle_only_when_asked_and_only_where_it_applies() -> None:
    out, _ = _small()
    capped = ej.compile(out, devices=2, backend="null", quiet=True, leave_idle=True, memory_limit="1GiB")
    assert capped.cluster.size == 2  # under caps every device is planned for
    islands = ej.Cluster.islands([1, 1], intra=20e9, inter=1e9)
    assert ej.compile(out, devices=islands, backend="null", quiet=True, leave_idle=True).cluster.size == 2
    with pytest.raises(ej.EinjoinError, match="leave_idle"):
        CompileOptions(leave_idle="yes")


def test_device_ladder() -> None:
    assert device_ladder(1) == [1]
    assert device_ladder(4) == [1, 2, 4]
    assert device_ladder(12) == [1, 2, 4, 8, 12]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=8), st.integers(0, 10**5),
       st.integers(0, 10**5), st.integers(1, 64))
def test_time_floor_bounds_plan_time(flops: list[int], tasks: int, extra: int, cores: int) -> None:
    # a plan with at least `tasks` tasks on len(flops) devices never beats the floor
    per_device = dict(enumerate(flops))
    assert time_floor(sum(flops), tasks, len(flops), cores) <= plan_time(tasks + extra, per_device, cores) * (1 + 1e-12)


# the planner's speed-ups (issue 22) compute what they replace


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=3), st.data())
def test_repart_from_equals_the_estimate_pair_by_pair(dims: list[tuple[int, int]], data: st.DataObject) -> None:
    from einjoin.decomp.partition import Partition, even_bounds
    from einjoin.planner.cost import CostModel, repartition_estimate

    def part() -> Partition:
        return Partition(tuple(even_bounds(n, min(n, data.draw(st.integers(1, k)))) for n, k in dims))
    model = CostModel(ej.Graph(ej.input("x", (1,))), 2)
    have = [part() for _ in range(data.draw(st.integers(1, 6)))]
    need = part()
    got = model.repart_from(tuple(model.pid(h) for h in have), model.pid(need), "float16")
    assert got.tolist() == [repartition_estimate(h, need, "float16") for h in have]
    assert [model.repart(h, need, "float16") for h in have] == got.tolist()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_dual_simplex_is_linprogs_highs_ds(seed: int) -> None:
    from scipy.optimize import linprog
    from scipy.sparse import csc_array, csr_matrix

    from einjoin.planner.ilp import Coo, _dual_simplex

    rng = np.random.default_rng(seed)
    n, m_ub, m_eq = 12, 5, 3
    c = rng.integers(0, 9, n).astype(float)
    dense_ub = rng.integers(-2, 3, (m_ub, n)).astype(float)
    dense_eq = (rng.random((m_eq, n)) < 0.4).astype(float)
    b_ub, b_eq = rng.integers(0, 4, m_ub).astype(float), np.ones(m_eq)
    want = linprog(c, A_ub=csr_matrix(dense_ub), b_ub=b_ub, A_eq=csr_matrix(dense_eq), b_eq=b_eq, bounds=(0, 1),
                   method="highs-ds", options={"presolve": False, "time_limit": 60.0})

    def coo(a: np.ndarray) -> Coo:  # entries in a shuffled order, one split in two halves
        r, k = np.nonzero(a)
        order = rng.permutation(len(r))
        rows, cols, vals = r[order], k[order], a[r, k][order]
        if len(rows):
            rows, cols, vals = np.append(rows, rows[0]), np.append(cols, cols[0]), np.append(vals, vals[0] / 2)
            vals[0] /= 2
        return Coo(rows, cols, vals, a.shape[0])
    a_ub, a_eq = coo(dense_ub), coo(dense_eq)
    assert np.array_equal(a_ub.dense(n), dense_ub) and np.array_equal(a_eq.dense(n), dense_eq)
    # the arrays handed to HiGHS are scipy's compressed columns of the same matrix
    ref = csc_array(np.vstack((dense_ub, dense_eq)))
    got_csc = Coo.stack(a_ub, a_eq).csc(n)
    assert [x.tolist() for x in got_csc] == [ref.indptr.tolist(), ref.indices.tolist(), ref.data.tolist()]
    got = _dual_simplex(c, a_ub, b_ub, a_eq, b_eq, 60.0)
    if want.status != 0:
        assert got is None
    else:
        assert got is not None and np.array_equal(got, want.x)


def test_the_planner_loads_highs_without_importing_scipy_optimize() -> None:
    # a fresh process's first plan: scipy.optimize's import (0.7-1.3 s) is not paid for the LP
    import subprocess
    import sys

    code = ("import sys, einjoin as ej\n"
            "x = ej.input('x', (64, 32)); w = ej.param('w', (32, 32))\n"
            "y = (x @ w).relu(); z = y @ w + y\n"  # y read twice: not a tree, so the ILP step runs
            "ej.compile(z, devices=2, backend='null', quiet=True)\n"
            "print('scipy.optimize._highspy._core' in sys.modules, 'scipy.optimize' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


def test_a_program_compiled_again_for_other_shapes_chooses_among_the_devices_given() -> None:
    import torch

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    prog = ej.compile(ej.from_torch(module, (torch.randn(4, 8),)), devices=4, quiet=True, leave_idle=True)
    assert prog.cluster.size == 1 and prog.plan.given is not None and prog.plan.given.size == 4
    x = torch.randn(6, 8)
    np.testing.assert_allclose(np.asarray(prog.run(x)), module(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    cache = prog.shape_cache
    assert cache is not None and len(cache) == 1  # the program compiled for the new shapes
    again = [cache[k] for k in cache]
    assert again[0] is not prog and "of the 4 devices given" in (again[0].plan.devices_note or "")
