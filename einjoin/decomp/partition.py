"""Partitions: per-dimension block boundaries (uneven allowed), and the block keys they define.

>>> from einjoin.decomp.partition import Partition
>>> p = Partition.from_counts((10, 4), (3, 1))
>>> p.bounds, p.nblocks, list(p.keys())
(((0, 4, 7, 10), (0, 4)), (3, 1), [(0, 0), (1, 0), (2, 0)])
>>> p.box((1, 0)), p.block_shape((1, 0))
(((4, 7), (0, 4)), (3, 4))
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from einjoin.errors import PartitionError

__all__ = ["Partition", "Covering", "BlockKey", "Box", "even_bounds", "check_bounds", "box_shape", "box_size",
           "intersect", "relative"]

BlockKey = tuple[int, ...]
Box = tuple[tuple[int, int], ...]  # a block in global coordinates: ((start, stop) per dim)


def even_bounds(n: int, k: int, what: str = "dimension") -> tuple[int, ...]:
    """Boundaries of ``k`` nearly equal blocks of ``n`` (the larger blocks first); an empty
    dimension (``n == 0``) is one empty block, ``(0, 0)``."""
    if isinstance(k, np.integer):
        k = int(k)
    if n == 0 and isinstance(k, int) and not isinstance(k, bool) and k >= 0:
        return (0, 0)  # an empty dimension is one empty block, however many were asked for
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PartitionError(f"{what}: block count must be a positive int, got {k!r}")
    if k > n:
        raise PartitionError(f"{what}: {k} blocks for a dimension of size {n} would leave "
                             f"empty blocks" + (" (an empty dimension takes 1 block)" if n == 0 else ""))
    q, r = divmod(n, k)
    out = [0]
    for i in range(k):
        out.append(out[-1] + q + (1 if i < r else 0))
    return tuple(out)


def check_bounds(bounds: Sequence[int], n: int, what: str = "dimension") -> tuple[int, ...]:
    """Validate explicit boundaries ``(0, b1, ..., n)``: strictly increasing, so no block is empty
    (except the one block ``(0, 0)`` of an empty dimension)."""
    try:
        if isinstance(bounds, (str, bytes)) or any(isinstance(v, bool) for v in bounds):
            raise TypeError
        b = tuple(operator.index(v) for v in bounds)
    except TypeError:
        raise PartitionError(f"{what}: boundaries must be a list of ints, got {bounds!r}") from None
    if len(b) < 2 or b[0] != 0 or b[-1] != n:
        raise PartitionError(f"{what}: boundaries {list(b)} must start at 0 and end at the size {n}")
    if b == (0, 0):
        return b  # an empty dimension: its one block is empty
    for x, y in zip(b, b[1:]):
        if y <= x:
            raise PartitionError(f"{what}: boundaries {list(b)} leave an empty block [{x}:{y}]")
    return b


# ---- box arithmetic: blocks as ((start, stop), ...) in some tensor's coordinates

def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    # blocks that only touch do not overlap; on an empty dim, its empty block meets itself
    return None if any(lo > hi or (lo == hi and (x0 < x1 or y0 < y1))
                       for (lo, hi), (x0, x1), (y0, y1) in zip(out, a, b)) else out


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in the coordinates of ``outer``'s corner."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def _shape(shape: Any, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or a PartitionError naming ``what``."""
    if isinstance(shape, (list, tuple)):
        try:
            if any(isinstance(n, bool) for n in shape):
                raise TypeError
            dims = tuple(operator.index(n) for n in shape)
        except TypeError:
            dims = None
        if dims is not None and all(n >= 0 for n in dims):
            return dims
    raise PartitionError(f"{what}: shape must be a tuple of non-negative ints, got "
                         f"{type(shape).__name__} {shape!r:.60}")


def _as_bounds(raw: Any) -> tuple[tuple[Any, ...], ...]:
    """``raw`` (any sequence of sequences) as a tuple of tuples, or a PartitionError."""
    try:
        if isinstance(raw, (str, bytes)):
            raise TypeError
        dims = tuple(raw)
    except TypeError:  # None, an int, a 0-d array...
        raise PartitionError(f"Partition(bounds): expected one sequence of boundaries per dim, "
                             f"got {type(raw).__name__} {raw!r:.60}") from None
    out = []
    for d, b in enumerate(dims):
        try:
            if isinstance(b, (str, bytes)):
                raise TypeError
            out.append(tuple(b))
        except TypeError:
            raise PartitionError(f"Partition(bounds): dim {d}: boundaries must be a list of "
                                 f"ints, got {type(b).__name__} {b!r:.60}") from None
    return tuple(out)


