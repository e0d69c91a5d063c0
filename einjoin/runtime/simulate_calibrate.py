"""Measure this machine for the time model: ``ej.calibrate()``.

Float32 GEMMs of a few sizes on one BLAS thread (a least-squares line ``t = W / rate + c`` gives
the rate and the work at which a GEMM reaches half of it, ``half_work = c · rate``), one large
GEMM on every core (what each further thread adds), an elementwise add and ``exp`` (memory
bandwidth and the vector rate of numpy's kernels, which run on one thread), the same add on every
core at once (the memory bus the devices divide; the last-level cache's size read from the OS
decides whether a program streams through it), a copy, and the threads backend's cost per kernel
and per run (chains of small matmuls, warm, on one device inline and on two and four device
threads, where the GIL's hand-overs cost) and of a free and a view (the
tasks that dispatch no kernel: their own intervals in those runs), the attention kernel on one
thread, and each elementwise function (its elements per second: a join is evaluated one function
at a time). Work on one thread is timed by its CPU time (on a busy machine, the speed a quiet one
has).
Each figure is the best of a few repetitions, the points of a line measured round after round
(a drift of the machine's speed moves them alike) and fitted on relative residuals; the chains
run after a pass that wipes the caches, as a program's run starts after kernels that streamed
its blocks. About 3-6 s on a quiet machine; the result is cached (:mod:`einjoin.cluster.calibration`).

>>> cal = calibrate()  # seconds, then read from the cache  # doctest: +SKIP
>>> print(cal.table())                # doctest: +SKIP
matmul float32, one core: 10.7 GFLOP/s (half of it at 56.91 MFLOP), each further thread +0.00 ...
...
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from einjoin.cluster.calibration import MEASURE, Calibration, load_cached, machine_key, save_cached
from einjoin.errors import EinjoinError
from einjoin.exchange import TaskKind
from einjoin.runtime.engine import Engine

__all__ = ["calibrate", "local_calibration"]


def _best(fn: Callable[[], object], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The least seconds of ``reps`` warm calls of ``fn`` by ``clock``: wall time, or for work
    on the calling thread alone its CPU time (``time.thread_time``: the machine's speed, not
    the share of it that other processes leave; a quiet machine's wall time)."""
    fn()  # warm: pages touched, BLAS buffers allocated
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _interleaved(fns: list[Callable[[], object]], reps: int,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The least seconds of ``reps`` warm calls of each of ``fns`` by ``clock``, measured round
    after round (one call of each per round), not one function's reps after another's: a drift
    of the machine's speed while measuring (another process starting, a neighbour's memory
    traffic) then moves every point alike instead of bending a line fitted through them (the
    half-work of the GEMM line read 0 to 5.7 MFLOP between runs measured one size after another)."""
    for fn in fns:
        fn()  # warm
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


_CPU = time.thread_time


def _matmul(a: np.ndarray, b: np.ndarray) -> Callable[[], object]:
    return lambda: a @ b


def _call(fn: Callable[..., object], args: tuple[Any, ...]) -> Callable[[], object]:
    return lambda: fn(*args)


class _Chain(NamedTuple):
    """One length of a calibration chain: its best run's seconds, and its tasks by cost class:
    kernels (and selects: a dispatch each), frees, views (loads of a feed's block, zero-copy moves),
    and the seconds one free and one view took in the runs (their own intervals, the mean)."""

    seconds: float
    kernels: int
    frees: int
    views: int
    free_secs: float
    view_secs: float


class _Wipe:
    """A pass over more memory than the last level cache holds (a copy of 32 MB into another 32
    MB), made before each timed run of a calibration chain: a program's run starts after kernels
    that streamed its blocks through the caches, so the runtime's Python around it (binding feeds,
    opening the session, assembling outputs) runs with its code and objects out of the caches. In
    the caches (a tiny chain run again and again) the per run cost read 0.05 ms on one device
    where runs of programs of MB-sized blocks spent 0.35-0.4 ms outside their tasks."""

    def __init__(self, nbytes: int = 32 << 20):
        self.src = np.ones(nbytes // 4, np.float32)
        self.dst = np.empty_like(self.src)

    def __call__(self) -> None:
        np.copyto(self.dst, self.src)


def _chain_runs(chains: list[tuple[Engine, dict[Any, np.ndarray]]], backend: Any, reps: int,
                clock: Callable[[], float]) -> list[_Chain]:
    """Per chain, the least seconds of ``reps`` warm runs by ``clock`` (the chains measured round
    after round, each run after a :class:`_Wipe` of the caches), with the intervals of its frees
    and views that a run right after each recorded (the runtime runs a free inline as its writer completes, a
    view load or a zero-copy move is a dictionary update: a kernel's dispatch is most of a chain's
    cost per task)."""
    wipe = _Wipe()
    for engine, feeds in chains:
        engine.run(feeds, backend)  # warm
    best = [float("inf")] * len(chains)
    kinds = []
    for _ in chains:
        frees: list[float] = []
        views: list[float] = []
        kinds.append((frees, views, {TaskKind.FREE: frees, TaskKind.LOAD: views, TaskKind.MOVE: views}))
    for _ in range(reps):
        for i, (engine, feeds) in enumerate(chains):
            wipe()
            t0 = clock()
            engine.run(feeds, backend)
            best[i] = min(best[i], clock() - t0)
            # a free's and a view's own cost from a run in the caches: after the wipe the first
            # tasks (the loads) also pay for the cold start, which is the run's (charged once per
            # run, not per load: a program's tenth load is as warm as a chain's)
            _, stats = engine.run(feeds, backend)
            tasks, kind = engine.tg.tasks, kinds[i][2]
            for iv in stats.intervals.values():
                for a, b, tid in iv:
                    got = kind.get(tasks[tid].kind)
                    if got is not None:
                        got.append(b - a)
    out = []
    for i, (engine, _) in enumerate(chains):
        tasks = engine.tg.tasks
        frees, views, _ = kinds[i]
        count = {k: sum(1 for t in tasks if t.kind is k) for k in TaskKind}
        out.append(_Chain(best[i], count[TaskKind.KERNEL] + count[TaskKind.SELECT], count[TaskKind.FREE],
                          count[TaskKind.LOAD] + count[TaskKind.MOVE],
                          float(np.median(frees)) if frees else 0.0, float(np.median(views)) if views else 0.0))
    return out


def _kernel_line(short: _Chain, long: _Chain) -> tuple[float, float, float, float]:
    """Seconds per kernel and per run through two chains, with a free and a view at their own
    measured cost (not a kernel's): (per kernel, per run, per free, per view)."""
    free = (short.free_secs + long.free_secs) / 2
    view = (short.view_secs + long.view_secs) / 2
    rest = [c.seconds - c.frees * free - c.views * view for c in (short, long)]
    per = max((rest[1] - rest[0]) / max(1, long.kernels - short.kernels), 1e-7)
    return per, max(0.0, rest[0] - short.kernels * per), free, view


def _line(work: list[float], secs: list[float]) -> tuple[float, float]:
    """A least-squares line ``t = W / rate + c`` through (work, seconds), on relative residuals:
    the rate and the work at which it reaches half of it (``c · rate``).

    >>> [round(v) for v in _line([1e6, 1e7, 1e8], [1.1e-4, 2e-4, 1.1e-3])]  # flop/s, half-work
    [100000000000, 10000000]
    """
    # relative residuals (weights 1 / t): fitted on absolute ones, 1% of noise at the largest
    # size (~10 ms) moved the intercept by ~0.1 ms, ~10 MFLOP of half-work, more than the small
    # sizes' whole time; each point counts alike now
    y = np.array(secs)
    slope, intercept = np.polyfit(np.array(work), y, 1, w=1.0 / y)
    rate = 1.0 / slope if slope > 0 else work[-1] / secs[-1]
    return float(rate), max(0.0, float(intercept)) * float(rate)


def _gemm(reps: int, quick: bool) -> tuple[float, float, float, float]:
    """One BLAS thread's line (CPU time), and the line on every core (wall time: the caller's
    CPU time leaves out the other threads' share, and read 2.0x on 2 cores where chains of 768^2
    GEMMs ran 1.74x): the speed-up of a further thread at large sizes (``parallel``) and the work
    at which the threaded GEMM reaches half its rate (``parallel_half``: starting the threads and
    splitting the tiles is a fixed cost a small GEMM does not amortise)."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    sizes = (48, 96, 192, 384) if quick else (96, 128, 192, 256, 384, 512, 768)
    work, secs = [], []
    with threadpool_limits(1, user_api="blas"):
        fns = []
        for n in sizes:
            a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
            work.append(2.0 * n**3)
            fns.append(_matmul(a, b))
        secs = _interleaved(fns, reps + 2, _CPU)
    rate, half = _line(work, secs)
    cores = os.cpu_count() or 1
    parallel, parallel_half = 0.0, half
    if cores > 1:
        # every core, by the wall clock (a busy machine's figures come out low: measure it quiet)
        tw, fns = [], []
        with threadpool_limits(cores, user_api="blas"):
            for n in ((96, 192, 512) if quick else (128, 256, 512, 1024)):
                a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
                tw.append(2.0 * n**3)
                fns.append(_matmul(a, b))
            ts = _interleaved(fns, reps + 4)
        rate_all, parallel_half = _line(tw, ts)
        parallel = min(1.0, max(0.0, (rate_all / rate - 1) / (cores - 1)))
    return rate, half, parallel, parallel_half


def _memory(reps: int, quick: bool) -> tuple[float, float, float]:
    n = (1 << 21) if quick else (1 << 23)  # 8 / 32 MB of float32: out of the caches
    x, y, out = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    small = np.ones(1 << 16, np.float32)  # exp in the cache: its compute rate
    sm_out = np.empty_like(small)
    add, copy = _interleaved([lambda: np.add(x, y, out=out), lambda: np.copyto(out, x)], reps + 2, _CPU)
    mem_bw = 3 * 4 * n / add
    vec = small.size / _best(lambda: np.exp(small, out=sm_out), reps * 3, _CPU)
    return mem_bw, vec, 2 * 4 * n / copy


def _cache_bytes() -> int:
    """The last-level cache's size in bytes (Linux: the highest level of cpu0's caches in sysfs;
    0 elsewhere or unreadable)."""
    import glob
    best = (0, 0)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "level"), encoding="ascii") as f:
                level = int(f.read())
            with open(os.path.join(d, "size"), encoding="ascii") as f:
                text = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            size = int(text.rstrip("KMG")) * unit
        except ValueError:
            continue
        best = max(best, (level, size))
    return best[1]


def _bus(reps: int, quick: bool, cache: int) -> float:
    """Bytes read + written per second by ``np.add`` on every core at once (a thread per core,
    each over arrays of its own, together several times the last-level cache): the memory bus
    that devices' memory-bound kernels divide. By the wall clock, the least of ``8 reps + 4`` rounds
    started together (measure on a quiet machine: a busy one reads low). -1 on one core."""
    import threading
    cores = os.cpu_count() or 1
    if cores < 2:
        return -1.0
    # each thread's three arrays: together at least 2x the cache (and 96 MB), at most 32 MB each
    n = max(1 << 18, min(1 << 23, max(2 * cache, 96 << 20) // (12 * cores)))
    if quick:
        n = max(1 << 18, n // 4)
    arrays = [(np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)) for _ in range(cores)]
    rounds = 8 * reps + 4  # many: the least finds a round the cores were both free for (a busy box)
    gate = threading.Barrier(cores)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(cores)]

    def work(i: int) -> None:
        x, y, out = arrays[i]
        np.add(x, y, out=out)  # warm: pages touched
        for _ in range(rounds):
            gate.wait()
            t0 = time.perf_counter()
            np.add(x, y, out=out)
            np.add(out, y, out=out)
            spans[i].append((t0, time.perf_counter()))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(cores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    best = min(max(s[r][1] for s in spans) - min(s[r][0] for s in spans) for r in range(rounds))
    return 2 * 12.0 * n * cores / max(best, 1e-9)


def _functions(reps: int, quick: bool, dtype: type = np.float32) -> dict[str, float]:
    """Elements per second of each scalar function (:data:`einjoin.ir.scalar.FUNCTIONS`) as a
    kernel's step runs it (:func:`einjoin.ir.evaluate.evaluate` of the one call, its in-place and
    faster forms included) over ``dtype`` arrays of 1M elements (out of the L2 cache), a new result
    each call as a join's first step allocates one (a comparison's bool for ``where``; functions
    that take no floats are not measured). float64 is a fill's (its index grids): numpy's float64
    cos and sin run ~16x slower than float32's vector loops here, not the 2x of their bytes."""
    from einjoin.ir.evaluate import evaluate
    from einjoin.ir.scalar import FUNCTIONS, Arg, Call
    n = (1 << 18) if quick else (1 << 20)
    rng = np.random.default_rng(0)
    x: np.ndarray = (rng.random(n, np.float32) + 0.5).astype(dtype)  # in every function's domain
    y: np.ndarray = (rng.random(n, np.float32) + 0.5).astype(dtype)
    cond = x > 1.0
    names, fns = [], []
    for name, f in FUNCTIONS.items():
        args = {"select": (cond, x, y), "logical": None}.get(f.rule, (x, y)[:f.arity])
        if args is None:
            continue
        fn = _call(evaluate, (Call(name, tuple(Arg(i) for i in range(f.arity))), list(args)))
        try:
            fn()
        except Exception:  # noqa: BLE001 - an integer-only function (ipow, floordiv): not measured
            continue
        names.append(name)
        fns.append(fn)
    # round after round (a drift of the machine's speed moves every function alike)
    secs = _interleaved(fns, max(1, reps - 1), _CPU)
    return {name: n / max(t, 1e-9) for name, t in zip(names, secs)}


