"""(op, join-agg spec) -> block kernels. Pure: shapes in, plain data out; no arrays, no devices.

A :class:`Decomposition` says which partition the op's output comes in, which partition it needs
of each input, and for every kernel which input blocks it reads and which output block it adds
to. Output blocks with several kernels are aggregated from partial results with ``agg``.

>>> import einjoin as ej
>>> from einjoin.decomp import decompose
>>> z = ej.input("x", (8, 6)) @ ej.input("w", (6, 4))
>>> d = decompose(z.node, {"m": 2, "k": 3})
>>> len(d.kernels), d.n_partials, str(d.out_partition), [str(p) for p in d.in_partitions]
(6, 3, '(2, 1)', ['(2, 3)', '(3, 1)'])
>>> d.kernels[1]
Kernel(index=(0, 0, 1), out_key=(0, 0), in_keys=((0, 1), (1, 0)))
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from einjoin.decomp.partition import BlockKey, Covering, Partition, even_bounds
from einjoin.decomp.spec import ROW, SPATIAL, JoinAggSpec, as_node, conv_labels, dim_labels
from einjoin.ir.agg import AGGS, Agg
from einjoin.ir.attention import key_band
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.ir.sparse_einsum import dense_follows
from einjoin.ir.window import input_range

__all__ = ["Kernel", "Decomposition", "decompose", "DECOMPOSE_RULES", "DecomposeRule", "reshape_groups",
           "reshape_region"]


@dataclass(frozen=True)
class Kernel:
    """One block kernel: ``index`` is its block per label (in the spec's label order)."""

    index: tuple[int, ...]
    out_key: BlockKey
    in_keys: tuple[BlockKey | None, ...]  # None: the kernel reads nothing of that input


@dataclass(frozen=True)
class Decomposition:
    node: Node
    spec: JoinAggSpec
    out_partition: Partition
    in_partitions: tuple[Partition | Covering, ...]  # a Covering: boxes that overlap (a halo)
    kernels: tuple[Kernel, ...]
    n_partials: int  # kernels per output block (1: nothing to aggregate)
    agg: Agg

    @property
    def labels(self) -> tuple[str, ...]:
        return self.spec.labels


DecomposeRule = Callable[[Node, Any, JoinAggSpec], Decomposition]


def decompose(node: Node, spec: Any = None) -> Decomposition:
    """Decompose ``node`` under ``spec`` (see :meth:`JoinAggSpec.for_node`), by its kind's rule
    in :data:`DECOMPOSE_RULES`."""
    node = as_node(node, "decompose")
    js = JoinAggSpec.for_node(node, spec)
    rule = rule_for(DECOMPOSE_RULES, node.op, "the decompositions (einjoin.decomp.decompose.DECOMPOSE_RULES)")
    return rule(node, node.op, js)


# a kind without partial results: (node, its op, the output partition) -> (input partitions,
# one kernel per output block)
_Cut = Callable[[Node, Any, Partition], "tuple[tuple[Partition | Covering, ...], tuple[Kernel, ...]]"]


def _blockwise(cut: _Cut) -> DecomposeRule:
    """The decomposition rule of a kind whose kernels make whole output blocks (no partials)."""
    def rule(node: Node, op: Any, js: JoinAggSpec) -> Decomposition:
        out = js.partition(js.labels)  # its labels are its output dims (a, b, ...; a pool's n, c, p, ...)
        partitions, kernels = cut(node, op, out)
        return Decomposition(node, js, out, partitions, kernels, 1, AGGS["none"])
    return rule


def _leaf(node: Node, op: Any, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    # an input or a fill reads nothing: one kernel per block makes (or receives) it
    return (), tuple(Kernel(k, k, ()) for k in out.keys())


def _elementwise(node: Node, op: Any, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    return (out,), tuple(Kernel(k, k, (k,)) for k in out.keys())


def _einsum(node: Node, op: Einsum, js: JoinAggSpec) -> Decomposition:
    pos = {lab: i for i, lab in enumerate(js.labels)}
    out_idx = [pos[lab] for lab in op.out_labels]
    in_idx = [[pos[lab] for lab in ls] for ls in op.in_labels]
    kernels = []
    for index in itertools.product(*(range(len(b) - 1) for b in js.bounds)):
        kernels.append(Kernel(index, tuple(index[i] for i in out_idx),
                              tuple(tuple(index[i] for i in ii) for ii in in_idx)))
    n_partials = 1
    for lab in op.agg_labels:
        n_partials *= len(js[lab]) - 1
    return Decomposition(node, js, js.partition(op.out_labels),
                         tuple(js.partition(ls) for ls in op.in_labels), tuple(kernels),
                         n_partials, op.agg if n_partials > 1 else AGGS["none"])


def _gather(node: Node, op: Gather, js: JoinAggSpec) -> Decomposition:
    table, idx = node.inputs
    out_labels = dim_labels(node.ndim)
    idx_labels, rest = out_labels[:idx.ndim], out_labels[idx.ndim:]
    out = js.partition(out_labels)
    table_part = Partition((js[ROW],) + tuple(js[lab] for lab in rest))
    idx_part = js.partition(idx_labels)
    kernels = []
    n_rows = len(js[ROW]) - 1
    for key in out.keys():
        for r in range(n_rows):
            kernels.append(Kernel(key + (r,), key, ((r,) + key[idx.ndim:], key[:idx.ndim])))
    return Decomposition(node, js, out, (table_part, idx_part), tuple(kernels), n_rows,
                         AGGS["sum"] if n_rows > 1 else AGGS["none"])


def _scatter_add(node: Node, op: ScatterAdd, js: JoinAggSpec) -> Decomposition:
    """Gather's mirror: one kernel per (output block, index block). Cutting the index labels
    makes partial sums of an output block (summed), cutting ``row`` keeps each kernel to the
    updates whose index falls in its rows (each updates block is read by every row block),
    cutting the row-shape labels is embarrassingly parallel."""
    updates, idx = node.inputs
    labels = dim_labels(updates.ndim)
    idx_labels, rest = labels[:idx.ndim], labels[idx.ndim:]
    out = js.partition((ROW,) + rest)
    idx_part = js.partition(idx_labels)
    kernels = []
    for key in out.keys():
        for ik in idx_part.keys():
            # the spec's label order is row, rest..., idx...: the output key, then the index key
            kernels.append(Kernel(key + ik, key, (ik + key[1:], ik)))
    n_idx = idx_part.num_blocks
    return Decomposition(node, js, out, (js.partition(labels), idx_part), tuple(kernels), n_idx,
                         AGGS["sum"] if n_idx > 1 else AGGS["none"])


def _intervals(bounds: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(zip(bounds, bounds[1:]))


def _window_ranges(bounds: tuple[int, ...], n: int, k: int, stride: int, lo: int, ld: int, rd: int
                   ) -> tuple[tuple[int, int], ...]:
    """Per output block ``[o0, o1)`` of one spatial dim, the input range it reads: its block
    and the halo. A block that reads only padding gets one element (its kernel crops it)."""
    out = []
    for o0, o1 in _intervals(bounds):
        a, e = input_range(o0, o1, n, k, stride, lo, ld, rd) if o1 > o0 and n else (0, 0)
        if a == e and n:
            a = min(a, n - 1)
            a, e = a, a + 1
        out.append((a, e))
    return tuple(out)


def _conv(node: Node, op: Conv, js: JoinAggSpec) -> Decomposition:
    """One kernel per (n, o, spatial, c) block. A spatial block reads the input rows its windows
    reach — its own and a halo its neighbours also read (a :class:`Covering`); an output-channel
    block reads its groups' input channels; cutting ``c`` (groups 1) makes partial sums."""
    x, w = node.inputs
    outs, agg = conv_labels(node)
    nd = node.ndim - 2
    og = w.shape[0] // op.groups
    cg = w.shape[1]
    if agg:
        chans, w_c = _intervals(js["c"]), js["c"]
    else:
        chans = tuple((o0 // og * cg, ((o1 - 1) // og + 1) * cg) if o1 > o0 else (0, x.shape[1])
                      for o0, o1 in _intervals(js["o"]))
        w_c = (0, cg) if cg else (0, 0)
    spatial = tuple(_window_ranges(js[lab], n, k, s, lo, ld, rd) for lab, n, k, s, (lo, _), ld, rd in
                    zip(SPATIAL, x.shape[2:], w.shape[2:], op.stride, op.padding, op.lhs_dilation,
                        op.rhs_dilation))
    x_cov = Covering((_intervals(js["n"]), chans) + spatial, x.shape)
    w_part = Partition((js["o"], w_c) + tuple((0, k) for k in w.shape[2:]))
    m = len(outs)
    kernels = []
    for index in itertools.product(*(range(len(b) - 1) for b in js.bounds)):
        ci = index[m] if agg else index[1]
        kernels.append(Kernel(index, index[:m], ((index[0], ci) + index[2:m],
                                                 (index[1], index[m] if agg else 0) + (0,) * nd)))
    n_partials = len(js["c"]) - 1 if agg else 1
    return Decomposition(node, js, js.partition(outs), (x_cov, w_part), tuple(kernels), n_partials,
                         AGGS["sum"] if n_partials > 1 else AGGS["none"])


def _pool(node: Node, op: Pool, out: Partition) -> tuple[tuple[Partition | Covering, ...], tuple[Kernel, ...]]:
    # every output block reads its batch and channel block and its windows' rows (with a halo)
    # (the windows, agg none: output channel c*K + j reads input channel c)
    x = node.inputs[0]
    spatial = tuple(_window_ranges(b, n, k, s, lo, 1, d) for b, n, k, s, (lo, _), d in
                    zip(out.bounds[2:], x.shape[2:], op.window, op.stride, op.padding, op.dilation))
    kt = node.shape[1] // x.shape[1] if x.shape[1] else 1
    chans = tuple((c0 // kt, (c1 - 1) // kt + 1) if c1 > c0 else (0, x.shape[1])
                  for c0, c1 in _intervals(out.bounds[1]))
    cov = Covering((_intervals(out.bounds[0]), chans) + spatial, x.shape)
    return (cov,), tuple(Kernel(k, k, (k,)) for k in out.keys())


def _topk(node: Node, op: TopK, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    # every kernel orders whole rows (the sorted dim is read whole): a cut of the sorted dim
    # makes kernels that each keep their range of the order (the rows replicated to them)
    x = node.inputs[0]
    inp = Partition(tuple((0, x.shape[d]) if d == op.axis else b for d, b in enumerate(out.bounds)))
    return (inp,), tuple(Kernel(k, k, (tuple(0 if d == op.axis else i for d, i in enumerate(k)),))
                         for k in out.keys())


def _sparse_cut(node: Node, op: Any, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    # a sparse einsum: an output dim the sparse operand does not carry cuts the dense inputs that
    # carry it (each kernel computes its own columns); the sparse operand's own dims and a fed
    # operand's keys and values are read whole (a cut there computes the entries in its box only)
    follows = dense_follows(node)
    follows += tuple((-1,) * x.ndim for x in node.inputs[len(follows):])
    ins = tuple(Partition(tuple(out.bounds[o] if o >= 0 else even_bounds(n, 1) for o, n in zip(f, x.shape)))
                for f, x in zip(follows, node.inputs))
    return ins, tuple(Kernel(k, k, tuple(tuple(k[o] if o >= 0 else 0 for o in f) for f in follows))
                      for k in out.keys())


def _attention_cut(node: Node, out: Partition, row_slots: tuple[int, ...]
                   ) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    """Attention's blocks: a cut batch dim cuts every input that has it (a mask's size-1 dims stay
    whole); the query rows cut the inputs of ``row_slots`` (the forward's q and mask), every key
    being read by every block; any other cut reads its inputs whole (the kernel recomputes them
    and keeps its box)."""
    nb = node.inputs[0].ndim - 2
    parts, follow = [], []
    for slot, x in enumerate(node.inputs):
        f = tuple((d < nb or (d == nb and slot in row_slots)) and x.shape[d] == node.shape[d] and d < node.ndim
                  for d in range(x.ndim))
        follow.append(f)
        parts.append(Partition(tuple(out.bounds[d] if f[d] else (0, n) for d, n in enumerate(x.shape))))
    kernels = tuple(Kernel(k, k, tuple(tuple(k[d] if f[d] else 0 for d in range(len(f))) for f in follow))
                    for k in out.keys())
    return tuple(parts), kernels


def _attention(node: Node, op: Attention, out: Partition) -> tuple[tuple[Partition | Covering, ...],
                                                                     tuple[Kernel, ...]]:
    """q and the mask (inputs q, k, v[, mask]) follow the rows; causal (or a sliding window) with
    the query rows cut: each query block reads only the band of keys its mask allows
    (attention.key_band), in k, v and the mask's key dim -- the key blocks it would only mask
    out are absent from its join, never moved to it nor computed (block sparsity)."""
    parts, kernels = _attention_cut(node, out, (0, 3))
    nb = node.ndim - 2
    rows = _intervals(out.bounds[nb])
    n_keys = node.inputs[1].shape[-2]
    if not op.causal or len(rows) < 2 or n_keys == 0:
        return parts, kernels
    # an empty band still reads one key (the kernel, seeing it outside the band, gives zeros): a
    # kernel's input box is never empty
    bands = tuple(band if band[1] > band[0] else (n_keys - 1, n_keys)
                  for band in (key_band(a, b, op.window, n_keys) for a, b in rows))
    key_dims = {1: nb, 2: nb}  # the slot -> its key dim (k's and v's rows; a mask's last dim)
    if len(node.inputs) > 3 and node.inputs[3].shape[-1] == n_keys:
        key_dims[3] = nb + 1
    new: list[Partition | Covering] = list(parts)
    for slot, dim in key_dims.items():
        p = parts[slot]
        new[slot] = Covering(tuple(bands if d == dim else _intervals(b) for d, b in enumerate(p.bounds)),
                             p.shape)
    banded = tuple(Kernel(k.index, k.out_key, tuple(
        key if s not in key_dims or key is None else key[:key_dims[s]] + (k.out_key[nb],) + key[key_dims[s] + 1:]
        for s, key in enumerate(k.in_keys))) for k in kernels)
    return tuple(new), banded


def _attention_grad(node: Node, op: AttentionGrad, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    # dk and dv sum over every query row, so a kernel reads whole rows: its batch block only
    return _attention_cut(node, out, ())


def reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Minimal groups of dims of ``a`` and ``b`` with equal products (row-major reshape); an
    empty tensor (a 0 in the shapes) is one group of all dims."""
    if 0 in a or 0 in b:
        return [(list(range(len(a))), list(range(len(b))))]
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        ia, jb = [], []
        pa = pb = 1
        if i < len(a):
            pa *= a[i]
            ia.append(i)
            i += 1
        if j < len(b):
            pb *= b[j]
            jb.append(j)
            j += 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                ia.append(i)
                i += 1
            else:
                pb *= b[j]
                jb.append(j)
                j += 1
        groups.append((ia, jb))
    return groups


def _lead(dims: list[int], shape: tuple[int, ...]) -> int | None:
    """The first dim of a group with size > 1 (where a row-major group can be cut)."""
    return next((d for d in dims if shape[d] > 1), None)


def _prod(xs: Any) -> int:
    n = 1
    for v in xs:
        n *= v
    return n


def _reshape(node: Node, op: Reshape, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    """A group keeps its cut when only its lead dim is cut, at multiples of the inner size on both
    sides (e.g. heads split out of a model dim cut on head boundaries); otherwise the input is
    needed whole across the group, a repartition the cost model sees."""
    src = node.inputs[0].shape
    dst = node.shape
    in_bounds: list[tuple[int, ...]] = [(0, n) for n in src]
    if node.size == 0:  # no row-major groups in an empty tensor: every kernel reads it whole
        inp = Partition(tuple(in_bounds))
        return (inp,), tuple(Kernel(k, k, ((0,) * len(src),)) for k in out.keys())
    for ia, jb in reshape_groups(src, dst):
        cut = [d for d in jb if len(out.bounds[d]) > 2]
        if not cut:
            continue
        lb, la = _lead(jb, dst), _lead(ia, src)
        if lb is None or la is None or cut != [lb]:
            continue
        inner_b = _prod(dst[d] for d in jb[jb.index(lb) + 1:])
        inner_a = _prod(src[d] for d in ia[ia.index(la) + 1:])
        flat = [c * inner_b for c in out.bounds[lb]]
        if all(f % inner_a == 0 for f in flat):
            in_bounds[la] = tuple(f // inner_a for f in flat)
    inp = Partition(tuple(in_bounds))
    # per input dim (in order): None (one block) or how a kernel's out key gives its block there,
    # worked out once per reshape rather than per kernel
    dims: list[tuple[int, int, int, tuple[int, ...]] | None] = []
    for ia, jb in _groups_cached(src, dst):
        la, lb = _lead(ia, src), _lead(jb, dst)
        for d in ia:
            # (a group's input is cut only where both sides have a dim > 1: la, lb are set)
            if d == la and la is not None and lb is not None and len(inp.bounds[d]) > 2:
                inner_b = _prod(dst[e] for e in jb[jb.index(lb) + 1:])
                inner_a = _prod(src[e] for e in ia[ia.index(la) + 1:])
                dims.append((lb, inner_b, inner_a, inp.bounds[d]))
            else:
                dims.append(None)
    kernels = []
    for key in out.keys():
        in_key = tuple(0 if m is None else m[3].index(out.bounds[m[0]][key[m[0]]] * m[1] // m[2]) for m in dims)
        kernels.append(Kernel(key, key, (in_key,)))
    return (inp,), tuple(kernels)


def reshape_region(node: Node, in_part: Partition, out_box: tuple[tuple[int, int], ...]
                   ) -> tuple[tuple[int, int], ...]:
    """The output box that one input block of a reshape turns into: the out block itself on groups
    whose cut is kept, the whole group elsewhere (the kernel then slices the out block from it)."""
    src, dst = node.inputs[0].shape, node.shape
    region = [(0, n) for n in dst]
    if node.size == 0:
        return tuple(region)
    for ia, jb in _groups_cached(src, dst):
        la = _lead(ia, src)
        if la is not None and len(in_part.bounds[la]) > 2:
            for d in jb:
                region[d] = out_box[d]
    return tuple(region)


_group_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[list[int], list[int]]]] = {}


def _groups_cached(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    key = (a, b)
    if key not in _group_cache:
        _group_cache[key] = reshape_groups(a, b)
    return _group_cache[key]


def _broadcast(node: Node, op: Broadcast, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    x = node.inputs[0]
    same = [x.shape[i] == node.shape[d] for i, d in enumerate(op.dims)]
    inp = Partition(tuple(out.bounds[d] if s else (0, 1) for d, s in zip(op.dims, same)))
    kernels = tuple(Kernel(k, k, (tuple(k[d] if s else 0 for d, s in zip(op.dims, same)),))
                    for k in out.keys())
    return (inp,), kernels


def _select(node: Node, op: Select, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    # the input is cut exactly at the selected blocks' edges: each kernel reads one whole block
    x = node.inputs[0]
    bounds = []
    for d, n in enumerate(x.shape):
        cuts = {0, n} | {op.starts[d] + c for c in out.bounds[d]}
        bounds.append(tuple(sorted(cuts)))
    inp = Partition(tuple(bounds))
    kernels = tuple(Kernel(k, k, (tuple(inp.bounds[d].index(op.starts[d] + out.bounds[d][i])
                                        for d, i in enumerate(k)),)) for k in out.keys())
    return (inp,), kernels


def _concat(node: Node, op: Concat, out: Partition) -> tuple[tuple[Partition, ...], tuple[Kernel, ...]]:
    ax = op.axis
    ins = []
    offsets = []
    start = 0
    for x in node.inputs:
        n = x.shape[ax]
        cuts = {0, n} | {c - start for c in out.bounds[ax] if start < c < start + n}
        b = list(out.bounds)
        b[ax] = tuple(sorted(cuts))
        ins.append(Partition(tuple(b)))
        offsets.append(start)
        start += n
    kernels = []
    for key in out.keys():
        lo, hi = out.bounds[ax][key[ax]], out.bounds[ax][key[ax] + 1]
        in_keys: list[BlockKey | None] = []
        for x, p, off in zip(node.inputs, ins, offsets):
            if start == 0:  # every input is empty along the axis: each kernel reads them all
                in_keys.append(key)
            elif off < hi and lo < off + x.shape[ax]:
                blk = p.overlapping(ax, max(lo, off) - off, min(hi, off + x.shape[ax]) - off)
                assert len(blk) == 1
                in_keys.append(key[:ax] + (blk[0],) + key[ax + 1:])
            else:
                in_keys.append(None)
        kernels.append(Kernel(key, key, tuple(in_keys)))
    return tuple(ins), tuple(kernels)


# how each node kind is cut into block kernels: (node, its op, its spec) -> Decomposition
DECOMPOSE_RULES: dict[type, DecomposeRule] = {
    Input: _blockwise(_leaf),
    Einsum: _einsum,
    Reshape: _blockwise(_reshape),
    Broadcast: _blockwise(_broadcast),
    Select: _blockwise(_select),
    Concat: _blockwise(_concat),
    Fill: _blockwise(_leaf),
    Gather: _gather,
    ScatterAdd: _scatter_add,
    Cast: _blockwise(_elementwise),
    Conv: _conv,
    Pool: _blockwise(_pool),
    TopK: _blockwise(_topk),
    RotateHalf: _blockwise(_topk),  # whole rows along its axis, as a sort's
    Attention: _blockwise(_attention),
    AttentionGrad: _blockwise(_attention_grad),
    SparseEinsum: _blockwise(_sparse_cut),
}
