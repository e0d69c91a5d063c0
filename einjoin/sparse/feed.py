"""A sparse tensor fed by name at run inside a dense graph (issue 24): ``ej.sparse_input``.

A graph's sparse operand is either a constant (a SparseTensor given to ``ej.einsum``: its
pattern drives the sparse plan) or an input declared with :func:`sparse_input` and fed at each
run, ``prog.run(A=adjacency, H=features)``, like a dense input. The graph holds it as two plain
inputs that the planner and the runtime move like any other: ``A`` (its values, ``(nnz,)`` of
its dtype) and ``A.keys[50,40]`` (its coordinates, ``(nnz, rank)`` int64). ``nnz`` is a capacity: a fed
tensor with fewer stored entries is padded (keys rows of -1, values 0), one with more is refused,
as is one of another shape or of a dtype its values would not fit exactly, each naming the input.
Each kernel builds the run's SparseTensor from its keys and values and runs the sparse einsum on
it (a new pattern is replanned, cached per block histogram as ``SparsePlan.run`` does); a kernel
of a node cut along the tensor's own dims (an SpMV's rows on several devices) computes only the
entries in its rows (:meth:`FedSparse.einsum_within`), so no device repeats another's work.

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> A = ej.sparse_input("A", (50, 40), nnz=200, dtype="float64")
>>> h = ej.input("h", (40, 8), "float64")
>>> prog = ej.compile(ej.relu(A @ h))
>>> rng = np.random.default_rng(0)
>>> a = scipy.sparse.random(50, 40, density=0.05, random_state=1)   # 100 stored entries
>>> hv = rng.normal(size=(40, 8))
>>> bool(np.allclose(prog.run(A=a, h=hv), np.maximum(a.toarray() @ hv, 0)))
True
"""

from __future__ import annotations


import operator
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.dtypes import canonical_dtype, exact_cast, numpy_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.reference import FEED_HOOKS
from einjoin.sparse.graph_plans import PlanCache, meeting
from einjoin.sparse.plan import LAZY
from einjoin.sparse.tensor import SparseTensor, is_sparse_format, sparse

__all__ = ["SparseInput", "FedSparse", "sparse_input", "fed_feeds", "declarations", "declare"]

KEYS = ".keys"  # the keys input's name: the sparse input's name, this and its shape ("A.keys[15,15]")


def keys_name(name: str, shape: Sequence[int]) -> str:
    """The name of a sparse input's keys input: its shape is part of it, so that declarations of
    one name with other shapes (and the gathers of their values' gradients) are other inputs."""
    return f"{name}{KEYS}[{','.join(map(str, shape))}]"


