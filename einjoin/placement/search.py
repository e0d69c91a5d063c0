"""``search``: a local search over placements, scored by a makespan (issue 23).

It starts from the better of the critical-path (CP) and greedy placements and tries moves of
kernels' devices, keeping a move when the score does not get worse, for a fixed number of
evaluations (``budget``); it returns the best placement seen, so never one that scores worse
than its start. Deterministic for a seed (its moves come from ``random.Random(seed)``). The moves:

- swap two devices within one op (every kernel of the op on ``a`` goes to ``b`` and back):
  the op stays as balanced as it was, its traffic changes;
- swap two devices over a run of consecutive ops (a producer and its consumers moved together,
  so that a chain that CP split over two islands can come back to one);
- move one kernel to another device;
- follow, for one op or a run of them: re-place the op's kernels where what they read arrives
  soonest (transfer times over the cluster's links), at most ceil(K/P) kernels per device.

What scores a placement is a parameter, because the score that counts — the event simulator's
makespan of the task graph — lives two floors up (the task graph is floor 4, the simulator floor
6; this is floor 2): ``ej.compile(..., placement="search")`` on a cluster with a time model
(a preset) passes a score that builds the task graph and simulates it
(:mod:`einjoin.compiler`). Called here without one (``place("search", ...)``, or a cluster with
no time model), it scores by :class:`Estimate`: a list schedule of the kernels over the same time
model (:mod:`einjoin.cluster.model`), transfers serialised on each device's ports.

>>> import einjoin as ej
>>> z = ej.relu(ej.input("a", (64, 64)) @ ej.input("b", (64, 64)))
>>> decomps = {n: ej.decompose(n, {"m": 2, "n": 2} if n is z.node.inputs[0] else None)
...            for n in ej.Graph([z]).nodes}
>>> pl = search(decomps, ej.Cluster.preset("dgx-a100", devices=4), budget=20)
>>> sorted(set(pl[z.node.inputs[0]].kernel_devices)) == [0, 1, 2, 3]
True
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping

from einjoin.cluster import Cluster
from einjoin.cluster.model import work_time
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.flops import kernel_flops
from einjoin.decomp.partition import BlockKey, box_size
from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Node
from einjoin.placement.affinity import NOMINAL_RATE, critical_path, greedy
from einjoin.placement.base import Placement, _from_kernel_devices, register_placer
from einjoin.placement.homes import _parts, block_devices, settle_homes

__all__ = ["search", "Estimate", "Score", "DEFAULT_BUDGET"]

Score = Callable[[Placement], float]
Link = Callable[[int, int, int], float]  # (src, dst, bytes) -> seconds alone on the link
DEFAULT_BUDGET = 60  # evaluations of the score (the simulator's: ~0.1-0.2 s each for a LLaMA block on 16 GPUs)
# the moves' shares (cumulative): swap in one op, move one kernel, follow one op, follow a run,
# then swap over a run. Tried against others on the bench's graphs (swaps first, follows first):
# the same makespans within 2% at 40 evaluations; so was annealing instead of hill climbing
_MOVES = (0.35, 0.65, 0.75, 0.85)


_KernelCost = tuple[tuple[float, ...], list[tuple[Node, BlockKey, int]]]  # seconds per device, pieces read


class Estimate:
    """A fast makespan estimate of a placement on ``cluster``: the kernels in topological order,
    each on its device's one lane when its inputs have arrived; a block read on another device
    crosses once per device (a copy is kept) and holds the sender's outgoing and the receiver's
    incoming port meanwhile; partial sums travel to their block's home. Kernel time is
    :func:`einjoin.cluster.model.work_time` plus the launch on a cluster with a time model
    (``cluster.hardware``), else flops at 100 GFLOP/s; transfers use the same model's links
    (else the cluster's). No contention between kernels, no memory: a score, not a simulation.

    >>> import einjoin as ej
    >>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    >>> decomps = {n: ej.decompose(n, {"m": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> est = Estimate(decomps, ej.Cluster.preset("dgx-a100", devices=2))
    >>> from einjoin.placement import place
    >>> 0 < est(place("critical_path", decomps, est.cluster)) < 1e-3
    True
    """

    def __init__(self, decomps: Mapping[Node, Decomposition], cluster: Cluster):
        self.decomps, self.cluster = decomps, cluster
        hw = cluster.hardware
        p = cluster.size
        self.p = p
        if hw is not None and hw.size == p:
            self._link: Link = hw.transfer_time
            self._fast = tuple(hw.groups)
        else:
            self._link = cluster.transfer_time
            self._fast = (0,) * p
        # per op: (node, decomposition, per kernel (seconds per device, pieces read), partial block bytes)
        self.ops: list[tuple[Node, Decomposition, list[_KernelCost], int]] = []
        for node, d in decomps.items():
            if node.facts.fed or node.facts.free:
                continue
            isz = itemsize(node.dtype)
            acc = itemsize(partial_dtype(node)) if d.n_partials > 1 else isz
            kernels = []
            for k in d.kernels:
                pieces = []
                nbytes = 0
                for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                    if key is None or x.facts.free:
                        continue
                    sz = itemsize(x.dtype)
                    for pk, sub in _parts(decomps[x].out_partition, d.in_partitions[slot].box(key)):
                        b = sz * box_size(sub)
                        pieces.append((x, pk, b))
                        nbytes += b
                out = acc * box_size(d.out_partition.box(k.out_key))
                flops = kernel_flops(d, k.index)
                if hw is not None and hw.size == p:
                    runs = tuple(work_time(m, flops, nbytes + out, node.dtype, 1.0, node.kind) + m.launch
                                 for m in hw.models)
                else:
                    runs = (flops / NOMINAL_RATE,) * p
                kernels.append((runs, pieces))
            block = acc * max((box_size(d.out_partition.box(key))
                               for key in d.out_partition.keys()), default=0)
            self.ops.append((node, d, kernels, block))

    def __call__(self, placement: Placement) -> float:
        p, link = self.p, self._link
        free = [0.0] * p          # each device's compute lane
        port_out = [0.0] * p      # each device's outgoing and incoming link port
        port_in = [0.0] * p
        ready: dict[tuple[Node, BlockKey], tuple[float, int]] = {}  # block -> (when, where)
        copies: dict[tuple[Node, BlockKey, int], float] = {}

        def send(t: float, src: int, dst: int, nbytes: int) -> float:
            took = link(src, dst, nbytes)
            start = max(t, port_out[src], port_in[dst])
            port_out[src] = port_in[dst] = start + took
            return start + took

        for node in self.decomps:
            if node.facts.fed:
                for key, home in placement[node].homes.items():
                    ready[(node, key)] = (0.0, home)
        end = 0.0
        for node, d, kernels, block in self.ops:
            pl = placement[node]
            partials: dict[BlockKey, list[tuple[float, int]]] = {}
            for k, dv, (runs, pieces) in zip(d.kernels, pl.kernel_devices, kernels):
                arrive = 0.0
                for x, pk, nbytes in pieces:
                    when, src = ready.get((x, pk), (0.0, dv))
                    if src != dv:
                        got = copies.get((x, pk, dv))
                        if got is None:
                            got = copies[(x, pk, dv)] = send(when, src, dv, nbytes)
                        when = got
                    arrive = max(arrive, when)
                done = max(free[dv], arrive) + runs[dv]
                free[dv] = done
                partials.setdefault(k.out_key, []).append((done, dv))
            for key, parts in partials.items():
                if len(parts) == 1:
                    ready[(node, key)] = parts[0]
                    continue
                home = pl.homes[key]
                when = max(t if dv == home else send(t, dv, home, block) for t, dv in parts)
                ready[(node, key)] = (when, home)
                end = max(end, when)
        return max(end, *free)


def _rebuild(decomps: Mapping[Node, Decomposition], devs: dict[Node, list[int]], base: Placement, p: int) -> Placement:
    """The placement with these kernel devices, every movable block homed again (settle_homes)."""
    out: Placement = {}
    for node, d in decomps.items():
        if node in devs:
            out[node] = _from_kernel_devices(d, devs[node])
        else:
            out[node] = base[node]
    return settle_homes(decomps, out, p)


def search(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0, *,
           score: Score | None = None, budget: int | None = None, start: Placement | None = None) -> Placement:
    """The best placement a local search finds in ``budget`` evaluations of ``score`` (lower is
    better; default :class:`Estimate`), starting from ``start`` (default: the better of the
    ``critical_path`` and ``greedy`` placements by ``score``). Never scores worse than the start;
    the same for the same seed.

    >>> import einjoin as ej
    >>> z = ej.input("a", (32, 32)) @ ej.input("b", (32, 32))
    >>> decomps = {n: ej.decompose(n, {"m": 2} if n is z.node else None) for n in ej.Graph([z]).nodes}
    >>> cl = ej.Cluster.preset("dgx-a100", devices=2)
    >>> search(decomps, cl, 1, budget=10) == search(decomps, cl, 1, budget=10)
    True
    """
    budget = DEFAULT_BUDGET if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise EinjoinError(f"search placement: budget must be an int >= 0 (evaluations), got {budget!r:.60}")
    p = cluster.size
    scorer: Score = score if score is not None else Estimate(decomps, cluster)
    if start is None:
        starts = [critical_path(decomps, cluster, seed), greedy(decomps, cluster, seed)]
        scored = [(scorer(s), i) for i, s in enumerate(starts)]
        best_score, i = min(scored)
        best = starts[i]
    else:
        best, best_score = start, scorer(start)
    ops = [n for n, d in decomps.items() if not (n.facts.fed or n.facts.free) and d.kernels]
    if p < 2 or not ops or budget == 0:
        return best
    rng = random.Random(seed)
    hw = cluster.hardware
    link: Link = hw.transfer_time if hw is not None and hw.size == p else cluster.transfer_time
    devs = {n: list(best[n].kernel_devices) for n in ops}
    cur_score = best_score
    order = {n: i for i, n in enumerate(ops)}
    # heavier ops are tried more often: weight by flops (log-ish, so small ops still get turns)
    weights = [1.0 + math.log1p(kernel_flops(decomps[n], decomps[n].kernels[0].index) * len(decomps[n].kernels))
               for n in ops]
    current = best
    for _ in range(budget):
        trial = _propose(rng, ops, weights, devs, order, decomps, current, p, link)
        if trial is None:
            continue
        cand = _rebuild(decomps, trial, current, p)
        s = scorer(cand)
        if s <= cur_score:  # equal scores are taken too: a plateau is crossed, not stopped at
            devs, current, cur_score = trial, cand, s
            if s < best_score:
                best, best_score = cand, s
    return best


def _propose(rng: random.Random, ops: list[Node], weights: list[float], devs: dict[Node, list[int]],
             order: dict[Node, int], decomps: Mapping[Node, Decomposition], current: Placement,
             p: int, link: Link) -> dict[Node, list[int]] | None:
    """One move (see the module docstring) as new kernel devices, or None when it changes nothing."""
    node = rng.choices(ops, weights)[0]
    kind = rng.random()
    trial = dict(devs)
    mine = devs[node]
    if kind < _MOVES[0] or kind >= _MOVES[3]:  # swap two devices in one op, or over a run of ops
        a = rng.choice(mine)
        b = rng.randrange(p - 1)
        b += b >= a
        i = order[node]
        span = ops[i:i + (1 if kind < _MOVES[0] else rng.randint(2, 8))]
        changed = False
        for n in span:
            old = devs[n]
            new = [b if dv == a else a if dv == b else dv for dv in old]
            if new != old:
                trial[n] = new
                changed = True
        return trial if changed else None
    if kind < _MOVES[1]:  # one kernel to another device
        j = rng.randrange(len(mine))
        dv = rng.randrange(p - 1)
        dv += dv >= mine[j]
        trial[node] = mine[:j] + [dv] + mine[j + 1:]
        return trial
    # follow, over a run of ops: each op re-placed against the devices its inputs now have
    i = order[node]
    for n in ops[i:i + (1 if kind < _MOVES[2] else rng.randint(2, 8))]:
        trial[n] = _follow(n, decomps, current, trial, p, link)
    return trial if any(trial[n] != devs[n] for n in trial) else None


def _follow(node: Node, decomps: Mapping[Node, Decomposition], current: Placement,
            devs: dict[Node, list[int]], p: int, link: Link) -> list[int]:
    """``node``'s kernels re-placed where what they read arrives soonest (each piece's transfer
    time from the device holding it, over the cluster's links), at most ceil(K/P) kernels per
    device as the placers keep them; the kernels with most to lose choose first."""
    d = decomps[node]
    homes_of: dict[Node, dict[BlockKey, int]] = {}  # per input, once: its blocks' devices

    def homes_for(x: Node) -> dict[BlockKey, int]:
        if x not in homes_of:
            xd, xpl = decomps[x], current[x]
            if x in devs and list(xpl.kernel_devices) != devs[x]:  # moved by this move: homes as first placed
                xpl = _from_kernel_devices(xd, devs[x])
            homes_of[x] = block_devices(x, xd, xpl)
        return homes_of[x]

    costs = []
    for k in d.kernels:
        cost = [0.0] * p
        for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
            if key is None or x.facts.free:
                continue
            xd = decomps[x]
            homes = homes_for(x)
            sz = itemsize(x.dtype)
            for pk, sub in _parts(xd.out_partition, d.in_partitions[slot].box(key)):
                h = homes[pk]
                nbytes = sz * box_size(sub)
                for dv in range(p):
                    if dv != h:
                        cost[dv] += link(h, dv, nbytes)
        costs.append(cost)
    cap = -(-len(d.kernels) // p)
    load = [0] * p
    out = list(devs[node])
    regret = sorted(range(len(costs)), key=lambda j: -(max(costs[j]) - min(costs[j])))
    for j in regret:
        dv = min((dv for dv in range(p) if load[dv] < cap), key=lambda dv: (costs[j][dv], dv != out[j], dv))
        out[j] = dv
        load[dv] += 1
    return out


@register_placer("search")
def search_placement(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """The registered ``"search"`` placer: :func:`search` scored by :class:`Estimate` (through
    ``ej.compile`` on a cluster with a time model, scored by the simulator instead)."""
    return search(decomps, cluster, seed)
