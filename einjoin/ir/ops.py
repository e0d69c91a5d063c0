"""Constructors of IR nodes: each validates its arguments and infers shape and dtype.

Errors are raised here, at graph-construction time, and name the op, labels and shapes.

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (4, 6), "float32")
>>> y = ops.reshape_node(x, (4, 2, 3))
>>> y.shape
(4, 2, 3)
>>> ops.einsum_node([x], (("i", "j"),), ("i",), "x0", "max").shape
(4,)
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, EinsumSyntaxError, ShapeError
from einjoin.ir.agg import Agg, get_agg
from einjoin.ir.dtypes import canonical_dtype, kind, numpy_dtype
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool,
                             Reshape, ScatterAdd, Select, TopK)
from einjoin.ir.window import out_size
from einjoin.ir.scalar import Const, Expr, infer_dtype, num_args, parse_join

__all__ = ["check_shape", "check_size", "MAX_ELEMENTS", "last_declaration", "declared_elsewhere", "input_node",
           "einsum_node", "reshape_node", "broadcast_node", "select_node", "concat_node",
           "fill_node", "gather_node", "scatter_add_node", "cast_node", "conv_node", "pool_node", "topk_node"]


def _as_int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise ShapeError(f"{what}: expected an integer, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ShapeError(f"{what}: expected an integer, got {v!r}") from None


def check_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints, or a ShapeError naming ``what``. A size-0 dim
    makes an empty tensor, as in torch (``x[:, n:]``); it flows through every op."""
    if isinstance(shape, (int,)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(_as_int(d, f"{what}: shape {shape!r}") for d in shape)
    except TypeError:
        raise ShapeError(f"{what}: shape must be a tuple of ints, got {shape!r}") from None
    for d in dims:
        if d < 0:
            raise ShapeError(f"{what}: negative dimension {d} in shape {dims}")
    check_size(dims, what)
    return dims


# numpy's limit: an array's bytes (its non-zero dims multiplied, times up to 8 bytes an element)
# must fit a signed 64-bit int; a bigger shape would fail deep inside a kernel instead of here
MAX_ELEMENTS = (2 ** 63 - 1) // 8


def check_size(shape: tuple[int, ...], what: str) -> None:
    """A ShapeError naming ``what`` when ``shape`` holds more elements than numpy can address
    (:data:`MAX_ELEMENTS`; size-0 dims do not make a huge shape legal, as in numpy)."""
    n = 1
    for d in shape:
        n *= d or 1
        if n > MAX_ELEMENTS:
            raise ShapeError(f"{what}: shape {shape} holds more elements than an array can "
                             f"(at most {MAX_ELEMENTS} = (2**63 - 1) // 8)")


def _need_node(x: Any, what: str) -> Node:
    if not isinstance(x, Node):
        raise EinjoinError(f"{what}: expected an einjoin tensor, got {type(x).__name__}")
    return x


# Input node -> the counter of its LAST declaration. Inputs are hash-consed, so a re-declared
# input keeps the serial of its first declaration; Graph compares both orders to tell when
# positional feeds would bind in an older graph's order (ambiguous: it then asks for names).
_declared: weakref.WeakKeyDictionary[Node, int] = weakref.WeakKeyDictionary()
_declaration = itertools.count()


def last_declaration(node: Node) -> int | None:
    """The counter of the last :func:`input_node` call that returned ``node`` (None for a node
    not built by it, e.g. unpickled); increasing with time, comparable only between inputs."""
    return _declared.get(node)


def declared_elsewhere(name: str) -> bool:
    """Whether a live input node named ``name`` exists (declared by :func:`input_node`), so that a
    feed for an input some graph has but this one does not read can be told from a typo."""
    return any(n.op.name == name for n in list(_declared.keys()))  # type: ignore[union-attr]


def input_node(name: str, shape: Any, dtype: Any = "float32", param: bool = False) -> Node:
    if not isinstance(name, str) or not name:
        raise EinjoinError(f"input name must be a non-empty string, got {name!r}")
    node = Node(Input(name, bool(param)), (), check_shape(shape, f"input {name!r}"),
                canonical_dtype(dtype))
    _declared[node] = next(_declaration)  # also when the hash-cons returned an older node
    return node


def einsum_node(inputs: Sequence[Node], in_labels: Sequence[Sequence[str]],
                out_labels: Sequence[str], join: str | Expr = "mul",
                agg: str | Agg | None = "sum") -> Node:
    """The extended einsum. Validates labels against shapes and infers the output."""
    inputs = tuple(_need_node(x, "einsum") for x in inputs)
    groups: tuple[tuple[str, ...], ...] = tuple(tuple(ls) for ls in in_labels)
    in_labels = groups
    out_labels = tuple(out_labels)
    eq = ",".join("".join(ls) for ls in in_labels) + "->" + "".join(out_labels)
    if not inputs:
        raise EinsumSyntaxError(f"einsum {eq!r}: needs at least one input")
    if len(in_labels) != len(inputs):
        raise EinsumSyntaxError(
            f"einsum {eq!r}: {len(in_labels)} label group(s) for {len(inputs)} input(s)")
    sizes: dict[str, tuple[int, int]] = {}  # label -> (size, input it was first seen in)
    for i, (x, ls) in enumerate(zip(inputs, in_labels)):
        if len(ls) != x.ndim:
            raise ShapeError(f"einsum {eq!r}: input {i} has rank {x.ndim} (shape {x.shape}) "
                             f"but {len(ls)} label(s) {''.join(ls)!r}")
        for lab, d in zip(ls, x.shape):
            if lab in sizes and sizes[lab][0] != d:
                j = sizes[lab][1]
                raise ShapeError(
                    f"einsum {eq!r}: label {lab!r} has size {sizes[lab][0]} in input {j} "
                    f"(shape {inputs[j].shape}) but size {d} in input {i} (shape {x.shape})")
            sizes.setdefault(lab, (d, i))
    seen: set[str] = set()
    for lab in out_labels:
        if lab in seen:
            raise EinsumSyntaxError(f"einsum {eq!r}: output label {lab!r} is repeated")
        seen.add(lab)
        if lab not in sizes:
            raise EinsumSyntaxError(
                f"einsum {eq!r}: output label {lab!r} appears in no input, so its size is unknown "
                f"(use broadcast to add a dimension)")
    expr = parse_join(join, len(inputs))
    aggregation = get_agg(agg)
    agg_labels = [lab for lab in sizes if lab not in out_labels]
    if agg_labels and not aggregation.reduces:
        raise EinsumSyntaxError(
            f"einsum {eq!r}: labels {''.join(agg_labels)!r} are missing from the output but agg is "
            f"'none'; give an aggregation (sum, max, min, prod)")
    if not agg_labels:
        aggregation = get_agg("none")
    empty = [lab for lab in agg_labels if sizes[lab][0] == 0]
    if empty and aggregation.name in ("max", "min"):
        # sum and prod over nothing are 0 and 1; max and min have no value there (torch raises)
        raise ShapeError(f"einsum {eq!r}: {aggregation.name} over label(s) {''.join(empty)!r} "
                         f"of size 0 has no value (an empty tensor's {aggregation.name}); slice "
                         f"a non-empty range or use sum")
    try:
        dtype = infer_dtype(expr, [x.dtype for x in inputs])
    except DTypeError as e:
        raise DTypeError(f"einsum {eq!r}: {e}") from None
    if aggregation.name in ("sum", "prod") and dtype == "bool":
        raise DTypeError(f"einsum {eq!r}: agg {aggregation.name!r} over bool values has no meaning "
                         f"(use max for any, min for all)")
    # a constant join over inputs (num_args(expr) == 0) is legal: it only takes their shape
    shape = tuple(sizes[lab][0] for lab in out_labels)
    check_size(shape, f"einsum {eq!r}")  # an outer product of big inputs
    return Node(Einsum(groups, out_labels, expr, aggregation), inputs, shape, dtype)


def reshape_node(x: Node, shape: Any) -> Node:
    x = _need_node(x, "reshape")
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    dims = [_as_int(d, f"reshape {x.shape} -> {shape!r}") for d in shape]
    if dims.count(-1) > 1:
        raise ShapeError(f"reshape {x.shape} -> {tuple(dims)}: at most one -1")
    if -1 in dims:
        known = 1
        for d in dims:
            if d != -1:
                known *= d
        if known == 0:  # torch: the -1 of an empty tensor could be anything
            raise ShapeError(f"reshape {x.shape} -> {tuple(dims)}: with a 0 among the known dims "
                             f"the -1 could be any size; give every dim")
        if known < 0 or x.size % known:
            raise ShapeError(f"reshape {x.shape} -> {tuple(dims)}: {x.size} elements do not "
                             f"divide into the known dims")
        dims[dims.index(-1)] = x.size // known
    out = check_shape(dims, f"reshape {x.shape}")
    n = 1
    for d in out:
        n *= d
    if n != x.size:
        raise ShapeError(f"reshape {x.shape} -> {out}: {x.size} elements cannot become {n}")
    if out == x.shape:
        return x
    return Node(Reshape(), (x,), out, x.dtype)


def broadcast_node(x: Node, shape: Any, dims: Sequence[int] | None = None) -> Node:
    """Expand ``x`` to ``shape``. ``dims[i]`` is the output dim of input dim ``i`` (default: the
    trailing dims, as numpy and torch ``expand``); mapped dims must be 1 or equal."""
    x = _need_node(x, "broadcast")
    out = check_shape(shape, f"broadcast {x.shape}")
    if dims is None:
        if x.ndim > len(out):
            raise ShapeError(f"broadcast {x.shape} -> {out}: target has lower rank")
        dims = tuple(range(len(out) - x.ndim, len(out)))
    dims = tuple(_as_int(d, "broadcast dims") for d in dims)
    if len(dims) != x.ndim or any(not 0 <= d < len(out) for d in dims) or list(dims) != sorted(set(dims)):
        raise ShapeError(f"broadcast {x.shape} -> {out}: dims {dims} must be increasing output "
                         f"dims, one per input dim")
    for i, d in enumerate(dims):
        if x.shape[i] not in (1, out[d]):
            raise ShapeError(f"broadcast {x.shape} -> {out}: input dim {i} has size {x.shape[i]}, "
                             f"which is neither 1 nor {out[d]}")
    if out == x.shape:
        return x
    return Node(Broadcast(dims), (x,), out, x.dtype)


def select_node(x: Node, starts: Sequence[int], stops: Sequence[int]) -> Node:
    x = _need_node(x, "select")
    starts = tuple(_as_int(s, "select start") for s in starts)
    stops = tuple(_as_int(s, "select stop") for s in stops)
    if len(starts) != x.ndim or len(stops) != x.ndim:
        raise ShapeError(f"select on shape {x.shape}: need {x.ndim} starts and stops, got "
                         f"{len(starts)} and {len(stops)}")
    for d, (a, b, n) in enumerate(zip(starts, stops, x.shape)):
        if not 0 <= a <= b <= n:  # start == stop selects an empty dim, as torch's x[:, n:]
            raise ShapeError(f"select [{a}:{b}] on dim {d} of shape {x.shape}: need "
                             f"0 <= start <= stop <= {n}")
    if starts == (0,) * x.ndim and stops == x.shape:
        return x
    shape = tuple(b - a for a, b in zip(starts, stops))
    empty = [d for d, (a, b, n) in enumerate(zip(starts, stops, x.shape)) if a == b and n > 0]
    if empty:
        # An empty slice of a non-empty dim (torch's x[:, n:]): one element's width of it,
        # broadcast to size 0. A block kernel then never has to cut an empty piece out of a
        # non-empty block, and x stays an input of the graph.
        one = [(min(a, n - 1), min(a, n - 1) + 1) if d in empty else (a, b)
               for d, (a, b, n) in enumerate(zip(starts, stops, x.shape))]
        thin = select_node(x, [a for a, _ in one], [b for _, b in one])
        return broadcast_node(thin, shape, tuple(range(x.ndim)))
    return Node(Select(starts, stops), (x,), shape, x.dtype)


def concat_node(xs: Sequence[Node], axis: int) -> Node:
    xs = tuple(_need_node(x, "concat") for x in xs)
    if not xs:
        raise ShapeError("concat: needs at least one tensor")
    first = xs[0]
    given = axis = _as_int(axis, "concat axis")
    if axis < 0:
        axis += first.ndim
    if not 0 <= axis < first.ndim:
        raise ShapeError(f"concat along axis {given} of tensors of rank {first.ndim} "
                         f"(shape {first.shape})")
    for i, x in enumerate(xs):
        if x.ndim != first.ndim or any(a != b for d, (a, b) in enumerate(zip(x.shape, first.shape))
                                       if d != axis):
            raise ShapeError(f"concat along axis {axis}: input {i} has shape {x.shape}, "
                             f"incompatible with input 0 of shape {first.shape}")
        if x.dtype != first.dtype:
            raise DTypeError(f"concat: input {i} is {x.dtype} but input 0 is {first.dtype}")
    if len(xs) == 1:
        return first
    shape = list(first.shape)
    shape[axis] = sum(x.shape[axis] for x in xs)
    check_size(tuple(shape), "concat")
    return Node(Concat(axis), xs, tuple(shape), first.dtype)


def concat_axis(node: Node) -> int | None:
    """The axis ``node`` concatenates its inputs along, or None when it is no concat (a query for
    the layers above, which never test the op's class).

    >>> a = input_node("a", (2, 3))
    >>> concat_axis(concat_node([a, a], 1)), concat_axis(a)
    (1, None)
    """
    return node.op.axis if isinstance(node.op, Concat) else None


def is_zero_fill(node: Node) -> bool:
    """``node`` is a fill of the constant 0 (an exact zero: what a gradient rule sends where no
    cotangent flows).

    >>> is_zero_fill(fill_node((2,), "float32", 0)), is_zero_fill(fill_node((2,), "float32", 1))
    (True, False)
    """
    return isinstance(node.op, Fill) and isinstance(node.op.expr, Const) and node.op.expr.value == 0


def fill_node(shape: Any, dtype: Any, expr: str | Expr | float | int | bool) -> Node:
    """A constant tensor: ``expr`` over the index variables ``x0..x{rank-1}`` (``"x0 >= x1"`` is the
    causal mask), or a plain number."""
    dims = check_shape(shape, "fill")
    dt = canonical_dtype(dtype)
    if isinstance(expr, np.generic) and expr.dtype.kind in "biuf":
        expr = expr.item()
    if isinstance(expr, (bool, int, float)):
        _check_fill_value(expr, dt)
        expr = repr(expr)
    e = parse_join(expr, max(len(dims), 1)) if len(dims) else parse_join(expr, 1)
    if len(dims) == 0 and num_args(e) > 0:
        raise ShapeError(f"fill {expr!r}: a rank-0 fill has no index variables")
    idx_dtype = "float64" if kind(dt) == "float" else "int64"
    out_dt = infer_dtype(e, [idx_dtype] * len(dims))
    order = {"bool": 0, "int": 1, "float": 2}
    if num_args(e) and order[kind(out_dt)] > order[kind(dt)]:
        raise DTypeError(f"fill {e}: gives {kind(out_dt)} values but the fill is {dt}")
    return Node(Fill(e), (), dims, dt)


def _check_fill_value(v: bool | int | float, dt: str) -> None:
    """A number given as a fill's value must be a value of ``dt``, as in torch.full: nan, inf or
    an int outside int64 into int64, or a finite number that overflows a float type, is a
    DTypeError (it would wrap or become inf silently). Floats into int64 truncate, as torch's."""
    if isinstance(v, bool) or dt == "bool":
        return
    fix = "give a value the dtype holds, or another dtype"
    shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:12]}... ({len(repr(v))} digits)"
    if kind(dt) == "int":
        if isinstance(v, float) and not math.isfinite(v):
            raise DTypeError(f"fill value {shown} is not an integer: an {dt} fill cannot hold it; {fix}")
        info = np.iinfo(numpy_dtype(dt))  # torch.full((3,), 1000, dtype=torch.int8) raises too
        if not info.min <= math.trunc(v) <= info.max:
            raise DTypeError(f"fill value {shown} is outside the range of {dt} "
                             f"[{info.min}, {info.max}]; {fix}")
        return
    try:
        f = float(v)
    except OverflowError:
        raise DTypeError(f"fill value {shown} is too large for a float ({dt}); {fix}") from None
    with np.errstate(all="ignore"):
        rounded = np.array(f).astype(numpy_dtype(dt))
    if math.isfinite(f) and not np.isfinite(rounded):
        import ml_dtypes  # its finfo knows bfloat16; imported only here (it is slow to import)
        raise DTypeError(f"fill value {shown} overflows {dt} (largest finite value "
                         f"{float(ml_dtypes.finfo(numpy_dtype(dt)).max)!r}); {fix}")


