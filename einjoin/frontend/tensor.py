"""The PyTorch-like lazy ``Tensor``: every operation builds IR nodes, nothing computes.

>>> import einjoin as ej
>>> x = ej.input("x", (8, 16)); w = ej.input("w", (16, 4))
>>> y = (x @ w).relu().sum(-1)
>>> y.shape, y.dtype
((8,), 'float32')
"""

from __future__ import annotations

import builtins
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, EinsumSyntaxError, ShapeError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.agg import Agg
from einjoin.ir.equation import parse_equation
from einjoin.ir.fold import fold
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.ir.scalar import Arg, Call, Const, Expr, substitute

__all__ = ["Tensor", "wrap", "elementwise", "reduce", "permute", "einsum", "matmul", "gather",
           "Scalar", "LETTERS"]

Scalar = int | float | bool
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def wrap(node: Node) -> Tensor:
    """A tensor for ``node``, after constant folding."""
    return Tensor(fold(node))


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (int, float, bool)) and not isinstance(v, complex):
        return True
    # numpy scalars of a real kind (a complex one would silently lose its imaginary part)
    return isinstance(v, np.generic) and v.dtype.kind in "biuf"


def broadcast_shapes(*shapes: tuple[int, ...], what: str = "broadcast") -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for d in range(rank):
        sizes = {s[len(s) - rank + d] for s in shapes if len(s) - rank + d >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise ShapeError(f"{what}: shapes {', '.join(str(tuple(s)) for s in shapes)} do not "
                             f"broadcast (dim {d - rank} has sizes {sorted(sizes)})")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


_CAT = {"bool": 0, "int": 1, "float": 2}
_DEFAULT = {1: "int64", 2: "float32"}  # torch's default dtype of each category
# dtypes torch sums and multiplies up in int64 (sum, prod, cumsum, cumprod without a dtype=)
_SUM_TO_INT64 = frozenset(("bool", "int32", "int16", "int8", "uint8"))
# bool arithmetic as torch does it: + is or, * is and, max is or, min is and
_BOOL_ARITH = {"add": "logical_or", "mul": "logical_and", "max": "logical_or", "min": "logical_and"}


def _scalar_cat(v: Any) -> int:
    if isinstance(v, (bool, np.bool_)):
        return 0
    if isinstance(v, (int, np.integer)):
        return 1
    return 2


def _tier_dtype(dtypes: Sequence[str]) -> str:
    """The common dtype of one tier's operands, across categories ('' for none)."""
    from einjoin.ir.dtypes import kind, promote
    out = ""
    for d in dtypes:
        if not out or _CAT[kind(d)] > _CAT[kind(out)]:
            out = d
        elif _CAT[kind(d)] == _CAT[kind(out)]:
            out = promote(out, d)
    return out


def _combine_tiers(higher: str, lower: str) -> str:
    """torch's ``combine_categories``: a higher-priority tier keeps its dtype unless a lower one
    is of a higher category (bool < int < float), which then brings its own dtype."""
    from einjoin.ir.dtypes import kind
    if not higher or not lower:
        return higher or lower
    return lower if _CAT[kind(lower)] > _CAT[kind(higher)] else higher


def _result_dtype(vals: Sequence[Any]) -> str:
    """torch's result type: operands in three tiers, tensors with dims, then 0-d tensors, then
    Python numbers (as int64 / float32, torch's defaults). A lower tier counts only when its
    category is higher: ``f16 tensor * f32 0-d tensor`` is float16, ``i64 tensor * f64 0-d``
    is float64, ``f16 tensor * 2.5`` float16.

    >>> import einjoin as ej
    >>> _result_dtype([ej.input("x", (3,), "float16"), ej.input("c", (), "float32")])
    'float16'
    """
    dims = _tier_dtype([a.dtype for a in vals if isinstance(a, Tensor) and a.ndim])
    zero = _tier_dtype([a.dtype for a in vals if isinstance(a, Tensor) and not a.ndim])
    nums = _tier_dtype([("bool", "int64", "float32")[_scalar_cat(a)] for a in vals
                        if not isinstance(a, Tensor)])
    return _combine_tiers(dims, _combine_tiers(zero, nums))


def _promote(fn: str, args: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]]:
    """torch's type promotion for a named scalar function (:func:`_result_dtype`); tensors of
    another dtype are cast to the result's. Functions
    that only make sense on floats (``/``, ``exp``, ``sqrt``...) take ints and bools as float32,
    as torch does. Returns the function (bool ``+`` is ``or``) and the arguments to use."""
    from einjoin.ir.dtypes import kind
    from einjoin.ir.scalar import FUNCTIONS
    f = FUNCTIONS.get(fn)
    if f is None or f.rule == "logical":
        return fn, args
    first = 1 if f.rule == "select" else 0  # where's condition stays bool
    vals = args[first:]
    ts = [a for a in vals if isinstance(a, Tensor)]
    if not ts:
        return fn, args
    target = _result_dtype(vals)
    if f.rule == "float" and kind(target) != "float":
        if fn == "pow" and kind(target) == "int" and all(
                isinstance(a, Tensor) or _scalar_cat(a) <= 1 for a in vals):
            if any(not isinstance(a, Tensor) and a < 0 for a in vals[1:]):
                raise DTypeError("pow: integers to negative integer powers are not allowed (as in "
                                 "torch); cast the base to a float type first")
            # int ** int stays in the ints' dtype as in torch: computed in the integers (wrapping)
            ints = tuple(a.to(target) if isinstance(a, Tensor) and a.dtype != target else
                         (int(a) if not isinstance(a, Tensor) else a) for a in vals)
            return "ipow", args[:first] + _wrapped(ints, target, "ipow")
        target = "float32"
    if target == "bool" and fn in _BOOL_ARITH:
        return _BOOL_ARITH[fn], args
    # every tensor in the result's dtype, as torch computes: a 0-d float64 beside float32 data is cast
    cast = tuple(a.to(target) if isinstance(a, Tensor) and a.dtype != target else a for a in vals)
    return fn, args[:first] + _wrapped(cast, target, fn)


