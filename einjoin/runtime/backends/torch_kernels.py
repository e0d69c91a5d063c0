"""The block kernels of the torch backend: every node kind's kernel on torch tensors
(:data:`TORCH_KERNELS`, keyed by op class as :data:`einjoin.decomp.block_kernels.BLOCK_KERNELS`,
with the same signature and the same numbers up to floating-point rounding).

Numerics are the numpy kernels' (:mod:`einjoin.ir.kernels`), which are torch's: an einsum whose
inputs and output are one half type (float16, bfloat16) runs torch's own half-precision matmul,
which accumulates in float32 and rounds once; a half einsum whose partial results are float32
(:func:`einjoin.ir.kernels.partial_dtype`: its aggregated label is split) computes in float32, as
do joins and aggregations over half inputs (widened, computed, rounded once to the output dtype).
Contractions go through ``torch.matmul`` (two inputs, a batched matmul over the label groups of
:func:`einjoin.ir.kernels.matmul_route`) or ``torch.einsum`` (opt_einsum's contraction order);
join expressions are translated once into torch functions (:mod:`.torch_expr`).

>>> import torch
>>> from einjoin.ir import ops
>>> a = ops.input_node("a", (2, 3), "bfloat16"); b = ops.input_node("b", (3, 2), "bfloat16")
>>> z = ops.einsum_node([a, b], ("ij", "jk"), "ik", "mul", "sum")
>>> torch_einsum(z.op, [torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16)], "bfloat16")
tensor([[3., 3.],
        [3., 3.]], dtype=torch.bfloat16)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import opt_einsum  # type: ignore[import-untyped]
import torch
import torch.nn.functional as tf

from einjoin.decomp.decompose import Decomposition, Kernel, reshape_region
from einjoin.decomp.partition import Box, box_shape
from einjoin.errors import EinjoinError
from einjoin.ir.dtypes import kind
from einjoin.ir.attention import attention_grad_torch, attention_torch
from einjoin.ir.kernels import MatmulRoute, matmul_route, partial_dtype
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.sparse_einsum import sparse_block
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool, Reshape,
                             ScatterAdd, Select, TopK)
from einjoin.ir.node import RotateHalf
from einjoin.ir.rotate import rotate_half_block_torch
from einjoin.ir.window import dilated, local_padding, out_size
from einjoin.runtime.backends.torch_expr import compile_expr

__all__ = ["TORCH_KERNELS", "TORCH_DTYPES", "dtype_name", "torch_einsum", "fill_block", "combine", "TorchBlockKernel"]

# einjoin's dtype names (einjoin.ir.dtypes.DTYPES) as torch dtypes, and back
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_HALF = (torch.float16, torch.bfloat16)


def dtype_name(dt: torch.dtype) -> str:
    """einjoin's name of a torch dtype (a dtype einjoin has no name for is an EinjoinError)."""
    try:
        return _NAMES[dt]
    except KeyError:
        raise EinjoinError(f"torch dtype {dt} has no einjoin dtype; known: {', '.join(TORCH_DTYPES)}") from None


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in _HALF else x


# ---------------------------------------------------------------- einsum


def _align(x: torch.Tensor, labels: Sequence[str], order: Sequence[str]) -> torch.Tensor:
    """:func:`einjoin.ir.kernels.align` on a tensor: repeated labels become their diagonal, axes
    permuted to ``order``, absent labels size 1."""
    ls = list(labels)
    while len(set(ls)) < len(ls):
        a = next(i for i, lab in enumerate(ls) if ls.index(lab) != i)
        b = ls.index(ls[a])
        x = torch.diagonal(x, dim1=b, dim2=a)
        lab = ls[a]
        ls = [lab_ for j, lab_ in enumerate(ls) if j not in (a, b)] + [lab]
    perm = sorted(range(len(ls)), key=lambda j: order.index(ls[j]))
    x = x.permute(perm)
    present = {ls[j] for j in perm}
    it = iter(x.shape)
    return x.reshape(tuple(next(it) if lab in present else 1 for lab in order))


