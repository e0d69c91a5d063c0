"""Einsum kernels prepared once per task: what :func:`einjoin.ir.kernels.einsum_kernel` works out
on every call from the op and its blocks' dtypes and shapes (the route, each input's axis
permutation and shape, the broadcast shape, the axes aggregated, the output dtype) is fixed for
a task of a task graph, so the local backends work it out once per engine. On a small model most
of a task's time was that bookkeeping (an 8x8 ``tanh`` block: ~45 us of Python around a ~1 us
ufunc).

A prepared kernel runs the same numpy calls in the same order as ``einsum_kernel`` (the same
bits); it checks that its blocks have the shapes and dtypes it was prepared for and returns None
otherwise (the caller then takes the general path, which also raises the errors). Einsum kernels
it does not prepare (half-precision inputs, repeated labels, the ``einsum`` and ``diagonal``
routes) take the general path; a kernel of another kind is its block kernel with the
decomposition, kernel and output box looked up once.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (4, 4)); prog = ej.compile([ej.tanh(x)], 1, backend="sync", fuse=False, quiet=True)
>>> fast = prepare_kernels(prog.taskgraph, prog.plan.decomps)
>>> [t.id for t in prog.taskgraph.tasks if fast[t.id] is not None] == [t.id for t in prog.taskgraph.tasks
...                                                                    if t.kind.value == "kernel"]
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.decomp.block_kernels import BLOCK_KERNELS, _einsum_block, _reshape_block
from einjoin.decomp.decompose import Decomposition, reshape_region
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.evaluate import SlotProgram, evaluate
from einjoin.ir.kernels import HALF_DTYPES, MatmulRoute, _batched_matmul, _matmul, align, matmul_route, partial_dtype
from einjoin.ir.node import Node, rule_for
from einjoin.ir.scalar import Arg, Call, Const
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["prepare_kernels", "FastKernel"]

# a prepared kernel: the task's input blocks (in the kernel's input order) -> its output block,
# or None when the blocks are not what it was prepared for
FastKernel = Callable[[Sequence[Any]], "np.ndarray | None"]


def prepare_kernels(tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> list[FastKernel | None]:
    """Per task id, its prepared kernel (None: the general path)."""
    out: list[FastKernel | None] = [None] * len(tg.tasks)
    for t in tg.tasks:
        if t.kind is TaskKind.KERNEL:
            out[t.id] = _prepare(t, tg, decomps)
    return out


def _prepare(t: Task, tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> FastKernel | None:
    d = decomps.get(t.node)
    if d is None:
        return None
    op: Any = d.node.op  # an einsum once its block kernel is the einsum one
    k = d.kernels[t.payload.kernel]
    rule = rule_for(BLOCK_KERNELS, op, "the block kernels (einjoin.decomp.block_kernels.BLOCK_KERNELS)")
    if rule is not _einsum_block:
        # another kind: its block kernel with the decomposition, kernel and box looked up once
        box = d.out_partition.box(k.out_key)
        if len(t.reads) != sum(key is not None for key in k.in_keys):
            return None
        if rule is _reshape_block and len(t.reads) == 1:
            return _reshape(d, box, tg.values[t.reads[0]].shape)
        return _other(rule, d, op, k, box)
    if any(key is None for key in k.in_keys) or len(t.reads) != len(k.in_keys) or not t.reads:
        return None
    vals = [tg.values[r] for r in t.reads]
    if any(v.dtype in HALF_DTYPES for v in vals):
        return None  # widened to float32 first: the general path
    shapes = tuple(v.shape for v in vals)
    n_in = len(shapes)
    dtypes = tuple(np.dtype(numpy_dtype(v.dtype)) for v in vals)
    out_dtype = np.dtype(numpy_dtype(partial_dtype(d.node) if d.n_partials > 1 else d.node.dtype))
    route = matmul_route(op, list(dtypes))
    core: Callable[[Sequence[np.ndarray]], Any]
    if route.path == "matmul":
        core = _matmul_core(route, shapes) or (lambda xs: _batched_matmul(route, xs[0], xs[1]))
    elif route.path == "join":
        got = _join_core(op, shapes, dtypes)
        if got is None:
            return None
        core = got
    elif route.path == "einsum" and n_in == 1:
        got = _one_core(op)
        if got is None:
            return None
        core = got
    else:
        return None
    n = len(shapes)
    nd = np.ndarray

    def run(blocks: Sequence[Any]) -> np.ndarray | None:
        if len(blocks) != n:
            return None
        for b, s, dt in zip(blocks, shapes, dtypes):
            # the exact class first (one identity test per block), a subclass the long way
            if type(b) is not nd or b.shape != s or b.dtype != dt:
                if not (isinstance(b, nd) and b.shape == s and b.dtype == dt):
                    return None
        z = core(blocks)
        # asarray(order="C") and astype(copy=False) return z itself when it is a C-ordered array
        # of the output's dtype (most kernels' results): tested here without the two calls
        if type(z) is nd and z.flags.c_contiguous and z.dtype == out_dtype:
            return z
        return np.asarray(z, order="C").astype(out_dtype, copy=False)
    return run


def _matmul_core(r: MatmulRoute, shapes: Sequence[tuple[int, ...]]) -> Callable[[Sequence[np.ndarray]], Any] | None:
    """:func:`einjoin.ir.kernels._batched_matmul` with its axis permutations and shapes worked
    out once for blocks of ``shapes`` (the same views and numpy calls: the same bits): a product
    with nothing contracted as one broadcast multiply, a contraction as one ``_matmul`` over
    (batch, m, k) x (batch, k, n). None (the general call) where labels are summed first or
    the dot-product route applies."""
    lx, ly = r.x_labels, r.y_labels
    if r.x_sum or r.y_sum or len(shapes[0]) != len(lx) or len(shapes[1]) != len(ly):
        return None
    if not r.k:
        out = r.out_labels
        ax = align(np.empty(shapes[0], np.int8), lx, out)  # the views align makes, on a dummy
        ay = align(np.empty(shapes[1], np.int8), ly, out)
        px = tuple(sorted(range(len(lx)), key=lambda i: out.index(lx[i])))
        py = tuple(sorted(range(len(ly)), key=lambda i: out.index(ly[i])))
        tx, ty = ax.shape, ay.shape

        def outer(xs: Sequence[np.ndarray]) -> Any:
            return np.multiply(xs[0].transpose(px).reshape(tx), xs[1].transpose(py).reshape(ty))
        return outer
    if not r.m and not r.n and lx[-1] in r.batch and ly[-1] in r.batch:
        return None
    size = dict(zip(lx, shapes[0])) | dict(zip(ly, shapes[1]))

    def prod(labels: tuple[str, ...]) -> int:
        return math.prod(size[lab] for lab in labels)

    batch, m, n, k = r.batch, r.m, r.n, r.k
    pmx = [lx.index(lab) for lab in batch + m + k]
    pmy = [ly.index(lab) for lab in batch + k + n]
    sx, sy = (prod(batch), prod(m), prod(k)), (prod(batch), prod(k), prod(n))
    order = batch + m + n
    zs = [size[lab] for lab in order]
    pz = [order.index(lab) for lab in r.out_labels]

    def matmul(xs: Sequence[np.ndarray]) -> Any:
        z = _matmul(np.transpose(xs[0], pmx).reshape(sx), np.transpose(xs[1], pmy).reshape(sy)).reshape(zs)
        return np.transpose(z, pz)
    return matmul


def _other(rule: Any, d: Decomposition, op: Any, k: Any, box: Any) -> FastKernel:
    """A block kernel of another kind, called as :func:`einjoin.decomp.block_kernels.run_kernel`
    calls it (the blocks in the kernel's input order, None where it reads nothing)."""
    keys = tuple(key is not None for key in k.in_keys)
    if all(keys):
        def run(blocks: Sequence[Any]) -> np.ndarray | None:
            return np.asarray(rule(d, op, k, blocks, box))
        return run

    def run_sparse(blocks: Sequence[Any]) -> np.ndarray | None:
        it = iter(blocks)
        return np.asarray(rule(d, op, k, [next(it) if has else None for has in keys], box))
    return run_sparse


def _one_core(op: Any) -> Callable[[Sequence[np.ndarray]], Any] | None:
    """The ``einsum`` route of ``einsum_kernel`` for one input without repeated labels (a copy in
    another axis order, or a sum over labels): a transposed view where nothing is summed (the
    caller's C-order copy makes it the same array ``np.einsum``'s view gives), else
    ``np.einsum`` itself on the equation worked out once (its summation order, its bits)."""
    ins, outs = op.in_labels[0], op.out_labels
    if len(set(ins)) < len(ins) or len(set(outs)) < len(outs) or not set(outs) <= set(ins):
        return None  # a diagonal, or labels the input lacks: the general path
    if len(outs) == len(ins):
        perm = tuple(ins.index(lab) for lab in outs)

        def transpose(xs: Sequence[np.ndarray]) -> Any:
            return xs[0].transpose(perm)
        return transpose
    sym = {lab: chr(ord("a") + i) for i, lab in enumerate(op.all_labels)}
    eq = "".join(sym[lab] for lab in ins) + "->" + "".join(sym[lab] for lab in outs)

    def summed(xs: Sequence[np.ndarray]) -> Any:
        return np.einsum(eq, xs[0])
    return summed


def _reshape(d: Decomposition, box: Any, in_shape: tuple[int, ...]) -> FastKernel:
    """:func:`einjoin.decomp.block_kernels._reshape_block` with its region worked out once: the
    input block reshaped to the region, the output box sliced from it (views)."""
    region = reshape_region(d.node, d.in_partitions[0].core, box)
    shape = tuple(b - a for a, b in region)
    cut = tuple(slice(a - r, b - r) for (a, b), (r, _) in zip(box, region))

    def run(blocks: Sequence[Any]) -> np.ndarray | None:
        b = blocks[0]
        if not (isinstance(b, np.ndarray) and b.shape == in_shape):
            return None
        return np.asarray(np.reshape(b, shape)[cut])
    return run


def _join_core(op: Any, shapes: Sequence[tuple[int, ...]],
               dtypes: Sequence[np.dtype[Any]]) -> Callable[[Sequence[np.ndarray]], Any] | None:
    """The ``join`` route of ``einsum_kernel`` with its alignment worked out: each input
    transposed to the op's label order and reshaped (size 1 for its absent labels), the join
    evaluated, broadcast to the full shape when it ignores an input, aggregated."""
    order = op.all_labels
    perms, targets = [], []
    for shape, ls in zip(shapes, op.in_labels):
        if len(set(ls)) < len(ls) or len(shape) != len(ls):
            return None  # a diagonal: the general path
        perm = sorted(range(len(ls)), key=lambda k: order.index(ls[k]))
        it = iter([shape[p] for p in perm])
        present = set(ls)
        perms.append(tuple(perm))
        targets.append(tuple(next(it) if lab in present else 1 for lab in order))
    full = tuple(min(s) if 0 in s else max(s) for s in ([tg[dim] for tg in targets] for dim in range(len(order))))
    axes = tuple(range(len(op.out_labels), len(order)))
    join, agg = op.join, op.agg
    if not isinstance(join, Call):  # an argument or a constant: evaluate's value (a view, a number)
        pairs = tuple(zip(perms, targets))

        def leaf(xs: Sequence[np.ndarray]) -> Any:
            aligned = [x.transpose(p).reshape(tgt) for x, (p, tgt) in zip(xs, pairs)]
            val = np.asarray(evaluate(join, aligned))
            if val.shape != full:
                val = np.broadcast_to(val, full)
            return agg.reduce(val, axes) if axes else val
        return leaf
    # the join's steps replayed (evaluate's numpy calls, recorded on the first call); an input
    # already in the op's label order and shape goes in as it is (its view is the same array)
    replay = SlotProgram(join).replay()
    moves = tuple((i, p, tgt) for i, (shape, p, tgt) in enumerate(zip(shapes, perms, targets))
                  if p != tuple(range(len(p))) or tgt != tuple(shape))
    reduce = agg.reduce if axes else None
    onehot = None if axes else _onehot_add(op, dtypes, full)

    def core(xs: Sequence[np.ndarray]) -> Any:
        if moves:
            xs = list(xs)
            for i, p, tgt in moves:
                xs[i] = xs[i].transpose(p).reshape(tgt)
        if onehot is not None:
            got = onehot(xs)
            if got is not None:
                return got
        val = replay.run(xs)
        if type(val) is not np.ndarray:
            val = np.asarray(val)
        if val.shape != full:  # a join that ignores an input still ranges over its labels
            val = np.broadcast_to(val, full)
        return val if reduce is None else reduce(val, axes)
    return core


def _onehot_add(op: Any, dtypes: Sequence[np.dtype[Any]],
                full: tuple[int, ...]) -> Callable[[Sequence[np.ndarray]], Any] | None:
    """A join ``X + where(x_i == x_r, Y, 0)`` (either order) whose range input ``x_r`` has only
    the last label ``L`` (of the op's label order, output ones first), ``x_i`` and every input of
    ``Y`` not ``L`` (a cross-entropy's gradient: the softmax term plus ``-1`` scaled at each row's
    target column), computed without the dense one-hot: ``X + 0`` everywhere, then ``X + Y`` at
    each index's column, where the range block is the ints ``start, start + 1, ...`` (else None:
    the whole join). The same bits: where the one-hot is 0 the join adds 0 (``-0`` becomes
    ``+0``), where it is 1 it adds Y's value (``X`` read before the ``+ 0``); only the sign of
    a nan from nan + nan may differ (x86 returns one operand's nan, numpy's loops differ on
    which). The dense
    ``where`` was five passes over the output-sized block (the comparison, the bit-mask
    select's three, the add); these are one, and a gather and a scatter of a row's worth.
    Called with the inputs aligned to the op's label order (sizes 1 for absent labels)."""
    j = op.join
    if not isinstance(j, Call) or j.fn != "add" or len(j.args) != 2 or not full:
        return None
    last = op.all_labels[-1]
    for w, x in ((j.args[1], j.args[0]), (j.args[0], j.args[1])):
        if not (isinstance(w, Call) and w.fn == "where" and isinstance(w.args[0], Call) and w.args[0].fn == "eq"
                and isinstance(w.args[2], Const) and type(w.args[2].value) in (int, float) and w.args[2].value == 0
                and all(isinstance(a, Arg) for a in w.args[0].args)):
            continue
        a0, a1 = (a.index for a in w.args[0].args if isinstance(a, Arg))
        y = w.args[1]
        y_args = {a.index for a in _args(y)}
        for i, r in ((a0, a1), (a1, a0)):
            if (tuple(op.in_labels[r]) == (last,) and last not in op.in_labels[i] and i != r
                    and dtypes[i].kind == "i" and dtypes[r].kind == "i"
                    and all(last not in op.in_labels[k] for k in y_args)):
                return _onehot_run(SlotProgram(x).replay(), SlotProgram(y).replay(), i, r, full)
    return None


def _args(e: Any) -> list[Arg]:
    if isinstance(e, Arg):
        return [e]
    return [a for sub in e.args for a in _args(sub)] if isinstance(e, Call) else []


def _onehot_run(x: Any, y: Any, i: int, r: int, full: tuple[int, ...]) -> Callable[[Sequence[np.ndarray]], Any]:
    n = full[-1]
    head = full[:-1] + (1,)
    arange = np.arange(n)

    def run(xs: Sequence[np.ndarray]) -> np.ndarray | None:
        rng = xs[r].reshape(-1)
        if rng.shape[0] != n or n == 0:
            return None
        start = int(rng[0])
        if not np.array_equal(rng, arange + start):
            return None
        d = x.run(xs)
        v = y.run(xs)
        if (type(d) is not np.ndarray or type(v) is not np.ndarray or d.shape != full or d.dtype.kind != "f"
                or v.dtype != d.dtype or v.ndim != len(full) or v.shape[-1] != 1):
            return None
        pos = np.broadcast_to(xs[i], head)[..., 0] - start
        hit = np.nonzero((pos >= 0) & (pos < n))
        at = hit + (pos[hit],)
        picked = d[at]  # X before its + 0, where Y is added instead
        if d.base is None and d.flags.writeable and not any(d is b or np.may_share_memory(d, b) for b in xs):
            out: np.ndarray = np.add(d, 0.0, out=d)  # a temporary X's evaluation made: in place
        else:
            out = np.add(d, 0.0)
        out[at] = picked + np.broadcast_to(v, head)[..., 0][hit]
        return out
    return run
