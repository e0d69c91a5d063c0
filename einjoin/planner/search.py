"""The search over join-agg specs: the EinDecomp dynamic program, local refinement, and
exhaustive search (ground truth for tests), all minimising the one cost model's
:func:`~einjoin.planner.cost.total_cost` over each op's candidates
(:mod:`einjoin.planner.candidates`).

The DP (EinDecomp, arXiv 2410.02682) works on trees: ``f(v, J) = join(J) + sum over inputs u of
min_q [g(u, q) + repart(q -> J|u)]`` and ``g(u, q) = min over J with out partition q of
f(u, J) + agg(J)``. The DAG is cut into trees at nodes with several consumers, solved in
topological order with earlier trees frozen; then a local search re-chooses each op's spec with
all others fixed until no move lowers the total (this crosses tree borders, which the paper's DP
cannot), and on graphs of at most ``Settings.ilp_max_ops`` ops an ILP (:mod:`einjoin.planner.ilp`)
chooses DAG-wide.

Under a memory limit (the planners' ``memory_limit``: device -> bytes) each op's candidates are
only the specs whose largest kernel holds at most ``Settings.kernel_share`` of the smallest cap
(cut as finely as that takes, and at most ``Settings.finer_window`` times finer than the
coarsest such spec: :func:`einjoin.planner.fit.fitting_specs`): the search then picks cuts that
also agree along chains of ops, so the memory planner needs few evictions.

>>> import einjoin as ej
>>> from einjoin.planner.search import eindecomp
>>> z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
>>> print(eindecomp(ej.Graph(z), ej.local(8))[z.node])
{m: 2, n: 2, k: 2}
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
from collections.abc import Callable, Mapping, Sequence

from einjoin.cluster import Cluster
from einjoin.decomp.spec import JoinAggSpec, dim_labels
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.planner.candidates import Candidates
from einjoin.planner.cost import (OBJECTIVES, CostModel, GraphEdges, SpecInfo, input_partitions, time_weights,
                                  total_cost)
from einjoin.planner.fit import MemoryLimit, device_memory, memory_cap
from einjoin.planner.gcpause import old_objects_frozen
from einjoin.planner.ilp import choose
from einjoin.settings import SETTINGS, Settings

__all__ = ["eindecomp", "exhaustive"]


def _candidates(graph: Graph, cluster: Cluster, memory_limit: MemoryLimit | None,
                settings: Settings, objective: str = "bytes") -> Candidates:
    limit = device_memory(cluster) if memory_limit is None else memory_limit
    if objective not in OBJECTIVES:
        raise EinjoinError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    weights = time_weights(cluster) if objective == "time" else None
    return Candidates(CostModel(graph, cluster.size, weights), memory_cap(limit), settings)


def _specs_of(graph: Graph, chosen: dict[Node, SpecInfo]) -> dict[Node, JoinAggSpec]:
    specs = {n: i.spec for n, i in chosen.items()}
    for x, part in input_partitions(graph, chosen).items():
        specs[x] = JoinAggSpec(dim_labels(x.ndim), part.bounds)
    for n in graph.nodes:
        if n not in specs:
            specs[n] = JoinAggSpec.for_node(n, None)
    return specs


def _solve_tree(graph: Graph, cands: Candidates, root: Node, members: set[Node],
                frozen: dict[Node, SpecInfo], downstream: bool = False) -> dict[Node, SpecInfo]:
    """Exact DP over the tree of ``members`` hanging from ``root`` (inputs of members outside
    the tree are frozen roots, graph inputs or fills). With ``downstream``, the root also pays
    the repartition to what its consumers (in other trees, as currently chosen) need."""
    order = [n for n in graph.nodes if n in members]
    f: dict[Node, list[int]] = {}
    pick: dict[Node, list[list[int]]] = {}  # per candidate J, per input slot: chosen candidate of u
    best_in: dict[tuple[Node, int], tuple[int, int]] = {}  # (u, need id) -> (cost, candidate)

    by_out: dict[Node, tuple[np.ndarray, list[int]]] = {}  # u -> (best f per out id, its candidate)

    def serve(u: Node, need: int) -> tuple[int, int]:
        # many candidates of v need the same partition of u, and many candidates of u give the
        # same output partition: solve each (u, need) once, over u's distinct outputs (the
        # repartition row from those outputs to ``need`` is fixed: memoised across calls)
        key = (u, need)
        found = best_in.get(key)
        if found is None:
            if u not in by_out:
                outs, group = cands.out_groups(u)
                best_f: list[int] = [-1] * len(outs)
                best_j: list[int] = [-1] * len(outs)
                for j, (g, c) in enumerate(zip(group, f[u])):
                    if best_j[g] < 0 or c < best_f[g]:
                        best_f[g], best_j[g] = c, j
                by_out[u] = (np.array(best_f, dtype=np.int64), best_j)
            c0, arg_of = by_out[u]
            total = c0 + cands.repart_row(u, need)
            k = int(total.argmin())  # the first of equal minima, as a strict < scan
            found = best_in[key] = (int(total[k]), arg_of[k])
        return found

    for v in order:
        options = cands(v)
        fv, pv = [], []
        for info in options:
            cost = info.op_bytes
            choice = []
            for u, need_id in zip(v.inputs, info.in_ids):
                if u.facts.leaf:
                    choice.append(-1)
                    continue  # loaded (or computed) as needed
                if u in members:
                    c, arg = serve(u, need_id)
                    cost += c
                    choice.append(arg)
                else:
                    cost += cands.model.repart_ids(frozen[u].out_id, need_id, u.dtype)
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
                        for j, info in enumerate(cands(root)):
                            root_cost[j] += cands.model.repart_ids(info.out_id, need, root.dtype)
    best_root = min(range(len(root_cost)), key=lambda j: root_cost[j])
    stack = [(root, best_root)]
    while stack:
        v, j = stack.pop()
        result[v] = cands(v)[j]
        for u, arg in zip(v.inputs, pick[v][j]):
            if arg >= 0 and u not in result:
                stack.append((u, arg))
    return result


def _dependent_edges(around: GraphEdges, v: Node) -> tuple[tuple[Node, int, Node], ...]:
    """The paid edges ``(w, slot, u)`` into the ops ``v``'s spec touches whose cost depends on
    that spec: ``u`` is ``v``'s result, or an input that ``v`` (its first consumer) loads."""
    first = around.first
    return tuple((w, slot, u) for w in around.touched[v] for slot, u in around.edges[w]
                 if u is v or (u in first and first[u][0] is v))


