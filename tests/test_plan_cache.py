"""The process's plan cache (einjoin.planner.plan_specs): the same graph planned again for the
same cluster, caps and state returns the same specs without searching; anything that could
change the plan misses."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin import planner as planner_mod
from einjoin.planner import PLAN_CACHE_STATS, PLANNERS, plan_specs


def _mlp(n: int = 64) -> ej.Tensor:
    x = ej.input("x", (n, 32))
    w1, w2 = ej.input("w1", (32, 48)), ej.input("w2", (48, 16))
    return ((x @ w1).relu() @ w2).sum(dim=1)


def _counts() -> tuple[int, int]:
    return PLAN_CACHE_STATS["hits"], PLAN_CACHE_STATS["misses"]


def test_the_same_graph_built_again_is_planned_once_and_runs_the_same() -> None:
    h0, m0 = _counts()
    first = ej.compile(_mlp(), devices=4, quiet=True)
    graph_id = id(first.graph.outputs[0])
    del first  # the cache holds the graph's nodes: a graph built again is the same nodes
    second = ej.compile(_mlp(), devices=4, quiet=True)
    assert _counts() == (h0 + 1, m0 + 1)
    assert id(second.graph.outputs[0]) == graph_id
    third = ej.compile(_mlp(), devices=4, quiet=True, planner="eindecomp")  # another name, same function
    assert _counts() == (h0 + 2, m0 + 1)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32)
             for k, s in (("x", (64, 32)), ("w1", (32, 48)), ("w2", (48, 16)))}
    np.testing.assert_allclose(second.run(**feeds), third.run(**feeds), rtol=0, atol=0)
    np.testing.assert_allclose(second.run(**feeds), ej.reference(_mlp(), **feeds), rtol=1e-5, atol=1e-5)
    assert second.explain() == third.explain()


@pytest.mark.parametrize("change", ["devices", "shape", "memory", "planner", "state"])
def test_what_could_change_the_plan_misses(change: str) -> None:
    base: dict[str, Any] = {"devices": 4, "quiet": True}
    ej.compile(_mlp(), **base)
    h0, m0 = _counts()
    if change == "devices":
        ej.compile(_mlp(), **{**base, "devices": 2})
    elif change == "shape":
        ej.compile(_mlp(128), **base)
    elif change == "memory":
        ej.compile(_mlp(), **base, memory_limit="64KiB")
    elif change == "planner":
        ej.compile(_mlp(), **base, planner="data_parallel")
    else:
        w = ej.input("w1", (32, 48))
        ej.compile(_mlp(), **base, state={w * 0.5: w})
    h1, m1 = _counts()
    assert (h1, m1) == (h0, m1) and m1 > m0


def test_a_name_registered_again_and_a_callable_planner_plan_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = ej.Graph(_mlp())
    calls: list[int] = []

    def mine(g: ej.Graph, cluster: Any, *, memory_limit: Any = None) -> dict[Any, Any]:
        calls.append(1)
        return PLANNERS["split_largest"](g, cluster, memory_limit=memory_limit)

    for _ in range(2):  # a callable's result may depend on anything: never cached
        plan_specs(mine, graph, ej.local(2))
    assert len(calls) == 2
    monkeypatch.setitem(PLANNERS, "mine", mine)
    a = plan_specs("mine", graph, ej.local(2))
    b = plan_specs("mine", graph, ej.local(2))
    assert len(calls) == 3 and a == b
    monkeypatch.setitem(PLANNERS, "mine", PLANNERS["single"])  # the same name, another function
    c = plan_specs("mine", graph, ej.local(2))
    assert len(calls) == 3 and c != a


def test_a_hit_is_a_copy_and_the_cache_is_bounded() -> None:
    graph = ej.Graph(_mlp())
    specs = plan_specs("auto", graph, ej.local(4))
    specs.clear()  # the caller's dict: the cache keeps its own
    assert plan_specs("auto", graph, ej.local(4)) == plan_specs("auto", graph, ej.local(4)) != {}
    for n in range(planner_mod.PLAN_CACHE_SIZE + 3):
        plan_specs("split_largest", graph, ej.Cluster.uniform(n + 1))
    assert len(planner_mod._PLANNED) == planner_mod.PLAN_CACHE_SIZE


def test_a_link_matrix_cluster_is_keyed_without_reading_its_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    # a LinkMatrix hashes as the dense matrix it equals, cell by cell in Python (O(n^2)): the
    # cache keyed on it made a 512-device compile 7x slower
    from einjoin.cluster import LinkMatrix

    def refuse(self: LinkMatrix) -> Any:
        raise AssertionError("the plan cache read a link matrix cell by cell")

    graph = ej.Graph(_mlp())
    cluster = ej.local(512)
    assert isinstance(cluster.bandwidth, LinkMatrix)
    monkeypatch.setattr(LinkMatrix, "__iter__", refuse)
    monkeypatch.setattr(LinkMatrix, "__hash__", refuse)
    h0, m0 = _counts()
    key = planner_mod._cache_key("split_largest", graph, cluster, {}, None)
    assert key is not None and key == planner_mod._cache_key("split_largest", graph, ej.local(512), {}, None)
    assert key != planner_mod._cache_key("split_largest", graph, ej.local(256), {}, None)
    assert _counts() == (h0, m0)
