"""The task graph: every op's kernels, its local and remote aggregation, and the exchange
programs between ops, as plain data built from shapes alone.

Accounting (the communication lower bound's model): exactly one copy of each input element is
loaded (``load`` tasks, on the device the placement gives each input block); every further
replica and every partial result that travels is a ``move``; outputs are aggregated to one copy
on the devices and then fetched.

Numerics: the partial results of a float16/bfloat16 sum or product are float32 values (kernels,
local reduces, the moves that carry them: ``einjoin.ir.kernels.partial_dtype``); the last reduce
of each block writes the op's dtype, so the result is rounded once, as torch and cuBLAS do.

>>> import einjoin as ej
>>> from einjoin.plan import build_taskgraph
>>> from einjoin.placement import place
>>> z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
>>> g = ej.Graph(z)
>>> decomps = {n: ej.decompose(n, {"k": 2} if n is z.node else None) for n in g.nodes}
>>> tg = build_taskgraph(g, decomps, place("round_robin", decomps, ej.local(2)), 2)
>>> tg.stats().bytes_moved   # a[:, 4:] and b[4:] go to device 1, one 8x8 partial comes back
512
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.flops import kernel_flops
from einjoin.decomp.partition import BlockKey, Partition
from einjoin.decomp.partition import Box, box_shape
from einjoin.exchange import (Block, Kernel, Move, Reduce, Release, Request, Task, TaskGraphBuilder, TaskKind,
                              Value, synthesize)
from einjoin.ir.graph import Graph
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Node
from einjoin.placement import Placement
from einjoin.plan.stats import PlanStats, compute_stats

__all__ = ["TaskGraph", "OutputLayout", "build_taskgraph", "kernel_flops"]


@dataclass(frozen=True)
class OutputLayout:
    node: Node
    partition: Partition
    blocks: dict[BlockKey, int]  # block key -> value id (the one aggregated copy)


@dataclass(frozen=True)
class TaskGraph:
    tasks: tuple[Task, ...]
    values: tuple[Value, ...]
    n_devices: int
    outputs: tuple[OutputLayout, ...]
    dependents: tuple[tuple[int, ...], ...]  # task id -> tasks that wait for it
    # set by einjoin.memplan: the caps this graph is safe under; outputs then end in the host store
    memory: Any = None

    def stats(self) -> PlanStats:
        return compute_stats(self)

    def __len__(self) -> int:
        return len(self.tasks)


def build_taskgraph(graph: Graph, decomps: Mapping[Node, Decomposition], placement: Placement,
                    n_devices: int) -> TaskGraph:
    b = TaskGraphBuilder()
    requests: dict[Node, list[Request]] = defaultdict(list)
    for c in graph.nodes:
        if c.facts.leaf:  # reads nothing
            continue
        d, devs = decomps[c], placement[c].kernel_devices
        for k, dev in zip(d.kernels, devs):
            for slot, (x, key) in enumerate(zip(c.inputs, k.in_keys)):
                if key is not None:
                    requests[x].append((d.in_partitions[slot].box(key), dev, c))
    outputs = set(graph.outputs)
    blocks: dict[Node, dict[BlockKey, int]] = {}
    regions: dict[Node, dict[tuple[Box, int], int]] = {}
    for node in graph.nodes:
        d, pl = decomps[node], placement[node]
        if node.facts.free:
            # a fill is computed where it is needed, never moved
            regions[node] = {}
            for box, dev, _ in requests[node]:
                if (box, dev) not in regions[node]:
                    regions[node][(box, dev)] = b.produce(TaskKind.FILL, dev, (), box_shape(box),
                                                          node.dtype, node, Block(box))
            if node in outputs:
                blocks[node] = {k: b.produce(TaskKind.FILL, pl.homes[k], (), d.out_partition.block_shape(k),
                                             node.dtype, node, Block(d.out_partition.box(k)))
                                for k in d.out_partition.keys()}
            continue
        if node.facts.fed:
            blocks[node] = {k: b.produce(TaskKind.LOAD, pl.homes[k], (), d.out_partition.block_shape(k),
                                         node.dtype, node, Block(d.out_partition.box(k)))
                            for k in d.out_partition.keys()}
        else:
            blocks[node] = _kernels_and_aggregation(b, node, d, pl.kernel_devices, pl.homes, regions)
        if requests[node]:
            regions[node] = synthesize(b, node, d.out_partition, blocks[node], requests[node])
    layouts = tuple(OutputLayout(o, decomps[o].out_partition, blocks[o]) for o in graph.outputs)
    _add_frees(b, {v for lay in layouts for v in lay.blocks.values()})
    dependents: list[list[int]] = [[] for _ in b.tasks]
    for t in b.tasks:
        for dep in t.deps:
            dependents[dep].append(t.id)
    return TaskGraph(tuple(b.tasks), tuple(b.values), n_devices, layouts,
                     tuple(tuple(x) for x in dependents))


def _kernels_and_aggregation(b: TaskGraphBuilder, node: Node, d: Decomposition, devs: tuple[int, ...],
                             homes: dict[BlockKey, int], regions: dict[Node, dict[tuple[Box, int], int]]
                             ) -> dict[BlockKey, int]:
    partials: dict[BlockKey, list[tuple[int, int]]] = defaultdict(list)  # key -> [(device, value)]
    # partial results keep the accumulation dtype (float32 for a half-precision sum) through
    # kernels, local reduces and moves; the last aggregation step of each block casts
    acc = partial_dtype(node) if d.n_partials > 1 else node.dtype
    for i, (k, dev) in enumerate(zip(d.kernels, devs)):
        reads = tuple(regions[x][(d.in_partitions[slot].box(key), dev)]
                      for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)) if key is not None)
        vid = b.produce(TaskKind.KERNEL, dev, reads, d.out_partition.block_shape(k.out_key), acc, node,
                        Kernel(i), flops=kernel_flops(d, k.index))
        partials[k.out_key].append((dev, vid))
    out: dict[BlockKey, int] = {}
    for key, parts in partials.items():
        if len(parts) == 1:
            out[key] = parts[0][1]
            continue
        shape = d.out_partition.block_shape(key)
        elems = 1
        for s in shape:
            elems *= s
        home = homes[key]
        local: dict[int, list[int]] = {}
        for dev, vid in parts:
            local.setdefault(dev, []).append(vid)
        # partials that share a device are combined there before anything moves; when one
        # device holds them all, that reduce is the last step and casts to the op's dtype
        local_dtype = node.dtype if len(local) == 1 else acc
        reduced = {dev: vids[0] if len(vids) == 1 else
                   b.produce(TaskKind.REDUCE, dev, tuple(vids), shape, local_dtype, node, Reduce(d.agg),
                             flops=elems * (len(vids) - 1))
                   for dev, vids in local.items()}
        gathered = ([reduced[home]] if home in reduced else []) + [
            b.produce(TaskKind.MOVE, home, (v,), shape, b.values[v].dtype, node, Move(dev, node))
            for dev, v in reduced.items() if dev != home]
        out[key] = gathered[0] if len(gathered) == 1 else b.produce(
            TaskKind.REDUCE, home, tuple(gathered), shape, node.dtype, node, Reduce(d.agg),
            flops=elems * (len(gathered) - 1))
    return out


def _add_frees(b: TaskGraphBuilder, keep: set[int]) -> None:
    readers: dict[int, list[int]] = defaultdict(list)
    for t in b.tasks:
        for vid in t.reads:
            readers[vid].append(t.id)
    for v in list(b.values):
        if v.id in keep:
            continue
        after = tuple(readers[v.id]) or v.producers
        b.add(TaskKind.FREE, v.device, (), -1, v.node, Release(v.id), nbytes=v.nbytes, after=after)