def _local_cost(around: GraphEdges, cands: Candidates, chosen: dict[Node, SpecInfo], v: Node,
                dependent: dict[Node, tuple[tuple[Node, int, Node], ...]] | None = None) -> int:
    """The part of the total that depends on v's spec: its op, its in- and out-edges, and the
    edges of inputs whose loaded partition v (as first consumer) decides. With ``dependent``
    (a memo of :func:`_dependent_edges`), the touched ops' other in-edges are left out: they do
    not depend on v's spec, so every candidate of v is off by the same amount and the
    comparisons of single-op moves are unchanged (the searches re-cost every candidate of every
    op, several rounds: a 32-layer LLaMA-7B at P=64 costs ~10^6 such edges)."""
    repart = cands.model.repart_ids
    first = around.first

    def have_of(u: Node) -> int:
        if u in first:
            c, s = first[u]
            return chosen[c].in_ids[s]
        return chosen[u].out_id

    def edges_into(w: Node) -> int:
        cost = 0
        need = chosen[w].in_ids
        for slot, u in around.edges[w]:
            cost += repart(have_of(u), need[slot], u.dtype)
        return cost

    def replica_bytes(u: Node) -> int:  # each (partition, replication) of u once
        seen: set[tuple[int, int]] = set()
        for w, slot in around.reads[u]:
            info = chosen[w]
            if info.join_in[slot]:
                seen.add((info.in_ids[slot], info.join_in[slot]))
        return sum(j for _, j in seen)

    cost = chosen[v].agg_bytes + edges_into(v)
    cost += sum(replica_bytes(u) for u in around.inputs[v])
    if dependent is None:
        for w in around.touched[v]:
            cost += edges_into(w)
        return cost
    mine = dependent.get(v)
    if mine is None:
        mine = dependent[v] = _dependent_edges(around, v)
    for w, slot, u in mine:
        cost += repart(have_of(u), chosen[w].in_ids[slot], u.dtype)
    return cost


