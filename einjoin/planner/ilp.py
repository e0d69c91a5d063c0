"""Choosing one strategy (join-agg spec) per op as an integer linear program, solved by HiGHS
through ``scipy.optimize.milp``. The objective is exactly :func:`einjoin.planner.cost.total_cost`:
op bytes per op, repartition bytes per edge (linearised pair variables), replicas of one tensor
in one partition paid once. Used by the ``mesh_ilp`` baseline (strategies from device meshes) and
by ``eindecomp``'s global refinement (strategies from its own candidates).

A plan must depend on shapes alone, never on the machine's load, so HiGHS stops on WORK, not on
time: at most ``node_limit`` branch-and-bound nodes (``Settings.ilp_node_limit`` /
``mesh_ilp_node_limit``; HiGHS 1.12's branch and bound is serial and deterministic, its only
parallel part, symmetry detection, too), with costs scaled so that byte differences stay above
its tolerances (``Settings.ilp_cost_range``: with costs scaled to at most 1, two plans 192 bytes
apart in 4 GB were equal to HiGHS, and solves of the same problem in one process returned
either: the LLaMA-7B block's training graph at P = 16). Every planner ILP measured so far needs at most one
node (see the settings' docstrings), so the budget never binds on them; where it does bind, the
best solution within it is returned, again the same everywhere. A wall-clock ``time_limit``
remains only as a far safety net against a pathological solve: when it stops HiGHS first, the
result depends on the machine, and :class:`IlpTimeLimitWarning` says so (never silently).

>>> from einjoin.planner.ilp import stop_reason
>>> stop_reason(status=1, message="Time limit reached. (HiGHS Status 13: Time limit reached)",
...             nodes=7, node_limit=500)
'time_limit'
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.decomp.partition import Partition
from einjoin.planner.cost import CostModel, SpecInfo
from einjoin.settings import SETTINGS

__all__ = ["Problem", "problem", "objective", "solve", "solve_detail", "choose", "Solved",
           "IlpTimeLimitWarning", "stop_reason"]

Stop = Literal["optimal", "node_limit", "time_limit", "other"]


class IlpTimeLimitWarning(RuntimeWarning):
    """HiGHS hit the wall-clock safety net before its node budget: the plan may differ from the
    one a less loaded machine chooses (raise ``Settings.ilp_time_limit`` /
    ``mesh_ilp_time_limit``, or lower the node limit, for a plan from shapes alone)."""


@dataclass(frozen=True)
class Solved:
    """One ILP solve: the strategy index per op, the branch-and-bound nodes HiGHS explored, and
    why it stopped (``optimal``; ``node_limit``: the best within the deterministic budget;
    ``time_limit``: the safety net, machine-dependent; ``other``: HiGHS's message)."""

    pick: dict[Node, int]
    nodes: int
    stop: Stop

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
            need = [model.pid(b.ins[slot]) for b in sv]
            if u.facts.fed:
                c0 = graph.users[u][0]
                s0 = c0.inputs.index(u)
                if c0 is v and s0 == slot:
                    continue  # loaded as its first consumer needs it
                if c0 is v:
                    unary[v] = unary[v] + np.array(
                        [float(model.repart(i.ins[s0], i.ins[slot], u.dtype)) for i in sv])
                    continue
                have = [model.pid(a.ins[s0]) for a in strategies[c0]]
                add_pair(c0, v, _repart_matrix(model, have, need, u.dtype))
                continue
            have = [model.pid(a.out) for a in strategies[u]]
            add_pair(u, v, _repart_matrix(model, have, need, u.dtype))
    return Problem(ops, strategies, unary, pair, dict(replicas))


def _repart_matrix(model: CostModel, have: list[int], need: list[int], dtype: str) -> np.ndarray:
    """Repartition bytes from each of ``have`` to each of ``need`` (interned partition ids),
    each distinct pair computed once: many strategies share a partition."""
    hs, hi = np.unique(np.array(have), return_inverse=True)
    ns, ni = np.unique(np.array(need), return_inverse=True)
    qs = tuple(int(a) for a in hs)
    small = np.stack([model.repart_from(qs, int(b), dtype) for b in ns], axis=1).astype(float)
    return small[np.ix_(hi.reshape(-1), ni.reshape(-1))]


def objective(prob: Problem, pick: dict[Node, int]) -> float:
    """The ILP's objective for one choice per op (equals total_cost of that choice)."""
    total = sum(prob.unary[v][pick[v]] for v in prob.ops)
    total += sum(m[pick[a], pick[b]] for (a, b), m in prob.pair.items())
    total += sum(key[2] for key, readers in prob.replicas.items()
                 if any(pick[v] == j for v, j in readers))
    return float(total)


def stop_reason(*, status: int, message: str, nodes: int, node_limit: int) -> Stop:
    """Why HiGHS stopped, from ``scipy.optimize.milp``'s result: status 0 is optimal; a time-limit
    stop says so in the message (scipy's status 1 also covers iteration limits); a node-limit
    stop is HiGHS's "solution limit" (status 16, which scipy does not map), seen as the budget
    reached."""
    if status == 0:
        return "optimal"
    if "time limit" in message.lower():
        return "time_limit"
    if nodes >= node_limit:
        return "node_limit"
    return "other"


def solve(prob: Problem, time_limit: float, tight: bool = True, *,
          node_limit: int = SETTINGS.ilp_node_limit,
          lp_first: bool = SETTINGS.ilp_lp_first) -> dict[Node, int]:
    """The strategy index per op of :func:`solve_detail` (which see)."""
    return solve_detail(prob, time_limit=time_limit, tight=tight, node_limit=node_limit,
                        lp_first=lp_first).pick


def solve_detail(prob: Problem, *, time_limit: float, node_limit: int, tight: bool = True,
                 cost_range: float = SETTINGS.ilp_cost_range,
                 lp_first: bool = SETTINGS.ilp_lp_first) -> Solved:
    """Binary one-hot choices x_{v,i} (sum_i x_{v,i} = 1). For every edge (u, v) with a nonzero
    cost matrix and strategy pair (i, j), e_{uv,ij} stands for the product x_{u,i} x_{v,j},
    linearised as e >= x_{u,i} + x_{v,j} - 1 (the objective pushes it down) or, with ``tight``,
    by the marginals sum_j e_{ij} = x_{u,i} and sum_i e_{ij} = x_{v,j}, which imply that
    inequality and give the local-polytope relaxation (integral on trees; HiGHS mostly solves
    at the root). A replica group's y >= x_{v,j} for each reader, paid once. Minimise.
    With ``lp_first`` (``Settings.ilp_lp_first``) and ``tight``, a tighter exact formulation
    whose LP relaxation is tried first (:func:`_solve_lp_first`).

    Costs are scaled so that the largest is ``cost_range`` (``Settings.ilp_cost_range``).
    HiGHS stops at the optimum (``mip_rel_gap`` 0) or after ``node_limit`` branch-and-bound
    nodes (deterministic); ``time_limit`` seconds is the safety net, reported by an
    :class:`IlpTimeLimitWarning` when it stops the solve (see the module's docstring)."""
    if lp_first and tight:  # Settings.ilp_lp_first: see _solve_lp_first
        return _solve_lp_first(prob, time_limit=time_limit, node_limit=node_limit, tight=tight,
                               cost_range=cost_range)
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
    # the largest cost becomes cost_range: byte differences that decide between plans must stay
    # above HiGHS's tolerances (about 1e-7 absolute), or it returns any of several near-ties
    scale = max(1.0, float(c.max())) / cost_range
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
    return _run_milp(prob, col, n_x, c / scale, a_mat, lo, hi, node_limit=node_limit, time_limit=time_limit)


def _solve_lp_first(prob: Problem, *, time_limit: float, node_limit: int, tight: bool,
                    cost_range: float) -> Solved:
    """Binary one-hot choices x_{v,i} (sum_i x_{v,i} = 1). For every edge (u, v) with a nonzero
    cost matrix and strategy pair (i, j), e_{uv,ij} stands for the product x_{u,i} x_{v,j},
    linearised as e >= x_{u,i} + x_{v,j} - 1 (the objective pushes it down) or, with ``tight``,
    by the marginals sum_j e_{ij} = x_{u,i} and sum_i e_{ij} = x_{v,j}, which imply that
    inequality and give the local-polytope relaxation (integral on trees). With ``tight``,
    strategies of u whose rows of the edge's cost matrix are equal share one e per column
    (likewise v's equal columns): an exact merge, the relaxation's value unchanged (split a
    merged e in proportion to the x it stands for), with fewer variables. A replica group's
    y >= x_{v,j} for each reader, paid once; with ``tight``, y >= sum_j x_{v,j} over one op's
    readers (valid as v makes one choice, and tighter: it made the relaxation integral where
    per-reader rows left it fractional, the GPT-2 block's training graph). Minimise.

    Costs are scaled so that the largest is ``cost_range`` (``Settings.ilp_cost_range``).
    With ``tight`` the LP relaxation is solved first (dual simplex, deterministic): when its
    choices are integral they are an optimum of the ILP, taken without branch and bound
    (``nodes`` 0). Otherwise HiGHS's MIP solver stops at the optimum (``mip_rel_gap`` 0) or
    after ``node_limit`` branch-and-bound nodes (deterministic); ``time_limit`` seconds is the
    safety net, reported by an :class:`IlpTimeLimitWarning` when it stops the solve (see the
    module's docstring)."""
    col: dict[Node, int] = {}
    n = 0
    for v in prob.ops:
        col[v] = n
        n += len(prob.strategies[v])
    n_x = n
    cost = [np.concatenate([prob.unary[v] for v in prob.ops])]
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    bounds: list[tuple[int, float, float]] = []  # (row count, lower, upper) per run of rows
    n_rows = 0

    def add(r: np.ndarray, c: np.ndarray, val: float) -> None:
        rows.append(n_rows + r)
        cols.append(c)
        vals.append(np.full(len(c), val))

    for v in prob.ops:  # one choice per op
        k = len(prob.strategies[v])
        add(np.zeros(k, dtype=np.int64), col[v] + np.arange(k), 1.0)
        bounds.append((1, 1.0, 1.0))
        n_rows += 1
    for (a, b), m in prob.pair.items():
        if not m.any():
            continue  # nothing to pay whatever both choose
        if tight:
            small, ri = np.unique(m, axis=0, return_inverse=True)
            small, ci = np.unique(small, axis=1, return_inverse=True)
            ri, ci = ri.reshape(-1), ci.reshape(-1)
            na, nb = small.shape
            e = n + np.arange(na * nb)
            add(np.repeat(np.arange(na), nb), e, 1.0)  # sum_Q e_PQ = sum_{i in P} x_{a,i}
            add(ri, col[a] + np.arange(m.shape[0]), -1.0)
            add(na + np.tile(np.arange(nb), na), e, 1.0)  # sum_P e_PQ = sum_{j in Q} x_{b,j}
            add(na + ci, col[b] + np.arange(m.shape[1]), -1.0)
            bounds.append((na + nb, 0.0, 0.0))
            n_rows += na + nb
            cost.append(small.reshape(-1))
            n += small.size
        else:
            ii, jj = np.nonzero(m)
            r = np.arange(len(ii))
            add(r, col[a] + ii, 1.0)
            add(r, col[b] + jj, 1.0)
            add(r, n + ii * m.shape[1] + jj, -1.0)
            bounds.append((len(ii), -np.inf, 1.0))
            n_rows += len(ii)
            cost.append(m.reshape(-1))
            n += m.size
    for key, readers in prob.replicas.items():
        by_op: dict[Node, list[int]] = defaultdict(list)
        for v, j in readers:
            by_op[v].append(j)
        if tight:
            for v, reads in by_op.items():
                # one row per op over its distinct strategies: an op may read the same replica
                # in several ways (an einsum reading one input thrice), and a repeated x in the
                # row would add up (y >= 2 x: infeasible with y <= 1)
                js = sorted(set(reads))
                add(np.zeros(1 + len(js), dtype=np.int64),
                    np.array([n] + [col[v] + j for j in js]), -1.0)
                vals[-1][0] = 1.0
                bounds.append((1, 0.0, np.inf))
                n_rows += 1
        else:
            for v, j in readers:
                add(np.zeros(2, dtype=np.int64), np.array([n, col[v] + j]), -1.0)
                vals[-1][0] = 1.0
                bounds.append((1, 0.0, np.inf))
                n_rows += 1
        cost.append(np.array([float(key[2])]))
        n += 1
    c = np.concatenate(cost)
    lo = np.concatenate([np.full(k, lb) for k, lb, _ in bounds])
    hi = np.concatenate([np.full(k, ub) for k, _, ub in bounds])
    coo = Coo(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), n_rows)
    # the largest cost becomes cost_range: byte differences that decide between plans must stay
    # above HiGHS's tolerances (about 1e-7 absolute), or it returns any of several near-ties
    scale = max(1.0, float(c.max())) / cost_range
    if tight:
        pick = _integral_relaxation(prob, col, c / scale, coo, lo, hi, time_limit)
        if pick is not None:
            return Solved(pick, 0, "optimal")
    from scipy.sparse import coo_matrix

    a_mat = coo_matrix((coo.vals, (coo.rows, coo.cols)), shape=(n_rows, n)).tocsr()
    return _run_milp(prob, col, n_x, c / scale, a_mat, lo, hi, node_limit=node_limit, time_limit=time_limit)


