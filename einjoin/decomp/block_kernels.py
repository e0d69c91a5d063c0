"""Running one kernel of a decomposition on numpy blocks.

The block kernel of every op is the op itself on smaller shapes (plus the block's position where
the op needs it: a fill's corner, a gather block's first table row)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from einjoin.decomp.decompose import Decomposition, Kernel, reshape_region
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.kernels import broadcast_kernel, einsum_kernel, fill_kernel, gather_kernel, partial_dtype
from einjoin.ir.node import Broadcast, Cast, Concat, Einsum, Fill, Gather, Input, Reshape, Select

__all__ = ["run_kernel"]


def run_kernel(d: Decomposition, k: Kernel, blocks: Sequence[np.ndarray | None]) -> np.ndarray:
    """The output block (or partial result) of kernel ``k``; ``blocks[i]`` is the block of input
    ``i`` named by ``k.in_keys[i]`` (None where the kernel reads nothing of that input). Partial
    results come in :func:`~einjoin.ir.kernels.partial_dtype` (float32 for a half-precision sum:
    the cast to the op's dtype waits for the last aggregation step)."""
    node = d.node
    op = node.op
    box = d.out_partition.box(k.out_key)
    shape = tuple(b - a for a, b in box)
    if isinstance(op, Einsum):
        dtype = partial_dtype(node) if d.n_partials > 1 else node.dtype
        return einsum_kernel(op, blocks, dtype)  # type: ignore[arg-type]
    if isinstance(op, Fill):
        return fill_kernel(op.expr, [a for a, _ in box], shape, node.dtype)
    if isinstance(op, Cast):
        return np.asarray(blocks[0]).astype(numpy_dtype(node.dtype))
    if isinstance(op, Select):
        return blocks[0]  # type: ignore[return-value]  # the input was cut at the block's edges
    if isinstance(op, Broadcast):
        return broadcast_kernel(blocks[0], shape, op.dims)  # type: ignore[arg-type]
    if isinstance(op, Concat):
        return np.concatenate([b for b in blocks if b is not None], axis=op.axis)
    if isinstance(op, Reshape):
        region = reshape_region(node, d.in_partitions[0], box)
        x = np.reshape(blocks[0], tuple(b - a for a, b in region))
        return x[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region))]
    if isinstance(op, Gather):
        table_part = d.in_partitions[0]
        r = k.in_keys[0][0]  # type: ignore[index]
        return gather_kernel(blocks[0], blocks[1], table_part.bounds[0][r],  # type: ignore[arg-type]
                             node.inputs[0].shape[0])
    if isinstance(op, Input):
        raise AssertionError("inputs are fed, not computed")  # pragma: no cover
    raise AssertionError(f"no block kernel for {op!r}")  # pragma: no cover