@dataclass(eq=False)
class FedSparse:
    """The sparse operand of a :class:`SparseEinsum` node whose tensor is fed at run (the IR's
    ``SparseOperand``): the declared name, shape, dtype and capacity (plain data: ``prog.save``
    writes it); its ``einsum`` reads the run's keys and values from the node's last two input
    blocks. Hashed by identity. ``blocks`` / ``relational`` / ``engine``: pins from ``ej.compile``
    (:meth:`pinned`; :mod:`einjoin.sparse.pins`), taken by each plan for its own labels."""

    name: str
    shape: tuple[int, ...]
    dtype_name: str
    capacity: int
    blocks: tuple[tuple[str, int], ...] = ()
    relational: tuple[str, ...] = ()
    engine: str = "memory"

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        self.blocks = tuple((str(lab), int(b)) for lab, b in self.blocks)
        self.relational = tuple(self.relational)
        self._fresh()

    def pinned(self, blocks: Sequence[tuple[str, int]], relational: Sequence[str], engine: str) -> FedSparse:
        """The same declaration, its plans under these pins (``ej.compile``'s)."""
        return FedSparse(self.name, self.shape, self.dtype_name, self.capacity, tuple(blocks), tuple(relational),
                         engine)

    def _fresh(self) -> None:
        self._plans = PlanCache(self.blocks, self.relational, self.engine)
        # the last run's (keys, values, dtype, tensor): see tensor_of
        self._last: tuple[np.ndarray, np.ndarray, str | None, SparseTensor] | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "shape": self.shape, "dtype_name": self.dtype_name, "capacity": self.capacity,
                "blocks": self.blocks, "relational": self.relational, "engine": self.engine}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def __repr__(self) -> str:
        return f"FedSparse({self.name!r}, shape={self.shape}, dtype={self.dtype_name}, nnz<={self.capacity})"

    @property
    def nnz(self) -> int:
        return self.capacity  # the most it may store: the cost model's flops

    def todense(self) -> np.ndarray:
        raise EinjoinError(f"sparse input {self.name!r} {list(self.shape)} has no value of its own: it is fed at "
                           f"run (prog.run({self.name}=...))")

    def tensor_of(self, keys: np.ndarray, values: np.ndarray, dtype: str | None = None) -> SparseTensor:
        """The run's tensor: the used rows of its keys and values inputs (sorted and unique: the
        feed hook wrote them so), int or bool values in the float ``dtype`` computes in. The last
        one is kept and returned again for equal keys and values (the same graph fed every run,
        and the forward and backward nodes of one run), with what the executor derived from it
        (its joins and SpMM orders): an equality check, not a new tensor and new joins."""
        keys, values = np.asarray(keys), np.asarray(values)
        with self._lock:
            last = self._last
            if last is not None and last[2] == dtype and _same(last[0], keys) and _same(last[1], values):
                return last[3]
        used = int(np.count_nonzero(keys[:, 0] >= 0)) if keys.shape[1] else 0
        r = len(self.shape)
        # copies: the run's blocks may be reused for other values once the run is over
        own_keys, own_values = np.array(keys), np.array(values)
        data = own_values[:used].reshape((used,) + (1,) * r)
        if dtype is not None and data.dtype.kind != "f":  # an adjacency of ones: in the node's float
            data = data.astype(np.float32 if dtype in ("float16", "bfloat16") else numpy_dtype(dtype))
        tensor = SparseTensor(self.name, self.shape, (1,) * r, own_keys[:used], data, trusted=True)
        with self._lock:
            self._last = (own_keys, own_values, dtype, tensor)
        return tensor

    def einsum(self, op: SparseEinsum, dense: Sequence[np.ndarray], dtype: str) -> np.ndarray:
        n = len(op.dense_labels)
        return self._plans.run(op, list(dense[:n]), self.tensor_of(dense[n], dense[n + 1], dtype), dtype)

    def einsum_within(self, op: SparseEinsum, dense: Sequence[np.ndarray], dtype: str,
                      box: Sequence[tuple[int, int] | None]) -> np.ndarray:
        """:meth:`einsum` on the run's entries inside ``box`` (per dim of the tensor, a range or
        None: all): a kernel of a node cut along the tensor's own dims (an SpMV's rows) computes
        its rows only, as a constant's does. The keys and values are still read whole (where a
        row's entries lie is data); the run's tensor is built once (:meth:`tensor_of`) and each
        box's entries are found in it once (sorted keys: the first dim's rows are one slice) and
        kept with it, so the forward and backward kernels of a run and later runs on the same
        feed reuse them and their joins."""
        n, box = len(op.dense_labels), tuple(box)
        part = meeting(self.tensor_of(dense[n], dense[n + 1], dtype), box)
        return self._plans.run(op, list(dense[:n]), part, dtype, part=box)


def _same(kept: np.ndarray, new: np.ndarray) -> bool:
    return kept.shape == new.shape and kept.dtype == new.dtype and bool(np.array_equal(kept, new))


