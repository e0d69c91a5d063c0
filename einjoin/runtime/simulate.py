"""The event simulator: a program's task graph (the same tasks, the same dependencies, no data)
replayed on a time model (:class:`~einjoin.cluster.model.Hardware`).

Each device has the lanes the runtime gives it — a compute lane, and a host-transfer lane when
the graph is memory-capped (the threads backend's) or on GPUs (``copy_engines``) — and each lane
runs one task at a time, taking the next from its ready queue in the runtime's own order
(:class:`~einjoin.runtime.engine.ReadyQueue`: fifo, lifo, priority by b-level, random). On GPUs
a move between devices takes no lane: it starts as soon as it is ready (the DMA engines and
NVLink/NIC ports carry many at once), so moves into one GPU share its incoming port instead of
queueing behind each other. A task is phases run one after another: its launch (the runtime's
dispatch; on a CPU machine the GIL, one at a time across devices), a fixed latency, then its
work; the work of concurrent tasks shares the resources it runs on (fluid, max-min fair sharing
by progressive filling: a link port's bandwidth between the transfers through it, a transfer
held to the slower of its two ports; a CPU's cores between the devices' kernels). What a task costs comes from its kind
(:data:`COSTS`) and the numbers it carries (flops from :mod:`einjoin.decomp.flops`, bytes of the
values it reads and writes), through the pure functions of :mod:`einjoin.cluster.model`.

Memory is counted as the stores count it: a value from the moment its first writer starts, a
task's scratch while it runs, until its release; the memory planner's evict and reload tasks are
in the graph of a capped program, so their traffic and their waits are simulated too.

>>> import einjoin as ej
>>> x = ej.input("x", (256, 256)); w = ej.input("w", (256, 256))
>>> prog = ej.compile(ej.relu(x @ w), devices=ej.Cluster.preset("dgx-h100", devices=2), backend="null")
>>> sim = prog.simulate()
>>> 0 < sim.makespan < 1e-3, sorted(sim.device_busy), str(sim).startswith("simulated")
(True, [0, 1], True)
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import operator
import os
import pathlib
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from einjoin.cluster import Cluster
from einjoin.cluster.model import Hardware, copy_time, is_contraction, steps_time, work_time
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import itemsize
from einjoin.ir.opkinds import Einsum, Fill
from einjoin.ir.printing import describe
from einjoin.ir.kernels import matmul_route
from einjoin.ir.scalar import Arg, Call
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime.backend import RunSpec
from einjoin.runtime.engine import Engine, ReadyQueue, RunStats, check_order, check_seed
from einjoin.runtime.simulate_hardware import TORCH_KINDS, hardware_for, kernel_pools, output_copies, streams
from einjoin.runtime.simulate_share import Sharing

__all__ = ["Simulation", "simulate", "simulate_program", "hardware_for", "SimulateBackend", "COSTS", "Phases"]

# a task's phases: (seconds alone, the shared resources it holds meanwhile as (resource, demand))
Resources = tuple[tuple[Any, float], ...]
Phases = tuple[tuple[float, Resources], ...]
GIL = ("gil",)
CORES = ("cores",)
BUS = ("bus",)  # the host's memory bus, which memory-bound kernels of devices sharing RAM divide


@dataclass
class Simulation:
    """What a simulated run gives: ``makespan`` (s, the run's fixed ``overhead`` included),
    ``device_busy`` (s of tasks per device, all its lanes: above the makespan where a GPU's
    copies overlap its kernels), ``link_bytes`` ((src, dst) -> bytes; -1 is the host), ``link_busy`` (the same
    pairs -> s of transfer), ``peak_memory`` (bytes per device), ``intervals`` (per device,
    (start, end, task id) in simulated seconds). Every figure is simulated, not measured. On
    several devices ``peak_memory`` is the peak of the one interleaving simulated, not a bound:
    a real run's tasks interleave otherwise and may peak higher (size memory from a cap, which
    the memory planner enforces, not from this figure)."""

    makespan: float
    device_busy: dict[int, float]
    link_bytes: dict[tuple[int, int], int]
    link_busy: dict[tuple[int, int], float]
    peak_memory: dict[int, int]
    intervals: dict[int, list[tuple[float, float, int]]]
    hardware: str
    tasks: Sequence[Task] = field(repr=False, default=())
    lanes: Sequence[int] = field(repr=False, default=())  # per task: 0 compute, 1 host transfers, 2 moves

    def trace(self, path: str | os.PathLike[str]) -> pathlib.Path:
        """Write the simulated run as a Chrome / Perfetto trace in the format of
        ``prog.run(trace=...)`` (:class:`einjoin.viz.trace.TraceRecorder`'s: an ``X`` event per
        task on its device's track, the same names and args), every event and the file marked
        simulated (``args["simulated"]``, ``otherData``, the process name). A device's kernels
        are on its track (``tid`` = the device); its host transfers and its moves, which overlap
        the kernels on a GPU, on tracks of their own ("device d host", "device d moves", one more
        per overlapping move: a track's events never overlap). Its folder is made."""
        out = pathlib.Path(os.fspath(path))
        out.parent.mkdir(parents=True, exist_ok=True)
        names: dict[Any, str] = {}
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                         "args": {"name": f"einjoin (simulated on {self.hardware})"}}]
        runs = sorted((s, e, tid) for iv in self.intervals.values() for s, e, tid in iv)
        n = len(self.intervals)
        tracks: dict[tuple[int, int, int], int] = {(d, 0, 0): d for d in range(n)}  # (device, lane, k) -> tid
        ends: dict[tuple[int, int], list[float]] = {}  # (device, lane) -> each sub-track's last end
        where: dict[int, int] = {}
        for s, e, tid in runs:
            d, ln = self.tasks[tid].device, (self.lanes[tid] if self.lanes else 0)
            if ln == 0:
                where[tid] = d
                continue
            last = ends.setdefault((d, ln), [])
            k = next((i for i, end in enumerate(last) if end <= s), len(last))  # the first free sub-track
            if k == len(last):
                last.append(e)
            last[k] = e
            where[tid] = tracks.setdefault((d, ln, k), len(tracks))
        for (d, ln, k), tr in sorted(tracks.items(), key=lambda kv: kv[1]):
            label = f"device {d}" + ("", " host", " moves")[ln] + (f" {k + 1}" if k else "")
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tr, "args": {"name": label}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tr,
                           "args": {"sort_index": d * 1000 + ln * 100 + k}})
        for s, e, tid in runs:
            t = self.tasks[tid]
            op = names.get(t.node)
            if op is None:
                op = names[t.node] = describe(t.node)
            args = t.trace_args(op)
            args["simulated"] = True
            events.append({"name": op if t.kind is TaskKind.KERNEL else f"{t.kind} {op}", "cat": t.kind.value,
                           "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6, "pid": 0, "tid": where[tid], "args": args})
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"simulated": True, "hardware": self.hardware, "makespan_s": self.makespan}}, f)
        return out

    def __str__(self) -> str:
        busy = max(self.device_busy.values(), default=0.0)
        moved = sum(b for (s, d), b in self.link_bytes.items() if s >= 0 and d >= 0)
        return (f"simulated on {self.hardware}: makespan {self.makespan * 1e3:.3f} ms (simulated), busiest device "
                f"{busy * 1e3:.3f} ms (simulated), {moved} bytes between devices, peak memory "
                f"{max(self.peak_memory.values(), default=0)} bytes per device (simulated)")