# functions whose Python-int argument torch converts with a range check (torch.where(x, y, 1000),
# clamp(min=1000), x ** 1000 on int8: "value cannot be converted to type int8_t without
# overflow"); the others (+ - * // % and comparisons) wrap it
_RANGE_CHECKED = frozenset(("where", "max", "min", "ipow"))


def _wrapped(vals: tuple[Any, ...], target: str, fn: str) -> tuple[Any, ...]:
    """Python ints meeting a narrow integer result as torch converts them: wrapped into
    ``target`` (``int8 tensor + 1000`` adds -24, ``x < 1000`` compares with -24), or refused
    where torch checks the range; numpy would refuse the constant, int64 would not wrap."""
    from einjoin.ir.dtypes import kind, wrap_int
    if kind(target) != "int" or target == "int64":
        return vals
    out = []
    for a in vals:
        if not isinstance(a, (Tensor, bool, np.bool_)) and _scalar_cat(a) == 1:
            w = wrap_int(int(a), target)
            # torch's range check lets an unsigned type take -max..-1 (wrapped: clamp(uint8, -5)
            # clamps at 251); a signed one only its own range
            fits = target == "uint8" and -255 <= int(a) <= 255
            if w != a and fn in _RANGE_CHECKED and not fits:
                raise DTypeError(f"{fn}: the value {int(a)} cannot be converted to {target} without "
                                 f"overflow (torch refuses it too); cast the tensor to a wider dtype first")
            a = w
        out.append(a)
    return tuple(out)


