"""Sparse einsums on several devices: each step's relations split over the devices by the block
keys of one relational label, every device joining and aggregating its part with the in-memory
executor (:func:`einjoin.sparse.execute.execute`), partial aggregates combined by key.

**The split** (:func:`choose_split`). For each relational label of the step's layout, the block
histogram along it (tuples per key, per operand) weighs every key: its joined tuples (estimated as
the product of the tuple counts of the operands keyed on the label) plus the tuples themselves,
and, splitting an output label, its output tuple (``ROW_ELEM`` per payload element).
Two splits of the keys are weighed on it: a *range* split (cut points on the cumulative weight:
contiguous keys per device) and a *hash* split (a multiplicative hash of the key, modulo the
devices); the one whose busiest device carries less is kept (range on a tie). Operands keyed on
the label are partitioned (each tuple on one device); an operand without it is sent to a device
only the tuples that match, on their shared keys, a tuple of that device's part (a semi-join: a
dense operand gets only the blocks a device's keys touch, or all of them when it touches at least
``WHOLE`` of them: a complete grid is joined by direct index). An output label leaves each output key
on one device; a summed label leaves partial sums, each sent to the device owning its output key
(a hash of the key) and added there. Of the labels, the one moving the fewest bytes is split (a
split whose busiest device carries more than ``BALANCE`` times the mean loses to one that does
not; a partial's bytes weigh ``PARTIAL_WEIGHT`` times a replica's); ``max`` splits output labels
only (a max over partials would meet the absent tuples of every part). No relational label with
two or more keys, or a step of fewer modelled multiply-adds (joined tuples times payload) than
``MIN_SPLIT_WORK`` with no pinned label (splitting would cost more than it saves; ``explain()``
says so) and, under ``memory_limit=``, within one device's cap: the step runs on device 0. A
step's split is kept for the next run while its relations have the same keys (the same key
arrays, or complete grids).

**Accounting** (the project's: one copy of every input tuple is loaded; every further copy and
every travelling partial counts): each step's :class:`Exchange` (``Step.exchange``) holds the
replicated tuples and bytes, the partial tuples and bytes sent to their key's owner, and per
device the input tuples it holds, the tuples it joined and its thread's CPU time;
``SparsePlan.explain()`` prints it.

**Where the parts run** (a per-backend table, :data:`RUNNERS`): ``sync`` one after the other on
this thread; ``threads`` the threads backend's device workers (the engine's ``einjoin-dev<d>``
threads, ``drive_threads``, under its share of the cores, ``cores_limit``); ``ray`` the Ray
backend's device actors (``RayBackend.device_actors``, ``DeviceWorker.call``); ``torch`` (CPU) as
``threads`` (the parts compute on numpy views of the tensors; dense results go back as tensors
when tensors came in, ``SparsePlan.run``). On Ray the parts
and the partials travel through the driver (point-to-point sends between actors are built for
task graphs only).

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> a = ej.sparse("A", scipy.sparse.random(400, 300, density=0.01, random_state=0))
>>> h = np.arange(300 * 4, dtype=float).reshape(300, 4)
>>> plan = ej.sparse_compile("ij,jk->ik", a, h, devices=2, backend="sync")
>>> np.allclose(plan.run().todense(), a.todense() @ h)
True
>>> plan.steps[0].exchange.split is None  # 1200 multiply-adds: too small to pay (MIN_SPLIT_WORK)
True
>>> plan.distribution.label = "i"  # a pinned split label is split regardless
>>> _ = plan.run(); ex = plan.steps[0].exchange
>>> ex.split.label, len(ex.tuples), sum(ex.joined) == plan.steps[0].counts.joined
('i', 2, True)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einjoin.cluster import MAX_DEVICES
from einjoin.errors import EinjoinError, UnsupportedOpError
from einjoin.sparse.duckdb_exec import DuckDevice, execute_duckdb
from einjoin.sparse.execute import RunCounts, execute, relation_of
from einjoin.sparse.layout import Layout
from einjoin.sparse.tensor import SparseTensor, key_codes

__all__ = ["Split", "Exchange", "Distribution", "choose_split", "RUNNERS", "distribution", "held_bytes", "check_cap"]

BALANCE = 1.5  # a split whose busiest device carries more than this times the mean loses
KEY_BYTES = 8  # one int64 key column of a tuple
# a partial's bytes count twice in the choice: it is written as an output tuple where it is made,
# moved, then sorted and added where its key lives; a replica is only moved (A·H·W, 20k nodes,
# 2 devices: 4.5 MB of partials cost 17 ms CPU to combine, 5 MB of replicated rows ~4 ms to cut)
PARTIAL_WEIGHT = 2.0
# a complete relation (a dense operand: every key present) of which a device's keys touch at least
# this fraction goes whole (the extra tuples count as moved): the join then indexes its complete
# grid directly instead of searching a subset (A·H·W, 20k nodes: each device touches 99.3% of
# H·W's rows; the search made each half's join cost ~2x the whole one's)
WHOLE = 0.9
# an output tuple weighs this many joined tuples per payload element in the split's balance: a
# device with many short output rows runs cold (its rows written at random by the SpMM), one with
# few busy rows runs in cache. A·H, 200k nodes / 5M power-law edges, H 200k x 128, 2 devices, range
# on i (CPU ms per device, sync backend, busy box; /tmp/e35/sweep.py): 0 (joined + tuples alone)
# [270, 850]; 0.1 [350, 640]; 0.15 [400, 570]; 0.2 [550, 540]; 0.4 [760, 700]
ROW_ELEM = 0.2
# a step of fewer modelled multiply-adds (joined tuples x payload) runs on one device: splitting it
# (cutting parts, waking device threads, merging outputs: ~1-2 ms) costs more than it saves. A·H,
# power-law graphs of n nodes / 10n edges, H n x 128, 1 vs 2 devices (threads; CPU ms, the 2-device
# one also as its busiest-device path, the wall on idle cores; busy 2-core box, /tmp/h2_ah2.py):
# 2.5e6 (2000 nodes) 1.2 vs 2.7, path 2.2; 6.3e6 (5000) 3.6 vs 6.5, path 4.8; 2.5e7 (20000) 40.7
# vs 44.1, path 32.2; 6.4e7 (50000) 83 vs 74, path 42. A pinned split label is split regardless,
# and so is a step whose tuples exceed one device's memory_limit (each device then holds its part).
MIN_SPLIT_WORK = 1e7
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: keys in arithmetic runs spread evenly


@dataclass(frozen=True)
class Split:
    """Which devices own which block keys of ``label``: ``"range"`` (device d owns the keys in
    ``[bounds[d-1], bounds[d])``) or ``"hash"`` (a multiplicative hash modulo ``n``). ``imbalance``:
    the busiest device's modelled load over the mean.

    >>> s = Split("i", "range", 2, (3,), 1.0)
    >>> s.owner(np.array([0, 2, 3, 9])).tolist()
    [0, 0, 1, 1]
    """

    label: str
    kind: str
    n: int
    bounds: tuple[int, ...]
    imbalance: float

    def owner(self, keys: np.ndarray) -> np.ndarray:
        if self.kind == "range":
            return np.searchsorted(np.asarray(self.bounds, np.int64), keys, side="right").astype(np.int64)
        return _hash_owner(keys, self.n)


def _hash_owner(keys: np.ndarray, n: int) -> np.ndarray:
    mixed: np.ndarray = (keys.astype(np.uint64) * _MIX) >> np.uint64(32)  # wraps modulo 2**64, as wanted
    return np.asarray(mixed % np.uint64(n), np.int64)


@dataclass
class Exchange:
    """One step's run on the devices: the split (None: not split, device 0 ran it), per device
    the input tuples it held, the tuples it joined and its CPU time, the input tuples copied to
    more than one device (``replicas``: copies beyond the first) and the partial output tuples
    sent to the device owning their key, each with its bytes (keys and payloads).

    >>> Exchange(None, [3, 0], [2, 0], replicas=1, replica_bytes=16).moved
    1
    """

    split: Split | None
    tuples: list[int]
    joined: list[int]
    replicas: int = 0
    replica_bytes: int = 0
    partials: int = 0
    partial_bytes: int = 0
    cpu: list[float] = field(default_factory=list)  # per device: its thread's CPU seconds on its part
    small: float | None = None  # not split because its modelled multiply-adds are below MIN_SPLIT_WORK
    spilled: list[int] = field(default_factory=list)  # engine duckdb, per device: its temp-directory bytes
    ranges: int = 1  # engine duckdb: the most output-key ranges (queries) of a device

    @property
    def moved(self) -> int:
        """Tuples moved between devices."""
        return self.replicas + self.partials

    @property
    def moved_bytes(self) -> int:
        return self.replica_bytes + self.partial_bytes

    def describe(self) -> str:
        if self.split is None and self.small is not None:
            how = (f"not split: {self.small:.3g} modelled multiply-adds, below MIN_SPLIT_WORK {MIN_SPLIT_WORK:.3g} "
                   f"(cutting, device threads and merging would cost more than they save): device 0")
        elif self.split is None:
            how = "not split (no relational label with two or more keys that it may split on): device 0"
        else:
            how = (f"split on {self.split.label} by {self.split.kind} over {len(self.tuples)} devices "
                   f"(modelled max/mean load {self.split.imbalance:.2f})")
        return (f"{how}; moved {self.moved} tuple(s), {_mib(self.moved_bytes)} ({self.replicas} replicated "
                f"input, {self.partials} partial); per device input tuples {self.tuples}, joined {self.joined}"
                + (f", CPU ms {[round(t * 1e3, 1) for t in self.cpu]}" if self.cpu else ""))


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 16 else f"{n} B"


# ---- the relations at a step's layout, split ---------------------------------------------------

def _at_layout(value: SparseTensor | np.ndarray, labels: tuple[str, ...], layout: Layout, name: str
               ) -> SparseTensor:
    """An operand as a relation of the layout's tuples (keys over every dim: 0 on dense dims),
    as :func:`relation_of` cuts it; a dense array becomes every block."""
    shape = tuple(value.shape)
    block = tuple(layout.extent(lab, n) if layout.relational(lab) else max(n, 1) for lab, n in zip(labels, shape))
    if isinstance(value, SparseTensor):
        return value.reblock(block)
    rel = relation_of(value, labels, layout)
    keys = np.zeros((len(rel.data), len(labels)), np.int64)
    keys[:, [d for d, lab in enumerate(labels) if layout.relational(lab)]] = rel.keys
    return SparseTensor(name, shape, block, keys, rel.data, trusted=True)


def _grid(layout: Layout, sizes: Mapping[str, int]) -> dict[str, int]:
    return {lab: max(1, -(-sizes[lab] // b)) for lab, b in layout.blocks.items() if b}


def _tuple_bytes(t: SparseTensor, labels: tuple[str, ...], layout: Layout) -> int:
    return math.prod(t.block) * t.data.dtype.itemsize + KEY_BYTES * sum(layout.relational(lab) for lab in labels)


def _weights(label: str, rels: Sequence[SparseTensor], in_labels: Sequence[tuple[str, ...]], g: int,
             row: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(keys, weights): per key of ``label`` (every key of the grid, or, for a grid far larger
    than the tuples, the keys present) its estimated joined tuples (the product of the keyed
    operands' tuple counts at that key) plus the tuples themselves -- the block histogram -- plus
    ``row`` for a key that joins anything (an output label: its output tuple, see ``ROW_ELEM``)."""
    cols = [r.keys[:, ls.index(label)] for r, ls in zip(rels, in_labels) if label in ls]
    if g <= 4 * sum(len(c) for c in cols) + (1 << 20):
        kv = np.arange(g, dtype=np.int64)
        counts = [np.bincount(c, minlength=g).astype(np.float64) for c in cols]
    else:  # a hypersparse label: only the keys present (a bincount of the grid would not fit)
        kv = np.unique(np.concatenate(cols))
        counts = [np.bincount(np.searchsorted(kv, c), minlength=len(kv)).astype(np.float64) for c in cols]
    joined = np.prod(counts, axis=0)
    return kv, np.asarray(joined + np.sum(counts, axis=0) + row * (joined > 0))


