"""The exact bytes a placed plan moves, as a volume formula over shapes and placement data.

This is the runtime's accounting written without tasks: for every tensor, the elements each
device needs (the union of its kernels' input regions) that do not live there, plus, for every
aggregated output block, one partial per device that computed some of it, except its home
(a half-precision sum's partials in float32).
Fills are computed where needed and never move. ``Program.stats.bytes_moved`` must equal it.

>>> import einjoin as ej
>>> from einjoin.planner.exact import plan_bytes
>>> z = ej.input("a", (16, 32)) @ ej.input("b", (32, 8))
>>> prog = ej.compile(z, devices=4, specs={z: {"k": 4}})
>>> plan_bytes(prog.graph, prog.decomps, prog.placement) == prog.stats.bytes_moved == 3 * 16 * 8 * 4
True
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping

from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.partition import BlockKey, Box, Partition, box_size
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.placement import Placement

__all__ = ["plan_bytes", "aggregation_bytes", "exchange_bytes"]


def aggregation_bytes(d: Decomposition, devices: tuple[int, ...], homes: Mapping[BlockKey, int]) -> int:
    """Partials that travel home: per output block, the devices holding some of its partials,
    the home excepted (partials sharing a device are combined there first). They travel at
    ``partial_dtype`` (float32 for a half-precision sum), except a block whose partials all sit
    on one device away from its home: that device's reduce is the last step, so the result,
    cast to the op's dtype, travels."""
    if d.n_partials <= 1:
        return 0
    held: dict[BlockKey, set[int]] = defaultdict(set)
    for k, dev in zip(d.kernels, devices):
        held[k.out_key].add(dev)
    acc, final = itemsize(partial_dtype(d.node)), itemsize(d.node.dtype)
    return sum(len(devs - {homes[key]}) * box_size(d.out_partition.box(key))
               * (final if len(devs) == 1 else acc)
               for key, devs in held.items())


def exchange_bytes(partition: Partition, homes: Mapping[BlockKey, int], dtype: str,
                   requests: list[tuple[Box, int]]) -> int:
    """Bytes of a tensor (blocks under ``partition`` at ``homes``) that must travel so every
    (region, device) request is served: per device, the volume of the union of its requested
    regions lying in blocks homed elsewhere."""
    bounds = [set(b) for b in partition.bounds]
    for box, _ in requests:
        for dim, (a, b) in enumerate(box):
            bounds[dim].update((a, b))
    usage = Partition(tuple(tuple(sorted(s)) for s in bounds))
    wanted: dict[int, set[BlockKey]] = defaultdict(set)
    for box, dev in requests:
        ranges = [usage.overlapping(dim, a, b) for dim, (a, b) in enumerate(box)]
        wanted[dev].update(itertools.product(*ranges))
    total = 0
    for dev, keys in wanted.items():
        for key in keys:
            box = usage.box(key)
            owner = tuple(partition.overlapping(dim, a, a + 1)[0] for dim, (a, _) in enumerate(box))
            if homes[owner] != dev:
                total += box_size(box)
    return total * itemsize(dtype)


def plan_bytes(graph: Graph, decomps: Mapping[Node, Decomposition], placement: Placement) -> int:
    """Total bytes moved by the placed plan (equal to ``Program.stats.bytes_moved``)."""
    requests: dict[Node, list[tuple[Box, int]]] = defaultdict(list)
    total = 0
    for c in graph.nodes:
        if c.facts.leaf:
            continue
        d, pl = decomps[c], placement[c]
        for k, dev in zip(d.kernels, pl.kernel_devices):
            for slot, (x, key) in enumerate(zip(c.inputs, k.in_keys)):
                if key is not None:
                    requests[x].append((d.in_partitions[slot].box(key), dev))
        total += aggregation_bytes(d, pl.kernel_devices, pl.homes)
    for u, reqs in requests.items():
        if u.facts.free:
            continue
        total += exchange_bytes(decomps[u].out_partition, placement[u].homes, u.dtype, reqs)
    return total
