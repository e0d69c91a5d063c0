"""The memory planner (TURNIP): walk one topological order of a task graph against a per-device
allocator, evicting to the host the resident value used furthest in the future (Belady) when an
allocation does not fit, and reloading it before its next use.

The allocator hands out bytes of a device's cap as chunks, each tagged with the task that freed
it; an allocation depends on the tasks that freed the chunks it takes (the earliest freed first,
so few ordering edges are new). The chunks are bytes of a budget, not addresses — the runtime's
own allocator places the arrays — so fragmentation never forces an eviction. Because every byte
passes from one value to the next only along a dependency edge, no order of the resulting graph
holds more than the cap on any device: the runtime may run any ready task.

>>> import einjoin as ej
>>> x = ej.input("x", (64, 64)); w = ej.input("w", (64, 64))
>>> prog = ej.compile(ej.relu(x @ w) @ w, memory_limit="40KiB")
>>> prog.taskgraph.memory.peak_bytes_per_device[0] <= 40 * 1024
True
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from einjoin.decomp.decompose import Decomposition
from einjoin.errors import EinjoinError
from einjoin.exchange import Release, Reload, Task, TaskKind, Value
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.memplan.needs import MemoryCapError, cap_error, kernel_scratches, task_needs
from einjoin.plan.stats import human_bytes
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["MemoryPlan", "plan_memory", "POLICIES"]

# belady: evict the furthest next use, only when an allocation does not fit, reload as early as
# memory allows; naive: evict every value after each use and reload it right before the next
# one, after the device's previous task (no prefetch) — the baseline bench/offload.py compares.
POLICIES = ("belady", "naive")


@dataclass(frozen=True)
class MemoryPlan:
    """What the memory planner decided: the caps, and per device the allocator's high-water mark
    (any run stays at or below it), with the evictions and reloads it added."""

    caps: dict[int, int | None]
    policy: str
    peak_bytes_per_device: dict[int, int]
    evictions: int
    reloads: int
    bytes_evicted: int
    bytes_reloaded: int

    def __str__(self) -> str:
        caps = {d: human_bytes(c) if c is not None else "none" for d, c in self.caps.items()}
        return (f"memory plan ({self.policy}): caps {caps}, {self.evictions} evictions "
                f"({human_bytes(self.bytes_evicted)} written to the host), {self.reloads} reloads "
                f"({human_bytes(self.bytes_reloaded)})")


class _Pool:
    """One device's cap as chunks (tag = id of the task that freed them; -1 = never used)."""

    def __init__(self, cap: int | None):
        self.cap = cap
        self.free = cap if cap is not None else 0
        self.heap: list[tuple[int, int, int]] = [(-1, 0, cap)] if cap else []
        self.seq = 1
        self.used = self.peak = 0

    def take(self, n: int) -> list[int]:
        self.used += n
        self.peak = max(self.peak, self.used)
        if self.cap is None or n == 0:
            return []
        deps, got = [], 0
        while got < n:
            tag, _, size = heapq.heappop(self.heap)
            use = min(size, n - got)
            got += use
            if size > use:
                heapq.heappush(self.heap, (tag, self.seq, size - use))
                self.seq += 1
            if tag >= 0:
                deps.append(tag)
        self.free -= n
        return deps

    def release(self, tag: int, n: int) -> None:
        self.used -= n
        if self.cap is None or n == 0:
            return
        heapq.heappush(self.heap, (tag, self.seq, n))
        self.seq += 1
        self.free += n