def _split_of(label: str, w: np.ndarray, n: int, kv: np.ndarray | None = None) -> Split:
    """The range or hash split of ``label``'s keys ``kv`` (sorted; default 0 .. len(w) - 1) of
    weights ``w`` with the lighter busiest device."""
    total = float(w.sum())
    keys = np.arange(len(w), dtype=np.int64) if kv is None else kv
    cum = np.cumsum(w)
    at = np.minimum(np.searchsorted(cum, total * np.arange(1, n) / n, side="left"), max(len(keys) - 1, 0))
    bounds = tuple(int(keys[i]) + 1 for i in at) if len(keys) else (0,) * (n - 1)
    found = []
    for kind, bs in (("range", bounds), ("hash", ())):
        s = Split(label, kind, n, bs, 1.0)
        load = np.bincount(s.owner(keys), weights=w, minlength=n)
        found.append(Split(label, kind, n, bs, float(load.max() / (total / n)) if total else 1.0))
    return min(found, key=lambda s: s.imbalance)


def _codes(t: SparseTensor, labels: tuple[str, ...], shared: Sequence[str], grid: Mapping[str, int]
           ) -> np.ndarray | None:
    return key_codes(t.keys[:, [labels.index(lab) for lab in shared]], [grid[lab] for lab in shared])


