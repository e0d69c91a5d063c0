"""Cutting ops finer to fit a memory cap: the one finer-cut search of the optimizer and the
memory planner.

Both ask the same question of an op — which cut of it holds less at once (:func:`op_need`:
its largest kernel's input blocks, output block and scratch, or one aggregation step) — and
both answer it with the same step, :func:`finer_cuts`: the op's spec with one label's block
count doubled (at most its size, at most ``Settings.max_kernels`` kernels). On that step:

- the optimizer's :func:`fitting_specs` (which candidate specs of an op fit a device of ``cap``
  bytes) runs a beam of finer cuts until some hold at most ``Settings.kernel_share`` of the cap;
- the memory planner's :func:`finer_spec` (the next cut of an op whose task did not fit, used by
  :mod:`einjoin.compiler` after lowering) takes the one finer cut that lowers the need most, and
  :func:`element_spec` is its last resort.

>>> import einjoin as ej
>>> from einjoin.planner.fit import finer_spec, op_need
>>> z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
>>> d = ej.decompose(z.node)
>>> op_need(d), finer_spec(z.node, d.spec).counts()   # cutting the rows halves a and the output
(14336, {'m': 2, 'n': 1, 'k': 1})
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import decompose
from einjoin.decomp.footprint import op_need
from einjoin.decomp.spec import JoinAggSpec, label_sizes, output_labels
from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.settings import SETTINGS, Settings

__all__ = ["op_need", "least_need", "LEAST_NEED_RULES",
           "finer_cuts", "fitting_specs", "finer_spec", "element_spec", "element_cuts", "memory_cap",
           "device_memory", "MemoryLimit"]

MemoryLimit = Mapping[int, "int | None"]
"""Device id -> its memory cap in bytes (None: uncapped), as planners receive it."""


def device_memory(cluster: Cluster) -> dict[int, int | None]:
    """The memory limit the cluster's devices declare (``Device.memory``, None: uncapped)."""
    return {d.id: d.memory for d in cluster.devices}


def memory_cap(memory_limit: MemoryLimit) -> int | None:
    """The smallest cap of ``memory_limit`` (None: no device has one): plans are the same on
    every device, so they must fit the smallest."""
    caps = [c for c in memory_limit.values() if c is not None]
    return min(caps) if caps else None


def finer_cuts(node: Node, spec: JoinAggSpec, settings: Settings = SETTINGS
               ) -> list[tuple[str, JoinAggSpec]]:
    """(label, ``spec`` with that label's block count doubled) for every label with room for
    more blocks (at most its size) whose doubling stays within ``settings.max_kernels``, in the
    spec's label order: the one step both finer-cut searches take."""
    counts = spec.counts()
    out = []
    for lab, bounds in zip(spec.labels, spec.bounds):
        size, c = bounds[-1], counts[lab]
        if c < size and spec.num_kernels // c * min(size, 2 * c) <= settings.max_kernels:
            out.append((lab, JoinAggSpec.for_node(node, {**counts, lab: min(size, 2 * c)})))
    return out


_FITTING: dict[Hashable, list[JoinAggSpec]] = {}
_FITTING_SIZE = 4096  # entries (an op shape's fitting specs, a few dozen); cleared when full


def fitting_specs(node: Node, candidates: list[JoinAggSpec], cap: int,
                  settings: Settings = SETTINGS) -> list[JoinAggSpec]:
    """The specs of ``node`` for a device of ``cap`` bytes: those whose largest kernel
    (:func:`op_need`) holds at most ``settings.kernel_share`` of it — ``candidates`` first, then
    ever finer cuts (:func:`finer_cuts` of the specs that hold least, a beam of
    ``settings.fit_beam``, while the need still falls) until some fit and on to
    ``settings.finer_window`` times the fewest kernels that fit; the fitting ones up to that many
    kernels are kept. Failing that, those within the whole cap (coarsest first, the same window);
    failing that, the specs that hold least with the fewest kernels (the memory planner cuts
    further or reports the op).

    >>> import einjoin as ej
    >>> from einjoin.planner.candidates import candidate_specs
    >>> z = ej.input("a", (256, 256)) @ ej.input("b", (256, 256))   # float32: 256 KiB each
    >>> sorted({s.num_kernels for s in fitting_specs(z.node, candidate_specs(z.node, 2), 800_000)})
    [2, 4, 8]
    >>> sorted({s.num_kernels for s in fitting_specs(z.node, candidate_specs(z.node, 2), 300_000)})
    [8, 16, 32]

    The answer depends on the op and its inputs' shapes only, so it is kept for the process
    (a bounded memo): compiling again (the time objective's second plan, a model of more
    layers) does not weigh the same cuts again.
    """
    key = (node.op, node.shape, node.dtype, tuple((x.shape, x.dtype, x.facts.free) for x in node.inputs),
           tuple(candidates), cap, settings)
    found = _FITTING.get(key)
    if found is None:
        if len(_FITTING) >= _FITTING_SIZE:
            _FITTING.clear()
        found = _FITTING[key] = _fitting_specs(node, candidates, cap, settings)
    return list(found)


