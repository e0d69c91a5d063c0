"""Candidate generation: the join-agg specs the searches choose among, per op.

Without a memory cap an op's candidates are its even specs with k * P blocks
(:func:`candidate_specs`, k in ``Settings.candidate_over``); under a cap, those and finer cuts
that fit it (:func:`einjoin.planner.fit.fitting_specs`). :class:`Candidates` memoises them per op
as the cost model's :class:`~einjoin.planner.cost.SpecInfo`, shared by ops of the same shape.

>>> import einjoin as ej
>>> z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
>>> sorted(tuple(s.counts().values()) for s in candidate_specs(z.node, 2, over=(1,)))
[(1, 1, 2), (1, 2, 1), (2, 1, 1)]
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable

import numpy as np

from einjoin.decomp.partition import even_bounds
from einjoin.decomp.spec import JoinAggSpec, label_sizes
from einjoin.ir.node import Node
from einjoin.planner.cost import CostModel, SpecInfo
from einjoin.planner.fit import fitting_specs
from einjoin.settings import SETTINGS, Settings

__all__ = ["candidate_specs", "Candidates"]


def _factorisations(target: int, sizes: list[int]) -> Iterable[tuple[int, ...]]:
    """Ordered tuples (p_1..p_n) with product ``target`` and p_i <= sizes[i]."""
    if not sizes:
        if target == 1:
            yield ()
        return
    for p in range(1, min(target, sizes[0]) + 1):
        if target % p == 0:
            for rest in _factorisations(target // p, sizes[1:]):
                yield (p,) + rest


def candidate_specs(node: Node, p: int, over: tuple[int, ...] = SETTINGS.candidate_over
                    ) -> list[JoinAggSpec]:
    """Even join-agg specs with block-count product k * p (k in ``over``), each count at most its
    label's size; where no label set is big enough for p blocks, the largest feasible product."""
    sizes = label_sizes(node)
    labels = list(sizes)
    dims = [sizes[lab] for lab in labels]
    most = [max(n, 1) for n in dims]  # an empty label (size 0) is one empty block
    found: list[tuple[int, ...]] = []
    for k in over:
        found.extend(_factorisations(k * p, most))
    if not found:
        cap = math.prod(most)
        for target in range(min(p, cap), 0, -1):
            found = list(_factorisations(target, most))
            if found:
                break
    return [JoinAggSpec(tuple(labels), tuple(even_bounds(n, c) for n, c in zip(dims, counts)))
            for counts in found]


class Candidates:
    """Each op's candidates on ``model``'s devices (memoised; fills and inputs have none): the
    specs of :func:`candidate_specs`, or under a memory ``cap`` (bytes, the smallest device's)
    the ones of :func:`~einjoin.planner.fit.fitting_specs`; cheapest aggregation first, then
    fewest kernels.

    >>> import einjoin as ej
    >>> from einjoin.planner.cost import CostModel
    >>> z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    >>> cands = Candidates(CostModel(ej.Graph(z), 2))
    >>> cands(z.node)[0].agg_bytes, cands(z.node)[-1].agg_bytes    # no partial sums first
    (0, 114688)
    """

    def __init__(self, model: CostModel, cap: int | None = None, settings: Settings = SETTINGS,
                 over: tuple[int, ...] | None = None):
        self.model = model
        self.cap = cap  # the devices' memory (None: no cap)
        self.settings = settings
        self.over = settings.candidate_over if over is None else over
        self._cands: dict[Node, list[SpecInfo]] = {}
        self._by_shape: dict[Hashable, list[SpecInfo]] = {}
        self._groups: dict[Node, tuple[tuple[int, ...], list[int]]] = {}
        self._rows: dict[tuple[Node, int], np.ndarray] = {}

    def __call__(self, node: Node) -> list[SpecInfo]:
        found = self._cands.get(node)
        if found is None:
            found = self._cands[node] = [] if node.facts.leaf else self._of(node)
        return found

    def out_groups(self, node: Node) -> tuple[tuple[int, ...], list[int]]:
        """``node``'s distinct output partitions (interned ids, in the order its candidates first
        give them) and, per candidate, the index of its output there (memoised)."""
        found = self._groups.get(node)
        if found is None:
            index: dict[int, int] = {}
            group = [index.setdefault(info.out_id, len(index)) for info in self(node)]
            found = self._groups[node] = (tuple(index), group)
        return found

    def repart_row(self, node: Node, need: int) -> np.ndarray:
        """The placement-free bytes from each of :meth:`out_groups`' partitions of ``node`` to
        partition ``need`` (an interned id), as int64 (memoised: the DP asks again every round)."""
        key = (node, need)
        found = self._rows.get(key)
        if found is None:
            found = self._rows[key] = self.model.repart_from(self.out_groups(node)[0], need, node.dtype)
        return found

    def _of(self, node: Node) -> list[SpecInfo]:
        # layers repeat: nodes with the same op on the same input shapes share candidates
        shape_key = (node.op, node.shape, node.dtype,
                     tuple((x.shape, x.dtype, x.facts.free) for x in node.inputs))
        found = self._by_shape.get(shape_key)
        if found is None:
            specs = candidate_specs(node, self.model.p, self.over)
            if self.cap is not None:
                specs = fitting_specs(node, specs, self.cap, self.settings)
            found = [self.model.info(node, s) for s in specs]
            # equal bytes: prefer fewer partial sums (no reduce to run), then fewer kernels
            found.sort(key=lambda i: (i.agg_bytes, i.spec.num_kernels))
            self._by_shape[shape_key] = found
        return found