def _placement(split: Split, rels: Sequence[SparseTensor], in_labels: Sequence[tuple[str, ...]],
               layout: Layout, grid: Mapping[str, int]) -> list[list[np.ndarray]]:
    """Per operand, per device, the mask of the tuples it sends there: the keyed operands by the
    split's owner, the others by a semi-join with every keyed operand's part on their shared keys
    (all of it to a device holding some part when they share none)."""
    n, lab = split.n, split.label
    keyed = [k for k, ls in enumerate(in_labels) if lab in ls]
    masks: list[list[np.ndarray]] = [[] for _ in rels]
    for k in keyed:
        owner = split.owner(rels[k].keys[:, in_labels[k].index(lab)])
        masks[k] = [owner == d for d in range(n)]
    busy = [any(bool(masks[k][d].any()) for k in keyed) for d in range(n)]
    for k, (r, ls) in enumerate(zip(rels, in_labels)):
        if k in keyed:
            continue
        keep = [np.full(len(r.keys), busy[d]) for d in range(n)]
        for p in keyed:
            shared = [x for x in ls if x in in_labels[p] and layout.relational(x)]
            mine, theirs = _codes(r, ls, shared, grid), _codes(rels[p], in_labels[p], shared, grid)
            if not shared or mine is None or theirs is None:
                continue  # nothing to match on (or codes overflow): every busy device gets it all
            total = math.prod(grid[x] for x in shared)
            for d in range(n):
                keep[d] &= _member(mine, theirs[masks[p][d]], total)
        if _complete(r, ls, layout, grid):  # see WHOLE
            keep = [np.full(len(r.keys), busy[d]) if busy[d] and m.mean() >= WHOLE else m
                    for d, m in enumerate(keep)]
        masks[k] = keep
    return masks


def _complete(t: SparseTensor, labels: tuple[str, ...], layout: Layout, grid: Mapping[str, int]) -> bool:
    """Whether ``t`` has a tuple at every key of its grid (a dense operand's relation)."""
    return len(t.keys) == math.prod(grid[lab] for lab in labels if layout.relational(lab))


def _complete_in_order(t: SparseTensor, labels: tuple[str, ...], layout: Layout, grid: Mapping[str, int]
                       ) -> bool:
    """Whether ``t`` is complete with its tuples in key order: then another such relation of the
    same grid has the same key at every tuple position, which a kept split's masks index."""
    if not _complete(t, labels, layout, grid):
        return False
    code = key_codes(t.keys, [grid[lab] if layout.relational(lab) else 1 for lab in labels])
    return code is not None and bool(np.all(code[1:] > code[:-1]))


def _member(codes: np.ndarray, present: np.ndarray, total: int) -> np.ndarray:
    """Which ``codes`` are among ``present`` (codes below ``total``): a bitmap when it is small."""
    if total > 4 * (len(codes) + len(present)) + (1 << 20):
        return np.isin(codes, present)
    seen = np.zeros(total, bool)
    seen[present] = True
    hit: np.ndarray = seen[codes]
    return hit


