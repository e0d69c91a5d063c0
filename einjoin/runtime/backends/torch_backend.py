"""The torch backend (``backend="torch"``): blocks are torch tensors and kernels torch ops
(:data:`einjoin.runtime.backends.torch_kernels.TORCH_KERNELS`), run through the one engine as the
``threads`` backend runs numpy: a worker thread per plan device (one inline worker for one
device), each with ``cores // devices`` of torch's intra-op threads while runs are in flight; a
host-transfer lane per device under a memory cap, whose evictions go to a host store of tensors
(pinned memory on CUDA); traces and cancellation are the engine's.

Feeds may be numpy arrays or torch tensors: a CPU tensor (or a numpy array) becomes a block
without a copy (``torch.from_numpy`` of the numpy view ``run`` binds), outputs come back as numpy
views of the result tensors, and ``run`` returns torch tensors when torch tensors went in, so a
torch-in, torch-out run on the CPU copies no data between torch and numpy
(``TorchBackend.host_copies``: the bytes it did copy, last run).

``TorchBackend(device_map=...)`` says where the plan devices run (:mod:`.torch_cuda`): ``"cpu"``
(default), ``"cuda"`` (spread over the GPUs present, a stream each) or a list. The CUDA path is
UNTESTED ON A GPU (none was available when it was written; ``bench/gpu_check.sh`` runs it).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (4, 4)); prog = ej.compile([ej.tanh(x @ x)], 2, backend="torch", quiet=True)
>>> a = np.eye(4, dtype=np.float32); np.allclose(prog.run(x=a)[0], np.tanh(a))
True
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from einjoin.decomp.decompose import Decomposition
from einjoin.errors import EinjoinError
from einjoin.exchange import Task, TaskKind
from einjoin.ir.dtypes import is_bfloat16, numpy_dtype
from einjoin.ir.node import Node, rule_for
from einjoin.plan.execute import unaliased
from einjoin.runtime.backend import RunSpec, cores
from einjoin.runtime.backends.torch_cuda import CudaLanes, check_caps, map_devices, pinned_copy
from einjoin.runtime.backends.torch_kernels import TORCH_DTYPES, TORCH_KERNELS, combine, fill_block
from einjoin.runtime.local import LocalSession
from einjoin.runtime.malloc import tune_malloc

if TYPE_CHECKING:
    from einjoin.runtime.engine import RunStats

__all__ = ["TorchBackend", "TorchSession", "TorchThreads", "TORCH_THREADS", "to_tensor", "to_numpy"]

_MOVE, _LOAD, _KERNEL, _RELOAD, _EVICT = (TaskKind.MOVE, TaskKind.LOAD, TaskKind.KERNEL, TaskKind.RELOAD,
                                          TaskKind.EVICT)
_RELEASES = frozenset(k for k in TaskKind if k.releases)
_TO_HOST = frozenset(k for k in TaskKind if k.to_host)


def to_tensor(a: np.ndarray) -> tuple[torch.Tensor, bool]:
    """A numpy array as a CPU tensor sharing its memory where torch can (bfloat16 through an
    int16 view); a read-only array or one with negative strides is copied. Returns the tensor
    and whether it was copied."""
    copied = False
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a, copied = np.array(a, order="C"), True
    if is_bfloat16(a.dtype):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16), copied
    return torch.from_numpy(a), copied


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A tensor as a numpy array (a view of a CPU tensor's memory; a copy from a GPU). Returns
    the array and whether it was copied."""
    copied = t.device.type != "cpu"
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16")), copied
    return t.numpy(), copied


