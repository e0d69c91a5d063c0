"""Which labels of a sparse einsum are relational (upper case: a key over non-empty blocks) and
which dense (lower case: inside each tuple's payload), and at what block size.

The cost of a layout, in units of one gathered payload element, from the data's block histogram
(non-empty block counts of each sparse operand at the candidate block sizes, counted exactly
with a bincount):

    joined ≈ Π_X tuples(X) / Π_ℓ grid(ℓ)^(c_ℓ − 1)       (independent keys; c_ℓ operands keyed on ℓ)
    cost   = joined · min(batched, looped, spmm) + Σ_X tuples(X) · payload(X)
    batched = TUPLE_COST + Σ_X payload(X) + payload(out) + BATCH_FLOP · flops
    looped  = CALL + BLAS_FLOP · flops                   (one BLAS einsum per tuple; sum only)
    spmm    = TUPLE_COST + SPMM_FLOP · payload(out)      (all payloads but one scalars; sum only;
                                                          2 · SPMM_FLOP when the big relation
                                                          outgrows the cache: its rows are missed)
    rowprod = TUPLE_COST + ROW_ELEM · (Σ_X≠scalar payload(X) + payload(out))
                                                         (no label summed inside a payload, out
                                                          no larger than the payloads; sum only)

``flops`` is the product of every label's extent: the block size of a relational label, the
full size of a dense one. Small blocks pay per tuple (gathers, index work), large blocks pay for
the zeros inside their payloads; a few big payloads run as one BLAS call each. The constants are
ratios measured roughly on this machine (gather 1, batched einsum flop ~2, a BLAS flop ~0.05, a
call ~10^4). Every combination is tried when there are few (≤ ``EXHAUSTIVE``), else a
coordinate descent over labels from two corners; a user pin (``blocks={"j": 256}``, ``relational={"i"}``) fixes
a label or keeps it relational.

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

__all__ = ["Operand", "Layout", "choose_layout", "histogram", "CANDIDATES"]

CANDIDATES = (1, 4, 16, 64, 256)  # relational block sizes tried (below a label's size)
TUPLE_COST = 8.0  # one joined tuple's index work (join, sort, segment), in gathered elements
BATCH_FLOP = 2.0  # a multiply-add of the batched np.einsum over tuples
BLAS_FLOP = 0.05  # a multiply-add inside one large einsum call (BLAS)
CALL = 1.0e4  # one einsum call of the looped kernel
SPMM_FLOP = 0.5  # a multiply-add of the SpMM kernel (scalar payloads times one big one)
CACHE_ELEMENTS = 1 << 22  # payload elements of a relation that stay in the cache (32 MiB of float64)
ROW_ELEM = 0.25  # a gathered element of the rowprod kernel (np.take of rows from a cached
# payload, product in place: ~1 ns each, half SPMM's ~2 ns per multiply-add of a large H)
EXHAUSTIVE = 200  # try every combination up to this many, else coordinate descent


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
    # "rowprod" (no label summed inside a payload: gathered rows multiplied, added by group)

    def relational(self, label: str) -> bool:
        return self.blocks[label] is not None

    def extent(self, label: str, size: int) -> int:
        b = self.blocks[label]
        return size if b is None else min(b, size)


def _evaluate(ops: Sequence[Operand], out_labels: Sequence[str], sizes: Mapping[str, int],
              blocks: dict[str, int | None], agg: str) -> Layout:
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
        costs["looped"] = CALL + BLAS_FLOP * flops
        out_size = math.prod(ext(lab) for lab in out_labels)
        if sorted(sizes_in)[:-1] == [1] * (len(ops) - 1):
            big = max(t * n for t, n in zip(tuples, sizes_in))
            costs["spmm"] = TUPLE_COST + SPMM_FLOP * out_size * (2 if big > CACHE_ELEMENTS else 1)
        elif all(lab in out_labels for lab in blocks if ext(lab) > 1) and \
                out_size <= sum(n for n in sizes_in if n > 1):
            # nothing summed inside a payload, and no outer product of payloads (per tuple a
            # payload as large as theirs together: the batched einsum's case)
            costs["rowprod"] = TUPLE_COST + ROW_ELEM * (sum(n for n in sizes_in if n > 1) + out_size)
    kernel = min(costs, key=costs.__getitem__)
    load = sum(t * n for t, n in zip(tuples, sizes_in))
    cost = joined * costs[kernel] + load
    return Layout(dict(blocks), tuples, joined, cost, flops, kernel)


def choose_layout(ops: Sequence[Operand], out_labels: Sequence[str],
                  pinned: Mapping[str, int], relational: set[str], *, agg: str = "sum",
                  what: str = "sparse einsum", engine: str = "memory") -> Layout:
    """The cheapest layout; ``pinned`` fixes block sizes, ``relational`` labels stay keyed.
    Labels of dense operands only stay dense (nothing to skip) unless pinned. For
    ``engine="duckdb"`` the labels of sparse operands are keyed per entry unless pinned: SQL
    arithmetic on a block's list elements (~7M a second in DuckDB's lambdas) costs far more
    than a join per entry (A·D of 64 dense 64-blocks, D 4096 x 256: 1.3 s at blocks of 1 vs
    4.9 s at 64, CPU)."""
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
        keyed: list[int | None] = [1] if engine == "duckdb" else [b for b in CANDIDATES if b < n] or [1]
        if lab in relational or (engine == "duckdb" and lab in in_sparse):
            choices[lab] = list(keyed)
        elif lab in in_sparse:
            choices[lab] = [None, *keyed]
        else:
            choices[lab] = [None]
    labels = list(choices)
    if math.prod(len(c) for c in choices.values()) <= EXHAUSTIVE:
        best = min((_evaluate(ops, out_labels, sizes, dict(zip(labels, combo)), agg)
                    for combo in itertools.product(*(choices[lab] for lab in labels))),
                   key=lambda lay: lay.cost)
        return best
    # coordinate descent from two corners (every label keyed per entry; every label dense where
    # it may be), the better end kept: one corner alone stalls where two labels must move at once
    ends = []
    for start in ({lab: c[1] if len(c) > 1 and c[0] is None else c[0] for lab, c in choices.items()},
                  {lab: c[0] for lab, c in choices.items()}):
        best = _evaluate(ops, out_labels, sizes, start, agg)
        for _sweep in range(4):
            improved = False
            for lab in labels:
                for bb in choices[lab]:
                    trial = _evaluate(ops, out_labels, sizes, {**best.blocks, lab: bb}, agg)
                    if trial.cost < best.cost:
                        best, improved = trial, True
            if not improved:
                break
        ends.append(best)
    return min(ends, key=lambda lay: lay.cost)


def histogram(op: Operand, sizes: Sequence[int] = CANDIDATES) -> list[tuple[int, int]]:
    """(block size, non-empty blocks with every dim keyed at it): the block histogram."""
    return [(b, op.tuples([b] * len(op.shape))) for b in sizes if b == 1 or b < max(op.shape, default=1)]
