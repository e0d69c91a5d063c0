"""The IR: one immutable node type, op payloads as data, shape/dtype inference, printing."""

from einjoin.ir.agg import AGGS, Agg, get_agg
from einjoin.ir.graph import Graph, as_nodes
from einjoin.ir.node import (FACTS, KINDS, Attention, AttentionGrad, Broadcast, Cast, Concat, Conv, Einsum, Fill,
                             Gather, Input, KindFacts, Node, Op, Pool, Reshape, RotateHalf, ScatterAdd, Select, TopK,
                             rule_for)
from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const, Expr, parse_join

__all__ = ["AGGS", "Agg", "get_agg", "Graph", "as_nodes", "Node", "Op", "Input", "Einsum",
           "Reshape", "Broadcast", "Select", "Concat", "Fill", "Gather", "ScatterAdd", "Cast", "Conv", "Pool", "TopK",
           "RotateHalf", "Attention", "AttentionGrad", "FUNCTIONS",
           "Arg", "Call", "Const", "Expr", "parse_join", "FACTS", "KINDS", "KindFacts", "rule_for"]
