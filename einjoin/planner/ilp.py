"""Choosing one strategy (join-agg spec) per op as an integer linear program, solved by HiGHS
through ``scipy.optimize.milp``. The objective is exactly :func:`einjoin.planner.cost.total_cost`:
op bytes per op, repartition bytes per edge (linearised pair variables), replicas of one tensor
in one partition paid once. Used by the ``mesh_ilp`` baseline (strategies from device meshes) and
by ``eindecomp``'s global refinement (strategies from its own candidates).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.decomp.partition import Partition
from einjoin.planner.cost import CostModel, SpecInfo

__all__ = ["Problem", "problem", "objective", "solve", "choose"]

ReplicaKey = tuple[Node, Partition, int]  # a tensor, the partition it is read in, its replica bytes


@dataclass
class Problem:
    """ILP data: per op its strategies and their own costs (aggregation, plus the
    join replicas where the cost model has no shared replicas), pair costs between two ops'
    choices, and replica groups: tensor u read in one partition with one replication, counted
    once however many (op, strategy, slot) read it."""

    ops: list[Node]
    strategies: dict[Node, list[SpecInfo]]
    unary: dict[Node, np.ndarray]
    pair: dict[tuple[Node, Node], np.ndarray]
    replicas: dict[ReplicaKey, list[tuple[Node, int]]]  # (u, partition, bytes) -> [(op, strategy)]


def problem(graph: Graph, model: CostModel, strategies: dict[Node, list[SpecInfo]]) -> Problem:
    """The ILP data for choosing one of ``strategies[v]`` for every op ``v`` (fills excluded)."""
    ops = [v for v in graph.ops if not v.facts.free]
    pos = {v: i for i, v in enumerate(ops)}
    shared = all(hasattr(i, "join_in") for infos in strategies.values() for i in infos)
    unary = {v: np.array([float(i.agg_bytes if shared else i.op_bytes) for i in strategies[v]])
             for v in ops}
    pair: dict[tuple[Node, Node], np.ndarray] = {}
    replicas: dict[ReplicaKey, list[tuple[Node, int]]] = defaultdict(list)

    def add_pair(a: Node, b: Node, m: np.ndarray) -> None:
        if pos[a] > pos[b]:
            a, b, m = b, a, m.T
        pair[(a, b)] = pair[(a, b)] + m if (a, b) in pair else m

    for v in ops:
        sv = strategies[v]
        for slot, u in enumerate(v.inputs):
            if u.facts.free:
                continue
            if shared:
                for j, info in enumerate(sv):
                    if info.join_in[slot]:
                        replicas[(u, info.ins[slot], info.join_in[slot])].append((v, j))
            if u.facts.fed:
                c0 = graph.users[u][0]
                s0 = c0.inputs.index(u)
                if c0 is v and s0 == slot:
                    continue  # loaded as its first consumer needs it
                if c0 is v:
                    unary[v] = unary[v] + np.array(
                        [float(model.repart(i.ins[s0], i.ins[slot], u.dtype)) for i in sv])
                    continue
                add_pair(c0, v, np.array([[float(model.repart(a.ins[s0], b.ins[slot], u.dtype))
                                           for b in sv] for a in strategies[c0]]))
                continue
            add_pair(u, v, np.array([[float(model.repart(a.out, b.ins[slot], u.dtype)) for b in sv]
                                     for a in strategies[u]]))
    return Problem(ops, strategies, unary, pair, dict(replicas))


def objective(prob: Problem, pick: dict[Node, int]) -> float:
    """The ILP's objective for one choice per op (equals total_cost of that choice)."""
    total = sum(prob.unary[v][pick[v]] for v in prob.ops)
    total += sum(m[pick[a], pick[b]] for (a, b), m in prob.pair.items())
    total += sum(key[2] for key, readers in prob.replicas.items()
                 if any(pick[v] == j for v, j in readers))
    return float(total)


def solve(prob: Problem, time_limit: float, tight: bool = True) -> dict[Node, int]:
    """Binary one-hot choices x_{v,i} (sum_i x_{v,i} = 1). For every edge (u, v) with a nonzero
    cost matrix and strategy pair (i, j), e_{uv,ij} stands for the product x_{u,i} x_{v,j},
    linearised as e >= x_{u,i} + x_{v,j} - 1 (the objective pushes it down) or, with ``tight``,
    by the marginals sum_j e_{ij} = x_{u,i} and sum_i e_{ij} = x_{v,j}, which imply that
    inequality and give the local-polytope relaxation (integral on trees; HiGHS mostly solves
    at the root). A replica group's y >= x_{v,j} for each reader, paid once. Minimise."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    col: dict[Node, int] = {}
    n = 0
    for v in prob.ops:
        col[v] = n
        n += len(prob.strategies[v])
    n_x = n
    cost = [np.concatenate([prob.unary[v] for v in prob.ops])]
    blocks = []
    for (a, b), m in prob.pair.items():
        if not m.any():
            continue  # nothing to pay whatever both choose
        blocks.append((a, b, m, n))
        cost.append(m.reshape(-1))
        n += m.size
    groups = []
    for key, readers in prob.replicas.items():
        groups.append((readers, n))
        cost.append(np.array([float(key[2])]))
        n += 1
    c = np.concatenate(cost)
    scale = max(1.0, float(c.max()))
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for j, val in entries:
            rows.append(r)
            cols.append(j)
            vals.append(val)
        lo.append(lb)
        hi.append(ub)

    for v in prob.ops:
        row([(col[v] + i, 1.0) for i in range(len(prob.strategies[v]))], 1.0, 1.0)
    for a, b, m, off in blocks:
        na, nb = m.shape
        if tight:
            for i in range(na):
                row([(off + i * nb + j, 1.0) for j in range(nb)] + [(col[a] + i, -1.0)], 0.0, 0.0)
            for j in range(nb):
                row([(off + i * nb + j, 1.0) for i in range(na)] + [(col[b] + j, -1.0)], 0.0, 0.0)
        else:
            for i in range(na):
                for j in range(nb):
                    if m[i, j]:
                        row([(col[a] + i, 1.0), (col[b] + j, 1.0), (off + i * nb + j, -1.0)],
                            -np.inf, 1.0)
    for readers, off in groups:
        for v, j in readers:
            row([(off, 1.0), (col[v] + j, -1.0)], 0.0, np.inf)
    a_mat = coo_matrix((vals, (rows, cols)), shape=(len(lo), n)).tocsr()
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    res = milp(c / scale, constraints=LinearConstraint(a_mat, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0, "time_limit": time_limit})
    if res.x is None:
        raise EinjoinError(f"spec ILP: HiGHS found no solution ({res.message})")
    return {v: int(np.argmax(res.x[col[v]:col[v] + len(prob.strategies[v])])) for v in prob.ops}


def choose(graph: Graph, model: CostModel, strategies: dict[Node, list[SpecInfo]],
           time_limit: float = 60.0, tight: bool = True) -> dict[Node, SpecInfo]:
    """The cheapest choice of one strategy per op."""
    prob = problem(graph, model, strategies)
    if not prob.ops:
        return {}
    pick = solve(prob, time_limit, tight)
    return {v: prob.strategies[v][j] for v, j in pick.items()}
