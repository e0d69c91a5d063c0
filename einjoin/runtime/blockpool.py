"""Large intermediate blocks kept per program and written again by its later runs (issue 22).

A block of 32 MiB or more is a fresh ``mmap`` even with glibc tuned (:mod:`einjoin.runtime.malloc`:
its largest heap threshold is 32 MiB), so every run's kernel that writes one page-faults it in
and the kernel zeroes it page by page first (the 4096 chain's two 32 MiB intermediates: ~13 ms
of system time per 64 MiB per run). A program's :class:`BlockPool` keeps such arrays between
runs instead, and a matmul kernel whose block is one of them computes into an array of the pool
(``np.matmul(out=)``, :func:`einjoin.runtime.outputs._matmul_into`: the same call and bits as
the kernel's own) once nothing else holds that array.

Safety is the array's reference count, read after taking a reference of our own: an array of
the pool is handed out again only when the pool's list is its one other holder -- not while a
store, a view of it (a view holds its base), a second run on another thread or the caller holds
it. Which blocks may come from the pool is fixed per program (:func:`engine_pool`), from the task
graph alone:

- a kernel task that is one ``np.matmul`` of float blocks (:func:`_matmul_into` finds one) and
  writes at least :data:`POOL_MIN_BYTES`;
- its block, and every block a move hands it over as or an elementwise kernel writes into it
  (a donation, :mod:`einjoin.plan.fuse_inplace`), is no block of a graph output (a result is
  the caller's own array, never the pool's);
- every kernel that reads it is an einsum's (numpy on the block's numbers; an attention kernel
  keys its forward memo by the arrays' identity, which a block written again would fool).

The local session (:mod:`einjoin.runtime.local`) uses the pool for runs without a memory cap
and without program state (state blocks live on between runs; a capped run's blocks own their
bytes in a store that counts them). ``POOL_BLOCKS = False`` turns it off (then every block is
numpy's own, as before).

>>> import numpy as np, einjoin as ej
>>> a, b, c = (ej.input(n, (4096, 4096)) for n in "abc")
>>> prog = ej.compile(a @ b @ c, devices=2, backend="threads", quiet=True)
>>> sorted(engine_pool(prog._engine).kernels) == sorted(
...     t.id for t in prog.taskgraph.tasks if t.kind == "kernel" and t.writes not in
...     {v for lay in prog.taskgraph.outputs for v in lay.blocks.values()})
True
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.decomp.block_kernels import BLOCK_KERNELS, _einsum_block
from einjoin.decomp.decompose import Decomposition
from einjoin.exchange import TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.node import Node, rule_for
from einjoin.plan.fuse_inplace import engine_donations
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime.outputs import _matmul_into

__all__ = ["POOL_BLOCKS", "POOL_MIN_BYTES", "POOL_MAX_BYTES", "BlockPool", "EnginePool", "engine_pool", "release"]

# whether the local sessions use a program's pool (False: every block is numpy's own)
POOL_BLOCKS = True
# blocks below this come from glibc's heap, which keeps freed memory (malloc.tune_malloc)
POOL_MIN_BYTES = 32 << 20
# at most this many bytes of arrays per program; above it a block is numpy's own, as before
POOL_MAX_BYTES = 1 << 30


def _alone() -> int:
    """What ``sys.getrefcount`` says in :meth:`BlockPool.empty` of an array only the pool's list
    holds (the list, the loop's name, getrefcount's argument), measured once as it is read there."""
    arrays = [np.empty(2)]
    for a in arrays:
        return sys.getrefcount(a)
    return 0  # pragma: no cover


_ALONE = _alone()


class BlockPool:
    """Arrays by (shape, dtype), each handed out again once nothing but the pool holds it.

    >>> pool = BlockPool()
    >>> a = pool.empty((1024, 1024), np.float32)
    >>> b = pool.empty((1024, 1024), np.float32)  # ``a`` is held (by the name ``a``): a new one
    >>> b is a, pool.nbytes == 2 * (4 << 20)
    (False, True)
    >>> held = id(a); del a  # nothing holds it now but the pool
    >>> id(pool.empty((1024, 1024), np.float32)) == held, pool.reused
    (True, 1)
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = POOL_MAX_BYTES if max_bytes is None else max_bytes
        self.nbytes = 0
        self.reused = 0  # arrays handed out again (for tests and benches)
        self._arrays: dict[tuple[tuple[int, ...], np.dtype[Any]], list[np.ndarray]] = {}
        self._ids: set[int] = set()  # the pool keeps its arrays alive: their ids stay theirs
        self._lock = threading.Lock()

    def holds(self, x: Any) -> bool:
        """Whether ``x`` is one of the pool's arrays (then the pool holds one reference to it)."""
        return id(x) in self._ids

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-ordered array: one of the pool's that nothing else holds, else a new
        one (kept by the pool while it has room)."""
        dt = np.dtype(dtype)
        key = (shape, dt)
        with self._lock:
            arrays = self._arrays.setdefault(key, [])
            for a in arrays:
                # a reference of our own (``a``) is taken before the count is read: a taker on
                # another thread holds one too, so two takers never both see the array alone
                if sys.getrefcount(a) <= _ALONE:
                    self.reused += 1
                    return a
            got = np.empty(shape, dt)
            if self.nbytes + got.nbytes <= self.max_bytes:
                arrays.append(got)
                self._ids.add(id(got))
                self.nbytes += got.nbytes
            return got


class EnginePool:
    """A program's pool and, per kernel task id that may write into it, that kernel
    (its input blocks -> its block in an array of the pool, or None: not what it was prepared for,
    the task then runs as usual)."""

    def __init__(self, kernels: Mapping[int, tuple[Callable[[Sequence[Any], np.ndarray], bool],
                                                  tuple[int, ...], np.dtype[Any]]]) -> None:
        self.pool = BlockPool()
        self.holds = self.pool.holds
        self.kernels: dict[int, Callable[[Sequence[Any]], np.ndarray | None]] = {
            tid: self._kernel(into, shape, dt) for tid, (into, shape, dt) in kernels.items()}

    def _kernel(self, into: Callable[[Sequence[Any], np.ndarray], bool], shape: tuple[int, ...],
                dt: np.dtype[Any]) -> Callable[[Sequence[Any]], np.ndarray | None]:
        empty = self.pool.empty

        def run(blocks: Sequence[Any]) -> np.ndarray | None:
            out = empty(shape, dt)
            return out if into(blocks, out) else None
        return run


_POOLS: weakref.WeakKeyDictionary[Any, EnginePool] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def engine_pool(engine: Any) -> EnginePool:
    """The engine's :class:`EnginePool`, worked out on its first run (once per program)."""
    got = _POOLS.get(engine)
    if got is None:
        with _POOLS_LOCK:
            got = _POOLS.get(engine)
            if got is None:
                got = _POOLS[engine] = EnginePool(_pooled(engine.tg, engine.decomps, engine_donations(engine)))
    return got