def _batched_matmul(r: MatmulRoute, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`einjoin.ir.kernels._batched_matmul` in torch: one ``torch.matmul`` over
    (batch, m, k) x (batch, k, n); labels only one input has are summed first."""
    if r.x_sum:
        x = x.sum(dim=r.x_sum)
    if r.y_sum:
        y = y.sum(dim=r.y_sum)
    lx, ly = r.x_labels, r.y_labels
    if not r.k:  # nothing contracted: one broadcast multiply
        return torch.mul(_align(x, lx, r.out_labels), _align(y, ly, r.out_labels))
    size = dict(zip(lx, x.shape)) | dict(zip(ly, y.shape))
    batch, m, nn, k = r.batch, r.m, r.n, r.k
    xm = x.permute([lx.index(lab) for lab in batch + m + k]).reshape(
        math.prod(size[lab] for lab in batch), math.prod(size[lab] for lab in m), math.prod(size[lab] for lab in k))
    ym = y.permute([ly.index(lab) for lab in batch + k + nn]).reshape(
        math.prod(size[lab] for lab in batch), math.prod(size[lab] for lab in k), math.prod(size[lab] for lab in nn))
    order = batch + m + nn
    z = torch.matmul(xm, ym).reshape([size[lab] for lab in order])
    return z.permute([order.index(lab) for lab in r.out_labels])


def _reduce(val: torch.Tensor, agg: str, n_out: int) -> torch.Tensor:
    """Aggregate ``val`` over its trailing dims after the first ``n_out`` (the aggregated labels
    come last in ``op.all_labels``), as numpy's ufunc ``reduce`` (bool sums and products count
    in int64)."""
    # the summed size spelled out: -1 is ambiguous when the kept dims hold no element
    flat = val.reshape(tuple(val.shape[:n_out]) + (math.prod(val.shape[n_out:]),))
    if agg == "sum":
        return flat.sum(dim=-1)
    if agg == "prod":
        return (flat.long() if flat.dtype == torch.bool else flat).prod(dim=-1)
    if flat.dtype == torch.bool:
        return flat.any(dim=-1) if agg == "max" else flat.all(dim=-1)
    return flat.amax(dim=-1) if agg == "max" else flat.amin(dim=-1)


def _equation(op: Einsum) -> str:
    sym = {lab: opt_einsum.get_symbol(i) for i, lab in enumerate(op.all_labels)}
    return ",".join("".join(sym[lab] for lab in ls) for ls in op.in_labels) + "->" + "".join(
        sym[lab] for lab in op.out_labels)


_ROUTES: dict[tuple[Einsum, tuple[torch.dtype, ...]], MatmulRoute] = {}


def torch_einsum(op: Einsum, xs: Sequence[torch.Tensor], out_dtype: str) -> torch.Tensor:
    """One einsum on (blocks of) its inputs, in ``out_dtype`` (see the module's numerics)."""
    tdt = TORCH_DTYPES[out_dtype]
    key = (op, tuple(x.dtype for x in xs))
    route = _ROUTES.get(key)
    if route is None:  # matmul_route reads numpy dtypes: looked up once per op and dtypes
        if len(_ROUTES) > 4096:
            _ROUTES.clear()
        route = _ROUTES[key] = matmul_route(op, [_NAMES[x.dtype] for x in xs])
    native = tdt in _HALF and all(x.dtype == tdt for x in xs)  # torch's half matmul: float32 accumulation
    if route.path == "matmul":
        out = _batched_matmul(route, *(xs if native else [_widen(x) for x in xs]))
    elif route.path in ("diagonal", "einsum"):
        ws = list(xs) if native else [_widen(x) for x in xs]
        out = torch.einsum(_equation(op), *ws)
    else:
        order = op.all_labels
        aligned = [_align(_widen(x), ls, order) for x, ls in zip(xs, op.in_labels)]
        full = tuple(min(s) if 0 in s else max(s)
                     for s in ([a.shape[d] for a in aligned] for d in range(len(order))))
        val = compile_expr(op.join)(aligned)
        if not isinstance(val, torch.Tensor):  # a join of constants only
            val = torch.tensor(val, device=xs[0].device if xs else None)
        if tuple(val.shape) != full:  # a join that ignores an input still ranges over its labels
            val = val.expand(full)
        n_out = len(op.out_labels)
        out = _reduce(val, op.agg.name, n_out) if len(order) > n_out else val
    return out.to(tdt).contiguous()


# ---------------------------------------------------------------- the other kinds


def fill_block(expr: Any, starts: Sequence[int], shape: Sequence[int], dtype: str,
               device: torch.device | str | None = None) -> torch.Tensor:
    """A fill's block with corner ``starts``: ``expr`` over the global index grid (float64 or
    int64 indices, as :func:`einjoin.ir.kernels.fill_kernel`)."""
    idx_dt = torch.float64 if kind(dtype) == "float" else torch.int64
    grids = [torch.arange(s, s + n, dtype=idx_dt, device=device).reshape(
        [n if j == d else 1 for j in range(len(shape))]) for d, (s, n) in enumerate(zip(starts, shape))]
    val = compile_expr(expr)(grids)
    if not isinstance(val, torch.Tensor):
        val = torch.tensor(val, device=device)
    return val.expand(tuple(shape)).to(TORCH_DTYPES[dtype]).contiguous()


def _check_rows(what: str, idx: torch.Tensor, n_rows: int, noun: str) -> None:
    if idx.numel():
        bad = (idx < 0) | (idx >= n_rows)
        if bool(bad.any()):
            raise EinjoinError(f"{what}: index {int(idx[bad].reshape(-1)[0])} out of range for {noun} of {n_rows} rows")


def _gather(table: torch.Tensor, idx: torch.Tensor, row_start: int, n_rows: int) -> torch.Tensor:
    _check_rows("gather", idx, n_rows, "a table")
    if row_start == 0 and len(table) == n_rows:
        return table[idx]
    local = idx - row_start
    inside = (local >= 0) & (local < len(table))
    out = table[torch.where(inside, local, torch.zeros_like(local))]
    out[~inside] = 0
    return out


def _scatter_add(updates: torch.Tensor, idx: torch.Tensor, row_start: int, block_rows: int, n_rows: int,
                 dtype: str) -> torch.Tensor:
    _check_rows("scatter_add", idx, n_rows, "an output")
    upd = _widen(updates)
    rest = tuple(upd.shape[idx.ndim:])
    flat_idx = idx.reshape(-1)
    flat_upd = upd.reshape((flat_idx.numel(),) + rest)
    if row_start != 0 or block_rows != n_rows:
        inside = (flat_idx >= row_start) & (flat_idx < row_start + block_rows)
        flat_idx, flat_upd = flat_idx[inside] - row_start, flat_upd[inside]
    out = torch.zeros((block_rows,) + rest, dtype=upd.dtype, device=upd.device)
    out.index_add_(0, flat_idx, flat_upd)
    return out.to(TORCH_DTYPES[dtype])


def _arrange(x: torch.Tensor, pads: Sequence[tuple[int, int]], ld: Sequence[int], fill: float) -> torch.Tensor:
    """:func:`einjoin.ir.kernels._arrange` on a tensor: spatial dims dilated by ``ld`` and padded
    by ``(lo, hi)`` (negative: cropped), new positions ``fill``."""
    if all(a == 1 for a in ld) and all(p == (0, 0) for p in pads):
        return x
    sizes = [max(0, lo + dilated(n, a) + hi) for n, (lo, hi), a in zip(x.shape[2:], pads, ld)]
    out = torch.full(tuple(x.shape[:2]) + tuple(sizes), fill, dtype=x.dtype, device=x.device)
    dst: list[slice] = [slice(None), slice(None)]
    src: list[slice] = [slice(None), slice(None)]
    for n, (lo, _), a, m in zip(x.shape[2:], pads, ld, sizes):
        j0 = max(0, -(lo // a))
        j1 = min(n, (m - 1 - lo) // a + 1) if m - 1 - lo >= 0 else 0
        if j1 <= j0:
            return out
        dst.append(slice(lo + a * j0, lo + a * (j1 - 1) + 1, a))
        src.append(slice(j0, j1))
    out[tuple(dst)] = x[tuple(src)]
    return out


def _conv(x: torch.Tensor, w: torch.Tensor, op: Conv, dtype: str) -> torch.Tensor:
    xs, ws = _widen(x), _widen(w)
    spatial = tuple(out_size(n, kk, s, lo, hi, a, b) for n, kk, s, (lo, hi), a, b in
                    zip(xs.shape[2:], ws.shape[2:], op.stride, op.padding, op.lhs_dilation, op.rhs_dilation))
    shape = (xs.shape[0], ws.shape[0]) + spatial
    if 0 in xs.shape or 0 in ws.shape or 0 in shape:  # a sum over nothing
        return torch.zeros(shape, dtype=TORCH_DTYPES[dtype], device=x.device)
    nd = xs.ndim - 2
    if all(a == 1 for a in op.lhs_dilation) and all(lo == hi >= 0 for lo, hi in op.padding):
        pad: Any = tuple(lo for lo, _ in op.padding)
    else:
        xs, pad = _arrange(xs, op.padding, op.lhs_dilation, 0.0), 0
    fn = (tf.conv1d, tf.conv2d, tf.conv3d)[nd - 1]
    out = fn(xs, ws.to(xs.dtype), None, op.stride, pad, op.rhs_dilation, op.groups)
    return out.to(TORCH_DTYPES[dtype]).contiguous()


def _pool(x: torch.Tensor, op: Pool, dtype: str) -> torch.Tensor:
    xs = _widen(x)
    nd = xs.ndim - 2
    spatial = tuple(out_size(n, kk, s, lo, hi, 1, dd) for n, kk, s, (lo, hi), dd in
                    zip(xs.shape[2:], op.window, op.stride, op.padding, op.dilation))
    kt = math.prod(op.window) if op.agg.name == "none" else 1
    tdt = TORCH_DTYPES[dtype]
    if 0 in xs.shape[:2] or 0 in spatial:
        return torch.zeros((xs.shape[0], xs.shape[1] * kt) + spatial, dtype=tdt, device=x.device)
    xs = _arrange(xs, op.padding, (1,) * nd, float(op.agg.identity or 0.0)).contiguous()
    if op.agg.name == "none":  # the windows, by strides: copied, never multiplied
        st = xs.stride()[2:]
        view = xs.as_strided(tuple(xs.shape[:2]) + tuple(op.window) + spatial,
                             tuple(xs.stride()[:2]) + tuple(d * s for d, s in zip(op.dilation, st))
                             + tuple(kk * s for kk, s in zip(op.stride, st)))
        return view.reshape((xs.shape[0], xs.shape[1] * kt) + spatial).to(tdt).contiguous()
    if op.agg.name == "max":
        out = (tf.max_pool1d, tf.max_pool2d, tf.max_pool3d)[nd - 1](xs, op.window, op.stride, 0, op.dilation)
    else:
        c = xs.shape[1]
        ones = torch.ones((c, 1) + tuple(op.window), dtype=xs.dtype, device=xs.device)
        out = (tf.conv1d, tf.conv2d, tf.conv3d)[nd - 1](xs, ones, None, op.stride, 0, op.dilation, c)
    return out.to(tdt).contiguous()


def _topk(x: torch.Tensor, op: TopK, start: int, stop: int) -> torch.Tensor:
    xs = _widen(x)
    if xs.shape[op.axis] == 0 or stop <= start:
        shape = list(xs.shape)
        shape[op.axis] = stop - start
        return torch.zeros(shape, dtype=torch.int64 if op.indices else x.dtype, device=x.device)
    _, order = torch.sort(xs, dim=op.axis, descending=op.largest, stable=True)
    idx = order.narrow(op.axis, start, stop - start)
    if op.indices:
        return idx.contiguous()
    return torch.take_along_dim(x, idx, dim=op.axis)


def combine(agg: str, acc: torch.Tensor, x: torch.Tensor) -> None:
    """``acc = agg(acc, x)`` in place (a reduce task's step over its partials)."""
    if agg == "sum":
        acc.add_(x) if acc.dtype != torch.bool else acc.logical_or_(x)
    elif agg == "prod":
        acc.mul_(x) if acc.dtype != torch.bool else acc.logical_and_(x)
    elif agg == "max":
        torch.maximum(acc, x, out=acc)
    elif agg == "min":
        torch.minimum(acc, x, out=acc)
    else:  # pragma: no cover - an aggregation without partials is never reduced
        raise AssertionError(f"no partials to combine for aggregation {agg!r}")


# ---------------------------------------------------------------- the table


_Blocks = Sequence[Any]  # torch.Tensor | None, one per input


def _input_block(d: Decomposition, op: Input, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    raise AssertionError("inputs are fed, not computed")  # pragma: no cover


def _einsum_block(d: Decomposition, op: Einsum, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    return torch_einsum(op, blocks, partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype)


def _fill_block(d: Decomposition, op: Fill, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    return fill_block(op.expr, [a for a, _ in box], box_shape(box), d.node.dtype)


def _cast_block(d: Decomposition, op: Cast, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    x: torch.Tensor = blocks[0]
    to = TORCH_DTYPES[d.node.dtype]
    if x.is_floating_point() and not to.is_floating_point and to != torch.bool:
        # as the numpy kernel (dtypes.cast_array): truncate into int32 / int64 (out of range, inf,
        # nan: its minimum, as torch's CPU conversion on any device), then wrap
        via = torch.int64 if to in (torch.int64, torch.uint8) else torch.int32
        f, lo = x.double(), float(torch.iinfo(via).min)
        x = torch.where((f > lo - 1) & (f < -lo), f, torch.full((), lo, dtype=f.dtype, device=f.device)).to(via)
    return x.to(to)


def _select_block(d: Decomposition, op: Select, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    out: torch.Tensor = blocks[0]  # the input was cut at the block's edges
    return out


def _broadcast_block(d: Decomposition, op: Broadcast, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    x: torch.Tensor = blocks[0]
    shape = box_shape(box)
    view = x.reshape([x.shape[op.dims.index(j)] if j in op.dims else 1 for j in range(len(shape))])
    return view.expand(tuple(shape))


def _concat_block(d: Decomposition, op: Concat, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    return torch.cat([b for b in blocks if b is not None], dim=op.axis)


def _reshape_block(d: Decomposition, op: Reshape, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    region = reshape_region(d.node, d.in_partitions[0].core, box)
    x: torch.Tensor = blocks[0].reshape(tuple(b - a for a, b in region))
    return x[tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region))]


def _gather_block(d: Decomposition, op: Gather, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    table_key = k.in_keys[0]
    assert table_key is not None
    return _gather(blocks[0], blocks[1], d.in_partitions[0].bounds[0][table_key[0]], d.node.inputs[0].shape[0])


def _scatter_add_block(d: Decomposition, op: ScatterAdd, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    (start, stop) = box[0]
    dtype = partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype
    return _scatter_add(blocks[0], blocks[1], start, stop - start, d.node.shape[0], dtype)


def _conv_block(d: Decomposition, op: Conv, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    """As :func:`einjoin.decomp.block_kernels._conv_block`: the conv on the blocks with the
    padding that gives exactly the output block; a block of output channels cutting a group
    computed with the group's missing weight rows as zeros, then sliced."""
    x_key, w_key = k.in_keys
    assert x_key is not None and w_key is not None
    xbox = d.in_partitions[0].box(x_key)
    x, w = blocks[0], blocks[1]
    kernel = d.node.inputs[1].shape[2:]
    pads = tuple(local_padding(a, b - a, o0, o1, kk, s, lo, ld, rd) for (a, b), (o0, o1), kk, s, (lo, _), ld, rd
                 in zip(xbox[2:], box[2:], kernel, op.stride, op.padding, op.lhs_dilation, op.rhs_dilation))
    groups, first = 1, 0
    if op.groups > 1:
        og, cg = d.node.inputs[1].shape[0] // op.groups, d.node.inputs[1].shape[1]
        g0, groups = xbox[1][0] // cg, (xbox[1][1] - xbox[1][0]) // cg
        first = box[1][0] - g0 * og
        if first or w.shape[0] != groups * og:
            full = torch.zeros((groups * og,) + tuple(w.shape[1:]), dtype=w.dtype, device=w.device)
            full[first:first + w.shape[0]] = w
            w = full
    dtype = partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype
    out = _conv(x, w, Conv(op.stride, pads, op.lhs_dilation, op.rhs_dilation, groups), dtype)
    if out.shape[1] != box[1][1] - box[1][0]:
        out = out[:, first:first + box[1][1] - box[1][0]].contiguous()
    return out


def _pool_block(d: Decomposition, op: Pool, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    x_key = k.in_keys[0]
    assert x_key is not None
    xbox = d.in_partitions[0].box(x_key)
    pads = tuple(local_padding(a, b - a, o0, o1, kk, s, lo, 1, dil) for (a, b), (o0, o1), kk, s, (lo, _), dil
                 in zip(xbox[2:], box[2:], op.window, op.stride, op.padding, op.dilation))
    out = _pool(blocks[0], Pool(op.agg, op.window, op.stride, pads, op.dilation), d.node.dtype)
    first = box[1][0] - xbox[1][0] * (out.shape[1] // max(1, xbox[1][1] - xbox[1][0]))
    if op.agg.name == "none" and (first or out.shape[1] != box[1][1] - box[1][0]):
        out = out[:, first:first + box[1][1] - box[1][0]].contiguous()
    return out


def _topk_block(d: Decomposition, op: TopK, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    start, stop = box[op.axis]
    return _topk(blocks[0], op, start, stop)


def _attention_block(d: Decomposition, op: Attention, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    # as decomp.block_kernels': a block of query rows (its first row places the causal diagonal)
    nb = d.node.ndim - 2
    key = k.in_keys[1]
    col0 = d.in_partitions[1].box(key)[nb][0] if key is not None else 0  # a causal block's band
    out: torch.Tensor = attention_torch(blocks[0], blocks[1], blocks[2], blocks[3] if len(blocks) > 3 else None,
                                        op.scale, op.causal, box[nb][0], op.window, col0)
    lo, hi = box[-1]
    return out if (lo, hi) == (0, out.shape[-1]) else out[..., lo:hi].contiguous()


def _attention_grad_block(d: Decomposition, op: AttentionGrad, k: Kernel, blocks: _Blocks, box: Box
                          ) -> torch.Tensor:
    nb = d.node.ndim - 2
    out: torch.Tensor = attention_grad_torch(blocks[0], blocks[1], blocks[2], blocks[3],
                                             blocks[4] if len(blocks) > 4 else None, op.scale, op.causal, op.parts,
                                             window=op.window)
    if all((a, b) == (0, n) for (a, b), n in zip(box[nb:], out.shape[nb:])):
        return out
    return out[(slice(None),) * nb + tuple(slice(a, b) for a, b in box[nb:])].contiguous()


def _sparse_einsum_block(d: Decomposition, op: SparseEinsum, k: Kernel, blocks: _Blocks, box: Box) -> torch.Tensor:
    # the sparse engine computes on numpy (zero-copy views of CPU tensors; half ones widened to float32)
    half = (torch.float16, torch.bfloat16)
    xs = [b.detach().to("cpu", torch.float32 if b.dtype in half else b.dtype).numpy() for b in blocks]
    out = torch.from_numpy(sparse_block(d.node, op, xs, box, widened=True))
    return out.to(blocks[0].device if blocks else "cpu", TORCH_DTYPES[d.node.dtype])


# the torch block kernel of each node kind: (decomposition, its op, kernel, input blocks as
# tensors, output box) -> the output block or partial result (a test checks it covers KINDS)
TorchBlockKernel = Callable[[Decomposition, Any, Kernel, _Blocks, Box], torch.Tensor]
TORCH_KERNELS: dict[type, TorchBlockKernel] = {
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
    RotateHalf: rotate_half_block_torch,
    Attention: _attention_block,
    AttentionGrad: _attention_grad_block,
    SparseEinsum: _sparse_einsum_block,
}
