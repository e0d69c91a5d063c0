"""The same plan on the ``threads`` backend and on ``ray`` (2 devices, a local Ray), in one table:
an MLP, a LLaMA block and a graph of many tiny tasks: time per run (best of ``--reps`` after a
warm-up), the ratio, each backend's time per task (the tiny-task row is their per-task dispatch
overhead), and Ray's extra time per task = (ray - threads) / tasks. Then Ray's first-run latency
once Ray is up: a program's first run on fresh actors (they start, import einjoin, get the plan),
a second program's first run on those actors (only its plan is shipped), and apart: the actors'
start alone and the first run on started actors, with the threads backend's first run.

    make bench            (or: .venv/bin/python bench/ray_exec.py [--reps 5])

Both programs of a row are compiled from one graph with the same planner and placement, so they
run the identical task graph; outputs are checked equal. The BLAS library in use is printed.
Goals (issue 22): LLaMA block ray / threads <= 2.0; first run <= 2 s after Ray is up.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

import einjoin as ej
from einjoin.models.graphs import llama_layers, mlp


def _tiny(depth: int = 150) -> ej.Tensor:
    """A chain of 8x8 matmuls and tanhs split in two: hundreds of tasks of ~microseconds each."""
    h = ej.input("x", (16, 8))
    for i in range(depth):
        h = ej.tanh(h @ ej.param(f"w{i}", (8, 8)))
    return h


# name -> (graph, devices: None for --devices); the tiny chain on one device is the per-task
# dispatch overhead alone, on two it also waits for a move (actor to actor on Ray) every layer
CASES: dict[str, tuple[Callable[[], ej.Tensor], int | None]] = {
    "MLP relu(x@W1)@W2, x 2048x512, W1 512x2048": (lambda: mlp(2048, 512, 2048), None),
    "LLaMA block b1 s256 d512 h8 ffn 1376": (lambda: llama_layers(1, batch=1, seq=256, d=512, heads=8,
                                                                  hidden=1376), None),
    "tiny tasks: 150 x tanh(h @ W), 16x8, 1 device": (_tiny, 1),
    "tiny tasks: 150 x tanh(h @ W), 16x8": (_tiny, None),
}


def _feeds(out: ej.Tensor) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {x.op.name: (rng.standard_normal(x.shape) * 0.05).astype(np.float32)
            for x in ej.Graph(out).inputs}


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _first_runs(console: Console, devices: int) -> None:
    """The first run of the LLaMA block on fresh actors, then a second program's on the same ones;
    where the first goes: a fresh backend's first run of a one-matmul program (its actors start:
    a process each that imports einjoin) then the LLaMA block's on those started actors (its plan
    shipped, each actor's part built); the threads backend's first run next to them."""
    from einjoin.runtime.backends.ray import RayBackend, ensure_ray
    t0 = time.perf_counter()
    ensure_ray(quiet=True)
    up = time.perf_counter() - t0
    out = CASES["LLaMA block b1 s256 d512 h8 ffn 1376"][0]()
    feeds = _feeds(out)
    x = ej.input("x", (8, 8))
    small = x @ x
    times: dict[str, float] = {}

    def timed(name: str, prog: ej.Program, f: dict[str, np.ndarray]) -> None:
        t = time.perf_counter()
        prog.run(**f)
        times[name] = time.perf_counter() - t

    backend = RayBackend(quiet=True)
    t0 = time.perf_counter()
    first = ej.compile(out, devices=devices, backend=backend, planner="eindecomp", quiet=True)
    times["compile"] = time.perf_counter() - t0
    second = ej.compile(out * 2.0, devices=devices, backend=backend, planner="eindecomp", quiet=True)
    timed("first", first, feeds)
    timed("second", second, feeds)
    backend.close()
    backend = RayBackend(quiet=True)
    timed("start", ej.compile(small, devices=devices, backend=backend, quiet=True), {"x": np.ones((8, 8), np.float32)})
    timed("started", ej.compile(out, devices=devices, backend=backend, planner="eindecomp", quiet=True), feeds)
    backend.close()
    timed("threads", ej.compile(out, devices=devices, backend="threads", planner="eindecomp", quiet=True), feeds)
    console.print(f"first run of the LLaMA block once Ray is up (ray.init {up:.2f} s, compile "
                  f"{times['compile']:.2f} s): "
                  f"on fresh actors {times['first']:.2f} s (goal <= 2 s), a second program on the same actors "
                  f"{times['second']:.2f} s; apart: the actors' start (a one-matmul program's first run on fresh "
                  f"actors) {times['start']:.2f} s, then the block's first run on them {times['started']:.2f} s; "
                  f"the threads backend's first run {times['threads']:.2f} s")


def main() -> None:
    import ray
    from threadpoolctl import threadpool_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    console = Console(width=200)
    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i.get('threading_layer', '?')})"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    console.print(f"Ray {ray.__version__}; BLAS: {blas}; devices {args.devices}")
    _first_runs(console, args.devices)
    table = Table(title=f"threads vs ray backend, same task graph (best of {args.reps}; goal: LLaMA block "
                        f"ray / threads <= 2.0)")
    for col in ("case", "devices", "tasks", "moves", "threads (s)", "ray (s)", "ray / threads",
                "threads per task (ms)", "ray per task (ms)", "ray extra per task (ms)", "bytes moved"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, (make, devices) in CASES.items():
        out = make()
        feeds = _feeds(out)
        devices = devices or args.devices
        progs = {b: ej.compile(out, devices=devices, backend=b, planner="eindecomp", quiet=True)
                 for b in ("threads", "ray")}
        a = progs["threads"].run(**feeds)
        b = progs["ray"].run(**feeds)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        times = {k: _best(lambda p=p, f=feeds: p.run(**f), args.reps) for k, p in progs.items()}
        n = len(progs["ray"].taskgraph)
        moves = sum(t.kind.value == "move" for t in progs["ray"].taskgraph.tasks)
        table.add_row(name, str(devices), str(n), str(moves), f"{times['threads']:.4f}", f"{times['ray']:.4f}",
                      f"{times['ray'] / times['threads']:.2f}", f"{times['threads'] / n * 1e3:.3f}",
                      f"{times['ray'] / n * 1e3:.3f}", f"{(times['ray'] - times['threads']) / n * 1e3:.3f}",
                      str(progs["ray"].run_stats.bytes_moved))
        progs["ray"].close()
    console.print(table)


if __name__ == "__main__":
    main()
