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

import itertools
from typing import Callable, Mapping

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition, Kernel
from einjoin.decomp.flops import kernel_flops
from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Fill, Input, Node
from einjoin.placement import NodePlacement, Placement, _from_kernel_devices, register_placer, round_robin

__all__ = ["greedy", "critical_path", "nums"]

class _State:
    def __init__(self, p: int):
        self.p = p
        self.homes: dict[Node, dict] = {}
        self.copies: dict[tuple[Node, tuple], set[int]] = {}
        self.load = [0] * p          # kernels of the current op per device
        self.ready = [0.0] * p       # critical_path: when each device is free
        self.block_ready: dict[tuple[Node, tuple], float] = {}
        self.mem = [0] * p           # nums: bytes resident, in, out
        self.net_in = [0] * p
        self.net_out = [0] * p


def _overlaps(part: object, box: tuple) -> list[tuple[tuple, int]]:
    ranges = [part.overlapping(dim, a, b) for dim, (a, b) in enumerate(box)]  # type: ignore[attr-defined]
    found = []
    for pk in itertools.product(*ranges):
        pbox = part.box(pk)  # type: ignore[attr-defined]
        vol = 1
        for (a, b), (c, e) in zip(box, pbox):
            vol *= max(0, min(b, e) - max(a, c))
        if vol:
            found.append((pk, vol))
    return found


def _pieces(node: Node, d: Decomposition, k: Kernel, decomps: Mapping[Node, Decomposition],
            st: _State) -> list[tuple[Node, tuple, int, set[int]]]:
    """(producer, region, bytes, devices already holding it) for every input region ``k`` reads."""
    out = []
    for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
        if key is None or isinstance(x.op, Fill):
            continue
        box = d.in_partitions[slot].box(key)
        size = itemsize(x.dtype)
        held = set(st.copies.get((x, box), ()))
        for pk, vol in _overlaps(decomps[x].out_partition, box):
            h = st.homes[x].get(pk)
            out.append((x, pk, vol * size, held | ({h} if h is not None else set())))
    return out


def _place(decomps: Mapping[Node, Decomposition], cluster: Cluster, choose: Callable) -> Placement:
    p = cluster.size
    st = _State(p)
    out: Placement = {}
    for node, d in decomps.items():
        if isinstance(node.op, Input):
            st.homes[node] = {}
            continue
        if isinstance(node.op, Fill):
            out[node] = round_robin({node: d}, cluster)[node]
            st.homes[node] = out[node].homes
            continue
        cap = -(-len(d.kernels) // p)
        st.load = [0] * p
        taken: dict = {}
        devs = []
        for k in d.kernels:
            pieces = _pieces(node, d, k, decomps, st)
            allowed = [dv for dv in range(p) if st.load[dv] < cap] or list(range(p))
            fresh = [dv for dv in allowed if dv not in taken.get(k.out_key, ())] or allowed
            dev = choose(node, d, k, pieces, fresh, st, cluster)
            devs.append(dev)
            st.load[dev] += 1
            taken.setdefault(k.out_key, set()).add(dev)
            for slot, (x, key) in enumerate(zip(node.inputs, k.in_keys)):
                if key is None or isinstance(x.op, Fill):
                    continue
                box = d.in_partitions[slot].box(key)
                if isinstance(x.op, Input):
                    for pk, _ in _overlaps(decomps[x].out_partition, box):
                        st.homes[x].setdefault(pk, dev)
                st.copies.setdefault((x, box), set()).add(dev)
        out[node] = _from_kernel_devices(d, devs)
        st.homes[node] = out[node].homes
    for node, d in decomps.items():
        if isinstance(node.op, Input):
            rr = round_robin({node: d}, cluster)[node].homes
            h = {key: st.homes[node].get(key, rr[key]) for key in d.out_partition.keys()}
            out[node] = NodePlacement(tuple(h[k.out_key] for k in d.kernels), h)
    return {node: out[node] for node in decomps}


def _missing(pieces: list, dev: int) -> list[tuple[int, int]]:
    """(source device, bytes) that must arrive on ``dev`` (sources unknown: inputs not yet homed)."""
    need = []
    for _, _, nbytes, held in pieces:
        if held and dev not in held:
            need.append((min(held), nbytes))
    return need


@register_placer("greedy")
def greedy(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Each kernel to the allowed device already holding most of what it reads (ties: the least
    loaded, then the lowest id); at most ceil(K/P) kernels of an op per device, and partials of
    one output block on different devices where possible."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        score = {dv: sum(b for _, _, b, held in pieces if dv in held) for dv in allowed}
        return min(allowed, key=lambda dv: (-score[dv], st.load[dv], dv))
    return _place(decomps, cluster, choose)


@register_placer("critical_path")
def critical_path(decomps: Mapping[Node, Decomposition], cluster: Cluster, seed: int = 0) -> Placement:
    """Earliest finish time: a kernel starts when its device is free and its inputs have arrived
    over the cluster's links (bandwidth and latency from the topology), and runs for its flops at
    a nominal 100 GFLOP/s; it goes to the device where it finishes first."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        run = kernel_flops(d, k.index) / 1e11
        best, best_dev = None, allowed[0]
        for dv in allowed:
            arrive = 0.0
            for x, pk, nbytes, held in pieces:
                t = st.block_ready.get((x, pk), 0.0)
                if held and dv not in held:
                    t += cl.transfer_time(min(held), dv, nbytes)
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
        best, best_dev = None, allowed[0]
        for dv in allowed:
            moves = _missing(pieces, dv)
            mem, nin, nout = list(st.mem), list(st.net_in), list(st.net_out)
            mem[dv] += out_bytes + sum(b for _, b in moves)
            for src, b in moves:
                nin[dv] += b
                nout[src] += b
            obj = (max(mem) + max(nin) + max(nout), st.load[dv], dv)
            if best is None or obj < best:
                best, best_dev = obj, dv
        for src, b in _missing(pieces, best_dev):
            st.net_in[best_dev] += b
            st.net_out[src] += b
            st.mem[best_dev] += b
        st.mem[best_dev] += out_bytes
        return best_dev
    return _place(decomps, cluster, choose)
