"""Named baseline planners: ``data_parallel``, ``zero``, ``megatron`` and ``mesh_ilp``.

All four have the planner signature (:class:`einjoin.planner.Planner`: ``planner(graph, cluster,
*, memory_limit) -> dict[Node, JoinAggSpec]``; they do not plan for memory, the memory planner fits
their plans later) and give every node a spec (fills one block, they are computed where needed; graph inputs the
partition their first consumer needs, via :func:`einjoin.planner.derive_input_specs`). A planner
that does not apply to a graph raises :class:`NotApplicable` saying why; callers print "n/a".

- ``data_parallel``: the batch dims of the activation inputs (dim 0 of every input that is not an
  ``ej.param``; for a graph without params, dim 0 of its first input only) are followed through
  the graph; every op that keeps a batch label splits it P ways, an op that contracts it (a
  parameter's gradient in a training graph) cuts it into P partial sums (the all-reduce is the
  exchange's), every other op runs in one block.
- ``zero``: ZeRO-style data parallelism: as ``data_parallel``, with every parameter and every
  parameter's gradient cut along its largest dim into P blocks (the forward gathers them).
- ``megatron``: column- then row-parallel contraction pairs with parameters (MLPs) and head
  parallel attention, found structurally; the split label is cut P ways along the whole chain,
  every other op cuts its largest output label P ways (as ``split_largest`` does).
- ``mesh_ilp``: Alpa's intra-operator ILP: for every 1-D and 2-D device mesh that factors P,
  each op picks a mapping of mesh axes to its labels, minimising op bytes plus repartition bytes
  exactly as :func:`einjoin.planner.cost.total_cost` counts them (``scipy.optimize.milp``, HiGHS);
  the best mesh wins.

>>> import einjoin as ej
>>> from einjoin.planner.baselines import data_parallel, mesh_ilp
>>> z = ej.input("x", (64, 32)) @ ej.input("w", (32, 16))
>>> print(data_parallel(ej.Graph(z), ej.local(4))[z.node])
{m: 4, n: 1, k: 1}
>>> z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
>>> print(mesh_ilp(ej.Graph(z), ej.local(8))[z.node])   # 2 x 4 mesh: no 3-D split (2, 2, 2)
{m: 2, n: 1, k: 4}
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, cast
from collections.abc import Callable

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import reshape_groups
from einjoin.decomp.partition import even_bounds
from einjoin.decomp.spec import ROW, JoinAggSpec, aggregated_labels, dim_labels, label_sizes, output_labels
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.planner.basic import derive_input_specs, largest_output_cut
from einjoin.planner.candidates import candidate_specs
from einjoin.planner.cost import CostModel, SpecInfo, total_cost
from einjoin.planner.fit import MemoryLimit
from einjoin.planner.ilp import choose
from einjoin.settings import SETTINGS, Settings

__all__ = ["NotApplicable", "data_parallel", "megatron", "mesh_ilp", "mesh_shapes", "zero",
           "mesh_strategies", "batch_dims", "contracted_batch", "parameter_gradients",
           "BATCH_DIM_RULES", "FOLLOW_RULES"]


class NotApplicable(EinjoinError):
    """A baseline planner cannot plan this graph on this cluster (the message says why)."""


def _finish(graph: Graph, specs: dict[Node, JoinAggSpec]) -> dict[Node, JoinAggSpec]:
    """Fills one block (computed where needed), inputs as their first consumer needs them."""
    for n in graph.ops:
        if n not in specs:
            specs[n] = JoinAggSpec.for_node(n, None)
    return derive_input_specs(graph, specs)


def _is_param(n: Node) -> bool:
    return n.facts.fed and cast(Input, n.op).param


def _lead(dims: list[int], shape: tuple[int, ...]) -> int | None:
    """The first dim of a row-major reshape group with size > 1 (where the group can be cut)."""
    return next((d for d in dims if shape[d] > 1), None)


# --------------------------------------------------------------------------------------------
# data parallelism


def batch_dims(graph: Graph) -> tuple[dict[Node, int | None], set[Node]]:
    """(node -> its batch dim or None, the activation-derived nodes).

    Activation inputs (``param=False``; in a graph without params only the first input) have
    batch dim 0. An einsum's batch label is one that is a batch dim of at least one
    activation-derived operand and appears in the output and in every activation-derived
    operand (the one that is a batch dim of the most operands, then the first in output order);
    a reshape keeps it when it is the lead dim of its row-major group (it becomes the lead of the
    output group); select, concat, broadcast, cast and gather keep its dim."""
    acts = [x for x in graph.inputs if not _is_param(x)] if graph.params else list(graph.inputs[:1])
    bdim: dict[Node, int | None] = {}
    derived: set[Node] = set()
    for x in acts:
        derived.add(x)
        bdim[x] = 0 if x.ndim else None
    for v in graph.ops:
        slots = [s for s, u in enumerate(v.inputs) if u in derived]
        if not slots:
            continue
        derived.add(v)
        bdim[v] = _batch_dim_of(v, slots, bdim)
    return bdim, derived


def _batch_dim_of(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    return rule_for(BATCH_DIM_RULES, v.op, "data-parallel batch-dim rules")(v, slots, bdim)


def _einsum_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    op = cast(Einsum, v.op)
    votes: dict[str, int] = defaultdict(int)
    for s in slots:
        d = bdim.get(v.inputs[s])
        if d is not None:
            votes[op.in_labels[s][d]] += 1
    # a scalar operand (a loss's 1 / count, fused into its gradient) broadcasts: no conflict
    ok = [lab for lab in op.out_labels if lab in votes
          and all(lab in op.in_labels[s] for s in slots if v.inputs[s].ndim)]
    if not ok:
        return None
    best = max(ok, key=lambda lab: votes[lab])  # max keeps the first among equals
    return op.out_labels.index(best)


def _reshape_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    d = bdim.get(v.inputs[0])
    if d is None:
        return None
    src, dst = v.inputs[0].shape, v.shape
    for ia, jb in reshape_groups(src, dst):
        if d in ia:
            return _lead(jb, dst) if _lead(ia, src) == d else None
    return None


def _same_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    return bdim.get(v.inputs[0])  # select, cast: dims stay where they are


def _concat_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    ds = {bdim.get(v.inputs[s]) for s in slots}
    return ds.pop() if len(ds) == 1 else None


def _broadcast_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    op = cast(Broadcast, v.op)
    x = v.inputs[0]
    d = bdim.get(x)
    if d is None or x.shape[d] != v.shape[op.dims[d]]:
        return None
    return op.dims[d]


def _gather_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    table, idx = v.inputs
    if 1 in slots and bdim.get(idx) is not None:
        return bdim[idx]
    d = bdim.get(table) if 0 in slots else None
    return None if not d else idx.ndim + d - 1  # the table's rows are no batch


def _scatter_add_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    updates, idx = v.inputs
    d = bdim.get(updates) if 0 in slots else None
    # a batch dim among the index dims is summed away (an embedding gradient: partial sums);
    # one in the row shape stays, after the output's rows
    return None if d is None or d < idx.ndim else d - idx.ndim + 1


def _window_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    # a conv's or pool's batch is its input's dim 0 and its output's (a weight has none)
    return 0 if 0 in slots and bdim.get(v.inputs[0]) == 0 else None


def _topk_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    d = bdim.get(v.inputs[0])
    return None if d is None or d == cast(TopK, v.op).axis else d  # the sorted dim is no batch


def _attention_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    # a batch dim of q, k, v (or the cotangent) stays the output's; the rows and features are no batch
    nb = v.inputs[0].ndim - 2
    for s in slots:
        d = bdim.get(v.inputs[s])
        if d is not None and d < nb and v.inputs[s].shape[d] == v.shape[d]:
            return d
    return None


def _no_batch(v: Node, slots: list[int], bdim: dict[Node, int | None]) -> int | None:
    return None  # a leaf reads nothing: it is never reached from an activation


BATCH_DIM_RULES: dict[type, Callable[[Node, list[int], dict[Node, int | None]], int | None]] = {
    Input: _no_batch,
    Einsum: _einsum_batch,
    Reshape: _reshape_batch,
    Broadcast: _broadcast_batch,
    Select: _same_batch,
    Concat: _concat_batch,
    Fill: _no_batch,
    Gather: _gather_batch,
    ScatterAdd: _scatter_add_batch,
    Cast: _same_batch,
    Conv: _window_batch,
    Pool: _window_batch,
    TopK: _topk_batch,
    RotateHalf: _topk_batch,  # its axis is no batch, as a sort's
    Attention: _attention_batch,
    AttentionGrad: _attention_batch,
    SparseEinsum: _no_batch,  # opaque: no batch dim passes through it
}
"""Per node kind, the batch dim of its output given its activation-derived input ``slots`` and
their batch dims (``data_parallel``; see :func:`batch_dims`)."""


def _einsum_input_label(v: Node, slot: int, d: int) -> str | None:
    return cast(Einsum, v.op).in_labels[slot][d]


def _gather_input_label(v: Node, slot: int, d: int) -> str | None:
    if slot == 1:  # the indices' dims are the output's leading dims
        return dim_labels(v.ndim)[d]
    return ROW if d == 0 else dim_labels(v.ndim)[v.inputs[1].ndim + d - 1]


def _scatter_add_input_label(v: Node, slot: int, d: int) -> str | None:
    return dim_labels(v.inputs[0].ndim)[d]  # updates and indices share the index labels a, b, ...


def _conv_input_label(v: Node, slot: int, d: int) -> str | None:
    # the input's dim 0 is n; the input channels (dim 1 of both) are c where c is a label
    # (groups 1): a weight gradient's conv sums the batch as its c
    if slot == 0 and d == 0:
        return "n"
    if d == 1 and cast(Conv, v.op).groups == 1:
        return "c"
    return "o" if slot == 1 and d == 0 else None


def _no_input_label(v: Node, slot: int, d: int) -> str | None:
    return None  # no aggregated labels: nothing to contract


_INPUT_LABEL_RULES: dict[type, Callable[[Node, int, int], str | None]] = {
    Input: _no_input_label,
    Einsum: _einsum_input_label,
    Reshape: _no_input_label,
    Broadcast: _no_input_label,
    Select: _no_input_label,
    Concat: _no_input_label,
    Fill: _no_input_label,
    Gather: _gather_input_label,
    ScatterAdd: _scatter_add_input_label,
    Cast: _no_input_label,
    Conv: _conv_input_label,
    Pool: _no_input_label,
    TopK: _no_input_label,
    RotateHalf: _no_input_label,
    Attention: _no_input_label,
    AttentionGrad: _no_input_label,
    SparseEinsum: _no_input_label,
}
"""Per node kind with aggregated labels, the label of dim ``d`` of input ``slot`` in the node's
label space (None for kinds that aggregate nothing): where a batch dim is contracted."""


def contracted_batch(v: Node, bdim: dict[Node, int | None]) -> str | None:
    """The batch label ``v`` aggregates away, if any: the one label that every operand with a
    batch dim has at that dim, when it is an aggregated label of ``v``. In a gradient graph the
    gradient of a parameter contracts the batch (``gW = x^T g``): cutting that label P ways
    leaves P partial sums, and their aggregation across the devices is the all-reduce (or, into
    a cut output, the reduce-scatter) that data parallelism needs, synthesised by the exchange."""
    labels = set()
    for s, u in enumerate(v.inputs):
        d = bdim.get(u)
        if d is not None:
            labels.add(rule_for(_INPUT_LABEL_RULES, v.op, "data-parallel input labels")(v, s, d))
    if len(labels) != 1:
        return None
    lab = labels.pop()
    return lab if lab is not None and lab in aggregated_labels(v) else None


def _cut_like_readers(graph: Graph, specs: dict[Node, JoinAggSpec], derived: set[Node]) -> None:
    """Ops that no activation reaches (the cotangent seed of a loss broadcast to the batch's
    shape, in a gradient graph) take the batch cut of an op reading them, so their blocks are
    made where they are read instead of in one block that is then scattered. Reverse
    topological order: a chain of such ops takes the cut from its end."""
    for v in reversed(graph.ops):
        if v in specs or v in derived or v.facts.free:
            continue
        for u in graph.users[v]:
            if u not in specs or v in specs:
                continue
            for slot, x in enumerate(u.inputs):
                if x is not v:
                    continue
                for d in range(v.ndim):
                    lab = rule_for(_INPUT_LABEL_RULES, u.op, "data-parallel input labels")(u, slot, d)
                    if lab is not None and len(specs[u][lab]) > 2 and specs[u][lab][-1] == v.shape[d]:
                        specs[v] = JoinAggSpec.for_node(v, {output_labels(v)[d]: list(specs[u][lab])})
                        break
                if v in specs:
                    break


def _data_parallel_specs(graph: Graph, p: int) -> dict[Node, JoinAggSpec]:
    bdim, derived = batch_dims(graph)
    specs: dict[Node, JoinAggSpec] = {}
    largest = 0
    for v in graph.ops:
        if v.facts.free:
            continue
        d = bdim.get(v)
        lab = output_labels(v)[d] if d is not None else contracted_batch(v, bdim)
        if lab is None:
            continue
        size = label_sizes(v)[lab]
        if d is not None:
            largest = max(largest, size)
        specs[v] = JoinAggSpec.for_node(v, {lab: min(p, size)})
    if largest == 0:
        raise NotApplicable("no batch label: no op keeps a batch dim of the activation inputs")
    if largest < p:
        raise NotApplicable(f"batch smaller than the devices: the largest batch label has size "
                            f"{largest} < P = {p}")
    _cut_like_readers(graph, specs, derived)
    return specs


def data_parallel(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None
                  ) -> dict[Node, JoinAggSpec]:
    """Split the batch label P ways in every op that has one (see :func:`batch_dims`); an op that
    contracts the batch away (a parameter's gradient, a loss summed over the batch) cuts that
    label into P partial sums (:func:`contracted_batch`); every other op runs in one block.
    NotApplicable when no op has a batch label of size >= P."""
    return _finish(graph, _data_parallel_specs(graph, cluster.size))


# --------------------------------------------------------------------------------------------
# ZeRO: data parallelism with parameters and their gradients sharded


def _shard(v: Node, p: int) -> JoinAggSpec:
    """``v``'s output cut along its largest dim into min(P, size) even blocks (the first such
    dim on ties)."""
    d = max(range(v.ndim), key=lambda i: v.shape[i])
    return JoinAggSpec.for_node(v, {output_labels(v)[d]: min(p, v.shape[d])})


def parameter_gradients(graph: Graph) -> list[Node]:
    """The graph outputs that are parameters' gradients: those with the shape and dtype of a
    parameter (``ej.param``) that are not the parameter itself. A training graph's outputs are
    ``[loss, *ej.grad(loss, params)]``; parameters of one shape are cut alike, so which
    parameter a gradient belongs to does not matter."""
    shapes = {(x.shape, x.dtype) for x in graph.params if x.ndim}
    return [v for v in dict.fromkeys(graph.outputs)
            if not v.facts.fed and v.ndim and (v.shape, v.dtype) in shapes]


def zero(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None
         ) -> dict[Node, JoinAggSpec]:
    """ZeRO-style (stage 3) data parallelism: the batch is split as :func:`data_parallel` does,
    but every parameter (an ``ej.param`` input) is held cut along its largest dim into P blocks,
    one per device, and so is every parameter's gradient (:func:`parameter_gradients`): the
    gradient op keeps its batch cut into P partial sums and cuts that dim P ways too, so the
    partials of each block meet on one device (a reduce-scatter rather than an all-reduce).
    The forward gathers the parameter blocks each op needs; all of it is synthesised by the
    exchange. NotApplicable without parameters or without a batch (as data_parallel).

    >>> import einjoin as ej
    >>> x, w = ej.input("x", (64, 32)), ej.param("w", (32, 16))
    >>> loss = (x @ w).sum()
    >>> gw = ej.einsum("mk,mn->kn", x, ej.input("g", (64, 16)))   # the gradient of w for cotangent g
    >>> specs = zero(ej.Graph([loss, gw]), ej.local(4))
    >>> print(specs[w.node], specs[gw.node])
    {a: 4, b: 1} {k: 4, n: 1, m: 4}
    """
    p = cluster.size
    params = [x for x in graph.params if x.ndim]
    if not params:
        raise NotApplicable("no parameters (ej.param inputs) to shard")
    specs = _data_parallel_specs(graph, p)
    for x in params:
        specs[x] = _shard(x, p)
    for g in parameter_gradients(graph):
        counts = specs[g].counts() if g in specs else {}
        shard = _shard(g, p).counts()
        cut = {lab: n for lab, n in shard.items() if n > 1}
        specs[g] = JoinAggSpec.for_node(g, {**{k: n for k, n in counts.items() if n > 1}, **cut})
    return _finish(graph, specs)


# --------------------------------------------------------------------------------------------
# Megatron-LM tensor parallelism


def _label_dim(n: Node, lab: str) -> int:
    return list(output_labels(n)).index(lab)


@dataclass
class _Chain:
    members: dict[Node, str] = field(default_factory=dict)  # node -> its split label
    rows: set[Node] = field(default_factory=set)  # row-parallel contractions (partial sums)
    heads: bool = False  # passes a reshape that splits heads out of the split dim
    ok: bool = True
    why: str = ""


def _column_label(v: Node) -> str | None:
    """A contraction with a parameter operand whose one kept parameter label is its output label
    (``x @ W``, ``linear(x, W)``): that label, else None."""
    if not v.facts.contracts:
        return None
    op = cast(Einsum, v.op)
    if not op.agg_labels:
        return None
    found = None
    for u, ls in zip(v.inputs, op.in_labels):
        if not _is_param(u) or not any(lab in op.agg_labels for lab in ls):
            continue
        kept = [lab for lab in ls if lab in op.out_labels]
        if len(kept) == 1 and found is None:
            found = kept[0]
    return found


_Step = tuple[Literal["keep", "row", "fail"], str, bool]
"""How a chain's split label continues in a consumer: ('keep', its label there, whether the
consumer cuts it into (heads, head dim)), ('row', label, False) at a row-parallel contraction,
or ('fail', the reason, False)."""


def _follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    """Dim ``d`` of ``v``'s operand ``slot``, seen in ``u`` (the consumer): see :data:`_Step`."""
    return rule_for(FOLLOW_RULES, u.op, "megatron chain rules")(u, slot, v, d)


