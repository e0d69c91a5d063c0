"""``doppler``: a learned dual policy that places kernels (issue 23; DOPPLER, arXiv 2505.23131).

A rollout walks the kernels of every op (the tasks) as a list scheduler does. **SEL** picks the
next task among those whose inputs are all placed; **PLC** picks its device among the allowed
ones (at most ceil(K/P) kernels of an op per device, partials of one block apart where possible:
the affinity placers' rules). Both are linear scoring networks over features of the task graph
and of the rollout's state, taking the best-scoring choice:

- SEL, per ready task: its bottom level (the longest modelled time from its start to the graph's
  end), its topological position, its run time, its number of successors;
- PLC, per allowed device: CP's nominal finish time there (the teacher's own criterion), the
  finish time on the cluster's time model (kernel roofline, links, the device's lane and ports),
  the fraction of the bytes it reads that would move there and that would cross groups (nodes),
  the device's lane backlog, the op's kernels already on it, and its id (the teacher breaks ties
  by the lowest).

Training (``bench/doppler_train.py``, seeded): first imitation of the critical-path teacher
(softmax regression on its decisions along its own rollouts over generated graphs), then a
cross-entropy search over the weights scored by the simulator's makespan on those graphs,
keeping the best. The result is committed as ``doppler_policy.json`` (a few hundred bytes);
:data:`POLICY` is loaded from it.

Placing a graph (``place("doppler", ...)``): the committed policy's rollout, then a (1+1)
evolution of its weights on this graph for ``budget`` evaluations of ``score`` (a drawn policy
whose placement was seen already costs a rollout, not an evaluation; at most 3 x budget draws) (lower is better;
default the :class:`~einjoin.placement.search.Estimate`; ``ej.compile`` on a cluster with a time
model passes the simulated makespan, as for ``"search"``), keeping the best placement seen.
Deterministic for a seed.

>>> import einjoin as ej
>>> x = ej.input("x", (256, 128), "bfloat16")
>>> z = ej.relu(x @ ej.param("w", (128, 256), "bfloat16"))
>>> decomps = {n: ej.decompose(n, {"m": 4} if n is z.node.inputs[0] else None) for n in ej.Graph([z]).nodes}
>>> cl = ej.Cluster.preset("dgx-a100", devices=4)
>>> pl = doppler(decomps, cl, budget=4)
>>> pl == doppler(decomps, cl, budget=4), len(pl[z.node.inputs[0]].kernel_devices)
(True, 4)
"""

from __future__ import annotations

import heapq
import json
import math
import pathlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.flops import kernel_flops
from einjoin.decomp.partition import BlockKey
from einjoin.errors import EinjoinError
from einjoin.ir.node import Node
from einjoin.placement.affinity import NOMINAL_RATE
from einjoin.placement.base import NodePlacement, Placement, _from_kernel_devices, register_placer, round_robin
from einjoin.placement.homes import settle_homes
from einjoin.placement.search import Estimate, Score

__all__ = ["Policy", "POLICY", "TEACHER", "Rollout", "doppler", "imitate", "improve", "DEFAULT_BUDGET"]

SEL_FEATURES = ("bottom level", "topological position", "run time", "successors")
PLC_FEATURES = ("CP's nominal finish", "modelled finish", "bytes moved", "bytes across groups",
                "lane backlog", "op's kernels here", "finish over run", "device id")
DEFAULT_BUDGET = 60  # evaluations of the score per graph, as search's (the simulator's: ~0.1-0.7 s each, LLaMA block)
STEP = 1.0  # the evolution's first step size per weight (each head's weights scaled to at most 1 in size)
_POLICY_FILE = pathlib.Path(__file__).with_name("doppler_policy.json")