def _step_call(reps: int) -> float:
    """Seconds of one step of a join's evaluation besides its elements: a join of six calls and
    one of none (``x0``) on a tiny block, through :func:`einjoin.ir.evaluate.evaluate`."""
    from einjoin.ir.evaluate import evaluate
    from einjoin.ir.scalar import parse_join
    x = np.ones((8, 8), np.float32)
    six, none = parse_join("sqrt(exp(x0) * 2.0 + 1.0) / 3.0 - x0", 1), parse_join("x0", 1)
    t6 = _best(_call(evaluate, (six, [x])), 10 * reps, _CPU)
    t0 = _best(_call(evaluate, (none, [x])), 10 * reps, _CPU)
    return max(0.0, (t6 - t0) / 6)


def _tiny_chain(devices: int, length: int, size: int = 8) -> tuple[Any, dict[Any, np.ndarray]]:
    """An engine for a chain of ``length`` small matmuls ``y = y @ w`` (``size`` x ``size``
    blocks) whose rows are cut over ``devices`` (built from the IR up: this floor does not
    compile), and its feeds."""
    from einjoin.cluster import local
    from einjoin.decomp.decompose import decompose
    from einjoin.ir.graph import Graph
    from einjoin.ir.ops import einsum_node, input_node
    from einjoin.placement import place
    from einjoin.plan.taskgraph import build_taskgraph
    rows = size * devices
    x, w = input_node("x", (rows, size)), input_node("w", (size, size))
    y = x
    for _ in range(length):
        y = einsum_node((y, w), ("ij", "jk"), "ik")
    g = Graph(y)
    decomps = {n: decompose(n, {"i": devices} if not n.facts.leaf else None) for n in g.nodes}
    tg = build_taskgraph(g, decomps, place("round_robin", decomps, local(devices)), devices)
    return Engine(tg, decomps), {x: np.ones((rows, size), np.float32) / size, w: np.eye(size, dtype=np.float32)}