class SparseInput:
    """A sparse tensor declared as a graph input (:func:`sparse_input`): use it as a SparseTensor
    in ``ej.einsum`` and ``@`` with lazy tensors; feed it by name at run. ``values`` and ``keys``
    are its two graph inputs; ``ej.grad(loss, [A])`` differentiates its values (one per stored
    entry; :meth:`on_pattern` puts a run's result on the fed tensor's pattern)."""

    __slots__ = ("operand", "values", "keys")

    def __init__(self, operand: FedSparse, values: Node, keys: Node) -> None:
        self.operand, self.values, self.keys = operand, values, keys

    @property
    def name(self) -> str:
        return self.operand.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.operand.shape

    @property
    def ndim(self) -> int:
        return len(self.operand.shape)

    @property
    def dtype(self) -> str:
        return self.operand.dtype_name

    @property
    def nnz(self) -> int:
        """The capacity: the most stored entries a fed tensor may have."""
        return self.operand.capacity

    @property
    def pattern(self) -> tuple[Node, Node]:
        return (self.keys, self.values)

    @property
    def __einjoin_wrt__(self) -> Node:
        """What ``ej.grad(loss, [A])`` differentiates: the values input (one per stored entry)."""
        return self.values

    def __repr__(self) -> str:
        return f"SparseInput({self.name!r}, shape={self.shape}, dtype={self.dtype}, nnz<={self.nnz})"

    def on_pattern(self, fed: Any, values: Any) -> SparseTensor:
        """A SparseTensor on the pattern of ``fed`` (what was fed as this input) with ``values``:
        a run's gradient w.r.t. this input's values (``ej.grad(loss, [A])``, one per
        stored entry in the feed's sorted order, then 0 up to ``nnz``) as torch gives a sparse
        leaf's ``.grad``.

        >>> import numpy as np, einjoin as ej
        >>> A = ej.sparse_input("A", (2, 2), nnz=3, dtype="float64")
        >>> x = ej.input("x", (2,), "float64")
        >>> (dA,) = ej.grad((A @ x).sum(), [A])   # w.r.t. its values
        >>> fed = ej.sparse("A", np.array([[0.0, 2.0], [3.0, 0.0]]))
        >>> g = ej.compile(dA).run(A=fed, x=np.array([10.0, 20.0]))
        >>> A.on_pattern(fed, g).todense()        # d sum(A x) / dA[i, j] = x[j] on A's entries
        array([[ 0., 20.],
               [10.,  0.]])
        """
        keys, _ = _feed(self, fed)
        vals = np.asarray(values)
        if vals.shape != (self.nnz,):
            raise ShapeError(f"sparse input {self.name!r}: on_pattern takes one value per stored entry up to nnz, "
                             f"shape ({self.nnz},), got {vals.shape}")
        used = int(np.count_nonzero(keys[:, 0] >= 0))
        r = len(self.shape)
        return SparseTensor(self.name, self.shape, (1,) * r, keys[:used], vals[:used].reshape((used,) + (1,) * r),
                            trusted=True)

    @classmethod
    def __einjoin_einsum__(cls, equation: str, operands: Sequence[Any], join: Any = None,
                           agg: Any = "sum") -> Any:
        return LAZY["einsum"](equation, operands, join=join, agg=agg)  # einjoin.sparse.node's lazy_einsum

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise EinjoinError(f"sparse input {self.name!r} {list(self.shape)} has no value until it is fed at run; "
                           f"use it in ej.einsum or '@' with einjoin tensors")

    def __getattr__(self, attr: str) -> Any:
        # the dense tensor API (A.T, A.sum(), A.reshape(...)): said so by name, not a raw AttributeError
        if attr in _DENSE_API:
            raise UnsupportedOpError(
                f"sparse input {self.name!r} {list(self.shape)}: .{attr} is the dense tensor API, which a "
                f"sparse input (ej.sparse_input) does not have; write what it computes as an einsum with it: "
                f"ej.einsum('ij->', A) is A.sum(), ej.einsum('ij->i', A) is A.sum(1), ej.einsum('ji,jk->ik', "
                f"A, x) is A.T @ x")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")

    def __getitem__(self, index: Any) -> Any:
        raise UnsupportedOpError(f"sparse input {self.name!r} {list(self.shape)}: indexing a sparse input "
                                 f"(A[{index!r}]) is not supported; use it in ej.einsum or '@' with einjoin tensors")


# the lazy dense Tensor's methods and properties a user reaches for on a sparse input (frontend/tensor.py)
_DENSE_API = frozenset({
    "T", "mT", "H", "mH", "t", "transpose", "permute", "swapaxes", "reshape", "view", "flatten", "squeeze",
    "unsqueeze", "expand", "sum", "mean", "max", "min", "prod", "amax", "amin", "softmax", "log_softmax",
    "exp", "log", "abs", "sqrt", "relu", "neg", "to", "astype", "float", "double", "half", "cast", "numpy",
    "item", "todense", "to_dense", "toarray", "matmul", "mm", "dot", "norm", "clone", "detach"})


# each declaration (name, shape, dtype, nnz) once: declaring it again gives the same operand, so
# the graphs built from either are one graph
_DECLARED: dict[tuple[Any, ...], SparseInput] = {}
_LOCK = threading.Lock()


