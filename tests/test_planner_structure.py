"""The planner package's shape (issue 17): one cost model, the ILP never importing the search, no
import cycle inside einjoin/planner, per-kind rule tables covering every node kind instead of
isinstance tests, and the Planner protocol receiving the memory limit explicitly."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest

import einjoin as ej
import einjoin.planner as planner_pkg
from einjoin.ir.node import KINDS

PKG = pathlib.Path(planner_pkg.__file__).parent
NODE_KINDS = {k.__name__ for k in KINDS}


def _module_name(path: pathlib.Path) -> str:
    return "einjoin.planner" if path.name == "__init__.py" else f"einjoin.planner.{path.stem}"


def _imports(path: pathlib.Path) -> set[str]:
    """The einjoin.planner modules ``path`` imports, anywhere in it (lazy imports count: a cycle
    through a function-level import is still a cycle). ``from einjoin.planner import x`` imports
    the package itself, or the submodule x."""
    names = {_module_name(p) for p in PKG.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in names else node.module)
    return {m for m in found if m in names}


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) - {_module_name(p)} for p in PKG.glob("*.py")}


def test_the_ilp_builds_on_the_cost_model_not_the_search() -> None:
    deps = _graph()
    assert "einjoin.planner.search" not in deps["einjoin.planner.ilp"]
    assert "einjoin.planner.cost" in deps["einjoin.planner.ilp"]


def test_no_import_cycle_inside_the_planner() -> None:
    deps = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, f"import cycle: {' -> '.join(path + [m])}"
        state[m] = 1
        for d in sorted(deps.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(deps):
        visit(m, [])
    # submodules never import the package's __init__ (it imports them to register the planners)
    assert not [m for m, ds in deps.items() if "einjoin.planner" in ds]


def test_one_cost_model() -> None:
    """The memoised model, total_cost and model_cost are the cost module's; the search only uses
    them (no second class of its own)."""
    from einjoin.planner import cost, search
    tree = ast.parse((PKG / "search.py").read_text())
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"total_cost", "model_cost", "candidate_specs", "fitting_specs", "finer_spec"}
    assert search.total_cost is cost.total_cost


def _kind_dispatch(path: pathlib.Path) -> list[str]:
    """isinstance / type(...) is tests naming a node kind."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & NODE_KINDS:
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot, ast.Eq)) for o in node.ops):
            names = {n.id for c in node.comparators for n in ast.walk(c) if isinstance(n, ast.Name)}
            if names & NODE_KINDS and isinstance(node.left, ast.Call):
                found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind" \
                and any(isinstance(c, ast.Constant) and isinstance(c.value, str) for c in node.comparators):
            found.append(f"{path.name}:{node.lineno}")  # node.kind == "fill"
    return found


def test_no_isinstance_on_node_kinds_in_the_planner() -> None:
    assert not [hit for p in PKG.glob("*.py") for hit in _kind_dispatch(p)]


def test_one_finer_cut_search() -> None:
    """The memory planner's finer cuts are the planner's (einjoin.planner.fit): no second copy."""
    import importlib.util
    assert importlib.util.find_spec("einjoin.memplan.fit") is None


def _rule_tables() -> dict[str, dict[type, Any]]:
    from einjoin.planner import baselines, bounds, cost, fit
    tables = {}
    for mod in (baselines, bounds, cost, fit):
        for name, value in vars(mod).items():
            if name.endswith("_RULES") and isinstance(value, dict):
                tables[f"{mod.__name__}.{name}"] = value
    return tables


def test_every_rule_table_covers_every_node_kind() -> None:
    tables = _rule_tables()
    assert len(tables) >= 5
    for name, table in tables.items():
        assert set(table) == set(KINDS), f"{name} misses {set(KINDS) - set(table)}"


def test_a_kind_without_a_rule_is_a_clear_error() -> None:
    from einjoin.planner.cost import INFO_RULES
    from einjoin.ir.node import Cast, rule_for
    with pytest.raises(ej.EinjoinError, match="cost model rules has no rule for node kind 'Cast'"):
        rule_for({k: v for k, v in INFO_RULES.items() if k is not Cast}, Cast(), "cost model rules")


# -- the Planner protocol: the memory limit is an argument, not a property of the cluster ---------

def _mm() -> tuple[ej.Tensor, ej.Graph]:
    z = ej.input("a", (256, 256)) @ ej.input("b", (256, 256))
    return z, ej.Graph(z)


def test_registered_planners_take_the_memory_limit() -> None:
    from einjoin.planner import PLANNERS, takes_memory_limit
    assert all(takes_memory_limit(fn) for fn in PLANNERS.values())


def test_the_memory_limit_reaches_the_planner_explicitly() -> None:
    from einjoin.planner import plan_specs
    z, g = _mm()
    seen: list[Any] = []

    def mine(graph: ej.Graph, cluster: ej.Cluster, *, memory_limit: Any) -> dict:
        seen.append((dict(memory_limit), [d.memory for d in cluster.devices]))
        return {}

    plan_specs(mine, g, ej.local(2), memory_limit={0: 300_000, 1: None})
    plan_specs(mine, g, ej.local(2, memory="1MiB"))
    assert seen == [({0: 300_000, 1: None}, [None, None]), ({0: 2**20, 1: 2**20}, [2**20, 2**20])]
    with pytest.raises(ej.EinjoinError, match="device 5"):
        plan_specs(mine, g, ej.local(2), memory_limit={5: 1000})


def test_a_plain_planner_still_sees_the_limit_as_device_memory() -> None:
    from einjoin.planner import plan_specs
    z, g = _mm()
    seen: list[Any] = []

    def plain(graph: ej.Graph, cluster: ej.Cluster) -> dict:
        seen.append([d.memory for d in cluster.devices])
        return {z: {"m": 2}}

    specs = plan_specs(plain, g, ej.local(2), memory_limit={0: 300_000})
    assert seen == [[300_000, None]] and specs[z.node].counts() == {"m": 2, "n": 1, "k": 1}


def test_eindecomp_plans_for_the_limit_it_is_given() -> None:
    """The limit given as an argument is the limit planned for: the same plan as a cluster whose
    devices declare it, and finer than the plan without one."""
    from einjoin.planner import plan_specs
    z, g = _mm()
    free = plan_specs("auto", g, ej.local(2))[z.node]
    capped = plan_specs("auto", g, ej.local(2), memory_limit={0: 300_000, 1: 300_000})[z.node]
    declared = plan_specs("auto", g, ej.local(2, memory=300_000))[z.node]
    assert capped == declared
    assert capped.num_kernels > free.num_kernels


def test_time_weights_grid_memo_is_per_weights() -> None:
    # the grid memo is process-wide: two clusters' weights asking the same grid must each get
    # their own answer (it was keyed on the grid alone, so the second cluster got the first's)
    from einjoin.planner.cost import TimeWeights
    groups = (0,) * 8 + (1,) * 8
    fast, slow = TimeWeights(groups, 2.0), TimeWeights(groups, 12.0)
    assert fast.grid(100, (16,), (False,)) == 7 * 100 + 8 * 100 * 2  # 8 partials cross at ratio 2
    assert slow.grid(100, (16,), (False,)) == 7 * 100 + 8 * 100 * 12
    assert TimeWeights((0,) * 4 + (1,) * 12, 12.0).grid(100, (16,), (False,)) == 11 * 100 + 4 * 100 * 12
