"""The vocabulary of task graphs: task kinds, tasks, the values they write, and a builder.

Every task runs on one device, reads values that live on that device (a ``move`` reads on its
source device and writes on its destination), and writes one value. A buffer assembled from
several ``touch`` tasks is one value with several producers. Everything is plain, picklable
data (the Ray backend ships it), built from shapes alone, and every task carries its byte count.

A :class:`Task` holds what every task has (id, kind, device, reads, writes, deps, bytes, flops,
node, scratch, dtype) and a small per-kind ``payload`` (:data:`PAYLOADS`):

============= ===================== ==========================================================
kind          payload               what it does
============= ===================== ==========================================================
``load``      :class:`Block`        a block (``box``, global coordinates) of a graph input
``fill``      :class:`Block`        a block of a fill computed in place
``kernel``    :class:`Kernel`       kernel ``kernel`` of the node's decomposition
``reduce``    :class:`Reduce`       combine same-shaped partials with ``agg``, in order; a
                                    half-precision sum's partials are float32 and the block's
                                    last reduce casts (the task's ``dtype``)
``select``    :class:`Select`       cut the sub-box ``box`` (relative to the source value)
``move``      :class:`Move`         copy a value from ``src_device`` to the task's device
``touch``     :class:`Touch`        write the source's sub-box ``box`` into region ``dst_box``
                                    of a buffer
``free``      :class:`Release`      drop value ``frees`` after its last reader
``evict``     :class:`Release`      drop ``frees``, first copying it to the host store under
                                    ``host_key`` when ``nbytes`` > 0 (a clean value — an input
                                    block, a fill, a reloaded copy — is only dropped)
``reload``    :class:`Reload`       copy the host store's ``host_key`` (or, with ``box``, the
                                    graph input's block) back to the device as a fresh value
``writeback`` :class:`Release`      copy an output block to the host store and drop it
============= ===================== ==========================================================

The last three cross the host link of memory-capped graphs (:mod:`einjoin.memplan`). The groups
the other floors ask about are properties of :class:`TaskKind` (``releases``, ``crosses_host``,
``fresh``, ``clean``, ``to_host``) — defined here once.

>>> TaskKind.EVICT.releases, TaskKind.LOAD.crosses_host, TaskKind.TOUCH.fresh, TaskKind("move")
(True, True, False, <TaskKind.MOVE: 'move'>)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from einjoin.decomp.partition import Box
from einjoin.ir.agg import Agg
from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Node

__all__ = ["Task", "TaskKind", "Value", "TaskGraphBuilder", "TASK_KINDS", "PAYLOADS", "Payload", "Block",
           "Kernel", "Reduce", "Select", "Move", "Touch", "Release", "Reload"]


class TaskKind(str, Enum):
    """What a task does (a ``str`` Enum: ``TaskKind.MOVE == "move"``, prints as ``move``). The
    groups the floors above ask about are properties, so a new kind is added here only."""

    LOAD = "load"
    FILL = "fill"
    KERNEL = "kernel"
    REDUCE = "reduce"
    SELECT = "select"
    MOVE = "move"
    TOUCH = "touch"
    FREE = "free"
    EVICT = "evict"
    RELOAD = "reload"
    WRITEBACK = "writeback"

    def __str__(self) -> str:  # "move", not "TaskKind.MOVE", in messages and traces
        return self.value

    @property
    def releases(self) -> bool:
        """Drops its payload's ``frees`` value from the device (free, evict, writeback)."""
        return self in _RELEASES

    @property
    def to_host(self) -> bool:
        """Copies the value it drops to the host store first (evict, writeback)."""
        return self in _TO_HOST

    @property
    def crosses_host(self) -> bool:
        """Uses the host<->device link (load, evict, reload, writeback): emulated ``host_link``
        time and a lane of its own on the parallel backends."""
        return self in _CROSSES_HOST

    @property
    def fresh(self) -> bool:
        """Writes a whole new value in one go (every kind that writes but touch, which fills a
        buffer in parts, and reload, which restores a value the memory planner tracks)."""
        return self in _FRESH

    @property
    def clean(self) -> bool:
        """Writes a value that can be had again without a copy to the host (load: from the feeds,
        fill: recomputed), so evicting it writes nothing."""
        return self in _CLEAN


_RELEASES = frozenset({TaskKind.FREE, TaskKind.EVICT, TaskKind.WRITEBACK})
_TO_HOST = frozenset({TaskKind.EVICT, TaskKind.WRITEBACK})
_CROSSES_HOST = frozenset({TaskKind.LOAD, TaskKind.EVICT, TaskKind.RELOAD, TaskKind.WRITEBACK})
_FRESH = frozenset({TaskKind.LOAD, TaskKind.FILL, TaskKind.KERNEL, TaskKind.REDUCE, TaskKind.SELECT,
                    TaskKind.MOVE})
_CLEAN = frozenset({TaskKind.LOAD, TaskKind.FILL})

TASK_KINDS = tuple(TaskKind)


# ---- per-kind payloads: small frozen dataclasses (``consumer``: the op whose request caused an
# exchange task, for explain and the memory planner's blame; None on the other kinds)

class Payload:
    """Base of the per-kind payloads."""

    __slots__ = ()
    consumer: Node | None = None


@dataclass(frozen=True, slots=True)
class Block(Payload):
    """load / fill: the block's box in the tensor's global coordinates."""

    box: Box


@dataclass(frozen=True, slots=True)
class Kernel(Payload):
    """kernel: its index in the node's decomposition."""

    kernel: int


