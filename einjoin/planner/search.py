"""Search over join-agg specs: the EinDecomp dynamic program, local refinement, and exhaustive
search (ground truth for tests). All use one placement-free cost model:

    total = sum over ops of join(J_v) + agg(J_v)
          + sum over edges u -> v of repart(out partition of u -> what J_v needs of u)

where graph inputs are loaded in the partition their first consumer needs (later consumers pay a
repartition) and fills cost nothing.

The DP (EinDecomp, arXiv 2410.02682) works on trees: ``f(v, J) = join(J) + sum over inputs u of
min_q [g(u, q) + repart(q -> J|u)]`` and ``g(u, q) = min over J with out partition q of
f(u, J) + agg(J)``. The DAG is cut into trees at nodes with several consumers, solved in
topological order with earlier trees frozen; then a local search re-chooses each op's spec with
all others fixed until no move lowers the total (this crosses tree borders, which the paper's DP
cannot).

On devices with a memory cap (``Device.memory``) each op's candidates are only the specs whose
largest kernel holds at most :data:`KERNEL_SHARE` of the smallest cap (cut as finely as that
takes, and at most :data:`FINER_WINDOW` times finer than the coarsest such spec): the search then
picks cuts that also agree along chains of ops, so the memory planner needs few evictions.

>>> import einjoin as ej
>>> from einjoin.planner.search import eindecomp
>>> z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
>>> print(eindecomp(ej.Graph(z), ej.local(8))[z.node])
{m: 2, n: 2, k: 2}
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import decompose
from einjoin.decomp.footprint import MAX_KERNELS, op_need
from einjoin.decomp.partition import Partition, even_bounds
from einjoin.decomp.spec import JoinAggSpec, label_sizes
from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import itemsize
from einjoin.ir.graph import Graph
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Einsum, Fill, Input, Node
from einjoin.planner.cost import agg_cost, join_cost_per_input, repartition_estimate

__all__ = ["candidate_specs", "fitting_specs", "memory_cap", "SpecInfo", "CostModel", "eindecomp",
           "exhaustive", "total_cost", "KERNEL_SHARE", "FINER_WINDOW"]

# Under a cap one kernel may hold this share of it: the rest keeps the next kernel's inputs
# loading while this one runs (and values waiting for their readers), so transfers overlap
# compute instead of every kernel waiting for the eviction before it.
KERNEL_SHARE = 0.75
# ... and among the cuts that fit, none more than this many times finer than the coarsest one:
# finer cuts only add per-task overhead and exchange, unless they line up with their neighbours.
FINER_WINDOW = 4


def _factorisations(target: int, sizes: list[int]) -> Iterable[tuple[int, ...]]:
    """Ordered tuples (p_1..p_n) with product ``target`` and p_i <= sizes[i]."""
    if not sizes:
        if target == 1:
            yield ()
        return
    for p in range(1, min(target, sizes[0]) + 1):
        if target % p == 0:
            for rest in _factorisations(target // p, sizes[1:]):
                yield (p,) + rest


def candidate_specs(node: Node, p: int, over: tuple[int, ...] = (1, 2, 4)) -> list[JoinAggSpec]:
    """Even join-agg specs with block-count product k * p (k in ``over``), each count at most its
    label's size; where no label set is big enough for p blocks, the largest feasible product."""
    sizes = label_sizes(node)
    labels = list(sizes)
    dims = [sizes[lab] for lab in labels]
    most = [max(n, 1) for n in dims]  # an empty label (size 0) is one empty block
    found: list[tuple[int, ...]] = []
    for k in over:
        found.extend(_factorisations(k * p, most))
    if not found:
        cap = math.prod(most)
        for target in range(min(p, cap), 0, -1):
            found = list(_factorisations(target, most))
            if found:
                break
    return [JoinAggSpec(tuple(labels), tuple(even_bounds(n, c) for n, c in zip(dims, counts)))
            for counts in found]