def sparse_input(name: str, shape: Sequence[int], nnz: int, dtype: Any = "float32") -> SparseInput:
    """A sparse tensor input named ``name`` of ``shape`` holding at most ``nnz`` stored entries,
    fed at each run (``prog.run(name=tensor)``) as a SparseTensor, a ``scipy.sparse`` matrix, a
    torch sparse tensor or a pydata ``sparse.COO``. Its values are ``dtype`` (a fed tensor's values
    are cast only where exact; an int or bool adjacency takes the float operands' dtype).

    >>> import einjoin as ej
    >>> A = ej.sparse_input("A", (100, 100), nnz=500)
    >>> x = ej.input("x", (100, 4))
    >>> (A @ x).shape, A.values.shape, A.keys.shape
    ((100, 4), (500,), (500, 2))
    """
    if not isinstance(name, str) or not name:
        raise EinjoinError(f"sparse input name must be a non-empty string, got {name!r}")
    what = f"sparse input {name!r}"
    try:  # integers only, as ej.input's (int(6.5) would declare another shape silently)
        shp = tuple(operator.index(n) for n in shape)
        bad = len(shp) != len(shape) or any(n < 0 for n in shp) or any(isinstance(n, bool) for n in shape)
    except (TypeError, ValueError):
        bad = True
    if bad or not shp:
        raise ShapeError(f"{what}: shape {shape!r} (a sequence of one or more integer sizes >= 0)")
    if not isinstance(nnz, (int, np.integer)) or isinstance(nnz, bool) or nnz < 0:
        raise EinjoinError(f"{what}: nnz={nnz!r} (the most stored entries a fed tensor may have: an integer >= 0)")
    dt = canonical_dtype(dtype)
    values = ops.input_node(name, (int(nnz),), dt)
    keys = ops.input_node(keys_name(name, shp), (int(nnz), len(shp)), "int64")
    with _LOCK:
        found = _DECLARED.get((name, shp, dt, int(nnz)))
        if found is None:
            found = _DECLARED[(name, shp, dt, int(nnz))] = SparseInput(FedSparse(name, shp, dt, int(nnz)), values,
                                                                       keys)
    return found


