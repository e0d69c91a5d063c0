"""Running one kernel of a decomposition on numpy blocks.

The block kernel of every op is the op itself on smaller shapes (plus the block's position where
the op needs it: a fill's corner, a gather block's first table row, a scatter-add block's rows)."""

from __future__ import annotations

from typing import Any, cast
from collections.abc import Callable, Sequence

import numpy as np

from einjoin.decomp.decompose import Decomposition, Kernel, reshape_region
from einjoin.decomp.partition import Box, box_shape
from einjoin.ir.dtypes import cast_array
from einjoin.ir.kernels import (broadcast_kernel, conv_kernel, einsum_kernel, fill_kernel, gather_kernel,
                                partial_dtype, pool_kernel, scatter_add_kernel, topk_kernel)
from einjoin.ir.node import Attention, AttentionGrad, RotateHalf, SparseEinsum
from einjoin.ir.rotate import rotate_half_block
from einjoin.ir.sparse_einsum import sparse_block
from einjoin.ir.attention import attention_grad_kernel, attention_kernel
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.window import local_padding

__all__ = ["run_kernel", "BLOCK_KERNELS", "BlockKernel"]


def run_kernel(d: Decomposition, k: Kernel, blocks: Sequence[np.ndarray | None]) -> np.ndarray:
    """The output block (or partial result) of kernel ``k``; ``blocks[i]`` is the block of input
    ``i`` named by ``k.in_keys[i]`` (None where the kernel reads nothing of that input). Partial
    results come in :func:`~einjoin.ir.kernels.partial_dtype` (float32 for a half-precision sum:
    the cast to the op's dtype waits for the last aggregation step)."""
    box = d.out_partition.box(k.out_key)
    rule = rule_for(BLOCK_KERNELS, d.node.op, "the block kernels (einjoin.decomp.block_kernels.BLOCK_KERNELS)")
    return rule(d, d.node.op, k, blocks, box)


_Blocks = Sequence[Any]  # np.ndarray | None, one per input