def elementwise(fn: str | Expr, *args: Tensor | Scalar, name: str | None = None) -> Tensor:
    """Apply a scalar function with numpy broadcasting. Python numbers become constants of the
    join expression (weakly typed); tensors become einsum inputs. Size-1 dims that broadcast are
    squeezed away, so no replica is materialised."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not tensors:
        raise EinjoinError(f"{name or fn}: needs at least one einjoin tensor argument")
    for a in args:
        if isinstance(a, (complex, np.complexfloating)):
            raise DTypeError(f"{name or fn}: complex value {a!r}; einjoin has no complex dtypes")
        if not isinstance(a, Tensor) and not _is_scalar(a):
            raise EinjoinError(f"{name or fn}: cannot combine an einjoin tensor with "
                               f"{type(a).__name__}; feed arrays as graph inputs")
    if isinstance(fn, str):
        fn, args = _promote(fn, args)
        if not fn:  # _promote built the whole result
            return typing.cast(Tensor, args[0])
        tensors = [a for a in args if isinstance(a, Tensor)]
    what = name or (fn if isinstance(fn, str) else str(fn))
    out_shape = broadcast_shapes(*(t.shape for t in tensors), what=what)
    rank = len(out_shape)
    if rank > len(LETTERS):
        raise ShapeError(f"{what}: rank {rank} is above the supported 26")
    out_labels = LETTERS[:rank]
    inputs: list[Node] = []
    labels: list[str] = []
    exprs: list[Expr] = []
    slot: dict[tuple[Node, str], int] = {}
    for a in args:
        if not isinstance(a, Tensor):
            exprs.append(Const(a.item() if hasattr(a, "item") else a))
            continue
        offset = rank - a.ndim
        keep = [d for d in range(a.ndim) if not (a.shape[d] == 1 and out_shape[offset + d] != 1)]
        node = a.node
        if len(keep) != a.ndim:
            node = fold(ops.reshape_node(node, tuple(a.shape[d] for d in keep)))
        ls = "".join(out_labels[offset + d] for d in keep)
        key = (node, ls)
        if key not in slot:  # x * x reads one input twice
            slot[key] = len(inputs)
            inputs.append(node)
            labels.append(ls)
        exprs.append(Arg(slot[key]))
    if isinstance(fn, str):
        expr: Expr = Call(fn, tuple(exprs))
    else:
        expr = substitute(fn, exprs)
    # every output label is kept by an input: a dim is dropped only where another input is larger
    return wrap(ops.einsum_node(inputs, labels, out_labels, expr, None))


def _times(a: Any, b: Any, x: Tensor, o: Any) -> Tensor:
    """``a * b`` (one of them ``x``, the other ``o``): with an operand of ``x``'s shape that computes
    its einsum itself (einjoin.sparse's SparseTensor), the sparse einsum ``'ab,ab->ab'`` (a graph
    node: the product on its stored entries), else the elementwise product."""
    if hasattr(type(o), "__einjoin_einsum__"):
        if x.ndim and tuple(getattr(o, "shape", ())) == x.shape:
            ls = LETTERS[:x.ndim]
            return einsum(f"{ls},{ls}->{ls}", a, b)
        # no broadcasting into a sparse tensor's stored entries: say so, not "feed arrays"
        raise ShapeError(f"mul: a sparse tensor {getattr(o, 'name', '?')!r} {tuple(getattr(o, 'shape', ()))} "
                         f"times an einjoin tensor of shape {x.shape}: the product needs the same shape (no "
                         f"broadcasting); write the broadcast as an ej.einsum (e.g. 'ij,j->ij')")
    return elementwise("mul", a, b)


def check_flag(value: Any, what: str) -> bool:
    """``value`` as a bool: Python and numpy bools, and the ints 0 and 1 (torch's arg parser takes
    them); anything else (an array, a string, None) is an EinjoinError naming ``what``."""
    if isinstance(value, (bool, np.bool_)):
        return builtins.bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return builtins.bool(value)
    raise EinjoinError(f"{what} must be True or False, got {type(value).__name__} {value!r:.60}")


def reduce(x: Tensor, agg: str, dim: Any = None, keepdim: bool = False) -> Tensor:
    """Aggregate ``x`` over ``dim`` (an int, a tuple, or None for all) with ``agg``."""
    keepdim = check_flag(keepdim, f"{agg}: keepdim")
    dims = _norm_dims(x, dim)
    if agg in ("sum", "prod") and x.dtype in _SUM_TO_INT64:
        x = x.to("int64")  # torch counts: a sum of bools, or of narrow ints, is int64
    ls = LETTERS[:x.ndim]
    out = "".join(ls[d] for d in range(x.ndim) if d not in dims)
    y = wrap(ops.einsum_node([x.node], [ls], out, "x0", agg))
    if keepdim:
        y = y.reshape(tuple(1 if d in dims else n for d, n in enumerate(x.shape)))
    return y


def _norm_dim(x: Tensor, d: Any) -> int:
    if isinstance(d, bool) or not isinstance(d, int):
        raise ShapeError(f"dimension must be an int, got {d!r}")
    if not -x.ndim <= d < x.ndim:
        raise ShapeError(f"dimension {d} out of range for a tensor of rank {x.ndim} (shape {x.shape})")
    return d % x.ndim


def _norm_dims(x: Tensor, dim: Any) -> tuple[int, ...]:
    """A reduction's dims, as torch reads them: None or an empty list is every dim, and a 0-d
    tensor takes dim 0 or -1 (reducing nothing)."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return tuple(range(x.ndim))
    if x.ndim == 0 and (dim in (0, -1) or (isinstance(dim, (list, tuple)) and len(dim) == 1
                                           and dim[0] in (0, -1))):
        if isinstance(dim, bool) or (isinstance(dim, (list, tuple)) and isinstance(dim[0], bool)):
            raise ShapeError(f"dimension must be an int, got {dim!r}")
        return ()
    if isinstance(dim, (list, tuple)):
        dims = tuple(_norm_dim(x, d) for d in dim)
        if len(set(dims)) != len(dims):
            raise ShapeError(f"repeated dimension in {tuple(dim)} for shape {x.shape}")
        return dims
    return (_norm_dim(x, dim),)


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    """``x`` with its dims in the order ``dims`` (a permutation of ``range(x.ndim)``)."""
    if not isinstance(x, Tensor):
        raise EinjoinError(f"permute: expected an einjoin tensor, got {type(x).__name__}")
    if not isinstance(dims, (list, tuple)):
        raise ShapeError(f"permute: dims must be a tuple of ints (a permutation of the dims of "
                         f"shape {x.shape}), got {type(dims).__name__} {dims!r:.60}")
    dims = tuple(_norm_dim(x, d) for d in dims)
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute {tuple(dims)} is not a permutation of the dims of shape {x.shape}")
    if dims == tuple(range(x.ndim)):
        return x
    ls = LETTERS[:x.ndim]
    return wrap(ops.einsum_node([x.node], [ls], "".join(ls[d] for d in dims), "x0", None))