# ---- what each task kind costs: a rule per kind (a new kind adds a row here)

class _Ctx:
    """What the cost rules read: the hardware, the graph's values, whether it is capped."""

    def __init__(self, hw: Hardware, tg: TaskGraph, resident: bool = False, served: frozenset[int] = frozenset(),
                 weights: frozenset[Any] = frozenset()):
        self.hw, self.tg, self.resident, self.served, self.weights = hw, tg, resident, served, weights
        self.capped = tg.memory is not None
        self.threads = hw.threads()
        self.pools = kernel_pools(tg, hw)  # node kind -> its threads, where the pools' shares differ
        self.speedup = dict(hw.pool_speedup)  # a device's share of the cores over one thread, per pool
        self.cpu = hw.cores is not None
        # a launch is Python holding the GIL, on a core (with more devices than cores, a device's
        # dispatch waits for one as its kernels do)
        self.launch_res: Resources = (((GIL, 1.0), (CORES, 1.0)) if self.cpu else ((GIL, 1.0),)) \
            if hw.shared_memory else ()
        self.vbytes = [v.nbytes for v in tg.values]  # a property: read once per value
        self.bus = hw.mem_bus > 0 and streams(hw, tg, self.vbytes)  # memory-bound work holds the bus
        self.steps: dict[Any, Any] = {}  # node -> its elementwise steps (_steps), memoised

    def read_bytes(self, t: Task) -> int:
        vbytes = self.vbytes
        return sum(vbytes[v] for v in t.reads)

    def launch(self, t: Task) -> tuple[float, Resources]:
        return (self.hw.models[t.device].launch, self.launch_res)

    def light(self, t: Task, cost: float) -> tuple[float, Resources]:
        """The launch of a task that does no work on the device (``cost``: the model's
        ``free_cost`` or ``view_cost``; -1: a launch)."""
        return (self.hw.models[t.device].launch if cost < 0 else cost, self.launch_res)

    def on_cores(self, seconds: float, demand: float = 1.0, streamed: float = 0.0) -> tuple[float, Resources]:
        """Work of ``seconds`` alone on ``demand`` cores; ``streamed``: the bytes it reads and
        writes in memory, which hold the memory bus at their rate alone (when the program streams)."""
        held: Resources = ((CORES, demand),) if self.cpu else ()
        if self.bus and streamed > 0 and seconds > 0:
            held += ((BUS, min(streamed / seconds, self.hw.mem_bus)),)
        return (seconds, held)

    def copy(self, t: Task, nbytes: float) -> Phases:
        return (self.launch(t), self.on_cores(copy_time(self.hw.models[t.device], nbytes), 1.0, 2.0 * nbytes))

    def host(self, t: Task, nbytes: float, inward: bool) -> Phases:
        """A host <-> device copy: on a machine sharing the host's RAM a copy on the cores, else
        the device's host link (PCIe) in that direction."""
        if self.hw.shared_memory:
            return self.copy(t, nbytes)
        m = self.hw.models[t.device]
        port = ("host", 1 if inward else 0, t.device)
        return ((m.host_latency, ()), (nbytes / m.host_bw, ((port, m.host_bw),)))


