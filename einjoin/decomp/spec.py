"""Join-agg specs: how many blocks (or which boundaries) each label of an op gets.

Every node kind has a label space. An einsum's labels are its own (contracted ones included);
every other kind names its output dims ``a, b, c, ...``, and a gather adds ``row`` for the
table rows (splitting it makes partial results, as vocab-parallel embeddings do). A scatter-add,
gather's adjoint, names the same tensors the same way: its updates' dims ``a, b, c, ...`` (the
index dims among them aggregated: cutting them makes partial sums) and ``row`` for the output
rows, so its output labels are ``row`` and the updates' trailing dims. A convolution names its
output dims ``n, o`` (batch, output channels) and ``p, q, r`` (spatial), and its input channels
per group ``c`` (aggregated: cutting it makes partial sums; with groups > 1 it is not cut, a
group's channels being read by its output channels only); a pool names its output dims
``n, c, p, q, r``.

>>> import einjoin as ej
>>> from einjoin.decomp.spec import JoinAggSpec, label_sizes
>>> z = ej.input("x", (8, 6)) @ ej.input("w", (6, 4))
>>> label_sizes(z.node)
{'m': 8, 'n': 4, 'k': 6}
>>> print(JoinAggSpec.for_node(z.node, {"m": 2, "k": [0, 1, 6]}))
{m: 2, n: 1, k: [1,5]}
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from einjoin.decomp.partition import Partition, check_bounds, even_bounds
from einjoin.errors import EinjoinError, PartitionError
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.ir.printing import describe

__all__ = ["JoinAggSpec", "LabelRules", "LABEL_RULES", "label_sizes", "aggregated_labels",
           "output_labels", "dim_labels", "ROW", "SPATIAL", "conv_labels"]

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
class LabelRules:
    """How one node kind names its labels (each a function of the node and its op): ``sizes``
    (label -> size, output labels first), ``aggregated`` (labels whose blocks produce partial
    results) and ``outputs`` (one label per output dim, in order)."""

    sizes: Callable[[Node, Any], dict[str, int]]
    aggregated: Callable[[Node, Any], tuple[str, ...]]
    outputs: Callable[[Node, Any], tuple[str, ...]]


def _einsum_sizes(node: Node, op: Einsum) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for lab in op.out_labels:
        sizes[lab] = 0
    for x, ls in zip(node.inputs, op.in_labels):
        for lab, n in zip(ls, x.shape):
            sizes[lab] = n
    return sizes


def _dim_sizes(node: Node, op: object) -> dict[str, int]:
    return dict(zip(dim_labels(node.ndim), node.shape))


def _gather_sizes(node: Node, op: Gather) -> dict[str, int]:
    # the table rows are a label of their own: cutting them makes partial sums (vocab parallel)
    sizes = _dim_sizes(node, op)
    sizes[ROW] = node.inputs[0].shape[0]
    return sizes


def _scatter_split(node: Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the index labels, the row-shape labels) of a scatter-add: its updates' dims a, b, c, ..."""
    updates, idx = node.inputs
    labels = dim_labels(updates.ndim)
    return labels[:idx.ndim], labels[idx.ndim:]


def _scatter_sizes(node: Node, op: ScatterAdd) -> dict[str, int]:
    # output labels first (row, then the row shape), then the aggregated index labels
    updates = node.inputs[0]
    idx, rest = _scatter_split(node)
    sizes = {ROW: node.shape[0]}
    sizes.update(zip(rest, node.shape[1:]))
    sizes.update(zip(idx, updates.shape))
    return sizes


SPATIAL = "pqr"  # the spatial output labels of a conv or pool


