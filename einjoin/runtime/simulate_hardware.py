"""The time model a simulation runs on (:func:`hardware_for`: a cluster's preset, or this machine's
calibration with the cluster's links) and what of it depends on the program (:func:`kernel_pools`:
the threads a kernel gets where the runtime gives its thread pools different shares of the
cores). Split from :mod:`einjoin.runtime.simulate` (its size).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from einjoin.cluster import Cluster
from einjoin.cluster.calibration import local_calibration
from einjoin.cluster.model import Fabric, Hardware
from einjoin.exchange import TaskKind
from einjoin.ir.node import Attention, AttentionGrad, Conv, Pool, TopK
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["hardware_for", "kernel_pools", "streams", "output_copies", "TORCH_KINDS"]

# the node kinds whose kernels run on torch's CPU threads: ray_worker.PRELOAD_FACTS's "torch"
# rows (that table is above this floor's reach: the registry of backends imports the simulator;
# tests/test_simulate_calibration_terms.py checks the two agree)
TORCH_KINDS: frozenset[type] = frozenset({Attention, AttentionGrad, Conv, Pool, TopK})


def kernel_pools(tg: TaskGraph, hw: Hardware) -> dict[type, float] | None:
    """Threads per kernel by node kind where the threads backend shares the cores between two
    pools (:func:`einjoin.runtime.backends.cores_limit` with a pool): with fewer devices than
    cores and kernels on torch's threads (attention, convolutions, ...), the pool doing most
    of the kernels' flops gets the device's share of the cores and the other pool one thread.
    None: every kernel gets the share (:meth:`Hardware.threads`).

    >>> import einjoin as ej
    >>> from einjoin.cluster.calibration import Calibration
    >>> hw = Calibration(cores=2, matmul_rate=5e10, half_work=0.0, parallel=0.9, mem_bw=8e9, vector_rate=1e9,
    ...                  copy_bw=1e10, launch=0.0, launch_threads=0.0, machine="m").hardware(1)
    >>> x = ej.input("x", (1, 2, 64, 16))
    >>> prog = ej.compile(ej.attention(x, x, x) @ ej.input("w", (16, 512)), devices=1, quiet=True)
    >>> sorted((k.__name__, v) for k, v in kernel_pools(prog.taskgraph, hw).items())
    [('Attention', 1.0526315789473684)]
    """
    if hw.cores is None or hw.threads() <= 1:
        return None
    flops = {True: 0, False: 0}  # on torch's threads, on BLAS's
    kinds: dict[type, bool] = {}
    for t in tg.tasks:
        if t.kind is TaskKind.KERNEL:
            kind = type(t.node.op)
            on_torch = kinds.get(kind)
            if on_torch is None:
                on_torch = kinds[kind] = kind in TORCH_KINDS
            flops[on_torch] += t.flops
    if not any(kinds.values()):
        return None  # no torch kernel: torch is not loaded, BLAS has the share
    main = flops[True] > flops[False]
    # the model's rates are per thread of the device's share: one thread of the other pool runs
    # at the first thread's rate, threads / speed-up of the share in those units
    speedup = dict(hw.pool_speedup)
    threads = hw.threads()
    return {k: threads / speedup.get("torch" if on_torch else "blas", threads)
            for k, on_torch in kinds.items() if on_torch != main}


def streams(hw: Hardware, tg: TaskGraph, vbytes: Sequence[int]) -> bool:
    """Whether a run of ``tg`` streams its blocks from memory on ``hw``: the bytes of the blocks it
    writes (``vbytes`` per value; a zero-copy move's block is its source's) exceed the cache the
    devices share (``hw.cache``; unknown: it streams). A run then evicts each block before a later
    kernel reads it, and its memory-bound kernels divide the memory bus (``hw.mem_bus``). Per
    program, not per kernel: a run repeats, and what it wrote last is what the next one finds.

    >>> import einjoin as ej
    >>> from einjoin.cluster.calibration import Calibration
    >>> cal = Calibration(cores=2, matmul_rate=5e10, half_work=0.0, parallel=0.9, mem_bw=8e9, vector_rate=1e9,
    ...                   copy_bw=1e10, launch=0.0, launch_threads=0.0, machine="m", mem_bw_all=1e10,
    ...                   cache_bytes=16 << 20)
    >>> x = ej.input("x", (1024, 1024))  # 4 MiB: x and exp(x) 8 MiB, a softmax's steps 20 MiB
    >>> outs = (ej.exp(x), ej.softmax(ej.exp(x) + x, dim=-1))
    >>> small, large = (ej.compile(out, devices=2, quiet=True) for out in outs)
    >>> hw = cal.hardware(2)
    >>> [streams(hw, p.taskgraph, [v.nbytes for v in p.taskgraph.values]) for p in (small, large)]
    [False, True]
    """
    if hw.cache <= 0:
        return True
    handed = hw.shared_memory and not hw.own_links and tg.memory is None
    total = sum(vbytes[t.writes] for t in tg.tasks if t.writes >= 0 and not (handed and t.kind is TaskKind.MOVE))
    return total > hw.cache


def output_copies(engine: Any, hw: Hardware) -> frozenset[int]:
    """Ids of the tasks of ``engine`` that copy their block into a multi-block output once written
    (:mod:`einjoin.runtime.outputs`: the local sessions' output slots, uncapped and without state):
    every task writing a block of such an output but a matmul kernel that computes into its slot
    and a touch whose buffer is the slot. Empty where the devices do not share the host's RAM
    (another backend's devices: its outputs are gathered otherwise) or the graph is capped."""
    tg = engine.tg
    if not hw.shared_memory or tg.memory is not None or not hasattr(engine, "decomps"):
        return frozenset()
    from einjoin.runtime.outputs import output_plan
    plan = output_plan(engine)
    slotted = {v for lay in plan.layouts if lay is not None for v, _ in lay[2]}
    if not slotted:
        return frozenset()
    return frozenset(t.id for t in tg.tasks if t.writes in slotted and t.id not in plan.into
                     and not (t.kind is TaskKind.TOUCH and t.writes in plan.touched))


def hardware_for(cluster: Cluster) -> Hardware:
    """The time model of ``cluster``: its own (a preset's), else this machine's calibration for
    that many devices of the threads backend (measured first when none is cached: a few
    seconds). With ``local(n)``'s default links (``Cluster.uniform``'s 20 GB/s, 5 us) the devices
    are this process's: an uncapped move is a zero-copy hand-over, a capped one a RAM copy. A
    cluster with links of its own (``Cluster.uniform(n, bandwidth=...)``, ``islands``,
    ``grouped``, a matrix) computes as this machine's devices but moves over its links: each
    move pays its pair's latency and bytes / bandwidth, sharing each device's port per
    direction. A matrix of more than two kinds of links is read as groups (devices joined by
    the fastest links), each kind at its slowest pair; an infinite link takes no time.

    >>> hw = hardware_for(ej.Cluster.islands([2, 2], intra=100e9, inter=1e9))  # doctest: +SKIP
    >>> hw.groups, hw.inter.bandwidth, hw.own_links                             # doctest: +SKIP
    ((0, 0, 1, 1), 1000000000.0, True)
    """
    if cluster.hardware is not None:
        hw: Hardware = cluster.hardware
        return hw
    from einjoin.cluster import local
    base = local_calibration().hardware(cluster.size)
    default = local(cluster.size)
    if cluster.bandwidth == default.bandwidth and cluster.latency == default.latency:
        return base
    groups, intra, inter = _links(cluster)
    return dataclasses.replace(base, name=f"{base.name}, the cluster's links", groups=groups, intra=intra,
                               inter=inter, own_links=True)


_NO_TIME = 1e300  # an infinite link's bandwidth as a Fabric holds it (a Fabric's figures are finite)


def _links(cluster: Cluster) -> tuple[tuple[int, ...], Fabric, Fabric]:
    """A cluster's link matrices as groups and two fabrics (see :func:`hardware_for`)."""
    from einjoin.cluster import LinkMatrix
    n, bw, lat = cluster.size, cluster.bandwidth, cluster.latency
    if isinstance(bw, LinkMatrix) and isinstance(lat, LinkMatrix) and bw.groups == lat.groups:
        ids: dict[Any, int] = {}
        groups = tuple(ids.setdefault(g, len(ids)) for g in bw.groups)
        pairs = {"intra": (bw.intra, lat.intra), "inter": (bw.inter, lat.inter)}
    else:
        rows = [[(float(bw[i][j]), float(lat[i][j])) for j in range(n)] for i in range(n)]
        top = max((rows[i][j][0] for i in range(n) for j in range(n) if i != j), default=1.0)
        root = list(range(n))

        def find(i: int) -> int:
            while root[i] != i:
                root[i] = root[root[i]]
                i = root[i]
            return i
        for i in range(n):
            for j in range(n):
                if i != j and rows[i][j][0] >= top:
                    root[find(i)] = find(j)
        ids = {}
        groups = tuple(ids.setdefault(find(i), len(ids)) for i in range(n))
        worst: dict[str, tuple[float, float]] = {}
        for i in range(n):
            for j in range(n):
                if i != j:
                    k = "intra" if groups[i] == groups[j] else "inter"
                    b, t = worst.get(k, (math.inf, 0.0))
                    worst[k] = (min(b, rows[i][j][0]), max(t, rows[i][j][1]))
        pairs = {k: worst.get(k, worst.get("intra", (math.inf, 0.0))) for k in ("intra", "inter")}
    intra, inter = (Fabric(min(b, _NO_TIME), t) for b, t in (pairs["intra"], pairs["inter"]))
    return groups, intra, inter
