"""Which labels of a sparse einsum are relational (upper case: a key over non-empty blocks) and
which dense (lower case: inside each tuple's payload), and at what block size.

The cost of a layout, in units of one gathered payload element, from the data's block histogram
(non-empty block counts of each sparse operand at the candidate block sizes, counted exactly
with a bincount):

    joined ≈ Π_X tuples(X) / Π_ℓ grid(ℓ)^(c_ℓ − 1)       (independent keys; c_ℓ operands keyed on ℓ)
    cost   = STEP + joined · min(batched, looped, spmm) + Σ_X tuples(X) · payload(X)
             + REBLOCK · Σ_X stored entries(X)          (sparse X cut into blocks > 1: each new tensor)
    batched = TUPLE_COST + Σ_X payload(X) + payload(out) + BATCH_FLOP · flops
    looped  = CALL + BLAS_FLOP · flops                   (one BLAS einsum per tuple; sum only;
                                                          BLAS_THREADED_FLOP per flop above
                                                          THREADED flops a call)
    spmm    = SPMM_TUPLE + SPMM_FLOP · payload(out)      (all payloads but one scalars; sum only;
                                                          SPMM_MISS × SPMM_FLOP when the big
                                                          relation outgrows the cache)
    rowprod = TUPLE_COST + ROW_ELEM · (Σ_X≠scalar payload(X) + payload(out))
                                                         (no label summed inside a payload, out
                                                          no larger than the payloads; sum only)

``flops`` is the product of every label's extent: the block size of a relational label, the
full size of a dense one. Small blocks pay per tuple (gathers, index work), large blocks pay for
the zeros inside their payloads; a few big payloads run as one BLAS call each. The unit is about
4 ns of CPU time on the development box (2 cores, AMD EPYC, 2 MiB L2 per core, 32 MiB L3);
the kernels' constants (spmm, looped, rowprod, reblocking) are CPU times measured there (see
their comments), the others ratios (gather 1, batched einsum flop ~2). Every combination is
tried when there are few (≤ ``EXHAUSTIVE``), else a coordinate descent over labels from two
corners; a user pin (``blocks={"j": 256}``, ``relational={"i"}``) fixes a label or keeps it
relational.

>>> import numpy as np
>>> from einjoin.sparse.layout import Operand, choose_layout
>>> a = Operand("A", ("i", "j"), (400, 300), np.array([[0, 0], [1, 5], [399, 299]]))
>>> b = Operand("B", ("j", "k"), (300, 64), None)               # dense
>>> choose_layout([a, b], ("i", "k"), {}, set()).blocks          # i, j keyed per entry; k dense
{'i': 1, 'k': None, 'j': 1}
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from einjoin.errors import EinjoinError, PartitionError
from einjoin.sparse.duckdb_cost import duckdb_cost

__all__ = ["Operand", "Layout", "choose_layout", "histogram", "CANDIDATES"]

CANDIDATES = (1, 4, 16, 64, 256)  # relational block sizes tried (below a label's size)
TUPLE_COST = 8.0  # one joined tuple's index work (join, sort, segment), in gathered elements
BATCH_FLOP = 2.0  # a multiply-add of the batched np.einsum over tuples
# The kernels' constants below are CPU time (time.process_time, min over 7-9 reps, BLAS threads
# as numpy starts them) on the development box under load, divided by the unit, ~4 ns
# (/tmp scripts: numpy einsum / scipy csr_matvecs / SparseTensor.reblock in loops):
CALL = 1.2e4  # one call of the looped kernel (~50 us: np.einsum with a precomputed path, 17-35 us
# alone, plus execute's loop around it: block-diagonal A at i=16, j=64 blocks times D, 256 calls,
# a run 32 ms CPU of which ~12 reblocking A and ~7 the multiply-adds)
BLAS_FLOP = 0.025  # a multiply-add of a looped call on one BLAS thread (~0.1 ns: 16x16x256
# 26 us, 32x256 48 us, 64x64x64 34 us a call)
THREADED = 1 << 18  # multiply-adds of a call above which OpenBLAS runs it on its threads
BLAS_THREADED_FLOP = 0.11  # a multiply-add of such a call in CPU time (~0.45 ns: 64x64x256
# 0.55 ns, 128x.. 0.45, 256x.. 0.32; the second thread spins while it waits, CPU time counts it;
# medians ~2x: block-diagonal 64-blocks x D ran 5x the per-entry SpMM's time)
SPMM_TUPLE = 2.0  # a joined tuple of the SpMM kernel: its CSR index and value (the join of a
# sparse operand kept per entry with a dense one is by key code; a run of A.D (block-diagonal,
# 262144 entries, D 4096 x 256) is its csr_matvecs time, 25 ms, within the noise)
SPMM_FLOP = 0.08  # a multiply-add of the SpMM kernel in cache (~0.3 ns: csr_matvecs over 256-wide
# rows of an 8 MiB relation at random 0.39-0.65 ns, in 64-row groups (block-diagonal A) 0.22 ns)
SPMM_MISS = 7.5  # SPMM_FLOP's factor when the big relation outgrows the cache (2.6 ns a
# multiply-add over 128-wide rows of a 195 MiB one by rows; 2.0 ns by columns, kernels.py)
CACHE_ELEMENTS = 1 << 22  # payload elements of a relation that stay in the cache (32 MiB of float64)
ROW_ELEM = 0.25  # a gathered element of the rowprod kernel (np.take of rows from a cached
# payload, product in place: ~1 ns each; MTTKRP, 0.4M entries, R 32: 36 ms for 38M elements)
REBLOCK = 11.0  # a stored entry of a sparse operand cut into blocks larger than 1
# (SparseTensor.reblock: ~45 ns an entry, block-diagonal 262144 entries at 4..256-blocks 12-14 ms).
# Since b3a6487 the tensor keeps its last cut, so only a run on a new tensor pays it (run(A=other),
# a new ej.einsum operand); charged in full, as for those, not re-measured for repeated runs
STEP = 1.2e5  # a step's own cost (~0.5 ms: building its relations and join, a planned
# intermediate's layout chosen at run): MTTKRP 9x8x7 (200 entries) in one rowprod step 0.12 ms, as
# Khatri-Rao then SpMM 0.69 ms; 60x40x30 (3000) 1.0 vs 1.4 ms CPU
EXHAUSTIVE = 200  # try every combination up to this many, else coordinate descent
DUCK_DENSE = 64  # DuckDB: a sparse operand's label of at most this size may be dense (a list of it)


@dataclass
class Operand:
    """An einsum operand as the layout sees it: labels, shape, and the stored coordinates
    (n × rank) of a sparse one (None: dense, every block present)."""

    name: str
    labels: tuple[str, ...]
    shape: tuple[int, ...]
    coords: np.ndarray | None
    estimate: float | None = None  # a planned intermediate: stored entries expected (coords None)
    _counts: dict[tuple[int | None, ...], int] = field(default_factory=dict, repr=False)

    def tuples(self, blocks: Sequence[int | None]) -> int:
        """Non-empty blocks when dim d is keyed at ``blocks[d]`` (None: dense, not keyed)."""
        key = tuple(blocks)
        if key not in self._counts:
            self._counts[key] = self._count(key)
        return self._counts[key]

    def _count(self, blocks: tuple[int | None, ...]) -> int:
        grid = [(-(-n // b) if b else 1) for n, b in zip(self.shape, blocks)]
        if self.coords is None:
            if self.estimate is None:
                return math.prod(grid)
            cells = math.prod(g for g, b in zip(grid, blocks) if b)  # entries spread uniformly
            return max(1, round(cells * -math.expm1(-self.estimate / cells))) if self.estimate else 0
        if len(self.coords) == 0:
            return 0
        dims = [d for d, b in enumerate(blocks) if b]
        if not dims:
            return 1
        total = math.prod(grid[d] for d in dims)
        code = np.zeros(len(self.coords), np.int64)
        for d in dims:
            b = blocks[d]
            assert b is not None
            col = self.coords[:, d] if b == 1 else self.coords[:, d] // b
            code = code * grid[d] + col
        if total <= 4 * len(code) + (1 << 20):
            return int(np.count_nonzero(np.bincount(code, minlength=total)))
        # a sort, not np.unique (numpy 2 hashes, ~30x slower here); stable: timsort takes the runs
        # of coordinates stored in order (5M power-law edges at 4x1 blocks: 0.14 s, quicksort 0.35)
        code.sort(kind="stable")
        return 1 + int(np.count_nonzero(code[1:] != code[:-1]))


@dataclass(frozen=True)
class Layout:
    """The chosen block size of each label (None: dense) and its estimates."""

    blocks: dict[str, int | None]
    tuples: tuple[int, ...]  # per operand, at these blocks
    joined: float  # estimated joined tuples
    cost: float
    payload: int  # multiply-adds per joined tuple
    kernel: str  # "batched" (one einsum per chunk of tuples), "looped" (one BLAS einsum per
    # tuple), "spmm" (every payload but one a scalar: a sparse matrix times the big payloads) or
    # "rowprod" (no label summed inside a payload: gathered rows multiplied, added by group);
    # "sql" for engine="duckdb" (the step's query, einjoin.sparse.duckdb_exec)

    def relational(self, label: str) -> bool:
        return self.blocks[label] is not None

    def extent(self, label: str, size: int) -> int:
        b = self.blocks[label]
        return size if b is None else min(b, size)


def _evaluate(ops: Sequence[Operand], out_labels: Sequence[str], sizes: Mapping[str, int],
              blocks: dict[str, int | None], agg: str, engine: str = "memory") -> Layout:
    def ext(lab: str) -> int:
        b = blocks[lab]
        return sizes[lab] if b is None else min(b, sizes[lab])
    tuples = tuple(op.tuples([blocks[lab] for lab in op.labels]) for op in ops)
    grid = {lab: -(-sizes[lab] // b) for lab, b in blocks.items() if b}
    if 0 in tuples:
        joined = 0.0
    else:
        log_joined = sum(math.log(t) for t in tuples)
        for lab, g in grid.items():
            log_joined -= (sum(lab in op.labels for op in ops) - 1) * math.log(g)
        joined = max(1.0, min(math.exp(log_joined), float(math.prod(grid.values())),
                              float(math.prod(tuples))))
    sizes_in = [math.prod(ext(lab) for lab in op.labels) for op in ops]
    flops = math.prod(ext(lab) for lab in blocks)
    batched = TUPLE_COST + sum(sizes_in) + math.prod(ext(lab) for lab in out_labels) + BATCH_FLOP * flops
    if agg == "max":
        batched += flops  # the product is materialised before its max
    costs = {"batched": batched}
    if agg == "sum":
        costs["looped"] = CALL + (BLAS_THREADED_FLOP if flops > THREADED else BLAS_FLOP) * flops
        out_size = math.prod(ext(lab) for lab in out_labels)
        if sorted(sizes_in)[:-1] == [1] * (len(ops) - 1):
            big = max(t * n for t, n in zip(tuples, sizes_in))
            costs["spmm"] = SPMM_TUPLE + SPMM_FLOP * out_size * (SPMM_MISS if big > CACHE_ELEMENTS else 1)
        elif all(lab in out_labels for lab in blocks if ext(lab) > 1) and \
                out_size <= sum(n for n in sizes_in if n > 1):
            # nothing summed inside a payload, and no outer product of payloads (per tuple a
            # payload as large as theirs together: the batched einsum's case)
            costs["rowprod"] = TUPLE_COST + ROW_ELEM * (sum(n for n in sizes_in if n > 1) + out_size)
    # a sparse operand stored per entry is cut into blocks on each run: a sort of its entries
    reblocked = sum(len(op.coords) for op in ops
                    if op.coords is not None and any((blocks[lab] or 2) > 1 for lab in op.labels))
    if engine == "duckdb":  # one SQL query: rows, list elements and lambdas (sparse/duckdb_cost.py)
        out_size = math.prod(ext(lab) for lab in out_labels)
        groups = min(joined, float(math.prod(grid[lab] for lab in out_labels if lab in grid)))
        cost = duckdb_cost(tuples, sizes_in, joined, out_size, flops, groups, reblocked)
        return Layout(dict(blocks), tuples, joined, cost, flops, "sql")
    kernel = min(costs, key=costs.__getitem__)
    load = float(sum(t * n for t, n in zip(tuples, sizes_in))) + REBLOCK * reblocked
    cost = STEP + joined * costs[kernel] + load
    return Layout(dict(blocks), tuples, joined, cost, flops, kernel)


def choose_layout(ops: Sequence[Operand], out_labels: Sequence[str],
                  pinned: Mapping[str, int], relational: set[str], *, agg: str = "sum",
                  what: str = "sparse einsum", engine: str = "memory") -> Layout:
    """The cheapest layout; ``pinned`` fixes block sizes, ``relational`` labels stay keyed.
    Labels of dense operands only stay dense (nothing to skip) unless pinned. For
    ``engine="duckdb"`` the costs are its query's (:mod:`einjoin.sparse.duckdb_cost`: rows,
    list elements, lambda calls), and a sparse operand's label is dense only up to
    ``DUCK_DENSE`` (its payload a list of the whole dim otherwise: one SQL column each)."""
    sizes: dict[str, int] = {}
    order: list[str] = list(out_labels)
    for op in ops:
        for lab, n in zip(op.labels, op.shape):
            sizes[lab] = n
            if lab not in order:
                order.append(lab)
    for lab in list(pinned) + sorted(relational):
        if lab not in sizes:
            raise EinjoinError(f"{what}: pinned label {lab!r} is not one of its labels "
                               f"{''.join(order)!r}")
    for lab, b in pinned.items():
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise PartitionError(f"{what}: block size {b!r} for label {lab!r} (size {sizes[lab]}) "
                                 f"must be an integer >= 1")
    in_sparse = {lab for op in ops if op.coords is not None for lab in op.labels}
    choices: dict[str, list[int | None]] = {}
    for lab in order:
        n = max(sizes[lab], 1)
        if lab in pinned:
            choices[lab] = [min(int(pinned[lab]), n)]
            continue
        keyed: list[int | None] = [b for b in CANDIDATES if b < n] or [1]
        if lab in relational or (engine == "duckdb" and lab in in_sparse and n > DUCK_DENSE):
            choices[lab] = list(keyed)
        elif lab in in_sparse:
            choices[lab] = [None, *keyed]
        else:
            choices[lab] = [None]
    labels = list(choices)
    if math.prod(len(c) for c in choices.values()) <= EXHAUSTIVE:
        best = min((_evaluate(ops, out_labels, sizes, dict(zip(labels, combo)), agg, engine)
                    for combo in itertools.product(*(choices[lab] for lab in labels))),
                   key=lambda lay: lay.cost)
        return best
    # coordinate descent from two corners (every label keyed per entry; every label dense where
    # it may be), the better end kept: one corner alone stalls where two labels must move at once
    ends = []
    for start in ({lab: c[1] if len(c) > 1 and c[0] is None else c[0] for lab, c in choices.items()},
                  {lab: c[0] for lab, c in choices.items()}):
        best = _evaluate(ops, out_labels, sizes, start, agg, engine)
        for _sweep in range(4):
            improved = False
            for lab in labels:
                for bb in choices[lab]:
                    trial = _evaluate(ops, out_labels, sizes, {**best.blocks, lab: bb}, agg, engine)
                    if trial.cost < best.cost:
                        best, improved = trial, True
            if not improved:
                break
        ends.append(best)
    return min(ends, key=lambda lay: lay.cost)


def histogram(op: Operand, sizes: Sequence[int] = CANDIDATES) -> list[tuple[int, int]]:
    """(block size, non-empty blocks with every dim keyed at it): the block histogram."""
    return [(b, op.tuples([b] * len(op.shape))) for b in sizes if b == 1 or b < max(op.shape, default=1)]