def _einsum_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    op = cast(Einsum, u.op)
    lab = op.in_labels[slot][d]
    if lab in op.out_labels:
        return "keep", lab, False
    if any(_is_param(x) and lab in ls for x, ls in zip(u.inputs, op.in_labels)):
        return "row", lab, False
    return "fail", f"the split label is contracted without a parameter in {op.equation}", False


def _reshape_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    src, dst = v.shape, u.shape
    for ia, jb in reshape_groups(src, dst):
        if d in ia:
            if _lead(ia, src) != d:
                return "fail", "a reshape moves the split dim off its group's lead", False
            lab = dim_labels(u.ndim)[_lead(jb, dst)]  # type: ignore[index]
            return "keep", lab, label_sizes(u)[lab] < v.shape[d]  # cut into (heads, head dim)
    return _no_follow(u, slot, v, d)


def _select_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    op = cast(Select, u.op)
    if op.starts[d] != 0 or op.stops[d] != v.shape[d]:
        return "fail", "a select narrows the split dim", False
    return "keep", dim_labels(u.ndim)[d], False


def _concat_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    if cast(Concat, u.op).axis == d:
        return "fail", "a concat runs along the split dim", False
    return "keep", dim_labels(u.ndim)[d], False


def _cast_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    return "keep", dim_labels(u.ndim)[d], False


