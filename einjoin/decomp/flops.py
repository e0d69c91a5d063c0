"""Modelled flops of a kernel: a pure function of the decomposition (used by the plan's accounting
and by placers that estimate run times)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.spec import ROW
from einjoin.ir.attention import band_pairs
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.sparse_einsum import followed_dims, sparse_flops
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.ir.scalar import Call, is_product

__all__ = ["kernel_flops", "FLOPS_RULES"]


def _count_calls(e: object) -> int:
    return 1 + sum(_count_calls(a) for a in e.args) if isinstance(e, Call) else 0


def kernel_flops(d: Decomposition, index: tuple[int, ...]) -> int:
    """Modelled flops of one kernel: the joined label box times the join's operations (a
    multiply-add per element for a contraction); kinds that only move or cut data count none."""
    return rule_for(FLOPS_RULES, d.node.op, "the flop counts (einjoin.decomp.flops.FLOPS_RULES)")(
        d, d.node.op, index)


def _einsum_flops(d: Decomposition, op: Einsum, index: tuple[int, ...]) -> int:
    n = 1
    for b, i in zip(d.spec.bounds, index):
        n *= b[i + 1] - b[i]
    if is_product(op.join, len(d.node.inputs)) and op.agg.reduces:
        return 2 * n
    return n * max(1, _count_calls(op.join))


def _scatter_add_flops(d: Decomposition, op: ScatterAdd, index: tuple[int, ...]) -> int:
    # one add per element of the updates block it reads: every label but the output rows (an
    # upper bound when rows are cut: only the updates whose index falls in its rows are added)
    n = 1
    for lab, b, i in zip(d.spec.labels, d.spec.bounds, index):
        if lab != ROW:
            n *= b[i + 1] - b[i]
    return n


def _block_elems(d: Decomposition, index: tuple[int, ...]) -> int:
    n = 1
    for b, i in zip(d.spec.bounds, index):
        n *= b[i + 1] - b[i]
    return n


def _conv_flops(d: Decomposition, op: Conv, index: tuple[int, ...]) -> int:
    # a multiply-add per (output element, input channel of its group, kernel position); the
    # labels' box covers the output block and the c block (groups 1), else the group's channels
    w = d.node.inputs[1]
    per = 1
    for k in w.shape[2:]:
        per *= k
    return 2 * _block_elems(d, index) * per * (1 if op.groups == 1 else w.shape[1])


def _pool_flops(d: Decomposition, op: Pool, index: tuple[int, ...]) -> int:
    per = 1
    for k in op.window:
        per *= k
    return _block_elems(d, index) * per  # one max or add per window element


def _topk_flops(d: Decomposition, op: TopK, index: tuple[int, ...]) -> int:
    # a comparison sort of each whole row it reads: n log2 n per row
    n = d.node.inputs[0].shape[op.axis]
    rows = _block_elems(d, index) // max(1, d.spec.bounds[op.axis][index[op.axis] + 1]
                                         - d.spec.bounds[op.axis][index[op.axis]])
    return rows * n * max(1, n.bit_length())


def _attention_batch(d: Decomposition, index: tuple[int, ...]) -> int:
    """The query-key pairs' batch a kernel of an attention node computes: its batch block where q
    follows the node's batch dims, q's whole dim elsewhere (a mask gradient's broadcast dims)."""
    q = d.node.inputs[0]
    n = 1
    for dim in range(q.ndim - 2):
        b = d.spec.bounds[dim]
        n *= b[index[dim] + 1] - b[index[dim]] if q.shape[dim] == d.node.shape[dim] else q.shape[dim]
    return n


def _attention_flops(d: Decomposition, op: Attention, index: tuple[int, ...]) -> int:
    # two products over the query-key pairs it computes: q k^T (E) and p v (Ev); its query rows x
    # every key, or causal: the pairs of the key blocks its mask does not hide entirely
    # (attention.band_pairs: by 128-row blocks, each over its band of keys)
    q, k, v = d.node.inputs[:3]
    nb = q.ndim - 2
    row0, row1 = d.spec.bounds[nb][index[nb]], d.spec.bounds[nb][index[nb] + 1]
    pairs = band_pairs(row0, row1 - row0, op.window, k.shape[-2]) if op.causal else (row1 - row0) * k.shape[-2]
    return 2 * _attention_batch(d, index) * pairs * (q.shape[-1] + v.shape[-1])


def _attention_grad_flops(d: Decomposition, op: AttentionGrad, index: tuple[int, ...]) -> int:
    # the forward again (q k^T, p v), then q k^T, dout v^T, p^T dout, ds k and ds^T q
    q, k, v = d.node.inputs[:3]
    e, ev = q.shape[-1], v.shape[-1]
    per = 2 * _attention_batch(d, index) * (4 * e + 3 * ev)
    if op.window is not None and e == ev and op.parts != ("mask",):  # by blocks over their bands
        return per * band_pairs(0, q.shape[-2], op.window, k.shape[-2])
    # causal: torch's fused backward skips the tiles above the diagonal; a window elsewhere (the
    # math kernel, a mask's gradient) is a mask over every pair
    n = per * q.shape[-2] * k.shape[-2]
    return n // 2 if op.causal and op.window is None else n


def _sparse_einsum_flops(d: Decomposition, op: SparseEinsum, index: tuple[int, ...]) -> int:
    # the whole op's share of the block along the dims its dense inputs are cut by; along the
    # sparse operand's own dims an operand with einsum_within (a constant, or one fed at run)
    # computes only its entries in the kernel's box (modelled as spread evenly), another the whole op
    n = sparse_flops(d.node)
    rows = hasattr(op.operand, "einsum_within")
    for o, f in enumerate(followed_dims(d.node)):
        size = d.node.shape[o]
        if (f or (rows and op.out_labels[o] in op.in_labels[op.position])) and size:
            b = d.out_partition.bounds[o]
            n = n * (b[index[o] + 1] - b[index[o]]) // size
    return n


def _no_flops(d: Decomposition, op: object, index: tuple[int, ...]) -> int:
    return 0  # modelled as free: moves, cuts, casts, fills and fed inputs


# modelled flops of one kernel of each node kind: (decomposition, its op, kernel index) -> flops
FLOPS_RULES: dict[type, Callable[[Decomposition, Any, tuple[int, ...]], int]] = {
    Input: _no_flops,
    Einsum: _einsum_flops,
    Reshape: _no_flops,
    Broadcast: _no_flops,
    Select: _no_flops,
    Concat: _no_flops,
    Fill: _no_flops,
    Gather: _no_flops,
    ScatterAdd: _scatter_add_flops,
    Cast: _no_flops,
    RotateHalf: _no_flops,
    Conv: _conv_flops,
    Pool: _pool_flops,
    TopK: _topk_flops,
    Attention: _attention_flops,
    AttentionGrad: _attention_grad_flops,
    SparseEinsum: _sparse_einsum_flops,
}