@dataclass(frozen=True)
class Policy:
    """The weights of SEL (one per :data:`SEL_FEATURES`) and PLC (one per :data:`PLC_FEATURES`).

    >>> Policy((0.0, 1.0, 0.0, 0.0), (-1.0,) + (0.0,) * 7).flat()[:5]
    (0.0, 1.0, 0.0, 0.0, -1.0)
    """

    sel: tuple[float, ...]
    plc: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.sel) != len(SEL_FEATURES) or len(self.plc) != len(PLC_FEATURES):
            raise EinjoinError(f"doppler policy: {len(self.sel)} SEL and {len(self.plc)} PLC weights, want "
                               f"{len(SEL_FEATURES)} and {len(PLC_FEATURES)}")

    def flat(self) -> tuple[float, ...]:
        return self.sel + self.plc

    @staticmethod
    def of(flat: Sequence[float]) -> Policy:
        n = len(SEL_FEATURES)
        return Policy(tuple(float(v) for v in flat[:n]), tuple(float(v) for v in flat[n:]))

    def to_json(self) -> dict[str, list[float]]:
        return {"sel": [round(v, 6) for v in self.sel], "plc": [round(v, 6) for v in self.plc]}


# the critical-path teacher as a policy: the topological order, the earliest nominal finish
TEACHER = Policy((0.0, 1.0, 0.0, 0.0), (-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))


def _load_policy() -> Policy:
    try:
        data = json.loads(_POLICY_FILE.read_text())
        return Policy(tuple(data["sel"]), tuple(data["plc"]))
    except (OSError, ValueError, KeyError, TypeError, EinjoinError):  # pragma: no cover - a broken install
        return TEACHER


POLICY = _load_policy()