def gather_node(table: Node, indices: Node) -> Node:
    table = _need_node(table, "gather")
    indices = _need_node(indices, "gather")
    if indices.dtype != "int64":
        raise DTypeError(f"gather: indices must be int64, got {indices.dtype} (shape {indices.shape})")
    if table.ndim < 1:
        raise ShapeError("gather: the table must have at least one dimension")
    shape = indices.shape + table.shape[1:]
    check_size(shape, "gather")
    return Node(Gather(), (table, indices), shape, table.dtype)


def scatter_add_node(updates: Node, indices: Node, rows: int) -> Node:
    """``out = zeros((rows,) + rest); out[indices[i], r] += updates[i, r]`` (numpy's ``np.add.at``:
    duplicate indices accumulate) — the adjoint of :func:`gather_node` with respect to its table.

    Inputs are ``(updates, indices)`` in that order: int64 ``indices`` of shape ``I``, ``updates``
    of shape ``I + rest`` (float or int64); the result has shape ``(rows,) + rest`` and the dtype
    of ``updates`` (float16/bfloat16 accumulate in float32, then round once, as torch's
    ``index_add``). An index outside ``[0, rows)`` is an error at run time, as in a gather.

    >>> from einjoin.ir import ops
    >>> u = ops.input_node("u", (2, 5, 8), "float32"); i = ops.input_node("i", (2, 5), "int64")
    >>> ops.scatter_add_node(u, i, 100).shape
    (100, 8)
    """
    updates = _need_node(updates, "scatter_add")
    indices = _need_node(indices, "scatter_add")
    n_rows = _as_int(rows, "scatter_add rows")
    if n_rows < 0:
        raise ShapeError(f"scatter_add: rows must be >= 0, got {n_rows}")
    if indices.dtype != "int64":
        raise DTypeError(f"scatter_add: indices must be int64, got {indices.dtype} "
                         f"(shape {indices.shape})")
    if kind(updates.dtype) == "bool":
        raise DTypeError(f"scatter_add: updates of dtype bool (shape {updates.shape}) cannot be "
                         f"added; cast them to a number type")
    lead = updates.shape[:indices.ndim]
    if updates.ndim < indices.ndim or lead != indices.shape:
        raise ShapeError(f"scatter_add: updates of shape {updates.shape} must start with the "
                         f"indices' shape {indices.shape} (updates = indices' shape + row shape)")
    shape = (n_rows,) + updates.shape[indices.ndim:]
    check_size(shape, "scatter_add")
    return Node(ScatterAdd(), (updates, indices), shape, updates.dtype)


