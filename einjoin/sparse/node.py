"""Sparse tensors inside the dense graph (issue 24): ``ej.einsum`` with a SparseTensor and lazy
einjoin tensors builds one :class:`~einjoin.ir.opkinds.SparseEinsum` node whose constant is the
sparse tensor, so a GNN layer ``relu(A @ H @ W)`` compiles, runs on several devices and trains
with ``ej.grad`` like any dense program.

:class:`GraphSparse` is the node's constant (the IR's ``SparseOperand``): it wraps the tensor
(one wrapper per tensor, kept in its ``derived`` dict, so nodes built twice are one node) and
computes the einsum on dense blocks through a :class:`~einjoin.sparse.plan.SparsePlan` compiled
once per (equation, shapes, dtypes) and run again on each call's blocks.

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> a = ej.sparse("A", scipy.sparse.random(50, 40, density=0.05, random_state=0))
>>> h = ej.input("h", (40, 8), "float64")
>>> w = ej.input("w", (8, 4), "float64")
>>> y = ej.relu(ej.einsum("ij,jk->ik", a, h @ w))
>>> y.node.inputs[0].kind, y.shape   # relu of the sparse einsum node
('sparseeinsum', (50, 4))
>>> rng = np.random.default_rng(0)
>>> feeds = {"h": rng.normal(size=(40, 8)), "w": rng.normal(size=(8, 4))}
>>> out = ej.compile(y, devices=2).run(**feeds)
>>> bool(np.allclose(out, np.maximum(a.todense() @ feeds["h"] @ feeds["w"], 0)))
True
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from einjoin.errors import EinjoinError, EinsumSyntaxError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.dtypes import canonical_dtype, numpy_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.opkinds import SparseEinsum
from einjoin.ir.sparse_einsum import DECLARE_INPUT, sparse_einsum_node
from einjoin.sparse.feed import SparseInput, fed_feeds, keys_name, sparse_input
from einjoin.sparse.graph_plans import PlanCache, meeting
from einjoin.sparse.plan import LAZY
from einjoin.sparse.tensor import SparseTensor, size1_squeeze

__all__ = ["GraphSparse", "PlanCache", "graph_operand", "is_lazy", "lazy_einsum"]

_KEY = ("graph operand",)  # the wrapper's key in its tensor's derived dict


@dataclass(eq=False)
class GraphSparse:
    """The sparse constant of :class:`SparseEinsum` nodes: a SparseTensor and the compiled plans
    of the einsums the graph asks of it. Hashed by identity (one per tensor: :func:`graph_operand`);
    pickles as its tensor (plans are compiled again where it lands: a Ray actor). Its fields are
    the tensor as plain data, so that ``prog.save`` writes it (the arrays with the program's) and
    ``ej.load`` builds it again (its keys checked as a directly built tensor's).

    ``blocks`` / ``relational`` / ``engine``: pins from ``ej.compile`` (:meth:`pinned`), which
    every plan of the operand takes for its own labels; none on the operand ``ej.einsum`` built."""

    name: str
    shape: tuple[int, ...]
    block: tuple[int, ...]
    keys: np.ndarray
    data: np.ndarray
    blocks: tuple[tuple[str, int], ...] = ()
    relational: tuple[str, ...] = ()
    engine: str = "memory"

    def __post_init__(self) -> None:  # read from a file: checked as any tensor built directly
        self._fresh(SparseTensor(self.name, tuple(self.shape), tuple(self.block), self.keys, self.data))

    @classmethod
    def of(cls, tensor: SparseTensor) -> GraphSparse:
        """The operand of ``tensor`` (its arrays shared, not checked again)."""
        obj = cls.__new__(cls)
        obj.blocks, obj.relational, obj.engine = (), (), "memory"
        obj._fresh(tensor)
        return obj

    def pinned(self, blocks: Sequence[tuple[str, int]], relational: Sequence[str], engine: str) -> GraphSparse:
        """Another operand of the same tensor whose plans take these pins (``ej.compile``'s
        ``blocks=``, ``relational=``, ``engine=``; :mod:`einjoin.sparse.pins`)."""
        obj = GraphSparse.of(self.tensor)
        obj.blocks, obj.relational, obj.engine = tuple(blocks), tuple(relational), engine
        obj._plans = PlanCache(obj.blocks, obj.relational, engine)
        return obj

    def _fresh(self, tensor: SparseTensor) -> None:
        self.tensor = tensor
        self.name, self.shape, self.block = tensor.name, tuple(tensor.shape), tuple(tensor.block)
        self.keys, self.data = tensor.keys, tensor.data
        self.blocks = tuple((str(lab), int(b)) for lab, b in self.blocks)
        self.relational = tuple(self.relational)
        self._plans = PlanCache(self.blocks, self.relational, self.engine)
        self._floats: dict[str, SparseTensor] = {}  # an int / bool tensor's float copies
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "pins": (self.blocks, self.relational, self.engine)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.blocks, self.relational, self.engine = state.get("pins", ((), (), "memory"))
        self._fresh(state["tensor"])

    def __repr__(self) -> str:
        return f"GraphSparse({self.tensor!r})"

    @property
    def dtype_name(self) -> str:
        return canonical_dtype(self.tensor.dtype)

    @property
    def nnz(self) -> int:
        return self.tensor.nnz

    def todense(self) -> np.ndarray:
        return self.tensor.todense()

    def stored_bytes(self, box: Sequence[tuple[int, int] | None] = ()) -> int:
        """Bytes of the stored entries (keys and values) of the blocks that meet ``box`` (per dim
        of the tensor, a range, or None / absent: all): what a kernel of the node holds of this
        constant while it runs (:meth:`einsum_within` computes on those blocks only). The memory
        planner counts them in the kernel's scratch (``decomp.footprint``), not the dense size.
        Counted without copying (the planner asks for every kernel of every candidate cut).

        >>> t = SparseTensor("A", (4, 3), (1, 1), np.array([[0, 1], [1, 0], [2, 2], [3, 1]]),
        ...                  np.arange(4.0).reshape(4, 1, 1))
        >>> op = GraphSparse.of(t)   # an entry: 2 int64 keys and one float64 value, 24 bytes
        >>> op.stored_bytes(), op.stored_bytes(((1, 3), None)), op.stored_bytes((None, (1, 2)))
        (96, 48, 48)
        """
        keys = np.asarray(self.tensor.keys)
        per = (keys.itemsize * keys.shape[1] if keys.ndim == 2 else 0) + int(
            np.asarray(self.tensor.data)[:1].nbytes)  # one entry's keys and its block's values
        box = tuple(box)
        if not any(r is not None for r in box) or not len(keys):
            return per * len(keys)
        lo, hi = 0, len(keys)
        block = self.tensor.block
        if box[0] is not None:  # sorted keys: the first dim's blocks are one slice (as meeting's)
            lo, hi = (int(v) for v in np.searchsorted(keys[:, 0], [box[0][0] // block[0],
                                                                    -(-box[0][1] // block[0])]))
        keep = np.ones(hi - lo, dtype=bool)
        for d, r in enumerate(box[1:], 1):
            if r is not None:
                start = keys[lo:hi, d] * block[d]
                keep &= (start < r[1]) & (start + block[d] > r[0])
        return per * int(np.count_nonzero(keep))

    def _float(self, dtype: str) -> SparseTensor:
        """The tensor, or for int / bool values (an adjacency of ones) a copy in the float the node
        computes in (the sparse engine multiplies one kind only), made once."""
        t = self.tensor
        if np.dtype(t.dtype).kind == "f":
            return t
        want = np.float32 if dtype in ("float16", "bfloat16") else numpy_dtype(dtype)
        with self._lock:
            found = self._floats.get(np.dtype(want).str)
            if found is None:
                found = self._floats[np.dtype(want).str] = SparseTensor(
                    t.name, t.shape, t.block, np.asarray(t.keys), np.asarray(t.data).astype(want), trusted=True)
        return found

    def einsum(self, op: SparseEinsum, dense: Sequence[np.ndarray], dtype: str) -> np.ndarray:
        """The einsum of ``op`` on the dense blocks ``dense`` (the node's inputs, whole), as a
        dense array of ``dtype``: half blocks computed in float32 and rounded once."""
        return self._plans.run(op, dense, self._float(dtype), dtype)

    def einsum_within(self, op: SparseEinsum, dense: Sequence[np.ndarray], dtype: str,
                      box: Sequence[tuple[int, int] | None]) -> np.ndarray:
        """:meth:`einsum` on the tensor's stored blocks that meet ``box`` (per dim of the tensor,
        a range, or None: all): a kernel of a node cut along the tensor's own dims computes its
        rows only (the result is zero elsewhere; the kernel keeps its box). The kept blocks are
        made once per box (a plan's kernels have fixed boxes), each box run by a plan of its own."""
        box = tuple(box)
        return self._plans.run(op, dense, meeting(self._float(dtype), box), dtype, part=box)


def graph_operand(tensor: SparseTensor) -> GraphSparse:
    """The one :class:`GraphSparse` of ``tensor`` (kept with it, so equal graphs hash-cons)."""
    found = tensor.derived.get(_KEY)
    if not isinstance(found, GraphSparse):
        found = tensor.derived[_KEY] = GraphSparse.of(tensor)
    return found


def is_lazy(x: Any) -> bool:
    """Whether ``x`` is a lazy einjoin value (a frontend Tensor or an IR node)."""
    return isinstance(getattr(x, "node", x), Node)


def lazy_einsum(equation: str, operands: Sequence[Any], join: Any = None, agg: Any = "sum") -> Node:
    """The :class:`SparseEinsum` node of ``ej.einsum(equation, *operands)`` where one operand is
    a SparseTensor and the others lazy einjoin tensors (the frontend wraps the node)."""
    what = f"einsum {equation!r}"
    if join not in (None, "mul"):
        raise UnsupportedOpError(f"{what}: join {join!r} with a sparse operand in a graph; only the product "
                                 f"('mul') is supported")
    agg_name = getattr(agg, "name", agg)
    if agg_name not in ("sum", "max", None, "none"):
        raise UnsupportedOpError(f"{what}: aggregation {agg_name!r} with a sparse operand in a graph; 'sum' and "
                                 f"'max' are supported")
    sparse_at = [i for i, x in enumerate(operands) if isinstance(x, (SparseTensor, SparseInput))]
    if len(sparse_at) != 1:
        raise UnsupportedOpError(f"{what}: {len(sparse_at)} sparse operands with lazy ones; a graph's sparse "
                                 f"einsum takes exactly one SparseTensor (compute products of sparse "
                                 f"tensors eagerly with ej.einsum on the SparseTensors first)")
    dense: list[Node] = []
    for i, x in enumerate(operands):
        if i == sparse_at[0]:
            continue
        if not is_lazy(x):
            raise EinjoinError(f"{what}: operand {i} is a {type(x).__name__} among lazy einjoin tensors; "
                               f"with a sparse operand in a graph, give the dense operands as einjoin tensors "
                               f"(ej.input, ej.param, or values computed from them)")
        dense.append(getattr(x, "node", x))
    given = operands[sparse_at[0]]
    # numpy's broadcasting of a dense operand's size-1 dims, as ej.einsum and sparse_compile do
    # ('ij,jk->ik' of (5, 4) and (1, 3) reads x[0, k] for every j): those dims reshaped away
    found = size1_squeeze(equation, [tuple(getattr(x, "shape", ())) for x in operands])
    if found is not None and len(found[1][sparse_at[0]]) == len(given.shape):  # (the sparse one kept whole)
        equation, keeps = found
        keeps.pop(sparse_at[0])
        dense = [x if len(k) == len(x.shape) else ops.reshape_node(x, tuple(x.shape[d] for d in k))
                 for x, k in zip(dense, keeps)]
    # max: the largest product, an absent entry's being 0 (nothing aggregated: a sum of one term)
    kind = "max" if agg_name == "max" else "sum"
    if isinstance(given, SparseInput):  # fed at run: its keys and values are the node's last inputs
        node = sparse_einsum_node(given.operand, sparse_at[0], dense, equation, pattern=given.pattern, agg=kind)
    else:
        node = sparse_einsum_node(graph_operand(given), sparse_at[0], dense, equation, agg=kind)
    op = cast(SparseEinsum, node.op)  # (kinds are asked of tables outside the IR, never isinstance)
    summed = sorted({lab for ls in op.in_labels for lab in ls} - set(op.out_labels))
    if agg_name in (None, "none") and summed:  # as the dense einsum: no aggregation sums nothing
        raise EinsumSyntaxError(f"{what}: labels {''.join(summed)!r} are missing from the output but agg is "
                                f"None; give agg='sum'")
    return node


def sparse_inputs(name: str, value: Any, inputs: Mapping[str, Node]) -> dict[str, np.ndarray]:
    """The arrays of the graph inputs standing for the sparse input ``name`` (its values, and its
    keys ``name.keys[shape]``) among ``inputs`` (name -> input node) when ``value`` (a sparse tensor
    of any format ``ej.sparse`` reads) is fed as it: what a program holding a torch module's sparse
    buffer as state (the Trainer) loads once."""
    read = [inputs[n] for n in (name, keys_name(name, tuple(value.shape))) if n in inputs]
    return {k: np.asarray(v) for k, v in fed_feeds(Graph(read), {name: value}, inputs.keys()).items()}


LAZY["einsum"] = lazy_einsum
DECLARE_INPUT.append(sparse_input)  # from_torch's sparse arguments and buffers