def _fitting_specs(node: Node, candidates: list[JoinAggSpec], cap: int, settings: Settings) -> list[JoinAggSpec]:
    budget = int(settings.kernel_share * cap)
    window = settings.finer_window
    need = {s: op_need(decompose(node, s)) for s in candidates}
    fewest = min((s.num_kernels for s, n in need.items() if n <= budget), default=None)
    # finer cuts: a beam of the specs that hold least, each with one label's count doubled,
    # until some fit, then on to the window (the cuts that line up with finer neighbours);
    # stop where cutting finer no longer lowers the need
    frontier = sorted(need, key=lambda s: (need[s], s.num_kernels))[:settings.fit_beam]
    while frontier:
        if fewest is not None and 2 * min(s.num_kernels for s in frontier) > window * fewest:
            break
        # a list, not a set: the order breaks ties, and must not follow string hashing
        finer = list(dict.fromkeys(d for s in frontier for _, d in finer_cuts(node, s, settings)
                                   if d not in need))
        if not finer:
            break  # no label has room for more blocks (or max_kernels is reached)
        least = min(need.values())
        need.update((d, op_need(decompose(node, d))) for d in finer)
        if fewest is None:
            fewest = min((d.num_kernels for d in finer if need[d] <= budget), default=None)
            if fewest is None and min(need[d] for d in finer) >= least:
                break
        frontier = sorted(finer, key=lambda d: (need[d], d.num_kernels))[:settings.fit_beam]
    for limit in (budget, cap):
        fit = [s for s, n in need.items() if n <= limit]
        if fit:
            fewest = min(s.num_kernels for s in fit)
            return [s for s in fit if s.num_kernels <= window * fewest]
    least = min(need.values())
    fewest = min(s.num_kernels for s, n in need.items() if n == least)
    return [s for s, n in need.items() if n == least and s.num_kernels == fewest]


def finer_spec(node: Node, spec: JoinAggSpec, settings: Settings = SETTINGS) -> JoinAggSpec | None:
    """The finer cut of ``node`` that lowers :func:`op_need` most (of :func:`finer_cuts`), an
    output label on ties (no new partial sums), then the largest label. Where no doubling helps
    (a local minimum of the need), the spec that holds least among those cutting every label
    whole or into single elements (at most ``settings.fit_leaps`` of them) and the kind's own
    extra cuts (:data:`LEAP_RULES`: a reshape's divisor cuts), if it holds less — it may cut some
    labels coarser; else None (also when every helpful cut exceeds ``settings.max_kernels``).
    The whole-or-element cuts are all tried when at most ``settings.fit_leaps`` of them stay within
    ``max_kernels`` (:func:`element_cuts`); beyond, the first that many in its order."""
    outs = set(output_labels(node))
    sizes = label_sizes(node)
    current = op_need(decompose(node, spec))
    best: tuple[tuple[int, bool, int], JoinAggSpec] | None = None
    for lab, js in finer_cuts(node, spec, settings):
        need = op_need(decompose(node, js))
        key = (need, lab not in outs, -sizes[lab])
        if need < current and (best is None or key < best[0]):
            best = (key, js)
    return _leap(node, current, settings) if best is None else best[1]


def _no_leaps(sizes: dict[str, int], limit: int) -> list[dict[str, int]]:
    return []


def _divisor_leaps(sizes: dict[str, int], limit: int) -> list[dict[str, int]]:
    # only a reshape's blocks straddle its input's rows: its need falls at counts dividing a dim
    tries: list[dict[str, int]] = []
    for lab, n in sizes.items():
        tries += [{lab: c} for c in range(2, n) if n % c == 0][:limit]
    return tries


LEAP_RULES: dict[type, Callable[[dict[str, int], int], list[dict[str, int]]]] = {
    Input: _no_leaps,
    Einsum: _no_leaps,
    Reshape: _divisor_leaps,
    Broadcast: _no_leaps,
    Select: _no_leaps,
    Concat: _no_leaps,
    Fill: _no_leaps,
    Gather: _no_leaps,
    ScatterAdd: _no_leaps,
    Cast: _no_leaps,
    Conv: _no_leaps,
    Pool: _no_leaps,
    TopK: _no_leaps,
    RotateHalf: _no_leaps,
    Attention: _no_leaps,
    AttentionGrad: _no_leaps,
    SparseEinsum: _no_leaps,
}
"""Per node kind, the extra cuts (label -> count) :func:`finer_spec` tries at a local minimum of
the need, given the labels' sizes and ``Settings.fit_leaps``."""


