"""The sparse einsum node kind (issue 24: sparse tensors inside the dense graph): its constructor,
its reference kernel, its block kernel, its modelled flops and its adjoints.

A :class:`~einjoin.ir.opkinds.SparseEinsum` node is a sum of products of dense graph values and
one sparse constant held by the op (a :class:`~einjoin.ir.opkinds.SparseOperand`:
``einjoin.sparse.node.GraphSparse`` around a ``SparseTensor``). The IR never imports the sparse
engine (it sits floors above): the operand computes the einsum itself (``operand.einsum``, a
compiled ``SparsePlan`` per equation and shapes), and the reference is ``numpy.einsum`` on its
densified value. The planner cuts the node by its output dims (:func:`dense_follows`): a dim
the sparse operand does not carry cuts the dense inputs that carry it (each kernel computes its
block); a cut of the operand's own dims is *replicated* (a kernel reads its inputs whole and
computes the whole output, then keeps its box), which the cost model charges.

The adjoint w.r.t. a dense operand is another sparse einsum with the same constant: the output's
cotangent joined with the other operands, summed onto the operand's labels (what
``einjoin.sparse.grad`` computes for a compiled plan), broadcast along labels no other operand
carries.

>>> import numpy as np
>>> from einjoin.ir import ops
>>> class Eye:  # a stand-in sparse operand: the 3 x 3 identity
...     name, shape, dtype_name, nnz = "I", (3, 3), "float64", 3
...     def todense(self): return np.eye(3)
...     def einsum(self, op, dense, dtype): return np.einsum(op.equation, np.eye(3), *dense)
>>> h = ops.input_node("h", (3, 2), "float64")
>>> y = sparse_einsum_node(Eye(), 0, [h], "ij,jk->ik")
>>> y.shape, y.dtype, str(y.op.equation)
((3, 2), 'float64', 'ij,jk->ik')
>>> print(repr(y).split(" : ")[0])  # doctest: +ELLIPSIS
<Node #... sparse_einsum[I{ij},jk->ik | I: sparse float64[3, 3], 3 stored]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, EinsumSyntaxError, ShapeError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.dtypes import canonical_dtype, is_half, kind, numpy_dtype, promote
from einjoin.ir.equation import parse_equation
from einjoin.ir.node import Node
from einjoin.ir.opkinds import SparseEinsum, SparseOperand

__all__ = ["sparse_einsum_node", "sparse_reference", "sparse_block", "sparse_flops", "sparse_adjoints",
           "fed_parts", "fed_dense", "DECLARE_INPUT", "dense_follows", "followed_dims", "operand_box"]

# ``ej.sparse_input(name, shape, nnz, dtype)``, put here by einjoin.sparse.node when the sparse
# engine loads: the frontend (which builds IR only and may not import the engine) declares a torch
# module's sparse argument or buffer through it (einjoin.frontend.aten_sparse)
DECLARE_INPUT: list[Callable[[str, tuple[int, ...], int, str], Any]] = []

AGGS = ("sum", "max")  # a graph's sparse einsum: the sum of the products, or their maximum
# a max node's adjoint (built by sparse_adjoints only): operand 0 is the output's cotangent, the
# others the forward's operands (max over them onto operand 0's labels), the result the cotangent
# of operand 1 (dense; its labels are the node's output): each output's cotangent to its maximal
# terms, split evenly among ties (torch's amax), the densified operand's zeros terms too
MAX_GRAD = "maxgrad"
# the same for a fed sparse operand's values (operand 1 is the sparse one, and a last dense operand,
# the values input labelled by the entry, gives the result its shape): per stored entry (a row of
# the keys input) its products' cotangents summed, unused rows 0
MAX_GRAD_VALUES = "maxgradvalues"


def _what(eq: str, operand: SparseOperand) -> str:
    return f"sparse_einsum {eq!r} (sparse operand {operand.name!r} {list(operand.shape)})"


def sparse_einsum_node(operand: SparseOperand, position: int, inputs: Sequence[Node],
                       equation: str | None = None, in_labels: Sequence[Sequence[str]] | None = None,
                       out_labels: Sequence[str] | None = None, pattern: Sequence[Node] = (),
                       agg: str = "sum") -> Node:
    """A :class:`SparseEinsum` node: ``equation`` (or ``in_labels`` / ``out_labels``) over every
    operand, the sparse ``operand`` at ``position`` and ``inputs`` (dense nodes) at the others, in
    order. Checks labels against shapes (errors name the op, the label and both shapes) and infers
    the dtype: the float operands' (dense operands must be float; an int sparse tensor takes theirs).

    ``pattern``: for a sparse operand fed at run (``ej.sparse_input``), its two graph inputs
    ``(keys, values)``, the node's last inputs: ``keys`` int64 (capacity × rank) coordinates of the
    stored entries, rows of -1 unused; ``values`` (capacity,) of the operand's dtype.

    ``agg``: ``"sum"`` or ``"max"`` (the largest product, an absent entry's being 0)."""
    inputs = tuple(inputs)
    if agg not in AGGS + (MAX_GRAD, MAX_GRAD_VALUES):
        raise UnsupportedOpError(f"sparse_einsum (sparse operand {operand.name!r} {list(operand.shape)}): "
                                 f"aggregation {agg!r}; a graph's sparse einsum takes {' or '.join(AGGS)}")
    if pattern:
        _check_pattern(operand, tuple(pattern))
    shapes = [tuple(x.shape) for x in inputs]
    if not 0 <= position <= len(inputs):
        raise EinsumSyntaxError(f"sparse_einsum: sparse operand position {position} for {len(inputs)} dense "
                                f"operand(s)")
    shapes.insert(position, tuple(operand.shape))
    if equation is not None:
        try:
            ins, outs = parse_equation(equation, shapes)
        except EinjoinError as e:  # the same error, naming the sparse einsum and its sparse operand
            raise type(e)(f"sparse_einsum (sparse operand {operand.name!r} {list(operand.shape)} at "
                          f"{position}): {e}") from None
    else:
        if in_labels is None or out_labels is None:
            raise EinsumSyntaxError("sparse_einsum: give an equation, or both in_labels and out_labels")
        ins, outs = tuple(tuple(ls) for ls in in_labels), tuple(out_labels)
    ins = tuple(tuple(ls) for ls in ins)
    outs = tuple(outs)
    eq = ",".join("".join(ls) for ls in ins) + "->" + "".join(outs)
    what = _what(eq, operand)
    if len(ins) != len(shapes):
        raise EinsumSyntaxError(f"{what}: {len(ins)} label group(s) for {len(shapes)} operand(s)")
    sizes: dict[str, tuple[int, int]] = {}
    for i, (shape, ls) in enumerate(zip(shapes, ins)):
        role = "the sparse operand" if i == position else "dense operand"
        if len(ls) != len(shape):
            raise ShapeError(f"{what}: operand {i} ({role}) has rank {len(shape)} (shape {shape}) but "
                             f"{len(ls)} label(s) {''.join(ls)!r}")
        if len(set(ls)) != len(ls):
            raise UnsupportedOpError(f"{what}: operand {i} repeats a label ({''.join(ls)!r}); diagonals "
                                     f"are not supported in sparse einsums")
        for lab, n in zip(ls, shape):
            if lab in sizes and sizes[lab][0] != n:
                j = sizes[lab][1]
                raise ShapeError(f"{what}: label {lab!r} has size {sizes[lab][0]} in operand {j} "
                                 f"(shape {shapes[j]}) but size {n} in operand {i} (shape {shape})")
            sizes.setdefault(lab, (n, i))
    if len(set(outs)) != len(outs):
        raise EinsumSyntaxError(f"{what}: an output label is repeated")
    for lab in outs:
        if lab not in sizes:
            raise EinsumSyntaxError(f"{what}: output label {lab!r} appears in no operand")
    empty = [lab for lab in sizes if lab not in outs and sizes[lab][0] == 0]
    if empty and agg == "max":  # as the dense einsum (ir.ops): a max over nothing has no value
        raise ShapeError(f"{what}: max over label(s) {''.join(empty)!r} of size 0 has no value (an empty "
                         f"tensor's max); slice a non-empty range or use sum")
    for x in inputs:
        if kind(x.dtype) != "float":
            raise DTypeError(f"{what}: dense operand of dtype {x.dtype}; sparse einsums take float operands "
                             f"(cast it first)")
    # torch's promotion: an int or bool sparse tensor (an adjacency of ones) takes the float operands' dtype
    sparse_dtype = canonical_dtype(operand.dtype_name)
    floats = ([sparse_dtype] if kind(sparse_dtype) == "float" else []) + [x.dtype for x in inputs]
    if not floats:
        raise DTypeError(f"{what}: the sparse operand is {sparse_dtype} and no operand is float; sparse einsums "
                         f"in a graph compute in float")
    dtype = floats[0]
    for dt in floats[1:]:
        dtype = promote(dtype, dt)
    op = SparseEinsum(ins, outs, position, operand, agg)
    return Node(op, inputs + tuple(pattern), tuple(sizes[lab][0] for lab in outs), dtype)


def _check_pattern(operand: SparseOperand, pattern: tuple[Node, ...]) -> None:
    what = f"sparse_einsum (sparse input {operand.name!r} {list(operand.shape)})"
    if len(pattern) != 2:
        raise EinjoinError(f"{what}: a fed sparse operand's pattern is two inputs (keys, values), got {len(pattern)}")
    keys, values = pattern
    rank = len(operand.shape)
    if keys.dtype != "int64" or keys.ndim != 2 or keys.shape[1] != rank:
        raise ShapeError(f"{what}: its keys input must be int64 of shape (capacity, {rank}), got "
                         f"{keys.dtype}{list(keys.shape)}")
    if values.ndim != 1 or values.shape[0] != keys.shape[0] or values.dtype != canonical_dtype(operand.dtype_name):
        raise ShapeError(f"{what}: its values input must be {operand.dtype_name} of shape ({keys.shape[0]},), "
                         f"got {values.dtype}{list(values.shape)}")


def sparse_einsums(nodes: Iterable[Node]) -> list[Node]:
    """The sparse einsum nodes among ``nodes``, in order (modules outside the IR ask this, never the
    node's kind)."""
    return [n for n in nodes if isinstance(n.op, SparseEinsum)]


def fed_parts(node: Node) -> tuple[tuple[Node, ...], tuple[Node, ...]]:
    """The node's dense operands and its fed pattern inputs ``(keys, values)`` (none for a
    constant sparse operand)."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    n = len(op.dense_labels)
    return node.inputs[:n], node.inputs[n:]


def fed_dense(shape: Sequence[int], keys: np.ndarray, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The dense value of a fed sparse operand from its keys and values (rows of -1 unused)."""
    out = np.zeros(tuple(shape), dtype)
    keys = np.asarray(keys)
    used = keys[:, 0] >= 0 if keys.shape[1] else np.zeros(len(keys), bool)
    np.add.at(out, tuple(keys[used].T), np.asarray(values)[used].astype(dtype))
    return out


# the reference densifies a sparse operand of at most this many elements (a 20k-node graph's
# adjacency would be 3.2 GB); a larger one is computed by the sparse engine (its own einsum)
DENSE_REFERENCE = 1 << 24


def sparse_reference(node: Node, op: SparseEinsum, args: Sequence[np.ndarray]) -> np.ndarray:
    """``numpy.einsum`` on the densified sparse operand (the reference; half types in float32);
    beyond :data:`DENSE_REFERENCE` elements, the sparse engine's result (never a huge dense array)."""
    if math.prod(op.operand.shape) > DENSE_REFERENCE or (op.agg != "sum" and _terms(node) > DENSE_REFERENCE):
        return sparse_block(node, op, args, tuple((0, n) for n in node.shape))
    n = len(op.dense_labels)
    dense = [np.asarray(a) for a in args[:n]]
    work = [a.astype(np.float32) if is_half(a.dtype) else a for a in dense]
    if len(args) > n:  # fed at run: densified from its keys and values inputs
        keys, values = args[n], np.asarray(args[n + 1])
        wide = np.dtype(np.float32) if is_half(values.dtype) else values.dtype
        value = fed_dense(op.operand.shape, keys, values, wide)
    else:
        value = np.asarray(op.operand.todense())
    work.insert(op.position, value)
    if op.agg == "max":
        out = _max_reference(op, work)
    elif op.agg == MAX_GRAD:
        out = _max_grad_reference(op, work)
    elif op.agg == MAX_GRAD_VALUES:  # the sparse operand's dense gradient at the fed keys
        full = _max_grad_reference(op, work[:-1])
        keys = np.asarray(args[n])
        used = keys[:, 0] >= 0
        out = np.zeros(len(keys), full.dtype)
        out[used] = full[tuple(keys[used].T)]
    else:
        out = np.einsum(op.equation, *work)
    return np.asarray(out).astype(numpy_dtype(node.dtype), copy=False)


def _labels_sizes(node: Node) -> dict[str, int]:
    op = node.op
    assert isinstance(op, SparseEinsum)
    shapes = [x.shape for x in node.inputs[:len(op.dense_labels)]]
    shapes.insert(op.position, op.operand.shape)
    return {lab: n for shape, ls in zip(shapes, op.in_labels) for lab, n in zip(ls, shape)}


def _terms(node: Node) -> int:
    """The products a max einsum's reference forms: every label's extent."""
    return math.prod(_labels_sizes(node).values())


def _max_reference(op: SparseEinsum, work: Sequence[np.ndarray]) -> np.ndarray:
    """The maximum over the summed labels of every product, the densified operand's zeros
    included (an absent entry's product is 0, as the sparse engine's); a summed label of extent 0
    is refused when the node is built (:func:`sparse_einsum_node`)."""
    every = tuple(dict.fromkeys(lab for ls in op.in_labels for lab in ls))
    summed = tuple(lab for lab in every if lab not in op.out_labels)
    prod = np.einsum(",".join("".join(ls) for ls in op.in_labels) + "->" + "".join(every), *work)
    axes = tuple(every.index(lab) for lab in summed)
    if not summed:
        out = prod
    elif any(prod.shape[a] == 0 for a in axes):
        out = np.zeros(tuple(n for d, n in enumerate(prod.shape) if d not in axes), prod.dtype)
    else:
        out = prod.max(axis=axes)
    kept = tuple(lab for lab in every if lab not in summed)
    return np.transpose(out, [kept.index(lab) for lab in op.out_labels])


def _max_grad_reference(op: SparseEinsum, work: Sequence[np.ndarray]) -> np.ndarray:
    """A :data:`MAX_GRAD` node on dense arrays: each forward output's cotangent (``work[0]``)
    split evenly among the products equal to its maximum (the densified operand's zeros are
    products too: torch's amax of the dense product), times the other forward operands, summed
    onto operand 1's labels."""
    out, fwd = op.in_labels[0], op.in_labels[1:len(work)]
    every = tuple(dict.fromkeys(lab for ls in fwd for lab in ls))
    prod = np.einsum(",".join("".join(ls) for ls in fwd) + "->" + "".join(every), *work[1:])
    axes = tuple(d for d, lab in enumerate(every) if lab not in out)
    best = prod.max(axis=axes, keepdims=True) if axes else prod
    hit = prod == best
    ties = hit.sum(axis=axes, keepdims=True) if axes else np.ones_like(prod)
    kept = "".join(lab for lab in every if lab in out)
    g = np.einsum("".join(out) + "->" + kept, work[0]).reshape([n if d not in axes else 1
                                                                  for d, n in enumerate(prod.shape)])
    weight = np.where(hit, g / np.maximum(ties, 1), 0)
    others = [("".join(ls), w) for k, (ls, w) in enumerate(zip(fwd, work[1:])) if k != 0]
    eq = ",".join(["".join(every)] + [e for e, _ in others]) + "->" + "".join(fwd[0])
    return np.asarray(np.einsum(eq, weight, *(w for _, w in others)))


def _cuttable(op: SparseEinsum) -> set[str]:
    """The output labels a kernel may compute on its own blocks: every one for a sum or max (each
    output element reads its own terms); for a :data:`MAX_GRAD` node only the forward's output
    labels (a label its max runs over couples every term of an output: ties and the maximum)."""
    return set(op.out_labels) if op.agg in AGGS else set(op.in_labels[0])


def dense_follows(node: Node) -> tuple[tuple[int, ...], ...]:
    """Per dense input, per dim: the output dim whose blocks it is cut by when the planner cuts the
    node (-1: read whole). An output label the sparse operand does not carry (a GNN's feature
    dim: ``k`` of ``ij,jk->ik``) is computed block by block from the dense operands' blocks, no
    work repeated; a label the sparse operand carries is not cut in it (where its entries lie is
    data), so a kernel cut there reads its inputs whole and keeps its box (repeated work).

    >>> from einjoin.ir import ops
    >>> class A:  # a stand-in sparse operand
    ...     name, shape, dtype_name, nnz = "A", (5, 4), "float32", 6
    >>> y = sparse_einsum_node(A(), 0, [ops.input_node("h", (4, 3), "float32")], "ij,jk->ik")
    >>> dense_follows(y), followed_dims(y)
    (((-1, 1),), (False, True))
    """
    op = node.op
    assert isinstance(op, SparseEinsum)
    sparse = set(op.in_labels[op.position])
    pos = {lab: o for o, lab in enumerate(op.out_labels) if lab not in sparse and lab in _cuttable(op)}
    return tuple(tuple(pos[lab] if lab in pos and x.shape[d] == node.shape[pos[lab]] else -1
                       for d, lab in enumerate(labels))
                 for x, labels in zip(node.inputs, op.dense_labels))


def followed_dims(node: Node) -> tuple[bool, ...]:
    """The output dims a kernel's dense input blocks are cut by (:func:`dense_follows`): its
    result has the block's extent there, the whole output's elsewhere."""
    cut = {o for f in dense_follows(node) for o in f if o >= 0}
    return tuple(o in cut for o in range(node.ndim))


def operand_box(node: Node, box: Sequence[tuple[int, int]]) -> tuple[tuple[int, int] | None, ...]:
    """Per dim of the node's sparse operand: the range of ``box`` (an output box) along it where
    the box cuts that output dim, else None. An operand with ``einsum_within`` (a constant, or one
    fed at run) computes only its entries there, so a cut along its own dims splits the work (its
    kernels still read the dense inputs, and a fed one's keys and values, whole)."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    pos = {lab: o for o, lab in enumerate(op.out_labels) if lab in _cuttable(op)}
    out: list[tuple[int, int] | None] = []
    for lab in op.in_labels[op.position]:
        o = pos.get(lab)
        out.append(None if o is None or tuple(box[o]) == (0, node.shape[o]) else (box[o][0], box[o][1]))
    return tuple(out)


def sparse_block(node: Node, op: SparseEinsum, blocks: Sequence[np.ndarray | None],
                 box: Sequence[tuple[int, int]], widened: bool = False) -> np.ndarray:
    """One kernel of the node through the sparse engine: the dense blocks are cut along the output
    dims the sparse operand does not carry (:func:`dense_follows`), so its result is the box
    there; along the others it is the whole output, cut to ``box`` (replicated work where the
    planner cut those). ``widened``: a half result stays float32 (the torch kernels round it)."""
    dense = [np.asarray(b) for b in blocks]
    dtype = "float32" if widened and node.dtype in ("float16", "bfloat16") else node.dtype
    within = getattr(op.operand, "einsum_within", None)
    rows = operand_box(node, box)
    if within is not None and any(r is not None for r in rows):  # its rows only (a constant operand)
        out = np.asarray(within(op, dense, dtype, rows))
    else:
        out = np.asarray(op.operand.einsum(op, dense, dtype))
    out = out.astype(numpy_dtype(dtype), copy=False)
    follow = followed_dims(node)
    if all(f or (a, b) == (0, n) for f, (a, b), n in zip(follow, box, node.shape)):
        return out
    return np.ascontiguousarray(out[tuple(slice(None) if f else slice(a, b) for f, (a, b) in zip(follow, box))])


def sparse_flops(node: Node) -> int:
    """Multiply-adds modelled for the whole op: each stored entry of the sparse operand times the
    extent of the labels it does not carry (an SpMM's ``2 nnz k``)."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    own = set(op.in_labels[op.position])
    sizes = {lab: n for x, ls in zip(node.inputs, op.dense_labels) for lab, n in zip(ls, x.shape)}
    rest = math.prod(n for lab, n in sizes.items() if lab not in own)
    return 2 * int(op.operand.nnz) * rest


def sparse_adjoints(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """The cotangent of each dense input: ``g`` joined with the other operands (the sparse one
    among them) and summed onto the input's labels, as one sparse einsum; labels only that input
    carries (summed away by the forward) are broadcast back. Cast to the input's dtype."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    if op.agg == "max":
        return _max_adjoints(node, g, wanted)
    if op.agg != "sum":  # a max node's adjoint: its own derivative is not built
        raise UnsupportedOpError(f"the gradient of {_what(op.equation, op.operand)} ({op.agg}: the gradient of a "
                                 f"sparse max) inside a graph is not supported (ej.grad of a gradient)")
    dense_in, pattern = fed_parts(node)
    out: list[Node | None] = []
    for k, (x, labels) in enumerate(zip(dense_in, op.dense_labels)):
        if not wanted[k]:
            out.append(None)
            continue
        others = [(y, ls) for j, (y, ls) in enumerate(zip(dense_in, op.dense_labels)) if j != k]
        carried = set(op.out_labels) | set(op.in_labels[op.position]) | {lab for _, ls in others for lab in ls}
        kept = tuple(lab for lab in labels if lab in carried)
        dense = [g] + [y for y, _ in others]
        dense_labels = [op.out_labels] + [ls for _, ls in others]
        # the sparse operand keeps its place among the dense ones: after the operands before it
        pos = 1 + sum(1 for j in range(len(dense_in)) if j != k and j < op.position)
        in_labels = dense_labels[:pos] + [op.in_labels[op.position]] + dense_labels[pos:]
        grad = sparse_einsum_node(op.operand, pos, dense, in_labels=in_labels, out_labels=kept, pattern=pattern)
        if kept != labels:
            grad = ops.broadcast_node(grad, x.shape, [labels.index(lab) for lab in kept])
        if grad.dtype != x.dtype:
            grad = ops.cast_node(grad, x.dtype)
        out.append(grad)
    if pattern:  # a fed sparse operand: its keys (int) get none, its values the sampled product
        out.append(None)
        out.append(_values_adjoint(node, g) if wanted[-1] else None)
    return tuple(out)


def _max_adjoints(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """The cotangents of a max node's dense inputs: one :data:`MAX_GRAD` node each (``g``, the
    input, the other operands; the sparse operand in its place among them), cast to the input's
    dtype. A fed sparse operand's values get none through a max (refused when asked for)."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    dense_in, pattern = fed_parts(node)
    out: list[Node | None] = []
    for k, (x, labels) in enumerate(zip(dense_in, op.dense_labels)):
        if not wanted[k]:
            out.append(None)
            continue
        # the forward's operands with this one first (a product's order is free), the sparse kept
        order = [k + (k >= op.position)] + [i for i in range(len(op.in_labels)) if i != k + (k >= op.position)]
        nodes = {i: y for i, y in zip([i for i in range(len(op.in_labels)) if i != op.position], dense_in)}
        dense = [g] + [nodes[i] for i in order if i != op.position]
        in_labels = [op.out_labels] + [op.in_labels[i] for i in order]
        grad = sparse_einsum_node(op.operand, 1 + order.index(op.position), dense, in_labels=in_labels,
                                  out_labels=labels, pattern=pattern, agg=MAX_GRAD)
        out.append(grad if grad.dtype == x.dtype else ops.cast_node(grad, x.dtype))
    if pattern:  # a fed operand: its keys (int) get none, its values their products' share
        out.append(None)
        out.append(_max_values_adjoint(node, g) if wanted[-1] else None)
    return tuple(out)


def _max_values_adjoint(node: Node, g: Node) -> Node:
    """The cotangent of a fed sparse operand's values through a max: a :data:`MAX_GRAD_VALUES`
    node (the cotangent, the sparse operand, the dense ones, and the values input labelled by a
    fresh entry label, whose extent is the result's), cast to the values' dtype."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    dense_in, (keys, values) = fed_parts(node)
    e = _fresh_label({lab for ls in op.in_labels for lab in ls} | set(op.out_labels))
    in_labels = [op.out_labels, op.in_labels[op.position], *op.dense_labels, (e,)]
    grad = sparse_einsum_node(op.operand, 1, [g, *dense_in, values], in_labels=in_labels, out_labels=(e,),
                              pattern=(keys, values), agg=MAX_GRAD_VALUES)
    return grad if grad.dtype == values.dtype else ops.cast_node(grad, values.dtype)


def _fresh_label(used: set[str]) -> str:
    return next(c for c in "eabcdfghmnopqrstuvwxyzEFGHMNOPQRSTUVWXYZ" if c not in used)


def _values_adjoint(node: Node, g: Node) -> Node:
    """The cotangent of a fed sparse operand's values: per stored entry ``e`` (its coordinates
    ``keys[e]`` on the operand's labels S), ``g`` times the other operands summed over every
    label but S, at S = ``keys[e]`` (the sampled dense-dense product, torch's gradient of a sparse
    leaf on its own pattern). Each factor carrying labels of S is gathered at the keys (its S
    labels first, flattened: one gather), the factors are joined by one einsum onto the entry
    label, and unused rows (keys of -1) get 0. Never the dense product over all of S."""
    op = node.op
    assert isinstance(op, SparseEinsum)
    dense_in, (keys, values) = fed_parts(node)
    sparse_labels = op.in_labels[op.position]
    sizes = dict(zip(sparse_labels, op.operand.shape))
    used = {lab for ls in op.in_labels for lab in ls} | set(op.out_labels)
    e = _fresh_label(used)
    cap = keys.shape[0]
    safe = ops.einsum_node([keys], [("e", "r")], ("e", "r"), join="max(x0, 0)")  # unused rows read row 0
    cols = [ops.reshape_node(ops.select_node(safe, (0, d), (cap, d + 1)), (cap,)) for d in range(len(sparse_labels))]
    factors: list[Node] = []
    labels: list[tuple[str, ...]] = []
    for t, ls in [(g, op.out_labels), *zip(dense_in, op.dense_labels)]:
        hit = tuple(lab for lab in ls if lab in sizes)
        if not hit:
            factors.append(t)
            labels.append(tuple(ls))
            continue
        rest = tuple(lab for lab in ls if lab not in sizes)
        if tuple(ls) != hit + rest:
            t = ops.einsum_node([t], [tuple(ls)], hit + rest, join="x0")
        rest_shape = t.shape[len(hit):]
        flat = ops.reshape_node(t, (math.prod(sizes[lab] for lab in hit),) + rest_shape)
        strides = [math.prod(sizes[lab] for lab in hit[i + 1:]) for i in range(len(hit))]
        parts = [cols[sparse_labels.index(lab)] for lab in hit]
        if len(parts) == 1:
            idx = parts[0]
        else:  # the row of the flattened factor: the entry's coordinates on its S labels
            join = " + ".join(f"x{i} * {st}" for i, st in enumerate(strides))
            idx = ops.einsum_node(parts, [("e",)] * len(parts), ("e",), join=join)
        factors.append(ops.gather_node(flat, idx))
        labels.append((e,) + rest)
    gathered = any(ls[:1] == (e,) for ls in labels)
    prod = ops.einsum_node(factors, labels, (e,) if gathered else (), join="mul" if len(factors) > 1 else "x0")
    if not gathered:  # no factor carries an S label: every entry gets the same sum
        prod = ops.broadcast_node(prod, (cap,), [])
    grad = ops.einsum_node([prod, _keys_first(keys, cap)], [("e",), ("e",)], ("e",),
                           join="where(ge(x1, 0), x0, 0)")
    if grad.dtype != values.dtype:
        grad = ops.cast_node(grad, values.dtype)
    return grad


def _keys_first(keys: Node, cap: int) -> Node:
    """The first coordinate of each row of a fed operand's keys (-1 on unused rows)."""
    return ops.reshape_node(ops.select_node(keys, (0, 0), (cap, 1)), (cap,))