class _Steps(NamedTuple):
    """How a kernel evaluates an elementwise expression step by step, as
    :func:`einjoin.ir.evaluate.evaluate` does (each distinct call once, over the broadcast of its
    arguments): ``calls`` (function, fraction of the block's box it covers), ``per`` the calls the
    flop table counts per element of the box (the box is the task's flops over it; 0: the box is
    the written block), ``aggregates`` (one more pass reading the joined box), ``size`` the
    itemsize it computes in, ``out_pass`` bytes per element of a last pass (a fill's cast),
    ``traffic`` the elements its calls read and write per element of the box (each distinct call's
    array arguments and its result)."""

    calls: tuple[tuple[str, float], ...]
    per: int
    aggregates: bool
    size: int
    out_pass: int = 0
    traffic: float = 0.0


def _walk(expr: Any, labels: Sequence[frozenset[Any]], sizes: dict[Any, int], full: int
          ) -> tuple[tuple[tuple[str, float], ...], int, float]:
    """The distinct calls of ``expr`` with the fraction of the box each covers (its arguments'
    labels broadcast together: ``labels[i]`` are ``Arg(i)``'s), the calls counted with repeats,
    and the elements the distinct calls read and write as a fraction of the box (a constant
    argument is no array)."""
    steps: dict[Call, float] = {}
    counted = 0
    traffic = 0.0

    def frac(labs: frozenset[Any]) -> float:
        return math.prod(sizes[lab] for lab in labs) / full

    def walk(e: Any) -> frozenset[Any]:
        nonlocal counted, traffic
        if isinstance(e, Arg):
            return labels[e.index]
        if not isinstance(e, Call):
            return frozenset()
        counted += 1
        args = [walk(a) for a in e.args]
        covers = frozenset().union(*args)
        if e not in steps:
            steps[e] = frac(covers)
            traffic += steps[e] + sum(frac(ls) for a, ls in zip(e.args, args) if isinstance(a, (Arg, Call)))
        return covers
    walk(expr)
    return tuple((e.fn, f) for e, f in steps.items()), counted, traffic


def _einsum_steps(node: Any) -> _Steps | None:
    # a product of two or more inputs that aggregates goes to BLAS (matmul_route): not elementwise
    op = node.op
    if (len(node.inputs) > 1 and op.agg_labels
            and matmul_route(op, [x.dtype for x in node.inputs]).path != "join"):
        return None
    sizes: dict[Any, int] = {}
    for x, ls in zip(node.inputs, op.in_labels):
        sizes.update(zip(ls, x.shape))
    full = max(1, math.prod(sizes.get(lab, 1) for lab in op.all_labels))
    calls, counted, traffic = _walk(op.join, [frozenset(ls) for ls in op.in_labels], sizes, full)
    return _Steps(calls, max(1, counted), bool(op.agg_labels), itemsize(node.dtype), traffic=traffic)


def _fill_steps(node: Any) -> _Steps:
    # the expression over index grids (float64 for a float fill), then cast to the node's dtype
    shape = node.shape
    calls, _, traffic = _walk(node.op.expr, [frozenset((d,)) for d in range(len(shape))], dict(enumerate(shape)),
                              max(1, math.prod(shape)))
    return _Steps(calls, 0, False, 8, 8 + itemsize(node.dtype), traffic)  # fill_kernel's grids: float64 or int64


# per task kind, the node kinds whose expression a kernel of that task evaluates step by step
_STEP_RULES: dict[TaskKind, dict[type, Callable[[Any], _Steps | None]]] = {
    TaskKind.KERNEL: {Einsum: _einsum_steps},
    TaskKind.FILL: {Fill: _fill_steps},
}


