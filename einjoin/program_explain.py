"""What ``Program.explain()`` prints: the plan's table (:func:`einjoin.plan.explain`), then the
program's own lines -- its state inputs and what their carry-over moves, the objective a plan was
made for (with its simulated time on a cluster that has a time model), the placer and its
simulated makespan next to the ``critical_path`` placer's for the same plan, idle devices and unread
forward arguments.

>>> import einjoin as ej
>>> prog = ej.compile(ej.input("x", (8, 4)) @ ej.input("w", (4, 2)), devices=2, quiet=True)
>>> "einsum" in explain_program(prog)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from einjoin.cluster.calibration import load_cached
from einjoin.compiler import objective_of
from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import itemsize
from einjoin.ir.printing import describe
from einjoin.memplan import parse_caps, plan_memory
from einjoin.memplan.chain import chain_reduces
from einjoin.placement import block_devices, place, tie_homes
from einjoin.plan import build_taskgraph, explain
from einjoin.plan.stats import human_bytes
from einjoin.sparse.pins import pinned_lines

if TYPE_CHECKING:
    from einjoin.program import Program

__all__ = ["explain_program", "COMPARE_TASKS"]

COMPARE_TASKS = 10_000
"""Above this many tasks explain() does not simulate the placers (two simulations and a second
placement and task graph: 0.3 s CPU at 4-5k tasks, so about 0.7 s at the cap); ``prog.simulate()``
gives the figure."""


def explain_program(prog: Program) -> str:
    """``prog``'s explanation as text (see :meth:`einjoin.program.Program.explain`)."""
    text = explain(prog.taskgraph, prog.decomps, list(prog.graph.nodes)) + _state_lines(prog)
    text += pinned_lines(prog.graph)  # ej.compile(blocks=, relational=, engine=): the sparse layouts
    plan = prog.plan
    if objective_of(plan.options, plan.cluster) == "time":
        text += "\nobjective: time (bytes weighed by the links they cross)"
        if plan.cluster.hardware is not None:
            sim = prog.simulate()
            text += f"; modelled time {sim.makespan * 1e3:.3f} ms (simulated, {plan.cluster.hardware.name})"
    text += _placer_lines(prog)
    if plan.devices_note:  # compile(..., leave_idle=True) left devices idle
        text += f"\nnote: {plan.devices_note}"
    unused = [a for a in (plan.arg_names or ()) if a not in prog.graph.input_by_name]
    if unused:  # an imported forward's arguments that the graph never reads
        text += (f"\nnote: forward argument(s) {', '.join(unused)} are not read by the graph; "
                 "run() accepts and ignores them")
    return text


def _placer_lines(prog: Program) -> str:
    """The placer the program was compiled with and, where its devices have a time model (a
    preset, or ``ej.local`` with a cached calibration: explain() never measures one), its
    simulated makespan next to the ``critical_path`` placer's for the same decompositions, each
    simulated as ``prog.simulate()`` simulates (the program's order and seed)."""
    plan = prog.plan
    name = plan.options.placement
    line = f"\nplacer: {name}"
    cluster = plan.cluster
    if cluster.hardware is None and load_cached() is None:
        return line + ("; no simulated makespan: this machine has no cached calibration "
                       "(ej.calibrate() measures one, ~20 s; explain() does not)")
    if len(prog.taskgraph) > COMPARE_TASKS:
        return line + (f"; placers not simulated: {len(prog.taskgraph)} tasks > {COMPARE_TASKS} "
                       "(prog.simulate() gives this placement's makespan)")
    try:
        ms = prog.simulate().makespan * 1e3
        if name == "critical_path":
            return line + f"; simulated makespan {ms:.3f} ms"
        cp = _critical_path_ms(prog)
    except EinjoinError as e:  # what the simulator refuses: explain() still explains the plan
        return line + f"; not simulated: {e}"
    return line + (f"; simulated makespan {ms:.3f} ms, critical_path's placement of the same plan "
                   f"{cp:.3f} ms (both simulated)")


def _critical_path_ms(prog: Program) -> float:
    """The simulated makespan (ms) of ``prog``'s decompositions placed by ``critical_path``."""
    from einjoin.runtime.simulate import simulate  # the simulator is the runtime's (a program's floor)
    from einjoin.runtime.simulate_hardware import hardware_for
    plan = prog.plan
    tied = {s.node: s.new for s in plan.state}
    placed = tie_homes(prog.decomps, place("critical_path", prog.decomps, plan.cluster, plan.options.seed), tied)
    tg = build_taskgraph(prog.graph, prog.decomps, placed, plan.cluster.size)
    caps = parse_caps(plan.options.memory_limit, plan.cluster.size, plan.cluster)
    if any(c is not None for c in caps.values()):  # as ej.compile does under caps (a preset's memory)
        tg = plan_memory(chain_reduces(tg, caps), prog.decomps, caps, plan.options.memory_policy)
    sim = simulate(tg, hardware_for(plan.cluster), prog.order, prog.seed, state=frozenset(s.node for s in plan.state))
    return sim.makespan * 1e3


def _state_lines(prog: Program) -> str:
    """The state inputs: each one's layout and the bytes its carry-over to the next run moves
    (0 when every block ends where the next run loads it, as every planner arranges)."""
    slots = prog.plan.state
    if not slots:
        return ""
    lines = ["", "state (kept on the devices between runs; loaded only when fed or written):"]
    for s in slots:
        part = prog.decomps[s.new].out_partition
        ends = block_devices(s.new, prog.decomps[s.new], prog.placement[s.new])
        homes = prog.placement[s.node].homes
        size = itemsize(s.node.dtype)
        carried = sum(int(np.prod(part.block_shape(k), dtype=np.int64)) * size
                      for k, dev in ends.items() if homes.get(k) != dev)
        lines.append(f"  {s.name!r} <- {describe(s.new)}: {prog.decomps[s.node].spec}, "
                     f"{part.num_blocks} block(s), {human_bytes(carried)} carried")
    return "\n".join(lines)