def fitting_specs(node: Node, p: int, cap: int, over: tuple[int, ...] = (1, 2, 4)) -> list[JoinAggSpec]:
    """The candidates for a device of ``cap`` bytes: those whose largest kernel (inputs, output,
    scratch: :func:`op_need`) holds at most :data:`KERNEL_SHARE` of it — ``candidate_specs``
    first, then ever finer cuts (a label's count doubled in the specs that hold least, at most
    :data:`MAX_KERNELS` kernels, while the need still falls) until some fit and on to
    :data:`FINER_WINDOW` times the fewest kernels that fit; the fitting ones up to that many
    kernels are kept. Failing that, those within the whole cap
    (coarsest first, the same window); failing that, the specs that hold least with the fewest
    kernels (the memory planner cuts further or reports the op).

    >>> import einjoin as ej
    >>> z = ej.input("a", (256, 256)) @ ej.input("b", (256, 256))   # float32: 256 KiB each
    >>> sorted({s.num_kernels for s in fitting_specs(z.node, 2, 800_000)})
    [2, 4, 8]
    >>> sorted({s.num_kernels for s in fitting_specs(z.node, 2, 300_000)})  # 3 blocks of 128x128 fit
    [8, 16, 32]
    """
    budget = int(KERNEL_SHARE * cap)
    need = {s: op_need(decompose(node, s)) for s in candidate_specs(node, p, over)}
    fewest = min((s.num_kernels for s, n in need.items() if n <= budget), default=None)
    # finer cuts: a beam of the specs that hold least, each with one label's count doubled,
    # until some fit, then on to FINER_WINDOW times that (the cuts that line up with finer
    # neighbours); stop where cutting finer no longer lowers the need
    frontier = sorted(need, key=lambda s: (need[s], s.num_kernels))[:_BEAM]
    while frontier:
        if fewest is not None and 2 * min(s.num_kernels for s in frontier) > FINER_WINDOW * fewest:
            break
        # a list, not a set: the order breaks ties, and must not follow string hashing
        finer = list(dict.fromkeys(d for s in frontier for d in _doubled(node, s) if d not in need))
        if not finer:
            break  # no label has room for more blocks (or MAX_KERNELS is reached)
        least = min(need.values())
        need.update((d, op_need(decompose(node, d))) for d in finer)
        if fewest is None:
            fewest = min((d.num_kernels for d in finer if need[d] <= budget), default=None)
            if fewest is None and min(need[d] for d in finer) >= least:
                break
        frontier = sorted(finer, key=lambda d: (need[d], d.num_kernels))[:_BEAM]
    for limit in (budget, cap):
        fit = [s for s, n in need.items() if n <= limit]
        if fit:
            fewest = min(s.num_kernels for s in fit)
            return [s for s in fit if s.num_kernels <= FINER_WINDOW * fewest]
    least = min(need.values())
    fewest = min(s.num_kernels for s, n in need.items() if n == least)
    return [s for s, n in need.items() if n == least and s.num_kernels == fewest]


_BEAM = 16  # specs refined per step: bounds the search for ops with many labels under tiny caps


def _doubled(node: Node, spec: JoinAggSpec) -> list[JoinAggSpec]:
    """``spec`` with one label's block count doubled (at most its size, at most MAX_KERNELS)."""
    counts = spec.counts()
    sizes = label_sizes(node)
    out = []
    for lab, c in counts.items():
        if c < sizes[lab] and spec.num_kernels // c * min(sizes[lab], 2 * c) <= MAX_KERNELS:
            out.append(JoinAggSpec.for_node(node, {**counts, lab: min(sizes[lab], 2 * c)}))
    return out


def memory_cap(cluster: Cluster) -> int | None:
    """The smallest device memory of ``cluster`` (None: no device has a cap)."""
    caps = [d.memory for d in cluster.devices if d.memory is not None]
    return min(caps) if caps else None


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


