"""The compiled sparse plans of a graph's sparse operand (a constant, ``einjoin.sparse.node``, or
one fed at run, ``einjoin.sparse.feed``): what a ``SparseEinsum`` kernel runs."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.ir.dtypes import is_half, numpy_dtype
from einjoin.ir.opkinds import SparseEinsum
from einjoin.sparse.grad_max import max_grads
from einjoin.sparse.plan import SparsePlan, sparse_compile
from einjoin.sparse.tensor import SparseTensor

__all__ = ["PlanCache", "meeting"]


class PlanCache:
    """The compiled sparse plans of one graph operand: one per (equation, aggregation, dense
    shapes and dtypes), each run under its own lock (a plan's run keeps per-run state).

    ``blocks`` / ``relational`` / ``engine``: the pins ``ej.compile`` gave the operand
    (:mod:`einjoin.sparse.pins`); each plan takes those of its own labels."""

    __slots__ = ("_plans", "_lock", "blocks", "relational", "engine")

    def __init__(self, blocks: Sequence[tuple[str, int]] = (), relational: Sequence[str] = (),
                 engine: str = "memory") -> None:
        self._plans: dict[tuple[Any, ...], tuple[SparsePlan, threading.Lock]] = {}
        self._lock = threading.Lock()
        self.blocks, self.relational, self.engine = tuple(blocks), tuple(relational), engine

    def compile(self, op: SparseEinsum, operands: Sequence[Any]) -> SparsePlan:
        """A plan of ``op`` on ``operands`` (the dense ones as arrays, the sparse one in place)
        under the pins of the op's labels; one device, ``backend="sync"``: the dense engine runs
        the kernel on its device's thread."""
        labels = {lab for ls in op.in_labels for lab in ls}
        blocks = {lab: b for lab, b in self.blocks if lab in labels}
        relational = [lab for lab in self.relational if lab in labels]
        return sparse_compile(op.equation, *operands, agg=op.agg, backend="sync", engine=self.engine,
                              blocks=blocks or None, relational=relational or None)

    def plans(self, op: SparseEinsum | None = None) -> list[SparsePlan]:
        """The plans compiled so far (what ``explain()`` shows of a fed operand after a run);
        ``op``: only that node's einsum's (an operand's forward and gradient nodes share a cache)."""
        with self._lock:
            return [p for k, (p, _) in self._plans.items()
                    if op is None or k[:4] == (op.in_labels, op.out_labels, op.position, op.agg)]

    def run(self, op: SparseEinsum, dense: Sequence[np.ndarray], tensor: SparseTensor, dtype: str,
            part: Any = None) -> np.ndarray:
        """The einsum of ``op`` on ``tensor`` and the dense blocks ``dense``, as a dense array of
        ``dtype``: half blocks computed in float32 and rounded once. ``part``: a kernel's box of
        the tensor (:func:`meeting`), which gets a plan of its own, so that kernels of one node on
        several devices run at once (a plan runs under its lock) and keep their own patterns."""
        arrays = [np.asarray(a.astype(np.float32) if is_half(a.dtype) else a, order="C") for a in dense]
        if op.agg in ("maxgrad", "maxgradvalues"):  # a max node's adjoint: no plan, its products at the entries
            return _max_grad(op, arrays, tensor).astype(numpy_dtype(dtype), copy=False)
        key = (op.in_labels, op.out_labels, op.position, op.agg, tuple((a.shape, a.dtype.str) for a in arrays),
               part)
        operands: list[Any] = list(arrays)
        operands.insert(op.position, tensor)
        with self._lock:
            found = self._plans.get(key)
            if found is None:
                # one device: the dense engine runs this kernel on its device's thread; compiled
                # once per shapes, so later calls skip the layout choice (a fed tensor of another
                # pattern is replanned by the plan's run, cached per block histogram)
                plan = self.compile(op, operands)
                found = self._plans[key] = (plan, threading.Lock())
        plan, lock = found
        with lock:
            out = plan.run(*operands)
        res = out.todense() if isinstance(out, SparseTensor) else np.asarray(out)
        return res.astype(numpy_dtype(dtype), copy=False)


def _max_grad(op: SparseEinsum, arrays: list[np.ndarray], tensor: SparseTensor) -> np.ndarray:
    """A ``maxgrad`` kernel (``ir.sparse_einsum``'s adjoint of a max node): operand 0 is the
    output's cotangent, the others the forward's operands, the cotangent wanted that of operand 1
    (dense): :func:`einjoin.sparse.grad_max.max_grads` on them, ties split as torch's amax."""
    values: list[Any] = list(arrays)
    values.insert(op.position, tensor)
    fwd = len(values) - (op.agg == "maxgradvalues")  # that one's last operand only gives the entries' count
    # the forward's labels only (the entry label is no term of the max: it would count as absent ones)
    sizes = {lab: n for ls, v in zip(op.in_labels[:fwd], values[:fwd]) for lab, n in zip(ls, v.shape)}
    dtype = np.result_type(*(np.dtype(v.dtype) for v in values[1:fwd]))
    (grad,) = max_grads(values[1:fwd], op.in_labels[1:fwd], op.in_labels[0], sizes, dtype, values[0], [0],
                        f"the gradient of sparse_einsum {op.equation!r} (agg='max')")
    if op.agg == "maxgrad":
        return np.asarray(grad)
    # a fed operand's values: the run's tensor holds the used rows of the keys input in their order
    # (sorted, unique: the feed hook wrote them so), its gradient the same entries, perhaps reordered
    assert isinstance(grad, SparseTensor)
    out = np.zeros(len(values[-1]), dtype)
    rows = _rows(tensor, grad)
    out[rows] = np.asarray(grad.coo()[1])
    return out


def _rows(tensor: SparseTensor, part: SparseTensor) -> np.ndarray:
    """The positions in ``tensor``'s stored entries of ``part``'s (a subset), by key code."""
    dims = np.asarray(tensor.shape, np.int64)

    def codes(t: SparseTensor) -> np.ndarray:
        c = np.zeros(t.nnz, np.int64)
        for d, coord in enumerate(np.asarray(t.coo()[0], np.int64).reshape(-1, len(dims)).T):
            c = c * dims[d] + coord
        return c
    mine = codes(tensor)
    order = np.argsort(mine, kind="stable")
    return np.asarray(order[np.searchsorted(mine[order], codes(part))])


def meeting(t: SparseTensor, box: tuple[tuple[int, int] | None, ...]) -> SparseTensor:
    """The stored blocks of ``t`` that meet ``box`` (per dim of ``t``, an index range, or None:
    all): what a kernel of a node cut along the tensor's own dims computes (its rows). Kept in
    ``t.derived`` (per box: a plan's kernels have fixed boxes), so a tensor used again (a constant,
    a fed tensor equal to the last run's) keeps its parts and the joins derived from them. The
    keys are sorted, so the first dim's range is a slice (a binary search), the others a mask.

    >>> t = SparseTensor("A", (4, 3), (1, 1), np.array([[0, 1], [1, 0], [2, 2], [3, 1]]),
    ...                  np.arange(4.0).reshape(4, 1, 1))
    >>> meeting(t, ((1, 3), None)).keys.tolist(), meeting(t, (None, (1, 2))).keys.tolist()
    ([[1, 0], [2, 2]], [[0, 1], [3, 1]])
    """
    key = ("meeting", box)
    found = t.derived.get(key)
    if isinstance(found, SparseTensor):
        return found
    keys, data = np.asarray(t.keys), np.asarray(t.data)
    lo, hi = 0, len(keys)
    if box and box[0] is not None and len(keys):  # blocks [a // b, ceil(c / b)) of the first dim
        b = t.block[0]
        lo, hi = (int(v) for v in np.searchsorted(keys[:, 0], [box[0][0] // b, -(-box[0][1] // b)]))
    keys, data = keys[lo:hi], data[lo:hi]
    keep = None
    for d, r in enumerate(box[1:], 1):
        if r is not None:
            start = keys[:, d] * t.block[d]
            hit = (start < r[1]) & (start + t.block[d] > r[0])
            keep = hit if keep is None else keep & hit
    if keep is not None:
        keys, data = keys[keep], data[keep]
    found = SparseTensor(t.name, t.shape, t.block, keys, data, trusted=True)
    if len(t.derived) < 512:  # bounded: a few plans' kernels (a dict's set is atomic: threads may race)
        t.derived[key] = found
    return found
