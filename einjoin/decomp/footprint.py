"""What one block kernel holds in memory at once: its input blocks, its output block and its
scratch (a materialised joined block, an operand transposed for the matmul route). Plans are
sized from shapes alone, so both the optimizer (choosing specs for devices with a memory cap) and
the memory planner (which must never exceed the cap) use these estimates.

>>> import einjoin as ej
>>> from einjoin.decomp.footprint import op_need
>>> z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
>>> op_need(ej.decompose(z.node, {"m": 2}))   # a's 32x32 block, b, the 32x16 result (float32)
8192
"""

from __future__ import annotations

import itertools
from math import prod
from typing import Any
from collections.abc import Callable

from einjoin.decomp.decompose import Decomposition
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import MatmulRoute, matmul_route, partial_dtype
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.sparse_einsum import followed_dims, operand_box
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf

__all__ = ["kernel_scratch", "op_need", "SCRATCH_RULES", "ScratchRule", "KERNEL_CLASS_RULES"]



def kernel_scratch(d: Decomposition, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    """Bytes a block kernel allocates besides its output (an upper estimate), by its kind's rule in
    :data:`SCRATCH_RULES`. Blocks are C-contiguous under a cap, so reshapes and slices are views
    (then copied into the output): only an einsum and a scatter-add have scratch."""
    rule = rule_for(SCRATCH_RULES, d.node.op, "the kernel scratch estimates (einjoin.decomp.footprint.SCRATCH_RULES)")
    return rule(d, d.node.op, kernel, in_bytes, out_bytes)


def _einsum_scratch(d: Decomposition, op: Einsum, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    """An einsum kernel's scratch along the code path :func:`~einjoin.ir.kernels.matmul_route`
    names (the same decision :func:`~einjoin.ir.kernels.einsum_kernel` follows): the matmul route
    copies an operand only when its labels are not already in matmul order, and its result when
    the output order differs; opt_einsum's pairwise path may copy all of them; a join materialises
    the joined block and one temporary of that size. Half-precision inputs are widened to float32
    first (a copy of twice their bytes)."""
    half = ("float16", "bfloat16")
    widen = sum(2 * b for b, x in zip(in_bytes, d.node.inputs) if x.dtype in half)
    # a half op's partial sums are written in float32 (partial_dtype): no result to cast
    wide_out = d.n_partials > 1 and partial_dtype(d.node) != d.node.dtype
    if (widen or d.node.dtype in half) and not wide_out:
        widen += 2 * out_bytes  # the float32 result before its cast
    route = matmul_route(op, [x.dtype for x in d.node.inputs])
    if route.path == "matmul":
        # it transposes the widened (float32) copies of half inputs, and np.matmul computes in
        # the wider of the two types (casting the narrower operand whole): copies and result
        # are as wide as those
        widths = [max(4, itemsize(x.dtype)) if x.dtype in half else itemsize(x.dtype)
                  for x in d.node.inputs]
        wide = max(widths)
        elems = [b // itemsize(x.dtype) for b, x in zip(in_bytes, d.node.inputs)]
        cast = sum(e * wide for e, w in zip(elems, widths) if w < wide)
        res_item = itemsize(partial_dtype(d.node) if wide_out else d.node.dtype)
        wide_res = out_bytes // res_item * wide
        return widen + cast + _matmul_copies(route, [e * w for e, w in zip(elems, widths)], wide_res)
    if route.path in ("einsum", "diagonal"):
        return widen + 2 * (sum(in_bytes) + out_bytes)
    k = d.kernels[kernel]
    joined = 1
    for lab, bounds in zip(d.spec.labels, d.spec.bounds):
        i = k.index[d.spec.labels.index(lab)]
        joined *= bounds[i + 1] - bounds[i]
    width = max([itemsize(x.dtype) for x in d.node.inputs] + [itemsize(d.node.dtype)])
    if any(x.dtype in half for x in d.node.inputs):
        width = max(width, 4)  # the join runs on the widened (float32) inputs
    return widen + 2 * joined * width


def _matmul_copies(route: MatmulRoute, in_bytes: list[int], out_bytes: int) -> int:
    """The copies of the (batch, m, k) x (batch, k, n) matmul route: an operand whose labels are
    out of that order, a summed-out label (its partial sum), and a result out of output order."""
    extra = 0
    if route.x_sum:
        extra += in_bytes[0]
    if route.y_sum:
        extra += in_bytes[1]
    if route.copy_x:
        extra += in_bytes[0]
    if route.copy_y:
        extra += in_bytes[1]
    if route.copy_out:
        extra += out_bytes  # the matmul result, before the C-order copy that is the output
    return extra


_ADD_AT_BUFFER = 8192  # np.add.at iterates through a small buffer of its own (measured: ~6 KB)


def _scatter_add_scratch(d: Decomposition, op: ScatterAdd, kernel: int, in_bytes: list[int],
                         out_bytes: int) -> int:
    """:func:`~einjoin.ir.kernels.scatter_add_kernel`'s copies: half updates widened to float32
    (twice their bytes); with the rows cut, the updates and indices whose index falls in the
    block (at most all of them) and the mask; the float32 accumulator of a half output that is
    no partial (partials stay float32: no cast); ``np.add.at``'s own buffer (a few KiB); with rows,
    the index arrays and a round's rows of ``kernels._add_rounds``."""
    upd, idx = in_bytes
    half = d.node.dtype in ("float16", "bfloat16")
    wide = 2 * upd if half else upd
    scratch = _ADD_AT_BUFFER + (wide if half else 0)
    if len(d.node.shape) > 1:  # rows added in rounds (kernels._add_rounds): index arrays, a round's rows twice
        scratch += 6 * idx + 2 * wide
    if len(d.out_partition.bounds[0]) > 2:
        scratch += wide + 3 * idx  # the picked updates and indices, shifted, and the masks
    if half and d.n_partials == 1:
        scratch += 2 * out_bytes
    return scratch


def _conv_scratch(d: Decomposition, op: Conv, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    return _window_scratch(d, kernel, in_bytes, prod(op.lhs_dilation), prod(d.node.inputs[1].shape[1:]))


def _pool_scratch(d: Decomposition, op: Pool, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    return _window_scratch(d, kernel, in_bytes, 1, prod(op.window))


def _window_scratch(d: Decomposition, kernel: int, in_bytes: list[int], grow: int, window: int) -> int:
    """:func:`~einjoin.ir.kernels.conv_kernel` / ``pool_kernel``'s copies: half inputs widened to
    float32, the input block dilated and padded (up to ``lhs_dilation`` times its size plus the
    window), torch's im2col buffer (input channels x kernel positions x output positions), and
    torch's result before the cast."""
    k = d.kernels[kernel]
    half = d.node.dtype in ("float16", "bfloat16")
    width = 4 if half else itemsize(d.node.dtype)
    x_elems = in_bytes[0] // itemsize(d.node.dtype)
    out_elems = prod(d.out_partition.block_shape(k.out_key))
    per_out = out_elems // max(1, d.out_partition.block_shape(k.out_key)[1])  # one channel's positions
    widen = sum(in_bytes) * 2 if half else 0
    arranged = 2 * x_elems * grow * width
    return widen + arranged + per_out * window * width + out_elems * width


def _topk_scratch(d: Decomposition, op: TopK, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    """:func:`~einjoin.ir.kernels.topk_kernel`'s copies: the sorted values and int64 order of the
    whole rows it reads (torch's sort), half inputs widened to float32 first."""
    elems = in_bytes[0] // itemsize(d.node.inputs[0].dtype)
    width = max(4, itemsize(d.node.inputs[0].dtype))
    return elems * (2 * width + 8)


def _math_scores(d: Decomposition, rows: int, copies: int) -> int:
    """``copies`` (rows, S) score matrices where the kernel is torch's math sdpa (a value size other
    than E: it materialises the weights; float32 or wider, as an upper estimate), else 0."""
    q, k, v = d.node.inputs[:3]
    if q.shape[-1] == v.shape[-1] or (q.shape[-1] == 0 and v.shape[-1] == 1):
        return 0
    return copies * rows * k.shape[-2] * max(4, itemsize(q.dtype))


def _attention_scratch(d: Decomposition, op: Attention, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    """torch's flash kernel: float32 accumulators of its output rows (and their log-sum-exp), and
    a bool mask made additive (or a causal mask below the first row) of the block's scores; torch's
    math kernel (``Ev != E``) holds the scores and their softmax besides. A cut of the value dim
    reads v whole: the kernel computes its rows at full width, then copies its columns out."""
    q, k = d.node.inputs[:2]
    block = d.out_partition.block_shape(d.kernels[kernel].out_key)
    rows = prod(block[:-1])  # the block's batch x query rows (from its shape: the value dim may be cut)
    full = rows * d.node.shape[-1]
    whole = full * itemsize(d.node.dtype) if block[-1] < d.node.shape[-1] else 0
    masked = len(d.node.inputs) > 3 or op.causal
    return (4 * (full + rows) + whole + (rows * k.shape[-2] * itemsize(q.dtype) if masked else 0)
            + _math_scores(d, rows, 2))


def _attention_grad_scratch(d: Decomposition, op: AttentionGrad, kernel: int, in_bytes: list[int],
                            out_bytes: int) -> int:
    """The recomputed forward (output, log-sum-exp), the three gradients before they are stacked
    (float32 accumulators), and an additive mask, as :func:`_attention_scratch`; autograd of torch's
    math kernel (``Ev != E``, a mask's gradient) holds the weights, their gradient, the scores'
    gradient and the expanded mask, (rows, S) each."""
    q, k = d.node.inputs[:2]
    rows = in_bytes[0] // max(1, itemsize(q.dtype) * q.shape[-1])
    mask = rows * k.shape[-2] * itemsize(q.dtype) if len(d.node.inputs) > 4 else 0
    math = _math_scores(d, rows, 4)
    if op.parts == ("mask",) and not math:
        math = 4 * rows * k.shape[-2] * max(4, itemsize(q.dtype))
    return 2 * sum(in_bytes[:4]) + 4 * rows + out_bytes + mask + math


def _sparse_einsum_scratch(d: Decomposition, op: SparseEinsum, kernel: int, in_bytes: list[int],
                           out_bytes: int) -> int:
    """The whole output (a cut kernel keeps its box of it) and the engine's joined relations, at
    most an input's bytes again each (its per-run copies: a dense operand gathered per tuple),
    and a constant operand's stored entries (keys and values) in the kernel's rows, never its
    dense size (``stored_bytes``; a fed operand's keys and values are input blocks, counted)."""
    box = d.out_partition.box(d.kernels[kernel].out_key)
    follow = followed_dims(d.node)  # there the engine's result is the block already
    whole = prod(b - a if f else n for f, (a, b), n in zip(follow, box, d.node.shape)) * itemsize(d.node.dtype)
    stored = getattr(op.operand, "stored_bytes", None)
    held = int(stored(operand_box(d.node, box))) if stored is not None else 0
    return (whole if whole > out_bytes else 0) + sum(in_bytes) + held


def _no_scratch(d: Decomposition, op: object, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    return 0


# scratch bytes of one block kernel of each node kind, besides its output:
# (decomposition, its op, kernel number, input block bytes, output block bytes) -> bytes
ScratchRule = Callable[[Decomposition, Any, int, list[int], int], int]
SCRATCH_RULES: dict[type, ScratchRule] = {
    Input: _no_scratch,
    Einsum: _einsum_scratch,
    Reshape: _no_scratch,
    Broadcast: _no_scratch,
    Select: _no_scratch,
    Concat: _no_scratch,
    Fill: _no_scratch,
    Gather: _no_scratch,
    ScatterAdd: _scatter_add_scratch,
    Cast: _no_scratch,
    Conv: _conv_scratch,
    Pool: _pool_scratch,
    TopK: _topk_scratch,
    RotateHalf: _no_scratch,
    Attention: _attention_scratch,
    AttentionGrad: _attention_grad_scratch,
    SparseEinsum: _sparse_einsum_scratch,
}


def _label_product(d: Decomposition) -> list[int] | None:
    # the kinds whose kernels are every combination of their labels' blocks, in product order, and
    # whose blocks' shapes follow the kernel's labels' extents (an einsum's inputs and output are
    # cut by its labels' bounds; a cast's, a select's and a broadcast's input block is the output
    # block's shape, a broadcast dim 1): one kernel per combination of distinct extents stands for
    # all (at most 2 ** labels on an even cut, instead of thousands)
    counts = [len(b) - 1 for b in d.spec.bounds]
    if len(d.kernels) != prod(counts):
        return None
    firsts = []
    for b in d.spec.bounds:
        first: dict[int, int] = {}
        for j in range(len(b) - 1):
            first.setdefault(b[j + 1] - b[j], j)
        firsts.append(sorted(first.values()))
    reps = []
    for index in itertools.product(*firsts):
        flat = 0
        for j, c in zip(index, counts):
            flat = flat * c + j
        if d.kernels[flat].index != index:
            return None
        reps.append(flat)
    return reps


def _every_kernel(d: Decomposition) -> list[int] | None:
    return None


KERNEL_CLASS_RULES: dict[type, Callable[[Decomposition], list[int] | None]] = {
    Input: _every_kernel,
    Einsum: _label_product,
    Reshape: _every_kernel,
    Broadcast: _label_product,
    Select: _label_product,
    Concat: _every_kernel,
    Fill: _every_kernel,
    Gather: _every_kernel,
    ScatterAdd: _every_kernel,
    Cast: _label_product,
    Conv: _every_kernel,
    Pool: _every_kernel,
    TopK: _every_kernel,
    RotateHalf: _every_kernel,
    Attention: _every_kernel,
    AttentionGrad: _every_kernel,
    SparseEinsum: _every_kernel,
}
"""Per node kind, the kernels of a decomposition that :func:`op_need` weighs (one of each class
of kernels that hold alike), or None: every kernel (it skips those alike as it goes)."""


def op_need(d: Decomposition) -> int:
    """Bytes the largest kernel of ``d`` holds at once (its input blocks, its output block, its
    scratch), or one accumulating aggregation step (an accumulator, a partial, the result).
    Partial results count at :func:`~einjoin.ir.kernels.partial_dtype` (float32 for a
    half-precision sum), as the task graph holds them."""
    node = d.node
    out_item = itemsize(node.dtype)
    if node.facts.leaf:  # received or computed whole per block: its blocks, no kernel
        return max(prod(d.out_partition.block_shape(k)) * out_item for k in d.out_partition.keys())
    part_item = itemsize(partial_dtype(node)) if d.n_partials > 1 else out_item
    items = [itemsize(x.dtype) for x in node.inputs]
    parts = d.in_partitions
    # block keys repeat across kernels (a weight block read by a whole row of them): each key's
    # shape and bytes once per slot, each label's block extents once (fitting weighs thousands of
    # kernels per candidate spec, 13M block_shape calls for LLaMA-70B on 256 devices)
    blocks: list[dict[Any, tuple[tuple[int, ...], int]]] = [{} for _ in node.inputs]
    outs: dict[Any, tuple[int, ...]] = {}
    widths = [tuple(b[j + 1] - b[j] for j in range(len(b) - 1)) for b in d.spec.bounds]
    worst = 0
    seen: set[tuple[Any, ...]] = set()
    reps = rule_for(KERNEL_CLASS_RULES, node.op, "the kernel classes (einjoin.decomp.footprint.KERNEL_CLASS_RULES)")(d)
    for i in range(len(d.kernels)) if reps is None else reps:
        k = d.kernels[i]
        ins, shapes = [], []
        for s, key in enumerate(k.in_keys):
            if key is None:
                continue
            got = blocks[s].get(key)
            if got is None:
                shape = parts[s].block_shape(key)
                got = blocks[s][key] = (shape, prod(shape) * items[s])
            shapes.append(got[0])
            ins.append(got[1])
        out_shape = outs.get(k.out_key)
        if out_shape is None:
            out_shape = outs[k.out_key] = d.out_partition.block_shape(k.out_key)
        # a scratch rule reads only the kernel's block bytes and shapes and its labels' extents:
        # kernels alike in those hold alike (an even cut has one such class)
        sig = (tuple(ins), out_shape, tuple(w[j] for w, j in zip(widths, k.index)), tuple(shapes))
        if sig in seen:
            continue
        seen.add(sig)
        out = prod(out_shape) * part_item
        worst = max(worst, sum(ins) + out + kernel_scratch(d, i, ins, out))
        if d.n_partials > 1:
            worst = max(worst, 3 * out)  # one accumulating step (see memplan.chain)
    return worst