def _run_milp(prob: Problem, col: dict[Node, int], n_x: int, c: np.ndarray, a_mat: Any, lo: Any,
              hi: Any, *, node_limit: int, time_limit: float) -> Solved:
    """HiGHS's MIP solver on ``min c.x`` subject to ``lo <= a_mat x <= hi``, x in [0, 1], the first
    ``n_x`` variables (the choices) binary: stops at the optimum or after ``node_limit`` nodes;
    hitting ``time_limit`` warns (:class:`IlpTimeLimitWarning`)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(c)
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    res = milp(c, constraints=LinearConstraint(a_mat, lo, hi), integrality=integrality,
               bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0, "node_limit": node_limit,
                                             "time_limit": time_limit})
    nodes = int(res.mip_node_count or 0)
    stop = stop_reason(status=int(res.status), message=str(res.message), nodes=nodes,
                       node_limit=node_limit)
    if stop == "time_limit":
        warnings.warn(IlpTimeLimitWarning(
            f"spec ILP ({len(prob.ops)} ops, {n} variables): HiGHS hit the {time_limit:g} s "
            f"safety net after {nodes} of its {node_limit} branch-and-bound nodes, so this plan "
            f"depends on the machine's speed and load; raise the time limit "
            f"(Settings.ilp_time_limit / mesh_ilp_time_limit) for a plan from shapes alone"),
            stacklevel=2)
    if res.x is None:
        raise EinjoinError(f"spec ILP: HiGHS found no solution ({res.message})")
    pick = {v: int(np.argmax(res.x[col[v]:col[v] + len(prob.strategies[v])])) for v in prob.ops}
    return Solved(pick, nodes, stop)


INTEGRAL_TOL = 1e-7
"""How far from 0 or 1 a choice of the LP relaxation may be and still count as integral (below
HiGHS's own MIP feasibility tolerance, 1e-6)."""


def _integral_relaxation(prob: Problem, col: dict[Node, int], c: np.ndarray, a_mat: Coo,
                         lo: np.ndarray, hi: np.ndarray, time_limit: float
                         ) -> dict[Node, int] | None:
    """The choice per op of the LP relaxation's optimum when every choice in it is integral
    (then it is an optimum of the ILP: no branch and bound needed), else None. Dual simplex
    without presolve: deterministic, and the fastest HiGHS LP path measured on the planner's
    problems (GPT-2 block's training graph: 0.2 s, against 0.4 s with presolve, 2 s by
    interior point and 1.1 s for the MIP solver's root). The inequality rows (``lo < hi``, here
    ``hi`` is infinite) are passed as ``-a x <= -lo``, then the equality rows: linprog's model."""
    eq = lo == hi
    sol = _dual_simplex(c, a_mat.take(~eq, -1.0), -lo[~eq], a_mat.take(eq, 1.0), lo[eq], time_limit)
    if sol is None:
        return None
    pick: dict[Node, int] = {}
    for v in prob.ops:
        x = sol[col[v]:col[v] + len(prob.strategies[v])]
        j = int(np.argmax(x))
        if x[j] < 1.0 - INTEGRAL_TOL:
            return None  # fractional: branch and bound decides
        pick[v] = j
    return pick


@dataclass(frozen=True)
class Coo:
    """A sparse matrix as numpy triplets (entry ``k`` is ``vals[k]`` at ``(rows[k], cols[k])``;
    repeated positions add up) with ``n_rows`` rows: the LP path builds and hands it to HiGHS
    without importing scipy.sparse (0.3-0.6 s of a fresh process's first plan).

    >>> Coo(np.array([1, 0]), np.array([0, 2]), np.array([5.0, 7.0]), 2).csc(3)
    (array([0, 1, 1, 2], dtype=int32), array([1, 0], dtype=int32), array([5., 7.]))
    """

    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray
    n_rows: int

    def take(self, keep: np.ndarray, sign: float) -> Coo:
        """The rows where ``keep`` (a bool per row), renumbered in order, times ``sign``."""
        new = np.cumsum(keep) - 1
        at = keep[self.rows]
        return Coo(new[self.rows[at]], self.cols[at], sign * self.vals[at], int(keep.sum()))

    @staticmethod
    def stack(top: Coo, bottom: Coo) -> Coo:
        """``top``'s rows, then ``bottom``'s."""
        return Coo(np.concatenate((top.rows, bottom.rows + top.n_rows)), np.concatenate((top.cols, bottom.cols)),
                   np.concatenate((top.vals, bottom.vals)), top.n_rows + bottom.n_rows)

    def csc(self, n_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Column-wise compressed (start, index, value), rows ascending in each column and
        repeated positions summed: the arrays scipy's ``csc_array`` of the same matrix holds
        (explicit zeros kept, as there)."""
        key = self.cols.astype(np.int64) * max(self.n_rows, 1) + self.rows
        order = np.argsort(key, kind="stable")
        key, vals = key[order], self.vals[order]
        if key.size and (np.diff(key) == 0).any():  # repeated positions: sum them
            key, inv = np.unique(key, return_inverse=True)
            vals = np.bincount(inv.reshape(-1), weights=vals, minlength=key.size)
        rows = key % max(self.n_rows, 1)
        start = np.zeros(n_cols + 1, dtype=np.int64)
        np.cumsum(np.bincount(key // max(self.n_rows, 1), minlength=n_cols), out=start[1:])
        return start.astype(np.int32), rows.astype(np.int32), np.asarray(vals, dtype=float)

    def dense(self, n_cols: int) -> np.ndarray:
        """The matrix as a numpy array (tests, small problems)."""
        out = np.zeros((self.n_rows, n_cols))
        np.add.at(out, (self.rows, self.cols), self.vals)
        return out


def _highs_core() -> Any:
    """scipy's HiGHS binding (``scipy.optimize._highspy._core``, private), loaded from its file
    without running ``scipy/optimize/__init__`` (a fresh process spends 0.7-1.3 s there, mostly
    parsing docstrings; the binding alone loads in ~30 ms). Registered under its own name, so a
    later ``import scipy.optimize`` uses this module. Raises ImportError where it is not found."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    name = "scipy.optimize._highspy._core"
    if name in sys.modules:
        return sys.modules[name]
    scipy = importlib.util.find_spec("scipy")
    if scipy is None or scipy.origin is None:
        raise ImportError("scipy not found")
    folder = os.path.join(os.path.dirname(scipy.origin), "optimize", "_highspy")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_core" + suffix)
        if os.path.exists(path):
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            if spec is None:
                break
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            sys.modules[name] = module
            return module
    from scipy.optimize._highspy import _core  # laid out otherwise: the ordinary import

    return _core


def _dual_simplex(c: np.ndarray, a_ub: Coo, b_ub: np.ndarray, a_eq: Coo, b_eq: np.ndarray,
                  time_limit: float) -> np.ndarray | None:
    """``x`` minimising ``c.x`` subject to ``a_ub x <= b_ub``, ``a_eq x = b_eq``, ``0 <= x <= 1``, by
    HiGHS's dual simplex without presolve, or None when it ends without an optimum: what
    ``scipy.optimize.linprog(..., method="highs-ds", options={"presolve": False})`` computes, from
    the same model (the same arrays) and options, so the same vertex. HiGHS is called through
    scipy's own binding (:func:`_highs_core`): linprog's wrapper loops in Python over every
    column for marginals the planner never reads (a third of the LP's time on the demo's LLaMA
    block, 75k columns), and importing it costs a fresh process more than the whole solve.
    Where that binding is not as expected, linprog itself."""
    n = c.size
    try:
        hi = _highs_core()
        start, index, value = Coo.stack(a_ub, a_eq).csc(n)
        lp, m = hi.HighsLp(), a_ub.n_rows + a_eq.n_rows
        lp.num_col_ = lp.a_matrix_.num_col_ = n
        lp.num_row_ = lp.a_matrix_.num_row_ = m
        lp.a_matrix_.format_ = hi.MatrixFormat.kColwise
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = c, np.zeros(n), np.ones(n)
        big = hi.kHighsInf  # HiGHS's infinity (linprog replaces np.inf so too)
        lp.row_lower_ = np.clip(np.concatenate((np.full(len(b_ub), -np.inf), b_eq)), -big, big)
        lp.row_upper_ = np.clip(np.concatenate((b_ub, b_eq)), -big, big)
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = start, index, value
        opts = hi.HighsOptions()
        opts.presolve, opts.solver, opts.time_limit = "off", "simplex", time_limit
        opts.simplex_strategy = hi.simplex_constants.SimplexStrategy.kSimplexStrategyDual
        opts.highs_debug_level = hi.HighsDebugLevel.kHighsDebugLevelNone
        opts.log_to_console = opts.output_flag = False
        highs = hi._Highs()
        if hi.HighsStatus.kError in (highs.passOptions(opts), highs.passModel(lp), highs.run()):
            return None
        if highs.getModelStatus() != hi.HighsModelStatus.kOptimal:
            return None
        return np.array(highs.getSolution().col_value)
    except (ImportError, AttributeError, TypeError):  # scipy's private binding changed
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix

        def sparse(a: Coo) -> Any:
            return coo_matrix((a.vals, (a.rows, a.cols)), shape=(a.n_rows, n)).tocsr()
        res = linprog(c, A_ub=sparse(a_ub), b_ub=b_ub, A_eq=sparse(a_eq), b_eq=b_eq, bounds=(0, 1),
                      method="highs-ds", options={"presolve": False, "time_limit": time_limit})
        return None if res.status != 0 or res.x is None else np.asarray(res.x)


def choose(graph: Graph, model: CostModel, strategies: dict[Node, list[SpecInfo]],
           time_limit: float = SETTINGS.ilp_time_limit, tight: bool = True, *,
           node_limit: int = SETTINGS.ilp_node_limit,
           lp_first: bool = SETTINGS.ilp_lp_first) -> dict[Node, SpecInfo]:
    """The cheapest choice of one strategy per op (within ``node_limit`` branch-and-bound
    nodes; ``time_limit`` seconds as the safety net, see :func:`solve_detail`)."""
    prob = problem(graph, model, strategies)
    if not prob.ops:
        return {}
    pick = solve(prob, time_limit, tight, node_limit=node_limit, lp_first=lp_first)
    return {v: prob.strategies[v][j] for v, j in pick.items()}
