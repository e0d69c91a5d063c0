"""The reference semantics: evaluate a graph with numpy, node by node. The oracle for every layer.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 3))
>>> ej.reference(x.sum(1), x=np.ones((2, 3), np.float32))
array([3., 3.], dtype=float32)
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.ir.dtypes import canonical_dtype, exact_cast, is_bfloat16, numpy_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.kernels import eval_node
from einjoin.ir.node import Node
from einjoin.ir.ops import declared_elsewhere

__all__ = ["reference", "bind_feeds", "to_numpy", "FEED_HOOKS"]

# feeds that stand for several inputs, rewritten into plain ones before they are checked:
# (graph, feeds by name, the inputs that may be left out) -> feeds by name (einjoin.sparse.feed: a
# sparse tensor fed by name is its keys and values inputs); registered by the floors above
FEED_HOOKS: list[Callable[[Graph, dict[str, Any], Collection[str]], dict[str, Any]]] = []


def _torch_to_numpy(t: Any, what: str) -> np.ndarray:
    # Tensors without values (meta, fake) cannot be fed; other layouts become dense (exact).
    import torch
    if t.device.type == "meta" or type(t).__name__ in ("FakeTensor", "FunctionalTensor"):
        raise EinjoinError(
            f"{what}: a torch tensor on the {t.device.type!r} device ({type(t).__name__}, "
            f"{t.dtype}{list(t.shape)}) holds no data, only a shape and dtype; feed a tensor with "
            f"values (for example one made on 'cpu')")
    if t.is_quantized:
        raise DTypeError(f"{what}: a quantized torch tensor ({t.dtype}); feed t.dequantize() or "
                         f"declare the input with the dtype of its values")
    try:
        t = t.detach()  # requires_grad is fine: einjoin reads values only
        if t.layout != torch.strided:  # sparse or mkldnn: the same values, densified
            t = t.to_dense()
        t = t.cpu().resolve_conj().resolve_neg()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return np.asarray(t.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16))
        return np.asarray(t.numpy())
    except TypeError as e:  # a dtype numpy has no type for (float8, ...)
        raise DTypeError(f"{what}: torch {t.dtype} has no numpy type ({e}); feed it converted, "
                         f"for example t.float()") from None
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise EinjoinError(f"{what}: cannot read this torch tensor ({type(t).__name__}, "
                           f"{t.dtype}{list(t.shape)}, layout {t.layout}, device {t.device}) as an "
                           f"array: {e}") from None


def to_numpy(value: Any, what: str) -> np.ndarray:
    """A numpy view of an array-like (numpy, torch, nested lists, scalars)."""
    if isinstance(value, np.ndarray):
        return value
    mod = type(value).__module__
    if mod.startswith("torch") and hasattr(value, "detach"):
        return _torch_to_numpy(value, what)
    if isinstance(value, (list, tuple, int, float, bool, np.generic)):
        try:
            return np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            raise EinjoinError(f"{what}: {type(value).__name__} is not a rectangular array of "
                               f"numbers") from None
    if hasattr(value, "__array__"):
        try:
            return np.asarray(value)
        except Exception as e:  # a foreign __array__ may raise anything
            raise EinjoinError(f"{what}: {type(value).__name__} did not convert to an array: "
                               f"{e}") from None
    raise EinjoinError(f"{what}: expected an array (numpy or torch), got {type(value).__name__}")


_CATEGORY = {"b": 0, "i": 1, "u": 1, "f": 2}


def _category(npd: np.dtype) -> int | None:
    """0 bool, 1 integer, 2 float (bfloat16 included), None for anything else."""
    return 2 if is_bfloat16(npd) else _CATEGORY.get(npd.kind)


def _weak(value: Any) -> bool:
    # Python numbers and lists of them carry no dtype of their own (as in torch.tensor(data,
    # dtype=...)): they take the input's dtype when their kind allows it
    return isinstance(value, (list, tuple, int, float, bool)) and not isinstance(value, np.generic)


def _cast_feed(name: str, value: Any, arr: np.ndarray, dtype: str) -> np.ndarray:
    """``arr`` in ``dtype``, or a DTypeError when the cast could change a value."""
    target = numpy_dtype(dtype)
    if arr.dtype == target:
        return arr
    fix = f"feed {name}.astype({_np_name(dtype)}) if the changed values are intended"
    own = _feed_dtype_name(arr.dtype)
    if own is not None:
        fix += f", or declare the input with ej.input({name!r}, shape, {own!r})"
    if _weak(value):
        cat = _category(arr.dtype)
        tcat = _category(target)
        if cat is None or cat > tcat or (cat == 0) != (tcat == 0):  # type: ignore[operator]
            raise DTypeError(f"input {name!r}: the Python values given read as {arr.dtype}, which "
                             f"an input of dtype {dtype} cannot take without changing them; {fix}")
        with np.errstate(all="ignore"):  # the checks below say what went wrong, not numpy
            out = arr.astype(target)
            if cat == 1 and target.kind in "iu":
                # a range check: a round trip through a wrapped value (2**63 read as uint64, into
                # int64) would compare equal
                info = np.iinfo(target)
                exact = arr.size == 0 or (int(arr.min()) >= info.min and int(arr.max()) <= info.max)
            else:
                exact = cat != 1 or np.array_equal(out.astype(arr.dtype), arr)
            finite = cat != 2 or np.array_equal(np.isfinite(out), np.isfinite(arr))
        if not exact:
            raise DTypeError(f"input {name!r}: these integers are not all exact in {dtype}; {fix}")
        if not finite:
            raise DTypeError(f"input {name!r}: these numbers overflow {dtype}; {fix}")
        return out
    if exact_cast(arr.dtype, dtype):
        return arr.astype(target)
    why = ("values it cannot hold exactly" if _category(arr.dtype) == _category(target)
           else "another kind of value")
    raise DTypeError(f"input {name!r}: expected {dtype}, got {arr.dtype} ({why}; einjoin casts a "
                     f"feed only when no value changes); {fix}")


def _np_name(dtype: str) -> str:
    return "ml_dtypes.bfloat16" if dtype == "bfloat16" else f"np.{dtype}" if dtype != "bool" else "bool"


def _feed_dtype_name(npd: np.dtype) -> str | None:
    """The einjoin dtype of a feed's dtype, or None where einjoin has none (int32, uint64, ...)."""
    try:
        return canonical_dtype(npd.newbyteorder("=") if npd.byteorder == ">" else npd)
    except DTypeError:
        return None


