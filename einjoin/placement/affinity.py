"""Placers that look at where a kernel's inputs already are: ``greedy`` (affinity with balance,
in the spirit of Einsummable's), ``critical_path`` (earliest finish time, the HEFT/ETF family
DOPPLER's teacher belongs to) and ``nums`` (NumS LSHS: minimise max memory + max bytes in + max
bytes out). All walk the ops in topological order and place one kernel at a time; a graph input's
block is homed where its first reader runs, so its one loaded copy is where it is used.

>>> import einjoin as ej
>>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
>>> for name in ("greedy", "critical_path", "nums"):
...     prog = ej.compile(z, devices=8, specs={z: {"m": 2, "n": 2, "k": 2}}, placement=name, backend="null")
...     print(name, prog.stats.bytes_moved)
greedy 49152
critical_path 49152
nums 49152
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition, Kernel
from einjoin.decomp.partition import BlockKey, Box, Partition, box_size
from einjoin.decomp.flops import kernel_flops
from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Node
from einjoin.placement.base import NodePlacement, Placement, _from_kernel_devices, register_placer, round_robin
from einjoin.placement.homes import settle_homes

__all__ = ["greedy", "critical_path", "nums"]

class _State:
    def __init__(self, p: int):
        self.p = p
        self.homes: dict[Node, dict[BlockKey, int]] = {}
        self.copies: dict[tuple[Node, Box], set[int]] = {}
        self.load = [0] * p          # kernels of the current op per device
        self.ready = [0.0] * p       # critical_path: when each device is free
        self.block_ready: dict[tuple[Node, BlockKey], float] = {}
        self.mem = [0] * p           # nums: bytes resident, in, out
        self.net_in = [0] * p
        self.net_out = [0] * p
        self.summed = [0] * p        # elements of spread sums homed per device (_spread_sums)


class _Held:
    """The devices holding a piece: the copies already sent to readers plus the producer block's
    home — a view, not a copy (a replicated block's copies reach P devices; copying them for
    every reader made placement cubic)."""

    __slots__ = ("copies", "home")

    def __init__(self, copies: set[int] | tuple[int, ...], home: int | None):
        self.copies, self.home = copies, home

    def __contains__(self, dv: int) -> bool:
        return dv == self.home or dv in self.copies

    def __bool__(self) -> bool:
        return self.home is not None or bool(self.copies)

    def __iter__(self) -> Iterator[int]:
        if self.home is not None:
            yield self.home
        yield from (dv for dv in self.copies if dv != self.home)

    def least(self) -> int:
        """The lowest device id holding it (callers check it is not empty)."""
        return min(self)


class _Allowed:
    """Where the next kernel of an op may go: the devices below the op's per-device cap of
    kernels (all devices if none is), and among them, those not yet holding a partial of the same
    output block (all allowed ones if that leaves none) — kept as a heap of (load, device) so the
    greedy placer finds the least loaded in O(log P) instead of listing P devices per kernel."""

    def __init__(self, p: int, cap: int, load: list[int]):
        self.p, self.cap, self.load = p, cap, load
        self.heap = [(0, dv) for dv in range(p)]  # (load, device); entries with an old load are stale
        self.taken: set[int] = set()
        self._least: int | None = None
        self._fresh_exists = True
        self._any_allowed = True
        self._least_allowed: int | None = None

    def start(self, taken: set[int]) -> None:
        """Prepare for one kernel whose output block has partials on ``taken``."""
        self.taken = taken
        heap, load = self.heap, self.load
        if len(taken) >= self.p:
            # every device holds a partial of this block (more partials than devices): the fresh
            # ones are all allowed ones, the least loaded of which is the heap's valid top
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            self._least = heap[0][1]
            self._any_allowed = load[self._least] < self.cap
            self._fresh_exists = False
            self._least_allowed = self._least
            return
        aside = []
        self._least = None
        while heap:
            ld, dv = heap[0]
            if ld != load[dv]:
                heapq.heappop(heap)  # stale
            elif dv in taken:
                aside.append(heapq.heappop(heap))
            else:
                self._least = dv
                break
        for e in aside:
            heapq.heappush(heap, e)
        # some device is below the cap (so "allowed" means below it)? either the least loaded
        # untaken one or a taken one; then fresh ones exist iff that untaken one is below it
        below = self._least is not None and load[self._least] < self.cap
        self._any_allowed = below or any(load[dv] < self.cap for dv in taken)
        self._fresh_exists = below if self._any_allowed else self._least is not None
        self._least_allowed = self._least if self._fresh_exists else None

    def bump(self, dv: int) -> None:
        self.load[dv] += 1
        heapq.heappush(self.heap, (self.load[dv], dv))

    def ok(self, dv: int) -> bool:
        """Whether ``dv`` is one of the devices the old list would hold."""
        if self._any_allowed and self.load[dv] >= self.cap:
            return False
        return not self._fresh_exists or dv not in self.taken

    def least_loaded(self) -> int:
        """The allowed device with the fewest kernels, then the lowest id."""
        if self._least_allowed is not None:
            return self._least_allowed
        return min(self.devices(), key=lambda dv: (self.load[dv], dv))  # rare: O(P)

    def devices(self) -> list[int]:
        """All of them, in id order (O(P): for the placers that weigh every device)."""
        return [dv for dv in range(self.p) if self.ok(dv)]


def _overlaps(part: Partition, box: Box) -> list[tuple[BlockKey, int]]:
    ranges = [part.overlapping(dim, a, b) for dim, (a, b) in enumerate(box)]
    found = []
    for pk in itertools.product(*ranges):
        pbox = part.box(pk)
        vol = 1
        for (a, b), (c, e) in zip(box, pbox):
            vol *= max(0, min(b, e) - max(a, c))
        if vol:
            found.append((pk, vol))
    return found


def _pieces(node: Node, d: Decomposition, k: Kernel, decomps: Mapping[Node, Decomposition],
            st: _State) -> list[tuple[Node, BlockKey, int, _Held]]:
    """(producer, region, bytes, devices already holding it) for every input region ``k`` reads."""
    out = []
    for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
        if key is None or x.facts.free:
            continue
        box = d.in_partitions[slot].box(key)
        size = itemsize(x.dtype)
        copies: set[int] | tuple[int, ...] = st.copies.get((x, box), ())
        for pk, vol in _overlaps(decomps[x].out_partition, box):
            out.append((x, pk, vol * size, _Held(copies, st.homes[x].get(pk))))
    return out


def _place(decomps: Mapping[Node, Decomposition], cluster: Cluster, choose: Callable[..., int]) -> Placement:
    p = cluster.size
    st = _State(p)
    out: Placement = {}
    # the ops each tensor's blocks are read by, for _spread_sums: whether all of them are one kernel
    whole: dict[Node, bool] = {}
    for node, d in decomps.items():
        for x in node.inputs:
            whole[x] = whole.get(x, True) and len(d.kernels) == 1
    for node, d in decomps.items():
        if node.facts.fed:
            st.homes[node] = {}
            continue
        if node.facts.free:
            out[node] = round_robin({node: d}, cluster)[node]
            st.homes[node] = out[node].homes
            continue
        cap = -(-len(d.kernels) // p)
        st.load = [0] * p
        allowed = _Allowed(p, cap, st.load)
        taken: dict[BlockKey, set[int]] = {}
        devs = []
        for k in d.kernels:
            pieces = _pieces(node, d, k, decomps, st)
            allowed.start(taken.setdefault(k.out_key, set()))
            dev = choose(node, d, k, pieces, allowed, st, cluster)
            devs.append(dev)
            allowed.bump(dev)
            taken[k.out_key].add(dev)
            for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                if key is None or x.facts.free:
                    continue
                box = d.in_partitions[slot].box(key)
                if x.facts.fed:
                    for pk, _ in _overlaps(decomps[x].out_partition, box):
                        st.homes[x].setdefault(pk, dev)
                st.copies.setdefault((x, box), set()).add(dev)
        out[node] = _spread_sums(d, devs, st) if whole.get(node) else _from_kernel_devices(d, devs)
        st.homes[node] = out[node].homes
    for node, d in decomps.items():
        if node.facts.fed:
            rr = round_robin({node: d}, cluster)[node].homes
            h = {key: st.homes[node].get(key, rr[key]) for key in d.out_partition.keys()}
            out[node] = NodePlacement(tuple(h[k.out_key] for k in d.kernels), h)
    # the kernels placed, every block that may live anywhere moves to its cheapest home
    return settle_homes(decomps, {node: out[node] for node in decomps}, p)


def _spread_sums(d: Decomposition, devs: list[int], st: _State) -> NodePlacement:
    """For a tensor only whole ops read (one kernel each: a training step's optimizer updates
    of small gradients), each block summed from partials on several devices is homed on the one
    of them with the fewest such elements so far, not always on its first partial's: the sum
    moves the same bytes either way, and the op that reads it follows it, so those ops spread
    over the devices instead of all queueing on device 0."""
    pl = _from_kernel_devices(d, devs)
    if d.n_partials < 2:
        return pl
    where: dict[BlockKey, set[int]] = {}
    for k, dev in zip(d.kernels, devs):
        where.setdefault(k.out_key, set()).add(dev)
    homes = dict(pl.homes)
    for key, on in where.items():
        if len(on) > 1:
            homes[key] = home = min(on, key=lambda dv: (st.summed[dv], dv))
            st.summed[home] += box_size(d.out_partition.box(key))
    return NodePlacement(pl.kernel_devices, homes)


def _missing(pieces: list[tuple[Node, BlockKey, int, _Held]], dev: int) -> list[tuple[int, int]]:
    """(source device, bytes) that must arrive on ``dev`` (sources unknown: inputs not yet homed)."""
    need = []
    for _, _, nbytes, held in pieces:
        if held and dev not in held:
            need.append((held.least(), nbytes))
    return need


@register_placer("greedy")
def greedy(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Each kernel to the allowed device already holding most of what it reads (ties: the least
    loaded, then the lowest id); at most ceil(K/P) kernels of an op per device, and partials of
    one output block on different devices where possible."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        # only devices holding some piece score above 0; the rest tie at 0, where the least
        # loaded wins: O(pieces' holders + log P) per kernel, not O(P)
        score: dict[int, int] = {}
        for _, _, b, held in pieces:
            for dv in held:
                score[dv] = score.get(dv, 0) + b
        scored = [dv for dv, s in score.items() if s > 0 and allowed.ok(dv)]
        if scored:
            return min(scored, key=lambda dv: (-score[dv], st.load[dv], dv))
        return allowed.least_loaded()
    return _place(decomps, cluster, choose)


NOMINAL_RATE = 1e11  # flop/s a kernel runs at where the cluster has no time model


@register_placer("critical_path")
def critical_path(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Earliest finish time: a kernel starts when its device is free and its inputs have arrived
    over the cluster's links (bandwidth and latency from the topology), and runs for its flops at
    a nominal 100 GFLOP/s; it goes to the device where it finishes first."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        run = kernel_flops(d, k.index) / NOMINAL_RATE
        devices = allowed.devices()
        best, best_dev = None, devices[0]
        sources = [held.least() if held else -1 for _, _, _, held in pieces]
        for dv in devices:
            arrive = 0.0
            for (x, pk, nbytes, held), src in zip(pieces, sources):
                t = st.block_ready.get((x, pk), 0.0)
                if src >= 0 and dv not in held:
                    t += cl.transfer_time(src, dv, nbytes)
                arrive = max(arrive, t)
            finish = max(st.ready[dv], arrive) + run
            if best is None or finish < best:
                best, best_dev = finish, dv
        st.ready[best_dev] = best
        st.block_ready[(node, k.out_key)] = max(st.block_ready.get((node, k.out_key), 0.0), best)
        return best_dev
    return _place(decomps, cluster, choose)


@register_placer("nums")
def nums(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """NumS' LSHS objective: the device that minimises max resident bytes + max bytes in + max
    bytes out over all devices after placing the kernel."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        out_bytes = 1
        for a, b in d.out_partition.box(k.out_key):
            out_bytes *= b - a
        out_bytes *= itemsize(node.dtype)
        devices = allowed.devices()
        best, best_dev = None, devices[0]
        # placing on dv only adds to mem[dv], net_in[dv] and net_out of the pieces' sources, so
        # each new maximum is the old one or a changed value: O(pieces) per device instead of
        # copying three P-long lists (O(P^2) per kernel: 107 s for a matmul on 1024 devices)
        sources = [(held.least(), b, held) for _, _, b, held in pieces if held]
        top_mem, top_in, top_out = max(st.mem), max(st.net_in), max(st.net_out)
        for dv in devices:
            moved = 0
            outs: dict[int, int] = {}
            for src, b, held in sources:
                if dv not in held:
                    moved += b
                    outs[src] = outs.get(src, st.net_out[src]) + b
            obj = (max(top_mem, st.mem[dv] + out_bytes + moved) + max(top_in, st.net_in[dv] + moved)
                   + max(top_out, max(outs.values(), default=0)), st.load[dv], dv)
            if best is None or obj < best:
                best, best_dev = obj, dv
        for src, b in _missing(pieces, best_dev):
            st.net_in[best_dev] += b
            st.net_out[src] += b
            st.mem[best_dev] += b
        st.mem[best_dev] += out_bytes
        return best_dev
    return _place(decomps, cluster, choose)