@dataclass(frozen=True)
class Partition:
    """A box partition of a tensor: ``bounds[d]`` are the block boundaries of dim ``d``."""

    bounds: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if type(self.bounds) is not tuple or not all(type(b) is tuple for b in self.bounds):
            # the slow path for lists, arrays and junk (the planners pass tuples: kept fast)
            object.__setattr__(self, "bounds", _as_bounds(self.bounds))
        if any(b == (0,) for b in self.bounds):
            # the set of cuts of an empty dim is {0}: its one block is (0, 0)
            object.__setattr__(self, "bounds", tuple((0, 0) if b == (0,) else b for b in self.bounds))
        for d, b in enumerate(self.bounds):
            check_bounds(b, b[-1] if b else 0, f"dim {d}")  # ints only: junk raises there

    # ---- construction
    @staticmethod
    def from_counts(shape: Sequence[int], counts: Sequence[int]) -> Partition:
        shape = _shape(shape, "Partition.from_counts")
        if not isinstance(counts, (list, tuple)):
            raise PartitionError(f"block counts must be a sequence (one per dim of shape "
                                 f"{tuple(shape)}), got {counts!r}")
        if len(counts) != len(shape):
            raise PartitionError(f"{len(counts)} block counts for a tensor of rank {len(shape)} "
                                 f"(shape {tuple(shape)})")
        return Partition(tuple(even_bounds(n, k, f"dim {d} of shape {tuple(shape)}")
                               for d, (n, k) in enumerate(zip(shape, counts))))

    @staticmethod
    def whole(shape: Sequence[int]) -> Partition:
        shape = _shape(shape, "Partition.whole")
        return Partition(tuple((0, n) for n in shape))

    @staticmethod
    def of(shape: Sequence[int], per_dim: Sequence[int | Sequence[int]]) -> Partition:
        """Each dim given as a block count or as explicit boundaries, validated against ``shape``."""
        shape = _shape(shape, "Partition.of")
        if not isinstance(per_dim, (list, tuple)):
            raise PartitionError(f"a partition is one entry per dim of shape {tuple(shape)}, "
                                 f"got {per_dim!r}")
        if len(per_dim) != len(shape):
            raise PartitionError(f"partition with {len(per_dim)} dims for a tensor of rank "
                                 f"{len(shape)} (shape {tuple(shape)})")
        out = []
        for d, (n, p) in enumerate(zip(shape, per_dim)):
            what = f"dim {d} of shape {tuple(shape)}"
            count = isinstance(p, (int, np.integer)) and not isinstance(p, bool)
            out.append(even_bounds(n, p, what) if count else check_bounds(p, n, what))
        return Partition(tuple(out))

    # ---- facts
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b[-1] for b in self.bounds)

    @property
    def ndim(self) -> int:
        return len(self.bounds)

    @property
    def nblocks(self) -> tuple[int, ...]:
        return tuple(len(b) - 1 for b in self.bounds)

    @property
    def num_blocks(self) -> int:
        n = 1
        for k in self.nblocks:
            n *= k
        return n

    def keys(self) -> Iterator[BlockKey]:
        return itertools.product(*(range(k) for k in self.nblocks))

    def box(self, key: BlockKey) -> tuple[tuple[int, int], ...]:
        return tuple((b[i], b[i + 1]) for b, i in zip(self.bounds, key))

    def block_shape(self, key: BlockKey) -> tuple[int, ...]:
        return tuple(b[i + 1] - b[i] for b, i in zip(self.bounds, key))

    def slices(self, key: BlockKey) -> tuple[slice, ...]:
        return tuple(slice(b[i], b[i + 1]) for b, i in zip(self.bounds, key))

    @property
    def core(self) -> Partition:
        """The partition itself (a :class:`Covering`'s is the partition it is loaded in)."""
        return self

    def overlap(self) -> int:
        """Elements its blocks hold beyond one copy of the tensor: 0 (blocks are disjoint)."""
        return 0

    def overlapping(self, d: int, start: int, stop: int) -> range:
        """Block indices of dim ``d`` that intersect ``[start, stop)``; on an empty dim, its one
        (empty) block."""
        b = self.bounds[d]
        if b[-1] == 0:
            return range(1)
        lo = bisect.bisect_right(b, start) - 1
        hi = bisect.bisect_left(b, stop)
        return range(lo, hi)

    def union(self, other: Partition) -> Partition:
        """The coarsest common refinement: per dim, every boundary of either."""
        if self.shape != other.shape:
            raise PartitionError(f"union of partitions of shapes {self.shape} and {other.shape}")
        return Partition(tuple(tuple(sorted(set(a) | set(b))) for a, b in zip(self.bounds, other.bounds)))

    def __str__(self) -> str:
        parts = []
        for b in self.bounds:
            sizes = [y - x for x, y in zip(b, b[1:])]
            if len(sizes) == 1:
                parts.append("1")
            elif max(sizes) - min(sizes) <= 1:
                parts.append(str(len(sizes)))
            else:
                parts.append("[" + ",".join(map(str, sizes)) + "]")
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class Covering:
    """Per-kernel input boxes that may overlap: ``ranges[d][i]`` is the ``(start, stop)`` of block
    ``i`` along dim ``d`` (a grid, as a partition's, but neighbours may share elements: the halo
    of a spatially split convolution). It answers what a :class:`Partition` answers where an
    op's input is read (``keys``, ``box``, ``block_shape``); ``core`` is the partition the tensor
    is loaded in (cut where the boxes start), whose ``bounds`` it reports.

    >>> c = Covering((((0, 5), (3, 9), (7, 10)),))   # 3 row blocks of a size-10 dim, halo 2
    >>> c.box((1,)), c.block_shape((1,)), c.bounds, c.overlap()
    (((3, 9),), (6,), ((0, 3, 7, 10),), 4)
    """

    ranges: tuple[tuple[tuple[int, int], ...], ...]
    shape: tuple[int, ...]

    def __init__(self, ranges: Sequence[Sequence[tuple[int, int]]], shape: Sequence[int] | None = None) -> None:
        rs = tuple(tuple((int(a), int(b)) for a, b in r) for r in ranges)
        dims = tuple(shape) if shape is not None else tuple(max((b for _, b in r), default=0) for r in rs)
        for d, (r, n) in enumerate(zip(rs, dims)):
            if not r or any(not 0 <= a <= b <= n for a, b in r):
                raise PartitionError(f"Covering: dim {d} (size {n}) has ranges {list(r)} outside [0, {n}]")
        object.__setattr__(self, "ranges", rs)
        object.__setattr__(self, "shape", dims)

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def nblocks(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.ranges)

    @property
    def num_blocks(self) -> int:
        n = 1
        for r in self.ranges:
            n *= len(r)
        return n

    def keys(self) -> Iterator[BlockKey]:
        return itertools.product(*(range(len(r)) for r in self.ranges))

    def box(self, key: BlockKey) -> tuple[tuple[int, int], ...]:
        return tuple(r[i] for r, i in zip(self.ranges, key))

    def block_shape(self, key: BlockKey) -> tuple[int, ...]:
        return tuple(r[i][1] - r[i][0] for r, i in zip(self.ranges, key))

    def slices(self, key: BlockKey) -> tuple[slice, ...]:
        return tuple(slice(*r[i]) for r, i in zip(self.ranges, key))

    @property
    def core(self) -> Partition:
        bounds = []
        for r, n in zip(self.ranges, self.shape):
            cuts = sorted({a for a, _ in r if 0 < a < n} | {0, n})
            bounds.append(tuple(cuts) if n else (0, 0))
        return Partition(tuple(bounds))

    @property
    def bounds(self) -> tuple[tuple[int, ...], ...]:
        return self.core.bounds

    def overlap(self) -> int:
        """Elements the blocks hold beyond one copy of what they cover: the halo, and blocks of
        other keys over the same box (a conv's output-channel blocks of one group read its input
        channels alike). Several readers of one key are replicas, counted elsewhere."""
        total = 1
        for r in self.ranges:
            total *= sum(b - a for a, b in r)
        covered = 1
        for r in self.ranges:
            marks = sorted(set(r))
            size, end = 0, 0
            for a, b in marks:
                size += max(0, b - max(a, end))
                end = max(end, b)
            covered *= size
        return max(0, total - covered)

    def __str__(self) -> str:
        return "(" + ", ".join(str(len(r)) if len(r) > 1 else "1" for r in self.ranges) + ") with halo"
