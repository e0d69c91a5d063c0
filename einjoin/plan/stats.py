"""A plan's accounting, known from shapes alone right after compile, and its explanation."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from einjoin.exchange.tasks import TaskKind
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.planner.bounds import node_bound_bytes

if TYPE_CHECKING:
    from einjoin.decomp.decompose import Decomposition
    from einjoin.plan.taskgraph import TaskGraph

__all__ = ["PlanStats", "OpBytes", "compute_stats", "with_state", "bytes_per_op", "explain", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass(frozen=True)
class PlanStats:
    bytes_moved: int
    bytes_loaded: int
    bytes_fetched: int
    flops: int
    bytes_in_per_device: dict[int, int]
    bytes_out_per_device: dict[int, int]
    flops_per_device: dict[int, int]
    bytes_per_pair: dict[tuple[int, int], int]
    task_counts: dict[str, int]
    peak_bytes_per_device: dict[int, int] = field(default_factory=dict)  # if run in task order
    bytes_evicted: int = 0   # device -> host copies of a memory-capped plan (not in bytes_moved)
    bytes_reloaded: int = 0  # host -> device copies of a memory-capped plan
    # of bytes_loaded, the state inputs' (a program with state): loaded by its first run only
    bytes_state: int = 0

    def __str__(self) -> str:
        text = self._core()
        if self.bytes_state:
            text += f", of the loads {human_bytes(self.bytes_state)} state (first run only)"
        if self.bytes_evicted or self.bytes_reloaded:
            text += (f", evicted {human_bytes(self.bytes_evicted)}, "
                     f"reloaded {human_bytes(self.bytes_reloaded)}")
        return text

    def _core(self) -> str:
        return (f"moved {human_bytes(self.bytes_moved)}, loaded {human_bytes(self.bytes_loaded)}, "
                f"fetched {human_bytes(self.bytes_fetched)}, {self.flops / 1e9:.3f} GFLOP, "
                f"{sum(self.task_counts.values())} tasks")


def compute_stats(tg: TaskGraph) -> PlanStats:
    moved = loaded = flops = evicted = reloaded = 0
    inn: dict[int, int] = defaultdict(int)
    out: dict[int, int] = defaultdict(int)
    fl: dict[int, int] = defaultdict(int)
    pair: dict[tuple[int, int], int] = defaultdict(int)
    live: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    for t in tg.tasks:
        kind = t.kind
        if kind is TaskKind.MOVE:
            src = t.payload.src_device
            moved += t.nbytes
            inn[t.device] += t.nbytes
            out[src] += t.nbytes
            pair[(src, t.device)] += t.nbytes
        elif kind is TaskKind.LOAD:
            loaded += t.nbytes
        elif kind is TaskKind.EVICT:
            evicted += t.nbytes
        elif kind is TaskKind.RELOAD:
            reloaded += t.nbytes
        flops += t.flops
        fl[t.device] += t.flops
        # the peak if tasks ran in id order (the runtime measures the real one)
        if kind.releases:
            live[t.device] -= tg.values[t.payload.frees].nbytes
        elif t.writes >= 0 and tg.values[t.writes].producers[0] == t.id:
            live[t.device] += tg.values[t.writes].nbytes
            peak[t.device] = max(peak[t.device], live[t.device] + t.scratch)
    fetched = sum(tg.values[v].nbytes for lay in tg.outputs for v in lay.blocks.values())
    return PlanStats(moved, loaded, fetched, flops, dict(inn), dict(out), dict(fl), dict(pair),
                     dict(Counter(t.kind.value for t in tg.tasks)), dict(peak), evicted, reloaded)


def with_state(stats: PlanStats, tg: TaskGraph, inputs: set[Node], outputs: set[int]) -> PlanStats:
    """``stats`` of a program with state: ``bytes_state`` the loads of the state ``inputs``
    (the later runs load only the rest), and ``bytes_fetched`` without the new state values
    (task-graph outputs ``outputs``: they stay on the devices)."""
    state = sum(t.nbytes for t in tg.tasks if t.kind is TaskKind.LOAD and t.node in inputs)
    kept = sum(tg.values[v].nbytes for i in outputs for v in tg.outputs[i].blocks.values())
    return replace(stats, bytes_state=state, bytes_fetched=stats.bytes_fetched - kept)


@dataclass(frozen=True)
class OpBytes:
    """Bytes moved on an op's account: ``moved_in`` feeds it (its inputs' replicas travelling to
    its kernels), ``moved_out`` is its own data travelling (partial sums included), ``agg`` the
    part of ``moved_out`` that is its partials travelling to their home."""

    moved_in: int = 0
    moved_out: int = 0
    agg: int = 0


def bytes_per_op(tg: TaskGraph) -> dict[Node, OpBytes]:
    """The bytes of the ``move`` tasks per op, as ``explain`` prints them (ops that move nothing
    are left out). Summing ``moved_out`` over the ops gives ``PlanStats.bytes_moved``."""
    bin_: dict[Node, int] = defaultdict(int)
    bout: dict[Node, int] = defaultdict(int)
    agg: dict[Node, int] = defaultdict(int)
    for t in tg.tasks:
        if t.kind is TaskKind.MOVE:
            consumer = t.payload.consumer
            bout[t.node] += t.nbytes
            if consumer is t.node:
                agg[t.node] += t.nbytes
            elif consumer is not None:
                bin_[consumer] += t.nbytes
    return {n: OpBytes(bin_.get(n, 0), bout.get(n, 0), agg.get(n, 0))
            for n in dict.fromkeys([*bout, *bin_])}


def explain(tg: TaskGraph, decomps: Mapping[Node, Decomposition], order: list[Node]) -> str:
    """Per op: its join-agg spec, blocks, kernels, partials, bytes moved in (to feed it) and out
    (its data travelling, partial sums included); then totals per device pair."""
    per_op = bytes_per_op(tg)
    bin_ = {n: b.moved_in for n, b in per_op.items()}
    bout = {n: b.moved_out for n, b in per_op.items()}
    agg = {n: b.agg for n, b in per_op.items()}
    rows = [("op", "spec", "blocks", "kernels", "partials", "bytes in", "bytes out", "bound",
             "(in+agg)/bound")]
    total_bound = 0.0
    for n in order:
        d = decomps[n]
        name = describe(n)
        bound = node_bound_bytes(n, tg.n_devices)
        b_in, b_out = bin_.get(n, 0), bout.get(n, 0)
        if bound:
            total_bound += bound
            bound_txt, ratio = human_bytes(bound), f"{(b_in + agg.get(n, 0)) / bound:.2f}"
        else:
            bound_txt, ratio = "n/a", ""
        rows.append((name, str(d.spec), str(d.out_partition.num_blocks), str(len(d.kernels)),
                     str(d.n_partials), human_bytes(b_in), human_bytes(b_out), bound_txt, ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = compute_stats(tg)
    lines.append("")
    lines.append(f"total: {s}")
    if total_bound:
        lines.append(f"sum of per-op lower bounds (contractions): {human_bytes(total_bound)}; "
                     f"bytes moved / that sum = {s.bytes_moved / total_bound:.2f}")
    if s.bytes_per_pair:
        lines.append("bytes moved per device pair (src -> dst):")
        for (a, b), nbytes in sorted(s.bytes_per_pair.items()):
            lines.append(f"  {a} -> {b}: {human_bytes(nbytes)}")
    return "\n".join(lines)