def _feed(x: SparseInput, value: Any) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of the inputs of ``x`` for one fed tensor: checked, padded to capacity."""
    name = x.name
    if isinstance(value, SparseInput):
        raise EinjoinError(f"input {name!r}: fed a SparseInput (a declaration); feed a sparse tensor")
    given = None
    if not isinstance(value, SparseTensor):
        if not is_sparse_format(value):
            raise EinjoinError(f"input {name!r} is a sparse input (ej.sparse_input, shape {x.shape}, nnz <= "
                               f"{x.nnz}): feed a SparseTensor (ej.sparse), a scipy.sparse matrix, a torch "
                               f"sparse tensor or a pydata sparse.COO, got {type(value).__name__}")
        boolean = str(getattr(value, "dtype", "")) in ("bool", "torch.bool")
        given = _given_dtype(value)  # ej.sparse widens int32 to int64: the check is of what was fed
        value = sparse(name, value)  # (bool values are read as float32 0 / 1: a bool input keeps them bool)
        if boolean and x.dtype == "bool":
            value = SparseTensor(value.name, value.shape, value.block, np.asarray(value.keys),
                                 np.asarray(value.data).astype(bool), trusted=True)
    if tuple(value.shape) != x.shape:
        raise ShapeError(f"input {name!r}: expected a sparse tensor of shape {x.shape}, got {tuple(value.shape)}")
    fed = given if given is not None else np.dtype(value.dtype)
    if not exact_cast(fed, x.dtype):
        raise DTypeError(f"input {name!r}: expected {x.dtype} values, got {fed} (einjoin casts a feed only "
                         f"when no value changes); convert the values, or declare ej.sparse_input({name!r}, "
                         f"{x.shape}, nnz, {str(fed)!r})")
    if not value.all_finite():  # as the sparse engine refuses them (0 * inf), but before the run, by name
        raise EinjoinError(f"input {name!r}: inf or nan among its stored values; a sum of products with a sparse "
                           f"tensor does not take them (absent entries are zeros: 0 * inf)")
    r = len(x.shape)
    entries = value if all(b == 1 for b in value.block) else value.reblock((1,) * r)
    coords = np.asarray(entries.keys, np.int64)
    vals = np.asarray(entries.data).reshape(-1)
    if len(vals) > x.nnz:
        raise EinjoinError(f"input {name!r}: {len(vals)} stored entries, more than the {x.nnz} it was declared "
                           f"with (ej.sparse_input({name!r}, {x.shape}, nnz={x.nnz})); declare a larger nnz (an "
                           f"imported torch module's sparse buffer holds the entries it had at import: import it "
                           f"with the largest graph)")
    try:
        keys = np.full((x.nnz, r), -1, np.int64)
        out = np.zeros(x.nnz, numpy_dtype(x.dtype))
    except MemoryError:
        need = x.nnz * (8 * r + np.dtype(numpy_dtype(x.dtype)).itemsize)
        raise EinjoinError(f"input {name!r}: its keys and values at the declared nnz={x.nnz} need {need} bytes, "
                           f"more than this process can allocate; declare a smaller nnz") from None
    keys[:len(vals)] = coords
    out[:len(vals)] = vals
    return keys, out


def _given_dtype(value: Any) -> np.dtype | None:
    """The values' dtype of a scipy / torch / pydata sparse tensor as fed (``torch.int32`` read
    as int32), or None where numpy has no such dtype."""
    try:
        return np.dtype(str(getattr(value, "dtype", "")).removeprefix("torch."))
    except TypeError:
        return None


def _declared(x: FedSparse) -> tuple[Any, ...]:
    return (x.name, tuple(x.shape), x.dtype_name, x.capacity)  # (a loaded program's are equal copies)


def _fed_of(graph: Graph) -> list[SparseInput]:
    """The sparse inputs ``graph`` reads: those of its sparse einsums, and a declaration whose
    keys input it reads without one (a gradient w.r.t. the values gathers at the keys)."""
    names = graph.input_by_name
    if not any(KEYS + "[" in n for n in names):
        return []
    found: dict[str, SparseInput] = {}
    for node in graph.nodes:
        operand = getattr(node.op, "operand", None)
        if isinstance(operand, FedSparse) and len(node.inputs) >= 2:
            x = SparseInput(operand, node.inputs[-1], node.inputs[-2])
            other = found.setdefault(x.name, x)
            if other.operand is not operand and _declared(other.operand) != _declared(operand):
                raise EinjoinError(f"sparse input {x.name!r} is declared twice in this graph, with shapes "
                                   f"{other.shape} and {x.shape}: give each sparse input its own name")
    with _LOCK:
        every = list(_DECLARED.values())
    for x in reversed(every):  # the latest declaration first: it decides a dtype left open
        if x.name in found or names.get(x.keys.op.name) is not x.keys:  # type: ignore[union-attr]
            continue
        if names.get(x.name, x.values) is not x.values:
            continue  # another dtype's declaration: its values input is the one read
        found[x.name] = x
    return list(found.values())


def declarations(graph: Graph) -> list[tuple[str, tuple[int, ...], str, int]]:
    """The sparse inputs ``graph`` reads, as (name, shape, dtype, nnz): what ``prog.save`` writes
    so that a loaded program reading only their keys (a gradient w.r.t. the values) takes the
    same feeds in a fresh process (no declaration of them there otherwise: see :func:`_fed_of`)."""
    return [_declared(x.operand) for x in _fed_of(graph)]


def declare(saved: Sequence[Sequence[Any]]) -> None:
    """Declare again the sparse inputs :func:`declarations` gave (``ej.load``)."""
    for name, shape, dtype, nnz in saved:
        sparse_input(name, shape, nnz, dtype)


def fed_feeds(graph: Graph, feeds: dict[str, Any], optional: Collection[str] = ()) -> dict[str, Any]:
    """``bind_feeds``' hook: each sparse input of ``graph`` fed by name becomes its values and
    keys feeds (a missing one is named as the sparse input, not as its keys; one whose inputs are
    all ``optional``, as a program's state write leaves the batch out, may be missing)."""
    declared = _fed_of(graph)
    if not declared:
        return feeds
    names = graph.input_by_name
    feeds = dict(feeds)
    for x in declared:
        keys_input = x.keys.op.name  # type: ignore[union-attr]
        if keys_input in optional and keys_input in feeds and x.name in feeds and not is_sparse_format(
                feeds[x.name]) and not isinstance(feeds[x.name], (SparseInput, SparseTensor)):
            continue  # its values and keys as arrays already: a program's state (a module's sparse buffer) written
        if x.name not in feeds:
            if all(n in optional for n in (x.name, keys_input) if n in names):
                continue  # left out where a program's state write leaves the batch out
            if x.keys.op.name in feeds:  # type: ignore[union-attr]
                raise EinjoinError(f"input {x.keys.op.name!r} is the keys of sparse input {x.name!r}: feed "  # type: ignore[union-attr]
                                   f"the sparse tensor as {x.name}=...")
            raise EinjoinError(f"missing sparse input {x.name!r} (shape {x.shape}, {x.dtype}, nnz <= {x.nnz}): "
                               f"feed it by name, {x.name}=tensor")
        keys, values = _feed(x, feeds[x.name])
        if names.get(x.name) is x.values:
            feeds[x.name] = values
        else:  # only its keys are read
            del feeds[x.name]
        if names.get(x.keys.op.name) is x.keys:  # type: ignore[union-attr]
            feeds[x.keys.op.name] = keys  # type: ignore[union-attr]
    return feeds


FEED_HOOKS.append(fed_feeds)
