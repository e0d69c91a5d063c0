"""A run's outputs assembled where their blocks are computed (the local backends' sessions).

An output of several blocks used to be assembled after the run, on the caller's thread, once
every device had finished: one more pass over it, serial (the 4096 matmul's 64 MiB output, two
column blocks: ~12-15 ms of CPU, 2% of the run, after the devices' work). Instead the session
allocates each such output once per run (:class:`OutputSlots`; ``np.empty``: no page is touched
before a block lands) and each block lands in its *slot*, a view of the output, on the device
thread that writes it, as it is written:

- a kernel that is one matmul (:func:`einjoin.ir.kernels.matmul_route`'s ``matmul`` path on a
  block large enough that :func:`einjoin.ir.kernels._matmul` makes it one ``np.matmul``) writes
  its product into the slot: ``np.matmul(..., out=slot)``, BLAS with the output's leading
  dimension, the same call and bits as the kernel's own (no block allocated, no copy);
- a touch fills the slot as its buffer;
- any other task's block is copied into the slot once written (on its device's thread, in
  parallel with the other devices' work), and the slot stands for the block from then on.

A block that reached the store any other way (another dtype or shape than its slot's) is copied
at the end. Outputs of one block are returned as before (the block itself, no copy), and so is
every output of a memory-capped graph (its outputs end in the host store) or of a program with
state; an output whose blocks appear in another output too is assembled as before.

>>> import numpy as np, einjoin as ej
>>> a, b = ej.input("a", (256, 512)), ej.input("b", (512, 512))
>>> prog = ej.compile(a @ b, devices=2, backend="threads", planner="split_largest", quiet=True)
>>> x, y = np.ones((256, 512), np.float32), np.ones((512, 512), np.float32)
>>> bool((prog.run(a=x, b=y) == x @ y).all())
True
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from einjoin.decomp.block_kernels import BLOCK_KERNELS, _einsum_block
from einjoin.decomp.decompose import Decomposition
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.kernels import matmul_route
from einjoin.ir.node import Einsum, Node, rule_for
from einjoin.plan.taskgraph import OutputLayout, TaskGraph

__all__ = ["OutputPlan", "OutputSlots", "output_plan"]

# a kernel writing its block into a slot: (its input blocks, the slot) -> whether it did (False:
# the blocks are not what it was prepared for; the task then runs as usual)
Into = Callable[[Sequence[Any], np.ndarray], bool]

# _matmul's split-k sum covers outputs up to this many elements; above it a product is one np.matmul
_SPLIT_K_AREA = 65536


@dataclass(frozen=True)
class OutputPlan:
    """Per engine, what does not change between runs: per output, its shape, dtype and each
    block's value id and slices (None: assembled as before); per task id, its kernel that writes
    into its slot."""

    layouts: tuple[tuple[tuple[int, ...], np.dtype[Any], tuple[tuple[int, tuple[slice, ...]], ...]] | None, ...]
    into: Mapping[int, Into]
    touched: frozenset[int]  # value ids a touch writes (their slot is the touch's buffer)


_PLANS: weakref.WeakKeyDictionary[Any, OutputPlan] = weakref.WeakKeyDictionary()


def output_plan(engine: Any) -> OutputPlan:
    """The engine's :class:`OutputPlan`, worked out on its first run (once per program)."""
    got = _PLANS.get(engine)
    if got is None:
        got = _PLANS[engine] = _plan(engine.tg, engine.decomps)
    return got