class CostModel:
    """Memoised cost pieces for one graph on ``p`` devices."""

    def __init__(self, graph: Graph, p: int, over: tuple[int, ...] = (1, 2, 4), cap: int | None = None):
        self.graph = graph
        self.p = p
        self.over = over
        self.cap = cap  # the devices' memory (None: no cap)
        self._cands: dict[Node, list[SpecInfo]] = {}
        self._info: dict[tuple[Node, JoinAggSpec], SpecInfo] = {}
        self._repart: dict[tuple[int, int], int] = {}
        self._pid: dict[Partition, int] = {}
        self._by_shape: dict[tuple, list[SpecInfo]] = {}
        self._parts: list[Partition] = []

    def pid(self, part: Partition) -> int:
        """An interned id for a partition (hashing nested tuples on every lookup is slow)."""
        i = self._pid.get(part)
        if i is None:
            i = self._pid[part] = len(self._parts)
            self._parts.append(part)
        return i

    def info(self, node: Node, spec: JoinAggSpec) -> SpecInfo:
        key = (node, spec)
        if key not in self._info:
            op = node.op
            if isinstance(op, Einsum):
                out = spec.partition(op.out_labels)
                ins = tuple(spec.partition(ls) for ls in op.in_labels)
                counts = spec.counts()
                joins = []
                for x, ls in zip(node.inputs, op.in_labels):
                    r = math.prod(c for lab, c in counts.items() if lab not in ls)
                    joins.append(0 if isinstance(x.op, Fill) else x.size * itemsize(x.dtype) * (r - 1))
                n_agg = math.prod(counts[lab] for lab in op.agg_labels)
                agg = node.size * itemsize(partial_dtype(node)) * (n_agg - 1)  # as cost.agg_cost
                join_in = tuple(joins)
            else:
                d = decompose(node, spec)
                out, ins, agg = d.out_partition, d.in_partitions, agg_cost(d)
                join_in = join_cost_per_input(d)
            self._info[key] = SpecInfo(spec, out, ins, sum(join_in) + agg, agg, join_in,
                                       self.pid(out), tuple(self.pid(p) for p in ins))
        return self._info[key]

    def candidates(self, node: Node) -> list[SpecInfo]:
        if node not in self._cands:
            if isinstance(node.op, (Input, Fill)):
                self._cands[node] = []
            else:
                # layers repeat: nodes with the same op on the same input shapes share candidates
                shape_key = (node.op, node.shape, node.dtype,
                             tuple((x.shape, x.dtype, isinstance(x.op, Fill)) for x in node.inputs))
                found = self._by_shape.get(shape_key)
                if found is None:
                    specs = (candidate_specs(node, self.p, self.over) if self.cap is None
                             else fitting_specs(node, self.p, self.cap, self.over))
                    found = [self.info(node, s) for s in specs]
                    # equal bytes: prefer fewer partial sums (no reduce to run), then fewer kernels
                    found.sort(key=lambda i: (i.agg_bytes, i.spec.num_kernels))
                    self._by_shape[shape_key] = found
                self._cands[node] = found
        return self._cands[node]

    def repart(self, q: Partition, r: Partition, dtype: str) -> int:
        return self.repart_ids(self.pid(q), self.pid(r), dtype)

    def repart_ids(self, q: int, r: int, dtype: str) -> int:
        key = (q, r)
        found = self._repart.get(key)
        if found is None:
            # cached in elements: the same pair of partitions serves every dtype
            found = self._repart[key] = repartition_estimate(self._parts[q], self._parts[r], "bool")
        return found * itemsize(dtype)


def _input_partitions(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo]
                      ) -> dict[Node, Partition]:
    """Each graph input is loaded as its first consumer needs it."""
    out: dict[Node, Partition] = {}
    for x in graph.inputs:
        for c in graph.users[x]:
            out[x] = chosen[c].ins[c.inputs.index(x)]
            break
    return out


def total_cost(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo]) -> int:
    """The model's bytes for a complete choice of specs. Replicas of one tensor in one partition
    are counted once however many ops read them (the exchange moves a region to a device once)."""
    loaded = _input_partitions(graph, model, chosen)
    total = 0
    replicas: dict[tuple[Node, Partition, int], None] = {}
    for v in graph.ops:
        if isinstance(v.op, Fill):
            continue
        info = chosen[v]
        total += info.agg_bytes
        for u, need, join in zip(v.inputs, info.ins, info.join_in):
            if isinstance(u.op, Fill):
                continue
            have = loaded[u] if isinstance(u.op, Input) else chosen[u].out
            total += model.repart(have, need, u.dtype)
            if join:
                replicas[(u, need, join)] = None
    return total + sum(j for _, _, j in replicas)