def _partial_estimate(masks: list[list[np.ndarray]], in_labels: Sequence[tuple[str, ...]],
                      out_rel: Sequence[str], grid: Mapping[str, int], n: int) -> float:
    """Partial output tuples that leave their device: per device a bound of its output keys (the
    fewest, over the operands, of an operand's tuples there, at most the grid of the output labels
    it has, times the grid of those it lacks), (n-1)/n of them owned by another device."""
    total = 0.0
    for d in range(n):
        total += min(min(int(m[d].sum()), math.prod(grid[lab] for lab in out_rel if lab in ls))
                     * math.prod(grid[lab] for lab in out_rel if lab not in ls)
                     for ls, m in zip(in_labels, masks))
    return total * (n - 1) / n


def _candidates(layout: Layout, sizes: Mapping[str, int], out_labels: tuple[str, ...], agg: str,
                label: str | None) -> list[str]:
    """The labels a step may be split on: relational with two or more keys (output labels only
    for ``max``), ``label`` only when pinned and one of them."""
    grid = _grid(layout, sizes)
    cands = [lab for lab in layout.blocks if grid.get(lab, 1) > 1 and (agg == "sum" or lab in out_labels)]
    return [lab for lab in cands if lab == label] if label is not None else cands


def choose_split(rels: Sequence[SparseTensor], in_labels: Sequence[tuple[str, ...]],
                 out_labels: tuple[str, ...], layout: Layout, sizes: Mapping[str, int], agg: str, n: int,
                 out_bytes: int, label: str | None = None
                 ) -> tuple[Split | None, list[list[np.ndarray]] | None]:
    """The split of a step over ``n`` devices and each operand's per-device masks (None, None:
    not split). ``label`` pins the label (it must be relational with two or more keys).

    >>> from einjoin.sparse.layout import Layout
    >>> a = SparseTensor("A", (4, 4), (1, 1), np.array([[0, 1], [1, 1], [2, 3], [3, 0]]), np.ones(4))
    >>> b = SparseTensor("B", (4, 2), (1, 2), np.array([[0, 0], [1, 0], [2, 0], [3, 0]]), np.ones((4, 1, 2)))
    >>> lay = Layout({"i": 1, "j": 1, "k": None}, (4, 4), 4.0, 0.0, 2, "batched")
    >>> split, masks = choose_split([a, b], [("i", "j"), ("j", "k")], ("i", "k"), lay,
    ...                             {"i": 4, "j": 4, "k": 2}, "sum", 2, 24, label="i")
    >>> split.kind, [m.tolist() for m in masks[1]]  # B's rows: those the device's A columns touch
    ('range', [[False, True, False, False], [True, False, False, True]])
    """
    grid = _grid(layout, sizes)
    cands = _candidates(layout, sizes, out_labels, agg, label)
    if n < 2 or not cands:
        return None, None
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    out_elems = math.prod(layout.extent(lab, sizes[lab]) for lab in out_labels)
    scored = []
    for lab in cands:
        kv, w = _weights(lab, rels, in_labels, grid[lab], ROW_ELEM * out_elems if lab in out_labels else 0.0)
        split = _split_of(lab, w, n, kv)
        masks = _placement(split, rels, in_labels, layout, grid)
        moved: float = sum((sum(int(m.sum()) for m in ms) - int(np.logical_or.reduce(ms).sum()))
                    * _tuple_bytes(r, ls, layout) for r, ls, ms in zip(rels, in_labels, masks))
        if lab not in out_labels:
            moved += _partial_estimate(masks, in_labels, out_rel, grid, n) * out_bytes * PARTIAL_WEIGHT
        scored.append(((split.imbalance > BALANCE, moved, split.imbalance), split, masks))
    _, split, masks = min(scored, key=lambda x: x[0])
    return split, masks


# ---- the per-device work (module functions: Ray pickles them by name) ---------------------------

def part_step(parts: Sequence[SparseTensor], in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
              sizes: Mapping[str, int], layout: Layout, agg: str, dtype: np.dtype, what: str,
              into: np.ndarray | None = None, duck: DuckDevice | None = None
              ) -> tuple[np.ndarray, np.ndarray | None, RunCounts, float, tuple[int, int]]:
    """One device's join-aggregation of its part: the in-memory executor (``into``: its rows of
    the whole result, see :func:`execute`), or with ``duck`` the DuckDB executor on a connection
    of the device's own (its share of ``memory_limit``, its own temp directory), opened where the
    part runs (a Ray actor too: connections do not travel). Also the CPU seconds its thread spent
    on it (BLAS or DuckDB threads it woke not counted) and DuckDB's (spilled bytes, key ranges)."""
    start = time.thread_time()
    if duck is None:
        data, keys, counts = execute(parts, in_labels, out_labels, sizes, layout, agg, dtype, what, into)
        return data, keys, counts, time.thread_time() - start, (0, 1)
    with duck.session(what) as session:
        data, keys, counts = execute_duckdb(session, parts, in_labels, out_labels, sizes, layout, agg, dtype, what)
        stats = (session.spilled, session.ranges)
    return data, keys, counts, time.thread_time() - start, stats


