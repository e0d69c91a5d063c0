"""objective="time" (issue 23): the planner weighs each byte by the links it is modelled to cross
(einjoin.planner.cost.TimeWeights), so on a cluster of two nodes it keeps the heavy traffic inside
them; "bytes" stays the default wherever links are uniform."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import einjoin as ej
from einjoin.exchange import TaskKind
from einjoin.compiler import default_objective
from einjoin.planner import PLAN_CACHE_STATS, plan_specs
from einjoin.planner.cost import CostModel, TimeWeights, join_cost_per_input, time_weights
from tests.budget import examples


def _mlp() -> ej.Tensor:
    x = ej.input("x", (2048, 1024), dtype="bfloat16")
    w1 = ej.param("w1", (1024, 4096), dtype="bfloat16")
    w2 = ej.param("w2", (4096, 1024), dtype="bfloat16")
    return (x @ w1).relu() @ w2


def _cross(prog: ej.Program, sim) -> int:  # type: ignore[no-untyped-def]
    groups = prog.cluster.hardware.groups
    return sum(b for (s, d), b in sim.link_bytes.items() if s >= 0 and d >= 0 and groups[s] != groups[d])


def test_time_plan_moves_fewer_bytes_across_the_network_than_the_bytes_plan() -> None:
    # the acceptance: two nodes of 8 GPUs; the time plan crosses the slow link less
    c = ej.Cluster.nodes(2)
    progs = {obj: ej.compile(_mlp(), c, backend="null", quiet=True, objective=obj) for obj in ("bytes", "time")}
    sims = {obj: p.simulate(resident=True) for obj, p in progs.items()}
    cross = {obj: _cross(progs[obj], sims[obj]) for obj in progs}
    assert cross["bytes"] > 0
    assert cross["time"] < cross["bytes"]
    assert sims["time"].makespan <= sims["bytes"].makespan
    # both are plans of the same graph: the time plan may move more bytes in all, inside nodes
    assert progs["time"].plan.specs != progs["bytes"].plan.specs


def test_a_time_plan_never_loses_to_the_bytes_plan_in_simulation() -> None:
    # where the weights guess the placement wrong (this small MLP: the weighted plan's fitted
    # task graph simulates slower), the compiler keeps the bytes plan
    c = ej.Cluster.nodes(2)
    x = ej.input("x", (1024, 512), dtype="bfloat16")
    w1, w2 = ej.param("w1", (512, 2048), dtype="bfloat16"), ej.param("w2", (2048, 512), dtype="bfloat16")
    out = (x @ w1).relu() @ w2
    g = ej.Graph(out)
    caps = {d: dev.memory for d, dev in enumerate(c.devices)}
    assert plan_specs("auto", g, c, memory_limit=caps, objective="time") != \
        plan_specs("auto", g, c, memory_limit=caps, objective="bytes")
    timed = ej.compile(out, c, backend="null", quiet=True, objective="time")
    by_bytes = ej.compile(out, c, backend="null", quiet=True, objective="bytes")
    assert timed.simulate(resident=True).makespan <= by_bytes.simulate(resident=True).makespan
    assert timed.plan.options.objective == "time"


def test_default_objective_follows_the_links() -> None:
    assert default_objective(ej.Cluster.nodes(2)) == "time"
    assert default_objective(ej.Cluster.preset("dgx-a100")) == "bytes"
    assert default_objective(ej.local(4)) == "bytes"
    assert default_objective(ej.Cluster.islands([2, 2], intra=100e9, inter=10e9)) == "bytes"
    # the default is the time plan on nodes, the bytes plan elsewhere (pinned plans stay)
    c = ej.Cluster.nodes(2)
    auto = ej.compile(_mlp(), c, backend="null", quiet=True)
    timed = ej.compile(_mlp(), c, backend="null", quiet=True, objective="time")
    assert auto.plan.specs == timed.plan.specs
    local = ej.compile(_mlp(), 4, backend="null", quiet=True)
    by_bytes = ej.compile(_mlp(), 4, backend="null", quiet=True, objective="bytes")
    assert local.plan.specs == by_bytes.plan.specs


def test_time_on_islands_crosses_less() -> None:
    # a cluster known by its links alone (no time model): 2 islands of 8, the network 12x
    # slower; the crossing bytes counted on the task graph's moves
    c = ej.Cluster.islands([8, 8], intra=300e9, inter=25e9)
    z = _mlp()
    g = ej.Graph(z)
    groups = c.bandwidth.groups

    def crossing(specs) -> int:  # type: ignore[no-untyped-def]
        prog = ej.compile(z, c, backend="null", quiet=True, planner=lambda g, c: specs)
        return sum(t.nbytes for t in prog.plan.taskgraph.tasks
                   if t.kind is TaskKind.MOVE and groups[t.payload.src_device] != groups[t.device])

    by_bytes = plan_specs("auto", g, c, objective="bytes")
    by_time = plan_specs("auto", g, c, objective="time")
    assert crossing(by_time) < crossing(by_bytes)


def test_plan_cache_tells_objectives_apart() -> None:
    c = ej.Cluster.nodes(2)
    g = ej.Graph(_mlp())
    a = plan_specs("auto", g, c, objective="bytes")
    misses = PLAN_CACHE_STATS["misses"]
    b = plan_specs("auto", g, c, objective="time")
    assert PLAN_CACHE_STATS["misses"] == misses + 1
    assert a != b


def test_bad_objective_is_an_einjoin_error() -> None:
    with pytest.raises(ej.EinjoinError, match="objective"):
        ej.compile(_mlp(), 2, backend="null", objective="latency")
    with pytest.raises(ej.EinjoinError, match="objective"):
        plan_specs("auto", ej.Graph(_mlp()), ej.local(2), objective="speed")


def test_time_weights_of_clusters() -> None:
    w = time_weights(ej.Cluster.nodes(2, network_gbps=400))
    assert (w.group, w.ratio) == (8, 300e9 / 50e9)
    assert time_weights(ej.local(4)).ratio == 1.0
    isl = time_weights(ej.Cluster.islands([2, 3], intra=100e9, inter=25e9))
    assert isl.groups == (0, 0, 1, 1, 1) and isl.ratio == 4.0 and isl.group == 2


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.integers(1, 4), min_size=3, max_size=3))
def test_grid_on_one_group_is_the_bytes_model(counts: list[int]) -> None:
    # with every device in one group no copy crosses: the weighted replicas of an einsum's input
    # are exactly the bytes model's join bytes, whatever the ratio
    labels = "mnk"
    ins = ("mk", "kn")
    sizes = {"m": 8, "n": 8, "k": 8}
    a = ej.input("a", (8, 8))
    b = ej.input("b", (8, 8))
    z = ej.einsum("mk,kn->mn", a, b)
    d = ej.decompose(z.node, dict(zip(labels, counts)))
    w = TimeWeights((0,) * 8, 12.0)
    for slot, ls in enumerate(ins):
        kept = tuple(lab in ls for lab in d.spec.labels)
        nbytes = math.prod(sizes[lab] for lab in ls) * 4
        assert w.grid(nbytes, tuple(counts), kept) == join_cost_per_input(d)[slot]


def test_grid_counts_copies_beyond_the_group_holding_most() -> None:
    # 4 kernels on 4 devices, groups (0, 0, 1, 1); a block read by all 4: 1 copy inside, 2 across
    w = TimeWeights((0, 0, 1, 1), 10.0)
    assert w.grid(400, (4,), (False,)) == 400 * (1 + 2 * 10)
    # two blocks, each read by 2 kernels on one group: 1 copy each, inside
    assert w.grid(400, (2, 2), (True, False)) == 2 * 200 * 1
    # two blocks, each read by kernels 0 and 2 (strided): the copy crosses
    assert w.grid(400, (2, 2), (False, True)) == 2 * 200 * 10


def test_cost_model_with_weights_keeps_bytes_on_uniform_links() -> None:
    g = ej.Graph(_mlp())
    plain, weighed = CostModel(g, 4), CostModel(g, 4, time_weights(ej.local(4)))
    for n in g.ops:
        spec = ej.decompose(n, None).spec
        assert plain.info(n, spec).op_bytes == weighed.info(n, spec).op_bytes
    assert np.all(plain.repart_from((0,), 0, "float32") == weighed.repart_from((0,), 0, "float32"))


def test_explain_names_the_time_objective_and_its_simulated_time() -> None:
    c = ej.Cluster.nodes(2)
    prog = ej.compile(_mlp(), c, backend="null", quiet=True)
    text = prog.explain(file=None)
    ms = prog.simulate().makespan * 1e3
    assert "objective: time" in text and f"modelled time {ms:.3f} ms (simulated, 2xdgx-a100)" in text
    assert "objective" not in ej.compile(_mlp(), 2, backend="null", quiet=True).explain(file=None)
