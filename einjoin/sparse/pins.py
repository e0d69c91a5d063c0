"""Pins of a graph's sparse einsums given to ``ej.compile`` (issue 24): ``blocks={"j": 256}``
fixes a label's block size (relational), ``relational={"i"}`` keeps a label relational (upper
case) at a block size of the planner's choice, ``engine="memory" | "duckdb"`` selects the
executor of the sparse steps. They are what ``ej.sparse_compile`` takes for one einsum, given
once for every ``SparseEinsum`` node of the graph that has the label.

The compiler rewrites the graph (:func:`pin_graph`): each sparse node gets an operand carrying
the pins (``GraphSparse.pinned`` / ``FedSparse.pinned``, one per operand, so a forward node and
its gradient's share their plans), and the nodes reading it are rebuilt over it. A pin no sparse
node can take is refused naming it: a label no sparse einsum has, a block size larger than the
label, an unknown engine, or pins on a graph without sparse einsums. ``explain()`` prints each
pinned node's layout (every sparse node's when none is pinned) in upper-case-lower-case notation,
with the joined tuples its kernels' plans estimated and those their last runs joined
(:func:`pinned_lines`).

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> a = ej.sparse("A", scipy.sparse.random(40, 30, density=0.1, random_state=0))
>>> h = ej.input("h", (30, 8), "float64")
>>> prog = ej.compile(ej.einsum("ij,jk->ik", a, h), blocks={"j": 8}, relational={"i"}, quiet=True)
>>> hv = np.random.default_rng(0).normal(size=(30, 8))
>>> bool(np.allclose(prog.run(h=hv), a.todense() @ hv))
True
>>> print(pinned_lines(prog.graph).strip())  # doctest: +ELLIPSIS
sparse einsums (pinned at compile: blocks j=8; relational i; engine memory):
  ij,jk->ik (A [40, 30]) -> [40, 8]: ...Jj... blocks ...j=8...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, cast

import numpy as np

from einjoin.errors import EinjoinError, PartitionError, UnsupportedOpError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.sparse_einsum import sparse_einsums
from einjoin.sparse.duckdb_exec import require_duckdb
from einjoin.sparse.plan import ENGINES

__all__ = ["Pins", "check_pins", "pin_graph", "pinned_lines"]

Pins = tuple[tuple[tuple[str, int], ...], tuple[str, ...], str | None]
"""(blocks as (label, size) pairs, relational labels, engine or None), as :func:`check_pins` gives."""


def _label(lab: Any, what: str) -> str:
    if not isinstance(lab, str) or len(lab) != 1 or not lab.isalpha():
        raise EinjoinError(f"ej.compile({what}): {lab!r:.40} is not an einsum label (one letter)")
    return lab


def check_pins(blocks: Any, relational: Any, engine: Any) -> Pins:
    """The pins as plain data, their types checked (an :class:`EinjoinError` naming the option):
    ``blocks`` a mapping label -> integer >= 1, ``relational`` labels (a set, a list or a string
    of letters), ``engine`` one of :data:`einjoin.sparse.plan.ENGINES` or None.

    >>> check_pins({"j": 64}, "ik", "duckdb")
    ((('j', 64),), ('i', 'k'), 'duckdb')
    >>> check_pins({"j": 0}, None, None)
    Traceback (most recent call last):
        ...
    einjoin.errors.PartitionError: ej.compile(blocks=...): block size 0 for label 'j' must be an integer >= 1
    """
    pairs: list[tuple[str, int]] = []
    if blocks is not None:
        if isinstance(blocks, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in blocks):
            blocks = dict(blocks)  # the checked form (CompileOptions.replace checks its fields again)
        if not isinstance(blocks, Mapping):
            raise EinjoinError(f"ej.compile(blocks=...): a mapping label -> block size ({{'j': 256}}), got "
                               f"{type(blocks).__name__}")
        for lab, b in blocks.items():
            _label(lab, "blocks=...")
            if not isinstance(b, (int, np.integer)) or isinstance(b, (bool, np.bool_)) or b < 1:
                raise PartitionError(f"ej.compile(blocks=...): block size {b!r:.40} for label {lab!r} must be an "
                                     f"integer >= 1")
            pairs.append((lab, int(b)))
    labels: list[str] = []
    if relational is not None:
        if not isinstance(relational, (str, Collection)) or isinstance(relational, Mapping):
            raise EinjoinError(f"ej.compile(relational=...): labels ({{'i'}}, ['i', 'j'] or 'ij'), got "
                               f"{type(relational).__name__}")
        labels = sorted({_label(lab, "relational=...") for lab in relational})
    if engine is not None and not (isinstance(engine, str) and engine in ENGINES):
        raise UnsupportedOpError(f"ej.compile(engine={engine!r:.40}): unknown engine of sparse einsums; known: "
                                 f"{', '.join(ENGINES)}")
    if engine == "duckdb":
        require_duckdb("ej.compile(engine='duckdb')")  # a missing package named at compile, not at the first run
    return tuple(sorted(pairs)), tuple(labels), engine


def _sizes(node: Node) -> dict[str, int]:
    op = cast(SparseEinsum, node.op)
    shapes = [x.shape for x in node.inputs[:len(op.dense_labels)]]
    shapes.insert(op.position, tuple(op.operand.shape))
    return {lab: n for shape, ls in zip(shapes, op.in_labels) for lab, n in zip(ls, shape)}


def _what(node: Node) -> str:
    op = cast(SparseEinsum, node.op)
    return f"sparse_einsum {op.equation!r} (sparse operand {op.operand.name!r} {list(op.operand.shape)})"


def pin_graph(graph: Graph, pins: Pins) -> dict[Node, Node]:
    """Each node of ``graph`` that the pins change (a sparse einsum, and everything reading one)
    -> its rebuilt node: the sparse einsums over operands carrying the pins. Checks them against
    the graph first (errors name the label, its size and the sparse einsum)."""
    blocks, relational, engine = pins
    if not blocks and not relational and engine is None:
        return {}
    sparse = sparse_einsums(graph.nodes)
    chosen = set(sparse)
    given = ", ".join(part for part in (f"blocks={dict(blocks)}" if blocks else "",
                                        f"relational={set(relational)}" if relational else "",
                                        f"engine={engine!r}" if engine is not None else "") if part)
    if not sparse:
        raise EinjoinError(f"ej.compile({given}): these pin sparse einsums, and the graph has none (a sparse "
                           f"einsum is ej.einsum with an ej.sparse(...) or ej.sparse_input(...) operand)")
    sizes = {n: _sizes(n) for n in sparse}
    for lab in dict.fromkeys([lab for lab, _ in blocks] + list(relational)):
        if not any(lab in s for s in sizes.values()):
            have = "; ".join(f"{_what(n)}: {''.join(s)!r}" for n, s in sizes.items())
            raise EinjoinError(f"ej.compile({given}): label {lab!r} is pinned but no sparse einsum of the graph has "
                               f"it (their labels: {have})")
    for lab, b in blocks:
        for n, s in sizes.items():
            if lab in s and b > max(s[lab], 1):
                raise PartitionError(f"ej.compile(blocks=...): block size {b} for label {lab!r} does not fit "
                                     f"{_what(n)}, where {lab!r} has size {s[lab]}")
    operands: dict[int, Any] = {}  # one pinned operand per operand: forward and gradient share plans
    new: dict[Node, Node] = {}
    for n in graph.nodes:
        ins = tuple(new.get(x, x) for x in n.inputs)
        op: Any = n.op
        if n in chosen:
            base = op.operand
            found = operands.get(id(base))
            if found is None:
                found = operands[id(base)] = (base, base.pinned(blocks, relational, engine or "memory"))
            new[n] = Node(dataclasses.replace(op, operand=found[1]), ins, n.shape, n.dtype)
        elif ins != n.inputs:
            new[n] = Node(op, ins, n.shape, n.dtype)
    return new


def pinned_lines(graph: Graph) -> str:
    """``explain()``'s lines for a graph's pinned sparse einsums: per node its layout in
    upper-case-lower-case notation and block sizes (a constant operand's plan on the node's whole
    inputs; a fed one's as its last run chose, on the fed pattern), the pins given; "" for a graph
    without pins."""
    nodes = sparse_einsums(graph.nodes)
    if not nodes:
        return ""
    pinned = [n for n in nodes if _pins_of(n.op.operand) != ((), (), "memory")]  # type: ignore[union-attr]
    if pinned:
        blocks, relational, engine = _pins_of(pinned[0].op.operand)  # type: ignore[union-attr]
        head = (f"sparse einsums (pinned at compile: blocks {' '.join(f'{k}={b}' for k, b in blocks) or '-'}; "
                f"relational {' '.join(relational) or '-'}; engine {engine}):")
    else:  # issue 24: every op's layout in explain(), pinned or chosen from the data
        head = "sparse einsums (layouts chosen from the data's block histograms, no pins):"
    lines = ["", head]
    for n in pinned or nodes:
        op = cast(SparseEinsum, n.op)
        lines.append(f"  {op.equation} ({op.operand.name} {list(op.operand.shape)}) -> {list(n.shape)}: {_layout(n)}")
        counts = _tuple_counts(n)
        if counts:
            lines.append(f"    {counts}")
    return "\n".join(lines)


def _tuple_counts(node: Node) -> str:
    """The joined tuples the node's kernels' plans estimated against those their last runs joined
    (summed over its kernels: a node cut over devices runs one plan per part)."""
    op = cast(SparseEinsum, node.op)
    cache = getattr(op.operand, "_plans", None)
    if cache is None or op.agg not in ("sum", "max"):  # a max's gradient joins no tuples
        return ""
    steps = [s for p in cache.plans(op) for s in p.steps]
    ran = [(lay, s.counts) for s in steps if s.counts is not None and (lay := s.layout or s.ran) is not None]
    if not ran:
        return "joined tuples: run() and explain() again for the estimated vs actual counts"
    return (f"joined tuples (last run, {len(ran)} step(s) over its kernels): estimated "
            f"{sum(lay.joined for lay, _ in ran):.0f}, actual {sum(c.joined for _, c in ran)}; "
            f"{sum(c.out for _, c in ran)} output tuple(s)")


def _pins_of(operand: Any) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...], str]:
    return (tuple(getattr(operand, "blocks", ())), tuple(getattr(operand, "relational", ())),
            str(getattr(operand, "engine", "memory")))


def _layout(node: Node) -> str:
    """The node's sparse plan as notation and block sizes: for a constant operand compiled on
    zero-stride dense stand-ins of the node's input shapes (the layout depends on shapes and the
    constant's pattern only); for a fed one the plans its kernels ran last."""
    op = cast(SparseEinsum, node.op)
    operand: Any = op.operand
    if op.agg not in ("sum", "max"):  # a max node's gradient: no plan (grad_max on the stored entries' products)
        return f"the gradient of a max ({op.agg}): the products at the stored entries, no layout"
    tensor = getattr(operand, "tensor", None)
    if tensor is None:
        ran = [p for p in operand._plans.plans() if p.notation() != "?"]
        if not ran:
            return "layout chosen at run on the fed pattern (run() and explain() again to see it)"
        return "; ".join(dict.fromkeys(_shown(p) for p in ran)) + " (as last run)"
    dense = [np.broadcast_to(np.zeros((), np.float64 if x.dtype != "float32" else np.float32), x.shape)
             for x in node.inputs[:len(op.dense_labels)]]
    operands: list[Any] = list(dense)
    operands.insert(op.position, operand._float(node.dtype))
    return _shown(operand._plans.compile(op, operands))


def _shown(plan: Any) -> str:
    parts = []
    for step in plan.steps:
        lay = step.layout or step.ran
        if lay is None:
            parts.append("? (an intermediate's layout, chosen at run)")
            continue
        keyed = " ".join(f"{lab}={b}" for lab, b in lay.blocks.items() if b is not None) or "-"
        dense = [lab for lab, b in lay.blocks.items() if b is None]
        parts.append(f"{step.notation(lay)}  blocks {keyed}" + (f" ({', '.join(dense)} dense)" if dense else ""))
    return "; ".join(parts) + f"; engine {plan.engine.name}"
