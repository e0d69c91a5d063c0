"""Fusing chains of elementwise einsums into one einsum node, before planning.

An einsum that aggregates nothing (every label it reads is an output label) and whose only
reader is another such einsum is inlined into it: its join expression is substituted for the
argument that read it, its inputs join the reader's (relabelled into the reader's labels). The
fused graph has fewer nodes, so fewer tasks, intermediate blocks and passes over memory; its
values are the unfused graph's exactly, because the kernels evaluate the composed expression
step by step in the same dtypes:

- a half-precision producer is never inlined (its result is rounded to float16/bfloat16, the
  composed expression would keep float32);
- a producer must compute in its own dtype (its join's inferred dtype) and the fused node must
  infer the reader's dtype and shape;
- a fused join that is a plain product (``x0 * x1 * x2``) is left unfused: products take the
  contraction kernels, which may multiply in another order.

Nodes that are graph outputs, or read twice, are kept (inlining would compute them twice),
unless they are free to recompute (:func:`_free`: a bare relabelling -- a copy, transpose or
broadcast -- or calls nested at most :data:`SMALL_DEPTH` deep on at most :data:`SMALL_RECOMPUTE`
elements) and every reader
is an elementwise einsum: then each reader inlines them and the node, its tasks and its block
go (a task costs ~15-20 us of the runtime's time, more than such a recomputation). A copy (an
identity einsum) that is not an output goes too, whoever reads it; a broadcast that only adds
dims is a relabelling too, taken in by elementwise readers; a reshape of a reshape is one
reshape of the first's input (none where that has the shape already), a broadcast of a reshape
that only inserted size-1 dims is one broadcast (GQA's repeat of k and v); an elementwise einsum
that reads size-1 dims only through reshapes that added them runs without them, reshaped after
(the RMSNorm's keepdim statistics: the reshapes on both sides then compose away). A concat of
the halves of one tensor, one negated -- a captured ``rotate_half`` and its gradient -- becomes one
:class:`~einjoin.ir.opkinds.RotateHalf` node (:func:`~einjoin.ir.rotate.as_rotate_half`; moved
and negated values: the same bits).

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (4, 3), "float32")
>>> e = ops.einsum_node([x], ("ij",), "ij", "exp", None)
>>> y = ops.einsum_node([e, x], ("ij", "ij"), "ji", "x0 * 2.0 + x1", None)
>>> [f] = fuse_elementwise([y])
>>> print(f.op.join, f.op.equation, f.shape)
exp(x0) * 2.0 + x0 ij->ji (3, 4)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Broadcast, Concat, Einsum, Node, Reshape, RotateHalf
from einjoin.ir.ops import broadcast_node, einsum_node, reshape_node
from einjoin.ir.rotate import as_rotate_half, rotated_first
from einjoin.ir.scalar import Arg, Call, Expr, infer_dtype, is_product, substitute

__all__ = ["fuse_elementwise", "MAX_FUSED_INPUTS", "MAX_FUSED_DEPTH"]

MAX_FUSED_INPUTS = 8   # a fused node reads at most this many inputs (the planner's search grows with them)
MAX_FUSED_DEPTH = 48   # nor nests calls deeper (kernels evaluate it step by step; printing stays short)
SMALL_RECOMPUTE = 4096  # a producer of <= SMALL_DEPTH calls this small is recomputed by each of several readers
SMALL_DEPTH = 2         # (RMSNorm's mean square + eps, read by the forward and the backward: a task less)
_HALF = ("float16", "bfloat16")


def _elementwise(n: Node) -> bool:
    """An einsum aggregating no label, reading no diagonal."""
    op = n.op
    if not isinstance(op, Einsum):
        return False
    out = set(op.out_labels)
    return all(len(set(ls)) == len(ls) and out.issuperset(ls) for ls in op.in_labels)


def _inlinable(p: Node) -> bool:
    """Whether producer ``p`` (already fused itself) may be inlined into a reader."""
    if not _elementwise(p) or p.dtype in _HALF:
        return False
    op = p.op
    assert isinstance(op, Einsum)
    try:
        return infer_dtype(op.join, [x.dtype for x in p.inputs]) == p.dtype
    except EinjoinError:  # pragma: no cover - a node was built with this dtype
        return False


def _free(p: Node) -> bool:
    """Whether inlinable producer ``p`` costs less to recompute in each reader than to keep as a
    node of its own: its join is a bare argument (a relabelling: copy, transpose, broadcast) or
    calls nested at most :data:`SMALL_DEPTH` deep over arguments and constants on a small block."""
    join = p.op.join  # type: ignore[union-attr]
    if isinstance(join, Arg):
        return True
    return (isinstance(join, Call) and join.depth <= SMALL_DEPTH and p.size <= SMALL_RECOMPUTE)


def _new_dims_only(p: Node) -> bool:
    """A broadcast that only adds dims (each input dim keeps its size): a relabelling its
    elementwise readers take in, reading its input with the labels of the dims it came from."""
    op = p.op
    return isinstance(op, Broadcast) and all(p.inputs[0].shape[i] == p.shape[d] for i, d in enumerate(op.dims))


def _squeezed(n: Node) -> Node | None:
    """Elementwise einsum ``n`` computed without its size-1 dims where it reads them only through
    reshapes that added them: the einsum over those reshapes' inputs, reshaped to ``n``'s shape
    (a reshape its squeezing readers compose away, see :func:`_fuse_pass`); None when it reads a
    size-1 dim otherwise or no such reshape. The same join on the same values: the same bits."""
    op = n.op
    assert isinstance(op, Einsum)
    ones = {lab for lab, size in zip(op.out_labels, n.shape) if size == 1}
    if not ones:
        return None
    ins: list[Node] = []
    labels: list[tuple[str, ...]] = []
    for x, ls in zip(n.inputs, op.in_labels):
        kept = tuple(lab for lab in ls if lab not in ones)
        if len(kept) == len(ls):
            ins.append(x)
            labels.append(tuple(ls))
            continue
        # a row-major reshape that only inserted size-1 dims keeps every other dim in order
        if not (isinstance(x.op, Reshape) and x.inputs[0].shape == tuple(
                size for size, lab in zip(x.shape, ls) if lab not in ones)):
            return None
        ins.append(x.inputs[0])
        labels.append(kept)
    if not any(isinstance(x.op, Reshape) and y is x.inputs[0] for x, y in zip(n.inputs, ins)):
        return None
    try:
        out = einsum_node(ins, labels, [lab for lab in op.out_labels if lab not in ones], op.join, op.agg)
    except EinjoinError:  # pragma: no cover - the parts were a valid einsum over these labels
        return None
    if out.dtype != n.dtype:  # pragma: no cover - the same join over the same dtypes
        return None
    return reshape_node(out, n.shape)


def _squeezes(reader: Node, n: Node) -> bool:
    """Whether ``reader`` may take ``n`` squeezed (see :func:`_squeezed`) without a reshape
    left between them: a reshape (the two compose) or an elementwise einsum of ``n``'s shape
    (which may run squeezed in turn)."""
    return isinstance(reader.op, Reshape) or (_elementwise(reader) and reader.shape == n.shape)


def _unsqueezed(r: Node) -> list[int | None] | None:
    """For a reshape ``r`` that only inserts size-1 dims into its input's shape: per dim of
    ``r``, the input dim it is (None: an inserted 1); None for any other reshape."""
    src = r.inputs[0].shape
    got: list[int | None] = []
    i = 0
    for size in r.shape:
        if i < len(src) and size == src[i]:
            got.append(i)
            i += 1
        elif size == 1:
            got.append(None)
        else:
            return None
    return got if i == len(src) else None


def _broadcast_through(b: Node, r: Node) -> Node | None:
    """Broadcast ``b`` of reshape ``r`` that only inserted size-1 dims, as one broadcast of ``r``'s
    input (the inserted dims are new dims of the broadcast): GQA's ``k[:, :, None].expand(...)``
    is one view, not a reshape task and a broadcast task. None for another reshape."""
    where = _unsqueezed(r)
    if where is None:
        return None
    dims: tuple[int, ...] = b.op.dims  # type: ignore[union-attr]
    return broadcast_node(r.inputs[0], b.shape, [dims[j] for j, i in enumerate(where) if i is not None])


def _copy(n: Node) -> bool:
    """An einsum that copies its one input as it is (the same labels in order, dtype and shape):
    whoever reads it may read the input (values are never written in place)."""
    op = n.op
    return (isinstance(op, Einsum) and len(n.inputs) == 1 and op.join == Arg(0)
            and tuple(op.in_labels[0]) == tuple(op.out_labels) and n.dtype == n.inputs[0].dtype
            and n.shape == n.inputs[0].shape)


def fuse_elementwise(outputs: Sequence[Node]) -> list[Node]:
    """``outputs`` rebuilt with every fusable elementwise chain inlined (the same outputs, in
    order, as new nodes where something below them was fused; inputs are kept as they are).
    Fusing is idempotent: fusing the result again changes nothing (a pass is repeated while it
    fuses: merging two reads of one block into one argument can leave a producer one reader)."""
    outs = list(outputs)
    for _ in range(8):
        fused = _fuse_pass(outs)
        if all(a is b for a, b in zip(fused, outs)):
            break
        outs = fused
    return outs


def _fuse_pass(outputs: list[Node]) -> list[Node]:
    graph = Graph(outputs)
    reads: Counter[Node] = Counter()
    ew_reads: Counter[Node] = Counter()  # reads by elementwise einsums
    for n in graph.nodes:
        ew = _elementwise(n)
        for x in n.inputs:
            reads[x] += 1
            ew_reads[x] += ew
    for o in graph.outputs:
        reads[o] += 1  # an output is kept: its value is returned
    # read once, or only by elementwise einsums (then inlined only if free to recompute: _free)
    single = {x: k == 1 for x, k in reads.items() if k == 1 or k == ew_reads[x]}
    outs = set(graph.outputs)
    new: dict[Node, Node] = {}
    for n in graph.nodes:
        ins = tuple(new[x] for x in n.inputs)
        if _copy(n) and n not in outs:
            new[n] = ins[0]  # a copy: its readers read what it copies
            continue
        if isinstance(n.op, Concat):
            rotated = as_rotate_half(n if ins == n.inputs else Node(n.op, ins, n.shape, n.dtype))
            if rotated is not None:  # rotary's rotate_half: one node, not selects, neg, concat
                new[n] = rotated
                continue
        if isinstance(n.op, RotateHalf) and n not in outs and all(_elementwise(u) for u in graph.users.get(n, ())):
            # rotated before a transpose, which its elementwise readers then take in
            first = rotated_first(n if ins == n.inputs else Node(n.op, ins, n.shape, n.dtype))
            if first is not None:
                new[n] = first
                continue
        if isinstance(n.op, Reshape) and isinstance(ins[0].op, Reshape):
            # row-major reshapes compose: a reshape of a reshape is one reshape of the first's
            # input, none where that has the shape already (a size-1 dim added, then dropped)
            src = ins[0].inputs[0]
            if src.shape != n.shape:
                new[n] = reshape_node(src, n.shape)
                continue
            if n not in outs:
                new[n] = src
                continue
        if isinstance(n.op, Broadcast) and isinstance(ins[0].op, Reshape):
            through = _broadcast_through(n, ins[0])
            if through is not None:
                new[n] = through
                continue
        fused = _fuse(n, ins, single) if _elementwise(n) else None
        if fused is not None:
            new[n] = fused
        elif ins == n.inputs:
            new[n] = n
        else:
            new[n] = Node(n.op, ins, n.shape, n.dtype)  # the same op over rebuilt inputs
        if n not in outs and _elementwise(new[n]) and all(_squeezes(u, n) for u in graph.users.get(n, ())):
            new[n] = _squeezed(new[n]) or new[n]
    return [new[o] for o in outputs]


def _fuse(n: Node, ins: tuple[Node, ...], single: dict[Node, bool]) -> Node | None:
    """``n`` with its elementwise producers inlined, or None when none is: those read once
    (``single[x]`` True) and those read only by elementwise einsums (False) that are free to
    recompute as fused so far (:func:`_free` of the rebuilt producer)."""
    op = n.op
    assert isinstance(op, Einsum)
    args: list[tuple[Node, tuple[str, ...]]] = []

    def arg(node: Node, labels: tuple[str, ...]) -> Expr:
        key = (node, labels)  # the same block read the same way: one argument
        if key not in args:
            args.append(key)
        return Arg(args.index(key))

    subs: list[Expr] = []
    inlined = False
    relabels = True  # every inlined producer only relabels (its join a bare argument)
    for x, nx, labels in zip(n.inputs, ins, op.in_labels):
        if x in single and _new_dims_only(nx):
            bop = nx.op
            assert isinstance(bop, Broadcast)
            subs.append(arg(nx.inputs[0], tuple(labels[d] for d in bop.dims)))
            inlined = True
        elif x in single and _inlinable(nx) and (single[x] or _free(nx)):
            pop = nx.op
            assert isinstance(pop, Einsum)
            rename = dict(zip(pop.out_labels, labels))
            inner = [arg(y, tuple(rename[lab] for lab in ly)) for y, ly in zip(nx.inputs, pop.in_labels)]
            subs.append(substitute(pop.join, inner))
            inlined = True
            relabels = relabels and isinstance(pop.join, Arg)
        else:
            subs.append(arg(nx, tuple(labels)))
    if not inlined:
        return None
    join = substitute(op.join, subs)
    # a product of at most two blocks is one multiply per element, whichever kernel runs it: a
    # product reader may take in a relabelling (it stays the product it was)
    kept_product = relabels and len(args) <= 2 and is_product(op.join, len(n.inputs))
    if (len(args) > MAX_FUSED_INPUTS or (is_product(join, len(args)) and not kept_product)
            or (isinstance(join, Call) and join.depth > MAX_FUSED_DEPTH)):
        return None
    try:
        out = einsum_node([a for a, _ in args], [ls for _, ls in args], op.out_labels, join, op.agg)
    except EinjoinError:  # pragma: no cover - the parts were valid einsums over these labels
        return None
    if out.dtype != n.dtype or out.shape != n.shape:
        return None
    return out
