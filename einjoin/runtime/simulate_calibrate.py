"""Measure this machine for the time model: ``ej.calibrate()``.

Float32 GEMMs of a few sizes on one BLAS thread (a least-squares line ``t = W / rate + c`` gives
the rate and the work at which a GEMM reaches half of it, ``half_work = c · rate``), one large
GEMM on every core (what each further thread adds), an elementwise add and ``exp`` (memory
bandwidth and the vector rate of numpy's kernels, which run on one thread), a copy, and the
threads backend's cost per task and per run (chains of tiny matmuls, warm, on one device inline
and on two device threads), and the attention kernel on one thread.
Each figure is the best of a few repetitions. About 3-6 s; the result is
cached (:mod:`einjoin.cluster.calibration`).

>>> cal = calibrate()  # seconds, then read from the cache  # doctest: +SKIP
>>> print(cal.table())                # doctest: +SKIP
matmul float32, one core: 10.7 GFLOP/s (half of it at 56.91 MFLOP), each further thread +0.00 ...
...
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from einjoin.cluster.calibration import Calibration, load_cached, machine_key, save_cached
from einjoin.runtime.engine import Engine

__all__ = ["calibrate", "local_calibration"]


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: pages touched, BLAS buffers allocated
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul(a: np.ndarray, b: np.ndarray) -> Callable[[], object]:
    return lambda: a @ b


def _runner(engine: Engine, feeds: dict[Any, np.ndarray], backend: Any) -> Callable[[], object]:
    return lambda: engine.run(feeds, backend)


def _gemm(reps: int, quick: bool) -> tuple[float, float, float]:
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    sizes = (48, 96, 192, 384) if quick else (64, 128, 256, 384, 512, 768)
    work, secs = [], []
    with threadpool_limits(1, user_api="blas"):
        for n in sizes:
            a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
            work.append(2.0 * n**3)
            secs.append(_best(_matmul(a, b), reps))
    slope, intercept = np.polyfit(np.array(work), np.array(secs), 1)
    rate = 1.0 / slope if slope > 0 else work[-1] / secs[-1]
    half = max(0.0, float(intercept)) * rate
    cores = os.cpu_count() or 1
    parallel = 0.0
    if cores > 1:
        n = sizes[-1] * (1 if quick else 4) // 3
        a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
        with threadpool_limits(1, user_api="blas"):
            one = _best(_matmul(a, b), reps)
        with threadpool_limits(cores, user_api="blas"):
            many = _best(_matmul(a, b), reps)
        parallel = min(1.0, max(0.0, (one / many - 1) / (cores - 1)))
    return float(rate), float(half), parallel


def _memory(reps: int, quick: bool) -> tuple[float, float, float]:
    n = (1 << 21) if quick else (1 << 23)  # 8 / 32 MB of float32: out of the caches
    x, y, out = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    add = _best(lambda: np.add(x, y, out=out), reps)
    mem_bw = 3 * 4 * n / add
    small = np.ones(1 << 16, np.float32)  # exp in the cache: its compute rate
    sm_out = np.empty_like(small)
    vec = small.size / _best(lambda: np.exp(small, out=sm_out), reps * 3)
    copy = _best(lambda: np.copyto(out, x), reps)
    return mem_bw, vec, 2 * 4 * n / copy


def _tiny_chain(devices: int, length: int) -> tuple[Any, dict[Any, np.ndarray]]:
    """An engine for a chain of ``length`` tiny matmuls ``y = y @ w`` whose rows are cut over
    ``devices`` (built from the IR up: this floor does not compile), and its feeds."""
    from einjoin.cluster import local
    from einjoin.decomp.decompose import decompose
    from einjoin.ir.graph import Graph
    from einjoin.ir.ops import einsum_node, input_node
    from einjoin.placement import place
    from einjoin.plan.taskgraph import build_taskgraph
    rows = 8 * devices
    x, w = input_node("x", (rows, 8)), input_node("w", (8, 8))
    y = x
    for _ in range(length):
        y = einsum_node((y, w), ("ij", "jk"), "ik")
    g = Graph(y)
    decomps = {n: decompose(n, {"i": devices} if not n.facts.leaf else None) for n in g.nodes}
    tg = build_taskgraph(g, decomps, place("round_robin", decomps, local(devices)), devices)
    return Engine(tg, decomps), {x: np.ones((rows, 8), np.float32), w: np.eye(8, dtype=np.float32)}


class _Threads:
    """The threads backend's session (:class:`~einjoin.runtime.local.LocalSession`, a thread per
    device) without its BLAS limiter: the registry of backends holds the simulator, which needs
    this module, so this module does not import the registry; the tiny kernels measured here
    run on one BLAS thread either way, and repeated runs of one device count keep the limiter
    off its slow path."""

    name, computes, remote, retries = "threads", True, False, 0

    def open(self, run: Any) -> Any:
        from einjoin.runtime.local import LocalSession
        return LocalSession(run, True, threaded=True)

    def close(self) -> None:
        pass


def _dispatch(reps: int, quick: bool) -> tuple[float, float, float, float]:
    """The threads backend's cost per task and per run, on one device (inline) and on two device
    threads: warm runs of chains of tiny matmuls of two lengths (a line through the two)."""
    backend = _Threads()
    out: list[float] = []
    for devices in (1, 2):
        points = []
        for length in ((4, 24) if quick else (10, 60)):
            engine, feeds = _tiny_chain(devices, length)
            points.append((len(engine.tg.tasks), _best(_runner(engine, feeds, backend), reps + 2)))
        (n0, t0), (n1, t1) = points
        per = max((t1 - t0) / (n1 - n0), 1e-7)
        out += [per, max(0.0, t0 - n0 * per)]
    return out[0], out[1], out[2], out[3]


def _attention(reps: int, quick: bool) -> float:
    """Flop/s of the runtime's attention kernel (torch's CPU flash kernel) on one thread: a
    causal (1, 4, L, 64) block, counted as the flop table counts it (half of the square)."""
    import torch

    from einjoin.ir.attention import attention_kernel
    length = 128 if quick else 256
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, length, 64), np.float32) for _ in range(3))
    flops = 2 * 4 * length * length * (64 + 64) // 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        secs = _best(lambda: attention_kernel(q, k, v, None, 0.125, True), reps)
    finally:
        torch.set_num_threads(before)
    return flops / secs


def calibrate(quick: bool = False, force: bool = False, reps: int = 3) -> Calibration:
    """Measure this machine (or return its cached calibration, unless ``force``) and cache it.
    ``quick``: smaller sizes (for tests; less accurate). At most a few seconds.

    Returns a :class:`~einjoin.cluster.calibration.Calibration`; ``.table()`` prints it."""
    if not force:
        cached = load_cached()
        if cached is not None:
            return cached
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    rate, half, parallel = _gemm(reps, quick)
    mem_bw, vector_rate, copy_bw = _memory(reps, quick)
    launch, overhead, launch_threads, overhead_threads = _dispatch(reps, quick)
    attention_rate = _attention(reps, quick)
    cal = Calibration(cores=os.cpu_count() or 1, matmul_rate=rate, half_work=half, parallel=parallel,
                      mem_bw=mem_bw, vector_rate=vector_rate, copy_bw=copy_bw, launch=launch,
                      launch_threads=launch_threads, overhead=overhead, overhead_threads=overhead_threads,
                      attention_rate=attention_rate, machine=machine_key(), seconds=time.perf_counter() - t0,
                      load=load)
    save_cached(cal)
    return cal


def local_calibration() -> Calibration:
    """The cached calibration of this machine, measured first when there is none."""
    return calibrate()
