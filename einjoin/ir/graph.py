"""A graph: the nodes that some outputs depend on, in topological order.

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (3,), "float32")
>>> g = Graph([ops.einsum_node([x], ("i",), "i", "exp", None)])
>>> [n.kind for n in g.nodes], [i.op.name for i in g.inputs]
(['input', 'einsum'], ['x'])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from einjoin.errors import EinjoinError
from einjoin.ir.node import Input, Node
from einjoin.ir.ops import last_declaration
from einjoin.ir.printing import format_graph

__all__ = ["Graph", "as_nodes"]


def as_nodes(outputs: object) -> tuple[Node, ...]:
    """Outputs given as a node, a frontend tensor (anything with ``.node``) or a sequence of them."""
    items: Iterable[object]
    if isinstance(outputs, (list, tuple)):
        items = outputs
    else:
        items = (outputs,)
    nodes = []
    for o in items:
        n = getattr(o, "node", o)
        if not isinstance(n, Node):
            raise EinjoinError(f"expected einjoin tensors as outputs, got {type(o).__name__}")
        nodes.append(n)
    if not nodes:
        raise EinjoinError("a graph needs at least one output")
    return tuple(nodes)


def _order_conflict(inputs: Sequence[Node]) -> tuple[Node, Node] | None:
    """Two of ``inputs`` (in first-declaration order) whose last declarations came the other way
    round, or None when both orders agree. Inputs built outside ``ops.input_node`` carry no last
    declaration and are left out."""
    last = [(x, t) for x in inputs if (t := last_declaration(x)) is not None]
    for (a, ta), (b, tb) in zip(last, last[1:]):
        if ta > tb:  # a non-increasing neighbour pair exists exactly when the orders differ
            return a, b
    return None


class Graph:
    """The sub-DAG reaching ``outputs``: ``nodes`` topologically ordered (ties by creation order),
    ``inputs`` in declaration order, ``users`` of each node. Input names must be unique.

    Inputs are hash-consed, so an input declared again keeps the place of its first declaration.
    When two inputs were last declared in the other order than they were first declared (another
    graph declared them the other way round), positional feeds would be ambiguous:
    ``positional_conflict`` then names such a pair (first-declared one first), else None, and
    positional feeding (:func:`einjoin.ir.reference.bind_feeds`) asks for names."""

    def __init__(self, outputs: object):
        self.outputs: tuple[Node, ...] = as_nodes(outputs)
        order: list[Node] = []
        state: dict[Node, int] = {}
        # iterative DFS: deep graphs (many layers) must not hit Python's recursion limit
        for root in sorted(set(self.outputs), key=lambda n: n.serial):
            stack: list[tuple[Node, int]] = [(root, 0)]
            while stack:
                node, i = stack.pop()
                if i == 0:
                    if state.get(node) == 2:
                        continue
                    state[node] = 1
                kids = sorted(set(node.inputs), key=lambda n: n.serial)
                if i < len(kids):
                    stack.append((node, i + 1))
                    if state.get(kids[i]) != 2:
                        stack.append((kids[i], 0))
                else:
                    state[node] = 2
                    order.append(node)
        self.nodes: tuple[Node, ...] = tuple(order)
        self.inputs: tuple[Node, ...] = tuple(sorted((n for n in order if isinstance(n.op, Input)),
                                                     key=lambda n: n.serial))
        by_name: dict[str, Node] = {}
        for x in self.inputs:
            name = x.op.name  # type: ignore[union-attr]
            if name in by_name:
                other = by_name[name]
                raise EinjoinError(f"two different inputs are named {name!r}: "
                                   f"{other.dtype}{list(other.shape)} and {x.dtype}{list(x.shape)}")
            by_name[name] = x
        self.input_by_name: dict[str, Node] = by_name
        self.positional_conflict: tuple[Node, Node] | None = _order_conflict(self.inputs)
        users: dict[Node, list[Node]] = {n: [] for n in order}
        for n in order:
            for x in n.inputs:
                if n not in users[x]:
                    users[x].append(n)
        self.users: dict[Node, tuple[Node, ...]] = {n: tuple(u) for n, u in users.items()}

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def params(self) -> tuple[Node, ...]:
        """The inputs marked as parameters (``ej.param``)."""
        return tuple(x for x in self.inputs if x.op.param)  # type: ignore[union-attr]

    @property
    def ops(self) -> Sequence[Node]:
        """The nodes that compute something (every node but the inputs)."""
        return tuple(n for n in self.nodes if not isinstance(n.op, Input))

    def __str__(self) -> str:
        return format_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {len(self.inputs)} inputs, {len(self.ops)} ops, {len(self.outputs)} outputs>"