def _single_op_moves(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo],
                     key: Callable[[Node], Any], rounds: int) -> None:
    """Re-choose each op's spec with all others fixed while that lowers ``key(op)``."""
    for _ in range(rounds):
        improved = False
        for v in graph.ops:
            if v not in chosen:
                continue  # fills are computed where they are read
            keep = chosen[v]
            best, best_info = key(v), keep
            for info in cands(v):
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


def _local_search(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo]) -> None:
    """Re-choose each op's spec with all others fixed while that lowers the total."""
    around = GraphEdges.of(graph)
    dependent: dict[Node, tuple[tuple[Node, int, Node], ...]] = {}
    _single_op_moves(graph, cands, chosen, lambda v: _local_cost(around, cands, chosen, v, dependent),
                     cands.settings.local_search_rounds)


def _waiting_bytes(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo], v: Node) -> int:
    """The bytes around ``v`` that wait on compute: its partial sums, and the repartitions and
    replicas of op results on its in- and out-edges (an input's replicas load before anything
    runs, so they overlap compute; these sit on the critical path)."""
    def edge(u: Node, w: Node, slot: int) -> int:
        info = chosen[w]
        return cands.model.repart_ids(chosen[u].out_id, info.in_ids[slot], u.dtype) + info.join_in[slot]

    cost = chosen[v].agg_bytes
    for slot, u in enumerate(v.inputs):
        if u in chosen:
            cost += edge(u, v, slot)
    for w in set(graph.users[v]):
        if w in chosen:
            cost += sum(edge(v, w, slot) for slot, u in enumerate(w.inputs) if u is v)
    return cost


def _break_ties(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo]) -> None:
    """Single-op moves that keep the modelled bytes (or lower them) and lower the bytes waiting
    on compute: of two plans moving as much, the one whose transfers can overlap compute."""
    around = GraphEdges.of(graph)
    dependent: dict[Node, tuple[tuple[Node, int, Node], ...]] = {}
    _single_op_moves(graph, cands, chosen, lambda v: (_local_cost(around, cands, chosen, v, dependent),
                                                      _waiting_bytes(graph, cands, chosen, v)),
                     cands.settings.tie_break_rounds)


def _balanced(spec: JoinAggSpec) -> bool:
    """Whether every label's blocks are as even as the search's own cuts (sizes differ by at
    most one). The cost model counts bytes, not work: uneven cuts (megatron's 32/16/16 of 64 on
    3 devices, aligned to heads) can move fewer bytes while one device does twice the work of
    the others, a trade the search's even candidates never make; a seed may not bring it in."""
    for b in spec.bounds:
        sizes = [hi - lo for lo, hi in zip(b, b[1:])]
        if max(sizes) - min(sizes) > 1:
            return False
    return True


def _seeded(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo],
            seeds: Sequence[Mapping[Node, JoinAggSpec]]) -> dict[Node, SpecInfo]:
    """The cheapest of ``chosen`` and the ``seeds`` (whole plans, e.g. the named baselines'),
    by the same cost model; a seed that wins is then improved by single-op moves. So the result
    is never worse than any seed with even cuts (:func:`_balanced`): the baselines' plans are a
    floor, not a competitor."""
    best, best_cost = chosen, total_cost(graph, cands.model, chosen)
    ops = [v for v in graph.ops if not v.facts.free]
    for seed in seeds:
        if any(v not in seed or not _balanced(seed[v]) for v in ops):
            continue  # not a whole plan, or one whose uneven cuts overload a device
        plan = {v: cands.model.info(v, seed[v]) for v in ops}
        cost = total_cost(graph, cands.model, plan)
        if cost < best_cost:
            best, best_cost = plan, cost
    if best is not chosen:
        _local_search(graph, cands, best)
    return best


