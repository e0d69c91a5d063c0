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

Nodes that are graph outputs, or read twice, are kept (inlining would compute them twice).

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
from einjoin.ir.node import Einsum, Node
from einjoin.ir.ops import einsum_node
from einjoin.ir.scalar import Arg, Call, Expr, infer_dtype, is_product, substitute

__all__ = ["fuse_elementwise", "MAX_FUSED_INPUTS", "MAX_FUSED_DEPTH"]

MAX_FUSED_INPUTS = 8   # a fused node reads at most this many inputs (the planner's search grows with them)
MAX_FUSED_DEPTH = 48   # nor nests calls deeper (kernels evaluate it step by step; printing stays short)
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
    for n in graph.nodes:
        for x in n.inputs:
            reads[x] += 1
    for o in graph.outputs:
        reads[o] += 1  # an output is kept: its value is returned
    new: dict[Node, Node] = {}
    for n in graph.nodes:
        ins = tuple(new[x] for x in n.inputs)
        fused = _fuse(n, ins, reads) if _elementwise(n) else None
        if fused is not None:
            new[n] = fused
        elif ins == n.inputs:
            new[n] = n
        else:
            new[n] = Node(n.op, ins, n.shape, n.dtype)  # the same op over rebuilt inputs
    return [new[o] for o in outputs]


def _fuse(n: Node, ins: tuple[Node, ...], reads: Counter[Node]) -> Node | None:
    """``n`` with its single-reader elementwise producers inlined, or None when none is."""
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
    for x, nx, labels in zip(n.inputs, ins, op.in_labels):
        if reads[x] == 1 and _inlinable(nx):
            pop = nx.op
            assert isinstance(pop, Einsum)
            rename = dict(zip(pop.out_labels, labels))
            inner = [arg(y, tuple(rename[lab] for lab in ly)) for y, ly in zip(nx.inputs, pop.in_labels)]
            subs.append(substitute(pop.join, inner))
            inlined = True
        else:
            subs.append(arg(nx, tuple(labels)))
    if not inlined:
        return None
    join = substitute(op.join, subs)
    if (len(args) > MAX_FUSED_INPUTS or is_product(join, len(args))
            or (isinstance(join, Call) and join.depth > MAX_FUSED_DEPTH)):
        return None
    try:
        out = einsum_node([a for a, _ in args], [ls for _, ls in args], op.out_labels, join, op.agg)
    except EinjoinError:  # pragma: no cover - the parts were valid einsums over these labels
        return None
    if out.dtype != n.dtype or out.shape != n.shape:
        return None
    return out