def _elementwise(c: _Ctx, t: Task) -> Phases | None:
    """The phases of an elementwise kernel evaluated step by step (:class:`_Steps`) on a device
    with per-function rates (None otherwise: the roofline): its launch and the Python of its
    steps (``fn_call`` each), which hold the GIL, then the ufuncs' work on a core."""
    m = c.hw.models[t.device]
    if not m.fn_rates:
        return None
    key = (t.node, t.kind)
    how = c.steps.get(key, False)
    if how is False:
        rule = _STEP_RULES.get(t.kind, {}).get(type(t.node.op))
        how = c.steps[key] = rule(t.node) if rule is not None else None
    if how is None:
        return None
    box = t.flops / how.per if how.per else t.nbytes / max(1, itemsize(t.node.dtype))
    if not how.calls:  # no function: a copy, or a reduction, of the inputs (a constant fill: its write)
        moved = c.read_bytes(t) + t.nbytes
        secs = steps_time(m, (), moved) or 0.0
        return (c.launch(t), c.on_cores(secs, 1.0, moved))
    passes = (box * how.size + t.nbytes if how.aggregates else 0.0) + box * how.out_pass
    secs = steps_time(m, [(fn, f * box) for fn, f in how.calls], passes, how.size) or 0.0
    python = len(how.calls) * m.fn_call
    # each step streams its array arguments and its result: at best at the memory bandwidth (the
    # function rates are measured on arrays the last level cache holds; a program's blocks were
    # written by other kernels a while before: x0 * x1 over 1 MB arrays ran at 2.1 Gelem/s cold,
    # 6.5 hot, where 12 bytes an element at mem_bw give 2.75)
    streamed = how.traffic * box * how.size + passes
    return ((m.launch + python, c.launch_res), c.on_cores(max(secs - python, streamed / m.mem_bw), 1.0, streamed))


def _kernel(c: _Ctx, t: Task) -> Phases:
    m = c.hw.models[t.device]
    steps = _elementwise(c, t)
    if steps is not None:
        return steps
    # numpy's kernels write their scratch (a joined block, attention's scores) and read it once
    # more; a GPU's kernels fuse it away (flash attention, GEMM epilogues)
    nbytes = c.read_bytes(t) + t.nbytes + (2 * t.scratch if c.hw.shared_memory else 0)
    dtype = t.node.dtype
    threads = demand = 1.0  # the kernel's threads (its speed) and the cores they hold (single-core equivalents)
    streamed = float(nbytes)  # a memory-bound kernel's bytes hold the bus; a GEMM works in the caches
    if is_contraction(t.flops, nbytes):
        streamed = 0.0
        kind = type(t.node.op)
        if c.pools is not None and kind in c.pools:
            threads = c.pools[kind]  # the pool with one thread: one thread's rate, one core
        else:
            threads = c.threads
            demand = c.speedup.get("torch" if kind in TORCH_KINDS else "blas", threads)
    return (c.launch(t), c.on_cores(work_time(m, t.flops, nbytes, dtype, threads, t.node.kind), demand, streamed))


def _memory_bound(c: _Ctx, t: Task) -> Phases:  # fill, reduce: bytes read and written
    m = c.hw.models[t.device]
    steps = _elementwise(c, t)  # a fill's expression, on a device that evaluates it step by step
    if steps is not None:
        return steps
    moved = c.read_bytes(t) + t.nbytes
    return (c.launch(t), c.on_cores(work_time(m, t.flops, moved, t.dtype or t.node.dtype), 1.0, moved))


def _copy(c: _Ctx, t: Task) -> Phases:  # select, touch: a copy of the written bytes
    return c.copy(t, t.nbytes)


def _load(c: _Ctx, t: Task) -> Phases:
    if c.resident or t.id in c.served:
        return ()  # on the device already (weights, state the last run left there)
    if c.hw.shared_memory and not c.capped:
        # a view of the feed, a block of columns too (einjoin.plan.execute._load: any block of a
        # C-ordered feed; its rows strided)
        return (c.light(t, c.hw.models[t.device].view_cost),)
    return c.copy(t, t.nbytes) if c.hw.shared_memory else c.host(t, t.nbytes, inward=True)


def _move(c: _Ctx, t: Task) -> Phases:
    if t.node in c.weights:
        return ()  # a weight's replica, resident on its reader as the block is on its home (simulate)
    src, dst = t.payload.src_device, t.device
    if c.hw.shared_memory and not c.hw.own_links:
        # devices in one process hand a block over (zero-copy) unless the graph is capped
        return c.copy(t, t.nbytes) if c.capped else (c.light(t, c.hw.models[t.device].view_cost),)
    if src == dst:
        return c.copy(t, t.nbytes)
    f = c.hw.fabric(src, dst)
    ports = tuple((port, f.bandwidth) for port in c.hw.route(src, dst))
    return ((c.launch(t),) if c.hw.own_links else ()) + ((f.latency, ()), (t.nbytes / f.bandwidth, ports))


def _release(c: _Ctx, t: Task) -> Phases:  # free; evict / writeback copy to the host first
    if t.kind.to_host and t.nbytes and not (c.resident and t.kind is TaskKind.WRITEBACK):
        return c.host(t, t.nbytes, inward=False) if not c.hw.shared_memory else c.copy(t, t.nbytes)
    return (c.light(t, c.hw.models[t.device].free_cost),) if c.hw.shared_memory else ()


