"""op_need weighs one kernel per class of kernels that hold alike (einjoin.decomp.footprint's
KERNEL_CLASS_RULES: for einsums, casts, selects and broadcasts, one kernel per combination of
distinct label extents) and memoises block shapes per key: the same bytes as weighing every
kernel, written out here plainly as the oracle, on random graphs and random (uneven) cuts."""

from __future__ import annotations

from math import prod
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.footprint import kernel_scratch, op_need
from einjoin.decomp.partition import even_bounds
from einjoin.decomp.spec import JoinAggSpec, label_sizes
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from graphgen import graphs


def _every_kernel(d: Decomposition) -> int:
    node = d.node
    out_item = itemsize(node.dtype)
    part_item = itemsize(partial_dtype(node)) if d.n_partials > 1 else out_item
    worst = 0
    for i, k in enumerate(d.kernels):
        ins = [prod(d.in_partitions[s].block_shape(key)) * itemsize(x.dtype)
               for s, (x, key) in enumerate(zip(node.inputs, k.in_keys)) if key is not None]
        out = prod(d.out_partition.block_shape(k.out_key)) * part_item
        worst = max(worst, sum(ins) + out + kernel_scratch(d, i, ins, out))
        if d.n_partials > 1:
            worst = max(worst, 3 * out)
    return worst


def _uneven(n: int, c: int, shift: int) -> tuple[int, ...]:
    b = list(even_bounds(n, c))
    if c > 1 and b[1] - b[0] > 1:  # move one cut: blocks of three sizes
        b[1] -= 1 + shift % (b[1] - b[0] - 1) if b[1] - b[0] > 2 else 1
    return tuple(b)


@settings(max_examples=examples(120), deadline=None)
@given(st.data())
def test_op_need_equals_every_kernel_weighed(data: Any) -> None:
    outs, _ = data.draw(graphs("float32", max_dim=6, max_rank=3))
    for node in ej.Graph(outs).ops:
        if node.facts.leaf:
            continue
        sizes = label_sizes(node)
        counts = {lab: data.draw(st.integers(1, max(1, min(n, 4)))) for lab, n in sizes.items()}
        spec = JoinAggSpec.for_node(node, counts)
        if data.draw(st.booleans()):  # uneven cuts: more than one class of kernels per label
            shift = data.draw(st.integers(0, 5))
            spec = JoinAggSpec(spec.labels, tuple(_uneven(b[-1], len(b) - 1, shift) for b in spec.bounds))
        d = ej.decompose(node, spec)
        assert op_need(d) == _every_kernel(d), (node, spec)
