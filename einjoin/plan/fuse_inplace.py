"""Elementwise kernels that write into a dying input block instead of a fresh one (issue 22).

An elementwise kernel on a contraction's output -- the MLP's ``relu(x @ W1)`` -- read a block
and wrote a new one of the same size: numpy allocated it (a 64 MiB block is a fresh ``mmap``
that the kernel zeroes page by page at first touch), and the block read was freed right after.
Where nothing else can see the block read, the kernel writes its result into it instead
(``np.maximum(h, 0, out=h)``): the same ufunc on the same numbers, so the same bits, one pass
over memory and no fresh block. ``donations(tg, decomps)`` finds, from the task graph alone,
the kernel tasks that may do so and the block each may write into (:class:`Donation`):

- the kernel's op is an einsum whose join is one ufunc of its arguments and constants (with
  an in-place form: :data:`einjoin.ir.evaluate`'s, and ``relu``), nothing aggregated, float32
  or float64 throughout;
- the block donated is one of its inputs, in the output's label order, shape and dtype (no
  transpose, no broadcast), written by a kernel task (never a feed's view, a move's hand-over
  or a select's slice), read by this task alone and no block of a graph output.

At run time the donor must also be an array that nothing else holds (its reference count: a
view of it, a second store entry, an attention memo would show), itself or as the whole of the
array it views (a kernel's block is often a reshape of the array numpy returned), else
the kernel runs as before; the local session (:mod:`einjoin.runtime.local`) calls it only for
uncapped runs without state. Measured (the MLP's per-device work, one BLAS thread, CPU time):
see ``docs/architecture.md``, Runtime.

>>> import numpy as np, einjoin as ej
>>> x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
>>> prog = ej.compile(ej.relu(x @ w), devices=2, backend="threads", quiet=True)
>>> sorted(d.arg for d in donations(prog.taskgraph, prog.decomps).values())
[0, 0]
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from einjoin.decomp.block_kernels import BLOCK_KERNELS, _einsum_block
from einjoin.decomp.decompose import Decomposition
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.evaluate import _FAST, _RAW
from einjoin.ir.node import Node, rule_for
from einjoin.ir.opkinds import Einsum
from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const
from einjoin.plan.taskgraph import TaskGraph

__all__ = ["Donation", "donations", "engine_donations"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _alone() -> tuple[int, int]:
    """What ``sys.getrefcount`` says in :meth:`Donation.__call__` of a block nothing else holds
    (the store's entry, the local name, getrefcount's own argument: 3 on CPython 3.11), and of
    the array a block views (its ``base``, the local name, the argument): measured the same way
    once, since later interpreters count borrowed references differently."""
    values = {0: np.empty(2)}
    x = values.get(0)
    alone = sys.getrefcount(x)
    values[1] = np.empty(4)[1:3]
    v = values.get(1)
    owner = v.base if v is not None else None
    viewed = sys.getrefcount(owner)
    return alone, viewed


_ALONE, _VIEWED = _alone()


@dataclass(frozen=True)
class Donation:
    """Kernel task ``task`` may write its block into its input ``arg`` (value ``value``)."""

    task: int
    value: int
    arg: int
    reads: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    # the join's calls, innermost first: (ufunc, its arguments), each argument ("v",) the value so
    # far (the donor at first), ("c", a constant) or ("a", position in reads, transpose, shape)
    steps: tuple[tuple[Callable[..., Any], tuple[tuple[Any, ...], ...]], ...]

    def __call__(self, values: Mapping[int, Any], pool: Any = None) -> np.ndarray | None:
        """The task's block computed into the donor (``values``: its device's store), or None
        when the donor is not a block of the planned shape and dtype that nothing else holds
        (``pool``: a program's block pool, :mod:`einjoin.runtime.blockpool`, whose ``holds(a)``
        says that it holds one more reference to ``a``, which it hands out only when unheld)."""
        x = values.get(self.value)
        if type(x) is not np.ndarray or x.shape != self.shape or x.dtype != self.dtype \
                or not x.flags.writeable or not x.flags.c_contiguous \
                or sys.getrefcount(x) > _ALONE + (pool is not None and pool.holds(x)):
            return None
        owner = x.base  # a kernel's block may be a reshaped view of the array numpy returned
        if owner is not None and (type(owner) is not np.ndarray or owner.base is not None
                                  or owner.nbytes != x.nbytes
                                  or sys.getrefcount(owner) > _VIEWED + (pool is not None and pool.holds(owner))):
            return None
        owner = None
        calls = []
        for u, args in self.steps:  # every other block checked before anything is written
            xs: list[Any] = []
            for a in args:
                if a[0] == "v":
                    xs.append(x)
                elif a[0] == "c":
                    xs.append(a[1])
                else:
                    b = values.get(self.reads[a[1]])
                    if type(b) is not np.ndarray or b.dtype != self.dtype:
                        return None
                    xs.append(b.transpose(a[2]).reshape(a[3]))
            calls.append((u, xs))
        for u, xs in calls:
            u(*xs, out=x)
        return x


def _relu(x: Any, *rest: Any, out: np.ndarray) -> np.ndarray:
    r: np.ndarray = np.maximum(x, 0, out=out)  # FUNCTIONS["relu"]'s call, into ``out``
    return r


# functions of floats that give floats of the same dtype (no comparison's bool in between)
_ARITH = frozenset({"add", "sub", "mul", "div", "max", "min", "neg", "abs", "exp", "log", "log1p", "expm1",
                    "sqrt", "tanh", "sin", "cos", "relu"})


def _ufunc(fn: str, n_args: int) -> Callable[..., Any] | None:
    """The function computing ``fn`` into ``out=`` exactly as its implementation computes it."""
    if fn not in _ARITH or fn not in FUNCTIONS:
        return None
    if fn == "relu":
        return _relu if n_args == 1 else None
    form = _FAST.get(FUNCTIONS[fn].impl)
    return _RAW.get(form) if form is not None else None


def _chain(join: Any) -> tuple[list[tuple[Any, list[Any]]], list[int]] | None:
    """The join as a chain of calls, innermost first, each with one argument that is the chain
    (the call below it, or an argument at the bottom: the candidate donors) and the others
    arguments or constants; None where it is not one."""
    calls: list[tuple[Any, list[Any]]] = []
    e = join
    while True:
        if not isinstance(e, Call):
            return None
        u = _ufunc(e.fn, len(e.args))
        inner = [a for a in e.args if isinstance(a, Call)]
        if u is None or len(inner) > 1 or any(isinstance(a, Const) and type(a.value) not in (int, float)
                                               for a in e.args):
            return None
        calls.append((u, list(e.args)))
        if not inner:
            calls.reverse()
            return calls, [a.index for a in e.args if isinstance(a, Arg)]
        e = inner[0]


def donations(tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> dict[int, Donation]:
    """Per kernel task id, the input block it may compute into (see the module's docstring)."""
    readers: dict[int, int] = {}
    writer: dict[int, Task] = {}
    for t in tg.tasks:
        writer[t.writes] = t
        if t.kind is not TaskKind.FREE:  # an evict or a writeback reads its value: it counts
            for v in t.reads:
                readers[v] = readers.get(v, 0) + 1
    outputs = {v for lay in tg.outputs for v in lay.blocks.values()}
    got: dict[int, Donation] = {}
    for t in tg.tasks:
        if t.kind is TaskKind.KERNEL:
            d = _donation(t, tg, decomps, readers, writer, outputs)
            if d is not None:
                got[t.id] = d
    return got


def _donation(t: Task, tg: TaskGraph, decomps: Mapping[Node, Decomposition], readers: Mapping[int, int],
              writer: Mapping[int, Task], outputs: set[int]) -> Donation | None:
    d = decomps.get(t.node)
    if d is None or d.n_partials != 1 or not t.reads:
        return None
    if not d.node.facts.contracts:  # contracts promises an Einsum op (ir.node.KindFacts)
        return None
    op = cast(Einsum, d.node.op)
    if op.agg_labels or not isinstance(op.join, Call):
        return None
    if rule_for(BLOCK_KERNELS, op, "the block kernels") is not _einsum_block:
        return None
    k = d.kernels[t.payload.kernel]
    if len(k.in_keys) != len(t.reads) or any(key is None for key in k.in_keys):
        return None
    chain = _chain(op.join)
    dtype = np.dtype(numpy_dtype(d.node.dtype))
    out = tg.values[t.writes]
    if chain is None or dtype not in _FLOATS or any(np.dtype(numpy_dtype(tg.values[v].dtype)) != dtype
                                                     for v in t.reads):
        return None
    calls, bottom = chain
    uses: dict[int, int] = {}
    for _, args in calls:
        for a in args:
            if isinstance(a, Arg):
                uses[a.index] = uses.get(a.index, 0) + 1
    donor = None
    for i in bottom:  # read once in the whole join: written over after its one use
        v = t.reads[i]
        w = writer.get(v)
        if (uses[i] == 1 and tuple(op.in_labels[i]) == tuple(op.out_labels) and tg.values[v].shape == out.shape
                and readers.get(v) == 1 and v not in outputs and w is not None and w.kind is TaskKind.KERNEL
                and w.device == t.device):
            donor = i
            break
    if donor is None:
        return None
    order = op.all_labels
    steps = []
    for n, (u, args) in enumerate(calls):
        spec: list[tuple[Any, ...]] = []
        for a in args:
            if isinstance(a, Call) or (n == 0 and isinstance(a, Arg) and a.index == donor):
                spec.append(("v",))
            elif isinstance(a, Const):
                spec.append(("c", a.value))
            else:
                labels = op.in_labels[a.index]
                if len(set(labels)) < len(labels):
                    return None  # a diagonal
                shape = tg.values[t.reads[a.index]].shape
                perm = tuple(sorted(range(len(labels)), key=lambda j: order.index(labels[j])))
                sizes = iter([shape[p] for p in perm])
                spec.append(("a", a.index, perm, tuple(next(sizes) if lab in labels else 1 for lab in order)))
        steps.append((u, tuple(spec)))
    return Donation(t.id, t.reads[donor], donor, tuple(t.reads), tuple(out.shape), dtype, tuple(steps))


_PLANS: weakref.WeakKeyDictionary[Any, dict[int, Donation]] = weakref.WeakKeyDictionary()


def engine_donations(engine: Any) -> dict[int, Donation]:
    """The engine's :func:`donations`, worked out on its first run (once per program)."""
    got = _PLANS.get(engine)
    if got is None:
        got = _PLANS[engine] = donations(engine.tg, engine.decomps)
    return got
