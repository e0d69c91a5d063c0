"""Finer decompositions for a memory cap: when one task alone does not fit its device, cut a
label of the op that sized its blocks into more blocks — the label whose cut shrinks that op's
largest kernel (inputs, output and scratch held at once) or aggregation the most.

>>> import einjoin as ej
>>> from einjoin.memplan.fit import finer_spec, op_need
>>> z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
>>> d = ej.decompose(z.node)
>>> op_need(d), finer_spec(z.node, d.spec).counts()   # cutting the rows halves a and the output
(14336, {'m': 2, 'n': 1, 'k': 1})
"""

from __future__ import annotations

import itertools
import math

from einjoin.decomp.decompose import decompose
from einjoin.decomp.footprint import MAX_KERNELS, op_need
from einjoin.decomp.spec import JoinAggSpec, label_sizes, output_labels
from einjoin.ir.node import Node, Reshape

__all__ = ["op_need", "finer_spec", "element_spec", "MAX_KERNELS"]


def finer_spec(node: Node, spec: JoinAggSpec) -> JoinAggSpec | None:
    """``spec`` with one label's block count doubled (at most its size): the cut that lowers
    :func:`op_need` most, an output label on ties (no new partial sums). Where no doubling helps
    (a local minimum of the need), the spec that holds least among those cutting every label
    whole or into single elements (at most 64 of them) or, for a reshape, one label into a divisor
    of its size, if it holds less — it may cut some labels coarser; else None (also
    when every helpful cut would exceed :data:`MAX_KERNELS`)."""
    counts = spec.counts()
    outs = set(output_labels(node))
    current = op_need(decompose(node, spec))
    best: tuple[tuple[int, bool, int], JoinAggSpec] | None = None
    for lab, bounds in zip(spec.labels, spec.bounds):
        size = bounds[-1]
        if counts[lab] >= size:
            continue
        js = JoinAggSpec.for_node(node, {**counts, lab: min(size, 2 * counts[lab])})
        if js.num_kernels > MAX_KERNELS:
            continue
        need = op_need(decompose(node, js))
        key = (need, lab not in outs, -size)
        if need < current and (best is None or key < best[0]):
            best = (key, js)
    return _leap(node, current) if best is None else best[1]


def _leap(node: Node, current: int) -> JoinAggSpec | None:
    # labels of size 1 have one cut only; a reshape's need falls at counts that divide its dims
    sizes = {lab: n for lab, n in label_sizes(node).items() if n > 1}
    tries: list[dict[str, int]] = []
    for cut in itertools.islice(itertools.product((False, True), repeat=len(sizes)), _LEAPS):
        tries.append({lab: (n if c else 1) for (lab, n), c in zip(sizes.items(), cut)})
    if isinstance(node.op, Reshape):  # only a reshape's blocks straddle its input's rows
        for lab, n in sizes.items():
            tries += [{lab: c} for c in range(2, n) if n % c == 0][:_LEAPS]
    found: tuple[tuple[int, int], JoinAggSpec] | None = None
    for counts in tries:
        if math.prod(counts.values()) > MAX_KERNELS:
            continue
        js = JoinAggSpec.for_node(node, counts)
        key = (op_need(decompose(node, js)), js.num_kernels)
        if key[0] < current and (found is None or key < found[0]):
            found = (key, js)
    return None if found is None else found[1]


_LEAPS = 64  # whole-or-element cuts tried at most (2^labels grows fast), and divisors per label


def element_spec(node: Node, spec: JoinAggSpec) -> JoinAggSpec | None:
    """Every label of ``node`` cut into single elements — the last resort when a buffer the op
    assembles from straddling blocks does not fit and no cut lowers the op's own need; None if
    ``spec`` is that already or it would exceed :data:`MAX_KERNELS` kernels."""
    sizes = label_sizes(node)
    if math.prod(sizes.values()) > MAX_KERNELS or spec.counts() == sizes:
        return None
    return JoinAggSpec.for_node(node, dict(sizes))
