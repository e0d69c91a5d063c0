"""This machine's measured figures (:class:`Calibration`), their cache on disk, and the time model
they make for ``n`` local devices (:meth:`Calibration.hardware`). The measuring itself is the
runtime's (:func:`einjoin.runtime.simulate_calibrate.calibrate`: it runs numpy kernels and the
threads backend); this module is plain data.

The cache is ``$XDG_CACHE_HOME/einjoin/calibration.json`` (``~/.cache`` without the variable),
keyed by the machine (host name, cores, processor): a calibration taken elsewhere is not used.

>>> cal = Calibration(cores=2, matmul_rate=50e9, half_work=2e6, parallel=0.9, mem_bw=8e9,
...                   vector_rate=1e9, copy_bw=10e9, launch=20e-6, launch_threads=40e-6, machine="m")
>>> hw = cal.hardware(4)
>>> hw.size, hw.cores, hw.shared_memory, hw.models[0].launch
(4, 2, True, 4e-05)
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from einjoin.cluster.model import DeviceModel, Fabric, Hardware
from einjoin.errors import EinjoinError

__all__ = ["Calibration", "cache_path", "machine_key", "load_cached", "save_cached", "local_calibration", "MEASURE"]

VERSION = 11  # bumped when what is measured changes: older caches are measured again


@dataclass(frozen=True)
class Calibration:
    """Measured on one machine: ``matmul_rate`` (float32 flop/s of one core's large GEMM),
    ``half_work`` (the flops at which a GEMM reaches half that), ``parallel`` (each further BLAS
    thread adds that fraction of a core's rate), ``mem_bw`` (bytes read + written per second by
    an elementwise kernel), ``vector_rate`` (elementwise flop/s, e.g. ``exp``), ``fn_rates``
    (elements per second of each scalar function of :data:`einjoin.ir.scalar.FUNCTIONS`, alone
    over float32 arrays out of the caches: numpy evaluates a join one function at a time), ``fn_call``
    (seconds of one such step besides its elements: the Python around the ufunc), ``copy_bw``
    (a copy's bytes read + written per second), ``launch`` (seconds per task of a one-device
    run, inline), ``launch_threads`` (seconds per task of a run on two device threads, each
    busy: the GIL handed over between them at each kernel), ``launch_threads4`` (the same on four
    device threads), ``overhead`` / ``overhead_threads`` / ``overhead_threads4`` (seconds per
    run besides its tasks: binding feeds, starting threads, assembling outputs), ``free_cost`` /
    ``view_cost`` (seconds of a free, and of a load that is a view of a feed or a zero-copy move,
    inline; ``free_threads`` / ``view_threads`` on device threads: these tasks dispatch no kernel,
    so the launches are then per kernel; -1, an older calibration: every task costs a launch),
    ``attention_rate`` / ``attention_half`` (the attention kernel's flop/s on one thread and its
    fixed cost per call as flops), ``mem_bw_all`` (bytes read + written per second by elementwise
    kernels on every core at once, over arrays out of the last-level cache: the memory bus the
    devices divide; -1: not measured), ``cache_bytes`` (the last-level cache's size; 0: unknown),
    ``cores`` and the ``machine`` it was measured on."""

    cores: int
    matmul_rate: float
    half_work: float
    parallel: float
    mem_bw: float
    vector_rate: float
    copy_bw: float
    launch: float
    launch_threads: float
    machine: str
    overhead: float = 0.0          # seconds per run besides its tasks, one device inline
    overhead_threads: float = 0.0  # the same on device threads (their start and end)
    attention_rate: float = 0.0    # flop/s of the attention kernel on one thread (0: not measured)
    attention_half: float = 0.0    # its fixed cost per call, as flops at that rate
    fn_rates: dict[str, float] = field(default_factory=dict)  # elements/s of each elementwise function
    fn_call: float = 0.0  # seconds of one step of a join's evaluation besides its elements
    fn_rates64: dict[str, float] = field(default_factory=dict)  # the same over float64 (a fill's grids)
    attention_parallel: float = -1.0  # what each further torch thread adds to it (-1: parallel's)
    parallel_half: float = -1.0    # the flops at which a GEMM on every core reaches half its rate (-1: half_work)
    launch_threads4: float = -1.0  # seconds per task on four device threads (-1: launch_threads)
    overhead_threads4: float = -1.0  # seconds per run on four device threads (-1: overhead_threads)
    free_cost: float = -1.0        # seconds of a free, inline (-1: not measured; the launches are per task)
    view_cost: float = -1.0        # seconds of a view load or a zero-copy move, inline
    free_threads: float = -1.0     # the same on device threads
    view_threads: float = -1.0
    mem_bw_all: float = -1.0       # bytes/s of elementwise kernels on every core at once (-1: not measured)
    cache_bytes: int = 0           # the last-level cache, bytes (0: unknown)
    load: float = 0.0              # the 1-minute load average when measured (busy: figures too low)
    seconds: float = 0.0  # how long measuring took

    def hardware(self, n: int) -> Hardware:
        """The time model of ``n`` devices of the threads backend on this machine: they share
        its cores (each device's kernels get ``cores // n`` BLAS threads, at least one) and its
        RAM (moves hand blocks over)."""
        threads = max(1, self.cores // n)
        # a device's contraction rate with its threads, as a per-thread rate (kernel_time
        # multiplies by the threads): the first thread's full rate, each further one `parallel`
        per_thread = self.matmul_rate * (1 + (threads - 1) * self.parallel) / threads
        ap = self.parallel if self.attention_parallel < 0 else self.attention_parallel
        scale = (1 + (threads - 1) * ap) / threads  # torch's attention: its own speed-up
        kinds = (("attention", self.attention_rate * scale),) if self.attention_rate > 0 else ()
        half = (("attention", self.attention_half * scale),) if kinds else ()
        # a GEMM on several threads reaches its rate later than on one (its threads' start and
        # split): the half-work measured on every core, in proportion for fewer threads
        gemm_half = self.half_work
        if threads > 1 and self.parallel_half >= 0:
            gemm_half += (self.parallel_half - self.half_work) * (threads - 1) / max(1, self.cores - 1)
        launch, overhead = self.dispatch(n)
        # each step of an elementwise kernel is a numpy call that lets the GIL go and takes it back,
        # as the measured kernels' one BLAS call does: on device threads that hand-over (what a
        # kernel costs there beyond one inline; per task: a kernel and its free, two tasks) comes
        # with each step's Python
        per_kernel = self.free_cost >= 0
        handover = (1 if per_kernel else 2) * max(0.0, launch - self.launch)
        free, view = self.light(n)
        model = DeviceModel("cpu", peak=(("float32", per_thread), ("float64", per_thread / 2)), kind_rates=kinds,
                            kind_half=half, fn_rates=tuple(sorted(self.fn_rates.items())),
                            fn_call=self.fn_call + handover,
                            fn_rates64=tuple(sorted(self.fn_rates64.items())),
                            mem_bw=self.mem_bw, copy_bw=self.copy_bw, vector_rate=self.vector_rate,
                            launch=launch, e_max=1.0, free_cost=free, view_cost=view,
                            half_work=max(0.0, gemm_half))
        link = Fabric(self.copy_bw / 2, 0.0)  # a copy between devices: RAM to RAM (capped graphs)
        return Hardware(f"this machine ({n} x cpu, calibrated)", (model,) * n, (0,) * n, link, link,
                        cores=self.cores, shared_memory=True, copy_engines=False,
                        overhead=overhead,
                        pool_speedup=(("blas", 1 + (threads - 1) * self.parallel), ("torch", 1 + (threads - 1) * ap)),
                        # concurrent devices' kernels share the cores as one GEMM's threads do: each
                        # further busy core adds `parallel` of one (2 single-thread GEMMs of a
                        # 2-device chain ran 1.55-1.65x one on 2 cores, a 2-thread GEMM 1.74x)
                        core_capacity=1 + (self.cores - 1) * self.parallel,
                        # the devices' memory-bound kernels divide one memory bus (never less than
                        # one thread streams alone), when the program's blocks leave the cache
                        mem_bus=max(self.mem_bw_all, self.mem_bw) if self.mem_bw_all > 0 else 0.0,
                        cache=float(max(0, self.cache_bytes)))

    def dispatch(self, n: int) -> tuple[float, float]:
        """Seconds per task and per run of the threads backend on ``n`` devices: inline on one,
        measured on two and four device threads (each busy: a task's cost holds the GIL's
        hand-overs, which grow with the threads waiting for it), in proportion for three,
        four's beyond four (not measured: more threads may wait longer).

        >>> cal = Calibration(cores=2, matmul_rate=1e9, half_work=0.0, parallel=1.0, mem_bw=1e9, vector_rate=1e9,
        ...                   copy_bw=1e9, launch=3e-6, launch_threads=1e-5, machine="m", overhead=1e-4,
        ...                   overhead_threads=5e-4, launch_threads4=2e-5, overhead_threads4=9e-4)
        >>> [round(x * 1e6, 3) for n in (1, 2, 3, 8) for x in cal.dispatch(n)]  # us per task, per run
        [3.0, 100.0, 10.0, 500.0, 15.0, 700.0, 20.0, 900.0]
        """
        if n <= 1:
            return self.launch, self.overhead
        two = (self.launch_threads, self.overhead_threads)
        four = (self.launch_threads4 if self.launch_threads4 >= 0 else two[0],
                self.overhead_threads4 if self.overhead_threads4 >= 0 else two[1])
        f = min(1.0, (n - 2) / 2)
        return two[0] + f * (four[0] - two[0]), two[1] + f * (four[1] - two[1])

    def light(self, n: int) -> tuple[float, float]:
        """Seconds of a free and of a view (a load of a feed's block, a zero-copy move) on ``n``
        devices: inline on one, on device threads beyond (-1, -1: not measured, a launch each).

        >>> cal = Calibration(cores=2, matmul_rate=1e9, half_work=0.0, parallel=1.0, mem_bw=1e9, vector_rate=1e9,
        ...                   copy_bw=1e9, launch=6e-6, launch_threads=1.2e-5, machine="m", free_cost=3e-7,
        ...                   view_cost=3e-6, free_threads=4e-7, view_threads=5e-6)
        >>> [round(x * 1e6, 3) for n in (1, 2) for x in cal.light(n)]  # us per free, per view
        [0.3, 3.0, 0.4, 5.0]
        """
        if self.free_cost < 0:
            return -1.0, -1.0
        if n <= 1:
            return self.free_cost, self.view_cost
        return max(0.0, self.free_threads), max(0.0, self.view_threads)

    def table(self) -> str:
        """The figures, one per line."""
        return "\n".join([
            f"matmul float32, one core: {self.matmul_rate / 1e9:.1f} GFLOP/s (half of it at "
            f"{self.half_work / 1e6:.2f} MFLOP), each further thread +{self.parallel:.2f} of a core"
            + (f" (on every core half of it at {self.parallel_half / 1e6:.2f} MFLOP)"
               if self.parallel_half >= 0 else ""),
            f"elementwise: {self.mem_bw / 1e9:.2f} GB/s read + written, {self.vector_rate / 1e9:.2f} GFLOP/s (exp)",
            f"copy: {self.copy_bw / 1e9:.2f} GB/s read + written"
            + (f"; every core at once {self.mem_bw_all / 1e9:.2f} GB/s (one memory bus)" if self.mem_bw_all > 0 else "")
            + (f"; last-level cache {self.cache_bytes / 2**20:.0f} MiB" if self.cache_bytes > 0 else ""),
            f"attention kernel, one thread: {self.attention_rate / 1e9:.2f} GFLOP/s (+{self.attention_half / 1e6:.1f} "
            "MFLOP of fixed cost per call)" + (f", each further thread +{self.attention_parallel:.2f}"
                                              if self.attention_parallel >= 0 else ""),
            f"elementwise functions, {self.fn_call * 1e6:.1f} us a call, Gelem/s: " + (", ".join(
                f"{k} {v / 1e9:.2f}" for k, v in sorted(self.fn_rates.items(), key=lambda kv: kv[1])[:8]) + ", ..."
                if self.fn_rates else "not measured"),
            f"dispatch per {'kernel' if self.free_cost >= 0 else 'task'}: {self.launch * 1e6:.1f} us inline, "
            f"{self.dispatch(2)[0] * 1e6:.1f} us on 2 device threads, {self.dispatch(4)[0] * 1e6:.1f} us on 4"
            + (f"; a free {self.light(1)[0] * 1e6:.2f} / {self.light(2)[0] * 1e6:.2f} us, a view (feed block, "
               f"zero-copy move) {self.light(1)[1] * 1e6:.1f} / {self.light(2)[1] * 1e6:.1f} us (inline / threads)"
               if self.free_cost >= 0 else ""),
            f"per run: {self.overhead * 1e3:.2f} ms inline, {self.dispatch(2)[1] * 1e3:.2f} ms on 2 device threads, "
            f"{self.dispatch(4)[1] * 1e3:.2f} ms on 4",
            f"cores: {self.cores}; measured in {self.seconds:.1f} s on {self.machine}, load average {self.load:.1f}"
            + (" (a busy machine: its figures are too low; measure again when it is quiet: "
               "ej.calibrate(force=True))" if self.load > self.cores else "")])


def machine_key() -> str:
    """What identifies this machine for the cache."""
    return f"{platform.node()}|{os.cpu_count()}|{platform.machine()}|{platform.processor()}"


def cache_path() -> pathlib.Path:
    """Where the calibration is cached: ``$XDG_CACHE_HOME/einjoin/calibration.json``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative (or empty) value is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "einjoin" / "calibration.json"


def load_cached() -> Calibration | None:
    """The cached calibration of this machine, or None (none, another machine's, unreadable)."""
    try:
        data: Any = json.loads(cache_path().read_text(encoding="utf-8"))
        if data.get("version") != VERSION or data.get("machine") != machine_key():
            return None
        names = {f.name for f in fields(Calibration)}
        cal = Calibration(**{k: v for k, v in data["calibration"].items() if k in names})
        for n in (1, 2):  # a parsable but damaged file (a rate "fast" or -1) is measured again
            cal.hardware(n)
        return cal
    except (OSError, ValueError, TypeError, KeyError, AttributeError, EinjoinError):
        return None


def save_cached(cal: Calibration) -> pathlib.Path | None:
    """Write ``cal`` to the cache (atomically); returns the path, or None when it cannot be written."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "machine": machine_key(), "calibration": asdict(cal)}),
                       encoding="utf-8")
        os.replace(tmp, path)
        return path
    except OSError:
        return None


# how this machine is measured: the runtime's calibrate (einjoin.runtime.simulate_calibrate registers
# it when einjoin loads), kept here so that the simulator reads a calibration without importing the
# module that measures one (which runs the threads backend, whose registry holds the simulator)
MEASURE: dict[str, Callable[[], Calibration]] = {}


def local_calibration() -> Calibration:
    """The cached calibration of this machine, measured first (``ej.calibrate()``) when there is none."""
    cached = load_cached()
    if cached is not None:
        return cached
    measure = MEASURE.get("calibrate")
    if measure is None:  # einjoin.runtime.simulate_calibrate not loaded: ``import einjoin`` loads it
        raise EinjoinError("no calibration of this machine is cached, and nothing to measure one is loaded: "
                           "import einjoin (ej.calibrate) first")
    return measure()