# ---- the builders Tensor's operators share with the free functions: ej.einsum, a @ b
# (matmul) and t[indices] (gather) live here, beside Tensor, so that its methods call them
# without importing einjoin.frontend.functions (which builds on this module and re-exports them)

def _t(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Node):
        return Tensor(x)
    mod = type(x).__module__ or ""
    if mod.startswith("scipy.sparse") or (mod.startswith("sparse") and hasattr(x, "coords")) or \
            (mod.startswith("torch") and str(getattr(x, "layout", "torch.strided")) != "torch.strided"):
        # another library's sparse matrix: einjoin's sparse tensor carries its name, plan and gradients
        raise EinjoinError(f"{what}: a {mod.split('.')[0]} sparse {type(x).__name__} of shape {tuple(x.shape)}; "
                           f"make it an einjoin sparse tensor first, ej.sparse('A', m) (then it computes with "
                           f"arrays, or builds a graph node with einjoin tensors)")
    raise EinjoinError(f"{what}: expected an einjoin tensor, got {type(x).__name__}")


def einsum(equation: str, *operands: Tensor, join: str | Expr | None = None,
           agg: str | Agg | None = "sum") -> Tensor:
    """The extended einsum: ``out = agg over missing labels of join(inputs)``.

    ``join`` is a function name (``"mul"``, ``"add"``, ``"sub"``, ``"exp"``...) or an expression
    over ``x0, x1, ...`` (``"exp(x0 - x1)"``); it defaults to the product (one input: the value
    itself). ``agg`` is ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` or ``None``. The equation takes
    spaces, an implicit output and ``...`` with numpy's broadcasting of size-1 batch dims."""
    # an operand with data of its own (einjoin.sparse's SparseTensor) computes the einsum itself,
    # or, among lazy tensors, returns the graph node that does (a sparse einsum node)
    hook = next((h for x in operands if (h := getattr(type(x), "__einjoin_einsum__", None))), None)
    if hook is not None:
        res = hook(equation, operands, join=join, agg=agg)
        return Tensor(res) if isinstance(res, Node) else res
    xs = [_t(x, f"einsum {equation!r}") for x in operands]
    in_labels, out = parse_equation(equation, [x.shape for x in xs])
    if join is None:
        join = "mul" if len(xs) > 1 else "x0"
    nodes = []
    labels = []
    widest: dict[str, int] = {}
    for x, ls in zip(xs, in_labels):
        for lab, n in zip(ls, x.shape):
            widest[lab] = builtins.max(widest.get(lab, 0), n)
    for x, ls in zip(xs, in_labels):
        # a label's size-1 dims broadcast against its larger ones, as numpy and torch do
        # ('ij,ij->ij' of (2, 1) and (1, 3)): squeezed away, that input does not vary along it
        # (a repeated label only where every one of its dims here is 1: a diagonal's sizes agree)
        drop = [d for d, lab in enumerate(ls) if widest[lab] > 1
                and all(x.shape[e] == 1 for e, other in enumerate(ls) if other == lab)]
        if drop:
            x = x.reshape(tuple(n for d, n in enumerate(x.shape) if d not in drop))
            ls = tuple(lab for d, lab in enumerate(ls) if d not in drop)
        nodes.append(x.node)
        labels.append(ls)
    try:
        return wrap(ops.einsum_node(nodes, labels, out, join, agg))
    except (ShapeError, EinsumSyntaxError, DTypeError) as e:
        if "..." not in equation:
            raise
        raise type(e)(f"einsum {equation!r} (its '...' expanded to capital labels): {e}") from None


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with torch's rules for 1-D operands and broadcast batch dims."""
    if any(hasattr(type(x), "__einjoin_einsum__") for x in (a, b)):  # a sparse matrix: its einsum hook
        eq = {(2, 2): "ij,jk->ik", (2, 1): "ij,j->i", (1, 2): "j,jk->k"}.get((len(a.shape), len(b.shape)))
        if eq is not None:
            return einsum(eq, a, b)
        raise ShapeError(f"matmul of shapes {tuple(a.shape)} and {tuple(b.shape)} with a sparse operand: "
                         f"'@' takes a sparse matrix with a 2-D or 1-D operand; write the product as "
                         f"ej.einsum (e.g. 'ij,bjk->bik' for a batch of right operands)")
    a, b = _t(a, "matmul"), _t(b, "matmul")
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul of shapes {a.shape} and {b.shape}: rank-0 operands")
    if a.ndim == 1 and b.ndim == 1:
        eq = "k,k->"
    elif a.ndim == 1:
        eq = "k,...kn->...n"
    elif b.ndim == 1:
        eq = "...mk,k->...m"
    else:
        eq = "...mk,...kn->...mn"
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ShapeError(f"matmul of shapes {a.shape} and {b.shape}: inner sizes {ka} and {kb} differ")
    if a.ndim > 2 and b.ndim > 2:  # check batch broadcasting with a clear message
        broadcast_shapes(a.shape[:-2], b.shape[:-2], what=f"matmul batch dims of {a.shape} and {b.shape}")
    return einsum(eq, a, b)


