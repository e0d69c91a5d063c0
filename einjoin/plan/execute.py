"""What each task does, on numpy arrays, and the reference executor of a task graph.

Engines and backends share :func:`compute`; the reference executor runs a task graph in its
topological (id) order in a few lines — the oracle the engines are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.decomp.block_kernels import run_kernel
from einjoin.decomp.decompose import Decomposition
from einjoin.decomp.relation import TensorRelation
from einjoin.errors import EinjoinError
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.evaluate import QUIET_FLOATS
from einjoin.ir.kernels import fill_kernel
from einjoin.ir.node import Node
from einjoin.ir.printing import describe

__all__ = ["compute", "run_reference", "assemble_outputs", "assemble_output", "unaliased", "unshared",
           "to_host", "from_host", "COMPUTE"]

Getter = Callable[[int], "np.ndarray | None"]


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def compute(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray],
            decomps: Mapping[Node, Decomposition], shape: tuple[int, ...],
            fast: Callable[[list[Any]], np.ndarray | None] | None = None) -> np.ndarray:
    """The array task ``t`` writes (for a touch: the buffer after the write). ``get`` reads a
    value by id (None for a buffer no touch has allocated yet); ``shape`` is the written value's.
    ``fast``: for a kernel task, its kernel prepared for its blocks
    (:func:`einjoin.runtime.fastkernels.prepare_kernels`; it returns None for blocks it was not
    prepared for, and the general path runs).

    Floating-point edge cases (overflow, log 0, 0/0) give inf/nan as IEEE says and raise no
    numpy warning, whichever backend or thread runs the task: errstate is per thread, so it is
    set here around the task, unless the thread holds it already
    (:func:`~einjoin.ir.evaluate.quiet_floats`: a local backend's worker, for the whole run;
    entering it costs ~2 us, a small model's step has ~900 computing tasks)."""
    if getattr(QUIET_FLOATS, "on", False):
        return _compute(t, get, feeds, decomps, shape, fast)
    with np.errstate(all="ignore"):
        return _compute(t, get, feeds, decomps, shape, fast)


def _compute(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray],
             decomps: Mapping[Node, Decomposition], shape: tuple[int, ...],
             fast: Callable[[list[Any]], np.ndarray | None] | None) -> np.ndarray:
    rule = COMPUTE.get(t.kind)
    if rule is None:  # pragma: no cover - releases and reloads are the runtime's, not computations
        raise AssertionError(f"no computation for task kind {t.kind}")
    if fast is not None:
        out = fast([get(v) for v in t.reads])
        if out is not None and out.shape == shape:
            return out
    return rule(t, get, feeds, decomps, shape)


def _load(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
          shape: tuple[int, ...]) -> np.ndarray:
    # host and CPU devices share RAM: any block of a C-ordered feed is loaded as a view, a block of
    # columns too (values are never written in place; its rows are strided, which BLAS reads with
    # its leading dimension and ufuncs as they are); a block of any other feed is copied to C order.
    # Copying column blocks cost a pass over them per run: 2 x 32 MiB of the 4096 matmul's B,
    # ~7 ms of CPU each
    feed = feeds[t.node]
    block = feed[_slices(t.payload.box)]
    return np.asarray(block) if isinstance(feed, np.ndarray) and feed.flags.c_contiguous else \
        np.asarray(block, order="C")


def _fill(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
          shape: tuple[int, ...]) -> np.ndarray:
    return fill_kernel(t.node.op.expr, [a for a, _ in t.payload.box], shape, t.node.dtype)  # type: ignore[union-attr]


def _kernel(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
            shape: tuple[int, ...]) -> np.ndarray:
    d = decomps[t.node]
    i = t.payload.kernel
    k = d.kernels[i]
    it = iter(t.reads)
    blocks = [None if key is None else get(next(it)) for key in k.in_keys]
    out = np.asarray(run_kernel(d, k, blocks))
    if out.shape != shape:
        raise EinjoinError(f"kernel {i} of {describe(t.node)} produced shape {out.shape}, expected {shape}")
    return out


def _reduce(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
            shape: tuple[int, ...]) -> np.ndarray:
    # the partials' dtype (float32 for a half-precision sum) accumulates; the block's last step
    # writes the op's dtype (t.dtype), so the cast happens once
    acc = np.array(get(t.reads[0]))
    ufunc = t.payload.agg.ufunc
    for v in t.reads[1:]:
        ufunc(acc, get(v), out=acc)
    return acc.astype(numpy_dtype(t.dtype), copy=False) if t.dtype else acc


def _select(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
            shape: tuple[int, ...]) -> np.ndarray:
    return np.array(get(t.reads[0])[_slices(t.payload.box)])  # type: ignore[index]


def _move(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
          shape: tuple[int, ...]) -> np.ndarray:
    return np.array(get(t.reads[0]))