def _broadcast_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    op = cast(Broadcast, u.op)
    if v.shape[d] != u.shape[op.dims[d]]:
        return "fail", "a broadcast expands the split dim", False
    return "keep", dim_labels(u.ndim)[op.dims[d]], False


def _scatter_add_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    n_idx = u.inputs[1].ndim
    if slot != 0 or d < n_idx:
        return "fail", "a scatter_add sums over the split dim (or reads it as indices)", False
    return "keep", dim_labels(v.ndim)[d], False  # a row-shape dim: same label as in the updates


def _window_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    if slot != 0 or d != 0:
        return "fail", f"a {u.kind} reads the split dim through its window or sums it", False
    return "keep", "n", False  # the batch


def _topk_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    if d == cast(TopK, u.op).axis:
        return "fail", "a topk orders the split dim", False
    return "keep", dim_labels(u.ndim)[d], False


def _attention_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    # heads (and other batch dims) pass through attention; its rows and features are read whole
    if d < u.inputs[0].ndim - 2 and v.shape[d] == u.shape[d]:
        return "keep", dim_labels(u.ndim)[d], False
    return "fail", "attention reads the split dim whole", False


def _no_follow(u: Node, slot: int, v: Node, d: int) -> _Step:
    return "fail", f"a {u.kind} reads the split dim", False  # a gather (a leaf reads nothing)