def conv_labels(node: Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(output labels, aggregated labels) of a conv: ``n, o, p[, q, r]`` and ``c`` (groups 1)."""
    op = node.op
    outs = ("n", "o") + tuple(SPATIAL[:node.ndim - 2])
    return outs, (("c",) if op.groups == 1 else ())  # type: ignore[union-attr]


def _conv_sizes(node: Node, op: Conv) -> dict[str, int]:
    outs, agg = conv_labels(node)
    sizes = dict(zip(outs, node.shape))
    if agg:
        sizes["c"] = node.inputs[1].shape[1]
    return sizes


def _pool_labels(node: Node, op: Pool) -> tuple[str, ...]:
    return ("n", "c") + tuple(SPATIAL[:node.ndim - 2])


def _dims(node: Node, op: object) -> tuple[str, ...]:
    return dim_labels(node.ndim)


def _none(node: Node, op: object) -> tuple[str, ...]:
    return ()


# every kind but einsum, gather and scatter-add: its output dims, named a, b, c, ...; nothing to aggregate
_DIMS_ONLY = LabelRules(_dim_sizes, _none, _dims)

# the label space of each node kind
LABEL_RULES: dict[type, LabelRules] = {
    Input: _DIMS_ONLY,
    Einsum: LabelRules(_einsum_sizes, lambda node, op: op.agg_labels, lambda node, op: op.out_labels),
    Reshape: _DIMS_ONLY,
    Broadcast: _DIMS_ONLY,
    Select: _DIMS_ONLY,
    Concat: _DIMS_ONLY,
    Fill: _DIMS_ONLY,
    Gather: LabelRules(_gather_sizes, lambda node, op: (ROW,), _dims),
    ScatterAdd: LabelRules(_scatter_sizes, lambda node, op: _scatter_split(node)[0],
                           lambda node, op: (ROW,) + _scatter_split(node)[1]),
    Cast: _DIMS_ONLY,
    Conv: LabelRules(_conv_sizes, lambda node, op: conv_labels(node)[1], lambda node, op: conv_labels(node)[0]),
    TopK: _DIMS_ONLY,
    RotateHalf: _DIMS_ONLY,
    Attention: _DIMS_ONLY,
    AttentionGrad: _DIMS_ONLY,
    SparseEinsum: _DIMS_ONLY,  # opaque: its output dims only (the sparse engine's labels are its own)
    Pool: LabelRules(lambda node, op: dict(zip(_pool_labels(node, op), node.shape)), _none, _pool_labels),
}


def _rules(node: Node) -> LabelRules:
    return rule_for(LABEL_RULES, node.op, "the label spaces (einjoin.decomp.spec.LABEL_RULES)")


def label_sizes(node: Node) -> dict[str, int]:
    """The label space of ``node``: label -> size, output labels first."""
    return _rules(node).sizes(node, node.op)


def aggregated_labels(node: Node) -> tuple[str, ...]:
    """Labels whose blocks produce partial results to aggregate."""
    return _rules(node).aggregated(node, node.op)


def output_labels(node: Node) -> tuple[str, ...]:
    """One label per output dim of ``node``, in order."""
    return _rules(node).outputs(node, node.op)


@dataclass(frozen=True)
class JoinAggSpec:
    """Boundaries for every label of one node (plain, hashable data)."""

    labels: tuple[str, ...]
    bounds: tuple[tuple[int, ...], ...]

    @staticmethod
    def for_node(node: Node, spec: JoinAggSpec | Mapping[str, Any] | Sequence[Any] | None = None
                 ) -> JoinAggSpec:
        """Normalise ``spec`` for ``node``: a mapping label -> block count or boundary list (labels
        left out get one block), a sequence in label order, or None (one block everywhere)."""
        node = as_node(node, "a join-agg spec")
        sizes = label_sizes(node)
        labels = tuple(sizes)
        if isinstance(spec, JoinAggSpec):
            if spec.labels != labels or any(b[-1] != sizes[lab] for lab, b in zip(spec.labels, spec.bounds)):
                given = dict((l, b[-1]) for l, b in zip(spec.labels, spec.bounds))
                raise PartitionError(f"spec {spec} (label sizes {given}) "
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
            if isinstance(p, numbers.Integral) and not isinstance(p, bool):  # np.int64 too
                out.append(even_bounds(sizes[lab], int(p), what))
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
