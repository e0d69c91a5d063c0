"""Which dims of each node kind the planner may split, and how, as data beside
:data:`~einjoin.decomp.decompose.DECOMPOSE_RULES`: :data:`SPLIT_FACTS` (one line of text per kind,
for the docs' op table, and the claim it makes per label), and :func:`observe`, what the
decomposition rule does when one label is cut in two. ``tests/test_op_table.py`` checks every
claim against :func:`observe` on sample nodes of each kind.

A cut of one label falls in one of four cases:

- ``split``: each kernel reads its own block of the inputs (no overlap, nothing to add);
- ``partial``: kernels make partial results of an output block, aggregated (sum, max, ...);
- ``halo``: the kernels' input blocks overlap (a window op's spatial dims: the halo);
- ``replicated``: every kernel reads the same input blocks, whole (a sort's rows, a reshape whose
  cut does not fall on a merged group's lead dim, a broadcast dim).

>>> import einjoin as ej
>>> x = ej.input("x", (2, 3, 8, 8))
>>> y = ej.conv(x, ej.input("w", (4, 3, 3, 3)), padding=1)
>>> observe(y.node)
{'n': 'split', 'o': 'split', 'p': 'halo', 'q': 'halo', 'c': 'partial'}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from einjoin.decomp.decompose import decompose
from einjoin.decomp.spec import ROW, aggregated_labels, conv_labels, dim_labels, label_sizes
from einjoin.ir.node import Attention, AttentionGrad, RotateHalf, SparseEinsum
from einjoin.ir.sparse_einsum import followed_dims
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)

__all__ = ["SplitFacts", "SPLIT_FACTS", "CASES", "observe", "claims", "split_text"]

CASES = ("split", "partial", "halo", "replicated")
Claim = Callable[[Node], dict[str, frozenset[str]]]


@dataclass(frozen=True)
class SplitFacts:
    """``text``: the kind's splittable dims in words; ``claim``: node -> {label: the cases a cut
    of it may fall in} (checked against :func:`observe`); ``plain``: the text for nodes of the
    kind that aggregate nothing (an elementwise einsum), if it differs."""

    text: str
    claim: Claim
    plain: str = ""


_S, _P, _H, _R = (frozenset({c}) for c in CASES)


def _every(node: Node) -> dict[str, frozenset[str]]:
    return {lab: _S for lab in label_sizes(node)}


def _einsum(node: Node) -> dict[str, frozenset[str]]:
    agg = set(aggregated_labels(node))
    return {lab: _P if lab in agg else _S for lab in label_sizes(node)}


def _conv(node: Node) -> dict[str, frozenset[str]]:
    outs, agg = conv_labels(node)
    out = {lab: _S for lab in outs[:2]}
    out.update({lab: _H | _S for lab in outs[2:]})  # a 1-wide window (or a stride past it) has no halo
    out.update({lab: _P for lab in agg})
    return out


def _pool(node: Node) -> dict[str, frozenset[str]]:
    labs = list(label_sizes(node))
    return {lab: (_S if i < 2 else _H | _S) for i, lab in enumerate(labs)}


def _topk(node: Node) -> dict[str, frozenset[str]]:
    axis: int = node.op.axis  # type: ignore[union-attr]
    return {lab: _R if d == axis else _S for d, lab in enumerate(dim_labels(node.ndim))}


def _attention(node: Node) -> dict[str, frozenset[str]]:
    nb = node.ndim - 2  # the batch dims and the query rows split; the value dim reads v whole
    out = {lab: _S if d <= nb else _R for d, lab in enumerate(dim_labels(node.ndim))}
    if node.op.causal:  # type: ignore[union-attr]  # query blocks read overlapping bands of keys
        out[dim_labels(node.ndim)[nb]] = _S | _H
    return out


def _attention_grad(node: Node) -> dict[str, frozenset[str]]:
    nb = node.ndim - 2  # only the batch dims split: dk and dv sum over every query row
    return {lab: _S if d < nb else _R for d, lab in enumerate(dim_labels(node.ndim))}


def _gather(node: Node) -> dict[str, frozenset[str]]:
    out = {lab: _S for lab in dim_labels(node.ndim)}
    out[ROW] = _P
    return out


def _scatter_add(node: Node) -> dict[str, frozenset[str]]:
    agg = set(aggregated_labels(node))
    out = {lab: _P if lab in agg else _S for lab in label_sizes(node)}
    out[ROW] = _S | _R  # a block of rows reads every update of its index block
    return out


def _reshape(node: Node) -> dict[str, frozenset[str]]:
    return {lab: _S | _R for lab in label_sizes(node)}


def _broadcast(node: Node) -> dict[str, frozenset[str]]:
    x = node.inputs[0]
    dims: tuple[int, ...] = node.op.dims  # type: ignore[union-attr]
    kept = {d for i, d in enumerate(dims) if x.shape[i] == node.shape[d]}
    return {lab: _S if d in kept else _R for d, lab in enumerate(dim_labels(node.ndim))}


def _sparse(node: Node) -> dict[str, frozenset[str]]:
    follow = followed_dims(node)
    return {lab: _S if f else _R for lab, f in zip(label_sizes(node), follow)}


_EVERY = "every dim"
# how each node kind may be split (the docs' "decomposable dims" column is made of these lines)
SPLIT_FACTS: dict[type, SplitFacts] = {
    Input: SplitFacts(_EVERY, _every),
    Einsum: SplitFacts("every dim; reduced dims make partials", _einsum, plain=_EVERY),
    Reshape: SplitFacts("every dim; a cut off a merged group's lead dim reads the group whole", _reshape),
    Broadcast: SplitFacts("every dim; a broadcast dim reads its one row", _broadcast),
    Select: SplitFacts(_EVERY, _every),
    Concat: SplitFacts(_EVERY, _every),
    Fill: SplitFacts("every dim (made in place)", _every),
    Gather: SplitFacts("every output dim; table rows make partial sums", _gather),
    ScatterAdd: SplitFacts("output rows (each block reads every update) and row dims; index dims make "
                           "partial sums", _scatter_add),
    Cast: SplitFacts(_EVERY, _every),
    Conv: SplitFacts("batch, out channels; spatial dims with a halo; in channels make partial sums (groups 1)",
                     _conv),
    Pool: SplitFacts("batch, channels; spatial dims with a halo", _pool),
    TopK: SplitFacts("every dim but the sorted one (a cut there reads whole rows)", _topk),
    RotateHalf: SplitFacts("every dim but the rotated one (a cut there reads whole rows)", _topk),
    Attention: SplitFacts("batch dims and query rows (each query block reads every key, or causal: the band "
                          "of keys its mask allows; keys are not split)",
                          _attention),
    AttentionGrad: SplitFacts("batch dims (a kernel makes its heads' dq, dk, dv whole)", _attention_grad),
    SparseEinsum: SplitFacts("output dims the sparse tensor does not carry (the dense operands' columns); a cut of "
                             "its own dims reads the inputs whole (each kernel computes the tensor's entries in its "
                             "rows)", _sparse),
}


def claims(node: Node) -> dict[str, frozenset[str]]:
    """What :data:`SPLIT_FACTS` says a cut of each label of ``node`` does."""
    return rule_for(SPLIT_FACTS, node.op, "the split facts (einjoin.decomp.split_facts.SPLIT_FACTS)").claim(node)


def split_text(node: Node) -> str:
    """The line of :data:`SPLIT_FACTS` that says how ``node`` may be split."""
    f = rule_for(SPLIT_FACTS, node.op, "the split facts (einjoin.decomp.split_facts.SPLIT_FACTS)")
    return f.plain if f.plain and not aggregated_labels(node) else f.text


def observe(node: Node) -> dict[str, str]:
    """What the decomposition rule does when each label of ``node`` (of size 2 or more) is cut in
    two, one label at a time: ``split``, ``partial``, ``halo`` or ``replicated``."""
    out = {}
    for lab, size in label_sizes(node).items():
        if size < 2:
            continue
        d = decompose(node, {lab: 2})
        if d.n_partials > 1:
            out[lab] = "partial"
        elif any(p.overlap() > 0 for p in d.in_partitions):
            out[lab] = "halo"
        elif d.in_partitions and len({k.in_keys for k in d.kernels}) == 1:  # every kernel reads the same
            out[lab] = "replicated"
        else:
            out[lab] = "split"
    return out