def _walk_order(tg: TaskGraph) -> tuple[list[int], dict[int, list[tuple[TaskKind, int]]]]:
    """Non-free tasks in id order with each load and fill moved to just before its first
    reader; then, per position, the frees and output write-backs that follow it."""
    readers: dict[int, list[int]] = defaultdict(list)
    for t in tg.tasks:
        for v in t.reads:
            readers[v].append(t.id)
    lazy = {t.id for t in tg.tasks if t.kind.clean and readers[t.writes]}
    order: list[int] = []
    done: set[int] = set()
    for t in tg.tasks:
        if t.kind is TaskKind.FREE or t.id in lazy:
            continue
        for v in t.reads:
            for p in tg.values[v].producers:
                if p in lazy and p not in done:
                    order.append(p)
                    done.add(p)
        order.append(t.id)
        done.add(t.id)
    pos = {tid: i for i, tid in enumerate(order)}
    after: dict[int, list[tuple[TaskKind, int]]] = defaultdict(list)
    for t in tg.tasks:
        if t.kind is TaskKind.FREE:
            after[max(pos[a] for a in t.deps)].append((TaskKind.FREE, t.payload.frees))
    for lay in tg.outputs:
        for v in lay.blocks.values():
            users = [*tg.values[v].producers, *readers[v]]
            after[max(pos[u] for u in users)].append((TaskKind.WRITEBACK, v))
    return order, after


def plan_memory(tg: TaskGraph, decomps: Mapping[Node, Decomposition], caps: Mapping[int, int | None],
                policy: str = "belady") -> TaskGraph:
    """The memory-planned task graph for ``caps`` (device -> bytes, None: uncapped). Graph
    inputs start in the host store; outputs end there (``writeback``). Raises
    :class:`MemoryCapError` when one task alone does not fit its device's cap."""
    if policy not in POLICIES:
        raise EinjoinError(f"unknown memory policy {policy!r}; known: {', '.join(POLICIES)}")
    if tg.memory is not None:
        raise EinjoinError("this task graph is already memory-planned")
    scratch = kernel_scratches(tg, decomps)  # once: the pre-check and the walk both read it
    for need in task_needs(tg, decomps, scratch):
        cap = caps.get(need.device)
        if cap is not None and need.needed > cap:
            raise cap_error(need, cap)
    return _Walk(tg, decomps, caps, policy, scratch).run()