def element_cuts(node: Node, settings: Settings = SETTINGS) -> Iterator[dict[str, int]]:
    """The cuts of ``node`` taking each label (of size > 1) whole or into single elements, within
    ``settings.max_kernels`` kernels: the output labels first, larger labels first, each cut before
    it is kept whole — so the cuts into most kernels without partial results come first (the
    search stops after ``settings.fit_leaps`` of them). Cuts beyond ``max_kernels`` are pruned, not
    counted: under a small cap the fitting cut is often one of the few near that bound.

    >>> import einjoin as ej
    >>> z = ej.input("a", (4, 3)) @ ej.input("b", (3, 2))
    >>> [sorted(c.items()) for c in element_cuts(z.node)][:3]
    [[('k', 3), ('m', 4), ('n', 2)], [('m', 4), ('n', 2)], [('k', 3), ('m', 4)]]
    """
    outs = set(output_labels(node))
    sizes = sorted(((lab, n) for lab, n in label_sizes(node).items() if n > 1),
                   key=lambda ln: (ln[0] not in outs, -ln[1]))  # stable: the spec's order on ties

    def walk(i: int, kernels: int, cut: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(sizes):
            yield dict(cut)
            return
        lab, n = sizes[i]
        if kernels * n <= settings.max_kernels:
            cut[lab] = n
            yield from walk(i + 1, kernels * n, cut)
            del cut[lab]
        yield from walk(i + 1, kernels, cut)

    return walk(0, 1, {})


def _leap(node: Node, current: int, settings: Settings) -> JoinAggSpec | None:
    # labels of size 1 have one cut only
    sizes = {lab: n for lab, n in label_sizes(node).items() if n > 1}
    tries = list(itertools.islice(element_cuts(node, settings), settings.fit_leaps))
    tries += rule_for(LEAP_RULES, node.op, "finer-cut leap rules")(sizes, settings.fit_leaps)
    found: tuple[tuple[int, int], JoinAggSpec] | None = None
    for counts in tries:
        if math.prod(counts.values()) > settings.max_kernels:
            continue
        js = JoinAggSpec.for_node(node, counts)
        key = (op_need(decompose(node, js)), js.num_kernels)
        if key[0] < current and (found is None or key < found[0]):
            found = (key, js)
    return None if found is None else found[1]


def element_spec(node: Node, spec: JoinAggSpec, settings: Settings = SETTINGS) -> JoinAggSpec | None:
    """Every label of ``node`` cut into single elements — the last resort when a buffer the op
    assembles from straddling blocks does not fit and no cut lowers the op's own need; None if
    ``spec`` is that already or it would exceed ``settings.max_kernels`` kernels."""
    sizes = label_sizes(node)
    if math.prod(sizes.values()) > settings.max_kernels or spec.counts() == sizes:
        return None
    return JoinAggSpec.for_node(node, dict(sizes))


def _one_of_each(node: Node) -> int:
    # every kernel writes an output block and reads a block of each input (a fill is computed
    # where read; one node read in two slots is one value; an empty input's block holds nothing)
    reads = {x for x in node.inputs if not x.facts.free and x.size}
    return itemsize(node.dtype) + sum(itemsize(x.dtype) for x in reads)


def _output_only(node: Node) -> int:
    # a kernel may read nothing of some input (a concat's block beside it; a gather's or a
    # scatter's rows), or the kind has no inputs (a load, a fill): its output block at least
    return itemsize(node.dtype)


LEAST_NEED_RULES: dict[type, Callable[[Node], int]] = {
    Input: _output_only,
    Einsum: _one_of_each,
    Reshape: _one_of_each,
    Broadcast: _one_of_each,
    Select: _one_of_each,
    Concat: _output_only,
    Fill: _output_only,
    Gather: _output_only,
    ScatterAdd: _output_only,
    Cast: _one_of_each,
    Conv: _one_of_each,
    Pool: _one_of_each,
    TopK: _one_of_each,
    RotateHalf: _one_of_each,
    Attention: _one_of_each,
    AttentionGrad: _one_of_each,
    SparseEinsum: _one_of_each,
}
"""Per node kind, a lower bound of what any one of its tasks holds under any cut
(:func:`least_need`)."""


def least_need(node: Node) -> int:
    """Bytes that one task of ``node`` holds at least, however finely it is cut: one element of
    its output block and of every block it must read (no scratch). A device whose cap is below
    it cannot run the op at all, so the compiler refuses before planning instead of cutting down
    to single elements first (0 for an empty tensor: it holds nothing).

    >>> import einjoin as ej
    >>> least_need((ej.input("a", (64, 64)) + ej.input("b", (64, 64))).node)   # 3 float32 elements
    12
    """
    if node.size == 0:
        return 0
    return rule_for(LEAST_NEED_RULES, node.op, "least-need rules")(node)
