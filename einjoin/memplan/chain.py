"""Accumulating aggregation for memory-capped graphs: an n-ary ``reduce`` holds all its partials
at once; under a cap it becomes a chain of two-input steps (``acc = p0 ⊕ p1``, then
``acc ⊕ p2`` ...), each freeing the partial it consumed, so an aggregation holds three blocks at
most. The fold order is the n-ary reduce's own, so results are bitwise the same.

>>> import einjoin as ej
>>> from einjoin.memplan.chain import chain_reduces
>>> z = ej.einsum("ij->i", ej.input("x", (4, 8)))
>>> prog = ej.compile(z, specs={z: {"i": 1, "j": 4}}, quiet=True)
>>> from einjoin.exchange import TaskKind
>>> [t.kind for t in prog.taskgraph.tasks].count(TaskKind.REDUCE)
1
>>> [len(t.reads) for t in chain_reduces(prog.taskgraph).tasks if t.kind is TaskKind.REDUCE]
[2, 2, 2]
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping

from einjoin.exchange import Release, Task, TaskKind, Value
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["chain_reduces", "fits"]


def fits(tg: TaskGraph, caps: Mapping[int, int | None]) -> bool:
    """Whether every device's cap holds all the values ``tg`` ever puts on it at once (each
    written block counted whole, nothing freed): then no aggregation needs chaining and no block
    an eviction. A pass over the values, not the tasks."""
    held = [0] * tg.n_devices
    for v in tg.values:
        held[v.device] += v.nbytes
    return all(c is None or held[d] <= c for d, c in ((d, caps.get(d)) for d in range(tg.n_devices)))


def chain_reduces(tg: TaskGraph, caps: Mapping[int, int | None] | None = None) -> TaskGraph:
    """``tg`` with every reduce of more than two partials as a chain of two-input reduces (and
    frees of the intermediate accumulators); the final step writes the original value. Given
    ``caps`` (device -> bytes, None: uncapped) that ``tg`` :func:`fits` at once, ``tg`` itself:
    chaining only lowers a peak that no cap presses (a capped LLaMA-70B layer on 256 GPUs: a
    walk and a copy of ~170k tasks for nothing)."""
    if caps is not None and fits(tg, caps):
        return tg
    if not any(t.kind is TaskKind.REDUCE and len(t.reads) > 2 for t in tg.tasks):
        return tg
    tasks: list[Task] = []
    values: list[Value] = list(tg.values)
    new_id: dict[int, int] = {}
    reader_of: dict[tuple[int, int], int] = {}  # (old reduce id, partial) -> the step reading it

    def emit(t: Task, **changes: object) -> int:
        tid = len(tasks)
        tasks.append(dataclasses.replace(t, id=tid, **changes))  # type: ignore[arg-type]
        return tid

    for t in tg.tasks:
        deps = tuple(new_id[d] for d in t.deps)
        if t.kind is TaskKind.REDUCE and len(t.reads) > 2:
            out = tg.values[t.writes]
            partial = tg.values[t.reads[0]]
            elems = t.flops // (len(t.reads) - 1)
            producers = {v: [new_id[p] for p in tg.values[v].producers] for v in t.reads}
            acc, acc_deps = t.reads[0], producers[t.reads[0]]
            for i, v in enumerate(t.reads[1:], start=1):
                last = i == len(t.reads) - 1
                if last:
                    vid = t.writes
                else:
                    # an intermediate accumulator keeps the partials' dtype (float32 for a
                    # half-precision sum); only the last step casts to the op's
                    vid = len(values)
                    values.append(dataclasses.replace(out, id=vid, producers=(), dtype=partial.dtype))
                step = emit(t, reads=(acc, v), writes=vid, flops=elems, dtype=values[vid].dtype,
                            nbytes=values[vid].nbytes,
                            deps=tuple(dict.fromkeys([*acc_deps, *producers[v]])))
                reader_of[(t.id, v)] = step
                if i == 1:
                    reader_of[(t.id, acc)] = step
                if acc >= len(tg.values):  # an intermediate accumulator: free it after this step
                    emit(t, kind=TaskKind.FREE, reads=(), writes=-1, deps=(step,), nbytes=values[acc].nbytes,
                         flops=0, payload=Release(acc), dtype="")
                acc, acc_deps = vid, [step]
            new_id[t.id] = step
        elif t.kind is TaskKind.FREE:
            # a partial's free waits for the step that read it, not for the whole chain
            new_id[t.id] = emit(t, deps=tuple(dict.fromkeys(
                reader_of.get((d, t.payload.frees), new_id[d]) for d in t.deps)))
        else:
            new_id[t.id] = emit(t, deps=deps)
    writers: dict[int, list[int]] = defaultdict(list)
    dependents: list[list[int]] = [[] for _ in tasks]
    for t in tasks:
        if t.writes >= 0:
            writers[t.writes].append(t.id)
        for d in t.deps:
            dependents[d].append(t.id)
    vals = tuple(dataclasses.replace(v, producers=tuple(writers.get(v.id, ()))) for v in values)
    return TaskGraph(tuple(tasks), vals, tg.n_devices, tg.outputs, tuple(tuple(x) for x in dependents),
                     memory=tg.memory)