def eindecomp(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None,
              refine: bool = True, settings: Settings = SETTINGS,
              seeds: Sequence[Mapping[Node, JoinAggSpec]] = (), objective: str = "bytes"
              ) -> dict[Node, JoinAggSpec]:
    """The EinDecomp DP over trees of the DAG, then refinement across tree borders: trees
    re-solved with their neighbours' choices and single-op moves (``settings.refine_rounds``);
    and, for graphs of at most ``settings.ilp_max_ops`` ops, a global step: an ILP
    (:mod:`einjoin.planner.ilp`) choosing among each op's DP choice and up to
    ``settings.ilp_keep`` of its candidates (those with exactly P blocks first, cheapest by op
    bytes), followed by the same local moves. The cheapest plan wins; among equal ones, single-op
    moves prefer less of the bytes waiting on compute (partial sums, op results repartitioned or
    replicated). A ``memory_limit`` (device -> bytes or None; default: the cluster's
    ``Device.memory``) restricts the candidates (see the module's docstring).

    ``seeds`` are whole plans (node -> spec, e.g. the named baselines' on this graph) that the
    result must not lose to: when one costs less than the search's plan it is taken and
    improved by single-op moves (:func:`_seeded`). Seeds are only used without a memory cap
    (under one, a seed's cuts need not fit it) and only if every cut is even (blocks of a label
    differ by at most one element: the bytes model does not see an overloaded device). The
    search itself offers every op k * P blocks (balanced work), so a plan that leaves a tiny op,
    such as the broadcast of a loss's cotangent, in one block can be cheaper in bytes; a seed
    carries that choice in.

    ``objective``: ``"bytes"`` (the modelled bytes) or ``"time"`` (each byte weighed by the
    links it is modelled to cross: :class:`~einjoin.planner.cost.TimeWeights`)."""
    with old_objects_frozen():  # the collector does not re-scan torch's objects meanwhile
        return _eindecomp(graph, cluster, memory_limit, refine, settings, seeds, objective)


def _eindecomp(graph: Graph, cluster: Cluster, memory_limit: MemoryLimit | None, refine: bool,
               settings: Settings, seeds: Sequence[Mapping[Node, JoinAggSpec]], objective: str
               ) -> dict[Node, JoinAggSpec]:
    cands = _candidates(graph, cluster, memory_limit, settings, objective)
    model = cands.model
    outputs = set(graph.outputs)
    roots = [n for n in graph.ops if not n.facts.free
             and (n in outputs or len(graph.users[n]) != 1)]
    tree_of: dict[Node, Node] = {}
    for n in reversed(graph.nodes):
        if n.facts.leaf:
            continue
        tree_of[n] = n if n in roots else tree_of.get(graph.users[n][0], graph.users[n][0])
    trees = {r: {n for n, t in tree_of.items() if t is r} for r in roots}
    chosen: dict[Node, SpecInfo] = {}
    for r in roots:
        chosen.update(_solve_tree(graph, cands, r, trees[r], chosen))
    if refine:
        # beyond the paper: re-solve every tree with its neighbours' current choices (its root
        # now sees what its consumers need), then re-choose single ops, until nothing improves
        best, best_choice = total_cost(graph, model, chosen), dict(chosen)
        solved: dict[Node, tuple[tuple[Any, ...], dict[Node, SpecInfo]]] = {}
        for _ in range(settings.refine_rounds):
            for r in roots:
                # a tree's DP reads only its neighbours' choices: where they are as at its last
                # solve, the result is the same (the local search may have moved its members since)
                deps = _tree_deps(graph, r, trees[r], chosen)
                last = solved.get(r)
                if last is None or last[0] != deps:
                    last = solved[r] = (deps, _solve_tree(graph, cands, r, trees[r], chosen, downstream=True))
                chosen.update(last[1])
            _local_search(graph, cands, chosen)
            cost = total_cost(graph, model, chosen)
            if cost >= best:
                break
            best, best_choice = cost, dict(chosen)
        chosen = best_choice
        ops = [v for v in graph.ops if not v.facts.free]
        if ops and len(ops) <= settings.ilp_max_ops and not _dp_is_exact(graph):
            glob = _global_step(graph, cands, chosen)
            if glob is not None and total_cost(graph, model, glob) < best:
                chosen = glob
        _break_ties(graph, cands, chosen)
    if seeds and cands.cap is None:
        chosen = _seeded(graph, cands, chosen, seeds)
    return _specs_of(graph, chosen)


