"""Exchange synthesis: from where a tensor's blocks are to the regions its consumers need where
they run, using only point-to-point primitives (select, move, touch).

The *usage partition* is the per-dimension union of the producer's boundaries and every
consumer's; its blocks are the pieces that travel. For each producer block and destination
device, the pieces needed there move once (the whole block in one move when all of it is
needed; otherwise each piece is cut at the source with a ``select`` so only needed bytes
travel). A requested region is then the value itself, a local ``select`` of it, or a buffer
assembled by ``touch``es. All-gather, all-to-all and broadcast patterns emerge from this; none is
called.

>>> import einjoin as ej
>>> from einjoin.decomp import Partition
>>> from einjoin.exchange import Block, TaskGraphBuilder, TaskKind, synthesize
>>> x = ej.input("x", (4, 4)).node
>>> rows = Partition.from_counts((4, 4), (4, 1))         # row blocks on devices 0..3
>>> b = TaskGraphBuilder()
>>> blocks = {k: b.produce(TaskKind.LOAD, i, (), rows.block_shape(k), "float32", x,
...                     Block(rows.box(k)))
...           for i, k in enumerate(rows.keys())}
>>> cols = Partition.from_counts((4, 4), (1, 4))         # column j needed on device j
>>> got = synthesize(b, x, rows, blocks, [(cols.box(k), j, None) for j, k in enumerate(cols.keys())])
>>> sum(t.nbytes for t in b.tasks if t.kind is TaskKind.MOVE), 4 * 4 * 4 * 3 // 4   # 3/4 of the bytes
(48, 48)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from einjoin.decomp.partition import BlockKey, Box, Partition, box_shape, box_size, intersect, relative
from einjoin.exchange.tasks import Move, Select, TaskGraphBuilder, TaskKind, Touch
from einjoin.ir.node import Node

__all__ = ["synthesize", "Request"]

Request = tuple[Box, int, "Node | None"]  # region, device, requesting op


def _pieces(usage: Partition, box: Box) -> list[Box]:
    """The usage blocks inside ``box`` (which is a union of them)."""
    ranges = [usage.overlapping(d, a, b) for d, (a, b) in enumerate(box)]
    return [usage.box(k) for k in itertools.product(*ranges)]


def synthesize(builder: TaskGraphBuilder, node: Node, partition: Partition,
               blocks: dict[BlockKey, int], requests: Iterable[Request]) -> dict[tuple[Box, int], int]:
    """Emit the exchange program for ``node``'s tensor (blocks ``blocks`` under ``partition``) and
    return the value id of every requested (region, device)."""
    requests = list(requests)
    dtype = node.dtype
    bounds = [set(b) for b in partition.bounds]
    for box, _, _ in requests:
        for d, (a, b) in enumerate(box):
            bounds[d].update((a, b))
    usage = Partition(tuple(tuple(sorted(s)) for s in bounds))
    dev = {k: builder.values[v].device for k, v in blocks.items()}

    def producers(box: Box) -> list[tuple[BlockKey, Box]]:
        ranges = [partition.overlapping(d, a, b) for d, (a, b) in enumerate(box)]
        out = []
        for k in itertools.product(*ranges):
            sub = intersect(box, partition.box(k))
            if sub is not None:
                out.append((k, sub))
        return out

    # pass 1: which usage pieces of which producer block each remote device needs
    needed: dict[tuple[BlockKey, int], dict[Box, Node | None]] = {}
    for box, d, consumer in requests:
        for k, sub in producers(box):
            if dev[k] != d:
                for e in _pieces(usage, sub):
                    needed.setdefault((k, d), {}).setdefault(e, consumer)

    # pass 2: move whole blocks where all of a block is needed, else the needed pieces
    whole: dict[tuple[BlockKey, int], int] = {}
    piece: dict[tuple[Box, int], int] = {}
    for (k, d), want in needed.items():
        src = blocks[k]
        kbox = partition.box(k)
        consumer = next(iter(want.values()))
        if len(want) == len(_pieces(usage, kbox)):
            whole[(k, d)] = builder.produce(TaskKind.MOVE, d, (src,), partition.block_shape(k), dtype, node,
                                            Move(dev[k], consumer))
            continue
        for e, consumer in want.items():
            cut = builder.produce(TaskKind.SELECT, dev[k], (src,), box_shape(e), dtype, node,
                                  Select(relative(e, kbox), consumer))
            piece[(e, d)] = builder.produce(TaskKind.MOVE, d, (cut,), box_shape(e), dtype, node,
                                            Move(dev[k], consumer))

    # regions: the value itself, a local select, or a buffer assembled by touches
    out: dict[tuple[Box, int], int] = {}
    for box, d, consumer in requests:
        if (box, d) in out:
            continue
        parts: list[tuple[int, Box, Box]] = []  # (source value, box in source, box in region)
        for k, sub in producers(box):
            kbox = partition.box(k)
            if dev[k] == d:
                parts.append((blocks[k], relative(sub, kbox), relative(sub, box)))
            elif (k, d) in whole:
                parts.append((whole[(k, d)], relative(sub, kbox), relative(sub, box)))
            else:
                for e in _pieces(usage, sub):
                    parts.append((piece[(e, d)], tuple((0, b - a) for a, b in e), relative(e, box)))
        shape = box_shape(box)
        if len(parts) == 1:
            src, sbox, _ = parts[0]
            if box_shape(sbox) == builder.values[src].shape:
                out[(box, d)] = src
            else:
                out[(box, d)] = builder.produce(TaskKind.SELECT, d, (src,), shape, dtype, node,
                                                Select(sbox, consumer))
            continue
        buf = builder.value(d, shape, dtype, node)
        for src, sbox, rbox in parts:
            builder.add(TaskKind.TOUCH, d, (src,), buf, node, Touch(sbox, rbox, consumer),
                        nbytes=box_size(rbox) * builder.values[buf].nbytes // max(box_size(box), 1))
        out[(box, d)] = buf
    return out
