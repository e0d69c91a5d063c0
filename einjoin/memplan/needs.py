"""What one task needs resident on its device while it runs: the values it reads, the value it
writes and its scratch (a materialised joined block, a transposed copy). A cap below that for
some task cannot be met by any eviction policy — only a finer decomposition helps.

>>> import einjoin as ej
>>> from einjoin.memplan.needs import parse_caps
>>> parse_caps("1KiB", 2), parse_caps({0: 2048}, 2)
({0: 1024, 1: 1024}, {0: 2048, 1: None})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from einjoin.cluster import Cluster, parse_bytes
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.footprint import kernel_scratch
from einjoin.errors import EinjoinError
from einjoin.exchange import Task, TaskKind
from einjoin.ir.printing import describe
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.plan.stats import human_bytes
from einjoin.plan.taskgraph import TaskGraph
from einjoin.planner.fit import least_need

__all__ = ["parse_caps", "kernel_scratch", "TaskNeed", "task_needs", "MemoryCapError", "cap_error",
           "refuse_unfittable"]


class MemoryCapError(EinjoinError):
    """A task cannot run under its device's memory cap: ``op`` (described), ``device``,
    ``needed`` and ``cap`` in bytes, ``shapes`` of the blocks it holds at once, ``node``."""

    def __init__(self, message: str, op: str = "", device: int = -1, needed: int = 0, cap: int = 0,
                 shapes: tuple[tuple[int, ...], ...] = (), node: Node | None = None):
        super().__init__(message)
        self.op, self.device, self.needed, self.cap, self.shapes = op, device, needed, cap, shapes
        self.node = node  # the op at fault


def parse_caps(memory_limit: Any, n_devices: int, cluster: Cluster | None = None) -> dict[int, int | None]:
    """Per-device caps in bytes (None: uncapped) from ``memory_limit`` — bytes or a size string for
    every device, or a mapping device -> size — else from the cluster's ``Device.memory``."""
    if memory_limit is None:
        if cluster is None:
            return {d: None for d in range(n_devices)}
        return {d.id: d.memory for d in cluster.devices}
    if isinstance(memory_limit, Mapping):
        for d in memory_limit:
            if not isinstance(d, int) or not 0 <= d < n_devices:
                raise EinjoinError(f"memory_limit names device {d!r}; devices are 0..{n_devices - 1}")
        return {d: (parse_bytes(memory_limit[d]) if d in memory_limit else None) for d in range(n_devices)}
    cap = parse_bytes(memory_limit)
    return {d: cap for d in range(n_devices)}


@dataclass(frozen=True)
class TaskNeed:
    task: Task
    device: int
    needed: int
    shapes: tuple[tuple[int, ...], ...]


def _scratch(t: Task, tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> int:
    if t.kind is not TaskKind.KERNEL:
        return 0
    return kernel_scratch(decomps[t.node], t.payload.kernel, [tg.values[v].nbytes for v in t.reads],
                          tg.values[t.writes].nbytes)


def kernel_scratches(tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> dict[int, int]:
    """Each kernel task's scratch bytes by task id (other kinds have none)."""
    return {t.id: _scratch(t, tg, decomps) for t in tg.tasks if t.kind is TaskKind.KERNEL}


def task_needs(tg: TaskGraph, decomps: Mapping[Node, Decomposition],
               scratch: Mapping[int, int] | None = None) -> list[TaskNeed]:
    """Per task, the bytes it holds at once on the device it allocates on (a move: the
    destination; its source value is already there). ``scratch``: :func:`kernel_scratches`
    when the caller has it already."""
    if scratch is None:
        scratch = kernel_scratches(tg, decomps)
    out = []
    for t in tg.tasks:
        if t.writes < 0:
            continue
        # a move's source is on another device; a reload reads the host
        held = [] if t.kind in (TaskKind.MOVE, TaskKind.RELOAD) else list(dict.fromkeys(t.reads))
        if t.kind is TaskKind.TOUCH or t.writes not in held:
            held.append(t.writes)
        shapes = tuple(tg.values[v].shape for v in held)
        need = sum(tg.values[v].nbytes for v in held) + scratch.get(t.id, 0)
        out.append(TaskNeed(t, t.device, need, shapes))
    return out


def describe_need(n: TaskNeed, cap: int) -> str:
    shapes = " + ".join("x".join(map(str, s)) or "scalar" for s in n.shapes)
    return (f"needs {human_bytes(n.needed)} on device {n.device} for one {n.task.kind} "
            f"(blocks {shapes}, plus scratch) but the cap is {human_bytes(cap)}")


def blamed_op(t: Task, tg: TaskGraph) -> Node:
    """The op whose partition sized the biggest block task ``t`` holds: the producer's for a
    select or move (it cuts or ships the producer's block), the consumer's for a touch into a
    buffer at least as big as its source, else (a kernel, a reduce, a load, a fill) its own."""
    consumer: Node | None = t.payload.consumer
    if t.kind is TaskKind.TOUCH and consumer is not None:
        if tg.values[t.writes].nbytes >= tg.values[t.reads[0]].nbytes:
            return consumer
    return t.node


def cap_error(need: TaskNeed, cap: int, why: str = "", node: Node | None = None) -> MemoryCapError:
    node = node or need.task.payload.consumer or need.task.node
    op = describe(node)
    return MemoryCapError(f"memory cap: {op} {describe_need(need, cap)}{why}", op, need.device,
                          need.needed, cap, need.shapes, node)


def refuse_unfittable(graph: Graph, caps: Mapping[int, int | None]) -> None:
    """Raise :class:`MemoryCapError` at once when some op of ``graph`` cannot fit on any device
    however finely it is cut (:func:`einjoin.planner.fit.least_need` above every cap), rather
    than after the planner and the cap fitting have cut it down to single elements (a 64x64 add
    under an 8-byte cap took seconds to be refused). Where some device has no cap nothing is
    refused here (a placement could put every task there).

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 64)) + ej.input("b", (64, 64))
    >>> try:
    ...     refuse_unfittable(ej.Graph(z), {0: 8, 1: 8})
    ... except MemoryCapError as e:
    ...     print(e.op, e.needed, e.cap, str(e).split("; ")[1])
    einsum[ab,ab->ab | x0 + x1] 12 8 no decomposition of it fits, however fine
    """
    if not caps or any(c is None for c in caps.values()):
        return
    device = max(caps, key=lambda d: caps[d] or 0)
    cap = caps[device] or 0
    for node in graph.nodes:
        least = least_need(node)
        if least > cap:
            raise MemoryCapError(f"memory cap: {describe(node)} needs at least {human_bytes(least)} on device "
                                 f"{device} for one task (one element of each block it must hold) but the cap "
                                 f"is {human_bytes(cap)}; no decomposition of it fits, however fine",
                                 describe(node), device, least, cap, ((1,) * node.ndim,), node)