class TorchThreads:
    """torch's intra-op thread count while torch runs are in flight: ``cores // devices`` of
    all the runs in flight (as :class:`~einjoin.runtime.backends.BlasLimiter` shares BLAS
    threads), the count found before the first run restored when the last one ends. torch's
    setting is process-wide; a worker thread takes it when it first runs a parallel op."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices = 0
        self._original: int | None = None

    @contextmanager
    def limit(self, n_devices: int) -> Iterator[None]:
        n = max(1, n_devices)
        with self._lock:
            if self._original is None:
                self._original = torch.get_num_threads()
            self._devices += n
            torch.set_num_threads(max(1, cores() // self._devices))
        try:
            yield
        finally:
            with self._lock:
                self._devices -= n
                if self._devices:
                    torch.set_num_threads(max(1, cores() // self._devices))
                elif self._original is not None:
                    torch.set_num_threads(self._original)
                    self._original = None


TORCH_THREADS = TorchThreads()


def _slices(box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _shares(a: torch.Tensor, b: Any) -> bool:
    return isinstance(b, torch.Tensor) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class TorchSession(LocalSession):
    """One run on the torch backend: :class:`~einjoin.runtime.local.LocalSession`'s stores,
    lanes and byte accounting, with every task computed on torch tensors."""

    eager: Literal[False] = False

    def __init__(self, run: RunSpec, backend: TorchBackend, threaded: bool):
        # the numpy session's structure without its numpy kernels prepared (computes=False),
        # then computing with torch's
        super().__init__(run, computes=False, threaded=threaded, limit=TORCH_THREADS.limit if threaded else None)
        self.computes = True
        self.backend = backend
        self.devices = map_devices(backend.device_map, self.n)
        self.cuda = any(d.startswith("cuda") for d in self.devices)
        self.copies = 0  # bytes copied between host memory representations (or host <-> GPU)
        self.copies_lock = threading.Lock()
        self.tfeeds: dict[Node, torch.Tensor] = {}
        for node, a in run.feeds.items():
            t, copied = to_tensor(a)
            self.tfeeds[node] = t
            if copied:
                self._copied(t.nbytes)
        self.host_t: dict[int, torch.Tensor] = {}
        self.run_feeds: dict[tuple[Node, str], tuple[Any, torch.Tensor]] = {}  # feeds uploaded this run
        self.lanes_cuda = CudaLanes(self.devices) if self.cuda else None  # pragma: no cover
        if self.cuda:  # pragma: no cover - UNTESTED ON A GPU
            free = {}
            for dev in set(self.devices):
                f, _ = torch.cuda.mem_get_info(torch.device(dev))
                free[dev] = f + torch.cuda.memory_reserved(torch.device(dev)) - torch.cuda.memory_allocated(
                    torch.device(dev))
            check_caps(self.devices, getattr(self.tg.memory, "caps", None), free)
        self.prepared = _prepared(run.engine)

    def _copied(self, nbytes: int) -> None:
        with self.copies_lock:
            self.copies += nbytes

    # ---- the tasks

    def execute(self, t: Task) -> None:
        if self.lanes_cuda is not None:  # pragma: no cover - UNTESTED ON A GPU
            with self.lanes_cuda.context(t.device):
                for v in t.reads:
                    src = t.payload.src_device if t.kind is _MOVE else t.device
                    self.lanes_cuda.wait_for(t.device, v, self.stores[src].get(v))
                self._execute(t)
                if t.writes >= 0:
                    self.lanes_cuda.produced(t.device, t.writes)
            return
        self._execute(t)

    def _execute(self, t: Task) -> None:
        store = self.stores[t.device]
        kind = t.kind
        start = time.perf_counter() if self.host_link is not None else 0.0
        if kind in _RELEASES:
            if kind in _TO_HOST:
                self._to_host(t, store.get(t.payload.frees))
                self._throttle(start, t.nbytes)
                if kind is _EVICT:
                    store.evicted += t.nbytes
            store.free(t.payload.frees)
            return
        planned = self.planned[t.writes]
        store.reserve(t.writes, planned, t.scratch)
        dev = self.devices[t.device]
        if kind is _LOAD and self.state is not None and self.state.load(t, store, planned):
            got = store.get(t.writes)
            if isinstance(got, np.ndarray):  # a state block kept as numpy (see finish): its tensor
                block = to_tensor(got)[0]
                store.values[t.writes] = block if dev == "cpu" else block.to(dev)
            return
        if kind is _RELOAD:
            value = self._from_host(t, dev)
        elif kind is _MOVE:
            src = self.stores[t.payload.src_device].get(t.reads[0])
            if not self.capped and src.device == torch.device(dev):
                value = src  # zero-copy in one memory: blocks are never written in place
            else:
                value = src.to(dev, non_blocking=True, copy=True)
                store.copied += value.nbytes
        else:
            get = store.get
            value = self._compute(t, get, dev)
            if self.capped and kind is _KERNEL and any(_shares(value, get(v)) for v in t.reads):
                value = value.clone()  # under a cap a block owns its bytes (freeing it must free them)
        store.unreserve(t.scratch)
        nbytes = value.nbytes
        store.put(t.writes, value, nbytes)
        if kind is _MOVE:
            store.received += nbytes
        elif kind is _LOAD:
            if self.state is not None and t.node in self.state.on_host:
                store.reloaded += nbytes
            else:
                store.loaded += nbytes
            self._throttle(start, nbytes)
        elif kind is _RELOAD:
            store.reloaded += nbytes
            self._throttle(start, nbytes)

    def _compute(self, t: Task, get: Callable[[int], Any], dev: str) -> torch.Tensor:
        kind = t.kind
        if kind is _KERNEL:
            rule, d, op, k, box, keys = self.prepared[t.id]
            it = iter(t.reads)
            blocks = [get(next(it)) if has else None for has in keys]
            out: torch.Tensor = rule(d, op, k, blocks, box)
            shape = self.tg.values[t.writes].shape
            if tuple(out.shape) != shape:
                from einjoin.ir.printing import describe
                raise EinjoinError(f"kernel {t.payload.kernel} of {describe(t.node)} produced shape "
                                   f"{tuple(out.shape)}, expected {shape}")
            return out
        if kind is _LOAD:
            if dev != "cpu":  # pragma: no cover - UNTESTED ON A GPU: the feed on the device, then the block
                return self._feed_on(t.node, dev)[_slices(t.payload.box)].contiguous()
            block = self.tfeeds[t.node][_slices(t.payload.box)]
            if not block.is_contiguous():
                return block.contiguous()
            return block.clone() if self.capped else block  # under a cap a block owns its bytes
        if kind is TaskKind.FILL:
            return fill_block(t.node.op.expr, [a for a, _ in t.payload.box],  # type: ignore[union-attr]
                              self.tg.values[t.writes].shape, t.node.dtype)
        if kind is TaskKind.REDUCE:
            acc: torch.Tensor = get(t.reads[0]).clone()
            for v in t.reads[1:]:
                combine(t.payload.agg.name, acc, get(v))
            return acc.to(TORCH_DTYPES[t.dtype]) if t.dtype else acc
        if kind is TaskKind.SELECT:
            src: torch.Tensor = get(t.reads[0])
            return src[_slices(t.payload.box)].clone()
        if kind is TaskKind.TOUCH:
            buf: torch.Tensor | None = get(t.writes)
            src = get(t.reads[0])
            if buf is None:
                buf = torch.empty(self.tg.values[t.writes].shape, dtype=TORCH_DTYPES[t.dtype or t.node.dtype],
                                  device=src.device)
            buf[_slices(t.payload.dst_box)] = src[_slices(t.payload.box)]
            return buf
        raise AssertionError(f"no torch computation for task kind {kind}")  # pragma: no cover

    def _feed_on(self, node: Node, dev: str) -> torch.Tensor:
        """The whole feed of ``node`` on GPU ``dev``: uploaded once per run, or, with the backend's
        ``cache_feeds``, once while the caller feeds the same array object (bound weights)."""
        a = self.feeds[node]
        key = (node, dev)
        with self.backend._cache_lock:
            cache = self.backend._feed_cache if self.backend.cache_feeds else self.run_feeds
            hit = cache.get(key)
            if hit is not None and hit[0] is a:
                return hit[1]
        t = self.tfeeds[node].to(dev)
        self._copied(t.nbytes)
        with self.backend._cache_lock:
            cache[key] = (a, t)
        return t

    def _to_host(self, t: Task, value: torch.Tensor) -> None:
        """An evict or write-back: a host copy of the block (pinned memory on CUDA)."""
        if not (t.nbytes or value.numel() == 0):
            return
        key = t.payload.host_key
        if value.device.type != "cpu":  # pragma: no cover - UNTESTED ON A GPU
            self.host_t[key] = pinned_copy(value)
            torch.cuda.current_stream().synchronize()  # a reload may read it on another stream
            self._copied(value.nbytes)
            return
        old = self.host_t.get(key)
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            old.copy_(value)  # a block evicted again reuses its host buffer
        else:
            self.host_t[key] = value.clone(memory_format=torch.contiguous_format)

    def _from_host(self, t: Task, dev: str) -> torch.Tensor:
        p = t.payload
        if p.box is not None:
            src = self.tfeeds[t.node][_slices(p.box)]
        else:
            src = self.host_t[p.host_key]
        if dev != "cpu":  # pragma: no cover - UNTESTED ON A GPU
            self._copied(src.nbytes)
            return src.to(dev, non_blocking=True)
        return src.clone(memory_format=torch.contiguous_format)

    # ---- the end of a run

    def finish(self, stats: RunStats) -> list[np.ndarray] | None:
        if self.lanes_cuda is not None:  # pragma: no cover - UNTESTED ON A GPU
            self.lanes_cuda.synchronize()
        tg, stores = self.tg, self.stores
        stats.bytes_moved = sum(s.received for s in stores)
        stats.bytes_loaded = sum(s.loaded for s in stores)
        stats.bytes_evicted = sum(s.evicted for s in stores)
        stats.bytes_reloaded = sum(s.reloaded for s in stores)
        stats.peak_bytes_per_device = {s.device: s.peak for s in stores}
        state = self.state
        fetched = tg if state is None else state.fetched(tg)
        if self.capped:
            def get_t(v: int) -> torch.Tensor:
                return self.host_t[v]
        else:
            def get_t(v: int) -> torch.Tensor:
                got: torch.Tensor = stores[tg.values[v].device].get(v)
                return got
        if state is not None:  # state blocks are kept as numpy views (the program reads them as numpy)
            state.keep(tg, lambda v: self._numpy(get_t(v)), self.capped, self.feeds)
        outs = []
        for lay in fetched.outputs:
            dense = _assemble(lay, get_t)
            out, copied = to_numpy(dense)
            if copied:
                self._copied(out.nbytes)
            outs.append(unaliased(out, self.feeds))
        stats.bytes_fetched = sum(o.nbytes for o in outs)
        self.backend._last_copies = self.copies
        stats.bytes_copied = sum(s.copied for s in stores) + self.copies  # moves' copies + host copies
        return outs

    def _numpy(self, t: torch.Tensor) -> np.ndarray:
        out, copied = to_numpy(t)
        if copied:  # pragma: no cover - a GPU's state goes to the host
            self._copied(out.nbytes)
        return out


def _assemble(lay: Any, get: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """An output from its blocks: the block itself when there is one, else the blocks copied
    into one tensor (on the first block's device)."""
    part = lay.partition
    if part.num_blocks == 1:
        only: torch.Tensor = get(lay.blocks[(0,) * part.ndim])
        return only if only.is_contiguous() else only.contiguous()
    blocks = {k: get(v) for k, v in lay.blocks.items()}
    first = next(iter(blocks.values()))
    out = torch.empty(part.shape, dtype=first.dtype, device=first.device)
    for k, b in blocks.items():
        out[part.slices(k)] = b.to(first.device)
    return out


_PREPARED: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_PREPARED_LOCK = threading.Lock()


def _prepared(engine: Any) -> dict[int, tuple[Any, ...]]:
    """:func:`_prepare` once per engine (a program's runs share it; it goes with the engine)."""
    with _PREPARED_LOCK:
        got = _PREPARED.get(engine)
    if got is None:
        got = _prepare(engine.tg.tasks, engine.decomps)
        with _PREPARED_LOCK:
            _PREPARED[engine] = got
    return got


def _prepare(tasks: Sequence[Task], decomps: Mapping[Node, Decomposition]) -> dict[int, tuple[Any, ...]]:
    """Per kernel task its torch kernel, decomposition, op, kernel, output box and which inputs
    it reads, looked up once per run."""
    out: dict[int, tuple[Any, ...]] = {}
    for t in tasks:
        if t.kind is _KERNEL:
            d = decomps[t.node]
            k = d.kernels[t.payload.kernel]
            rule = rule_for(TORCH_KERNELS, d.node.op, "the torch block kernels "
                            "(einjoin.runtime.backends.torch_kernels.TORCH_KERNELS)")
            out[t.id] = (rule, d, d.node.op, k, d.out_partition.box(k.out_key),
                         tuple(key is not None for key in k.in_keys))
    return out


@dataclass
class TorchBackend:
    """Blocks as torch tensors, kernels as torch ops, on ``device_map``'s devices (``"cpu"``, or
    UNTESTED ON A GPU ``"cuda"`` / a list); ``threaded``: a worker thread per plan device (False:
    one inline worker, as ``sync``). ``cache_feeds`` (GPUs only): a feed given as the same array
    object as in an earlier run (a program's bound weights) is not uploaded again; the caller
    promises not to change such an array in place (the cache holds it, and its GPU copy, until
    :meth:`close`)."""

    device_map: str | Sequence[str] = "cpu"
    threaded: bool = True
    cache_feeds: bool = False
    name: str = "torch"
    computes: bool = True
    remote: bool = False
    retries: int = 0
    _last_copies: int = field(default=0, repr=False, compare=False)
    _feed_cache: dict[Any, tuple[Any, torch.Tensor]] = field(default_factory=dict, repr=False, compare=False)
    _cache_lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def host_copies(self) -> int:
        """The bytes the last finished run copied between host memory representations (feeds
        torch could not share, results from a GPU) or between the host and a GPU: 0 for a run
        on the CPU whose feeds were tensors or writable numpy arrays."""
        return self._last_copies

    def open(self, run: RunSpec) -> TorchSession:
        tune_malloc()  # torch's CPU allocator is glibc's malloc: keep freed blocks, as threads does
        return TorchSession(run, self, self.threaded)

    def close(self) -> None:
        with self._cache_lock:
            self._feed_cache.clear()

    def __getstate__(self) -> dict[str, Any]:  # a program pickles its backend: its options only
        return {k: v for k, v in self.__dict__.items() if k not in ("_feed_cache", "_cache_lock", "_last_copies")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _feed_cache={}, _cache_lock=threading.Lock(), _last_copies=0)
