"""What ``Program.explain()`` prints: the plan's table (:func:`einjoin.plan.explain`), then the
program's own lines -- its state inputs and what their carry-over moves, the objective a plan was
made for (with its simulated time on a cluster that has a time model), idle devices and unread
forward arguments.

>>> import einjoin as ej
>>> prog = ej.compile(ej.input("x", (8, 4)) @ ej.input("w", (4, 2)), devices=2, quiet=True)
>>> "einsum" in explain_program(prog)
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from einjoin.compiler import objective_of
from einjoin.ir.dtypes import itemsize
from einjoin.ir.printing import describe
from einjoin.placement import block_devices
from einjoin.plan import explain
from einjoin.plan.stats import human_bytes

if TYPE_CHECKING:
    from einjoin.program import Program

__all__ = ["explain_program"]


def explain_program(prog: Program) -> str:
    """``prog``'s explanation as text (see :meth:`einjoin.program.Program.explain`)."""
    text = explain(prog.taskgraph, prog.decomps, list(prog.graph.nodes)) + _state_lines(prog)
    plan = prog.plan
    if objective_of(plan.options, plan.cluster) == "time":
        text += "\nobjective: time (bytes weighed by the links they cross)"
        if plan.cluster.hardware is not None:
            sim = prog.simulate()
            text += f"; modelled time {sim.makespan * 1e3:.3f} ms (simulated, {plan.cluster.hardware.name})"
    if plan.devices_note:  # compile(..., leave_idle=True) left devices idle
        text += f"\nnote: {plan.devices_note}"
    unused = [a for a in (plan.arg_names or ()) if a not in prog.graph.input_by_name]
    if unused:  # an imported forward's arguments that the graph never reads
        text += (f"\nnote: forward argument(s) {', '.join(unused)} are not read by the graph; "
                 "run() accepts and ignores them")
    return text


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