def _replica_bytes(graph: Graph, chosen: dict[Node, SpecInfo], u: Node) -> int:
    """Replica bytes of tensor ``u`` over all its readers, each (partition, replication) once."""
    seen: set[tuple[Partition, int]] = set()
    for w in graph.users[u]:
        info = chosen[w]
        for x, need, join in zip(w.inputs, info.ins, info.join_in):
            if x is u and join:
                seen.add((need, join))
    return sum(j for _, j in seen)


def _specs_of(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo]) -> dict[Node, JoinAggSpec]:
    from einjoin.decomp.spec import dim_labels
    specs = {n: i.spec for n, i in chosen.items()}
    for x, part in _input_partitions(graph, model, chosen).items():
        specs[x] = JoinAggSpec(dim_labels(x.ndim), part.bounds)
    for n in graph.nodes:
        if n not in specs:
            specs[n] = JoinAggSpec.for_node(n, None)
    return specs


def _solve_tree(graph: Graph, model: CostModel, root: Node, members: set[Node],
                frozen: dict[Node, SpecInfo], downstream: bool = False) -> dict[Node, SpecInfo]:
    """Exact DP over the tree of ``members`` hanging from ``root`` (inputs of members outside
    the tree are frozen roots, graph inputs or fills). With ``downstream``, the root also pays
    the repartition to what its consumers (in other trees, as currently chosen) need."""
    order = [n for n in graph.nodes if n in members]
    f: dict[Node, list[int]] = {}
    pick: dict[Node, list[list[int]]] = {}  # per candidate J, per input slot: chosen candidate of u
    best_in: dict[tuple[Node, int], tuple[int, int]] = {}  # (u, need id) -> (cost, candidate)

    by_out: dict[Node, list[tuple[int, int, int]]] = {}  # u -> [(out id, best f, candidate)]

    def serve(u: Node, need: int) -> tuple[int, int]:
        # many candidates of v need the same partition of u, and many candidates of u give the
        # same output partition: solve each (u, need) once, over u's distinct outputs
        key = (u, need)
        found = best_in.get(key)
        if found is None:
            if u not in by_out:
                best_of: dict[int, tuple[int, int]] = {}
                for j, uinfo in enumerate(model.candidates(u)):
                    if uinfo.out_id not in best_of or f[u][j] < best_of[uinfo.out_id][0]:
                        best_of[uinfo.out_id] = (f[u][j], j)
                by_out[u] = [(o, c, j) for o, (c, j) in best_of.items()]
            best, arg = -1, -1
            for o, c0, j in by_out[u]:
                c = c0 + model.repart_ids(o, need, u.dtype)
                if arg < 0 or c < best:
                    best, arg = c, j
            found = best_in[key] = (best, arg)
        return found

    for v in order:
        cands = model.candidates(v)
        fv, pv = [], []
        for info in cands:
            cost = info.op_bytes
            choice = []
            for u, need, need_id in zip(v.inputs, info.ins, info.in_ids):
                if isinstance(u.op, (Input, Fill)):
                    choice.append(-1)
                    continue  # loaded (or computed) as needed
                if u in members:
                    c, arg = serve(u, need_id)
                    cost += c
                    choice.append(arg)
                else:
                    cost += model.repart_ids(frozen[u].out_id, need_id, u.dtype)
                    choice.append(-1)
            fv.append(cost)
            pv.append(choice)
        f[v], pick[v] = fv, pv
    result: dict[Node, SpecInfo] = {}
    root_cost = list(f[root])
    if downstream:
        for w in graph.users[root]:
            if w in frozen:
                for slot, u in enumerate(w.inputs):
                    if u is root:
                        need = frozen[w].in_ids[slot]
                        for j, info in enumerate(model.candidates(root)):
                            root_cost[j] += model.repart_ids(info.out_id, need, root.dtype)
    best_root = min(range(len(root_cost)), key=lambda j: root_cost[j])
    stack = [(root, best_root)]
    while stack:
        v, j = stack.pop()
        result[v] = model.candidates(v)[j]
        for u, arg in zip(v.inputs, pick[v][j]):
            if arg >= 0 and u not in result:
                stack.append((u, arg))
    return result