def _reload(c: _Ctx, t: Task) -> Phases:
    return c.copy(t, t.nbytes) if c.hw.shared_memory else c.host(t, t.nbytes, inward=True)


COSTS: dict[TaskKind, Callable[[_Ctx, Task], Phases]] = {
    TaskKind.LOAD: _load,
    TaskKind.FILL: _memory_bound,
    TaskKind.KERNEL: _kernel,
    TaskKind.REDUCE: _memory_bound,
    TaskKind.SELECT: _copy,
    TaskKind.MOVE: _move,
    TaskKind.TOUCH: _copy,
    TaskKind.FREE: _release,
    TaskKind.EVICT: _release,
    TaskKind.RELOAD: _reload,
    TaskKind.WRITEBACK: _release,
}

_CROSSES_HOST = frozenset(k for k in TaskKind if k.crosses_host)
_RELEASES = frozenset(k for k in TaskKind if k.releases)


def _caps(hw: Hardware) -> Callable[[Any], float]:
    def cap(r: Any) -> float:
        if r is GIL:
            return 1.0
        if r is CORES:
            return float(hw.core_capacity or hw.cores or 1)
        if r is BUS:
            return float(hw.mem_bus)
        kind, _, dev = r
        if kind == "host":
            return float(hw.models[dev].host_bw)
        return float(hw.intra.bandwidth if kind == "intra" else hw.inter.bandwidth)
    return cap


class _Flow:
    """A task in flight: its phases, the one it is in, and the seconds (alone) left of it."""

    __slots__ = ("task", "lane", "phases", "i", "left", "res", "ids", "rate", "start", "since", "end")

    def __init__(self, task: Task, lane: int, phases: Phases, start: float):
        self.task, self.lane, self.phases, self.start = task, lane, phases, start
        self.i = -1
        self.left = 0.0
        self.res: Resources = ()
        self.ids: tuple[tuple[int, float], ...] = ()  # ``res`` numbered (:class:`Sharing`), while shared
        self.rate = 1.0
        self.since = start  # when ``left`` was last brought up to date (a shared phase)
        self.end = start    # when the phase ends at the current rate

    def advance(self) -> bool:
        """Enter the next phase with time in it (consecutive phases that share nothing run as
        one); False when none is left (the task is done)."""
        phases, n = self.phases, len(self.phases)
        while self.i + 1 < n:
            self.i += 1
            self.left, self.res = phases[self.i]
            if self.left > 0:
                if not self.res:
                    while self.i + 1 < n and not phases[self.i + 1][1]:
                        self.i += 1
                        self.left += phases[self.i][0]
                return True
        return False


_end_of = operator.attrgetter("end")


def simulate(tg: TaskGraph, hardware: Hardware, order: str = "fifo", seed: int = 0,
             priority: Sequence[float] | None = None, resident: bool = False,
             served: frozenset[int] = frozenset(), replicated: bool = False,
             state: frozenset[Any] = frozenset(), landed: frozenset[int] = frozenset()) -> Simulation:
    """Replay ``tg`` on ``hardware`` with the ready-queue policy ``order`` (``seed`` for
    ``random``; ``priority``: the b-levels for ``priority``, computed when not given).
    ``resident``: the inputs are on their devices before the run and the outputs stay there
    (weights and state kept on GPUs; what a kernel benchmark times): loads and write-backs
    cost nothing. ``replicated`` (with ``resident``): a parameter (``ej.param``) is resident on
    every device that reads it, not only on its blocks' homes, as a deployment keeps each weight
    shard on every GPU that reads it: the task graph loads one copy and moves it to each further
    reader (its accounting, and what a run does), those moves then cost nothing and their bytes
    count as host loads (``link_bytes[(-1, device)]``, free when resident; their memory as
    before). Not for the inputs in ``state`` (values the program writes: a training step's
    parameters move to their readers each step). Off by default: ``ej.compile``'s time objective
    and the placement search score plans with each forward's weight moves counted.
    ``served``: ids of load tasks whose block is on its device already (a
    program's state the last run kept there): they cost nothing. ``landed``: ids of tasks that
    copy their block into a multi-block output once written (the local sessions' output slots:
    :func:`einjoin.runtime.simulate_hardware.output_copies`): a copy of it after their work.

    >>> from einjoin.cluster.presets import preset_hardware
    >>> import einjoin as ej
    >>> prog = ej.compile(ej.input("a", (64, 64)) @ ej.input("b", (64, 64)), devices=2, backend="null")
    >>> sim = simulate(prog.taskgraph, preset_hardware("dgx-a100", devices=2))
    >>> sim.makespan > 0 and len(sim.intervals[0]) + len(sim.intervals[1]) == len(prog.taskgraph)
    True
    """
    order, seed = check_order(order), check_seed(seed)
    key = (hardware, order, seed, resident, served, replicated, state, landed)
    for ref, k, sim in _RECENT:  # the same graph again: ej.compile's time objective simulated it already
        if priority is None and ref() is tg and k == key:
            return _own_copy(sim)
    sim = _simulate(tg, hardware, order, seed, priority, resident, served, replicated, state, landed)
    if priority is None:
        _RECENT.append((weakref.ref(tg), key, _own_copy(sim)))
        del _RECENT[:-2]
    return sim