class _Walk:
    def __init__(self, tg: TaskGraph, decomps: Mapping[Node, Decomposition],
                 caps: Mapping[int, int | None], policy: str, scratch: Mapping[int, int]):
        self.tg, self.decomps, self.policy, self.scratch = tg, decomps, policy, scratch
        self.caps = {d: caps.get(d) for d in range(tg.n_devices)}
        self.pools = {d: _Pool(c) for d, c in self.caps.items()}
        self.tasks: list[Task] = []
        self.values: list[Value] = [Value(v.id, v.device, v.shape, v.dtype, v.node) for v in tg.values]
        self.cur: dict[int, int | None] = {}        # base value -> its resident version
        self.ever: set[int] = set()                 # produced (or first touched) already
        self.prod: dict[int, list[int]] = {}        # producers of the current version
        self.rdrs: dict[int, list[int]] = {}        # its readers so far
        self.wdeps: dict[int, list[int]] = {}       # what every writer of the version waits for
        self.host_ok: set[int] = set()              # the host store holds the current contents
        self.host_writer: dict[int, int] = {}
        self.resident: dict[int, dict[int, None]] = {d: {} for d in range(tg.n_devices)}
        self.last_on: dict[int, int] = {}
        self.outputs = {v for lay in tg.outputs for v in lay.blocks.values()}
        self.source = {v.id: tg.tasks[v.producers[0]] for v in tg.values if v.producers}
        self.evictions = self.reloads = self.bytes_evicted = self.bytes_reloaded = 0

    # -- bookkeeping ----------------------------------------------------------------------
    def emit(self, t: Task, *, kind: TaskKind | None = None, device: int | None = None,
             reads: tuple[int, ...] | None = None, writes: int | None = None, deps: tuple[int, ...] | None = None,
             nbytes: int | None = None, flops: int | None = None, payload: object = None,
             scratch: int | None = None) -> int:
        """Append ``t`` as the next task, with the fields given changed (None: ``t``'s). Built
        field by field, not by ``dataclasses.replace``: a LLaMA-70B layer on 256 GPUs emits
        some 170k tasks, and replace's generic path cost more than the walk's own work."""
        tid = len(self.tasks)
        t = Task(tid, t.kind if kind is None else kind, t.device if device is None else device,
                 t.reads if reads is None else reads, t.writes if writes is None else writes,
                 t.deps if deps is None else deps, t.nbytes if nbytes is None else nbytes,
                 t.flops if flops is None else flops, t.node, t.payload if payload is None else payload,
                 t.scratch if scratch is None else scratch, t.dtype)
        self.tasks.append(t)
        self.last_on[t.device] = tid
        return tid

    def size(self, b: int) -> int:
        return self.tg.values[b].nbytes

    def next_use(self, b: int, pos: int) -> float:
        uses = self.uses[b]
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else float("inf")

    def alloc(self, dev: int, n: int, pinned: set[int], pos: int, task: Task) -> list[int]:
        pool = self.pools[dev]
        while pool.cap is not None and pool.free < n:
            cands = [b for b in self.resident[dev] if b not in pinned]
            if not cands:  # the pre-check makes this unreachable; keep the error clear anyway
                raise MemoryCapError(f"memory cap: {describe(task.node)} needs {human_bytes(n)} more on "
                                     f"device {dev} with nothing left to evict (cap "
                                     f"{human_bytes(pool.cap)})", describe(task.node), dev, n, pool.cap)
            # Belady: the furthest next use; among equals a clean one (nothing to write back)
            victim = max(cands, key=lambda b: (self.next_use(b, pos), not self.dirty(b), self.size(b)))
            self.evict(victim)
        return pool.take(n)

    def dirty(self, b: int) -> bool:
        if b in self.host_ok:
            return False
        return b in self.outputs or not self.source[b].kind.clean

    def evict(self, b: int) -> None:
        v = self.cur[b]
        assert v is not None
        write = self.dirty(b)
        nbytes = self.size(b) if write else 0
        tid = self.emit(self.source[b], kind=TaskKind.EVICT, device=self.values[v].device, reads=(v,), writes=-1,
                        deps=tuple(dict.fromkeys(self.prod[b] + self.rdrs[b])), nbytes=nbytes, flops=0,
                        payload=Release(v, host_key=b), scratch=0)
        if write:
            self.host_ok.add(b)
            self.host_writer[b] = tid
            self.bytes_evicted += nbytes
        self.evictions += 1
        self.pools[self.values[v].device].release(tid, self.size(b))
        del self.resident[self.values[v].device][b]
        self.cur[b] = None

    def restore(self, b: int, pos: int, pinned: set[int], task: Task) -> None:
        val = self.tg.values[b]
        mem = self.alloc(val.device, val.nbytes, pinned, pos, task)
        src = self.source[b]
        vid = len(self.values)
        self.values.append(Value(vid, val.device, val.shape, val.dtype, val.node))
        if self.policy == "naive" and val.device in self.last_on:
            mem = [*mem, self.last_on[val.device]]  # synchronous: after the device's last task
        if src.kind is TaskKind.FILL and b not in self.host_ok:
            tid = self.emit(src, writes=vid, deps=tuple(dict.fromkeys(mem)))  # recompute in place
        else:
            from_feed = b not in self.host_ok
            if not from_feed:
                mem = [*mem, self.host_writer[b]]
            tid = self.emit(src, kind=TaskKind.RELOAD, device=val.device, reads=(), writes=vid,
                            deps=tuple(dict.fromkeys(mem)), nbytes=val.nbytes, flops=0,
                            payload=Reload(b, src.payload.box if from_feed else None), scratch=0)
            self.reloads += 1
            self.bytes_reloaded += val.nbytes
        self.cur[b], self.prod[b], self.rdrs[b], self.wdeps[b] = vid, [tid], [], [tid]
        self.resident[val.device][b] = None

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> TaskGraph:
        tg = self.tg
        order, after = _walk_order(tg)
        pos_of = {tid: i for i, tid in enumerate(order)}
        self.uses: dict[int, list[int]] = defaultdict(list)
        self.last_touch: dict[int, int] = {}
        for tid in order:
            t = tg.tasks[tid]
            for v in dict.fromkeys(t.reads):
                self.uses[v].append(pos_of[tid])
            if t.kind is TaskKind.TOUCH:
                self.uses[t.writes].append(pos_of[tid])
                self.last_touch[t.writes] = pos_of[tid]
        for pos, tid in enumerate(order):
            self.step(tg.tasks[tid], pos)
            for what, b in after.get(pos, ()):
                self.release(b, what)
        return self.finish()

    def step(self, t: Task, pos: int) -> None:
        dev = t.device
        rdev = t.payload.src_device if t.kind is TaskKind.MOVE else dev
        reads = list(dict.fromkeys(t.reads))
        b_out = t.writes
        fresh = t.kind.fresh or (t.kind is TaskKind.TOUCH and b_out not in self.ever)
        pinned = set(reads) | {b_out}
        need = reads + ([] if fresh else [b_out])
        for r in need:
            if self.cur.get(r) is None:
                self.restore(r, pos, pinned, t)
        deps: list[int] = []
        for r in reads:
            deps += self.prod[r]
        scratch = self.scratch.get(t.id, 0)
        if fresh:
            size = self.size(b_out)
            mem = self.alloc(dev, size + scratch, pinned if dev == rdev else {b_out}, pos, t)
            vid = b_out  # the first version keeps the original id
            self.wdeps[b_out] = mem  # later touches of a buffer wait for its memory too
            deps += mem
        else:
            vid = self.cur[b_out]  # type: ignore[assignment]
            deps += self.wdeps[b_out]
        tid = self.emit(t, reads=tuple(self.cur[r] for r in t.reads), writes=vid,  # type: ignore[misc]
                        deps=tuple(dict.fromkeys(deps)), scratch=scratch)
        if scratch:
            self.pools[dev].release(tid, scratch)  # the kernel's scratch is free when it ends
        for r in reads:
            self.rdrs[r].append(tid)
        if fresh:
            self.cur[b_out], self.rdrs[b_out] = vid, []
            self.prod[b_out] = [tid]
            self.ever.add(b_out)
            self.resident[dev][b_out] = None
        else:
            self.prod[b_out].append(tid)
        if t.kind is TaskKind.TOUCH:
            self.host_ok.discard(b_out)  # its host copy (if any) is stale now
        if self.policy == "naive":
            for b in [*reads, b_out]:
                if (self.cur.get(b) is not None and self.next_use(b, pos) != float("inf")
                        and self.last_touch.get(b, -1) <= pos):  # not a buffer still being assembled
                    self.evict(b)

    def release(self, b: int, what: TaskKind) -> None:
        v = self.cur.get(b)
        if v is None:
            if what is TaskKind.WRITEBACK and b not in self.host_ok:  # pragma: no cover - evict writes outputs
                raise AssertionError(f"output value {b} lost")
            return
        dev = self.values[v].device
        deps = tuple(dict.fromkeys(self.prod[b] + self.rdrs[b]))
        src = self.source[b]
        if what is TaskKind.FREE:
            tid = self.emit(src, kind=TaskKind.FREE, device=dev, reads=(), writes=-1, deps=deps,
                            nbytes=self.size(b), flops=0, payload=Release(v), scratch=0)
        else:
            nbytes = 0 if b in self.host_ok else self.size(b)
            tid = self.emit(src, kind=TaskKind.WRITEBACK, device=dev, reads=(v,), writes=-1, deps=deps,
                            nbytes=nbytes, flops=0, payload=Release(v, host_key=b), scratch=0)
            self.host_ok.add(b)
        self.pools[dev].release(tid, self.size(b))
        del self.resident[dev][b]
        self.cur[b] = None

    def finish(self) -> TaskGraph:
        producers: dict[int, list[int]] = defaultdict(list)
        dependents: list[list[int]] = [[] for _ in self.tasks]
        for t in self.tasks:
            if t.writes >= 0:
                producers[t.writes].append(t.id)
            for d in t.deps:
                dependents[d].append(t.id)
        values = tuple(Value(v.id, v.device, v.shape, v.dtype, v.node, tuple(producers.get(v.id, ())))
                       for v in self.values)
        plan = MemoryPlan(dict(self.caps), self.policy,
                          {d: p.peak for d, p in self.pools.items()}, self.evictions, self.reloads,
                          self.bytes_evicted, self.bytes_reloaded)
        return TaskGraph(tuple(self.tasks), values, self.tg.n_devices, self.tg.outputs,
                         tuple(tuple(x) for x in dependents), memory=plan)