def _tree_deps(graph: Graph, root: Node, members: set[Node], chosen: Mapping[Node, SpecInfo]) -> tuple[Any, ...]:
    """What :func:`_solve_tree` with ``downstream`` reads of the choices outside the tree: the
    output partition of each non-leaf input from another tree, and the partition each consumer
    of the root (where chosen) needs of it."""
    ins = tuple(chosen[u].out_id for v in members  # the same set each round: the same order
                for u in v.inputs if not u.facts.leaf and u not in members)
    outs = tuple(chosen[w].in_ids[slot] if w in chosen else None
                 for w in graph.users[root] for slot, u in enumerate(w.inputs) if u is root)
    return ins, outs


def _dp_is_exact(graph: Graph) -> bool:
    """Whether the tree DP's plan is already the cheapest over every op's candidates: every value
    but a fill is read once (one op in one slot, or as a graph output), so the graph is a forest
    of trees that share nothing, each solved exactly, and the DP's sum is the total cost (no
    input loaded for one reader and repartitioned for another, no replica shared). The ILP step
    chooses among a subset of the same candidates and is taken only when strictly cheaper, so it
    is skipped there (plans unchanged; an MLP or a chain then plans without HiGHS)."""
    reads = Counter(x for v in graph.nodes for x in v.inputs)
    reads.update(graph.outputs)
    return all(k <= 1 for x, k in reads.items() if not x.facts.free)


def _global_step(graph: Graph, cands: Candidates, chosen: dict[Node, SpecInfo]
                 ) -> dict[Node, SpecInfo] | None:
    """ILP over a candidate subset per op (the DAG-wide choice the DP's trees cannot make)."""
    keep, p = cands.settings.ilp_keep, cands.model.p
    strategies: dict[Node, list[SpecInfo]] = {}
    for v, info in chosen.items():
        options = cands(v)
        exact = [c for c in options if c.spec.num_kernels == p]
        rest = [c for c in options if c.spec.num_kernels != p]
        pool = sorted(exact, key=lambda c: c.op_bytes)[:keep]
        pool += sorted(rest, key=lambda c: c.op_bytes)[:max(0, keep - len(pool))]
        strategies[v] = [info] + [c for c in pool if c is not info]
    try:
        glob = choose(graph, cands.model, strategies, cands.settings.ilp_time_limit,
                      node_limit=cands.settings.ilp_node_limit,
                      lp_first=cands.settings.ilp_lp_first)
    except EinjoinError:  # HiGHS found nothing within its budget: keep the DP's plan
        return None
    if not glob:
        return None
    _local_search(graph, cands, glob)
    return glob


def exhaustive(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None,
               settings: Settings = SETTINGS, objective: str = "bytes") -> dict[Node, JoinAggSpec]:
    """Every combination of candidate specs (graphs of at most ``settings.exhaustive_max_ops``
    ops): ground truth. ``memory_limit`` and ``objective`` as for :func:`eindecomp`."""
    cands = _candidates(graph, cluster, memory_limit, settings, objective)
    ops = [n for n in graph.ops if not n.facts.free]
    if len(ops) > settings.exhaustive_max_ops:
        raise EinjoinError(f"exhaustive search takes at most {settings.exhaustive_max_ops} ops; "
                           f"this graph has {len(ops)}")
    best, best_choice = None, None
    for combo in itertools.product(*(cands(n) for n in ops)):
        chosen = dict(zip(ops, combo))
        c = total_cost(graph, cands.model, chosen)
        if best is None or c < best:
            best, best_choice = c, chosen
    assert best_choice is not None
    return _specs_of(graph, best_choice)