def combine_sums(chunks: Sequence[tuple[np.ndarray, np.ndarray]], grid: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Partial sums (payloads, keys) from several devices, added by key: (payloads, sorted keys)."""
    data = np.concatenate([c[0] for c in chunks])
    keys = np.concatenate([c[1] for c in chunks])
    if not len(keys):
        return data, keys
    code = key_codes(keys, grid)
    order = (np.lexsort(keys.T[::-1]) if code is None else np.argsort(code, kind="stable"))
    ks = keys[order]
    first = np.r_[True, np.any(ks[1:] != ks[:-1], axis=1)]
    starts = np.flatnonzero(first)
    return np.add.reduceat(data[order], starts, axis=0), ks[starts]


# ---- the runners: per backend, how the devices' parts run ---------------------------------------

Runner = Callable[[Any, Callable[..., Any], Sequence[tuple[Any, ...]], str], list[Any]]


def _run_sync(backend: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str) -> list[Any]:
    return [fn(*a) for a in args]


def _run_threads(backend: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str) -> list[Any]:
    """A worker thread per device: the engine's device threads (Ctrl-C safe, none outlives the
    call) under the threads backend's share of the cores (BLAS threads = cores // devices)."""
    from einjoin.runtime.backends import cores_limit
    from einjoin.runtime.engine import drive_threads
    n = len(args)
    if n == 1:  # one part (a step not split): inline, as the engine runs a one-lane session
        return [fn(*args[0])]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def worker(q: int) -> None:
        try:
            results[q] = fn(*args[q])
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors[q] = e
    with cores_limit(n):
        drive_threads(worker, n, n, threading.Lock(), lambda: None)
    for e in errors:
        if e is not None:
            raise e
    return results


