"""The cost model: bytes a plan moves, as pure functions of shapes and specs (and, for the exact
repartition cost, of a placement given as data).

Accounting is the runtime's: one copy of every input block is loaded where one of its readers
runs; every further replica and every travelling partial result is a move.

- join cost: every input block read by r kernels travels r - 1 times. For an einsum this is
  ``sum_i |X_i| (r_i - 1)`` with ``r_i`` the product of the block counts of the labels X_i lacks;
  other kinds count their readers from the decomposition (a broadcast's size-1 dims, a gather's
  table rows read by every index block).
- aggregation cost: ``|Z| (n_agg - 1)``, each output block's partials but one travel home (a
  float16/bfloat16 sum's partials travel as float32).
- repartition cost: the bytes of the overlaps between a producer's blocks and a consumer's
  required blocks that sit on different devices (exact given a placement; without one, each
  required block is assumed to sit with the producer block it overlaps most).

>>> import einjoin as ej
>>> from einjoin.planner.cost import join_cost, agg_cost
>>> z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
>>> d = ej.decompose(z.node, {"m": 2, "n": 2, "k": 2})
>>> (join_cost(d) + agg_cost(d)) / (8192 * 8192 * 4)    # 3 matrices, the lower bound at P = 8
3.0
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Mapping

from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.partition import Partition
from einjoin.decomp.partition import box_size, intersect
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Fill

__all__ = ["join_cost", "join_cost_per_input", "agg_cost", "repartition_cost", "repartition_estimate", "op_cost"]


def join_cost(d: Decomposition) -> int:
    """Bytes of input replicas beyond the one loaded copy: sum over input blocks of
    |block| * (kernels reading it - 1). Fills are computed where needed and cost nothing."""
    return sum(join_cost_per_input(d))


def join_cost_per_input(d: Decomposition) -> tuple[int, ...]:
    """:func:`join_cost` split by input slot."""
    out = []
    for slot, (x, part) in enumerate(zip(d.node.inputs, d.in_partitions)):
        total = 0
        if not isinstance(x.op, Fill):
            readers = Counter(k.in_keys[slot] for k in d.kernels if k.in_keys[slot] is not None)
            size = itemsize(x.dtype)
            for key, r in readers.items():
                total += _elems(part.block_shape(key)) * size * (r - 1)
        out.append(total)
    return tuple(out)


def agg_cost(d: Decomposition) -> int:
    """Bytes of partial results that travel to be aggregated: |Z| * (n_partials - 1), at the
    dtype partials travel in (float32 for a half-precision sum: see ``partial_dtype``)."""
    if d.n_partials <= 1:
        return 0
    return d.node.size * itemsize(partial_dtype(d.node)) * (d.n_partials - 1)


def _elems(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def repartition_cost(producer: Partition, consumer: Partition, dtype: str,
                     producer_devices: Mapping | None = None, consumer_devices: Mapping | None = None
                     ) -> int:
    """Bytes to turn ``producer``'s blocks into ``consumer``'s given the devices of both (block key
    -> device): the overlap volume between blocks on different devices. Without devices, see
    :func:`repartition_estimate`."""
    if producer_devices is None or consumer_devices is None:
        return repartition_estimate(producer, consumer, dtype)
    size = itemsize(dtype)
    total = 0
    for ck in consumer.keys():
        cbox = consumer.box(ck)
        ranges = [producer.overlapping(dim, a, b) for dim, (a, b) in enumerate(cbox)]
        overlaps = []
        for pk in itertools.product(*ranges):
            sub = intersect(cbox, producer.box(pk))
            if sub is not None:
                overlaps.append((pk, box_size(sub)))
        total += sum(v for pk, v in overlaps if producer_devices[pk] != consumer_devices[ck]) * size
    return total


def repartition_estimate(producer: Partition, consumer: Partition, dtype: str) -> int:
    """Placement-free repartition bytes: each consumer block sits with the producer block it
    overlaps most and the rest of it moves. Both partitions are grids, so the sum over consumer
    blocks of the largest overlap factorises into a product over dims of 1-D sums: O(blocks)."""
    if producer == consumer or 0 in consumer.shape:  # an empty tensor moves nothing
        return 0
    kept = 1
    for pb, cb in zip(producer.bounds, consumer.bounds):
        dim_sum = 0
        j = 0
        for a, b in zip(cb, cb[1:]):
            while pb[j + 1] <= a:
                j += 1
            best, i = 0, j
            while i < len(pb) - 1 and pb[i] < b:
                best = max(best, min(b, pb[i + 1]) - max(a, pb[i]))
                i += 1
            dim_sum += best
        kept *= dim_sum
    n = 1
    for b in consumer.bounds:
        n *= b[-1]
    return (n - kept) * itemsize(dtype)


def op_cost(d: Decomposition) -> int:
    """Join plus aggregation bytes of one op under its spec (no repartitioning)."""
    return join_cost(d) + agg_cost(d)