def _plan(tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> OutputPlan:
    seen: dict[int, int] = {}
    for lay in tg.outputs:
        for v in lay.blocks.values():
            seen[v] = seen.get(v, 0) + 1
    layouts: list[Any] = []
    slotted: set[int] = set()
    for lay in tg.outputs:
        if len(lay.blocks) < 2 or any(seen[v] > 1 for v in lay.blocks.values()):
            layouts.append(None)
            continue
        blocks = tuple((v, lay.partition.slices(k)) for k, v in lay.blocks.items())
        layouts.append((lay.partition.shape, _dtype(lay), blocks))
        slotted.update(v for v, _ in blocks)
    into: dict[int, Into] = {}
    touched = set()
    for t in tg.tasks:
        if t.writes in slotted:
            if t.kind is TaskKind.KERNEL:
                fn = _matmul_into(t, tg, decomps)
                if fn is not None:
                    into[t.id] = fn
            elif t.kind is TaskKind.TOUCH and np.dtype(numpy_dtype(t.dtype or t.node.dtype)) == \
                    np.dtype(numpy_dtype(tg.values[t.writes].node.dtype)):
                touched.add(t.writes)  # its buffer, in the touch's dtype (execute.py's _touch)
    return OutputPlan(tuple(layouts), into, frozenset(touched))


def _dtype(lay: OutputLayout) -> np.dtype[Any]:
    return np.dtype(numpy_dtype(lay.node.dtype))


class OutputSlots:
    """One run's outputs of several blocks, allocated, and each block's slot (value id -> a view
    of its output). ``land(t, value)`` puts a block the task wrote into its slot and returns what
    the store keeps; ``outputs(get, assemble)`` the run's outputs."""

    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self.dense: list[np.ndarray | None] = []
        self.views: dict[int, np.ndarray] = {}
        for lay in plan.layouts:
            if lay is None:
                self.dense.append(None)
                continue
            shape, dtype, blocks = lay
            out = np.empty(shape, dtype)
            self.dense.append(out)
            for v, sl in blocks:
                self.views[v] = out[sl]

    def land(self, value: Any, view: np.ndarray) -> Any:
        """``value``, a block just written, in its slot ``view``: the view (the value copied into
        it, unless it is the view already), or the value itself when it does not fit the slot."""
        if value is view:
            return view
        if isinstance(value, np.ndarray) and value.shape == view.shape and value.dtype == view.dtype:
            np.copyto(view, value)
            return view
        return value

    def outputs(self, layouts: Sequence[OutputLayout], get: Callable[[int], Any],
                assemble: Callable[[OutputLayout], np.ndarray]) -> list[np.ndarray]:
        """Each output: its dense array (a block that is not in its slot copied now), or, where it
        has none or a block of another dtype or shape than its slot's, ``assemble(layout)`` (the
        output as its blocks make it, as before)."""
        outs = []
        for lay, out, plan in zip(layouts, self.dense, self.plan.layouts):
            if out is None or plan is None:
                outs.append(assemble(lay))
                continue
            views = self.views
            late = [(sl, got) for sl, got, view in ((sl, get(v), views[v]) for v, sl in plan[2]) if got is not view]
            if any(np.shape(got) != out[sl].shape or getattr(got, "dtype", None) != out.dtype for sl, got in late):
                outs.append(assemble(lay))
                continue
            for sl, got in late:
                out[sl] = got
            outs.append(out)
        return outs


def _matmul_into(t: Task, tg: TaskGraph, decomps: Mapping[Node, Decomposition]) -> Into | None:
    """For a kernel task that is one ``np.matmul`` of two float blocks of one dtype (the general
    path's ``_batched_matmul`` with nothing summed first and an output above the split-k sizes),
    the same product written into its slot; else None."""
    d = decomps.get(t.node)
    if d is None or d.n_partials != 1 or not d.node.facts.contracts:
        return None
    if rule_for(BLOCK_KERNELS, d.node.op, "the block kernels") is not _einsum_block:
        return None
    k = d.kernels[t.payload.kernel]
    if len(k.in_keys) != 2 or any(key is None for key in k.in_keys) or len(t.reads) != 2:
        return None
    dt = np.dtype(numpy_dtype(d.node.dtype))
    shapes = [tg.values[v].shape for v in t.reads]
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) or \
            any(np.dtype(numpy_dtype(tg.values[v].dtype)) != dt for v in t.reads):
        return None
    r = matmul_route(cast(Einsum, d.node.op), [dt, dt])  # an einsum: the kind contracts
    lx, ly = r.x_labels, r.y_labels
    if r.path != "matmul" or r.x_sum or r.y_sum or not r.k or len(shapes[0]) != len(lx) or len(shapes[1]) != len(ly):
        return None
    if not r.m and not r.n and lx[-1] in r.batch and ly[-1] in r.batch:
        return None  # the dot-product route (np.einsum)
    size = dict(zip(lx, shapes[0])) | dict(zip(ly, shapes[1]))

    def prod(labels: tuple[str, ...]) -> int:
        return math.prod(size[lab] for lab in labels)

    batch, m, n, kk = r.batch, r.m, r.n, r.k
    sx, sy, sz = (prod(batch), prod(m), prod(kk)), (prod(batch), prod(kk), prod(n)), (prod(batch), prod(m), prod(n))
    if sz[1] * sz[2] <= _SPLIT_K_AREA:
        return None  # maybe a split-k sum (_matmul): the general path
    px = [lx.index(lab) for lab in batch + m + kk]
    py = [ly.index(lab) for lab in batch + kk + n]
    pz = [r.out_labels.index(lab) for lab in batch + m + n]  # the slot's axes in matmul order
    item = dt.itemsize

    def into(blocks: Sequence[Any], out: np.ndarray) -> bool:
        x, y = blocks
        if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.shape == shapes[0]
                and y.shape == shapes[1] and x.dtype == dt and y.dtype == dt):
            return False
        z = _reshaped_view(np.transpose(out, pz), sz)
        # BLAS writes it only with unit stride along a row (else numpy's own loop would: other bits)
        if z is None or z.strides[2] != item or z.strides[1] < sz[2] * item:
            return False
        np.matmul(np.transpose(x, px).reshape(sx), np.transpose(y, py).reshape(sy), out=z)
        return True
    return into


def _reshaped_view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``a`` reshaped as a view (None where that needs a copy)."""
    try:
        got: np.ndarray = np.reshape(a, shape, copy=False)  # numpy >= 2.1: raises where a copy is needed
        return got
    except ValueError:
        return None
    except TypeError:  # older numpy: no copy argument
        v: np.ndarray = a.view()
        try:
            v.shape = shape  # raises where the strides cannot express it
        except AttributeError:
            return None
        return v
