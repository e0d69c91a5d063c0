"""Program state that persists between runs: the values of a program's *state inputs* (a
parameter, an optimizer moment, a step count) that stay where the last run computed them.

A program compiled with ``state={new_value: old_input}`` computes each new value as an extra
output of its task graph (:class:`StateSlot` says which). The planner cuts the input as its new
value is cut and places input block ``k`` where new-value block ``k`` ends
(:func:`einjoin.planner.tie_state`, :func:`einjoin.placement.tie_homes`), so one run's result is
the next run's input on the same device. :class:`Resident` is a program's store of those values;
:class:`StateRun` is one run's view of it:

- the run's ``load`` of a resident state block takes the block the last run left on that device:
  nothing is loaded (``RunStats.bytes_loaded`` counts only the other inputs);
- under a memory cap the new values end in the host store (the graph writes its outputs back),
  so state is resident in host RAM: its loads are then host -> device copies counted as
  ``bytes_reloaded`` (not ``bytes_loaded``);
- at the end of a run the new values' blocks are kept (:meth:`StateRun.keep`), not fetched; the
  program commits them only when the whole run succeeded, so a failed or cancelled run leaves
  the previous state as it was.

Runs of a program with state are serialised (:attr:`Resident.lock`): each run starts from the
state the previous one left.

Determinism (``ej.compile(..., deterministic=True)``): every partial sum is combined by ``reduce``
tasks that read their partials in the order the task graph lists them (:mod:`einjoin.plan.taskgraph`;
under a cap :mod:`einjoin.memplan.chain` keeps that order), on every backend, whatever the thread
timing or the ready order; touches write disjoint regions and moves copy. The one other source of
differing bits is BLAS: OpenBLAS's float32 matmul gives other bits with another thread count. A
run's share is fixed (``threads``: cores // devices in flight, see ``BlasLimiter``; Ray: the
actors' ``blas_threads``, the same formula), so a deterministic program's runs are serialised and
are then bit-identical run after run (and resumed in a fresh process); other einjoin runs in
flight in the same process at the same time would change the share. ``sync`` leaves BLAS
unlimited, so its bits may differ from ``threads``'.

>>> import numpy as np, einjoin as ej
>>> w = ej.input("w", (4,)); prog = ej.compile([w.sum()], state={w * 0.5: w}, quiet=True)
>>> prog.run(w=np.ones(4, np.float32)), prog.run()[0], prog.run_stats.bytes_loaded
((array(4., dtype=float32),), array(2., dtype=float32), 0)
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.decomp.partition import Box
from einjoin.decomp.relation import TensorRelation
from einjoin.exchange import Task
from einjoin.ir.node import Node
from einjoin.plan.execute import unaliased

if TYPE_CHECKING:
    from einjoin.plan.taskgraph import TaskGraph
    from einjoin.runtime.local import Store

__all__ = ["StateSlot", "Resident", "StateRun"]


@dataclass(frozen=True)
class StateSlot:
    """One piece of state: the graph input ``node`` (named ``name``), its ``new`` value, and
    ``output``, the index of the new value among the task graph's outputs."""

    name: str
    node: Node
    new: Node
    output: int


@dataclass
class Resident:
    """A program's state between runs. ``blocks``: per state input, its blocks on their devices
    (box -> block; None blocks for a backend that computes nothing); ``host``: per state input,
    its value in host RAM (a memory-capped graph's state, or a value given by
    :meth:`einjoin.program.Program.write_state`, ``written`` then: loaded and counted by the next
    run). A run reads and replaces these under ``lock``."""

    blocks: dict[Node, dict[Box, Any]] = field(default_factory=dict)
    host: dict[Node, np.ndarray] = field(default_factory=dict)
    written: set[Node] = field(default_factory=set)
    refs: dict[Node, Any] = field(default_factory=dict)  # a remote backend's handles (Ray)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def has(self, node: Node) -> bool:
        return node in self.blocks or node in self.host or node in self.refs

    def _drop(self, node: Node, dropped: list[Any]) -> None:
        self.blocks.pop(node, None)
        self.host.pop(node, None)
        self.written.discard(node)
        old = self.refs.pop(node, None)
        if old is not None:
            dropped.append(old)

    def set_host(self, node: Node, value: np.ndarray) -> list[Any]:
        """A value given from the host: the next run loads it (and counts it). Returns the
        remote handles it replaced (for the backend to release)."""
        dropped: list[Any] = []
        self._drop(node, dropped)
        self.host[node] = value
        self.written.add(node)
        return dropped

    def commit(self, run: StateRun) -> list[Any]:
        """A successful run's new values become the state; returns the remote handles they
        replaced (for the backend to release)."""
        dropped: list[Any] = []
        for node, blocks in run.kept.items():
            self._drop(node, dropped)
            self.blocks[node] = blocks
        for node, value in run.kept_host.items():
            self._drop(node, dropped)
            self.host[node] = value
        for node, refs in run.kept_refs.items():
            self._drop(node, dropped)
            self.refs[node] = refs
        return dropped