def _own_copy(sim: Simulation) -> Simulation:
    """``sim`` with dicts and interval lists of its own: a caller that changes the one it got
    (drops a device's intervals, adds up link bytes) changes no other caller's."""
    return dataclasses.replace(sim, device_busy=dict(sim.device_busy), link_bytes=dict(sim.link_bytes),
                               link_busy=dict(sim.link_busy), peak_memory=dict(sim.peak_memory),
                               intervals={d: list(iv) for d, iv in sim.intervals.items()})


# the last two simulations (with the runs' own ready order), by their task graph (weakly) and the
# other arguments: a plan compiled for time was simulated to choose it, and prog.simulate() of it
# then replays nothing. Each caller gets a copy (its dicts and lists its own; the tasks, immutable,
# are shared).
_RECENT: list[tuple[weakref.ref[TaskGraph], tuple[Any, ...], Simulation]] = []


def _simulate(tg: TaskGraph, hardware: Hardware, order: str, seed: int, priority: Sequence[float] | None,
              resident: bool, served: frozenset[int], replicated: bool = False,
              state: frozenset[Any] = frozenset(), landed: frozenset[int] = frozenset()) -> Simulation:
    if hardware.size != tg.n_devices:
        from einjoin.errors import EinjoinError
        raise EinjoinError(f"simulate: the hardware {hardware.name!r} has {hardware.size} devices, the task graph "
                           f"{tg.n_devices}")
    if order == "priority" and priority is None:
        priority = Engine(tg, {}).priority()
    weights = frozenset(t.node for t in tg.tasks if t.kind is TaskKind.LOAD and getattr(t.node.op, "param", False)
                        and t.node not in state) if resident and replicated else frozenset()
    ctx = _Ctx(hardware, tg, resident, served, weights)
    n = tg.n_devices
    host_lanes = ctx.capped or hardware.copy_engines
    copy_lanes = hardware.copy_engines

    def lane(t: Task) -> int:
        if host_lanes and t.kind in _CROSSES_HOST:
            return n + t.device
        if copy_lanes and t.kind is TaskKind.MOVE:
            return 2 * n + t.device  # a lane without a limit: its moves all start when ready
        return t.device

    tasks, dependents, vbytes = tg.tasks, tg.dependents, ctx.vbytes
    queues = [ReadyQueue(order, priority or (), seed + q) for q in range(3 * n)]
    counters = [len(t.deps) for t in tasks]
    lanes = [lane(t) for t in tasks]
    for t in tasks:
        if not t.deps:
            queues[lanes[t.id]].push(t.id)
    idle = [True] * (3 * n)
    waiting = {q for q in range(3 * n) if len(queues[q])}
    sharing = Sharing(_caps(hardware))
    live, peak = [0] * n, [0] * n
    counted: set[int] = set()
    intervals: dict[int, list[tuple[float, float, int]]] = {d: [] for d in range(n)}
    link_bytes: dict[tuple[int, int], int] = {}
    link_busy: dict[tuple[int, int], float] = {}
    active: list[_Flow] = []
    fixed: list[tuple[float, int, _Flow]] = []  # flows in a phase that shares nothing: by end time
    now = 0.0
    done = 0
    serial = 0
    dirty = False  # the set of shared phases changed: their rates are recomputed

    def finish(f: _Flow) -> None:
        nonlocal done
        t = f.task
        intervals[t.device].append((f.start, now, t.id))
        d = t.device
        live[d] -= t.scratch
        if t.kind in _RELEASES:
            v = t.payload.frees
            if v in counted:
                counted.discard(v)
                live[d] -= vbytes[v]
        pair = (-1, d) if t.kind is TaskKind.MOVE and t.node in weights else _pair(t)  # a resident replica
        if pair is not None:
            link_bytes[pair] = link_bytes.get(pair, 0) + t.nbytes
            link_busy[pair] = link_busy.get(pair, 0.0) + (now - f.start)
        idle[f.lane] = True
        if len(queues[f.lane]):
            waiting.add(f.lane)
        for dep in dependents[t.id]:
            counters[dep] -= 1
            if counters[dep] == 0:
                q = lanes[dep]
                queues[q].push(dep)
                if idle[q]:
                    waiting.add(q)
        done += 1

    # the shared phases by resource, and the resources whose flows changed since the last
    # sharing: only the flows connected to those through shared resources get new rates (max-min
    # fairness splits into such components; on 256 GPUs most transfers are in other nodes')
    through: dict[int, dict[_Flow, None]] = {}  # by resource number
    touched: dict[int, None] = {}

    def place(f: _Flow) -> None:
        nonlocal serial, dirty
        if f.res:
            f.since, f.rate = now, 0.0
            active.append(f)
            f.ids = sharing.number(f.res)
            for r, _ in f.ids:
                through.setdefault(r, {})[f] = None
                touched[r] = None
            dirty = True
        else:
            serial += 1
            heapq.heappush(fixed, (now + f.left, serial, f))

    while True:
        while waiting:  # a task that ends as it starts may make others ready at once
            batch = sorted(waiting)
            waiting.clear()
            for q in batch:
                if not (idle[q] and len(queues[q])):
                    continue
                for _ in range(len(queues[q]) if q >= 2 * n else 1):  # a move lane starts them all
                    t = tasks[queues[q].pop()]
                    idle[q] = q >= 2 * n
                    d = t.device
                    if t.writes >= 0 and t.writes not in counted:
                        counted.add(t.writes)
                        live[d] += vbytes[t.writes]
                    live[d] += t.scratch
                    if live[d] > peak[d]:
                        peak[d] = live[d]
                    phases = COSTS[t.kind](ctx, t)
                    if landed and t.id in landed:  # then copied into its output's slot
                        phases += (ctx.on_cores(copy_time(hardware.models[d], t.nbytes), 1.0, 2.0 * t.nbytes),)
                    f = _Flow(t, q, phases, now)
                    if f.advance():
                        place(f)
                    else:
                        finish(f)  # nothing to do (a free on a GPU): it ends as it starts
        if not active and not fixed:
            break
        # the next event: the first fixed phase to end, or the first shared phase to end at the
        # rates the shared phases now have (recomputed only when that set changed)
        if dirty:
            comp: dict[_Flow, None] = {}
            stack = list(touched)
            seen = set(stack)
            touched.clear()
            while stack:
                for f in through.get(stack.pop(), ()):
                    if f not in comp:
                        comp[f] = None
                        f.left -= f.rate * (now - f.since)  # its progress at the old rate
                        f.since = now
                        for r, _ in f.ids:
                            if r not in seen:
                                seen.add(r)
                                stack.append(r)
            changed = list(comp)
            sharing.share(changed)
            for f in changed:
                f.end = now + max(f.left, 0.0) / f.rate
            dirty = False
        nxt = fixed[0][0] if fixed else math.inf
        if active:
            nxt = min(nxt, min(map(_end_of, active)))
        now = max(now, nxt)
        limit = now * (1 + 1e-12) + 1e-15
        ended: list[_Flow] = []
        if active:
            keep = [f for f in active if f.end > limit]
            if len(keep) < len(active):
                ended = [f for f in active if f.end <= limit]
                active[:] = keep
                for f in ended:
                    for r, _ in f.ids:
                        users = through[r]
                        del users[f]
                        if not users:
                            del through[r]
                        touched[r] = None
                dirty = True
        while fixed and fixed[0][0] <= now * (1 + 1e-12) + 1e-15:
            ended.append(heapq.heappop(fixed)[2])
        for f in ended:
            if f.advance():
                place(f)
            else:
                finish(f)
    if done < len(tasks):
        from einjoin.errors import EinjoinError
        raise EinjoinError(f"simulate: {len(tasks) - done} of {len(tasks)} tasks never got ready (a cycle?)")
    busy = {d: sum(e - s for s, e, _ in iv) for d, iv in intervals.items()}
    return Simulation(now + hardware.overhead, busy, link_bytes, link_busy, {d: peak[d] for d in range(n)}, intervals,
                      hardware.name, tasks, tuple(q // n for q in lanes))


def _pair(t: Task) -> tuple[int, int] | None:
    """The (src, dst) a task's bytes cross (-1: the host), or None."""
    k = t.kind
    if k is TaskKind.MOVE:
        return (t.payload.src_device, t.device)
    if k is TaskKind.LOAD or k is TaskKind.RELOAD:
        return (-1, t.device)
    if k.to_host and t.nbytes:
        return (t.device, -1)
    return None


def simulate_program(prog: Any, cluster: Cluster | None = None, order: str | None = None,
                     seed: int | None = None, resident: bool = False, replicated: bool = False) -> Simulation:
    """``prog.simulate(...)``: its task graph on ``cluster``'s time model (default: the cluster
    it was compiled for), in its run order."""
    cl = prog.cluster if cluster is None else cluster
    if not isinstance(cl, Cluster):
        from einjoin.errors import EinjoinError
        raise EinjoinError(f"simulate: cluster must be an ej.Cluster (e.g. ej.Cluster.preset('dgx-a100')), got "
                           f"{type(cl).__name__} {cl!r:.60}")
    order = check_order(prog.order if order is None else order)
    engine = prog._engine  # noqa: SLF001 - its b-levels are the run's priority order
    hw, state = hardware_for(cl), frozenset(s.node for s in prog.plan.state)
    return simulate(prog.taskgraph, hw, order, check_seed(prog.seed if seed is None else seed),
                    engine.priority() if order == "priority" else None, resident, replicated=replicated,
                    state=state, landed=output_copies(engine, hw) if not state else frozenset())


@dataclass(frozen=True)
class SimulateBackend:
    """``backend="simulate"``: a run simulates the task graph instead of computing it. ``run``
    returns None (no data, as the null backend); ``prog.run_stats`` holds the simulated figures:
    ``wall_time`` is the simulated makespan, ``busy_time_per_device``, ``intervals`` (on the
    engine's clock: callbacks and ``trace=`` see the simulated durations), peak bytes per device
    and the plan's bytes; ``last`` the :class:`Simulation` of the latest run (for its trace).
    The cluster's time model is the program's cluster's (:func:`hardware_for`).

    >>> import numpy as np, einjoin as ej
    >>> prog = ej.compile(ej.input("a", (64, 64)) @ ej.input("b", (64, 64)),
    ...                   devices=ej.Cluster.preset("dgx-h100", devices=2), backend="simulate")
    >>> prog.run(np.ones((64, 64), np.float32), np.ones((64, 64), np.float32)) is None
    True
    >>> prog.run_stats.wall_time == prog.backend.last.makespan > 0
    True
    """

    name: str = "simulate"
    computes: bool = False
    remote: bool = False
    retries: int = 0
    _last: list[Simulation] = field(default_factory=list, compare=False, repr=False)

    @property
    def last(self) -> Simulation | None:
        """The latest run's simulation (None before the first)."""
        return self._last[-1] if self._last else None

    def open(self, run: RunSpec) -> _SimSession:
        return _SimSession(run, self._last)

    def close(self) -> None:
        pass


class _SimSession:
    """One simulated run: an eager session whose tasks need no submitting; ``finish`` simulates."""

    eager = True

    def __init__(self, run: RunSpec, last: list[Simulation]):
        self.run, self.last = run, last

    def __enter__(self) -> _SimSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def submit(self, task: Task) -> None:
        pass

    def collect(self, cancel: Any) -> None:
        if cancel is not None and cancel.cancelled:
            from einjoin.errors import EinjoinError
            raise EinjoinError("run cancelled before its simulation")

    def finish(self, stats: RunStats) -> None:
        run = self.run
        engine, tg = run.engine, run.engine.tg
        from einjoin.cluster import local
        hw = hardware_for(run.cluster if run.cluster is not None else local(tg.n_devices))
        state = run.state
        # as the stores do (StateRun.load): a load of state the last run left on its device takes
        # the block as it is (nothing loaded); state kept in host RAM is fed again (a reload)
        served = frozenset() if state is None else frozenset(
            t.id for t in tg.tasks if t.kind is TaskKind.LOAD and t.node in state.resident)
        on_host = 0 if state is None else sum(
            t.nbytes for t in tg.tasks if t.kind is TaskKind.LOAD and t.node in state.on_host and t.id not in served)
        sim = simulate(tg, hw, run.order, run.seed, engine.priority() if run.order == "priority" else None,
                       served=served, landed=output_copies(engine, hw) if state is None else frozenset())
        self.last[:] = [sim]
        base = time.perf_counter()
        stats.wall_time = sim.makespan
        stats.source = "simulated"  # its repr says so beside every figure
        stats.intervals = {d: [(base + s, base + e, tid) for s, e, tid in iv] for d, iv in sim.intervals.items()}
        stats.peak_bytes_per_device = dict(sim.peak_memory)
        by_kind: dict[TaskKind, int] = {}
        for t in tg.tasks:
            if t.id not in served:
                by_kind[t.kind] = by_kind.get(t.kind, 0) + t.nbytes
        stats.bytes_moved = by_kind.get(TaskKind.MOVE, 0)
        # as _move models them: handed over (shared memory, local(n)'s links, uncapped), else copied
        handed = hw.shared_memory and not hw.own_links and tg.memory is None
        stats.bytes_copied = 0 if handed else stats.bytes_moved
        stats.bytes_loaded = by_kind.get(TaskKind.LOAD, 0) - on_host
        stats.bytes_evicted = by_kind.get(TaskKind.EVICT, 0)  # as the stores count it: write-backs are not evictions
        stats.bytes_reloaded = by_kind.get(TaskKind.RELOAD, 0) + on_host
        fetched = tg if state is None else state.fetched(tg)
        stats.bytes_fetched = sum(tg.values[v].nbytes for lay in fetched.outputs for v in lay.blocks.values())
        if state is not None:
            state.keep(tg, None, tg.memory is not None, run.feeds)