FOLLOW_RULES: dict[type, Callable[[Node, int, Node, int], _Step]] = {
    Input: _no_follow,
    Einsum: _einsum_follow,
    Reshape: _reshape_follow,
    Broadcast: _broadcast_follow,
    Select: _select_follow,
    Concat: _concat_follow,
    Fill: _no_follow,
    Gather: _no_follow,
    ScatterAdd: _scatter_add_follow,
    Cast: _cast_follow,
    Conv: _window_follow,
    Pool: _window_follow,
    TopK: _topk_follow,
    RotateHalf: _topk_follow,
    Attention: _attention_follow,
    AttentionGrad: _attention_follow,
    SparseEinsum: _no_follow,
}
"""Per node kind, how a Megatron chain's split label continues through it (see :func:`_follow`)."""


def _trace(graph: Graph, start: Node, lab: str, owner: dict[Node, tuple[int, str]]
           ) -> tuple[_Chain, set[int]]:
    """Follow the split label of ``start`` to every consumer until row-parallel contractions or
    graph outputs. Meeting a node of an accepted chain (``owner``: node -> (chain id, label))
    with the same label joins that chain (returned ids) and stops there."""
    ch = _Chain()
    ch.members[start] = lab
    joined: set[int] = set()
    stack = [start]
    while stack and ch.ok:
        v = stack.pop()
        d = _label_dim(v, ch.members[v])
        for u in graph.users[v]:
            for slot, x in enumerate(u.inputs):
                if x is not v:
                    continue
                how, ulab, splits = _follow(u, slot, v, d)
                if how == "fail":
                    ch.ok, ch.why = False, ulab
                    break
                if u in owner:
                    cid, olab = owner[u]
                    if olab != ulab:
                        ch.ok, ch.why = False, "two chains split one op along different labels"
                        break
                    joined.add(cid)
                    continue
                if u in ch.members:
                    if ch.members[u] != ulab:
                        ch.ok, ch.why = False, "one op reached with two different split labels"
                        break
                    continue
                ch.members[u] = ulab
                if how == "row":
                    ch.rows.add(u)
                    continue
                if splits:
                    ch.heads = True  # the split dim is cut into (heads, head dim)
                stack.append(u)
            if not ch.ok:
                break
    return ch, joined