@dataclass
class StateRun:
    """One run's view of the state: ``slots``; ``n_outputs`` (the user's outputs, the first of
    the task graph's; the rest are new state values, kept, not fetched); ``resident`` (per state
    input not fed this run, its blocks on their devices: the loads take them); ``on_host`` (state
    inputs resident in host RAM: fed from there, their loads counted as reloads); ``refs`` (a
    remote backend's block handles); ``kept`` / ``kept_host`` / ``kept_refs``: the new values
    once the run finished (committed by the program only if the whole run succeeded)."""

    slots: tuple[StateSlot, ...]
    n_outputs: int
    resident: dict[Node, dict[Box, Any]] = field(default_factory=dict)
    on_host: set[Node] = field(default_factory=set)
    refs: dict[Node, Any] = field(default_factory=dict)
    kept: dict[Node, dict[Box, Any]] = field(default_factory=dict)
    kept_host: dict[Node, np.ndarray] = field(default_factory=dict)
    kept_refs: dict[Node, Any] = field(default_factory=dict)

    def fetched(self, tg: TaskGraph) -> TaskGraph:
        """``tg`` with only the user's outputs (what a run fetches and returns)."""
        return dataclasses.replace(tg, outputs=tg.outputs[:self.n_outputs])

    def load(self, t: Task, store: Store, planned: int) -> bool:
        """The ``load`` task ``t`` (its output already reserved in ``store``) served from the
        state, if its input is resident on the device: True when done here (the block is taken
        as it is: nothing loaded). A state input resident in host RAM (``on_host``) is fed, so
        its load runs as any other and is counted as a reload by the session."""
        blocks = self.resident.get(t.node)
        if blocks is None:
            return False
        value = blocks[t.payload.box]
        store.unreserve(t.scratch)
        store.put(t.writes, value, planned if value is None else value.nbytes)
        return True

    def keep(self, tg: TaskGraph, get: Any, capped: bool, feeds: Mapping[Node, np.ndarray]) -> None:
        """Keep the new values at the end of a run: their blocks where they are (``get(value id)``;
        None: a backend that computes nothing), or, for a capped graph whose outputs end in the
        host store, the assembled host array. A block that shares memory with a feed (a state
        passed through unchanged: loads are views) is copied, so the caller's arrays never alias
        the state."""
        fs, share = tuple(feeds.values()), np.may_share_memory

        def own(b: Any) -> Any:  # unaliased(b, feeds) with the feeds listed once per run
            if b is not None:
                for f in fs:
                    if share(b, f):
                        return np.array(b, order="C")
            return b
        for slot in self.slots:
            lay = tg.outputs[slot.output]
            if get is None:  # nothing computed: the blocks are only counted (in host RAM under a cap)
                if capped:
                    self.kept_host[slot.node] = None  # type: ignore[assignment]
                else:
                    self.kept[slot.node] = {lay.partition.box(k): None for k in lay.blocks}
                continue
            if capped:
                blocks = {k: unaliased(get(v), feeds) for k, v in lay.blocks.items()}
                self.kept_host[slot.node] = TensorRelation(lay.partition, blocks).to_dense()
            else:
                self.kept[slot.node] = {box: own(get(v)) for box, v in _boxes(tg, slot.output)}


# per task graph (by identity, while it lives; a frozen dataclass hashes all its tasks) and
# output index: its blocks' (box, value id). A training step keeps ~70 state blocks per run, and
# working out each box again cost ~0.1 ms of the main thread's serial time per run.
_BOXES: dict[int, dict[int, tuple[tuple[Box, int], ...]]] = {}
_BOXES_LOCK = threading.Lock()


def _boxes(tg: TaskGraph, output: int) -> tuple[tuple[Box, int], ...]:
    """Output ``output``'s blocks of ``tg`` as (box, value id), in the layout's order."""
    per = _BOXES.get(id(tg))
    got = per.get(output) if per is not None else None
    if got is None:
        lay = tg.outputs[output]
        got = tuple((lay.partition.box(k), v) for k, v in lay.blocks.items())
        with _BOXES_LOCK:
            if id(tg) not in _BOXES:
                _BOXES[id(tg)] = {}
                weakref.finalize(tg, _BOXES.pop, id(tg), None)  # the id may be reused once tg is gone
            _BOXES[id(tg)][output] = got
    return got


