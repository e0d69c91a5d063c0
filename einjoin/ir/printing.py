"""The readable printed form of nodes and graphs.

>>> from einjoin.ir import ops
>>> from einjoin.ir.graph import Graph
>>> x = ops.input_node("x", (4, 8), "float32"); w = ops.input_node("w", (8, 2), "float32")
>>> print(Graph([ops.einsum_node([x, w], ("ij", "jk"), "ik", "mul", "sum")]))
graph(x: float32[4, 8], w: float32[8, 2]) {
  %0 = einsum[ij,jk->ik | x0 * x1 | sum](x, w) : float32[4, 2]
  return %0
}
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from einjoin.ir.opkinds import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool,
                                Reshape, ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.opkinds import Attention, AttentionGrad, RotateHalf, SparseEinsum

if TYPE_CHECKING:  # annotations only: Node prints itself through describe (no cycle)
    from einjoin.ir.graph import Graph
    from einjoin.ir.node import Node

__all__ = ["DESCRIBE_RULES", "describe", "format_graph", "type_str"]


def type_str(node: Node) -> str:
    return f"{node.dtype}[{', '.join(map(str, node.shape))}]"


def _describe_input(op: Input) -> str:
    return f"{'param' if op.param else 'input'} {op.name!r}"


def _describe_einsum(op: Einsum) -> str:
    agg = "" if op.agg.name == "none" else f" | {op.agg.name}"
    return f"einsum[{op.equation} | {op.join}{agg}]"


def _describe_broadcast(op: Broadcast) -> str:
    return f"broadcast[dims={list(op.dims)}]"


def _describe_select(op: Select) -> str:
    return "select[" + ", ".join(f"{a}:{b}" for a, b in zip(op.starts, op.stops)) + "]"


def _describe_concat(op: Concat) -> str:
    return f"concat[axis={op.axis}]"


def _describe_fill(op: Fill) -> str:
    return f"fill[{op.expr}]"


def _describe_scatter_add(op: ScatterAdd) -> str:
    return "scatter_add"


def _pairs(pads: tuple[tuple[int, int], ...]) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in pads) + "]"


def _describe_conv(op: Conv) -> str:
    parts = [f"stride={list(op.stride)}", f"pad={_pairs(op.padding)}"]
    if any(d != 1 for d in op.lhs_dilation):
        parts.append(f"lhs_dilation={list(op.lhs_dilation)}")
    if any(d != 1 for d in op.rhs_dilation):
        parts.append(f"dilation={list(op.rhs_dilation)}")
    if op.groups != 1:
        parts.append(f"groups={op.groups}")
    return f"conv[{', '.join(parts)}]"


def _describe_pool(op: Pool) -> str:
    parts = [f"window={list(op.window)}", f"stride={list(op.stride)}", f"pad={_pairs(op.padding)}"]
    if any(d != 1 for d in op.dilation):
        parts.append(f"dilation={list(op.dilation)}")
    return f"{'windows' if op.agg.name == 'none' else op.agg.name + '_pool'}[{', '.join(parts)}]"


def _describe_topk(op: TopK) -> str:
    which = "indices" if op.indices else "values"
    return f"topk[dim={op.axis}, k={op.k}, {'largest' if op.largest else 'smallest'}, {which}]"


def _describe_rotate_half(op: RotateHalf) -> str:
    return f"{'-' if op.sign < 0 else ''}rotate_half[dim={op.axis}]"


def _describe_attention(op: Attention) -> str:
    return f"attention[scale={op.scale!r}{', causal' if op.causal else ''}{_window(op.window)}]"


def _describe_attention_grad(op: AttentionGrad) -> str:
    return (f"attention_grad[{','.join(op.parts)}, scale={op.scale!r}{', causal' if op.causal else ''}"
            f"{_window(op.window)}]")


def _window(window: int | None) -> str:
    return "" if window is None else f", window={window}"


def _describe_sparse_einsum(op: SparseEinsum) -> str:
    # the sparse constant's labels marked by its name (the node's arguments are the dense operands)
    a = op.operand
    terms = ["".join(ls) for ls in op.in_labels]
    terms[op.position] = f"{a.name}{{{terms[op.position]}}}"
    agg = "" if op.agg == "sum" else f", agg={op.agg}"
    return (f"sparse_einsum[{','.join(terms)}->{''.join(op.out_labels)}{agg} | {a.name}: sparse "
            f"{a.dtype_name}[{', '.join(map(str, a.shape))}], {a.nnz} stored]")


def _bare(op: object) -> str:  # a kind without parameters: its name
    return type(op).__name__.lower()


# how each node kind prints: op -> ``kind[parameters]``
DESCRIBE_RULES: dict[type, Callable[[Any], str]] = {
    Input: _describe_input,
    Einsum: _describe_einsum,
    Reshape: _bare,
    Broadcast: _describe_broadcast,
    Select: _describe_select,
    Concat: _describe_concat,
    Fill: _describe_fill,
    Gather: _bare,
    ScatterAdd: _describe_scatter_add,
    Cast: _bare,
    Conv: _describe_conv,
    Pool: _describe_pool,
    TopK: _describe_topk,
    RotateHalf: _describe_rotate_half,
    Attention: _describe_attention,
    AttentionGrad: _describe_attention_grad,
    SparseEinsum: _describe_sparse_einsum,
}


def describe(node: Node) -> str:
    """The op with its parameters, without inputs: ``einsum[ij,jk->ik | x0 * x1 | sum]``."""
    return rule_for(DESCRIBE_RULES, node.op, "the printed forms (einjoin.ir.printing.DESCRIBE_RULES)")(
        node.op)


def _input_name(name: str) -> str:
    # an input named "%0", "a b" or "a\nb" would read as another node or break the line: quote
    # it (state-dict keys such as "layers.0.weight" stay as they are)
    return name if re.fullmatch(r"[\w.]+", name) else repr(name)


def format_graph(graph: Graph, note: Callable[[Node], str] | None = None) -> str:
    """One line per node in topological order; ``note`` may append text (a spec, a cost)."""
    names: dict[Node, str] = {}
    for x in graph.inputs:
        names[x] = _input_name(x.op.name)  # type: ignore[union-attr]
    lines = [f"graph({', '.join(f'{names[x]}: {type_str(x)}' for x in graph.inputs)}) {{"]
    k = 0
    for node in graph.nodes:
        if node in names:
            continue
        names[node] = f"%{k}"
        k += 1
        args = ", ".join(names[i] for i in node.inputs)
        extra = f"   # {note(node)}" if note is not None and note(node) else ""
        lines.append(f"  {names[node]} = {describe(node)}({args}) : {type_str(node)}{extra}")
    lines.append("  return " + ", ".join(names[o] for o in graph.outputs))
    lines.append("}")
    return "\n".join(lines)