def gather(table: Tensor, indices: Tensor) -> Tensor:
    """Rows of ``table`` picked by integer ``indices`` (int32 ones too, as torch's, widened to
    int64 exactly): shape ``indices.shape + table.shape[1:]``."""
    idx = _t(indices, "gather")
    if idx.dtype in _SUM_TO_INT64 and idx.dtype != "bool":  # the narrow ints: int64 holds them
        idx = idx.to("int64")
    return wrap(ops.gather_node(_t(table, "gather").node, idx.node))


# methods built in modules that build on this one (which therefore cannot import them back):
# each registers itself here when imported; einjoin.frontend's __init__ imports them all
BUILT_ELSEWHERE: dict[str, Callable[..., Any]] = {}  # {"getitem_with_tensors": routing's}


# numpy ufuncs a Tensor answers (Tensor.__array_ufunc__), by the scalar function they are
_UFUNCS = {"add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "div", "divide": "div",
           "floor_divide": "floordiv", "remainder": "mod", "power": "pow", "less": "lt", "less_equal": "le",
           "greater": "gt", "greater_equal": "ge", "equal": "eq", "not_equal": "ne", "negative": "neg",
           "absolute": "abs", "exp": "exp", "expm1": "expm1", "log": "log", "log1p": "log1p", "sqrt": "sqrt",
           "tanh": "tanh", "sin": "sin", "cos": "cos", "maximum": "max", "minimum": "min",
           "reciprocal": "reciprocal", "logical_and": "logical_and", "logical_or": "logical_or",
           "logical_not": "logical_not"}


