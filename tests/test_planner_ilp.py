"""The planner's ILP stops on work, never on the clock: a plan depends on shapes alone.

HiGHS explores at most ``node_limit`` branch-and-bound nodes (``Settings.ilp_node_limit`` /
``mesh_ilp_node_limit``); the wall-clock ``time_limit`` is a far safety net whose hitting is
reported by an ``IlpTimeLimitWarning``. No assertion here depends on how fast the machine is: the
generous time limits are hundreds of times what the solves take, and a hit would warn, which
these tests turn into an error."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.ir.graph import Graph
from einjoin.models.graphs import build
from einjoin.planner import ilp
from einjoin.planner.baselines import mesh_ilp
from einjoin.planner.ilp import IlpTimeLimitWarning, Problem, objective, solve_detail, stop_reason
from einjoin.planner.search import eindecomp
from einjoin.settings import SETTINGS


def _frustrated(n_ops: int = 10, k: int = 2, seed: int = 0, density: float = 0.5) -> Problem:
    """Random costs on a dense graph of ops (keys from a real graph): unlike the planner's
    problems (near-trees, solved at the root), its relaxation is fractional, so HiGHS branches."""
    ops = [v for v in Graph(build("llama-block")).ops if not v.facts.free][:n_ops]
    assert len(ops) == n_ops
    rng = np.random.default_rng(seed)
    pair = {(ops[i], ops[j]): rng.integers(0, 100, (k, k)).astype(float)
            for i in range(n_ops) for j in range(i + 1, n_ops) if rng.random() < density}
    unary = {v: rng.integers(0, 100, k).astype(float) for v in ops}
    # the solver sizes each op's one-hot block by len(strategies[v]); placeholders suffice
    return Problem(ops, {v: [None] * k for v in ops}, unary, pair, {})  # type: ignore[list-item]


@pytest.fixture(scope="module")
def frustrated() -> Problem:
    return _frustrated()


def test_the_node_budget_not_the_time_limit_decides_the_result(frustrated: Problem) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", IlpTimeLimitWarning)  # the safety net must not be reached
        full = solve_detail(frustrated, time_limit=600.0, node_limit=100_000, tight=False)
        assert full.stop == "optimal"
        budget = max(1, full.nodes // 2)
        assert full.nodes > budget, "the test problem must need branch-and-bound nodes"
        cut = [solve_detail(frustrated, time_limit=t, node_limit=budget, tight=False)
               for t in (20.0, 600.0, 20.0)]
    assert {s.stop for s in cut} == {"node_limit"}
    assert all(s.pick == cut[0].pick and s.nodes == cut[0].nodes for s in cut)
    # the budget's answer is a feasible choice, never better than the optimum
    assert objective(frustrated, cut[0].pick) >= objective(frustrated, full.pick)
    # and a generous budget gives the optimum whatever the time limit
    again = solve_detail(frustrated, time_limit=20.0, node_limit=100_000, tight=False)
    assert again.pick == full.pick and again.nodes == full.nodes


def test_hitting_the_time_safety_net_is_reported_never_silent(frustrated: Problem) -> None:
    # a limit no solve can meet: HiGHS stops on the clock, and says so
    with pytest.warns(IlpTimeLimitWarning, match="safety net"):
        try:
            solved = solve_detail(frustrated, time_limit=1e-9, node_limit=100_000, tight=False)
        except ej.EinjoinError as err:
            assert "no solution" in str(err)
        else:
            assert solved.stop == "time_limit"


@pytest.mark.parametrize("status, message, nodes, stop", [
    (0, "Optimization terminated successfully. (HiGHS Status 7: Optimal)", 1, "optimal"),
    (1, "Time limit reached. (HiGHS Status 13: Time limit reached)", 3, "time_limit"),
    (4, "The HiGHS status code was not recognized. (HiGHS Status 16: Solution limit reached)",
     5, "node_limit"),
    (1, "Iteration limit reached. (HiGHS Status 14: Iteration limit reached)", 2, "other"),
])
def test_stop_reason(status: int, message: str, nodes: int, stop: str) -> None:
    assert stop_reason(status=status, message=message, nodes=nodes, node_limit=5) == stop


def _capture_milp(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import scipy.optimize
    seen: list[dict[str, Any]] = []
    real = scipy.optimize.milp

    def spy(c: Any, **kw: Any) -> Any:
        seen.append(dict(kw["options"]))
        return real(c, **kw)

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    return seen


def test_eindecomp_and_mesh_ilp_give_highs_their_settings_budgets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _capture_milp(monkeypatch)
    # a residual MLP: x is read twice, so eindecomp's tree DP is not exact and its ILP step runs
    x, w1, w2 = ej.input("x", (64, 32)), ej.input("w1", (32, 128)), ej.input("w2", (128, 32))
    graph, cluster = Graph((x @ w1).relu() @ w2 + x), ej.local(4)
    # the MIP path (with ilp_lp_first an integral LP relaxation never reaches the MIP solver)
    mip = SETTINGS.replace(ilp_lp_first=False)
    settings = mip.replace(ilp_node_limit=7, ilp_time_limit=123.0,
                           mesh_ilp_node_limit=9, mesh_ilp_time_limit=321.0)
    # each planner runs once with the settings, once with the defaults (same plan: no budget binds)
    for plan, node_limit, time_limit, default in (
            (eindecomp, 7, 123.0, SETTINGS.ilp_node_limit),
            (mesh_ilp, 9, 321.0, SETTINGS.mesh_ilp_node_limit)):
        seen.clear()
        assert plan(graph, cluster, settings=settings) == plan(graph, cluster, settings=mip)
        half = len(seen) // 2
        assert half and all(o["node_limit"] == node_limit and o["time_limit"] == time_limit
                            for o in seen[:half])
        assert all(o["node_limit"] == default for o in seen[half:])


def test_the_default_budgets_are_far_above_what_the_golden_plans_need(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure behind ``Settings.ilp_node_limit``: the planner's ILPs solve at the root."""
    seen: list[int] = []
    import scipy.optimize
    real = scipy.optimize.milp

    def spy(c: Any, **kw: Any) -> Any:
        res = real(c, **kw)
        seen.append(int(res.mip_node_count or 0))
        return res

    monkeypatch.setattr(scipy.optimize, "milp", spy)
    mip = SETTINGS.replace(ilp_lp_first=False)  # the MIP path, whose budget this is
    for model in ("mlp", "chain"):
        for p in (2, 8):
            eindecomp(Graph(build(model)), ej.local(p), settings=mip)
            mesh_ilp(Graph(build(model)), ej.local(p), settings=mip)
    assert seen and max(seen) * 100 <= min(SETTINGS.ilp_node_limit, SETTINGS.mesh_ilp_node_limit)


