"""Where each block lives once every kernel has its device: :func:`settle_homes`.

A block's *home* is where it is loaded (a graph input's block), or where its partial results are
summed (a block computed by several kernels); the exchange then sends it from there to every
other device that reads it. Given the kernels' devices, the bytes a block costs depend on its home
only, and on nothing else's, so each block can take the best home on its own:

- summing on a device holding a partial saves moving that partial (``block`` bytes in the
  partials' dtype), and
- living on a device that reads ``u`` elements of it saves sending those ``u`` elements there.

The home that saves most moves the fewest bytes, exactly as the task graph counts them
(:mod:`einjoin.plan.taskgraph`, :mod:`einjoin.exchange`). Among equally good homes (for a
parameter every device reads whole, for a gradient nobody reads: all of them) the block goes to
the device holding the fewest blocks of the same tensor, then (for a block that stays all run: an
input's, an output's) the fewest bytes of such blocks, then the least traffic in so far: so a
ZeRO plan's parameter and gradient blocks spread one per device (a reduce-scatter, not a reduce
to device 0), and whole parameters and gradients of data parallelism spread over the devices
instead of piling on the first. A block computed by one kernel stays where it is
computed (the task graph never moves it to a home).

>>> import einjoin as ej
>>> x, w = ej.input("x", (64, 32)), ej.param("w", (32, 16))
>>> gw = ej.einsum("mk,mn->kn", x, ej.input("g", (64, 16)))   # w's gradient: m contracted
>>> prog = ej.compile([x @ w, gw], devices=4, specs={w: {"a": 4}, gw: {"m": 4, "k": 4}},
...                   backend="null")
>>> sorted(prog.placement[w.node].homes.values()), sorted(prog.placement[gw.node].homes.values())
([0, 1, 2, 3], [0, 1, 2, 3])
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.partition import BlockKey, Box, Partition
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Node
from einjoin.placement.base import NodePlacement, Placement

__all__ = ["settle_homes", "tie_homes", "block_devices"]

_Reads = dict[BlockKey, dict[int, set[Box]]]  # block -> device -> the parts of it read there


def _parts(part: Partition, box: Box) -> list[tuple[BlockKey, Box]]:
    """The blocks of ``part`` that ``box`` overlaps, each with the overlap (non-empty)."""
    found = []
    for pk in itertools.product(*(part.overlapping(dim, a, b) for dim, (a, b) in enumerate(box))):
        sub = tuple((max(a, c), min(b, e)) for (a, b), (c, e) in zip(box, part.box(pk)))
        if all(a < b for a, b in sub):
            found.append((pk, sub))
    return found


def _volume(boxes: set[Box]) -> int:
    """Elements in the union of ``boxes`` (usually one box; else counted on their common grid)."""
    if len(boxes) == 1:
        vol = 1
        for a, b in next(iter(boxes)):
            vol *= b - a
        return vol
    cuts = [sorted({v for box in boxes for v in box[dim]}) for dim in range(len(next(iter(boxes))))]
    vol = 0
    for cell in itertools.product(*(list(zip(c, c[1:])) for c in cuts)):
        if any(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(cell, box)) for box in boxes):
            size = 1
            for lo, hi in cell:
                size *= hi - lo
            vol += size
    return vol


def _reads(decomps: Mapping[Node, Decomposition], placement: Placement) -> dict[Node, _Reads]:
    """For every tensor, which parts of each of its blocks each device reads."""
    reads: dict[Node, _Reads] = {}
    for node, d in decomps.items():
        if node.facts.leaf:
            continue
        for k, dev in zip(d.kernels, placement[node].kernel_devices):
            for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                if key is None or x.facts.free:
                    continue
                per = reads.setdefault(x, {})
                for pk, sub in _parts(decomps[x].out_partition, d.in_partitions[slot].box(key)):
                    per.setdefault(pk, {}).setdefault(dev, set()).add(sub)
    return reads


def settle_homes(decomps: Mapping[Node, Decomposition], placement: Placement, p: int) -> Placement:
    """``placement`` with every graph input's block and every block summed from several partials
    homed where it moves the fewest bytes, ties spread (see the module docstring); the kernels'
    devices, and the homes of blocks computed by one kernel, are unchanged. O(kernels' reads).

    >>> import einjoin as ej
    >>> from einjoin.placement.base import NodePlacement
    >>> x, y = ej.input("x", (8, 4)), ej.input("y", (8, 4))
    >>> g1, g2 = ej.einsum("mk,mn->kn", x, y), ej.einsum("mk,mn->kn", y, x)   # two gradients
    >>> d = {n: ej.decompose(n, {"m": 2} if n in (g1.node, g2.node) else {"a": 2})
    ...      for n in ej.Graph([g1, g2]).nodes}
    >>> both_on_0 = NodePlacement((0, 1), {(0, 0): 0})      # partials on 0 and 1, summed on 0
    >>> pl = {x.node: NodePlacement((), {(0, 0): 0, (1, 0): 1}), y.node: NodePlacement((), {(0, 0): 0, (1, 0): 1}),
    ...       g1.node: both_on_0, g2.node: both_on_0}
    >>> settled = settle_homes(d, pl, 2)
    >>> settled[g1.node].homes, settled[g2.node].homes      # as cheap either way: spread
    ({(0, 0): 0}, {(0, 0): 1})
    """
    reads = _reads(decomps, placement)
    # bytes per device of the blocks that stay for the whole run: graph inputs' and those of
    # tensors nothing reads (outputs: a gradient, the loss); intermediates come and go
    held = [0] * p
    inbound = [0] * p  # bytes each device receives, for the homes given so far
    out: Placement = {}
    for node, d in decomps.items():
        pl = placement[node]
        if node.facts.free:
            out[node] = pl
            continue
        isz = itemsize(node.dtype)
        acc = itemsize(partial_dtype(node)) if d.n_partials > 1 else isz
        partials: dict[BlockKey, list[int]] = {}
        if not node.facts.fed:
            for k, dev in zip(d.kernels, pl.kernel_devices):
                partials.setdefault(k.out_key, []).append(dev)
        mine = [0] * p  # blocks of this tensor homed per device
        per = reads.get(node, {})
        stays = node.facts.fed or not per
        homes: dict[BlockKey, int] = {}
        for key in d.out_partition.keys():
            old = pl.homes[key]
            elems = 1
            for a, b in d.out_partition.box(key):
                elems *= b - a
            parts = partials.get(key, ())
            need = {dv: isz * _volume(boxes) for dv, boxes in per.get(key, {}).items()}
            if len(parts) == 1 or not (parts or need):
                home = old  # computed where it lives; or an input block nobody reads
            else:
                saved = dict(need)
                for dv in set(parts):
                    saved[dv] = saved.get(dv, 0) + acc * elems
                top = max(saved.values())
                home = min((dv for dv, s in saved.items() if s == top),
                           key=lambda dv: (mine[dv], held[dv] if stays else 0, inbound[dv], dv != old, dv))
            # the traffic into each device, as the task graph will have it
            for dv, nbytes in need.items():
                if dv != home:
                    inbound[dv] += nbytes
            inbound[home] += acc * elems * len(set(parts) - {home})
            homes[key] = home
            mine[home] += 1
            if stays:
                held[home] += isz * elems
        out[node] = NodePlacement(pl.kernel_devices, homes)
    return out


def block_devices(node: Node, d: Decomposition, pl: NodePlacement) -> dict[BlockKey, int]:
    """Where each output block of ``node`` ends up in the task graph: on the device of its one
    kernel when one kernel computes it, else at its home (a loaded, filled or summed block)."""
    count: dict[BlockKey, int] = {}
    first: dict[BlockKey, int] = {}
    if not (node.facts.fed or node.facts.free):
        for k, dev in zip(d.kernels, pl.kernel_devices):
            count[k.out_key] = count.get(k.out_key, 0) + 1
            first.setdefault(k.out_key, dev)
    return {key: first[key] if count.get(key) == 1 else pl.homes[key] for key in d.out_partition.keys()}


def tie_homes(decomps: Mapping[Node, Decomposition], placement: Placement, tied: Mapping[Node, Node]
              ) -> Placement:
    """``placement`` with every state input's block ``k`` (a key of ``tied``: state input -> new
    value, cut alike by :func:`einjoin.planner.tie_state`) homed where the new value's block ``k``
    ends, so the carry-over from one run's end to the next run's start moves nothing. A new block
    summed from several partials takes the home that saves most for the pair (its partials, its
    readers, the input block's readers); one computed by one kernel fixes the input's home.

    >>> import einjoin as ej
    >>> w = ej.input("w", (8, 4)); new = w * 2.0
    >>> d = {w.node: ej.decompose(w.node, {"a": 2}), new.node: ej.decompose(new.node, {"a": 2})}
    >>> pl = {w.node: NodePlacement((), {(0, 0): 0, (1, 0): 0}),
    ...       new.node: NodePlacement((1, 0), {(0, 0): 1, (1, 0): 0})}
    >>> tie_homes(d, pl, {w.node: new.node})[w.node].homes
    {(0, 0): 1, (1, 0): 0}
    """
    if not any(old is not new for old, new in tied.items()):
        return placement
    reads = _reads(decomps, placement)
    out = dict(placement)
    for old, new in tied.items():
        if old is new:
            continue
        d, pl = decomps[new], out[new]
        ends = block_devices(new, d, pl)
        partials: dict[BlockKey, list[int]] = {}
        if not (new.facts.fed or new.facts.free):
            for k, dev in zip(d.kernels, pl.kernel_devices):
                partials.setdefault(k.out_key, []).append(dev)
        isz = itemsize(new.dtype)
        acc = itemsize(partial_dtype(new)) if d.n_partials > 1 else isz
        homes_new, homes_old = dict(pl.homes), {}
        for key in d.out_partition.keys():
            home = ends[key]
            parts = partials.get(key, ())
            if len(parts) > 1:  # summed: where the pair saves most (ties: where it was)
                elems = 1
                for a, b in d.out_partition.box(key):
                    elems *= b - a
                saved: dict[int, int] = {}
                for x in (new, old):
                    for dv, boxes in reads.get(x, {}).get(key, {}).items():
                        saved[dv] = saved.get(dv, 0) + isz * _volume(boxes)
                for dv in set(parts):
                    saved[dv] = saved.get(dv, 0) + acc * elems
                top = max(saved.values())
                home = min((dv for dv, s_ in saved.items() if s_ == top), key=lambda dv: (dv != ends[key], dv))
                homes_new[key] = home
            homes_old[key] = home
        out[new] = NodePlacement(pl.kernel_devices, homes_new)
        out[old] = NodePlacement(out[old].kernel_devices, homes_old)
    return out