def bind_feeds(graph: Graph, args: Sequence[Any] = (), feeds: Mapping[str, Any] | None = None,
               optional: Collection[str] = ()) -> dict[Node, np.ndarray]:
    """Match positional ``args`` (in input declaration order) and keyword ``feeds`` (by name) to
    the graph's inputs and check names and shapes. Positional args are refused (EinjoinError) when
    the declaration order is ambiguous (``Graph.positional_conflict``: two inputs re-declared in
    the other order). A feed of another dtype than its input's is
    cast only when the cast is exact (:func:`einjoin.ir.dtypes.exact_cast`: float16 into a
    float32 input, int32 into int64, any byte order); Python numbers and lists take the input's
    dtype when their kind allows it (ints into floats when exact, floats rounded into any float
    type they do not overflow, bools only into bool); anything else is a DTypeError naming the
    input. Inputs named in ``optional`` may be left out (a program's state: its values are
    resident); the result then has no entry for them."""
    feeds = dict(feeds or {})
    for hook in FEED_HOOKS:  # before the names are checked: a hook may feed inputs of other names
        feeds = hook(graph, feeds, optional)
    if args and graph.positional_conflict is not None:
        a, b = (x.op.name for x in graph.positional_conflict)  # type: ignore[union-attr]
        raise EinjoinError(
            f"positional inputs are ambiguous for this graph: inputs {a!r} and {b!r} were first "
            f"declared in this order but declared again the other way round (inputs are shared "
            f"between graphs, so another graph's order may be the one you see); feed them by name, "
            f"e.g. ({a}=..., {b}=...)")
    if len(args) > len(graph.inputs):
        raise EinjoinError(f"{len(args)} positional inputs given but the graph has "
                           f"{len(graph.inputs)}: {', '.join(graph.input_by_name)}")
    bound: dict[str, Any] = {}
    for x, v in zip(graph.inputs, args):
        bound[x.op.name] = v  # type: ignore[union-attr]
    for name, v in feeds.items():
        if name not in graph.input_by_name:
            known = f"the graph's inputs are {', '.join(graph.input_by_name) or '(none)'}"
            if declared_elsewhere(name):  # e.g. a weight its own gradient does not read
                raise EinjoinError(f"input {name!r} is not read by these outputs ({known}); leave it "
                                   f"out, or evaluate the outputs together with one that reads it "
                                   f"(a gradient need not read its own weight: d(x @ w)/dw reads x only)")
            raise EinjoinError(f"unknown input {name!r}; {known}")
        if name in bound:
            raise EinjoinError(f"input {name!r} given both by position and by name")
        bound[name] = v
    out: dict[Node, np.ndarray] = {}
    for x in graph.inputs:
        name = x.op.name  # type: ignore[union-attr]
        if name not in bound:
            if name in optional:
                continue
            raise EinjoinError(f"missing input {name!r} ({x.dtype}{list(x.shape)})")
        arr = to_numpy(bound[name], f"input {name!r}")
        if tuple(arr.shape) != x.shape:
            raise ShapeError(f"input {name!r}: expected shape {x.shape}, got {tuple(arr.shape)}")
        out[x] = _cast_feed(name, bound[name], arr, x.dtype)
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
        if node.facts.fed:
            continue
        values[node] = eval_node(node, [values[i] for i in node.inputs])
    fed = [values[x] for x in graph.inputs]
    results = tuple(_own(np.asarray(values[o], order="C"), fed) for o in graph.outputs)
    return results if isinstance(outputs, (list, tuple)) else results[0]
