"""The one node type of the IR, and the facts of each node kind.

A :class:`Node` is immutable and hash-consed: building the same op on the same inputs twice
gives the same object, so structural equality is identity and common subexpressions are
shared for free. The op payloads it carries (small frozen dataclasses — plain, hashable data)
and :func:`rule_for` are defined in :mod:`einjoin.ir.opkinds` and re-exported here, so
``from einjoin.ir.node import Einsum`` keeps working.

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (2, 3), "float32")
>>> ops.input_node("x", (2, 3), "float32") is x
True
>>> x.shape, x.dtype, x.op
((2, 3), 'float32', Input(name='x', param=False))
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.opkinds import (Attention, AttentionGrad, Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather,
                                Input, Op, Pool, Reshape, RotateHalf, ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.printing import describe

__all__ = ["Node", "Op", "Input", "Einsum", "Reshape", "Broadcast", "Select", "Concat",
           "Fill", "Gather", "ScatterAdd", "Cast", "Conv", "Pool", "TopK", "RotateHalf", "Attention",
           "AttentionGrad", "SparseEinsum", "KindFacts",
           "FACTS", "KINDS", "rule_for"]


@dataclass(frozen=True)
class KindFacts:
    """What the layers above ask of a node kind, as data (so they never test the op's class).

    - ``fed``: its value comes from the caller at run time (a graph input);
    - ``free``: computed in place, block by block, on whichever device reads it — it is never
      moved, costs no communication and is not planned (a fill);
    - ``leaf``: it reads no other node (``fed`` or ``free``);
    - ``computes``: its kernel does arithmetic (rather than only moving or cutting data);
    - ``contracts``: an extended einsum — its spec may cut aggregated labels into partials.

    Each layer's per-kind behaviour lives in that layer's table keyed by op class (kernels in
    :mod:`einjoin.ir.kernels`, decompositions in :mod:`einjoin.decomp`, ...); a test checks that
    every kind of :data:`Op` has an entry in every table, so a new kind is added table by table.

    >>> from einjoin.ir import ops
    >>> ops.input_node("x", (2,), "float32").facts.fed
    True
    """

    fed: bool = False
    free: bool = False
    computes: bool = False
    contracts: bool = False

    @property
    def leaf(self) -> bool:
        return self.fed or self.free


FACTS: dict[type, KindFacts] = {
    Input: KindFacts(fed=True),
    Einsum: KindFacts(computes=True, contracts=True),
    Reshape: KindFacts(),
    Broadcast: KindFacts(),
    Select: KindFacts(),
    Concat: KindFacts(),
    Fill: KindFacts(free=True),
    Gather: KindFacts(),
    # it adds (duplicate indices accumulate), so it computes; its aggregated index labels make
    # partial sums, but it is no einsum (``contracts`` promises an Einsum op to the planners)
    ScatterAdd: KindFacts(computes=True),
    Cast: KindFacts(computes=True),
    # window ops: their input channels (conv) are aggregated, but neither is an Einsum op
    Conv: KindFacts(computes=True),
    Pool: KindFacts(computes=True),
    TopK: KindFacts(computes=True),
    RotateHalf: KindFacts(computes=True),  # moves halves and negates one (exact)
    # fused attention and its gradients: kernels that read whole key rows (no einsum labels)
    Attention: KindFacts(computes=True),
    AttentionGrad: KindFacts(computes=True),
    # a sum of products with a sparse constant (issue 24), evaluated by the sparse engine: opaque to the planner
    SparseEinsum: KindFacts(computes=True),
}
KINDS: tuple[type, ...] = tuple(FACTS)  # every op class; each layer's rule table covers them all

_serial = itertools.count()
_interned: weakref.WeakValueDictionary[Any, Node] = weakref.WeakValueDictionary()


class Node:
    """An immutable IR node: an op payload, its input nodes, and the inferred shape and dtype.

    Build nodes with the functions of :mod:`einjoin.ir.ops` (they validate and infer);
    ``serial`` is the creation order, used only to print and to order graph inputs."""

    __slots__ = ("op", "inputs", "shape", "dtype", "serial", "_hash", "__weakref__")
    op: Op
    inputs: tuple[Node, ...]
    shape: tuple[int, ...]
    dtype: str
    serial: int
    _hash: int

    def __new__(cls, op: Op, inputs: tuple[Node, ...], shape: tuple[int, ...], dtype: str) -> Node:
        key = (op, inputs, shape, dtype)
        found = _interned.get(key)
        if found is not None:
            return found
        self = object.__new__(cls)
        for name, value in (("op", op), ("inputs", inputs), ("shape", shape), ("dtype", dtype),
                            ("serial", next(_serial)), ("_hash", hash(key))):
            object.__setattr__(self, name, value)
        _interned[key] = self
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("einjoin IR nodes are immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other

    def __reduce__(self) -> Any:
        return (Node, (self.op, self.inputs, self.shape, self.dtype))

    @property
    def kind(self) -> str:
        """The op kind: ``input``, ``einsum``, ``reshape``, ..."""
        return type(self.op).__name__.lower()

    @property
    def facts(self) -> KindFacts:
        """The kind's facts (:class:`KindFacts`): ``fed``, ``free``, ``leaf``, ``computes``, ``contracts``."""
        try:
            return FACTS[type(self.op)]
        except KeyError:  # as rule_for, inlined: the layers above ask this often
            return rule_for(FACTS, self.op, "the kind facts (einjoin.ir.node.FACTS)")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __repr__(self) -> str:
        return f"<Node #{self.serial} {describe(self)} : {self.dtype}{list(self.shape)}>"
