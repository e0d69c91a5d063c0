"""The reference semantics: evaluate a graph with numpy, node by node. The oracle for every layer.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 3))
>>> ej.reference(x.sum(1), x=np.ones((2, 3)))
array([3., 3.], dtype=float32)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.ir.dtypes import canonical_dtype, kind, numpy_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.kernels import eval_node
from einjoin.ir.node import Input, Node

__all__ = ["reference", "bind_feeds", "to_numpy"]


def to_numpy(value: Any, what: str) -> np.ndarray:
    """A numpy view of an array-like (numpy, torch, nested lists, scalars)."""
    if isinstance(value, np.ndarray):
        return value
    mod = type(value).__module__
    if mod.startswith("torch"):
        t = value.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes
            return t.view(dtype=__import__("torch").int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if isinstance(value, (list, tuple, int, float, bool, np.generic)):
        try:
            return np.asarray(value)
        except ValueError:
            raise EinjoinError(f"{what}: {type(value).__name__} is not a rectangular array") from None
    if hasattr(value, "__array__"):
        return np.asarray(value)
    raise EinjoinError(f"{what}: expected an array (numpy or torch), got {type(value).__name__}")


def bind_feeds(graph: Graph, args: Sequence[Any] = (), feeds: Mapping[str, Any] | None = None
               ) -> dict[Node, np.ndarray]:
    """Match positional ``args`` (in input declaration order) and keyword ``feeds`` (by name) to
    the graph's inputs; check names, shapes and dtype kinds; cast within a kind."""
    feeds = dict(feeds or {})
    if len(args) > len(graph.inputs):
        raise EinjoinError(f"{len(args)} positional inputs given but the graph has "
                           f"{len(graph.inputs)}: {', '.join(graph.input_by_name)}")
    bound: dict[str, Any] = {}
    for x, v in zip(graph.inputs, args):
        bound[x.op.name] = v  # type: ignore[union-attr]
    for name, v in feeds.items():
        if name not in graph.input_by_name:
            raise EinjoinError(f"unknown input {name!r}; the graph's inputs are "
                               f"{', '.join(graph.input_by_name) or '(none)'}")
        if name in bound:
            raise EinjoinError(f"input {name!r} given both by position and by name")
        bound[name] = v
    out: dict[Node, np.ndarray] = {}
    for x in graph.inputs:
        name = x.op.name  # type: ignore[union-attr]
        if name not in bound:
            raise EinjoinError(f"missing input {name!r} ({x.dtype}{list(x.shape)})")
        arr = to_numpy(bound[name], f"input {name!r}")
        if tuple(arr.shape) != x.shape:
            raise ShapeError(f"input {name!r}: expected shape {x.shape}, got {tuple(arr.shape)}")
        try:
            got = canonical_dtype(arr.dtype)
        except DTypeError:
            got = None
        if got is None or kind(got) != kind(x.dtype):
            if not (arr.dtype.kind in "iu" and x.dtype == "int64"):
                raise DTypeError(f"input {name!r}: expected {x.dtype}, got {arr.dtype}")
        out[x] = arr.astype(numpy_dtype(x.dtype), copy=False)
    return out


def _own(x: np.ndarray, fed: list[np.ndarray]) -> np.ndarray:
    # an output that passes an input through must not alias the caller's array
    return x.copy() if any(np.may_share_memory(x, f) for f in fed) else x


def reference(outputs: Any, *args: Any, **inputs: Any) -> Any:
    """Evaluate ``outputs`` (a tensor or a list/tuple of tensors) with numpy; inputs by name
    (or by position in declaration order). Returns an array, or a tuple of arrays."""
    graph = Graph(outputs)
    values: dict[Node, np.ndarray] = dict(bind_feeds(graph, args, inputs))
    for node in graph.nodes:
        if isinstance(node.op, Input):
            continue
        values[node] = eval_node(node, [values[i] for i in node.inputs])
    fed = [values[x] for x in graph.inputs]
    results = tuple(_own(np.asarray(values[o], order="C"), fed) for o in graph.outputs)
    return results if isinstance(outputs, (list, tuple)) else results[0]