def _local_cost(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo], v: Node) -> int:
    """The part of the total that depends on v's spec: its op, its in- and out-edges, and the
    edges of inputs whose loaded partition v (as first consumer) decides."""

    def have(u: Node) -> int:
        if isinstance(u.op, Input):
            c = graph.users[u][0]
            return chosen[c].in_ids[c.inputs.index(u)]
        return chosen[u].out_id

    def edges_into(w: Node) -> int:
        cost = 0
        for slot, (u, need) in enumerate(zip(w.inputs, chosen[w].in_ids)):
            if isinstance(u.op, Fill) or (isinstance(u.op, Input) and graph.users[u][0] is w
                                           and slot == w.inputs.index(u)):
                continue  # a fill is computed in place; an input is loaded as its first use needs
            cost += model.repart_ids(have(u), need, u.dtype)
        return cost

    cost = chosen[v].agg_bytes + edges_into(v)
    cost += sum(_replica_bytes(graph, chosen, u) for u in set(v.inputs) if not isinstance(u.op, Fill))
    touched = {w for w in graph.users[v]}
    for u in v.inputs:
        if isinstance(u.op, Input) and graph.users[u][0] is v:
            touched.update(w for w in graph.users[u] if w is not v)
    for w in touched:
        cost += edges_into(w)
    return cost


def _single_op_moves(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo],
                     key: Callable[[Node], Any], rounds: int) -> None:
    """Re-choose each op's spec with all others fixed while that lowers ``key(op)``."""
    for _ in range(rounds):
        improved = False
        for v in graph.ops:
            if v not in chosen:
                continue  # fills are computed where they are read
            keep = chosen[v]
            best, best_info = key(v), keep
            for info in model.candidates(v):
                if info is keep:
                    continue
                chosen[v] = info
                c = key(v)
                if c < best:
                    best, best_info = c, info
            chosen[v] = best_info
            improved |= best_info is not keep
        if not improved:
            return


def _local_search(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo], rounds: int = 8) -> None:
    """Re-choose each op's spec with all others fixed while that lowers the total."""
    _single_op_moves(graph, model, chosen, lambda v: _local_cost(graph, model, chosen, v), rounds)


def _waiting_bytes(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo], v: Node) -> int:
    """The bytes around ``v`` that wait on compute: its partial sums, and the repartitions and
    replicas of op results on its in- and out-edges (an input's replicas load before anything
    runs, so they overlap compute; these sit on the critical path)."""
    def edge(u: Node, w: Node, slot: int) -> int:
        info = chosen[w]
        return model.repart_ids(chosen[u].out_id, info.in_ids[slot], u.dtype) + info.join_in[slot]

    cost = chosen[v].agg_bytes
    for slot, u in enumerate(v.inputs):
        if u in chosen:
            cost += edge(u, v, slot)
    for w in set(graph.users[v]):
        if w in chosen:
            cost += sum(edge(v, w, slot) for slot, u in enumerate(w.inputs) if u is v)
    return cost


def _break_ties(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo], rounds: int = 2) -> None:
    """Single-op moves that keep the modelled bytes (or lower them) and lower the bytes waiting
    on compute: of two plans moving as much, the one whose transfers can overlap compute."""
    _single_op_moves(graph, model, chosen, lambda v: (_local_cost(graph, model, chosen, v),
                                                      _waiting_bytes(graph, model, chosen, v)), rounds)