def _touch(t: Task, get: Getter, feeds: Mapping[Node, np.ndarray], decomps: Mapping[Node, Decomposition],
           shape: tuple[int, ...]) -> np.ndarray:
    buf = get(t.writes)
    if buf is None:
        buf = np.empty(shape, dtype=numpy_dtype(t.dtype or t.node.dtype))
    buf[_slices(t.payload.dst_box)] = get(t.reads[0])[_slices(t.payload.box)]  # type: ignore[index]
    return buf


# what each computing task kind writes (releases and reloads move values, see to_host / from_host)
COMPUTE: dict[TaskKind, Callable[..., np.ndarray]] = {
    TaskKind.LOAD: _load,
    TaskKind.FILL: _fill,
    TaskKind.KERNEL: _kernel,
    TaskKind.REDUCE: _reduce,
    TaskKind.SELECT: _select,
    TaskKind.MOVE: _move,
    TaskKind.TOUCH: _touch,
}


def to_host(t: Task, value: np.ndarray, host: dict[int, np.ndarray]) -> None:
    """An evict or write-back: a copy of ``value`` into the host store (a clean value, with
    ``nbytes`` 0, is only dropped by the caller)."""
    if t.nbytes or value.size == 0:  # an empty value weighs 0 bytes but must still arrive
        key = t.payload.host_key
        old = host.get(key)
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            np.copyto(old, value)  # a block evicted again reuses its host buffer (no new pages)
        else:
            host[key] = np.array(value, order="C")


def from_host(t: Task, host: Mapping[int, np.ndarray], feeds: Mapping[Node, np.ndarray]) -> np.ndarray:
    """A reload: a fresh device copy of the host store's block, or of the graph input's block."""
    p = t.payload
    if p.box is not None:
        return np.array(feeds[t.node][_slices(p.box)], order="C")
    return np.array(host[p.host_key], order="C")


def unaliased(value: Any, feeds: Mapping[Node, np.ndarray]) -> Any:
    """``value``, or a C-contiguous copy of it when it shares memory with a feed (a result or a
    kept block must never alias the caller's array); None passes through (the null backend)."""
    if value is not None and any(np.may_share_memory(value, f) for f in feeds.values()):
        return np.array(value, order="C")
    return value


def unshared(outs: Sequence[Any]) -> list[Any]:
    """``outs`` where no result shares memory with an earlier one (an output and a reshape or a
    transpose of it may be views of one block on one device): such a later one is copied, so
    writing one result never changes another (None passes through: the null backend). Only
    results over one underlying buffer are compared (one pass, not all pairs: a training
    program returns dozens of gradients every run)."""
    out = list(outs)
    by_root: dict[int, list[np.ndarray]] = {}
    for i, o in enumerate(out):
        if not isinstance(o, np.ndarray) or not o.size:
            continue
        root: Any = o
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        earlier = by_root.setdefault(id(root), [])
        if any(np.may_share_memory(o, e) for e in earlier):
            out[i] = o = np.array(o, order="C")
            by_root.setdefault(id(o), []).append(o)
        else:
            earlier.append(o)
    return out


def assemble_outputs(tg: object, get: Callable[[int], np.ndarray],
                     feeds: Mapping[Node, np.ndarray] = {}) -> list[np.ndarray]:
    """Dense outputs from their aggregated blocks (the fetch). An output that is a view of a
    feed (an input passed through, loads are views) is copied, so callers never alias inputs."""
    return [assemble_output(lay, get, feeds) for lay in tg.outputs]  # type: ignore[attr-defined]


def assemble_output(lay: Any, get: Callable[[int], np.ndarray], feeds: Mapping[Node, np.ndarray] = {}
                    ) -> np.ndarray:
    """One output (an :class:`~einjoin.plan.taskgraph.OutputLayout`) from its blocks, as
    :func:`assemble_outputs` does."""
    rel = TensorRelation(lay.partition, {k: get(v) for k, v in lay.blocks.items()})
    out: np.ndarray = unaliased(rel.to_dense(), feeds)
    return out


def run_reference(tg: object, decomps: Mapping[Node, Decomposition],
                  feeds: Mapping[Node, np.ndarray]) -> list[np.ndarray]:
    """Run every task in id order (a topological order) with one dictionary as every store."""
    vals: dict[int, np.ndarray] = {}
    host: dict[int, np.ndarray] = {}
    for t in tg.tasks:  # type: ignore[attr-defined]
        if t.kind.to_host:
            to_host(t, vals.pop(t.payload.frees), host)
        elif t.kind.releases:
            del vals[t.payload.frees]
        elif t.kind is TaskKind.RELOAD:
            vals[t.writes] = from_host(t, host, feeds)
        else:
            vals[t.writes] = compute(t, vals.get, feeds, decomps, tg.values[t.writes].shape)  # type: ignore[attr-defined]
    return assemble_outputs(tg, (host if tg.memory is not None else vals).__getitem__, feeds)  # type: ignore[attr-defined]