def release(engine: Any) -> None:
    """Drop the engine's pool (``prog.close()``): its arrays go once no run in flight holds them;
    a later run starts an empty one."""
    with _POOLS_LOCK:
        _POOLS.pop(engine, None)


def _pooled(tg: TaskGraph, decomps: Mapping[Node, Decomposition], donated: Mapping[int, Any] | None = None
            ) -> dict[int, tuple[Callable[[Sequence[Any], np.ndarray], bool], tuple[int, ...], np.dtype[Any]]]:
    if tg.memory is not None:
        return {}
    outputs = {v for lay in tg.outputs for v in lay.blocks.values()}
    readers: dict[int, list[Any]] = {}
    for t in tg.tasks:
        for v in t.reads:
            readers.setdefault(v, []).append(t)

    def private(v: int, depth: int = 0) -> bool:
        """No output's block, read by einsum kernels only (through moves and donations, plan.fuse_inplace:
        the same array; a relu writing into the block whose own block is an output gave the caller
        the pool's array)."""
        if v in outputs or depth > 64:
            return False
        for r in readers.get(v, ()):
            if r.kind is TaskKind.MOVE:
                if not private(r.writes, depth + 1):
                    return False
            elif r.kind is TaskKind.KERNEL:
                d = decomps.get(r.node)
                if d is None or rule_for(BLOCK_KERNELS, d.node.op, "the block kernels") is not _einsum_block:
                    return False
                don = (donated or {}).get(r.id)
                if don is not None and don.value == v and not private(r.writes, depth + 1):
                    return False
        return True

    got = {}
    for t in tg.tasks:
        if t.kind is not TaskKind.KERNEL or t.writes < 0:
            continue
        val = tg.values[t.writes]
        if val.nbytes < POOL_MIN_BYTES or not private(t.writes):
            continue
        into = _matmul_into(t, tg, decomps)
        if into is not None:
            got[t.id] = (into, tuple(val.shape), np.dtype(numpy_dtype(val.dtype)))
    return got
