"""Placement: the device of every kernel (so of every partial result) and of every output block.

A placement is plain data. ``NodePlacement.kernel_devices[i]`` is where kernel ``i`` of the node's
decomposition runs; ``homes[out_key]`` is where that output block is aggregated and lives. Placers
share one signature and one registry.

>>> import einjoin as ej
>>> from einjoin.placement import place
>>> z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
>>> d = ej.decompose(z.node, {"m": 2, "k": 2})
>>> p = place("round_robin", {z.node: d}, ej.local(4))[z.node]
>>> p.kernel_devices, p.homes
((0, 1, 1, 2), {(0, 0): 0, (1, 0): 1})
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Mapping

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition
from einjoin.errors import EinjoinError
from einjoin.ir.node import Node

__all__ = ["NodePlacement", "Placement", "PLACERS", "place", "register_placer"]


@dataclass(frozen=True)
class NodePlacement:
    kernel_devices: tuple[int, ...]
    homes: dict  # out block key -> device (the device of the block's first partial)

    def __hash__(self) -> int:  # pragma: no cover - placements are compared, rarely hashed
        return hash(self.kernel_devices)


Placement = dict[Node, NodePlacement]
Placer = Callable[[Mapping[Node, Decomposition], Cluster, int], Placement]
PLACERS: dict[str, Placer] = {}


def register_placer(name: str) -> Callable[[Placer], Placer]:
    def deco(fn: Placer) -> Placer:
        PLACERS[name] = fn
        return fn
    return deco


def _from_kernel_devices(d: Decomposition, devs: list[int]) -> NodePlacement:
    homes: dict = {}
    for k, dev in zip(d.kernels, devs):
        homes.setdefault(k.out_key, dev)
    return NodePlacement(tuple(devs), homes)


@register_placer("round_robin")
def round_robin(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Output block ``i`` (in key order) lives on device ``i mod P``; its ``j``-th partial is
    computed on device ``(i + j) mod P``, so partial sums spread over devices. Aligned
    elementwise chains therefore stay local."""
    out: Placement = {}
    for node, d in decomps.items():
        index = {key: i for i, key in enumerate(d.out_partition.keys())}
        seen: dict = {}
        devs = []
        for k in d.kernels:
            j = seen.get(k.out_key, 0)
            seen[k.out_key] = j + 1
            devs.append((index[k.out_key] + j) % cluster.size)
        out[node] = _from_kernel_devices(d, devs)
    return out


@register_placer("random")
def random_placement(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Every kernel on a uniformly random device (tests use it to exercise every exchange case)."""
    rng = random.Random(seed)
    return {node: _from_kernel_devices(d, [rng.randrange(cluster.size) for _ in d.kernels])
            for node, d in decomps.items()}


def place(name: str, decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    if name not in PLACERS:
        raise EinjoinError(f"unknown placement {name!r}; known: {', '.join(sorted(PLACERS))}")
    return PLACERS[name](decomps, cluster, seed)


@register_placer("greedy")
def greedy(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Affinity with balance (in the spirit of Einsummable's greedy): each kernel goes to the
    device that already holds most of the bytes it reads (producer blocks' homes, or copies an
    earlier kernel caused), among devices below ceil(K/P) kernels of this op and, where possible,
    not holding another partial of the same output block. A graph input's block is homed where
    its first reader runs, so the one loaded copy is where it is used."""
    from einjoin.ir.node import Fill, Input

    p = cluster.size
    homes: dict[Node, dict] = {}
    copies: dict[tuple[Node, tuple], set[int]] = {}  # (producer, region) -> devices holding it
    out: Placement = {}
    for node, d in decomps.items():
        if isinstance(node.op, Input):
            homes[node] = {}
            continue
        if isinstance(node.op, Fill):
            out[node] = round_robin({node: d}, cluster)[node]
            homes[node] = out[node].homes
            continue
        cap = -(-len(d.kernels) // p)
        load = [0] * p
        partial_devs: dict = {}
        devs = []
        for k in d.kernels:
            score = [0] * p
            for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                if key is None or isinstance(x.op, Fill):
                    continue
                box = d.in_partitions[slot].box(key)
                xd = decomps[x]
                for dev in copies.get((x, box), ()):
                    score[dev] += _box_elems(box)
                for pk, vol in _overlaps(xd.out_partition, box):
                    h = homes[x].get(pk)
                    if h is not None:
                        score[h] += vol
            taken = partial_devs.setdefault(k.out_key, set())
            order = sorted(range(p), key=lambda dv: (load[dv] >= cap, dv in taken, -score[dv], load[dv], dv))
            dev = order[0]
            devs.append(dev)
            load[dev] += 1
            taken.add(dev)
            for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                if key is None or isinstance(x.op, Fill):
                    continue
                box = d.in_partitions[slot].box(key)
                if isinstance(x.op, Input):
                    for pk, _ in _overlaps(decomps[x].out_partition, box):
                        homes[x].setdefault(pk, dev)
                copies.setdefault((x, box), set()).add(dev)
        out[node] = _from_kernel_devices(d, devs)
        homes[node] = out[node].homes
    for node, d in decomps.items():
        if isinstance(node.op, Input):
            rr = round_robin({node: d}, cluster)[node].homes
            h = {key: homes[node].get(key, rr[key]) for key in d.out_partition.keys()}
            out[node] = NodePlacement(tuple(h[k.out_key] for k in d.kernels), h)
    return {node: out[node] for node in decomps}


def _box_elems(box: tuple) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _overlaps(part: "object", box: tuple) -> list:
    import itertools
    ranges = [part.overlapping(dim, a, b) for dim, (a, b) in enumerate(box)]  # type: ignore[attr-defined]
    found = []
    for pk in itertools.product(*ranges):
        pbox = part.box(pk)  # type: ignore[attr-defined]
        vol = 1
        for (a, b), (c, e) in zip(box, pbox):
            vol *= max(0, min(b, e) - max(a, c))
        if vol:
            found.append((pk, vol))
    return found
