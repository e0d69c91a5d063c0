"""The vocabulary of task graphs: tasks, the values they write, and a builder.

Every task runs on one device, reads values that live on that device (a ``move`` reads on its
source device and writes on its destination), and writes one value. A buffer assembled from
several ``touch`` tasks is one value with several producers. Everything is plain data, built
from shapes alone, and every task carries its byte count.

Task kinds:

- ``load``   — a block of a graph input from the host (``box``: the block, global coordinates)
- ``fill``   — a block of a fill computed in place (``box``: global coordinates)
- ``kernel`` — kernel ``kernel`` of ``node``'s decomposition (its output block or a partial)
- ``reduce`` — combine same-shaped partials with ``agg``, in the order given (a local aggregation);
  a half-precision sum's partials are float32 and the block's last reduce casts (``dtype``)
- ``select`` — cut the sub-box ``box`` (relative to the source value) on the device
- ``move``   — copy a value from ``src_device`` to ``device`` (``nbytes`` travel)
- ``touch``  — write the sub-box ``box`` of the source into region ``dst_box`` of a buffer
- ``free``   — drop a value after its last reader

Memory-capped graphs (:mod:`einjoin.memplan`) add three kinds that cross the host link:

- ``evict``     — drop a value from its device, first copying it to the host store under
  ``host_key`` when ``nbytes`` > 0 (a clean value — an input block, a fill, a reloaded copy — is
  only dropped)
- ``reload``    — copy the host store's ``host_key`` (or, with ``box``, the graph input's block)
  back to the device as a fresh value
- ``writeback`` — copy an output block to the host store and drop it from the device
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from einjoin.decomp.partition import Box
from einjoin.ir.agg import Agg
from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Node

__all__ = ["Task", "Value", "TaskGraphBuilder", "TASK_KINDS", "RELEASES"]

TASK_KINDS = ("load", "fill", "kernel", "reduce", "select", "move", "touch", "free", "evict", "reload",
              "writeback")
RELEASES = ("free", "evict", "writeback")  # kinds that drop their ``frees`` value from the device


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


@dataclass(frozen=True)
class Task:
    id: int
    kind: str
    device: int
    reads: tuple[int, ...]
    writes: int  # value id; -1 for free
    deps: tuple[int, ...]
    nbytes: int
    flops: int
    node: Node
    src_device: int = -1
    box: Box | None = None
    dst_box: Box | None = None
    kernel: int = -1
    agg: Agg | None = None
    consumer: Node | None = None  # move/select: the op whose request caused it (for explain)
    frees: int = -1  # free/evict/writeback: the value dropped
    host_key: int = -1  # evict/reload/writeback: the host store's key (the value's first id)
    scratch: int = 0  # bytes the task needs besides its output while it runs (a joined block)
    # the written value's dtype (set by the builder): a half-precision op's partial sums are
    # float32 until the reduce that casts them (einjoin.ir.kernels.partial_dtype)
    dtype: str = ""


@dataclass
class TaskGraphBuilder:
    """Appends tasks in a topological order (a task's reads are written by earlier tasks)."""

    tasks: list[Task] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)

    def value(self, device: int, shape: tuple[int, ...], dtype: str, node: Node) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, device, tuple(shape), dtype, node))
        return vid

    def add(self, kind: str, device: int, reads: tuple[int, ...], writes: int, node: Node,
            flops: int = 0, nbytes: int | None = None, after: tuple[int, ...] = (), **extra: Any) -> int:
        """Append a task; its deps are the producers of what it reads, plus ``after``."""
        tid = len(self.tasks)
        deps: list[int] = list(dict.fromkeys(after))
        for v in reads:
            for p in self.values[v].producers:
                if p not in deps:
                    deps.append(p)
        if nbytes is None:
            nbytes = self.values[writes].nbytes if writes >= 0 else 0
        if writes >= 0:
            extra.setdefault("dtype", self.values[writes].dtype)
        self.tasks.append(Task(tid, kind, device, tuple(reads), writes, tuple(deps), nbytes, flops,
                               node, **extra))
        if writes >= 0:
            v = self.values[writes]
            self.values[writes] = Value(v.id, v.device, v.shape, v.dtype, v.node, v.producers + (tid,))
        return tid

    def produce(self, kind: str, device: int, reads: tuple[int, ...], shape: tuple[int, ...],
                dtype: str, node: Node, **extra: Any) -> int:
        """A task writing a fresh value; returns the value id."""
        vid = self.value(device, shape, dtype, node)
        self.add(kind, device, reads, vid, node, **extra)
        return vid
