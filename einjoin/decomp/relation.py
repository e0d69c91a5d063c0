"""Tensor relations: a tensor stored as ``{block key: ndarray}`` under a partition.

>>> import numpy as np
>>> from einjoin.decomp import Partition, TensorRelation
>>> x = np.arange(12.0).reshape(3, 4)
>>> r = TensorRelation.from_dense(x, Partition.from_counts((3, 4), (3, 1)))
>>> c = r.repartition(Partition.from_counts((3, 4), (1, 2)))   # rows -> columns, by overlap
>>> sorted(c.blocks), bool((c.to_dense() == x).all())
([(0, 0), (0, 1)], True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from einjoin.decomp.partition import BlockKey, Covering, Partition
from einjoin.errors import PartitionError

__all__ = ["TensorRelation"]


@dataclass
class TensorRelation:
    partition: Partition
    blocks: dict[BlockKey, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def from_dense(x: np.ndarray, partition: Partition) -> TensorRelation:
        if tuple(x.shape) != partition.shape:
            raise PartitionError(f"partition of shape {partition.shape} for an array of shape {x.shape}")
        return TensorRelation(partition, {k: x[partition.slices(k)] for k in partition.keys()})

    @property
    def dtype(self) -> np.dtype:
        return next(iter(self.blocks.values())).dtype

    def to_dense(self) -> np.ndarray:
        missing = [k for k in self.partition.keys() if k not in self.blocks]
        if missing:
            raise PartitionError(f"relation lacks blocks {missing[:4]} of partition {self.partition}")
        if self.partition.num_blocks == 1:
            return np.asarray(self.blocks[(0,) * self.partition.ndim], order="C")
        out = np.empty(self.partition.shape, dtype=self.dtype)
        for k, v in self.blocks.items():
            out[self.partition.slices(k)] = v
        return out

    def region(self, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The values in ``box``, assembled from every block that overlaps it."""
        p = self.partition
        ranges = [p.overlapping(d, a, b) for d, (a, b) in enumerate(box)]
        keys = list(itertools.product(*ranges))
        if len(keys) == 1 and p.box(keys[0]) == box:
            return self.blocks[keys[0]]  # aligned: the block itself, no copy
        out = np.empty(tuple(b - a for a, b in box), dtype=self.dtype)
        for k in keys:
            src = p.box(k)
            lo = [max(a, s) for (a, _), (s, _) in zip(box, src)]
            hi = [min(b, e) for (_, b), (_, e) in zip(box, src)]
            out[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, box))] = \
                self.blocks[k][tuple(slice(l - s, h - s) for l, h, (s, _) in zip(lo, hi, src))]
        return out

    def repartition(self, target: Partition | Covering) -> TensorRelation:
        """The same tensor under ``target``: each target block from the overlapping source blocks
        (a :class:`Covering`'s boxes may overlap: such a relation only feeds kernels)."""
        if target.shape != self.partition.shape:
            raise PartitionError(f"cannot repartition shape {self.partition.shape} to {target.shape}")
        if target == self.partition:
            return self
        return TensorRelation(cast(Partition, target), {k: self.region(target.box(k)) for k in target.keys()})