def _threads() -> Any:
    """The threads backend, as programs run on it (its BLAS and torch limits each run included).
    Imported here, not above: the registry of backends holds the simulator, whose calibration this
    module measures (the simulator reads it through :data:`einjoin.cluster.calibration.MEASURE`)."""
    from einjoin.runtime.backends import get_backend
    return get_backend("threads")


# the chains' lengths (a line through two: the cost per task and per run; on device threads the
# shorter one short, so that the noise of the slope moves the intercept little) and the size of
# their matmuls on device threads: 64 x 64, whose BLAS call releases the GIL, so each task hands
# the GIL over and takes it back as a program's kernels do (8 x 8 never releases it: on 2 cores
# its tasks ran at 5.9 us each, 64 x 64 ones at 10.9 us, 128 x 128 ones core-bound)
_LENGTHS = {False: (10, 60), True: (4, 24)}
_THREADED_LENGTHS = {False: (2, 40), True: (2, 16)}
_THREADED_SIZE = 64


def _threaded_line(devices: int, reps: int, quick: bool) -> tuple[float, float, float, float]:
    """Seconds per kernel and per run of the threads backend on ``devices`` device threads, each
    busy with its own chain of 64 x 64 matmuls: the wall clock's line through two lengths (its
    slope is the rate at which device threads that contend for the GIL get kernels done; its
    intercept starting and joining the threads, the shares of the cores set and reset), and the
    seconds of a free and of a view there (:func:`_kernel_line`). The best of ``reps`` runs per
    length."""
    backend = _threads()
    chains = [_tiny_chain(devices, length, _THREADED_SIZE) for length in _THREADED_LENGTHS[quick]]
    short, long = _chain_runs(chains, backend, reps, time.perf_counter)
    return _kernel_line(short, long)