def _input_block(d: Decomposition, op: Input, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    raise AssertionError("inputs are fed, not computed")  # pragma: no cover


def _einsum_block(d: Decomposition, op: Einsum, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    dtype = partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype
    return einsum_kernel(op, blocks, dtype)


def _fill_block(d: Decomposition, op: Fill, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return fill_kernel(op.expr, [a for a, _ in box], box_shape(box), d.node.dtype)


def _cast_block(d: Decomposition, op: Cast, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return cast_array(blocks[0], d.node.dtype)  # floats into ints as torch (ir.kernels' cast too)


def _select_block(d: Decomposition, op: Select, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return cast(np.ndarray, blocks[0])  # the input was cut at the block's edges


def _broadcast_block(d: Decomposition, op: Broadcast, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return broadcast_kernel(blocks[0], box_shape(box), op.dims)


def _concat_block(d: Decomposition, op: Concat, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return np.concatenate([b for b in blocks if b is not None], axis=op.axis)


def _reshape_block(d: Decomposition, op: Reshape, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    region = reshape_region(d.node, d.in_partitions[0].core, box)  # (a reshape's is a Partition)
    x = np.reshape(blocks[0], tuple(b - a for a, b in region))
    return x[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region))]


def _gather_block(d: Decomposition, op: Gather, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    table_part = d.in_partitions[0]
    table_key = k.in_keys[0]
    assert table_key is not None
    return gather_kernel(blocks[0], blocks[1], table_part.bounds[0][table_key[0]],
                         d.node.inputs[0].shape[0])


def _scatter_add_block(d: Decomposition, op: ScatterAdd, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    # the output block's rows [start, stop): updates indexed elsewhere belong to other blocks
    (start, stop) = box[0]
    dtype = partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype
    return scatter_add_kernel(blocks[0], blocks[1], start, stop - start, d.node.shape[0], dtype)


def _conv_block(d: Decomposition, op: Conv, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    """The conv itself on the blocks, with the padding that makes the input block (its rows and
    halo) give exactly the output block; a block of output channels that cuts a group is
    computed with the group's missing rows of the weight as zeros, then sliced."""
    x_key, w_key = k.in_keys
    assert x_key is not None and w_key is not None
    xbox = d.in_partitions[0].box(x_key)
    x, w = np.asarray(blocks[0]), np.asarray(blocks[1])
    kernel = d.node.inputs[1].shape[2:]
    pads = tuple(local_padding(a, b - a, o0, o1, kk, s, lo, ld, rd) for (a, b), (o0, o1), kk, s, (lo, _), ld, rd
                 in zip(xbox[2:], box[2:], kernel, op.stride, op.padding, op.lhs_dilation, op.rhs_dilation))
    groups, first = 1, 0
    if op.groups > 1:
        og, cg = d.node.inputs[1].shape[0] // op.groups, d.node.inputs[1].shape[1]
        g0, groups = xbox[1][0] // cg, (xbox[1][1] - xbox[1][0]) // cg
        first = box[1][0] - g0 * og
        if first or w.shape[0] != groups * og:
            full = np.zeros((groups * og,) + w.shape[1:], w.dtype)
            full[first:first + w.shape[0]] = w
            w = full
    dtype = partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype
    out = conv_kernel(x, w, Conv(op.stride, pads, op.lhs_dilation, op.rhs_dilation, groups), dtype)
    if out.shape[1] != box[1][1] - box[1][0]:
        out = np.ascontiguousarray(out[:, first:first + box[1][1] - box[1][0]])
    return out


def _pool_block(d: Decomposition, op: Pool, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    x_key = k.in_keys[0]
    assert x_key is not None
    xbox = d.in_partitions[0].box(x_key)
    pads = tuple(local_padding(a, b - a, o0, o1, kk, s, lo, 1, dil) for (a, b), (o0, o1), kk, s, (lo, _), dil
                 in zip(xbox[2:], box[2:], op.window, op.stride, op.padding, op.dilation))
    out = pool_kernel(np.asarray(blocks[0]), Pool(op.agg, op.window, op.stride, pads, op.dilation),
                      d.node.dtype)
    first = box[1][0] - xbox[1][0] * (out.shape[1] // max(1, xbox[1][1] - xbox[1][0]))
    if op.agg.name == "none" and (first or out.shape[1] != box[1][1] - box[1][0]):
        # the block starts or ends within a channel's windows
        out = np.ascontiguousarray(out[:, first:first + box[1][1] - box[1][0]])
    return out


def _topk_block(d: Decomposition, op: TopK, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    start, stop = box[op.axis]  # its range of the order, from whole rows
    return topk_kernel(np.asarray(blocks[0]), op, start, stop)


def _attention_block(d: Decomposition, op: Attention, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    # a block of query rows (its first row places the causal diagonal) over its keys (every key,
    # or causal: its band, from key col0); a cut of the value dim (v read whole) keeps its columns
    nb = d.node.ndim - 2
    key = k.in_keys[1]
    col0 = d.in_partitions[1].box(key)[nb][0] if key is not None else 0
    out = attention_kernel(blocks[0], blocks[1], blocks[2], blocks[3] if len(blocks) > 3 else None,
                           op.scale, op.causal, box[nb][0], op.window, col0)
    lo, hi = box[-1]
    return out if (lo, hi) == (0, out.shape[-1]) else np.ascontiguousarray(out[..., lo:hi])


def _attention_grad_block(d: Decomposition, op: AttentionGrad, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    # the gradients of a batch block, whole; a cut of the rows or the last dim keeps its box
    nb = d.node.ndim - 2
    out = attention_grad_kernel(blocks[0], blocks[1], blocks[2], blocks[3], blocks[4] if len(blocks) > 4 else None,
                                op.scale, op.causal, op.parts, op.window)
    cut = (slice(None),) * nb + tuple(slice(a, b) for a, b in box[nb:])
    if all((a, b) == (0, n) for (a, b), n in zip(box[nb:], out.shape[nb:])):
        return out
    return np.ascontiguousarray(out[cut])


def _sparse_einsum_block(d: Decomposition, op: SparseEinsum, k: Kernel, blocks: _Blocks, box: Box) -> np.ndarray:
    return sparse_block(d.node, op, blocks, box)  # the sparse engine on the whole inputs, cut to the box


# the block kernel of each node kind: (decomposition, its op, kernel, input blocks, output box)
# -> the output block or partial result
BlockKernel = Callable[[Decomposition, Any, Kernel, _Blocks, Box], np.ndarray]
BLOCK_KERNELS: dict[type, BlockKernel] = {
    Input: _input_block,
    Einsum: _einsum_block,
    Reshape: _reshape_block,
    Broadcast: _broadcast_block,
    Select: _select_block,
    Concat: _concat_block,
    Fill: _fill_block,
    Gather: _gather_block,
    ScatterAdd: _scatter_add_block,
    Cast: _cast_block,
    Conv: _conv_block,
    Pool: _pool_block,
    TopK: _topk_block,
    RotateHalf: rotate_half_block,  # whole rows along its axis, cut to the box
    Attention: _attention_block,
    AttentionGrad: _attention_grad_block,
    SparseEinsum: _sparse_einsum_block,
}
