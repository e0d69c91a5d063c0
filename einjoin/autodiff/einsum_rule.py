"""The adjoint of an extended einsum, as einsums (relational autodiff, arXiv 2306.00088).

For ``y[out] = agg over the missing labels of f(x_0[l_0], ..., x_n[l_n])`` and a cotangent ``g``
of ``y``'s shape, the cotangent of ``x_i`` is one einsum over the op's labels, aggregated with
``sum`` onto ``l_i``:

- ``agg`` sum or none: join ``g * ∂f/∂x_i``. A product join (a contraction) gives the product of
  the other operands, so the adjoint of ``ij,jk->ik`` w.r.t. the lhs is the contraction
  ``ik,jk->ij`` (join ``mul``) that planners and the matmul kernels know; any other join is
  differentiated symbolically (:func:`einjoin.ir.derivative.derivative`).
- ``agg`` max/min: the cotangent goes to the positions whose joined value equals the result,
  **split evenly between ties** (as torch's ``amax``/``amin``): ``where(f == y, g / count, 0)``
  with ``count`` the number of ties, an einsum too; a NaN result (no position equals it) gives
  NaN to its whole group, as torch's does. In float16/bfloat16 the join is computed in float32
  and only the result rounded, so the winners are found on the join rounded to the op's dtype.
- ``agg`` prod: ``g`` times the product of the *other* factors of the group, computed without
  dividing by zero: with ``P`` the product of the group's nonzero factors and ``z`` its number of
  zeros, a nonzero factor gets ``P / f`` when ``z == 0`` (else 0) and a zero factor gets ``P``
  when ``z == 1`` (else 0) — the exclusive product, exact in the presence of zeros.

Label bookkeeping (:func:`onto`): a label repeated within ``l_i`` (``ii->i``) receives its
values on the diagonal only — the adjoint is computed over fresh labels for the repeats and
multiplied by a diagonal fill ``x_a == x_b`` (free: computed where it is read); a label of
``l_i`` that no other operand of the adjoint carries (it was summed away in the forward) is
added back by a broadcast; a label of the op that the adjoint's operands no longer carry (the
operand it came from is not read by ``∂f/∂x_i``) multiplies the adjoint by its size.

>>> from einjoin.ir import ops
>>> a = ops.input_node("a", (2, 3), "float64"); b = ops.input_node("b", (3, 4), "float64")
>>> y = ops.einsum_node([a, b], ("ij", "jk"), "ik", "mul", "sum")
>>> g = ops.input_node("g", (2, 4), "float64")
>>> da, db = einsum_adjoints(y, g, (True, True))
>>> da.op.equation, str(da.op.join), db.op.equation
('ik,jk->ij', 'x0 * x1', 'ik,ij->jk')
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from einjoin.errors import ExpressionError
from einjoin.ir import ops
from einjoin.ir.derivative import vjp_join
from einjoin.ir.fold import fold
from einjoin.ir.node import Node
from einjoin.ir.opkinds import Einsum
from einjoin.ir.scalar import Arg, Call, Const, Expr, is_product, num_args, substitute

__all__ = ["einsum_adjoints", "onto", "JOIN_HITS"]

_HALF = ("float16", "bfloat16")

# "agg:<name>" and "join:<expr>" -> how many adjoints were built for it (the tests' hit counter)
JOIN_HITS: dict[str, int] = {}


def _shown(e: Expr) -> str:
    """``str(e)``, or a placeholder for an expression nested too deeply to print."""
    try:
        return str(e)
    except RecursionError:
        return "<deep join>"


def _hit(key: str) -> None:
    JOIN_HITS[key] = JOIN_HITS.get(key, 0) + 1


def _adjoint_join(expr: Expr, i: int, seed: Expr, dtypes: Sequence[str]) -> Expr:
    """``seed · ∂expr/∂x_i``: for a product of distinct arguments (the contraction case) the seed
    times the other arguments, a plain product; anything else through
    :func:`einjoin.ir.derivative.vjp_join`, which places the seed inside the branches of masks
    (``where``, ``relu``, ``max``) as torch's backward does, so a masked position gets an exact 0
    even where the seed or the other branch is infinite (causal ``-inf`` scores)."""
    n = num_args(expr)
    if n >= 1 and is_product(expr, n):
        out = seed
        for j in range(n):
            if j != i:
                out = Call("mul", (out, Arg(j)))
        return out
    return vjp_join(expr, i, seed, dtypes)


def _reuse(expr: Expr, f: Expr, value: Expr) -> Expr:
    """``expr`` with every sub-expression equal to ``f`` replaced by ``value``."""
    if expr == f:
        return value
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(_reuse(a, f, value) for a in expr.args))
    return expr


def _compact(expr: Expr, inputs: Sequence[Node], labels: Sequence[Sequence[str]]
             ) -> tuple[Expr, list[Node], list[tuple[str, ...]]]:
    """Drop the inputs ``expr`` does not read and merge repeated (node, labels) pairs;
    renumber the arguments."""
    used: list[int] = []

    def walk(e: Expr) -> None:
        if isinstance(e, Arg):
            if e.index not in used:
                used.append(e.index)
        elif isinstance(e, Call):
            for a in e.args:
                walk(a)

    walk(expr)
    slot: dict[tuple[Node, tuple[str, ...]], int] = {}
    new_args: dict[int, Expr] = {}
    nodes: list[Node] = []
    ls: list[tuple[str, ...]] = []
    for k in used:  # in order of appearance: the cotangent first
        key = (inputs[k], tuple(labels[k]))
        if key not in slot:
            slot[key] = len(nodes)
            nodes.append(inputs[k])
            ls.append(tuple(labels[k]))
        new_args[k] = Arg(slot[key])
    return substitute(expr, [new_args.get(k, Const(0)) for k in range(len(inputs))]), nodes, ls


def onto(inputs: Sequence[Node], in_labels: Sequence[Sequence[str]], join: Expr,
         target_labels: Sequence[str], target_shape: tuple[int, ...]) -> Node:
    """The einsum of ``join`` over ``inputs`` summed onto ``target_labels`` (which may repeat a
    label: its values then lie on the diagonal, zeros elsewhere; and may hold labels no input
    carries: the result is broadcast along them).

    >>> from einjoin.ir import ops
    >>> g = ops.input_node("g", (3,), "float64")
    >>> d = onto([g], ["i"], Arg(0), ("i", "i"), (3, 3))
    >>> d.op.equation, str(d.op.join), str(d.inputs[1].op.expr)
    ('i,ia->ia', 'x0 * x1', 'where(x0 == x1, 1.0, 0.0)')
    """
    grid = {lab: d for x, ls in zip(inputs, in_labels) for lab, d in zip(ls, x.shape)}
    join, nodes, labels = _compact(join, inputs, in_labels)
    # a label of the op's grid that no input read by the join carries (nor the target) still
    # counts its size: summing a value that does not vary along it multiplies it by the size
    kept = {lab for ls in labels for lab in ls} | set(target_labels)
    factor = 1
    for lab, d in grid.items():
        if lab not in kept:
            factor *= d
    if factor != 1:
        join = Call("mul", (join, Const(factor)))
    taken = {lab for ls in labels for lab in ls} | set(target_labels)
    fresh = iter(c for c in string.ascii_letters if c not in taken)
    first: dict[str, int] = {}
    pos: list[str] = []
    pairs: list[tuple[int, int]] = []
    for p, lab in enumerate(target_labels):
        if lab in first:
            pairs.append((first[lab], p))
            pos.append(next(fresh))
        else:
            first[lab] = p
            pos.append(lab)
    if pairs:
        cond: Expr = Call("eq", (Arg(pairs[0][0]), Arg(pairs[0][1])))
        for a, b in pairs[1:]:
            cond = Call("logical_and", (cond, Call("eq", (Arg(a), Arg(b)))))
        dtype = _float_dtype(nodes)
        mask = ops.fill_node(target_shape, dtype, Call("where", (cond, Const(1.0), Const(0.0))))
        join = Call("mul", (join, Arg(len(nodes))))
        nodes.append(mask)
        labels.append(tuple(pos))
    present = {lab for ls in labels for lab in ls}
    out = tuple(lab for lab in pos if lab in present)
    y = fold(ops.einsum_node(nodes, labels, out, join, "sum"))
    if len(out) < len(pos):
        dims = tuple(p for p, lab in enumerate(pos) if lab in present)
        y = fold(ops.broadcast_node(y, target_shape, dims))
    return y


def _float_dtype(nodes: Sequence[Node]) -> str:
    for n in nodes:
        if n.dtype.startswith(("float", "bfloat")):
            return n.dtype
    return "float32"


def _count(node: Node, equal: Expr, extra: Sequence[Node], extra_labels: Sequence[Sequence[str]],
           dtype: str) -> Node:
    """An einsum over ``node``'s inputs (plus ``extra``) onto its output labels: the number of
    positions where the bool expression ``equal`` holds, as a float of ``dtype``'s precision
    (float32 for half types: exact counts beyond 2048)."""
    op: Einsum = node.op  # type: ignore[assignment]
    c = fold(ops.einsum_node(list(node.inputs) + list(extra), list(op.in_labels) + list(extra_labels),
                             op.out_labels, Call("where", (equal, Const(1.0), Const(0.0))), "sum"))
    want = "float64" if dtype == "float64" else "float32"
    return fold(ops.cast_node(c, want))


def einsum_adjoints(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """The cotangent of each input of the einsum ``node`` (None where not ``wanted`` or where
    the join does not depend on it), given the cotangent ``g`` of its output."""
    op: Einsum = node.op  # type: ignore[assignment]
    try:
        if (op.agg.name in ("max", "min") and node.dtype in _HALF
                and not isinstance(op.join, Arg)):
            return _rounded_extremum(node, g, wanted)
        return _adjoints(node, g, wanted, node)
    except RecursionError:
        # the parser takes joins nested ~100 deep; their derivatives nest deeper still
        raise ExpressionError(f"the gradient of einsum {op.equation!r} (shape {node.shape}): its "
                              f"join nests too deeply to differentiate; split it into several "
                              f"einsums") from None


def _rounded_extremum(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """A half-precision max/min over a computed join: the join is evaluated in float32 and only
    the result is rounded, so comparing the recomputed float32 join with the half result finds
    no winner (every gradient 0). The join is taken apart instead: ``y = max(fj)`` with
    ``fj`` the join rounded to the node's dtype (an elementwise einsum over the op's grid),
    whose winners compare exactly; rounding is monotone, so ``y`` is the forward value."""
    op: Einsum = node.op  # type: ignore[assignment]
    grid = list(op.out_labels)
    for ls in op.in_labels:
        grid += [lab for lab in ls if lab not in grid]
    fj = fold(ops.einsum_node(list(node.inputs), op.in_labels, tuple(grid), op.join, None))
    pick = ops.einsum_node([fj], [tuple(grid)], op.out_labels, Arg(0), op.agg)
    (gf,) = _adjoints(pick, g, (True,), node)  # node holds pick's value: never recomputed
    assert gf is not None
    return _adjoints(fj, fold(ops.cast_node(gf, fj.dtype)), wanted, fj)


def _adjoints(node: Node, g: Node, wanted: Sequence[bool], value: Node
              ) -> tuple[Node | None, ...]:
    """:func:`einsum_adjoints` with ``value`` a node holding ``node``'s value (itself, or the
    forward node it stands for)."""
    op: Einsum = node.op  # type: ignore[assignment]
    f = op.join
    xs = list(node.inputs)
    n = len(xs)
    agg = op.agg.name
    _hit(f"agg:{agg}")
    _hit(f"join:{_shown(f)}")
    base_nodes: list[Node] = xs + [g]
    base_labels: list[tuple[str, ...]] = [tuple(ls) for ls in op.in_labels] + [op.out_labels]
    G = Arg(n)  # the cotangent, after the forward operands
    extra_nodes: list[Node] = []
    extra_labels: list[tuple[str, ...]] = []
    if agg in ("max", "min"):
        Y = Arg(n + 1)
        count = _count(node, Call("eq", (f, Arg(n))), [value], [op.out_labels], node.dtype)
        C = Arg(n + 2)
        extra_nodes, extra_labels = [value, count], [op.out_labels, op.out_labels]
    elif agg == "prod":
        zero = Call("eq", (f, Const(0)))
        nonzero_prod = fold(ops.einsum_node(xs, op.in_labels, op.out_labels,
                                            Call("where", (zero, Const(1), f)), "prod"))
        zeros = _count(node, zero, [], [], node.dtype)
        P, Z = Arg(n + 1), Arg(n + 2)
        extra_nodes, extra_labels = [nonzero_prod, zeros], [op.out_labels, op.out_labels]
    dtypes = [x.dtype for x in base_nodes + extra_nodes]
    out: list[Node | None] = []
    for i in range(n):
        if not wanted[i]:
            out.append(None)
            continue
        if agg in ("max", "min"):
            # ties split evenly; the seed sits inside the mask, so a position that lost gets an
            # exact 0 whatever its derivative (an infinite one included)
            # a NaN result has no winner (count 0): the whole group gets NaN, as torch's
            # amax backward gives (grad / 0 * 0)
            lost = Call("where", (Call("ne", (Y, Y)), Y, Const(0)))
            join: Expr = Call("where", (Call("eq", (f, Y)), _adjoint_join(f, i, Call("div", (G, C)), dtypes),
                                        lost))
        elif agg == "prod":
            # g times the exclusive product of the group (no division by a zero factor)
            excl = Call("where", (zero, Call("where", (Call("eq", (Z, Const(1))), P, Const(0))),
                                  Call("where", (Call("eq", (Z, Const(0))), Call("div", (P, f)),
                                                 Const(0)))))
            join = _adjoint_join(f, i, Call("mul", (G, excl)), dtypes)
        else:
            join = _adjoint_join(f, i, G, dtypes)
            if agg == "none" and isinstance(f, Call):
                # an elementwise op's value is at hand: exp' = exp, tanh' = 1 - tanh**2, and the
                # softmax's exp(x0 - x1)' read the forward output instead of recomputing it (as
                # torch saves the result), so ``g * exp(x0 - x1)`` becomes the product ``g * y``
                join = _reuse(join, f, Arg(len(base_nodes) + len(extra_nodes)))
        if join == Const(0):  # the join does not read x_i
            out.append(None)
            continue
        out.append(onto(base_nodes + extra_nodes + [value], base_labels + extra_labels + [op.out_labels],
                        join, op.in_labels[i], xs[i].shape))
    return tuple(out)
