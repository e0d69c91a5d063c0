"""The time model: what a device computes how fast, and what a link carries how fast, as data.

A :class:`DeviceModel` holds one device's figures (peak flop rates per dtype, a matmul efficiency
curve, memory and copy bandwidth, memory size, the fixed cost of one task); a :class:`Hardware`
holds a cluster's devices, the fabrics between them (routes through per-device ports, so that
concurrent transfers through one port share its bandwidth) and, for a CPU machine, the cores the
devices share. The times themselves are pure functions of numbers:

- a kernel takes ``max(flops / (peak · efficiency(work)), bytes / memory bandwidth) + launch``,
  with ``efficiency(W) = e_max · W / (W + half_work · rate(dtype) / top rate)`` (a small kernel
  runs far below peak: the fixed start of its tiles and waves, a time, so its flops scale with
  the dtype's rate: a float32 GEMM on an A100 starts in the same 20 µs as a bf16 one; which
  :func:`einjoin.runtime.simulate_calibrate.calibrate` fits on this machine and the presets take
  from measured GEMM rates);
- a transfer takes ``latency + bytes / bandwidth`` over each link of its route (the slowest
  link sets the pace; the simulator shares each link's bandwidth between the transfers on it).

>>> h100 = DeviceModel("h100", peak=(("bfloat16", 989e12), ("float32", 67e12)), mem_bw=3.35e12,
...                    copy_bw=3.0e12, vector_rate=67e12, launch=5e-6, e_max=0.75, half_work=14e9)
>>> t = kernel_time(h100, flops=2 * 4096**3, nbytes=3 * 2 * 4096**2, dtype="bfloat16")
>>> round(t * 1e3, 3)   # a 4096^3 bf16 matmul: 68% of 989 TFLOP/s for its size, plus the launch
0.209
>>> transfer_time(latency=2e-6, nbytes=1 << 30, bandwidths=(300e9, 25e9)) > (1 << 30) / 25e9
True
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from einjoin.errors import EinjoinError

__all__ = ["DeviceModel", "Fabric", "Hardware", "kernel_time", "transfer_time", "copy_time", "efficiency",
           "steps_time"]

# a kernel whose flops per byte exceed this is a contraction (BLAS, tensor cores): it runs at the
# matmul rate; below it, an elementwise kernel runs at the vector rate (numpy's ufuncs, CUDA cores)
CONTRACTION_INTENSITY = 1.0


def _positive(v: float, what: str, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy numbers are Real
        raise EinjoinError(f"device model {what} must be a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f) or f < 0 or (f == 0 and not zero_ok):
        raise EinjoinError(f"device model {what} must be {'>= 0' if zero_ok else 'positive'} and finite, got {v!r}")
    return f


def _pairs_any(v: Any, what: str) -> list[tuple[str, Any]]:
    items = v.items() if isinstance(v, Mapping) else v
    try:
        return [(str(k), r) for k, r in items]
    except (TypeError, ValueError):
        raise EinjoinError(f"device model {what} must be (name, number) pairs or a mapping, got {v!r:.80}") from None


def _pairs(v: Any, what: str) -> tuple[tuple[str, float], ...]:
    """``(name, rate)`` pairs, from pairs or a mapping name -> rate, each rate checked."""
    return tuple((k, _positive(r, f"{what}[{k}]")) for k, r in _pairs_any(v, what))


@dataclass(frozen=True)
class DeviceModel:
    """One device's figures. ``peak``: (dtype, flop/s) pairs for dense contractions (one core's
    rate when the hardware shares ``cores``: a kernel then runs on its share of them);
    ``mem_bw``: bytes/s a memory-bound kernel reads plus writes; ``copy_bw``: bytes/s of a copy
    on the device (read + write); ``vector_rate``: flop/s of elementwise work; ``launch``: the
    fixed cost of one task (a kernel launch, a Python dispatch), s; ``e_max`` and ``half_work``:
    the matmul efficiency curve (:func:`efficiency`; ``half_work`` in flops at the top rate of
    ``peak``, scaled for a slower dtype); ``memory``: bytes (None: unbounded);
    ``host_bw`` / ``host_latency``: the host link (loads, evictions, reloads of a device that
    does not share the host's memory); ``kind_rates``: (node kind, flop/s) for kernels whose own
    code runs far from the GEMM rate (a CPU's attention: torch's flash kernel), instead of the
    contraction rate and its curve; ``kind_half``: (node kind, flops) the start of such a kind's own
    curve (its fixed cost per call as flops at its rate: ``(W + half) / rate``); ``fn_rates``:
    (scalar function, elements/s) of each elementwise function run alone over float32 arrays
    out of the caches — a device that evaluates an elementwise expression step by step (numpy:
    one pass over memory per function, :func:`steps_time`); empty: the expression is one fused
    pass (a GPU's kernels), the roofline of its flops at ``vector_rate`` and its bytes;
    ``fn_call``: seconds of one such step besides its elements (the Python around a ufunc);
    ``fn_rates64``: the same over float64 (a fill's index grids; float64 transcendentals run far
    below float32's vector loops, not at half their rate); ``free_cost`` / ``view_cost``:
    seconds of a task that does no work on the device — a free, a load that is a view of a feed or a
    zero-copy move (a CPU runtime's dictionary updates, far below a kernel's dispatch; -1: ``launch``)."""

    name: str
    peak: tuple[tuple[str, float], ...]
    mem_bw: float
    copy_bw: float
    vector_rate: float
    launch: float
    e_max: float = 1.0
    half_work: float = 0.0
    memory: int | None = None
    host_bw: float = 25e9
    host_latency: float = 10e-6
    kind_rates: tuple[tuple[str, float], ...] = ()
    kind_half: tuple[tuple[str, float], ...] = ()
    fn_rates: tuple[tuple[str, float], ...] = ()
    fn_call: float = 0.0
    fn_rates64: tuple[tuple[str, float], ...] = ()
    free_cost: float = -1.0  # seconds of a free (no bytes to the host): -1, ``launch``
    view_cost: float = -1.0  # seconds of a load that is a view of a feed, a zero-copy move: -1, ``launch``

    def __post_init__(self) -> None:
        if not self.peak:
            raise EinjoinError(f"device model {self.name!r} needs a peak rate for at least one dtype")
        object.__setattr__(self, "peak", _pairs(self.peak, "peak"))
        object.__setattr__(self, "kind_rates", _pairs(self.kind_rates, "kind_rates"))
        object.__setattr__(self, "kind_half", tuple((k, _positive(h, f"kind_half[{k}]", zero_ok=True))
                                                    for k, h in _pairs_any(self.kind_half, "kind_half")))
        object.__setattr__(self, "fn_rates", _pairs(self.fn_rates, "fn_rates"))
        object.__setattr__(self, "fn_rates64", _pairs(self.fn_rates64, "fn_rates64"))
        if self.memory is not None:  # bytes, or a size "80GiB" (einjoin.cluster.parse_bytes)
            from einjoin.cluster.sizes import parse_bytes
            try:
                mem = parse_bytes(self.memory)
            except EinjoinError as err:
                raise EinjoinError(f"device model {self.name!r} memory: {err}") from None
            object.__setattr__(self, "memory", mem)
        for f in ("mem_bw", "copy_bw", "vector_rate", "host_bw"):
            object.__setattr__(self, f, _positive(getattr(self, f), f))
        for f in ("launch", "half_work", "host_latency", "fn_call"):
            object.__setattr__(self, f, _positive(getattr(self, f), f, zero_ok=True))
        for f in ("free_cost", "view_cost"):  # -1: the task costs a launch
            if getattr(self, f) != -1.0:
                object.__setattr__(self, f, _positive(getattr(self, f), f, zero_ok=True))
        e = _positive(self.e_max, "e_max")
        if e > 1:
            raise EinjoinError(f"device model e_max must be in (0, 1], got {self.e_max!r}")

    def rate(self, dtype: str) -> float:
        """Peak contraction flop/s for ``dtype``: its own figure, else float32's (numpy computes
        half precision in float32), else the lowest given."""
        table = dict(self.peak)
        if dtype in table:
            return table[dtype]
        return table.get("float32", min(table.values()))

    def half(self, dtype: str | None = None) -> float:
        """The flops at which a ``dtype`` contraction reaches half of ``e_max``: ``half_work`` (given
        at the top rate) times ``rate(dtype) / top rate``. The curve's start is a time (tiles'
        and waves' fixed work), so a dtype at 1/16 of the rate does 1/16 of the flops in it."""
        if dtype is None or not self.half_work:
            return self.half_work
        return self.half_work * self.rate(dtype) / max(r for _, r in self.peak)


def efficiency(model: DeviceModel, work: float, dtype: str | None = None) -> float:
    """The fraction of peak a contraction of ``work`` flops in ``dtype`` reaches:
    ``e_max · W / (W + model.half(dtype))`` (None: ``half_work`` as given, the top rate's).

    >>> m = DeviceModel("x", peak=(("bfloat16", 16e9), ("float32", 1e9)), mem_bw=1e9, copy_bw=1e9,
    ...                 vector_rate=1e9, launch=0.0, e_max=0.5, half_work=1600.0)
    >>> efficiency(m, 1600.0, "bfloat16"), efficiency(m, 100.0, "float32"), efficiency(m, 0.0)
    (0.25, 0.25, 0.0)
    """
    if work <= 0:
        return 0.0
    return model.e_max * work / (work + model.half(dtype))


def kernel_time(model: DeviceModel, flops: float, nbytes: float, dtype: str, threads: float = 1.0,
                launch: bool = True) -> float:
    """Seconds one kernel takes alone on ``model`` with ``threads`` of its cores: a roofline of
    its flops (at the contraction rate scaled by :func:`efficiency`, or the vector rate for an
    elementwise kernel) and its bytes (read + written, at ``mem_bw``), plus the launch.

    >>> m = DeviceModel("x", peak=(("float32", 1e9),), mem_bw=1e9, copy_bw=1e9, vector_rate=1e8,
    ...                 launch=1e-3)
    >>> kernel_time(m, flops=1e9, nbytes=1e6, dtype="float32")   # compute-bound: 1 s + launch
    1.001
    >>> kernel_time(m, flops=1e6, nbytes=1e9, dtype="float32")   # memory-bound: 1 s + launch
    1.001
    """
    return work_time(model, flops, nbytes, dtype, threads) + (model.launch if launch else 0.0)


def work_time(model: DeviceModel, flops: float, nbytes: float, dtype: str, threads: float = 1.0,
              kind: str | None = None) -> float:
    """:func:`kernel_time` without the launch; ``kind``: the node kind, for ``model.kind_rates``."""
    compute = 0.0
    own = dict(model.kind_rates).get(kind) if kind is not None and model.kind_rates else None
    if flops > 0:
        if own is not None:  # the kind's own curve: a fixed start (``kind_half``) plus its flops at its rate
            compute = (flops + dict(model.kind_half).get(kind or "", 0.0)) / (own * threads)
        elif is_contraction(flops, nbytes):
            compute = flops / (model.rate(dtype) * threads * max(efficiency(model, flops, dtype), 1e-9))
        else:
            compute = flops / model.vector_rate
    return max(compute, nbytes / model.mem_bw)


def steps_time(model: DeviceModel, steps: Sequence[tuple[str, float]], pass_bytes: float,
               itemsize: int = 4) -> float | None:
    """Seconds of an elementwise kernel evaluated step by step on ``model`` (one thread): each
    ``(function, elements)`` step at the device's measured rate of that function (``fn_rates``:
    its pass over memory included; a function not measured at ``add``'s) plus ``fn_call``, plus ``pass_bytes``
    (an aggregation's read of the joined block and its write, or a copy: bytes at ``mem_bw``).
    A dtype wider than float32 moves proportionally more bytes. None when ``model`` has no
    function rates (it fuses the expression: the roofline applies).

    >>> m = DeviceModel("x", peak=(("float32", 1e9),), mem_bw=1e9, copy_bw=1e9, vector_rate=1e8,
    ...                 launch=0.0, fn_rates=(("exp", 1e8), ("add", 1e9)), fn_call=0.25)
    >>> steps_time(m, [("exp", 1e8), ("mul", 1e9)], pass_bytes=1e9)   # 1 s + 1 s (as add) + 1 s + 2 calls
    3.5
    """
    if not model.fn_rates:
        return None
    rates = dict(model.fn_rates)
    other = rates.get("add", model.mem_bw / 12)  # two reads and a write of float32
    scale = max(1.0, itemsize / 4)
    wide = dict(model.fn_rates64) if itemsize == 8 else {}  # measured in float64: no scaling
    secs = sum(n / wide[fn] if fn in wide else scale * n / rates.get(fn, other) for fn, n in steps)
    return secs + len(steps) * model.fn_call + pass_bytes / model.mem_bw


def is_contraction(flops: float, nbytes: float) -> bool:
    """Whether a kernel runs at the contraction rate (its flops per byte above
    :data:`CONTRACTION_INTENSITY`)."""
    return flops > CONTRACTION_INTENSITY * max(nbytes, 1.0)


def copy_time(model: DeviceModel, nbytes: float) -> float:
    """Seconds of a copy of ``nbytes`` on the device (read + write at ``copy_bw``), no launch."""
    return 2.0 * nbytes / model.copy_bw


def transfer_time(latency: float, nbytes: float, bandwidths: Sequence[float]) -> float:
    """Seconds of a transfer alone on its route: the latency plus the bytes at the slowest link."""
    if not bandwidths:
        return latency
    return latency + nbytes / min(bandwidths)


@dataclass(frozen=True)
class Fabric:
    """Links of one kind: each device has a port of ``bandwidth`` bytes/s per direction into
    it (a NVSwitch port, a NIC), and a transfer pays ``latency`` once."""

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", _positive(self.bandwidth, "fabric bandwidth"))
        object.__setattr__(self, "latency", _positive(self.latency, "fabric latency", zero_ok=True))


@dataclass(frozen=True)
class Hardware:
    """A cluster's time model: ``models[d]`` for device ``d``; ``groups[d]`` its island or node;
    ``intra`` the fabric inside a group, ``inter`` between groups (a route ``i -> j`` goes out
    of ``i``'s port and into ``j``'s, so transfers through one port share it); ``cores``: the CPU
    cores every device shares (None: each device computes on its own silicon); ``shared_memory``:
    the devices and the host share RAM (a move is a zero-copy hand-over unless the graph is
    memory-capped, a contiguous load is a view); ``copy_engines``: moves and host transfers run
    beside the kernels (GPU DMA engines), not on the device's one lane; ``overhead``: seconds a
    run costs besides its tasks (binding feeds, starting workers, gathering outputs);
    ``own_links``: moves between devices cross ``intra`` / ``inter`` even where the devices
    share RAM (this machine's devices under a cluster's own link figures); ``pool_speedup``: on
    shared cores, how much faster than one thread a device's share of them runs a kernel of
    BLAS's or torch's thread pool (the runtime gives one pool the share and the other one thread
    where a program has both: :func:`einjoin.runtime.simulate_hardware.kernel_pools`); a kernel
    on ``t`` threads holds that speed-up of the cores; ``core_capacity``: the work the shared cores
    do at once, in one busy core's (below ``cores`` where a second busy core adds less than a
    core: a clock lowered for all, caches and memory shared; 0: ``cores``); ``mem_bus``: bytes/s
    (read + written) the devices' memory-bound work streams at most together, the host's memory
    bus that devices sharing RAM divide (0: each device has its own memory); ``cache``: bytes of
    the last-level cache those devices share (0: unknown): a program whose blocks fit in it
    streams nothing from memory, so its kernels hold no share of the bus."""

    name: str
    models: tuple[DeviceModel, ...]
    groups: tuple[int, ...]
    intra: Fabric
    inter: Fabric
    cores: int | None = None
    shared_memory: bool = False
    copy_engines: bool = True
    overhead: float = 0.0
    own_links: bool = False
    pool_speedup: tuple[tuple[str, float], ...] = ()  # ("blas" | "torch", its share over one thread)
    core_capacity: float = 0.0  # what the shared cores do at once, in one core's work (0: ``cores``)
    mem_bus: float = 0.0  # bytes/s the devices' memory-bound kernels share (0: not shared)
    cache: float = 0.0    # bytes of the last-level cache the devices share (0: unknown)

    def __post_init__(self) -> None:
        if len(self.models) != len(self.groups) or not self.models:
            raise EinjoinError(f"hardware {self.name!r}: {len(self.models)} device models for "
                               f"{len(self.groups)} devices")
        c = self.cores
        if c is not None and (isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 1):
            raise EinjoinError(f"hardware {self.name!r}: cores must be a positive int or None, got {c!r}")
        if c is not None:
            object.__setattr__(self, "cores", int(c))
        for f in ("mem_bus", "cache"):
            object.__setattr__(self, f, _positive(getattr(self, f), f"hardware {self.name!r} {f}", zero_ok=True))

    @property
    def size(self) -> int:
        return len(self.models)

    def threads(self) -> float:
        """Cores each device's kernels use (the threads backend gives each device
        ``cores // devices`` BLAS threads, at least one); 1 for devices of their own."""
        if self.cores is None:
            return 1.0
        return float(max(1, self.cores // self.size))

    def fabric(self, src: int, dst: int) -> Fabric:
        return self.intra if self.groups[src] == self.groups[dst] else self.inter

    def route(self, src: int, dst: int) -> tuple[tuple[str, int, int], ...]:
        """The link resources a transfer ``src -> dst`` crosses: (fabric, direction, device)
        ports, ``("intra", 0, src)`` being ``src``'s outgoing port."""
        kind = "intra" if self.groups[src] == self.groups[dst] else "inter"
        return ((kind, 0, src), (kind, 1, dst))

    def transfer_time(self, src: int, dst: int, nbytes: float) -> float:
        """Seconds of a transfer alone on its route (0 to itself)."""
        if src == dst:
            return 0.0
        f = self.fabric(src, dst)
        return transfer_time(f.latency, nbytes, (f.bandwidth,))