def megatron(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None
             ) -> dict[Node, JoinAggSpec]:
    """Megatron-LM's tensor parallelism, detected structurally (not by names).

    A *column-parallel* contraction has a parameter operand whose one kept label ``n`` is an
    output label. ``n`` is followed through its consumers: einsums that keep it (elementwise
    ops, and in attention the scores, mask, softmax and value einsums), transposes, selects and
    concats along other dims, and reshapes where it is the lead of its group (a reshape that
    cuts it into (heads, head dim) marks attention: the heads label carries the split), until a
    *row-parallel* contraction contracts it with a parameter (that op aggregates P partial sums)
    or a graph output. Chains that meet (q, k and v meet in the scores and the value einsum) are
    one chain; a chain that hits anything else (a reduction over the split label without a
    parameter, a narrowing select, ...) is dropped, and so is one with neither a row-parallel
    end nor a heads reshape. Every label of a chain is cut P ways on the same boundaries (heads
    whole: the model dim is cut at multiples of the head dim).

    Every other op cuts its largest output label into min(P, size) blocks (``split_largest``'s
    rule; no partial sums). NotApplicable when no chain is found, or when a chain's split label
    (e.g. the number of heads) is smaller than P."""
    p = cluster.size
    owner: dict[Node, tuple[int, str]] = {}
    chains: dict[int, _Chain] = {}
    ids = itertools.count()
    reasons: list[str] = []
    for v in graph.ops:
        lab = _column_label(v)
        if lab is None or v in owner:
            continue
        ch, joined = _trace(graph, v, lab, owner)
        if not ch.ok:
            reasons.append(ch.why)
            continue
        cid = min(joined) if joined else next(ids)
        for j in joined:
            if j != cid:
                other = chains.pop(j)
                ch.members.update(other.members)
                ch.rows |= other.rows
                ch.heads |= other.heads
        if cid in chains:
            base = chains[cid]
            base.members.update(ch.members)
            base.rows |= ch.rows
            base.heads |= ch.heads
            ch = base
        chains[cid] = ch
        for n, l in ch.members.items():
            owner[n] = (cid, l)
    good = [ch for ch in chains.values() if ch.rows or ch.heads]
    if not good:
        why = f" (chains dropped: {'; '.join(sorted(set(reasons)))})" if reasons else ""
        raise NotApplicable("no MLP pair (a column- then row-parallel contraction with "
                            f"parameters) nor attention heads found{why}")
    specs: dict[Node, JoinAggSpec] = {}
    for ch in good:
        sizes = {n: label_sizes(n)[lab] for n, lab in ch.members.items()}
        unit = min(sizes.values())
        if any(s % unit for s in sizes.values()):
            continue  # the split labels do not nest: leave these ops to the default rule
        if unit < p:
            if ch.heads:
                raise NotApplicable(f"more devices than heads: {unit} heads, P = {p}")
            raise NotApplicable(f"the split label has size {unit} < P = {p}")
        cuts = even_bounds(unit, p)
        for n, lab in ch.members.items():
            scale = sizes[n] // unit
            specs[n] = JoinAggSpec.for_node(n, {lab: [bound * scale for bound in cuts]})
    if not specs:
        raise NotApplicable("the split labels of the chains found do not nest")
    for v in graph.ops:
        if v in specs or v.facts.free:
            continue
        specs[v] = largest_output_cut(v, p)
    return _finish(graph, specs)


