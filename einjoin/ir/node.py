"""The one node type of the IR, and the op payloads it carries.

A :class:`Node` is immutable and hash-consed: building the same op on the same inputs twice
gives the same object, so structural equality is identity and common subexpressions are
shared for free. Op payloads are small frozen dataclasses — plain, hashable data.

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
from typing import Any, TypeVar
from collections.abc import Mapping

from einjoin.errors import EinjoinError
from einjoin.ir.agg import Agg
from einjoin.ir.scalar import Expr

__all__ = ["Node", "Op", "Input", "Einsum", "Reshape", "Broadcast", "Select", "Concat",
           "Fill", "Gather", "Cast", "KindFacts", "FACTS", "KINDS", "rule_for"]


@dataclass(frozen=True)
class Input:
    """A graph input, fed by name at run time. ``param`` marks a parameter (a weight) as opposed
    to an activation; planners such as data parallelism read it."""

    name: str
    param: bool = False


@dataclass(frozen=True)
class Einsum:
    """``out[out_labels] = agg over missing labels of join(x_i[in_labels[i]] ...)``.

    ``agg`` is ``none`` exactly when no label is aggregated."""

    in_labels: tuple[tuple[str, ...], ...]
    out_labels: tuple[str, ...]
    join: Expr
    agg: Agg

    @property
    def all_labels(self) -> tuple[str, ...]:
        """Every label once: output labels first, then aggregated ones in order of appearance."""
        seen = list(self.out_labels)
        for ls in self.in_labels:
            for lab in ls:
                if lab not in seen:
                    seen.append(lab)
        return tuple(seen)

    @property
    def agg_labels(self) -> tuple[str, ...]:
        return tuple(lab for lab in self.all_labels if lab not in self.out_labels)

    @property
    def equation(self) -> str:
        return ",".join("".join(ls) for ls in self.in_labels) + "->" + "".join(self.out_labels)


@dataclass(frozen=True)
class Reshape:
    """Row-major reshape to the node's shape (merge and split dimensions)."""


@dataclass(frozen=True)
class Broadcast:
    """Expand to the node's shape; input dim ``i`` becomes output dim ``dims[i]`` (size 1 or equal)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class Select:
    """The sub-box ``[starts, stops)`` of the input."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]


@dataclass(frozen=True)
class Concat:
    """Inputs laid end to end along ``axis``."""

    axis: int


@dataclass(frozen=True)
class Fill:
    """A tensor with no inputs: ``expr`` evaluated over the index grid (``x_d`` is the index along
    dim ``d``): constants, iota, the causal mask ``x0 >= x1``, rotary tables."""

    expr: Expr


@dataclass(frozen=True)
class Gather:
    """``out[idx..., rest...] = table[indices[idx...], rest...]`` (embedding lookup by int64 rows)."""


@dataclass(frozen=True)
class Cast:
    """Convert to the node's dtype."""


Op = Input | Einsum | Reshape | Broadcast | Select | Concat | Fill | Gather | Cast


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
    Cast: KindFacts(computes=True),
}
KINDS: tuple[type, ...] = tuple(FACTS)  # every op class; each layer's rule table covers them all

_Rule = TypeVar("_Rule")


def rule_for(table: Mapping[type, _Rule], op: Op, table_name: str) -> _Rule:
    """``table``'s entry for ``op``'s kind: how each layer dispatches on node kinds.

    >>> rule_for({Input: "feed"}, Input("x"), "example")
    'feed'
    """
    try:
        return table[type(op)]
    except KeyError:
        raise EinjoinError(f"{table_name} has no rule for node kind {type(op).__name__!r} "
                           f"(op {op!r}); every kind needs an entry there") from None

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
        from einjoin.ir.printing import describe
        return f"<Node #{self.serial} {describe(self)} : {self.dtype}{list(self.shape)}>"
