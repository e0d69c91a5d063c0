"""Weights resident on every reader (issue 23's 70B line): with ``resident=True,
replicated=True`` the simulator takes a parameter's block as resident on each device that reads
it, so the task graph's moves of it (one loaded copy, then a move per further reader: the plan's
accounting) cost nothing and count as host loads; activations, runs without resident weights and a program's state
move as before, and the task graph a real run executes is unchanged."""

from __future__ import annotations

import numpy as np

import einjoin as ej
from einjoin.exchange import TaskKind
from einjoin.runtime.simulate import simulate


def _program(weight: ej.Tensor, backend: str = "null", state: dict | None = None) -> ej.Program:
    """x @ w on two A100s, rows of x cut in two: w is read whole on both devices."""
    x = ej.input("x", (512, 256))
    z = x @ weight
    outs = [z] if state is None else [z, *state]
    cl = ej.Cluster.preset("dgx-a100", devices=2)
    return ej.compile(outs if state is not None else z, devices=cl, backend=backend, planner="split_largest",
                      specs={z: {"m": 2, "n": 1, "k": 1}}, quiet=True, fuse=False,
                      **({"state": state} if state else {}))


def _weight_moves(prog: ej.Program) -> list:
    return [t for t in prog.taskgraph.tasks if t.kind is TaskKind.MOVE and getattr(t.node.op, "param", False)]


def test_a_resident_weights_replica_costs_nothing_and_counts_as_a_host_load() -> None:
    prog = _program(ej.param("w", (256, 256)))
    moves = _weight_moves(prog)
    assert moves, "the plan moves w to its second reader"
    nbytes = sum(t.nbytes for t in moves)
    hw = prog.cluster.hardware
    resident = simulate(prog.taskgraph, hw, resident=True, replicated=True)
    assert simulate(prog.taskgraph, hw, resident=True).makespan > resident.makespan  # off by default
    plain = simulate(prog.taskgraph, hw)
    between = {k: b for k, b in resident.link_bytes.items() if k[0] >= 0 and k[1] >= 0}
    assert between == {}, "no weight byte crosses NVLink when weights are resident"
    loaded = sum(b for (s, d), b in plain.link_bytes.items() if s == -1)  # one copy of x and w
    assert sum(b for (s, d), b in resident.link_bytes.items() if s == -1) == loaded + nbytes
    # without resident weights the runtime moves it, and so does the simulation
    assert sum(b for (s, d), b in plain.link_bytes.items() if s >= 0 and d >= 0) == nbytes
    assert resident.makespan < plain.makespan


def test_an_activation_or_a_state_parameter_still_moves_when_resident() -> None:
    act = _program(ej.input("w", (256, 256)))  # the same bytes, not a parameter
    sim = simulate(act.taskgraph, act.cluster.hardware, resident=True, replicated=True)
    assert sum(b for (s, d), b in sim.link_bytes.items() if s >= 0 and d >= 0) > 0
    w = ej.param("w", (256, 256))
    trained = _program(w, state={w * 0.5: w})  # the program writes w: its replicas move each run
    assert _weight_moves(trained)
    from einjoin.runtime.simulate import simulate_program
    sim = simulate_program(trained, resident=True, replicated=True)
    moved = sum(b for (s, d), b in sim.link_bytes.items() if s >= 0 and d >= 0)
    assert moved >= sum(t.nbytes for t in _weight_moves(trained))


def test_real_runs_keep_the_one_load_plan_and_its_values() -> None:
    w = ej.param("w", (256, 256))
    prog = _program(w, backend="threads")
    rng = np.random.default_rng(0)
    xv, wv = rng.standard_normal((512, 256), np.float32), rng.standard_normal((256, 256), np.float32)
    np.testing.assert_allclose(prog.run(x=xv, w=wv), xv @ wv, rtol=1e-5, atol=1e-4)
    loads = [t for t in prog.taskgraph.tasks if t.kind is TaskKind.LOAD and t.node is w.node]
    assert sum(t.nbytes for t in loads) == 256 * 256 * 4  # one copy loaded, the replica moved
    assert prog.run_stats.bytes_moved >= sum(t.nbytes for t in _weight_moves(prog)) > 0