# --------------------------------------------------------------------------------------------
# Alpa's intra-operator ILP over device meshes


def mesh_shapes(p: int) -> list[tuple[int, ...]]:
    """The 1-D mesh (p,) and every 2-D mesh (a, p // a) with 1 < a < p."""
    return [(p,)] + [(a, p // a) for a in range(2, p) if p % a == 0]


def mesh_strategies(node: Node, mesh: tuple[int, ...]) -> list[JoinAggSpec]:
    """Every map of the mesh axes to labels of ``node`` (each axis to one label, a label may take
    several): a label's block count is the product of its axes' sizes, at most its size."""
    sizes = label_sizes(node)
    labels = list(sizes)
    seen: dict[tuple[int, ...], JoinAggSpec] = {}
    for assign in itertools.product(range(len(labels)), repeat=len(mesh)):
        counts = [1] * len(labels)
        for axis, i in zip(mesh, assign):
            counts[i] *= axis
        if all(c <= sizes[lab] for c, lab in zip(counts, labels)) and tuple(counts) not in seen:
            seen[tuple(counts)] = JoinAggSpec.for_node(node, dict(zip(labels, counts)))
    return list(seen.values())


def mesh_candidates(graph: Graph, model: CostModel, mesh: tuple[int, ...], keep: int
                    ) -> dict[Node, list[SpecInfo]]:
    """Per op, the strategies of one mesh (at most ``keep``, the cheapest by op bytes)."""
    strategies: dict[Node, list[SpecInfo]] = {}
    for v in graph.ops:
        if v.facts.free:
            continue
        specs = mesh_strategies(v, mesh)
        if not specs:  # no label set takes the whole mesh: einjoin's largest feasible even split
            specs = candidate_specs(v, model.p, over=(1,))
        infos = [model.info(v, s) for s in specs]
        if len(infos) > keep:
            infos = sorted(infos, key=lambda i: i.op_bytes)[:keep]  # stable: ties keep their order
        strategies[v] = infos
    return strategies


def mesh_ilp(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None,
             tight: bool = True, settings: Settings = SETTINGS) -> dict[Node, JoinAggSpec]:
    """Alpa's intra-operator pass on einjoin's cost model. For every mesh of
    :func:`mesh_shapes`, each op chooses one of :func:`mesh_strategies` (every axis mapped, so
    the block counts multiply to P; an op too small for any takes einjoin's largest feasible
    even split; at most ``settings.mesh_ilp_keep`` per op, the cheapest by op bytes). Node costs are the op's
    join + aggregation bytes, edge costs the repartition bytes from the producer's output
    partition to what the consumer needs; a graph input is loaded free as its first consumer
    needs it and its other consumers pay from there (an edge between the two consumers'
    choices); replicas of one tensor in one partition are paid once however many ops read them,
    as the cost model counts them. So the ILP's objective is exactly
    :func:`einjoin.planner.cost.total_cost`. The mesh whose optimum is cheapest wins (the first
    on ties); ``tight`` picks the linearisation (see :func:`einjoin.planner.ilp.solve`)."""
    model = CostModel(graph, cluster.size)
    best: tuple[int, dict[Node, SpecInfo]] | None = None
    for mesh in mesh_shapes(cluster.size):
        chosen = choose(graph, model, mesh_candidates(graph, model, mesh, settings.mesh_ilp_keep),
                        settings.mesh_ilp_time_limit, tight,
                        node_limit=settings.mesh_ilp_node_limit, lp_first=settings.ilp_lp_first)
        if not chosen:
            break
        cost = total_cost(graph, model, chosen)
        if best is None or cost < best[0]:
            best = (cost, chosen)
    specs = {} if best is None else {v: i.spec for v, i in best[1].items()}
    return _finish(graph, specs)