class Tensor:
    """A lazy tensor: an IR node plus the operators people expect. Nothing runs until the graph
    is compiled or evaluated (``ej.reference``)."""

    __slots__ = ("node",)
    __array_priority__ = 1000  # numpy scalars on the left defer to our operators

    def __init__(self, node: Node):
        if not isinstance(node, Node):
            raise EinjoinError(f"Tensor(node): expected an einjoin IR node, got {type(node).__name__} "
                               f"{node!r:.60}; make tensors with ej.input, ej.param, ej.full, ...")
        self.node = node

    # ---- facts
    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.shape

    @property
    def dtype(self) -> str:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return self.node.ndim

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[_norm_dim(self, dim)]

    def __len__(self) -> int:
        if not self.shape:
            raise ShapeError("len() of a rank-0 tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Tensor({describe(self.node)}, {self.dtype}{list(self.shape)})"

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def __bool__(self) -> bool:
        raise EinjoinError("an einjoin tensor is lazy and has no truth value; use ej.where for "
                           "data-dependent choices")

    __hash__ = object.__hash__  # == builds a comparison, as in torch

    # ---- numpy and Python conversions: a lazy tensor has no values (numpy would otherwise
    # iterate it into an object array of 0-d tensors, np.add(x, 1) one of per-element graphs)
    def _no_values(self, what: str) -> EinjoinError:
        return EinjoinError(f"{what} of a lazy einjoin tensor ({self!r:.80}): it has no values until "
                            f"it runs; compute it with ej.reference(t, **feeds) or ej.compile(t).run(...)")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise self._no_values("a numpy array")

    def __float__(self) -> float:
        raise self._no_values("float()")

    def __int__(self) -> int:
        raise self._no_values("int()")

    def __index__(self) -> int:
        raise self._no_values("an int index")

    def __complex__(self) -> complex:
        raise self._no_values("complex()")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Tensor:
        """numpy's elementwise ufuncs with numpy scalars (``np.float32(2) * x``, ``np.exp(x)``)
        build the same graph as the operators; arrays and other ufuncs are refused by name."""
        fn = _UFUNCS.get(getattr(ufunc, "__name__", "")) if method == "__call__" and not kwargs else None
        if fn is None:
            raise UnsupportedOpError(f"numpy's {getattr(ufunc, '__name__', ufunc)}.{method} on a lazy "
                                     f"einjoin tensor; use the tensor's operators or einjoin functions")
        # numpy hands a scalar to comparisons as a 0-d array: the scalar it holds
        args: list[Any] = [a[()] if isinstance(a, np.ndarray) and a.ndim == 0 else a for a in inputs]
        return elementwise(fn, *args)

    # ---- arithmetic
    def __add__(self, o: Any) -> Tensor: return elementwise("add", self, o)
    def __radd__(self, o: Any) -> Tensor: return elementwise("add", o, self)
    def __sub__(self, o: Any) -> Tensor: return elementwise("sub", self, o)
    def __rsub__(self, o: Any) -> Tensor: return elementwise("sub", o, self)
    def __mul__(self, o: Any) -> Tensor: return _times(self, o, self, o)
    def __rmul__(self, o: Any) -> Tensor: return _times(o, self, self, o)
    def __truediv__(self, o: Any) -> Tensor: return elementwise("div", self, o)
    def __rtruediv__(self, o: Any) -> Tensor: return elementwise("div", o, self)
    def __floordiv__(self, o: Any) -> Tensor: return elementwise("floordiv", self, o)
    def __rfloordiv__(self, o: Any) -> Tensor: return elementwise("floordiv", o, self)
    def __mod__(self, o: Any) -> Tensor: return elementwise("mod", self, o)
    def __rmod__(self, o: Any) -> Tensor: return elementwise("mod", o, self)
    def __pow__(self, o: Any) -> Tensor: return elementwise("pow", self, o)
    def __rpow__(self, o: Any) -> Tensor: return elementwise("pow", o, self)
    def __neg__(self) -> Tensor: return elementwise("neg", self)
    def __abs__(self) -> Tensor: return elementwise("abs", self)
    def __invert__(self) -> Tensor: return elementwise("logical_not", self)
    def __and__(self, o: Any) -> Tensor: return elementwise("logical_and", self, o)
    def __or__(self, o: Any) -> Tensor: return elementwise("logical_or", self, o)
    # True | mask and True & mask, as torch: Python's bool has no | for a Tensor
    def __rand__(self, o: Any) -> Tensor: return elementwise("logical_and", o, self)
    def __ror__(self, o: Any) -> Tensor: return elementwise("logical_or", o, self)
    def __lt__(self, o: Any) -> Tensor: return elementwise("lt", self, o)
    def __le__(self, o: Any) -> Tensor: return elementwise("le", self, o)
    def __gt__(self, o: Any) -> Tensor: return elementwise("gt", self, o)
    def __ge__(self, o: Any) -> Tensor: return elementwise("ge", self, o)
    def __eq__(self, o: Any) -> Tensor: return elementwise("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Tensor: return elementwise("ne", self, o)  # type: ignore[override]

    def __matmul__(self, o: Tensor) -> Tensor:
        return matmul(self, o)

    def __rmatmul__(self, o: Tensor) -> Tensor:
        return matmul(o, self)

    # ---- unary maps
    def exp(self) -> Tensor: return elementwise("exp", self)
    def log(self) -> Tensor: return elementwise("log", self)
    def sqrt(self) -> Tensor: return elementwise("sqrt", self)
    def rsqrt(self) -> Tensor: return elementwise("rsqrt", self)
    def reciprocal(self) -> Tensor: return elementwise("reciprocal", self)
    def abs(self) -> Tensor: return elementwise("abs", self)
    def neg(self) -> Tensor: return elementwise("neg", self)
    def relu(self) -> Tensor: return elementwise("relu", self)
    def silu(self) -> Tensor: return elementwise("silu", self)
    def tanh(self) -> Tensor: return elementwise("tanh", self)
    def erf(self) -> Tensor: return elementwise("erf", self)
    def sigmoid(self) -> Tensor: return elementwise("sigmoid", self)
    def sin(self) -> Tensor: return elementwise("sin", self)
    def cos(self) -> Tensor: return elementwise("cos", self)
    def logical_not(self) -> Tensor: return elementwise("logical_not", self)

    def gelu(self, approximate: str = "none") -> Tensor:
        if not isinstance(approximate, str) or approximate not in ("none", "tanh"):
            raise EinjoinError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return elementwise("gelu" if approximate == "none" else "gelu_tanh", self)

    # ---- reductions (values only: max/min do not return indices)
    def sum(self, dim: Any = None, keepdim: bool = False) -> Tensor: return reduce(self, "sum", dim, keepdim)
    def prod(self, dim: Any = None, keepdim: bool = False) -> Tensor: return reduce(self, "prod", dim, keepdim)
    def max(self, dim: Any = None, keepdim: bool = False) -> Tensor: return reduce(self, "max", dim, keepdim)
    def min(self, dim: Any = None, keepdim: bool = False) -> Tensor: return reduce(self, "min", dim, keepdim)
    amax, amin = max, min

    def mean(self, dim: Any = None, keepdim: bool = False) -> Tensor:
        """The mean over ``dim``; ints and bools give float32 (torch's default float), the mean
        over an empty dim is nan (0/0, as torch)."""
        keepdim = check_flag(keepdim, "mean: keepdim")
        dims = _norm_dims(self, dim)
        n = 1
        for d in dims:
            n *= self.shape[d]
        scale = 1.0 / n if n else math.nan  # the one nan object: Const(nan) must equal itself
        if self.dtype in ("float16", "bfloat16") and n:
            # scale each element before summing: the sum of x/n stays within the range of x, so
            # half partial sums cannot overflow where the mean itself fits
            ls = LETTERS[:self.ndim]
            out = "".join(ls[d] for d in range(self.ndim) if d not in dims)
            y = wrap(ops.einsum_node([self.node], [ls], out, Call("mul", (Arg(0), Const(scale))),
                                     "sum" if dims else None))
            if keepdim:
                y = y.reshape(tuple(1 if d in dims else k for d, k in enumerate(self.shape)))
            return y
        return reduce(self, "sum", dim, keepdim) * scale

    # ---- layout
    @property
    def T(self) -> Tensor:
        return permute(self, tuple(reversed(range(self.ndim))))

    def permute(self, *dims: Any) -> Tensor:
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return permute(self, dims)

    def transpose(self, a: int = 0, b: int = 1) -> Tensor:
        order = list(range(self.ndim))
        a, b = _norm_dim(self, a), _norm_dim(self, b)
        order[a], order[b] = order[b], order[a]
        return permute(self, order)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return wrap(ops.reshape_node(self.node, shape))

    view = reshape

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        a, b = _norm_dim(self, start_dim), _norm_dim(self, end_dim)
        if a > b:
            raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} "
                             f"(shape {self.shape})")
        n = 1
        for d in self.shape[a:b + 1]:
            n *= d
        return self.reshape(self.shape[:a] + (n,) + self.shape[b + 1:])

    def unsqueeze(self, dim: int) -> Tensor:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim - 1 <= dim <= self.ndim:
            raise ShapeError(f"unsqueeze({dim!r}) on a tensor of rank {self.ndim}")
        d = dim % (self.ndim + 1)
        return self.reshape(self.shape[:d] + (1,) + self.shape[d:])

    def squeeze(self, dim: Any = None) -> Tensor:
        dims = tuple(d for d in range(self.ndim) if self.shape[d] == 1) if dim is None else _norm_dims(self, dim)
        return self.reshape(tuple(n for d, n in enumerate(self.shape) if not (d in dims and n == 1)))

    def expand(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        for s in shape:  # ints only (an array would compare elementwise below)
            if isinstance(s, builtins.bool) or not isinstance(s, (int, np.integer)):
                raise ShapeError(f"expand {self.shape} -> {shape!r:.80}: sizes must be ints (-1 "
                                 f"keeps a dim), got {type(s).__name__} {s!r:.40}")
        shape = tuple(int(s) for s in shape)
        lead = len(shape) - self.ndim
        if lead < 0:
            raise ShapeError(f"expand {self.shape} -> {tuple(shape)}: target has lower rank")
        full = tuple(self.shape[d - lead] if s == -1 and d >= lead else s for d, s in enumerate(shape))
        return wrap(ops.broadcast_node(self.node, full))

    broadcast_to = expand

    def to(self, dtype: Any) -> Tensor:
        return wrap(ops.cast_node(self.node, dtype))

    astype = to
    def float(self) -> Tensor: return self.to("float32")
    def double(self) -> Tensor: return self.to("float64")
    def half(self) -> Tensor: return self.to("float16")
    def bfloat16(self) -> Tensor: return self.to("bfloat16")
    def long(self) -> Tensor: return self.to("int64")
    def bool(self) -> Tensor: return self.to("bool")

    def contiguous(self) -> Tensor:
        return self

    # ---- indexing
    def __getitem__(self, index: Any) -> Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        if any(isinstance(i, Tensor) for i in index):
            # index tensors as torch: negative ones count from the end (routing's gather)
            got: Tensor = BUILT_ELSEWHERE["getitem_with_tensors"](self, index)
            return got
        # a 0-d integer array indexes as its int (numpy's rule); other arrays are refused below
        index = tuple(int(i) if isinstance(i, np.ndarray) and i.ndim == 0 and i.dtype.kind in "iu"
                      else i for i in index)
        n_real = builtins.sum(1 for i in index if i is not None and i is not Ellipsis)
        ells = [k for k, i in enumerate(index) if i is Ellipsis]  # `in` would compare arrays
        if len(ells) > 1:
            raise ShapeError("an index can hold only one '...'")
        if n_real > self.ndim:
            raise ShapeError(f"too many indices ({n_real}) for a tensor of rank {self.ndim} "
                             f"(shape {self.shape})")
        if ells:
            k = ells[0]
            index = index[:k] + (slice(None),) * (self.ndim - n_real) + index[k + 1:]
        else:
            index = index + (slice(None),) * (self.ndim - n_real)
        strided = _strided_slices(self, index)
        if strided is not None:  # x[a:b:s] with s > 1: those dims first, then the rest as usual
            return strided
        starts, stops, out_shape = [], [], []
        d = 0
        for item in index:
            if item is None:
                out_shape.append(1)
                continue
            n = self.shape[d]
            if isinstance(item, np.integer):
                item = int(item)
            if isinstance(item, slice):
                if isinstance(item.step, (int, np.integer)) and item.step < 1:
                    raise ShapeError(f"slicing with step {item.step} on dim {d} (shape {self.shape}): "
                                     f"the step must be positive, as in torch")
                try:
                    a, b, step = item.indices(n)  # bounds and step must be ints (or None)
                except (TypeError, ValueError) as e:  # a float bound, an array, step 0
                    raise ShapeError(f"slice {item!r:.80} on dim {d} (shape {self.shape}): {e}") from None
                assert step == 1, step  # steps above 1 went through _strided_slices
                b = builtins.max(a, b)  # an empty slice is an empty tensor, as in torch
                starts.append(a)
                stops.append(b)
                out_shape.append(b - a)
            elif isinstance(item, int) and not isinstance(item, builtins.bool):
                if not -n <= item < n:
                    raise ShapeError(f"index {item} out of range for dim {d} of shape {self.shape}")
                i = item % n
                starts.append(i)
                stops.append(i + 1)
            else:
                raise UnsupportedOpError(f"indexing with {type(item).__name__} ({item!r:.60}); use ints, "
                                         f"slices, None, ... or an int64 tensor (gather)")
            d += 1
        sel = wrap(ops.select_node(self.node, starts, stops))
        return sel.reshape(tuple(out_shape)) if tuple(out_shape) != sel.shape else sel


def _strided_slices(x: Tensor, index: tuple[Any, ...]) -> Tensor | None:
    """``x[index]`` when some slice of ``index`` (already padded to the rank) has a step above 1:
    each such dim is taken first (:func:`_every`), then the rest of the index; None when no
    slice steps."""
    plan, d = [], 0
    for k, item in enumerate(index):
        if item is None:
            continue
        if isinstance(item, slice) and isinstance(item.step, (int, np.integer)) and item.step > 1:
            plan.append((k, d, item))
        d += 1
    if not plan:
        return None
    rest = list(index)
    for k, d, item in plan:
        try:
            a, b, s = item.indices(x.shape[d])
        except (TypeError, ValueError) as e:  # a float bound, an array
            raise ShapeError(f"slice {item!r:.80} on dim {d} (shape {x.shape}): {e}") from None
        x = _every(x, d, a, b, s)
        rest[k] = slice(None)
    return x[tuple(rest)]


def _every(x: Tensor, d: int, a: int, b: int, s: int) -> Tensor:
    """Every ``s``-th entry of dim ``d`` in ``[a, b)`` with the node kinds there are (no strided
    select): the ``n * s`` entries from ``a`` (zero-padded past the end) reshaped to ``(n, s)``,
    and the first of each row kept — a select and a reshape, so the planner still cuts ``d``."""
    n = len(range(a, b, s))
    lead = (slice(None),) * d
    size = x.shape[d]
    y = x[lead + (slice(a, builtins.min(a + n * s, size)),)]
    if n and a + n * s > size:  # the last row runs past the end: pad it (never read)
        pad = list(y.shape)
        pad[d] = a + n * s - size
        y = wrap(ops.concat_node([y.node, ops.fill_node(tuple(pad), x.dtype, False if x.dtype == "bool" else 0)],
                                 d))
    y = y.reshape(x.shape[:d] + (n, s) + x.shape[d + 1:])
    return y[lead + (slice(None), 0)]
