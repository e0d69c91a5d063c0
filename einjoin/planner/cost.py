"""The cost model — the one the planners optimise: bytes a plan moves, as pure functions of
shapes and specs (and, for the exact repartition cost, of a placement given as data), and
:class:`CostModel`, the same pieces memoised per (node, spec) for the searches, with
:func:`total_cost`, the figure every planner is judged by:

    total = sum over ops of join(J_v) + agg(J_v)
          + sum over edges u -> v of repart(out partition of u -> what J_v needs of u)

where graph inputs are loaded in the partition their first consumer needs (later consumers pay a
repartition), fills cost nothing, and replicas of one tensor in one partition are paid once.

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
import math
from collections import Counter
from dataclasses import dataclass
from typing import cast
from collections.abc import Callable, Mapping

import numpy as np

from einjoin.cluster import Cluster, LinkMatrix
from einjoin.decomp.decompose import Decomposition, decompose
from einjoin.decomp.partition import BlockKey, Partition, box_size, intersect
from einjoin.decomp.spec import JoinAggSpec
from einjoin.ir.dtypes import itemsize
from einjoin.ir.graph import Graph
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf

__all__ = ["join_cost", "join_cost_per_input", "agg_cost", "repartition_cost", "repartition_estimate",
           "op_cost", "SpecInfo", "CostModel", "total_cost", "model_cost", "input_partitions",
           "INFO_RULES", "WEIGHT_RULES", "GraphEdges", "TimeWeights", "time_weights", "OBJECTIVES"]


def join_cost(d: Decomposition) -> int:
    """Bytes of input replicas beyond the one loaded copy: sum over input blocks of
    |block| * (kernels reading it - 1). Fills are computed where needed and cost nothing."""
    return sum(join_cost_per_input(d))


def join_cost_per_input(d: Decomposition) -> tuple[int, ...]:
    """:func:`join_cost` split by input slot. Input boxes that overlap (a :class:`Covering`: a
    spatially cut conv's halo) add the elements they share: the tensor is loaded in its
    ``core`` partition, and the halo moves."""
    out = []
    for slot, (x, part) in enumerate(zip(d.node.inputs, d.in_partitions)):
        total = 0
        if not x.facts.free:
            readers = Counter(key for k in d.kernels if (key := k.in_keys[slot]) is not None)
            size = itemsize(x.dtype)
            for key, r in readers.items():
                total += _elems(part.block_shape(key)) * size * (r - 1)
            # a conv's halo: the rows neighbouring boxes share travel beyond the loaded copy
            total += part.overlap() * size
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
                     producer_devices: Mapping[BlockKey, int] | None = None,
                     consumer_devices: Mapping[BlockKey, int] | None = None
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
    return _moved_elems(producer.bounds, consumer.bounds) * itemsize(dtype)


def _moved_elems(have: tuple[tuple[int, ...], ...], need: tuple[tuple[int, ...], ...]) -> int:
    """:func:`repartition_estimate` in elements, from the two partitions' boundaries."""
    n = 1
    for cb in need:
        n *= cb[-1]
    if n == 0 or have == need:  # an empty tensor moves nothing
        return 0
    kept = 1
    for pb, cb in zip(have, need):
        kept *= _kept_along(pb, cb)
    return n - kept


_KEPT: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
_KEPT_MAX = 1 << 16  # entries kept before the memo starts afresh (a few MB at most)


def _kept_along(pb: tuple[int, ...], cb: tuple[int, ...]) -> int:
    """The 1-D factor of :func:`repartition_estimate`: the sum over the consumer's blocks along
    one dim of its largest overlap with a producer block. Memoised on the two boundary tuples
    (plain data): the searches ask for ~10^5 pairs of partitions that share a few hundred
    distinct dims, so the pairs cost a product of lookups."""
    key = (pb, cb)
    found = _KEPT.get(key)
    if found is not None:
        return found
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
    if len(_KEPT) >= _KEPT_MAX:
        _KEPT.clear()
    _KEPT[key] = dim_sum
    return dim_sum


def _dim_groups(parts: list[tuple[tuple[int, ...], ...]]) -> list[tuple[list[tuple[int, ...]], np.ndarray]]:
    """Per dim of partitions of one tensor (their boundaries): the distinct boundary tuples,
    and for each partition the index of its own among them."""
    out = []
    for d in range(len(parts[0]) if parts else 0):
        index: dict[tuple[int, ...], int] = {}
        col = np.array([index.setdefault(b[d], len(index)) for b in parts], dtype=np.intp)
        out.append((list(index), col))
    return out


def op_cost(d: Decomposition) -> int:
    """Join plus aggregation bytes of one op under its spec (no repartitioning)."""
    return join_cost(d) + agg_cost(d)


# --------------------------------------------------------------------------------------------
# the memoised model the searches use


@dataclass(frozen=True)
class SpecInfo:
    """What the cost model needs of (node, spec)."""

    spec: JoinAggSpec
    out: Partition
    ins: tuple[Partition, ...]
    op_bytes: int  # join + aggregation
    agg_bytes: int
    join_in: tuple[int, ...]  # replica bytes per input slot
    out_id: int = -1  # interned partition ids: memo keys that hash fast
    in_ids: tuple[int, ...] = ()


# (out partition, input partitions, aggregation bytes, replica bytes per input slot)
_Pieces = tuple[Partition, tuple[Partition, ...], int, tuple[int, ...]]


def _einsum_pieces(node: Node, spec: JoinAggSpec) -> _Pieces:
    """An einsum's pieces straight from its labels (no decomposition: the searches' hot path);
    equal to :func:`_decomposed_pieces`."""
    op = cast(Einsum, node.op)  # the table dispatched on the kind
    out = _partition(spec, op.out_labels)
    ins = tuple(_partition(spec, ls) for ls in op.in_labels)
    counts = spec.counts()
    joins = []
    for x, ls in zip(node.inputs, op.in_labels):
        r = math.prod(c for lab, c in counts.items() if lab not in ls)
        joins.append(0 if x.facts.free else x.size * itemsize(x.dtype) * (r - 1))
    n_agg = math.prod(counts[lab] for lab in op.agg_labels)
    agg = node.size * itemsize(partial_dtype(node)) * (n_agg - 1)  # as agg_cost
    return out, ins, agg, tuple(joins)


_PARTS: dict[tuple[tuple[int, ...], ...], Partition] = {}


def _partition(spec: JoinAggSpec, labels: str | tuple[str, ...]) -> Partition:
    """``spec.partition(labels)``, one object per boundaries (plain data, memoised): a spec's
    bounds are checked once, and equal partitions compare by identity in the searches' memos."""
    bounds = tuple(spec[lab] for lab in labels)
    found = _PARTS.get(bounds)
    if found is None:
        if len(_PARTS) >= _KEPT_MAX:
            _PARTS.clear()
        found = _PARTS[bounds] = Partition(bounds)
    return found


_DECOMPOSED: dict[tuple[object, ...], _Pieces] = {}


def _decomposed_pieces(node: Node, spec: JoinAggSpec) -> _Pieces:
    # memoised on plain data (the op, the shapes, dtypes and fill-ness around it, the spec): a
    # reshape's decomposition is the slow part of a small graph's candidates, and plans of the
    # same layers for other device counts, or again for a compile, ask for the same ones
    key = (node.op, node.shape, node.dtype, tuple((x.shape, x.dtype, x.facts.free) for x in node.inputs), spec)
    found = _DECOMPOSED.get(key)
    if found is None:
        # an input read in overlapping boxes (a conv's halo) is needed in its core partition, the
        # halo being counted in its join bytes
        d = decompose(node, spec)
        if len(_DECOMPOSED) >= _KEPT_MAX:
            _DECOMPOSED.clear()
        found = _DECOMPOSED[key] = (d.out_partition, tuple(p.core for p in d.in_partitions), agg_cost(d),
                                    join_cost_per_input(d))
    return found


INFO_RULES: dict[type, Callable[[Node, JoinAggSpec], _Pieces]] = {
    Input: _decomposed_pieces,
    Einsum: _einsum_pieces,
    Reshape: _decomposed_pieces,
    Broadcast: _decomposed_pieces,
    Select: _decomposed_pieces,
    Concat: _decomposed_pieces,
    Fill: _decomposed_pieces,
    Gather: _decomposed_pieces,
    ScatterAdd: _decomposed_pieces,
    Cast: _decomposed_pieces,
    Conv: _decomposed_pieces,
    Pool: _decomposed_pieces,
    TopK: _decomposed_pieces,
    RotateHalf: _decomposed_pieces,
    Attention: _decomposed_pieces,
    AttentionGrad: _decomposed_pieces,
    SparseEinsum: _decomposed_pieces,
}
"""Per node kind, how the cost model reads (node, spec): an einsum from its labels, every other
kind from its decomposition."""


def _grid_weighed(w: TimeWeights, node: Node, spec: JoinAggSpec, agg: int, join_in: tuple[int, ...]
                  ) -> tuple[int, tuple[int, ...]]:
    """An einsum's copies by its kernel grid (its labels): where each copy goes."""
    op = cast(Einsum, node.op)
    out_bytes = node.size * itemsize(partial_dtype(node))
    counts = tuple(len(b) - 1 for b in spec.bounds)
    if agg:
        agg = w.grid(out_bytes, counts, tuple(lab in op.out_labels for lab in spec.labels))
    joins = []
    for x, ls, j in zip(node.inputs, op.in_labels, join_in):
        joins.append(w.grid(x.size * itemsize(x.dtype), counts, tuple(lab in ls for lab in spec.labels))
                     if j else j)
    return agg, tuple(joins)


def _count_weighed(w: TimeWeights, node: Node, spec: JoinAggSpec, agg: int, join_in: tuple[int, ...]
                   ) -> tuple[int, tuple[int, ...]]:
    """Any other kind's copies by count: the partials per output block and the readers per input
    element, from the bytes (join = |X| (r - 1), agg = |Z| (n - 1))."""
    out_bytes = node.size * itemsize(partial_dtype(node))
    if agg and out_bytes:
        agg = w.copies(out_bytes, 1 + agg / out_bytes)
    joins = []
    for x, j in zip(node.inputs, join_in):
        size = x.size * itemsize(x.dtype)
        joins.append(w.copies(size, 1 + j / size) if j and size else j)
    return agg, tuple(joins)


_Weighed = Callable[["TimeWeights", Node, JoinAggSpec, int, tuple[int, ...]], tuple[int, tuple[int, ...]]]
WEIGHT_RULES: dict[type, _Weighed] = {
    Input: _count_weighed,
    Einsum: _grid_weighed,
    Reshape: _count_weighed,
    Broadcast: _count_weighed,
    Select: _count_weighed,
    Concat: _count_weighed,
    Fill: _count_weighed,
    Gather: _count_weighed,
    ScatterAdd: _count_weighed,
    Cast: _count_weighed,
    Conv: _count_weighed,
    Pool: _count_weighed,
    TopK: _count_weighed,
    RotateHalf: _count_weighed,
    Attention: _count_weighed,
    AttentionGrad: _count_weighed,
    SparseEinsum: _count_weighed,
}
"""Per node kind, how ``objective="time"`` weighs its replica and partial bytes by the links they
cross (:class:`TimeWeights`): an einsum by its kernel grid, every other kind by count."""


OBJECTIVES = ("bytes", "time")


@dataclass(frozen=True)
class TimeWeights:
    """How ``objective="time"`` weighs bytes: the costs stay integers, in bytes at the fast
    link's speed (modelled time times the fast bandwidth), so the searches and the ILP run
    unchanged. ``groups[d]`` is device ``d``'s island or node; a byte crossing between groups
    costs ``ratio`` (fast / slow bandwidth) times one inside a group.

    - an einsum's replicas and partial sums (:meth:`grid`): its kernels are taken to run in
      their grid order on consecutive devices (kernel ``i`` of ``K`` on device ``i * P // K``,
      as the placers lay out an op whose inputs are not placed yet); a block's copies to
      readers, or its partials, in groups other than the one holding most of them cross;
    - other kinds' replicas and partials (:meth:`copies`): up to a group's size of them stay
      inside it, the rest cross;
    - a placement-free repartition: its moved bytes go between two devices picked evenly,
      crossing with probability ``(P - group) / (P - 1)`` (:attr:`repart`).

    >>> w = TimeWeights(groups=(0,) * 8 + (1,) * 8, ratio=12.0)
    >>> w.copies(100, 8), w.copies(100, 16)   # 7 copies inside a node; 8 more across the network
    (700, 10300)
    >>> w.grid(100, (16,), (False,))            # 16 partials of one block, 8 on the other node
    10300
    >>> w.grid(100, (2, 8), (True, False))      # 2 blocks of 50 bytes, 8 partials each on one node
    700
    """

    groups: tuple[int, ...]
    ratio: float

    @property
    def p(self) -> int:
        return len(self.groups)

    @property
    def group(self) -> int:
        return min(Counter(self.groups).values())

    @property
    def repart(self) -> float:
        if self.p <= 1:
            return 1.0
        return 1.0 + (self.ratio - 1.0) * max(0, self.p - self.group) / (self.p - 1)

    def copies(self, nbytes: int, r: float) -> int:
        """Weighted bytes of ``r - 1`` extra copies of ``nbytes`` (``r`` readers or partials)."""
        if r <= 1:
            return 0
        across = max(0.0, r - self.group)
        return int(round(nbytes * ((r - 1 - across) + across * self.ratio)))

    def grid(self, nbytes: int, counts: tuple[int, ...], kept: tuple[bool, ...]) -> int:
        """Weighted bytes of the extra copies of a tensor of ``nbytes`` cut along the grid labels
        with ``kept`` (its blocks), read (or summed) by every kernel of the grid ``counts``:
        per block, the kernels beyond the first, those outside the group holding most of them
        at ``ratio``. Memoised: a few hundred grids per graph (per weights: the answer depends
        on the groups and the ratio, and one process plans for several clusters)."""
        key = (self, nbytes, counts, kept)
        found = _GRID.get(key)
        if found is None:
            found = _GRID[key] = self._grid(nbytes, counts, kept)
            if len(_GRID) >= _KEPT_MAX:
                _GRID.clear()
        return found

    def _grid(self, nbytes: int, counts: tuple[int, ...], kept: tuple[bool, ...]) -> int:
        k = math.prod(counts)
        if k <= 1:
            return 0
        node = np.asarray(self.groups)[(np.arange(k) * self.p // k) if k >= self.p else np.arange(k)]
        grid = node.reshape(counts)
        own = [a for a, keep in enumerate(kept) if keep]
        rest = [a for a, keep in enumerate(kept) if not keep]
        rows = grid.transpose(own + rest).reshape(math.prod(counts[a] for a in own), -1)
        r = rows.shape[1]
        if r <= 1:
            return 0
        block = nbytes / rows.shape[0]
        total = 0.0
        for row in rows:
            most = np.unique(row, return_counts=True)[1].max()
            total += block * ((most - 1) + (r - most) * self.ratio)
        return int(round(total))


_GRID: dict[tuple[object, ...], int] = {}


def time_weights(cluster: Cluster) -> TimeWeights:
    """The :class:`TimeWeights` of ``cluster``'s links: its groups (a preset's nodes, the
    islands of ``Cluster.islands``) and the ratio of the fast links' bandwidth to the slow
    ones'. A cluster whose links are one speed gets ratio 1 (time is bytes).

    >>> import einjoin as ej
    >>> w = time_weights(ej.Cluster.nodes(2))
    >>> w.group, w.ratio
    (8, 12.0)
    """
    bw = cluster.bandwidth
    if isinstance(bw, LinkMatrix):
        if len(set(bw.groups)) > 1 and bw.inter > 0 and bw.intra > bw.inter:
            ids = {g: i for i, g in enumerate(dict.fromkeys(bw.groups))}
            return TimeWeights(tuple(ids[g] for g in bw.groups), bw.intra / bw.inter)
    return TimeWeights((0,) * cluster.size, 1.0)


class CostModel:
    """Memoised cost pieces for one graph on ``p`` devices: per (node, spec) a :class:`SpecInfo`,
    per pair of partitions the placement-free repartition bytes. With ``weights``
    (``objective="time"``, :class:`TimeWeights`), every piece is weighed by the links it is
    modelled to cross.

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
    >>> info = CostModel(ej.Graph(z), 2).info(z.node, ej.decompose(z.node, {"k": 2}).spec)
    >>> info.agg_bytes, info.join_in     # one 64x16 float32 partial travels; nothing replicated
    (4096, (0, 0))
    """

    def __init__(self, graph: Graph, p: int, weights: TimeWeights | None = None):
        self.graph = graph
        self.p = p
        self.weights = weights
        self._info: dict[tuple[Node, JoinAggSpec], SpecInfo] = {}
        self._repart: dict[tuple[int, int], int] = {}
        self._repart_bytes: dict[tuple[int, int, str], int] = {}
        self._pid: dict[Partition, int] = {}
        self._parts: list[Partition] = []
        self._dims: dict[tuple[int, ...], list[tuple[list[tuple[int, ...]], np.ndarray]]] = {}

    def pid(self, part: Partition) -> int:
        """An interned id for a partition (hashing nested tuples on every lookup is slow)."""
        i = self._pid.get(part)
        if i is None:
            i = self._pid[part] = len(self._parts)
            self._parts.append(part)
        return i

    def info(self, node: Node, spec: JoinAggSpec) -> SpecInfo:
        """The cost pieces of ``node`` under ``spec`` (memoised)."""
        key = (node, spec)
        found = self._info.get(key)
        if found is None:
            out, ins, agg, join_in = rule_for(INFO_RULES, node.op, "cost model rules")(node, spec)
            if self.weights is not None:
                agg, join_in = self._weighed(node, spec, agg, join_in)
            found = self._info[key] = SpecInfo(spec, out, ins, sum(join_in) + agg, agg, join_in,
                                               self.pid(out), tuple(self.pid(p) for p in ins))
        return found

    def _weighed(self, node: Node, spec: JoinAggSpec, agg: int, join_in: tuple[int, ...]
                 ) -> tuple[int, tuple[int, ...]]:
        w = self.weights
        assert w is not None
        if w.ratio == 1.0:
            return agg, join_in
        return rule_for(WEIGHT_RULES, node.op, "time-weight rules")(w, node, spec, agg, join_in)

    def repart_from(self, qs: tuple[int, ...], r: int, dtype: str) -> np.ndarray:
        """:meth:`repart_ids` from each of the interned partitions ``qs`` (of one tensor) to
        ``r``, as int64: per dim, each distinct boundary tuple among ``qs`` is measured once (a
        tensor's candidates cut each dim in a few ways), and the 1-D sums multiply per ``q``."""
        dims = self._dims.get(qs)
        if dims is None:
            dims = self._dims[qs] = _dim_groups([self._parts[q].bounds for q in qs])
        need = self._parts[r].bounds
        n = 1
        for cb in need:
            n *= cb[-1]
        if n == 0:  # an empty tensor moves nothing
            return np.zeros(len(qs), dtype=np.int64)
        kept = np.ones(len(qs), dtype=np.int64)
        for cb, (distinct, col) in zip(need, dims):
            kept *= np.array([_kept_along(pb, cb) for pb in distinct], dtype=np.int64)[col]
        moved = (n - kept) * itemsize(dtype)
        if self.weights is not None and self.weights.ratio != 1.0:
            weighed: np.ndarray = np.rint(moved * self.weights.repart).astype(np.int64)
            return weighed
        return moved

    def repart(self, q: Partition, r: Partition, dtype: str) -> int:
        """Placement-free bytes to turn partition ``q`` of a ``dtype`` tensor into ``r``."""
        return self.repart_ids(self.pid(q), self.pid(r), dtype)

    def repart_ids(self, q: int, r: int, dtype: str) -> int:
        """:meth:`repart` for interned partition ids."""
        got = self._repart_bytes.get((q, r, dtype))  # the searches ask ~10^5 times per graph
        if got is not None:
            return got
        key = (q, r)
        found = self._repart.get(key)
        if found is None:
            # cached in elements: the same pair of partitions serves every dtype
            found = self._repart[key] = _moved_elems(self._parts[q].bounds, self._parts[r].bounds)
        got = found * itemsize(dtype)
        if self.weights is not None and self.weights.ratio != 1.0:
            got = int(np.rint(got * self.weights.repart))
        self._repart_bytes[(q, r, dtype)] = got
        return got


@dataclass(frozen=True)
class GraphEdges:
    """The graph's structure as :func:`total_cost` accounts it, computed once per search (the
    searches' local moves re-cost every candidate of every op, many times): each graph input's
    first consumer (it loads the input as it needs it), the edges each op pays a repartition on
    (not fills, not an input's first use), each tensor's readers (its replicas are paid once per
    partition), each op's distinct non-fill inputs, and the ops whose in-edges an op's spec
    changes (its consumers, and the other consumers of inputs it loads).

    >>> import einjoin as ej
    >>> x = ej.input("x", (4, 4)); y = ej.input("w", (4, 4)) @ x; z = y + x
    >>> e = GraphEdges.of(ej.Graph(z))
    >>> e.edges[y.node], [slot for slot, _ in e.edges[z.node]]  # x's second use pays, and y
    ((), [0, 1])
    """

    first: dict[Node, tuple[Node, int]]  # a graph input -> (first consumer, its slot)
    edges: dict[Node, tuple[tuple[int, Node], ...]]  # op -> the (slot, input) edges it pays
    reads: dict[Node, tuple[tuple[Node, int], ...]]  # tensor -> its (reader, slot) pairs
    inputs: dict[Node, tuple[Node, ...]]  # op -> its distinct inputs that are not fills
    touched: dict[Node, tuple[Node, ...]]  # op -> ops whose in-edges its spec changes

    @staticmethod
    def of(graph: Graph) -> GraphEdges:
        first = {u: (graph.users[u][0], graph.users[u][0].inputs.index(u))
                 for u in graph.nodes if u.facts.fed and graph.users[u]}
        edges, reads, inputs, touched = {}, {}, {}, {}
        for w in graph.ops:
            # a fill is computed in place; an input is loaded as its first use needs
            edges[w] = tuple((slot, u) for slot, u in enumerate(w.inputs)
                             if not (u.facts.free or first.get(u) == (w, slot)))
            inputs[w] = tuple(dict.fromkeys(u for u in w.inputs if not u.facts.free))
            near = dict.fromkeys(graph.users[w])
            for u in w.inputs:
                if u in first and first[u][0] is w:
                    near.update(dict.fromkeys(x for x in graph.users[u] if x is not w))
            touched[w] = tuple(near)
        for u in graph.nodes:
            reads[u] = tuple(dict.fromkeys((w, slot) for w in graph.users[u]
                                           for slot, x in enumerate(w.inputs) if x is u))
        return GraphEdges(first, edges, reads, inputs, touched)


def input_partitions(graph: Graph, chosen: Mapping[Node, SpecInfo]) -> dict[Node, Partition]:
    """Each graph input is loaded as its first consumer needs it."""
    out: dict[Node, Partition] = {}
    for x in graph.inputs:
        for c in graph.users[x]:
            out[x] = chosen[c].ins[c.inputs.index(x)]
            break
    return out


def total_cost(graph: Graph, model: CostModel, chosen: Mapping[Node, SpecInfo]) -> int:
    """The model's bytes for a complete choice of specs. Replicas of one tensor in one partition
    are counted once however many ops read them (the exchange moves a region to a device once)."""
    loaded = input_partitions(graph, chosen)
    total = 0
    replicas: dict[tuple[Node, Partition, int], None] = {}
    for v in graph.ops:
        if v.facts.free:
            continue
        info = chosen[v]
        total += info.agg_bytes
        for u, need, join in zip(v.inputs, info.ins, info.join_in):
            if u.facts.free:
                continue
            have = loaded[u] if u.facts.fed else chosen[u].out
            total += model.repart(have, need, u.dtype)
            if join:
                replicas[(u, need, join)] = None
    return total + sum(j for _, _, j in replicas)


def model_cost(graph: Graph, cluster: Cluster, specs: Mapping[Node, JoinAggSpec]) -> int:
    """The model's bytes for given specs (e.g. a planner's output), the figure planners are
    judged by."""
    model = CostModel(graph, cluster.size)
    chosen = {n: model.info(n, specs[n]) for n in graph.ops if not n.facts.free}
    return total_cost(graph, model, chosen)