def _dispatch(reps: int, quick: bool) -> tuple[tuple[float, float, float, float], tuple[float, float, float, float]]:
    """The threads backend's cost per kernel and per run, and of a free and a view, on one device
    (inline: chains of 8 x 8 matmuls, two lengths, timed by the thread's CPU time: the Python
    around a task) and on two device threads (:func:`_threaded_line`: the wall clock, where the
    cost per kernel holds the GIL's hand-overs between the threads)."""
    backend = _threads()
    short, long = _chain_runs([_tiny_chain(1, length) for length in _LENGTHS[quick]], backend, 2 * reps + 3, _CPU)
    return _kernel_line(short, long), _threaded_line(2, 3 * reps, quick)


def _dispatch_many(reps: int, quick: bool) -> tuple[float, float, float, float]:
    """The same on four device threads (:func:`_threaded_line`): more threads wait for the GIL
    (and on fewer cores than four, for a core) at each hand-over."""
    return _threaded_line(4, 3 * reps, quick)


def _attention(reps: int, quick: bool) -> tuple[float, float, float]:
    """Flop/s of the runtime's attention kernel (torch's CPU flash kernel) on one thread and its
    fixed cost per call (as flops at that rate): causal (1, h, L, 64) blocks of two sizes,
    counted as the flop table counts them (half of the square), a line through the two; and
    what each further torch thread adds on the larger (wall clock, every core: a device whose
    main pool is torch's runs it so; on 2 cores this kernel gained ~1.1x, not the GEMM's 1.7x)."""
    import torch

    from einjoin.ir.attention import attention_kernel
    rng = np.random.default_rng(0)
    before = torch.get_num_threads()
    cores = os.cpu_count() or 1
    parallel = 0.0
    torch.set_num_threads(1)
    try:
        flops, fns = [], []
        for heads, length in (((1, 128), (4, 256)) if quick else ((1, 128), (8, 512))):
            q, k, v = (rng.standard_normal((1, heads, length, 64), np.float32) for _ in range(3))
            flops.append(2 * heads * length * length * (64 + 64) // 2)
            fns.append(_call(attention_kernel, (q, k, v, None, 0.125, True)))
        points = list(zip(flops, _interleaved(fns, reps + 2, _CPU)))  # round after round
        if cores > 1:  # one thread and every core, round after round, by the wall clock
            one = many = float("inf")
            fns[-1]()
            for _ in range(reps + 2):
                torch.set_num_threads(1)
                t0 = time.perf_counter()
                fns[-1]()
                one = min(one, time.perf_counter() - t0)
                torch.set_num_threads(cores)
                t0 = time.perf_counter()
                fns[-1]()
                many = min(many, time.perf_counter() - t0)
            parallel = min(1.0, max(0.0, (one / many - 1) / (cores - 1)))
    finally:
        torch.set_num_threads(before)
    (w0, t0), (w1, t1) = points
    rate = (w1 - w0) / (t1 - t0) if t1 > t0 else w1 / t1
    return rate, max(0.0, t0 * rate - w0), parallel


def calibrate(quick: bool = False, force: bool = False, reps: int = 3) -> Calibration:
    """Measure this machine (or return its cached calibration, unless ``force``) and cache it
    (unless the machine was busy — load average above half its cores and above the cached
    calibration's — and a quieter calibration is cached: that one stays).
    ``quick``: smaller sizes (for tests; less accurate). At most a few seconds.

    Returns a :class:`~einjoin.cluster.calibration.Calibration`; ``.table()`` prints it."""
    for name, flag in (("quick", quick), ("force", force)):
        if not isinstance(flag, (bool, np.bool_)):
            raise EinjoinError(f"calibrate: {name} must be True or False, got {flag!r:.40}")
    # reps < 1 would time nothing: every rate 0 (the inf of an empty min)
    if isinstance(reps, (bool, np.bool_)) or not isinstance(reps, (int, np.integer)) or reps < 1:
        raise EinjoinError(f"calibrate: reps must be an int >= 1, got {reps!r:.40}")
    if not force:
        cached = load_cached()
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    rate, half, parallel, parallel_half = _gemm(reps, quick)
    mem_bw, vector_rate, copy_bw = _memory(reps, quick)
    cache = _cache_bytes()
    mem_bw_all = _bus(reps, quick, cache)
    attention_rate, attention_half, attention_parallel = _attention(reps, quick)
    # after the attention kernel: torch loaded, each run also sets torch's share of the cores, as
    # runs of programs with torch kernels do
    (launch, overhead, free, view), (launch_threads, overhead_threads, free2, view2) = _dispatch(reps, quick)
    launch_threads4, overhead_threads4, free4, view4 = _dispatch_many(reps, quick)
    # a kernel on device threads costs at least one inline (its hand-overs come on top), and on
    # four at least one on two (a noisy line read less at load 6 on 2 cores)
    launch_threads = max(launch_threads, launch)
    launch_threads4 = max(launch_threads4, launch_threads)
    fn_rates = _functions(reps, quick)
    fn_rates64 = _functions(max(1, reps - 1), True, np.float64)  # a fill's grids: the small arrays suffice
    fn_call = _step_call(reps)
    cal = Calibration(cores=os.cpu_count() or 1, matmul_rate=rate, half_work=half, parallel=parallel,
                      parallel_half=parallel_half,
                      mem_bw=mem_bw, vector_rate=vector_rate, copy_bw=copy_bw, launch=launch,
                      launch_threads=launch_threads, overhead=overhead, overhead_threads=overhead_threads,
                      launch_threads4=launch_threads4, overhead_threads4=overhead_threads4,
                      attention_rate=attention_rate, attention_half=attention_half, fn_rates64=fn_rates64,
                      attention_parallel=attention_parallel, fn_rates=fn_rates, fn_call=fn_call,
                      mem_bw_all=mem_bw_all, cache_bytes=cache,
                      free_cost=free, view_cost=view, free_threads=(free2 + free4) / 2,
                      view_threads=(view2 + view4) / 2,
                      machine=machine_key(), seconds=time.perf_counter() - t0,
                      load=load)
    # figures measured on a busy machine are low (another process had the cores): they never
    # replace a cached calibration measured quieter; this call still returns them
    prior = load_cached()
    if prior is None or load <= max(prior.load, cal.cores / 2):
        save_cached(cal)
    return cal


def local_calibration() -> Calibration:
    """The cached calibration of this machine, measured first when there is none."""
    return calibrate()


MEASURE["calibrate"] = local_calibration