def _run_ray(backend: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str) -> list[Any]:
    """Device d's part on the Ray backend's actor of device d (its ``wait`` threads: a task
    graph's run on the same actors is not held up), BLAS threads = cores // devices."""
    import os

    import ray
    from einjoin.runtime.backends.ray import WAIT
    n = len(args)
    actors = backend.device_actors(n)
    blas = max(1, (os.cpu_count() or 1) // n)
    refs = [a.call.options(concurrency_group=WAIT).remote(fn, tuple(x), blas) for a, x in zip(actors, args)]
    out = []
    for d, ref in enumerate(refs):
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - the part's own error, or a lost actor
            cause = getattr(e, "cause", None)
            if isinstance(cause, EinjoinError):
                raise cause from None
            # not retried: a lost actor stays in the pool until a task-graph run on the backend
            # replaces it, or close() (sparse steps hold no lineage to re-run from yet)
            raise EinjoinError(f"{what}: device {d} (Ray actor) failed: {type(e).__name__}: {e}; if the "
                               f"actor was lost, backend.close() starts fresh actors at the next run") from None
    return out


def _run_torch(backend: Any, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str) -> list[Any]:
    """The torch backend on the CPU: its device threads as ``threads`` runs them (one inline worker,
    as ``sync``, when it is not ``threaded``). The parts compute with the in-memory executor on
    numpy views of the tensors' memory (``SparsePlan.run`` converts at the boundary, no copy)."""
    return (_run_threads if getattr(backend, "threaded", True) else _run_sync)(backend, fn, args, what)


RUNNERS: dict[str, Runner] = {"sync": _run_sync, "threads": _run_threads, "ray": _run_ray, "torch": _run_torch}


@dataclass
class _Kept:
    """A step's split kept between runs: the key signature it was chosen on, the split, each
    operand's per-device masks and replicated copies, and each sparse operand's per-device parts
    with the arrays they were cut from (a part is a tensor of its own: the executor keeps its
    join and SpMM order in its ``derived``, so that the next run reuses them)."""

    sign: tuple[Any, ...]
    split: Split
    masks: list[list[np.ndarray]]
    copies: list[int]
    cut: list[tuple[np.ndarray, np.ndarray, list[SparseTensor]] | None]
    rels: list[SparseTensor | None]  # this run's sparse operands at the layout (None: dense)
    rows: list[int] | None = None  # output tuples per device in the last run (disjoint keys)

    def part(self, k: int, d: int, value: SparseTensor | np.ndarray, labels: tuple[str, ...], layout: Layout,
             name: str) -> SparseTensor | np.ndarray:
        """Operand ``k``'s part on device ``d``: a dense operand that goes whole stays the array
        (the executor joins its complete grid by index, with the one-device kernels); sparse
        parts are cut once per key and data arrays."""
        mask = self.masks[k][d]
        r = self.rels[k]
        if r is None:
            if bool(mask.all()):
                return value
            return _subset(_at_layout(value, labels, layout, name), mask)
        cut = self.cut[k]
        if cut is None or cut[0] is not r.keys or cut[1] is not r.data:
            cut = self.cut[k] = (r.keys, r.data, [_subset(r, m) for m in self.masks[k]])
        return cut[2][d]


def _tuples(part: SparseTensor | np.ndarray, labels: tuple[str, ...], layout: Layout, grid: Mapping[str, int]
            ) -> int:
    """A part's tuples (a dense array: every block of its grid)."""
    if isinstance(part, SparseTensor):
        return len(part.keys)
    return math.prod(grid[lab] for lab in labels if layout.relational(lab))


def _tuple_bytes_of(shape: tuple[int, ...], labels: tuple[str, ...], layout: Layout, dtype: np.dtype) -> int:
    """:func:`_tuple_bytes` of an operand of ``shape`` at ``layout`` (its relation not built)."""
    block = [layout.extent(lab, n) if layout.relational(lab) else max(n, 1) for lab, n in zip(labels, shape)]
    return math.prod(block) * dtype.itemsize + KEY_BYTES * sum(layout.relational(lab) for lab in labels)


def held_bytes(parts: Sequence[SparseTensor | np.ndarray], in_labels: Sequence[tuple[str, ...]],
               out_labels: tuple[str, ...], layout: Layout, sizes: Mapping[str, int], out_bytes: int,
               bound: bool = True) -> tuple[int, int]:
    """A device's tuple bytes for a step on ``parts``: (its input tuples' keys and payloads at the
    layout, an upper bound of its output tuples' bytes: per operand the distinct keys of the
    relational output labels it has among its tuples (a sort: only with ``bound``; else 0), times
    the grid of those it lacks; the fewest of any operand, at most the output grid; one block when
    no output label is relational).

    >>> from einjoin.sparse.layout import Layout
    >>> a = SparseTensor("A", (4, 4), (1, 1), np.array([[0, 1], [2, 3]]), np.ones(2))
    >>> lay = Layout({"i": 1, "j": 1, "k": None}, (2, 4), 2.0, 0.0, 2, "batched")
    >>> held_bytes([a, np.ones((4, 3))], [("i", "j"), ("j", "k")], ("i", "k"), lay, {"i": 4, "j": 4, "k": 3}, 32)
    (176, 64)
    """
    grid = _grid(layout, sizes)
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    held, rows = 0, math.prod(grid[lab] for lab in out_rel)
    for p, ls in zip(parts, in_labels):
        if isinstance(p, SparseTensor):
            p = _at_layout(p, ls, layout, p.name)  # reblock keeps its last cut: the executor's too
        t = _tuples(p, ls, layout, grid)
        held += t * _tuple_bytes_of(tuple(p.shape), ls, layout, np.dtype(p.dtype))
        if not bound:
            continue
        mine = [lab for lab in out_rel if lab in ls]
        has = math.prod(grid[lab] for lab in mine)
        if isinstance(p, SparseTensor) and mine and t:  # the part's keys present (a device holds a few)
            code = key_codes(p.keys[:, [ls.index(lab) for lab in mine]], [grid[lab] for lab in mine])
            has = len(np.unique(code)) if code is not None else has
        rows = min(rows, min(t, has) * math.prod(grid[lab] for lab in out_rel if lab not in ls))
    if not out_rel:  # one output block, written even when nothing joins
        rows = 1
    return held, rows * out_bytes if bound else 0


def check_cap(cap: int | None, need: Sequence[tuple[int, int]], step: str, what: str) -> None:
    """Refuse a step whose tuples (inputs held plus the output bound, :func:`held_bytes`, per
    device) would exceed ``cap`` bytes on some device, naming the device and the bytes."""
    if cap is None:
        return
    for d, (held, out) in enumerate(need):
        if held + out > cap:
            raise EinjoinError(
                f"{what}: the step {step} needs up to {held + out} bytes of tuples on device {d} ({held} of "
                f"input tuples, up to {out} of output tuples) over its memory_limit of {cap} bytes: compile with "
                f"more devices= (each holds its part), a larger memory_limit, or engine='duckdb' (it spills)")


class Distribution:
    """Where a sparse plan's steps run: ``devices`` and the backend running the parts
    (:data:`RUNNERS`); ``label`` pins the split label of every step that has it (None: chosen
    per step from the block histogram)."""

    def __init__(self, devices: int, backend: Any, label: str | None = None) -> None:
        self.devices = devices
        self.backend = backend
        self.label = label
        self.cap: int | None = None  # memory_limit: per device, bytes of a step's tuples (check_cap)
        self.held: list[int] = []  # the last step's tuple bytes per device: inputs held plus its output
        # per step (its labels and layout): the split of the last run, the key arrays it was chosen
        # on (held, so their ids stay theirs) and the per-device parts cut from them; reused while a
        # run's relations have the same keys
        self._splits: dict[Any, _Kept] = {}

    def describe(self, exchanges: Sequence[Exchange | None] = ()) -> str:
        """The devices and backend, and the totals of a run's step ``exchanges`` (those not None).

        >>> Distribution(2, distribution(2, "sync", "x").backend).describe([Exchange(None, [2, 0], [1, 0], 3, 48)])
        '2 devices on backend sync (last run moved 3 tuple(s), 48 B between devices)'
        """
        if self.devices == 1:
            return "1 device"
        ran = [e for e in exchanges if e is not None]
        total = (f" (last run moved {sum(e.moved for e in ran)} tuple(s), {_mib(sum(e.moved_bytes for e in ran))} "
                 f"between devices)" if ran else "")
        return f"{self.devices} devices on backend {self.backend.name}{total}"

    def _kept(self, values: Sequence[SparseTensor | np.ndarray], in_labels: Sequence[tuple[str, ...]],
              out_labels: tuple[str, ...], layout: Layout, sizes: Mapping[str, int], agg: str, out_bytes: int,
              names: Sequence[str]) -> _Kept:
        """The last run's split of this step when its relations have the same keys (the same key
        arrays: a plan's own sparse operands; or complete grids: dense operands and results), else
        :func:`choose_split` on this run's relations."""
        grid = _grid(layout, sizes)
        step = (tuple(in_labels), out_labels, tuple(layout.blocks.items()), agg, self.label)
        # a dense operand is a complete grid: its relation is built only when a split is chosen
        rels: list[SparseTensor | None] = [_at_layout(v, ls, layout, nm) if isinstance(v, SparseTensor) else None
                                           for v, ls, nm in zip(values, in_labels, names)]
        sign = tuple(r.keys if r is not None and not _complete_in_order(r, ls, layout, grid) else
                     ("complete", math.prod(grid[lab] for lab in ls if layout.relational(lab)))
                     for r, ls in zip(rels, in_labels))
        old = self._splits.get(step)
        if old is not None and len(old.sign) == len(sign) and all(_same(x, y) for x, y in zip(old.sign, sign)):
            old.rels = rels
            return old
        full = [r if r is not None else _at_layout(v, ls, layout, nm)
                for r, v, ls, nm in zip(rels, values, in_labels, names)]
        split, masks = choose_split(full, in_labels, out_labels, layout, sizes, agg, self.devices, out_bytes,
                                    self.label)
        assert split is not None and masks is not None  # a candidate exists (the caller checked)
        kept = _Kept(sign, split, masks, [sum(int(m.sum()) for m in ms) - int(np.logical_or.reduce(ms).sum())
                                          for ms in masks], [None] * len(values), rels)
        if len(self._splits) >= 16:
            self._splits.pop(next(iter(self._splits)))
        self._splits[step] = kept
        return kept

    def execute(self, values: Sequence[SparseTensor | np.ndarray], in_labels: Sequence[tuple[str, ...]],
                out_labels: tuple[str, ...], sizes: Mapping[str, int], layout: Layout, agg: str,
                dtype: np.dtype, what: str, names: Sequence[str], duck: Sequence[DuckDevice] | None = None
                ) -> tuple[np.ndarray, np.ndarray | None, RunCounts, Exchange | None]:
        """The step on the devices: :func:`execute`'s contract, and the step's :class:`Exchange`
        (None on one device). ``duck``: per device its DuckDB settings (engine duckdb), the parts
        then run as SQL on a connection per device; the split, the exchange and the combining of
        partial sums are the same as in memory."""
        n = self.devices
        compute = np.dtype(np.float32) if dtype.kind == "f" and dtype.itemsize < 4 else dtype
        out_rel = [lab for lab in out_labels if layout.relational(lab)]
        out_ext = [layout.extent(lab, sizes[lab]) for lab in out_labels]
        out_bytes = math.prod(out_ext) * compute.itemsize + KEY_BYTES * len(out_rel)
        step = f"{','.join(''.join(ls) for ls in in_labels)}->{''.join(out_labels)}"
        work = layout.joined * max(layout.payload, 1)
        small = self.label is None and work < MIN_SPLIT_WORK  # see MIN_SPLIT_WORK
        if n == 1 or small or not _candidates(layout, sizes, out_labels, agg, self.label):
            held, bound = held_bytes(values, in_labels, out_labels, layout, sizes, out_bytes, self.cap is not None)
            if (small and n > 1 and self.cap is not None and held + bound > self.cap
                    and _candidates(layout, sizes, out_labels, agg, self.label)):
                small = False  # too large for one device's cap: split after all, each device holds its part
            else:
                check_cap(self.cap, [(held, bound)], step, what)
        if n == 1:
            data, keys, counts = execute(values, in_labels, out_labels, sizes, layout, agg, dtype, what)
            self.held = [held + len(data) * out_bytes]
            return data, keys, counts, None
        run = RUNNERS[self.backend.name]
        cands = _candidates(layout, sizes, out_labels, agg, self.label)
        if small or not cands:  # device 0 runs it as it is
            ((data, keys, counts, cpu, st),) = run(self.backend, part_step, [
                (values, tuple(in_labels), out_labels, dict(sizes), layout, agg, dtype, what, None,
                 duck[0] if duck else None)], what)
            ex = Exchange(None, [sum(counts.tuples)] + [0] * (n - 1), [counts.joined] + [0] * (n - 1),
                          cpu=[cpu] + [0.0] * (n - 1), spilled=[st[0]] + [0] * (n - 1), ranges=st[1],
                          small=work if cands and small else None)
            self.held = [held + len(data) * out_bytes] + [0] * (n - 1)
            return data, keys, counts, ex
        kept = self._kept(values, in_labels, out_labels, layout, sizes, agg, out_bytes, names)
        split = kept.split
        grid = _grid(layout, sizes)
        tuples = tuple(len(r.keys) if r is not None else sg[1] for r, sg in zip(kept.rels, kept.sign))
        parts = [[kept.part(k, d, v, ls, layout, nm) for k, (v, ls, nm) in enumerate(zip(values, in_labels, names))]
                 for d in range(n)]
        ex = Exchange(split, [sum(_tuples(p, ls, layout, grid) for p, ls in zip(ps, in_labels)) for ps in parts],
                      [0] * n)
        need = [held_bytes(ps, in_labels, out_labels, layout, sizes, out_bytes, self.cap is not None) for ps in parts]
        check_cap(self.cap, need, step, what)
        for v, ls, copies in zip(values, in_labels, kept.copies):
            ex.replicas += copies
            ex.replica_bytes += copies * _tuple_bytes_of(tuple(v.shape), ls, layout, np.dtype(v.dtype))
        # output keys disjoint per device, in the order of the devices (a range split of the leading
        # output label): each device writes its rows of one buffer, its row count the last run's
        # (the same parts: the same join). Concatenating A·H's 200k x 128 rows cost ~0.2-0.7 s CPU
        views: list[np.ndarray | None] = [None] * n
        whole: np.ndarray | None = None
        if (split.label in out_labels and split.kind == "range" and agg == "sum" and kept.rows is not None
                and out_rel[:1] == [split.label] and self.backend.name in ("sync", "threads") and not duck):
            whole = np.empty((sum(kept.rows), *out_ext), compute)
            at = np.cumsum([0, *kept.rows])
            views = [whole[at[d]:at[d + 1]] for d in range(n)]
        got = run(self.backend, part_step,
                  [(ps, tuple(in_labels), out_labels, dict(sizes), layout, agg, compute, what, views[d],
                    duck[d] if duck else None) for d, ps in enumerate(parts)], what)
        ex.joined = [g[2].joined for g in got]
        # each device's tuples: its inputs and its output (partial sums before they travel)
        self.held = [h + len(g[0]) * out_bytes for (h, _), g in zip(need, got)]
        ex.cpu = [g[3] for g in got]
        ex.spilled = [g[4][0] for g in got]
        ex.ranges = max(g[4][1] for g in got)
        joined = sum(ex.joined)
        if split.label in out_labels:  # output keys disjoint per device
            kept.rows = [len(g[0]) for g in got]
            grid_out = [grid[lab] for lab in out_rel]
            if whole is not None and all(g[0] is v for g, v in zip(got, views)):
                keys = np.concatenate([g[1] for g in got])
                code = key_codes(keys, grid_out)
                if code is not None and bool(np.all(code[1:] > code[:-1])):
                    return whole.astype(dtype, copy=False), keys, RunCounts(tuples, joined, len(keys)), ex
            data, keys = _by_key([g[0] for g in got], [g[1] for g in got], grid_out)
            return data.astype(dtype, copy=False), keys, RunCounts(tuples, joined, len(keys)), ex
        if not out_rel:  # one partial block per device that joined anything, summed on device 0
            busy = [d for d in range(n) if got[d][2].joined]
            ex.partials = sum(1 for d in busy if d != 0)
            ex.partial_bytes = ex.partials * out_bytes
            data = got[busy[0]][0].copy() if busy else got[0][0]
            for d in busy[1:]:
                data = data + got[d][0]
            return data.astype(dtype, copy=False), None, RunCounts(tuples, joined, int(joined > 0)), ex
        # partial sums by output key: each to the device owning the key (a hash of its code), added there
        grid_out = [_grid(layout, sizes)[lab] for lab in out_rel]
        sends: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
        for d, (data_d, keys_d, *_) in enumerate(got):
            code = key_codes(keys_d, grid_out)
            owner = _hash_owner(code if code is not None else keys_d[:, 0], n)
            for q in range(n):
                sel = owner == q
                sends[q].append((data_d[sel], keys_d[sel]))
                if q != d:
                    ex.partials += int(sel.sum())
        ex.partial_bytes = ex.partials * out_bytes
        combined = run(self.backend, combine_sums, [(s, grid_out) for s in sends], what)
        data, keys = _by_key([c[0] for c in combined], [c[1] for c in combined], grid_out)
        return data.astype(dtype, copy=False), keys, RunCounts(tuples, joined, len(keys)), ex


def _by_key(datas: Sequence[np.ndarray], keys: Sequence[np.ndarray], grid: Sequence[int]
            ) -> tuple[np.ndarray, np.ndarray]:
    """The devices' output tuples (disjoint keys) as one relation sorted by key (no sort when
    the devices' ranges already follow each other: a range split of the leading output label)."""
    data, key = np.concatenate(datas), np.concatenate(keys)
    code = key_codes(key, grid)
    if code is not None and bool(np.all(code[1:] > code[:-1])):
        return data, key
    order = np.lexsort(key.T[::-1]) if code is None else np.argsort(code, kind="stable")
    return data[order], key[order]


def _same(a: Any, b: Any) -> bool:
    """One relation's key signature: the same key array, or the same complete grid."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is b
    return bool(a == b)


def _subset(t: SparseTensor, mask: np.ndarray) -> SparseTensor:
    """The tuples of ``mask``: a view when they are one run (a range split of the leading key)."""
    idx = np.flatnonzero(mask)
    if len(idx) and idx[-1] - idx[0] + 1 == len(idx):
        run = slice(int(idx[0]), int(idx[-1]) + 1)
        return SparseTensor(t.name, t.shape, t.block, t.keys[run], t.data[run], trusted=True)
    return SparseTensor(t.name, t.shape, t.block, t.keys[idx], t.data[idx], trusted=True)


def distribution(devices: Any, backend: Any, what: str) -> Distribution:
    """The checked ``devices`` (an integer >= 1) and ``backend`` (``"sync"``, ``"threads"``,
    ``"ray"`` or such a backend object) of ``sparse_compile``.

    >>> distribution(2, "sync", "x").describe()
    '2 devices on backend sync'
    """
    if not isinstance(devices, (int, np.integer)) or isinstance(devices, bool) or not 1 <= devices <= MAX_DEVICES:
        raise EinjoinError(f"{what}: devices={devices!r} (an integer from 1 to {MAX_DEVICES})")
    from einjoin.runtime.backends import get_backend
    b = get_backend(backend)
    if getattr(b, "name", None) not in RUNNERS:
        raise UnsupportedOpError(f"{what}: backend {getattr(b, 'name', backend)!r}; sparse einsums run on "
                                 f"{', '.join(RUNNERS)}")
    if b.name == "torch" and getattr(b, "device_map", "cpu") not in ("cpu", ["cpu"], ("cpu",)):
        raise UnsupportedOpError(f"{what}: backend torch with device_map={b.device_map!r}; sparse einsums run "
                                 f"on the torch backend's CPU devices only (TorchBackend(device_map='cpu'))")
    return Distribution(int(devices), b)
