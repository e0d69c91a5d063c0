"""Join-agg specs: how many blocks (or which boundaries) each label of an op gets.

Every node kind has a label space. An einsum's labels are its own (contracted ones included);
every other kind names its output dims ``a, b, c, ...``, and a gather adds ``row`` for the
table rows (splitting it makes partial results, as vocab-parallel embeddings do).

>>> import einjoin as ej
>>> from einjoin.decomp.spec import JoinAggSpec, label_sizes
>>> z = ej.input("x", (8, 6)) @ ej.input("w", (6, 4))
>>> label_sizes(z.node)
{'m': 8, 'n': 4, 'k': 6}
>>> print(JoinAggSpec.for_node(z.node, {"m": 2, "k": [0, 1, 6]}))
{m: 2, n: 1, k: [1,5]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from einjoin.decomp.partition import Partition, check_bounds, even_bounds
from einjoin.errors import EinjoinError, PartitionError
from einjoin.ir.node import (Broadcast, Cast, Concat, Einsum, Fill, Gather, Input, Node, Reshape,
                             Select, rule_for)
from einjoin.ir.printing import describe

__all__ = ["JoinAggSpec", "LabelSpace", "LABEL_RULES", "label_space", "label_sizes", "aggregated_labels",
           "output_labels", "dim_labels", "ROW"]

ROW = "row"
_DIMS = "abcdefghijklmnopqrstuvwxyz"


def as_node(x: Any, what: str) -> Node:
    """A node from a node or a frontend tensor, or a clear error."""
    n = getattr(x, "node", x)
    if not isinstance(n, Node):
        raise EinjoinError(f"{what}: expected an einjoin tensor or node, got {type(x).__name__}")
    return n


def dim_labels(rank: int) -> tuple[str, ...]:
    return tuple(_DIMS[:rank])


@dataclass(frozen=True)
class LabelSpace:
    """An op's labels: ``sizes`` (label -> size, output labels first), the ``aggregated`` ones
    (whose blocks produce partial results) and the ``outputs`` (one per output dim, in order)."""

    sizes: dict[str, int]
    aggregated: tuple[str, ...]
    outputs: tuple[str, ...]


def _einsum_labels(node: Node, op: Einsum) -> LabelSpace:
    sizes: dict[str, int] = {}
    for lab in op.out_labels:
        sizes[lab] = 0
    for x, ls in zip(node.inputs, op.in_labels):
        for lab, n in zip(ls, x.shape):
            sizes[lab] = n
    return LabelSpace(sizes, op.agg_labels, op.out_labels)


def _gather_labels(node: Node, op: Gather) -> LabelSpace:
    # the table rows are a label of their own: cutting them makes partial sums (vocab parallel)
    dims = dim_labels(node.ndim)
    return LabelSpace(dict(zip(dims, node.shape)) | {ROW: node.inputs[0].shape[0]}, (ROW,), dims)


def _dim_labels(node: Node, op: object) -> LabelSpace:
    # every other kind: its output dims, named a, b, c, ...; nothing to aggregate
    dims = dim_labels(node.ndim)
    return LabelSpace(dict(zip(dims, node.shape)), (), dims)


# the label space of each node kind: (node, its op) -> LabelSpace
LABEL_RULES: dict[type, Callable[[Node, Any], LabelSpace]] = {
    Input: _dim_labels,
    Einsum: _einsum_labels,
    Reshape: _dim_labels,
    Broadcast: _dim_labels,
    Select: _dim_labels,
    Concat: _dim_labels,
    Fill: _dim_labels,
    Gather: _gather_labels,
    Cast: _dim_labels,
}


def label_space(node: Node) -> LabelSpace:
    """``node``'s :class:`LabelSpace`, from :data:`LABEL_RULES`."""
    return rule_for(LABEL_RULES, node.op, "the label spaces (einjoin.decomp.spec.LABEL_RULES)")(
        node, node.op)


def label_sizes(node: Node) -> dict[str, int]:
    """The label space of ``node``: label -> size, output labels first."""
    return label_space(node).sizes


def aggregated_labels(node: Node) -> tuple[str, ...]:
    """Labels whose blocks produce partial results to aggregate."""
    return label_space(node).aggregated


def output_labels(node: Node) -> tuple[str, ...]:
    return label_space(node).outputs


@dataclass(frozen=True)
class JoinAggSpec:
    """Boundaries for every label of one node (plain, hashable data)."""

    labels: tuple[str, ...]
    bounds: tuple[tuple[int, ...], ...]

    @staticmethod
    def for_node(node: Node, spec: "JoinAggSpec | Mapping[str, Any] | Sequence[Any] | None" = None
                 ) -> "JoinAggSpec":
        """Normalise ``spec`` for ``node``: a mapping label -> block count or boundary list (labels
        left out get one block), a sequence in label order, or None (one block everywhere)."""
        node = as_node(node, "a join-agg spec")
        sizes = label_sizes(node)
        labels = tuple(sizes)
        if isinstance(spec, JoinAggSpec):
            if spec.labels != labels or any(b[-1] != sizes[lab] for lab, b in zip(spec.labels, spec.bounds)):
                raise PartitionError(f"spec {spec} (label sizes {dict((l, b[-1]) for l, b in zip(spec.labels, spec.bounds))}) "
                                     f"given to {describe(node)} whose label sizes are {sizes}")
            return spec
        if spec is None:
            spec = {}
        if isinstance(spec, (list, tuple)):
            if len(spec) != len(labels):
                raise PartitionError(f"{describe(node)}: {len(spec)} block counts for labels "
                                     f"{''.join(labels) if all(len(l) == 1 for l in labels) else labels}")
            spec = dict(zip(labels, spec))
        if not isinstance(spec, Mapping):
            raise PartitionError(f"{describe(node)}: a spec is a mapping label -> blocks, got "
                                 f"{type(spec).__name__}")
        for lab in spec:
            if lab not in sizes:
                raise PartitionError(f"{describe(node)}: spec names label {lab!r}, which the op "
                                     f"does not have (labels: {', '.join(labels)})")
        out = []
        for lab in labels:
            p = spec.get(lab, 1)
            what = f"{describe(node)} label {lab!r} (size {sizes[lab]})"
            if isinstance(p, (int,)) and not isinstance(p, bool):
                out.append(even_bounds(sizes[lab], p, what))
            elif isinstance(p, (list, tuple)):
                out.append(check_bounds(p, sizes[lab], what))
            else:
                raise PartitionError(f"{what}: blocks must be a count or a boundary list, got {p!r}")
        return JoinAggSpec(labels, tuple(out))

    def __getitem__(self, label: str) -> tuple[int, ...]:
        return self.bounds[self.labels.index(label)]

    def counts(self) -> dict[str, int]:
        return {lab: len(b) - 1 for lab, b in zip(self.labels, self.bounds)}

    def partition(self, labels: Sequence[str]) -> Partition:
        """The partition of a tensor whose dims carry ``labels``."""
        return Partition(tuple(self[lab] for lab in labels))

    @property
    def num_kernels(self) -> int:
        n = 1
        for b in self.bounds:
            n *= len(b) - 1
        return n

    def __str__(self) -> str:
        parts = []
        for lab, b in zip(self.labels, self.bounds):
            sizes = [y - x for x, y in zip(b, b[1:])]
            txt = str(len(sizes)) if max(sizes) - min(sizes) <= 1 else "[" + ",".join(map(str, sizes)) + "]"
            parts.append(f"{lab}: {txt}")
        return "{" + ", ".join(parts) + "}"