def eindecomp(graph: Graph, cluster: Cluster, refine: bool = True, rounds: int = 6,
              ilp_max_ops: int = 200, ilp_keep: int = 40, time_limit: float = 30.0
              ) -> dict[Node, JoinAggSpec]:
    """The EinDecomp DP over trees of the DAG, then refinement across tree borders: trees
    re-solved with their neighbours' choices and single-op moves; and, for graphs of at most
    ``ilp_max_ops`` ops, a global step: an ILP (:mod:`einjoin.planner.ilp`) choosing among each op's
    DP choice and up to ``ilp_keep`` of its candidates (those with exactly P blocks first,
    cheapest by op bytes), followed by the same local moves. The cheapest plan wins; among equal
    ones, single-op moves prefer less of the bytes waiting on compute (partial sums, op results
    repartitioned or replicated). Devices with a memory cap restrict the candidates (see the
    module's docstring)."""
    model = CostModel(graph, cluster.size, cap=memory_cap(cluster))
    outputs = set(graph.outputs)
    roots = [n for n in graph.ops if not isinstance(n.op, Fill)
             and (n in outputs or len(graph.users[n]) != 1)]
    tree_of: dict[Node, Node] = {}
    for n in reversed(graph.nodes):
        if isinstance(n.op, (Input, Fill)):
            continue
        tree_of[n] = n if n in roots else tree_of.get(graph.users[n][0], graph.users[n][0])
    trees = {r: {n for n, t in tree_of.items() if t is r} for r in roots}
    chosen: dict[Node, SpecInfo] = {}
    for r in roots:
        chosen.update(_solve_tree(graph, model, r, trees[r], chosen))
    if refine:
        # beyond the paper: re-solve every tree with its neighbours' current choices (its root
        # now sees what its consumers need), then re-choose single ops, until nothing improves
        best, best_choice = total_cost(graph, model, chosen), dict(chosen)
        for _ in range(rounds):
            for r in roots:
                chosen.update(_solve_tree(graph, model, r, trees[r], chosen, downstream=True))
            _local_search(graph, model, chosen)
            cost = total_cost(graph, model, chosen)
            if cost >= best:
                break
            best, best_choice = cost, dict(chosen)
        chosen = best_choice
        ops = [v for v in graph.ops if not isinstance(v.op, Fill)]
        if ops and len(ops) <= ilp_max_ops:
            glob = _global_step(graph, model, chosen, ilp_keep, time_limit)
            if glob is not None and total_cost(graph, model, glob) < best:
                chosen = glob
        _break_ties(graph, model, chosen)
    return _specs_of(graph, model, chosen)


def _global_step(graph: Graph, model: CostModel, chosen: dict[Node, SpecInfo], keep: int,
                 time_limit: float) -> dict[Node, SpecInfo] | None:
    """ILP over a candidate subset per op (the DAG-wide choice the DP's trees cannot make)."""
    from einjoin.planner.ilp import choose  # the ILP module builds on this one's cost model

    strategies: dict[Node, list[SpecInfo]] = {}
    for v, info in chosen.items():
        cands = model.candidates(v)
        exact = [c for c in cands if c.spec.num_kernels == model.p]
        rest = [c for c in cands if c.spec.num_kernels != model.p]
        pool = sorted(exact, key=lambda c: c.op_bytes)[:keep]
        pool += sorted(rest, key=lambda c: c.op_bytes)[:max(0, keep - len(pool))]
        strategies[v] = [info] + [c for c in pool if c is not info]
    try:
        glob = choose(graph, model, strategies, time_limit)
    except EinjoinError:  # HiGHS found nothing in time: keep the DP's plan
        return None
    if not glob:
        return None
    _local_search(graph, model, glob)
    return glob


def exhaustive(graph: Graph, cluster: Cluster, max_ops: int = 4) -> dict[Node, JoinAggSpec]:
    """Every combination of candidate specs (graphs of at most ``max_ops`` ops): ground truth."""
    model = CostModel(graph, cluster.size, cap=memory_cap(cluster))
    ops = [n for n in graph.ops if not isinstance(n.op, Fill)]
    if len(ops) > max_ops:
        raise EinjoinError(f"exhaustive search takes at most {max_ops} ops; this graph has {len(ops)}")
    best, best_choice = None, None
    for combo in itertools.product(*(model.candidates(n) for n in ops)):
        chosen = dict(zip(ops, combo))
        c = total_cost(graph, model, chosen)
        if best is None or c < best:
            best, best_choice = c, chosen
    assert best_choice is not None
    return _specs_of(graph, model, best_choice)


def model_cost(graph: Graph, cluster: Cluster, specs: dict[Node, JoinAggSpec]) -> int:
    """The model's bytes for given specs (e.g. a planner's output)."""
    model = CostModel(graph, cluster.size)
    chosen = {n: model.info(n, specs[n]) for n in graph.ops if not isinstance(n.op, Fill)}
    return total_cost(graph, model, chosen)
