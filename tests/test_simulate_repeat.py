"""Identical layers simulated through a few of them (einjoin.runtime.simulate_repeat): the
makespan of 5 decoder blocks extrapolated from the simulations of 3 and 4 blocks equals the full
simulation of n blocks, and the planner cuts the middle blocks alike (the layer reuse the
extrapolation rests on). A small grouped-query LLaMA block in bfloat16 on two A100s."""

from __future__ import annotations

from typing import Any

import pytest

import einjoin as ej
from einjoin.errors import EinjoinError
from einjoin.runtime.simulate import Simulation
from einjoin.ir.graph import Graph
from einjoin.runtime.simulate_repeat import block_ends, compiled_ends, layer_of_tasks, repeat_layers

CLUSTER = ej.Cluster.preset("dgx-a100", devices=2)


def _block(x: ej.Tensor, prefix: str, heads: int = 4, kv: int = 2) -> ej.Tensor:
    b, s, d = x.shape
    hd = d // heads

    def p(name: str, shape: tuple[int, ...]) -> ej.Tensor:
        return ej.param(prefix + name, shape, "bfloat16")

    def split(t: ej.Tensor, n: int) -> ej.Tensor:
        return t.reshape(b, s, n, hd).transpose(-3, -2)

    h = ej.rms_norm(x, p("an", (d,)))
    q = split(ej.linear(h, p("wq", (d, d))), heads)
    k = split(ej.linear(h, p("wk", (kv * hd, d))), kv)
    v = split(ej.linear(h, p("wv", (kv * hd, d))), kv)
    a = ej.attention(ej.rope(q), ej.rope(k), v, causal=True)
    x = x + ej.linear(a.transpose(-3, -2).reshape(b, s, d), p("wo", (d, d)))
    h = ej.rms_norm(x, p("mn", (d,)))
    up = ej.silu(ej.linear(h, p("w1", (2 * d, d)))) * ej.linear(h, p("w3", (2 * d, d)))
    return x + ej.linear(up, p("w2", (d, 2 * d)))


def _program(n: int) -> tuple[Any, list[ej.Tensor]]:
    x = ej.input("x", (1, 64, 32), "bfloat16")
    ends = []
    for i in range(n):
        x = _block(x, f"l{i}.")
        ends.append(x)
    return ej.compile(x, CLUSTER, backend="null", quiet=True, objective="bytes"), ends


@pytest.fixture(scope="module")
def programs() -> dict[int, tuple[Any, list[ej.Tensor]]]:
    return {n: _program(n) for n in (3, 4, 5)}


def test_extrapolated_makespan_is_the_full_simulation(programs: dict[int, Any]) -> None:
    sims = {n: prog.simulate(resident=True) for n, (prog, _) in programs.items()}
    prog4, ends4 = programs[4]
    rep = repeat_layers(3, sims[3], sims[4], 5, layer_of_tasks(prog4.taskgraph, ends4))
    assert rep.makespan == pytest.approx(sims[5].makespan, rel=1e-4)
    assert rep.step == pytest.approx(sims[5].makespan - sims[4].makespan, rel=1e-3) and rep.step > 0
    # the middle blocks' spans in the 5-block simulation are the 4-block one's
    prog5, ends5 = programs[5]
    ends = block_ends(sims[5], layer_of_tasks(prog5.taskgraph, ends5))
    assert len(ends) == 5 and list(ends) == sorted(ends)
    spans = [b - a for a, b in zip(ends[:-2], ends[1:-1])]
    assert rep.periods and all(s == pytest.approx(rep.periods[0], rel=1e-6) for s in spans)


def test_middle_blocks_are_cut_alike(programs: dict[int, Any]) -> None:
    prog, ends = programs[5]
    per_block: list[list[str]] = [[] for _ in ends]
    layer: dict[Any, int] = {}
    # a node's block: the first whose output depends on it, in the compiled (fused) graph
    for i, e in enumerate(compiled_ends(prog.taskgraph, ends)):
        for node in Graph(e).nodes:
            layer.setdefault(node, i)
    for node, spec in prog.plan.specs.items():
        if not node.facts.fed and node in layer:
            per_block[layer[node]].append(f"{node.op.__class__.__name__}{node.shape}{spec}")
    assert all(per_block) and all(sorted(b) == sorted(per_block[1]) for b in per_block[1:-1])


def test_block_ends_are_found_after_fusion(programs: dict[int, Any]) -> None:
    """Fusion rebuilds the blocks' output nodes: each end is still found in the task graph, as
    the compiled node reading the same weights (was none at all: no periods to check)."""
    prog, ends = programs[4]
    found = compiled_ends(prog.taskgraph, ends)
    assert len(set(found)) == 4 and all(n in {t.node for t in prog.taskgraph.tasks} for n in found)
    assert all(f.shape == e.shape for f, e in zip(found, ends))
    assert sorted(set(layer_of_tasks(prog.taskgraph, ends)) - {-1}) == [0, 1, 2, 3]


def test_too_few_blocks_refused(programs: dict[int, Any]) -> None:
    sim = programs[3][0].simulate(resident=True)
    with pytest.raises(EinjoinError, match="at least 3"):
        repeat_layers(2, sim, sim, 80)
    with pytest.raises(EinjoinError, match="fewer than"):
        repeat_layers(3, sim, sim, 2)


def _sim(makespan: float, ends: list[float]) -> Simulation:
    """A simulation whose task i (block i's output) ends at ``ends[i]``."""
    iv = [(0.0, e, i) for i, e in enumerate(ends)]
    return Simulation(makespan, {0: makespan}, {}, {}, {0: 0}, {0: iv}, "toy", tasks=(None,) * len(ends))  # type: ignore[arg-type]