def cast_node(x: Node, dtype: Any) -> Node:
    x = _need_node(x, "cast")
    dt = canonical_dtype(dtype)
    if dt == x.dtype:
        return x
    return Node(Cast(), (x,), x.shape, dt)


def _per_dim(v: Any, nd: int, what: str, name: str, least: int = 1) -> tuple[int, ...]:
    """An int or one int per spatial dim, each >= ``least``, or a ShapeError naming ``what``."""
    vals = [v] * nd if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
    try:
        out = tuple(_as_int(d, f"{what}: {name}") for d in vals)
    except TypeError:
        raise ShapeError(f"{what}: {name} must be an int or {nd} ints, got {v!r}") from None
    if len(out) != nd or any(d < least for d in out):
        raise ShapeError(f"{what}: {name} must be an int or {nd} int(s) >= {least}, got {v!r}")
    return out


def _pads(v: Any, nd: int, what: str) -> tuple[tuple[int, int], ...]:
    """Padding as one (lo, hi) pair per spatial dim: an int, one int per dim, or the pairs."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return ((int(v), int(v)),) * nd
    try:
        items = list(v)
        if len(items) == nd and all(isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in items):
            return tuple((int(p), int(p)) for p in items)
        pairs = tuple((_as_int(p[0], f"{what}: padding"), _as_int(p[1], f"{what}: padding"))
                      for p in items if len(p) == 2)
    except (TypeError, ShapeError):
        pairs = ()
    if len(pairs) != nd:
        raise ShapeError(f"{what}: padding must be an int, {nd} ints or {nd} (lo, hi) pairs, got {v!r}")
    return pairs


def _window_out(what: str, x: Node, kernel: tuple[int, ...], stride: tuple[int, ...],
                pads: tuple[tuple[int, int], ...], ld: tuple[int, ...], rd: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d, (n, k, s, (lo, hi), a, b) in enumerate(zip(x.shape[2:], kernel, stride, pads, ld, rd)):
        m = out_size(n, k, s, lo, hi, a, b)
        if m < 1 and n > 0:
            raise ShapeError(f"{what}: spatial dim {d} of input {x.shape} (size {n}) with window {k}, "
                             f"stride {s}, padding {(lo, hi)}, dilation {b} gives no output position")
        out.append(max(m, 0))
    return tuple(out)


def conv_node(x: Node, w: Node, stride: Any = 1, padding: Any = 0, lhs_dilation: Any = 1,
              rhs_dilation: Any = 1, groups: int = 1) -> Node:
    """A convolution (:class:`~einjoin.ir.opkinds.Conv`): ``x`` of shape ``(N, C, *spatial)``
    with 1-3 spatial dims, ``w`` of shape ``(O, C // groups, *kernel)``, both of one float dtype.

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (2, 4, 9, 9), "float32"); w = ops.input_node("w", (6, 2, 3, 3), "float32")
    >>> ops.conv_node(x, w, stride=2, padding=1, groups=2).shape
    (2, 6, 5, 5)
    """
    x, w = _need_node(x, "conv"), _need_node(w, "conv")
    what = f"conv of input {x.shape} with weight {w.shape}"
    if not 3 <= x.ndim <= 5 or w.ndim != x.ndim:
        raise ShapeError(f"{what}: need input (N, C, *spatial) and weight (O, C/groups, *kernel) of "
                         f"one rank, with 1-3 spatial dims")
    if kind(x.dtype) != "float" or x.dtype != w.dtype:
        raise DTypeError(f"{what}: input and weight must share one float dtype, got {x.dtype} and {w.dtype}")
    nd = x.ndim - 2
    g = _as_int(groups, f"{what}: groups")
    if g < 1 or x.shape[1] != w.shape[1] * g or w.shape[0] % g:
        raise ShapeError(f"{what}: groups={groups} needs input channels {x.shape[1]} = groups x weight "
                         f"dim 1 ({w.shape[1]}) and output channels {w.shape[0]} divisible by groups")
    st = _per_dim(stride, nd, what, "stride")
    ld = _per_dim(lhs_dilation, nd, what, "lhs_dilation")
    rd = _per_dim(rhs_dilation, nd, what, "rhs_dilation")
    pads = _pads(padding, nd, what)
    if any(k < 1 for k in w.shape[2:]):
        raise ShapeError(f"{what}: the kernel has an empty spatial dim")
    spatial = _window_out(what, x, w.shape[2:], st, pads, ld, rd)
    shape = (x.shape[0], w.shape[0]) + spatial
    check_size(shape, "conv")
    return Node(Conv(st, pads, ld, rd, g), (x, w), shape, x.dtype)


def pool_node(x: Node, agg: str | Agg, window: Any, stride: Any = None, padding: Any = 0,
              dilation: Any = 1) -> Node:
    """A window aggregation (:class:`~einjoin.ir.opkinds.Pool`, ``max`` or ``sum``, or ``none``:
    the windows as ``C * prod(window)`` channels) over the spatial dims of ``x`` of shape
    ``(N, C, *spatial)``; ``stride`` defaults to the window.

    >>> from einjoin.ir import ops
    >>> ops.pool_node(ops.input_node("x", (2, 3, 8, 8), "float32"), "max", 2).shape
    (2, 3, 4, 4)
    """
    x = _need_node(x, "pool")
    a = get_agg(agg)
    what = f"{a.name} pool of input {x.shape}"
    if a.name not in ("max", "sum", "none"):
        raise EinjoinError(f"{what}: a pool aggregates with max or sum (or none: the windows), not {a.name}")
    if not 3 <= x.ndim <= 5:
        raise ShapeError(f"{what}: need an input (N, C, *spatial) with 1-3 spatial dims")
    if kind(x.dtype) != "float":
        raise DTypeError(f"{what}: pooling needs a float input, got {x.dtype}")
    nd = x.ndim - 2
    win = _per_dim(window, nd, what, "window")
    st = win if stride is None else _per_dim(stride, nd, what, "stride")
    dil = _per_dim(dilation, nd, what, "dilation")
    pads = _pads(padding, nd, what)
    spatial = _window_out(what, x, win, st, pads, (1,) * nd, dil)
    channels = x.shape[1] * math.prod(win) if a.name == "none" else x.shape[1]
    return Node(Pool(a, win, st, pads, dil), (x,), (x.shape[0], channels) + spatial, x.dtype)


def topk_node(x: Node, k: int, axis: int = -1, largest: bool = True, indices: bool = False) -> Node:
    """The ``k`` largest (or smallest) values of ``x`` along ``axis`` in order, or (``indices``)
    their int64 positions (:class:`~einjoin.ir.opkinds.TopK`; ``k`` = the dim's size sorts).

    >>> from einjoin.ir import ops
    >>> x = ops.input_node("x", (4, 10), "float32")
    >>> ops.topk_node(x, 3).shape, ops.topk_node(x, 3, indices=True).dtype
    ((4, 3), 'int64')
    """
    x = _need_node(x, "topk")
    what = f"topk of input {x.shape} ({x.dtype})"
    if x.ndim == 0:
        raise ShapeError(f"{what}: needs at least one dim")
    ax = _as_int(axis, f"{what}: dim")
    if not -x.ndim <= ax < x.ndim:
        raise ShapeError(f"{what}: dim {axis} out of range for rank {x.ndim}")
    ax %= x.ndim
    kk = _as_int(k, f"{what}: k")
    if not 0 <= kk <= x.shape[ax]:
        raise ShapeError(f"{what}: k={k} outside [0, {x.shape[ax]}] (the size of dim {ax})")
    if kind(x.dtype) == "bool":
        raise DTypeError(f"{what}: sorting bool values; cast them to a number type")
    shape = x.shape[:ax] + (kk,) + x.shape[ax + 1:]
    return Node(TopK(ax, kk, bool(largest), bool(indices)), (x,), shape, "int64" if indices else x.dtype)