@dataclass(frozen=True, slots=True)
class Reduce(Payload):
    """reduce: the aggregation combining the partials."""

    agg: Agg


@dataclass(frozen=True, slots=True)
class Select(Payload):
    """select: the sub-box cut, relative to the source value."""

    box: Box
    consumer: Node | None = None


@dataclass(frozen=True, slots=True)
class Move(Payload):
    """move: the device the value comes from."""

    src_device: int
    consumer: Node | None = None


@dataclass(frozen=True, slots=True)
class Touch(Payload):
    """touch: ``box`` of the source written into ``dst_box`` of the buffer."""

    box: Box
    dst_box: Box
    consumer: Node | None = None


@dataclass(frozen=True, slots=True)
class Release(Payload):
    """free / evict / writeback: the value dropped and (evict, writeback) its host store key
    (the value's first id)."""

    frees: int
    host_key: int = -1


@dataclass(frozen=True, slots=True)
class Reload(Payload):
    """reload: the host store key, or ``box``: the graph input's block read from the feeds."""

    host_key: int
    box: Box | None = None


PAYLOADS: dict[TaskKind, type[Payload]] = {
    TaskKind.LOAD: Block,
    TaskKind.FILL: Block,
    TaskKind.KERNEL: Kernel,
    TaskKind.REDUCE: Reduce,
    TaskKind.SELECT: Select,
    TaskKind.MOVE: Move,
    TaskKind.TOUCH: Touch,
    TaskKind.FREE: Release,
    TaskKind.EVICT: Release,
    TaskKind.RELOAD: Reload,
    TaskKind.WRITEBACK: Release,
}


@dataclass(frozen=True)
class Value:
    """A value: where it lives, its shape and dtype, and the tasks that write it."""

    id: int
    device: int
    shape: tuple[int, ...]
    dtype: str
    node: Node
    producers: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        n = itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Task:
    """One task: what every kind has, and its kind's ``payload`` (:data:`PAYLOADS`).

    ``writes`` is a value id (-1 for a release); ``deps`` the tasks it waits for; ``scratch`` the
    bytes it needs besides its output while it runs (a joined block); ``dtype`` the written
    value's (a half-precision op's partial sums are float32 until the reduce that casts them:
    :func:`einjoin.ir.kernels.partial_dtype`; "" for a release)."""

    id: int
    kind: TaskKind
    device: int
    reads: tuple[int, ...]
    writes: int
    deps: tuple[int, ...]
    nbytes: int
    flops: int
    node: Node
    payload: Any  # the kind's payload class (PAYLOADS[kind]), checked by the builder
    scratch: int = 0
    dtype: str = ""

    @property
    def consumer(self) -> Node | None:
        """The op whose request caused an exchange task (select, move, touch; a partial's move
        names its own op), else None: what ``explain`` and the memory planner's blame read."""
        consumer: Node | None = self.payload.consumer
        return consumer

    def trace_args(self, op: str) -> dict[str, Any]:
        """What a trace event shows of this task (``op``: its node described), in the real
        runs' traces and the simulator's alike: op, kind, bytes, id, and the kernel, the source
        device of a move, the flops where they apply."""
        args: dict[str, Any] = {"op": op, "kind": self.kind.value, "bytes": self.nbytes, "task": self.id}
        if self.kind is TaskKind.KERNEL:
            args["kernel"] = self.payload.kernel
        elif self.kind is TaskKind.MOVE:
            args["src_device"] = self.payload.src_device
        if self.flops:
            args["flops"] = self.flops
        return args


@dataclass
class TaskGraphBuilder:
    """Appends tasks in a topological order (a task's reads are written by earlier tasks)."""

    tasks: list[Task] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)

    def value(self, device: int, shape: tuple[int, ...], dtype: str, node: Node) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, device, tuple(shape), dtype, node))
        return vid

    def add(self, kind: TaskKind, device: int, reads: tuple[int, ...], writes: int, node: Node,
            payload: Payload, flops: int = 0, nbytes: int | None = None, after: tuple[int, ...] = ()) -> int:
        """Append a task; its deps are the producers of what it reads, plus ``after``."""
        kind = TaskKind(kind)  # a plain string would pass PAYLOADS (a str Enum) but lack the groups
        if type(payload) is not PAYLOADS[kind]:  # a programming error in a floor above
            raise TypeError(f"a {kind} task takes a {PAYLOADS[kind].__name__} payload, "
                            f"not {type(payload).__name__}")
        tid = len(self.tasks)
        deps: list[int] = list(dict.fromkeys(after))
        for v in reads:
            for p in self.values[v].producers:
                if p not in deps:
                    deps.append(p)
        if nbytes is None:
            nbytes = self.values[writes].nbytes if writes >= 0 else 0
        dtype = self.values[writes].dtype if writes >= 0 else ""
        self.tasks.append(Task(tid, kind, device, tuple(reads), writes, tuple(deps), nbytes, flops, node,
                               payload, dtype=dtype))
        if writes >= 0:
            w = self.values[writes]
            self.values[writes] = Value(w.id, w.device, w.shape, w.dtype, w.node, w.producers + (tid,))
        return tid

    def produce(self, kind: TaskKind, device: int, reads: tuple[int, ...], shape: tuple[int, ...],
                dtype: str, node: Node, payload: Payload, flops: int = 0) -> int:
        """A task writing a fresh value; returns the value id."""
        vid = self.value(device, shape, dtype, node)
        self.add(kind, device, reads, vid, node, payload, flops=flops)
        return vid