class Rollout:
    """The task graph of ``decomps``' kernels on ``cluster`` and rollouts of policies over it.

    ``run(policy)`` gives each op's kernel devices; ``placement(devs)`` the whole placement
    (graph inputs homed where first read, summed blocks homed by :func:`settle_homes`);
    ``record=True`` also keeps every decision (features, choice) for imitation.

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    >>> decomps = {n: ej.decompose(n, {"m": 2, "k": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> r = Rollout(decomps, ej.Cluster.preset("dgx-a100", devices=2))
    >>> from einjoin.placement import place
    >>> cp = place("critical_path", decomps, r.cluster)[z.node].kernel_devices   # the teacher's own run
    >>> len(r.tasks), r.run(TEACHER)[z.node] == list(cp)
    (4, True)
    """

    def __init__(self, decomps: Mapping[Node, Decomposition], cluster: Cluster):
        self.decomps, self.cluster = decomps, cluster
        est = Estimate(decomps, cluster)
        self.p, self.link, self.groups = est.p, est._link, est._fast
        # tasks in topological order: (op index, kernel index, runs per device, pieces, nominal run)
        self.ops = est.ops
        self.tasks: list[tuple[int, int, tuple[float, ...], list[tuple[Node, BlockKey, int]], float]] = []
        producers: dict[tuple[Node, BlockKey], list[int]] = {}
        self.partials: dict[tuple[Node, BlockKey], int] = {}
        for oi, (node, d, kernels, _) in enumerate(self.ops):
            for j, (k, (runs, pieces)) in enumerate(zip(d.kernels, kernels)):
                producers.setdefault((node, k.out_key), []).append(len(self.tasks))
                self.tasks.append((oi, j, runs, pieces, kernel_flops(d, k.index) / NOMINAL_RATE))
        for key, ts in producers.items():
            self.partials[key] = len(ts)
        n = len(self.tasks)
        self.deps: list[list[int]] = [[] for _ in range(n)]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for t, (_, _, _, pieces, _) in enumerate(self.tasks):
            seen: set[int] = set()
            for x, pk, _ in pieces:
                for s in producers.get((x, pk), ()):
                    if s not in seen:
                        seen.add(s)
                        self.deps[t].append(s)
                        self.succs[s].append(t)
        # static SEL features: bottom level (mean run over devices plus successors'), position, run, successors
        mean = [sum(runs) / len(runs) for _, _, runs, _, _ in self.tasks]
        blevel = [0.0] * n
        for t in range(n - 1, -1, -1):
            blevel[t] = mean[t] + max((blevel[s] for s in self.succs[t]), default=0.0)
        top_b, top_run = max(blevel, default=1.0) or 1.0, max(mean, default=1.0) or 1.0
        top_s = max((len(s) for s in self.succs), default=1) or 1
        self.sel_features = [(blevel[t] / top_b, -t / max(n, 1), mean[t] / top_run, len(self.succs[t]) / top_s)
                             for t in range(n)]

    def run(self, policy: Policy, record: bool = False
            ) -> dict[Node, list[int]]:
        """Each op's kernel devices as ``policy`` places them (decisions in ``self.decisions``
        when ``record``: SEL's (ready tasks' features, chosen index) and PLC's likewise)."""
        p, link, groups = self.p, self.link, self.groups
        sel_w, plc_w = policy.sel, policy.plc
        self.decisions: tuple[list[tuple[list[tuple[float, ...]], int]], list[tuple[list[tuple[float, ...]], int]]] \
            = ([], [])
        n = len(self.tasks)
        waiting = [len(ds) for ds in self.deps]
        ready: list[tuple[float, int]] = []
        for t in range(n):
            if not waiting[t]:
                heapq.heappush(ready, (-_dot(sel_w, self.sel_features[t]), t))
        devs: dict[int, list[int]] = {oi: [-1] * len(op[1].kernels) for oi, op in enumerate(self.ops)}
        load: dict[int, list[int]] = {}
        taken: dict[tuple[int, BlockKey], set[int]] = {}
        # CP's nominal state (the teacher's feature) and the time model's
        nom_free = [0.0] * p
        nom_block: dict[tuple[Node, BlockKey], float] = {}
        free, port_out, port_in = [0.0] * p, [0.0] * p, [0.0] * p
        block: dict[tuple[Node, BlockKey], tuple[float, int]] = {}  # when and where a block is whole
        held: dict[tuple[Node, BlockKey], dict[int, float]] = {}   # devices with a copy -> since when
        parts: dict[tuple[Node, BlockKey], list[tuple[float, int]]] = {}
        while ready:
            if record:
                self.decisions[0].append((sorted(self.sel_features[t] for _, t in ready), 0))
                choice = min(ready)[1]
                self.decisions[0][-1] = (self.decisions[0][-1][0],
                                         self.decisions[0][-1][0].index(self.sel_features[choice]))
            _, t = heapq.heappop(ready)
            oi, j, runs, pieces, nom_run = self.tasks[t]
            node, d, _, block_bytes = self.ops[oi]
            k = d.kernels[j]
            cap = -(-len(d.kernels) // p)
            ld = load.setdefault(oi, [0] * p)
            tk = taken.setdefault((oi, k.out_key), set())
            below = [dv for dv in range(p) if ld[dv] < cap] or list(range(p))
            allowed = [dv for dv in below if dv not in tk] or below
            total = sum(b for _, _, b in pieces) or 1
            feats = []
            nom_fin, fin = [], []
            for dv in allowed:
                na = ra = 0.0
                moved = across = 0
                for x, pk, nbytes in pieces:
                    h = held.get((x, pk))
                    if not h:
                        continue  # a graph input nobody read yet: homed where first read
                    nt = nom_block.get((x, pk), 0.0)
                    when, src = block.get((x, pk), (0.0, -1))
                    if dv in h:
                        rt = h[dv]
                    else:
                        srcs = min(h)
                        nt += self.cluster.transfer_time(srcs, dv, nbytes)
                        rt = max(when, port_out[src], port_in[dv]) + link(src, dv, nbytes)
                        moved += nbytes
                        across += nbytes if groups[src] != groups[dv] else 0
                    na, ra = max(na, nt), max(ra, rt)
                nom_fin.append(max(nom_free[dv], na) + nom_run)
                fin.append(max(free[dv], ra) + runs[dv])
                feats.append([0.0, 0.0, moved / total, across / total, free[dv], ld[dv] / cap, 0.0, dv / p])
            lo_n, hi_n, lo_f, hi_f = min(nom_fin), max(nom_fin), min(fin), max(fin)
            lo_free = min(free[dv] for dv in allowed)
            span_free = max(free[dv] for dv in allowed) - lo_free
            for f, nf, rf in zip(feats, nom_fin, fin):
                f[0] = (nf - lo_n) / (hi_n - lo_n) if hi_n > lo_n else 0.0
                f[1] = (rf - lo_f) / (hi_f - lo_f) if hi_f > lo_f else 0.0
                f[4] = (f[4] - lo_free) / span_free if span_free > 0 else 0.0
                f[6] = min((rf - lo_f) / (min(runs) + 1e-12), 10.0) / 10.0
            scores = [_dot(plc_w, f) for f in feats]
            i = max(range(len(allowed)), key=lambda i: (scores[i], -i))
            if record:
                teacher = min(range(len(allowed)), key=lambda i: (nom_fin[i], i))
                self.decisions[1].append(([tuple(f) for f in feats], teacher))
            dv = allowed[i]
            # commit: the teacher's nominal state, then the time model's (copies over the ports)
            nom_free[dv] = nom_fin[i]
            key = (node, k.out_key)
            nom_block[key] = max(nom_block.get(key, 0.0), nom_fin[i])
            arrive = 0.0
            for x, pk, nbytes in pieces:
                h = held.setdefault((x, pk), {})
                if not h:
                    h[dv] = 0.0
                    block[(x, pk)] = (0.0, dv)
                if dv not in h:
                    when, src = block[(x, pk)]
                    start = max(when, port_out[src], port_in[dv])
                    port_out[src] = port_in[dv] = h[dv] = start + link(src, dv, nbytes)
                arrive = max(arrive, h[dv])
            done = free[dv] = max(free[dv], arrive) + runs[dv]
            devs[oi][j] = dv
            ld[dv] += 1
            tk.add(dv)
            got = parts.setdefault(key, [])
            got.append((done, dv))
            if len(got) == self.partials[key]:
                home = got[0][1]
                when = 0.0
                for tdone, pdv in got:
                    if pdv != home:
                        start = max(tdone, port_out[pdv], port_in[home])
                        port_out[pdv] = port_in[home] = tdone = start + link(pdv, home, block_bytes)
                    when = max(when, tdone)
                block[key] = (when, home)
                held[key] = {home: when}
            for s in self.succs[t]:
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(ready, (-_dot(sel_w, self.sel_features[s]), s))
        return {self.ops[oi][0]: ds for oi, ds in devs.items()}

    def placement(self, devs: Mapping[Node, list[int]]) -> Placement:
        """The placement with these kernel devices: a graph input's block homed where it is first
        read (else round robin), free inputs round robin, summed blocks settled."""
        out: Placement = {}
        first: dict[tuple[Node, BlockKey], int] = {}
        for node, d in self.decomps.items():
            if node in devs:
                out[node] = _from_kernel_devices(d, devs[node])
        for oi, j, _, pieces, _ in self.tasks:
            node = self.ops[oi][0]
            for x, pk, _ in pieces:
                first.setdefault((x, pk), devs[node][j])
        for node, d in self.decomps.items():
            if node in out:
                continue
            rr = round_robin({node: d}, self.cluster)[node]
            if node.facts.fed:
                h = {key: first.get((node, key), rr.homes[key]) for key in d.out_partition.keys()}
                out[node] = NodePlacement(tuple(h[k.out_key] for k in d.kernels), h)
            else:
                out[node] = rr
        return settle_homes(self.decomps, {node: out[node] for node in self.decomps}, self.p)


def _unit(policy: Policy) -> Policy:
    """The same policy (its choices are argmaxes) with each head's largest weight 1 in size, so
    that one step size suits every policy the searches start from."""
    def scaled(w: tuple[float, ...]) -> tuple[float, ...]:
        top = max((abs(v) for v in w), default=0.0)
        return tuple(v / top for v in w) if top > 0 else w
    return Policy(scaled(policy.sel), scaled(policy.plc))


def _dot(w: Sequence[float], f: Sequence[float]) -> float:
    return sum(a * b for a, b in zip(w, f))


def imitate(rollouts: Sequence[Rollout], steps: int = 2000, rate: float = 10.0
            ) -> tuple[Policy, tuple[float, float, float]]:
    """The policy fitted to the critical-path teacher's decisions along its own rollouts over
    ``rollouts`` (softmax regression by gradient descent from zero weights, each head on its
    features scaled by their spread within a decision), and the fractions of those decisions it
    agrees with, teacher-forced: SEL's, PLC's, both together (decisions with one choice left out).

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    >>> decomps = {n: ej.decompose(n, {"m": 2, "k": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> policy, (sel, plc, both) = imitate([Rollout(decomps, ej.Cluster.preset("dgx-a100", devices=2))])
    >>> plc
    1.0
    """
    import numpy as np

    sel: list[tuple[list[tuple[float, ...]], int]] = []
    plc: list[tuple[list[tuple[float, ...]], int]] = []
    for r in rollouts:
        r.run(TEACHER, record=True)
        sel += [dec for dec in r.decisions[0] if len(dec[0]) > 1]
        plc += [dec for dec in r.decisions[1] if len(dec[0]) > 1]

    def fit(decisions: list[tuple[list[tuple[float, ...]], int]], width: int) -> tuple[np.ndarray, int]:
        if not decisions:
            return np.zeros(width), 0
        x = np.array([f for fs, _ in decisions for f in fs], dtype=np.float64)
        sizes = np.array([len(fs) for fs, _ in decisions])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        seg = np.repeat(np.arange(len(decisions)), sizes)
        ys = starts + np.array([y for _, y in decisions])
        # softmax compares choices within a decision: scale each feature by its spread there
        dev = x - (np.add.reduceat(x, starts, axis=0) / sizes[:, None])[seg]
        scale = np.sqrt((dev ** 2).mean(axis=0))
        scale[scale == 0] = 1.0
        xs = x / scale
        w = np.zeros(width)
        for _ in range(steps):
            sc = xs @ w
            e = np.exp(sc - np.maximum.reduceat(sc, starts)[seg])
            prob = e / np.add.reduceat(e, starts)[seg]
            w -= rate * (xs.T @ prob - xs[ys].sum(axis=0)) / len(decisions)
        sc = x @ (w / scale)
        best = np.maximum.reduceat(sc, starts)
        # the first best of each decision, as run's ties go
        first = np.array([starts[i] + int(np.argmax(sc[starts[i]:starts[i] + sizes[i]] >= best[i]))
                          for i in range(len(decisions))])
        return w / scale, int((first == ys).sum())
    ws, a_sel = fit(sel, len(SEL_FEATURES))
    wp, a_plc = fit(plc, len(PLC_FEATURES))
    return (Policy(tuple(ws.tolist()), tuple(wp.tolist())),
            (a_sel / max(len(sel), 1), a_plc / max(len(plc), 1), (a_sel + a_plc) / max(len(sel) + len(plc), 1)))


def improve(rollouts: Sequence[Rollout], scores: Sequence[Score], start: Policy, *, rounds: int = 6,
            population: int = 8, elite: int = 3, sigma: float = 0.5, seed: int = 0) -> tuple[Policy, float]:
    """A cross-entropy search over the weights from ``start``: each round draws ``population``
    policies around the mean, scores each by the mean over graphs of its makespan over the
    teacher's (``scores[i]`` scores a placement of ``rollouts[i]``), refits the mean and spread
    to the ``elite`` best; returns the best policy seen (``start`` included) and its mean ratio.

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    >>> decomps = {n: ej.decompose(n, {"m": 2, "k": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> r = Rollout(decomps, ej.Cluster.preset("dgx-a100", devices=2))
    >>> improve([r], [Estimate(decomps, r.cluster)], TEACHER, rounds=1, population=2)[1] <= 1.0
    True
    """
    rng = random.Random(seed)
    start = _unit(start)
    base = [score(r.placement(r.run(TEACHER))) for r, score in zip(rollouts, scores)]

    def value(pol: Policy) -> float:
        return sum(score(r.placement(r.run(pol))) / b for r, score, b in zip(rollouts, scores, base)) / len(base)
    mean = list(start.flat())
    spread = [sigma] * len(mean)
    best, best_v = start, value(start)
    for _ in range(rounds):
        drawn = [Policy.of([m + s * rng.gauss(0.0, 1.0) for m, s in zip(mean, spread)]) for _ in range(population)]
        ranked = sorted(((value(pol), i, pol) for i, pol in enumerate(drawn)), key=lambda e: e[:2])
        if ranked[0][0] < best_v:
            best_v, best = ranked[0][0], ranked[0][2]
        top = [pol.flat() for _, _, pol in ranked[:elite]]
        mean = [sum(col) / len(col) for col in zip(*top)]
        spread = [max(0.05, math.sqrt(sum((v - m) ** 2 for v in col) / len(col))) for col, m in zip(zip(*top), mean)]
    return best, best_v


@register_placer("doppler")
def doppler(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0, *,
            score: Score | None = None, budget: int | None = None, policy: Policy | None = None) -> Placement:
    """The placement of the learned policy (default :data:`POLICY`), then its weights evolved on
    this graph, for ``budget`` evaluations of ``score`` (default :class:`Estimate`), the best
    placement kept; the same for the same seed.

    >>> import einjoin as ej
    >>> z = ej.input("a", (32, 32)) @ ej.input("b", (32, 32))
    >>> decomps = {n: ej.decompose(n, {"m": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> sorted(doppler(decomps, ej.Cluster.preset("dgx-a100", devices=2), 1, budget=3)[z.node].kernel_devices)
    [0, 1]
    """
    budget = DEFAULT_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise EinjoinError(f"doppler placement: budget must be an int >= 0 (evaluations), got {budget!r:.60}")
    pol = POLICY if policy is None else policy
    roll = Rollout(decomps, cluster)
    best = roll.placement(roll.run(pol))
    if budget == 0 or cluster.size < 2 or not roll.tasks:
        return best
    scorer: Score = score if score is not None else Estimate(decomps, cluster)
    best_score = scorer(best)
    rng = random.Random(seed)
    flat = list(_unit(pol).flat())
    sigma = STEP
    seen = {tuple(best[n].kernel_devices for n in roll.decomps)}
    spent = 1
    for _ in range(3 * budget):  # (1+1) evolution: a step that scores no worse is kept; the step size adapts
        if spent >= budget:
            break
        trial = Policy.of([v + sigma * rng.gauss(0.0, 1.0) for v in flat])
        cand = roll.placement(roll.run(trial))
        sig = tuple(cand[n].kernel_devices for n in roll.decomps)
        if sig in seen:  # the same placement: no evaluation spent (rollouts are cheaper), a larger step next
            sigma = min(sigma * 1.5, 4.0)
            continue
        seen.add(sig)
        spent += 1
        s = scorer(cand)
        if s <= best_score:
            best, best_score, flat = cand, s, list(trial.flat())
            sigma = min(sigma * 1.5, 4.0)
        else:
            sigma = max(sigma * 0.8, 0.05)
    return best
