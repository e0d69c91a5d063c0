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

from math import prod

from einjoin.decomp.decompose import Decomposition
from einjoin.ir.dtypes import itemsize
from einjoin.ir.kernels import partial_dtype
from einjoin.ir.node import Einsum, Fill, Input
from einjoin.ir.scalar import is_product

__all__ = ["kernel_scratch", "op_need", "MAX_KERNELS"]

MAX_KERNELS = 4096  # per op when cutting for a cap: beyond this, per-task overhead dwarfs the kernels


def kernel_scratch(d: Decomposition, kernel: int, in_bytes: list[int], out_bytes: int) -> int:
    """Bytes a block kernel allocates besides its output (an upper estimate, mirroring
    :func:`einjoin.ir.kernels.einsum_kernel`): a two-input contraction copies an operand only when
    its labels are not already in matmul order, and its result when the output order differs;
    other contractions (opt_einsum's pairwise path) may copy all of them; any other join
    materialises the joined block and one temporary of that size. Half-precision inputs are
    widened to float32 first (a copy of twice their bytes)."""
    op = d.node.op
    if not isinstance(op, Einsum):
        return 0  # blocks are C-contiguous under a cap: reshapes and slices are views (then copied)
    half = ("float16", "bfloat16")
    widen = sum(2 * b for b, x in zip(in_bytes, d.node.inputs) if x.dtype in half)
    # a half op's partial sums are written in float32 (partial_dtype): no result to cast
    wide_out = d.n_partials > 1 and partial_dtype(d.node) != d.node.dtype
    if (widen or d.node.dtype in half) and not wide_out:
        widen += 2 * out_bytes  # the float32 result before its cast
    if is_product(op.join, len(d.node.inputs)) and op.agg.name in ("sum", "none"):
        if len(op.in_labels) == 2 and all(x.dtype.startswith(("float", "bfloat")) for x in d.node.inputs):
            return widen + _matmul_copies(op, in_bytes, out_bytes)
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


def _matmul_copies(op: Einsum, in_bytes: list[int], out_bytes: int) -> int:
    """The copies of the (batch, m, k) x (batch, k, n) matmul route: an operand whose labels are
    out of that order, a summed-out label (its partial sum), and a result out of output order."""
    (lx, ly), out = op.in_labels, op.out_labels
    if len(set(lx)) != len(lx) or len(set(ly)) != len(ly):
        return 2 * (sum(in_bytes) + out_bytes)
    sx, sy, so = set(lx), set(ly), set(out)
    extra = 0
    if sx - sy - so:
        extra += in_bytes[0]
        lx = tuple(lab for lab in lx if lab in sy or lab in so)
    if sy - sx - so:
        extra += in_bytes[1]
        ly = tuple(lab for lab in ly if lab in sx or lab in so)
    sx, sy = set(lx), set(ly)
    batch = [lab for lab in out if lab in sx and lab in sy]
    m = [lab for lab in out if lab in sx and lab not in sy]
    n = [lab for lab in out if lab in sy and lab not in sx]
    k = [lab for lab in lx if lab in sy and lab not in so]
    if list(lx) != batch + m + k:
        extra += in_bytes[0]
    if list(ly) != batch + k + n:
        extra += in_bytes[1]
    if batch + m + n != list(out):
        extra += out_bytes  # the matmul result, before the C-order copy that is the output
    return extra



def op_need(d: Decomposition) -> int:
    """Bytes the largest kernel of ``d`` holds at once (its input blocks, its output block, its
    scratch), or one accumulating aggregation step (an accumulator, a partial, the result).
    Partial results count at :func:`~einjoin.ir.kernels.partial_dtype` (float32 for a
    half-precision sum), as the task graph holds them."""
    node = d.node
    out_item = itemsize(node.dtype)
    if isinstance(node.op, (Input, Fill)):
        return max(prod(d.out_partition.block_shape(k)) * out_item for k in d.out_partition.keys())
    part_item = itemsize(partial_dtype(node)) if d.n_partials > 1 else out_item
    worst = 0
    for i, k in enumerate(d.kernels):
        ins = [prod(d.in_partitions[s].block_shape(key)) * itemsize(x.dtype)
               for s, (x, key) in enumerate(zip(node.inputs, k.in_keys)) if key is not None]
        out = prod(d.out_partition.block_shape(k.out_key)) * part_item
        worst = max(worst, sum(ins) + out + kernel_scratch(d, i, ins, out))
        if d.n_partials > 1:
            worst = max(worst, 3 * out)  # one accumulating step (see memplan.chain)
    return worst