def test_the_ilp_module_reads_no_clock() -> None:
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(ilp))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"time", "datetime"}


def _planner_problems() -> list[Problem]:
    """The ILPs eindecomp's global step solves on small graphs (captured, not rebuilt)."""
    seen: list[Problem] = []
    real = ilp.solve_detail

    def spy(prob: Problem, **kw: Any) -> Any:
        seen.append(prob)
        return real(prob, **kw)

    ilp.solve_detail = spy  # type: ignore[assignment]
    try:
        for model, p in (("mlp", 4), ("chain", 8), ("llama-block", 4)):
            eindecomp(Graph(build(model)), ej.local(p))
    finally:
        ilp.solve_detail = real  # type: ignore[assignment]
    return seen


def test_lp_first_reaches_the_mip_optimum_without_branching() -> None:
    """Settings.ilp_lp_first's formulation is exact: the same optimum as the MIP solver's on
    the planner's problems, found by the LP relaxation alone (integral there, so 0 nodes)."""
    probs = _planner_problems()
    assert probs
    for prob in probs:
        mip = solve_detail(prob, time_limit=600.0, node_limit=500, lp_first=False)
        lp = solve_detail(prob, time_limit=600.0, node_limit=500, lp_first=True)
        assert (lp.stop, lp.nodes) == ("optimal", 0)
        assert objective(prob, lp.pick) == pytest.approx(objective(prob, mip.pick), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lp_first_branches_when_the_relaxation_is_fractional(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a frustrated problem the relaxation is fractional: lp_first falls back to the MIP
    solver on its own formulation and still reaches the optimum."""
    prob = _frustrated(n_ops=12, k=3, seed=seed, density=0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IlpTimeLimitWarning)
        plain = solve_detail(prob, time_limit=600.0, node_limit=100_000, lp_first=False)
        seen = _capture_milp(monkeypatch)
        first = solve_detail(prob, time_limit=600.0, node_limit=100_000, lp_first=True)
    assert len(seen) == 1, "the relaxation must be fractional here, so the MIP solver runs"
    assert plain.stop == first.stop == "optimal"
    assert objective(prob, first.pick) == objective(prob, plain.pick)


def test_lp_first_is_a_setting_and_checked() -> None:
    assert SETTINGS.replace(ilp_lp_first=True).ilp_lp_first is True
    with pytest.raises(ej.EinjoinError, match="ilp_lp_first"):
        SETTINGS.replace(ilp_lp_first=1)


@pytest.mark.parametrize("lp_first", [True, False])
def test_an_op_reading_one_input_several_ways_is_feasible(lp_first: bool) -> None:
    # the einsum reads in0 three times: its replica readers repeat strategies, which the tight
    # formulation's one row per op once summed into y >= 2 x (infeasible: a raw HiGHS error)
    x = ej.input("in0", (2,), "float64")
    y = ej.einsum("i,j,k->", x, x, x, join="x0 * x1 * x2")
    settings = SETTINGS.replace(ilp_lp_first=lp_first)
    for planner in (mesh_ilp, eindecomp):
        specs = planner(Graph(y), ej.local(2), settings=settings)
        assert y.node in specs
    prog = ej.compile(y, devices=2, planner="mesh_ilp", quiet=True)
    feed = np.array([0.5, -2.0])
    np.testing.assert_allclose(prog.run(in0=feed), feed.sum() ** 3)