def test_no_step_or_no_period_refused(programs: dict[int, Any]) -> None:
    sims = {n: programs[n][0].simulate(resident=True) for n in (3, 4)}
    with pytest.raises(EinjoinError, match="tasks"):  # the two programs swapped: one block fewer
        repeat_layers(3, sims[4], sims[3], 80)
    with pytest.raises(EinjoinError, match="adds"):  # one more block adds no time
        repeat_layers(3, _sim(5.0, [1.0, 2.0, 3.0]), _sim(5.0, [1.0, 2.0, 3.0, 4.0]), 80)
    # middle blocks of spans 1 and 2: not periodic, refused; spans 1 and 1: the step holds
    with pytest.raises(EinjoinError, match="not periodic"):
        repeat_layers(3, _sim(4.0, [1.0, 2.0, 4.0]), _sim(6.0, [1.0, 2.0, 4.0, 6.0]), 80, [0, 1, 2, 3])
    rep = repeat_layers(3, _sim(4.0, [1.0, 2.0, 3.0]), _sim(5.0, [1.0, 2.0, 3.0, 5.0]), 80, [0, 1, 2, 3])
    assert rep.periods == (1.0, 1.0) and rep.makespan == 4.0 + 77 * 1.0
    with pytest.raises(EinjoinError, match="tolerance"):
        repeat_layers(3, _sim(4.0, [1.0]), _sim(5.0, [1.0, 2.0]), 80, tolerance=-0.1)


def test_a_kept_simulation_is_a_copy(programs: dict[int, Any]) -> None:
    prog = programs[3][0]
    a = prog.simulate(resident=True)
    a.intervals.clear()
    a.link_bytes[(0, 1)] = -1
    a.peak_memory.clear()
    b = prog.simulate(resident=True)  # the kept replay: unchanged by what the first caller did
    assert b is not a and b.intervals and (0, 1, -1) not in {(*k, v) for k, v in b.link_bytes.items()}
    assert sum(len(iv) for iv in b.intervals.values()) == len(prog.taskgraph) and b.peak_memory


def _blocks(n: int, d: int = 32) -> tuple[ej.Tensor, list[ej.Tensor]]:
    x = ej.input("x", (1, 64, d), "bfloat16")
    ends = []
    for i in range(n):
        x = _block(x, f"l{i}.")
        ends.append(x)
    return x, ends


def _layer_of(name: str) -> int | None:
    return int(name[1:name.index(".")]) if name.startswith("l") and "." in name else None


@pytest.fixture(scope="module")
def window() -> Any:
    """The 4-block program planned as a window (no ILP step); the window planners registered for
    it are unregistered after the module (tests that list every planner see the usual ones)."""
    from einjoin.planner import PLANNERS
    from einjoin.runtime.simulate_repeat import REUSE_PLANNER, WINDOW_PLANNER, window_planner
    yield ej.compile(_blocks(4)[0], CLUSTER, backend="null", quiet=True, objective="bytes", planner=window_planner())
    for name in (WINDOW_PLANNER, REUSE_PLANNER):
        PLANNERS.pop(name, None)


def test_a_window_reusing_the_longer_windows_plan_extrapolates_to_the_full_simulation(window: Any) -> None:
    """The 3-block program planned by reuse of the 4-block plan (window_planner: no ILP step, as
    a long model) gives the step that the 5-block program planned whole confirms; the reused
    plan's last block is the 4-block plan's last, its middle block the 4-block plan's."""
    from einjoin.runtime.simulate_repeat import block_keys, reuse_planner, window_planner
    long_ = window
    whole = ej.compile(_blocks(5)[0], CLUSTER, backend="null", quiet=True, objective="bytes", planner=window_planner())
    reuse = reuse_planner(long_.plan.specs, long_.plan.graph, 4, _layer_of)
    short = ej.compile(_blocks(3)[0], CLUSTER, backend="null", quiet=True, objective="bytes", planner=reuse)
    interned: dict[Any, int] = {}
    keys4 = block_keys(long_.plan.graph, _layer_of, 4, interned)
    keys3 = block_keys(short.plan.graph, _layer_of, 3, interned)
    by_key = {keys4[n]: s for n, s in long_.plan.specs.items()}
    assert short.plan.specs and all(by_key[keys3[n]] == s for n, s in short.plan.specs.items())
    roles = {interned_key[4] for interned_key in interned}
    assert {"first", "middle", "last"} <= roles
    sims = {n: simulate_resident(p) for n, p in ((3, short), (4, long_), (5, whole))}
    rep = repeat_layers(3, sims[3], sims[4], 5)
    assert rep.makespan == pytest.approx(sims[5].makespan, rel=1e-4)


def simulate_resident(prog: Any) -> Simulation:
    from einjoin.runtime.simulate import simulate
    return simulate(prog.taskgraph, prog.cluster.hardware, resident=True, replicated=True)


def test_reuse_refuses_a_program_whose_blocks_it_has_not_planned(window: Any) -> None:
    from einjoin.runtime.simulate_repeat import reuse_planner
    reuse = reuse_planner(window.plan.specs, window.plan.graph, 4, _layer_of)
    with pytest.raises(EinjoinError, match="plays the part"):  # blocks of another width
        ej.compile(_blocks(3, d=64)[0], CLUSTER, backend="null", quiet=True, objective="bytes", planner=reuse)
