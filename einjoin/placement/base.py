"""What a placement is, the placer registry, and the placers that ignore where data is:
``round_robin`` and ``random``. The affinity-based placers (:mod:`einjoin.placement.affinity`)
build on this module; :mod:`einjoin.placement` re-exports both.

>>> import einjoin as ej
>>> z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
>>> d = ej.decompose(z.node, {"m": 2, "k": 2})
>>> round_robin({z.node: d}, ej.local(4))[z.node].kernel_devices
(0, 1, 1, 2)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.partition import BlockKey
from einjoin.errors import EinjoinError
from einjoin.ir.node import Node
from einjoin.registry import Registry

__all__ = ["NodePlacement", "Placement", "PLACERS", "place", "register_placer"]


@dataclass(frozen=True)
class NodePlacement:
    kernel_devices: tuple[int, ...]
    homes: dict[BlockKey, int]  # out block key -> device (the device of the block's first partial)

    def __hash__(self) -> int:  # pragma: no cover - placements are compared, rarely hashed
        return hash(self.kernel_devices)


Placement = dict[Node, NodePlacement]
Placer = Callable[[Mapping[Node, Decomposition], Cluster, int], Placement]


PLACERS: dict[str, Placer] = Registry()


_P = TypeVar("_P", bound=Placer)


def register_placer(name: str) -> Callable[[_P], _P]:
    """Register a placer under ``name`` (``ej.compile(..., placement=name)``); the function is
    returned unchanged."""
    def deco(fn: _P) -> _P:
        PLACERS[name] = fn
        return fn
    return deco


def _from_kernel_devices(d: Decomposition, devs: list[int]) -> NodePlacement:
    homes: dict[BlockKey, int] = {}
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
        seen: dict[BlockKey, int] = {}
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
    """The placement of every node's kernels by the placer ``name``."""
    if not isinstance(name, str) or name not in PLACERS:
        shown = repr(name)
        raise EinjoinError(f"unknown placement {shown if len(shown) <= 60 else shown[:57] + '...'}; "
                           f"known: {', '.join(sorted(PLACERS))}")
    return PLACERS[name](decomps, cluster, seed)

