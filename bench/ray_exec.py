"""The same plan on the ``threads`` backend and on ``ray`` (2 devices, a local Ray), in one table:
an MLP, a LLaMA block and a graph of many tiny tasks: time per run (best of ``--reps`` after a
warm-up, the backends alternating by round), the ratio (also of Ray with every move through its
object store, ``channels=False``), the CPU per run of the driver (for threads: all of it) and of
the actors, each backend's time per task (the tiny-task row is their per-task dispatch
overhead), and Ray's extra time per task = (ray - threads) / tasks. First, Ray's first-run latency
once Ray is up (``ray.init`` returned and its prestarted workers idle), timed from ``prog.run`` on
fresh actors: as before compile-time warm-up, as ``ej.compile`` does now (the actors start and
import what the kernels need while it plans), and after ``RayBackend.warm(wait=True)``; a second
program on those actors; the threads backend's first run.

    make bench            (or: .venv/bin/python bench/ray_exec.py [--reps 5] [--no-first-run]
                           [--first-run-reps 3] [--only-first-run])

Both programs of a row are compiled from one graph with the same planner and placement, so they
run the identical task graph; outputs are checked equal. The BLAS library in use is printed.
Goals (issue 22): LLaMA block ray / threads <= 2.0; first run <= 2 s after Ray is up.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Mapping

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


def _actors_cpu(backend: object) -> float:
    """CPU seconds the actors of ``backend``'s last pool have used since they started."""
    import ray
    actors = backend.actors  # type: ignore[attr-defined]
    return float(sum(ray.get([a.__ray_call__.remote(lambda w: time.process_time()) for a in actors])))


def _timed(runs: dict[str, Callable[[], object]], reps: int, backends: Mapping[str, object]) -> dict[str, list[float]]:
    """Per case: [best wall, median driver CPU, median actors' CPU] over ``reps`` rounds, the cases
    alternating by round (a busy machine slows them alike), after one warm-up round. The driver's
    CPU is this process's (for threads: the whole run); the actors' is read before and after."""
    for fn in runs.values():
        fn()
    got: dict[str, list[list[float]]] = {k: [[], [], []] for k in runs}
    for _ in range(reps):
        for k, fn in runs.items():
            b = backends.get(k)
            a0 = _actors_cpu(b) if b is not None else 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            got[k][0].append(time.perf_counter() - t0)
            got[k][1].append(time.process_time() - c0)
            got[k][2].append(_actors_cpu(b) - a0 if b is not None else 0.0)
    return {k: [min(w), float(np.median(c)), float(np.median(a))] for k, (w, c, a) in got.items()}


def _idle_workers(cpus: int, timeout: float = 120.0, settle: float = 0.5) -> set[int]:
    """Wait until the local Ray this process started has ``cpus`` idle workers (``ray::IDLE``
    processes below this one, the workers Ray prestarts) that have finished starting: their CPU
    time grew by less than 20 ms over ``settle`` seconds (a worker connects, and is named IDLE,
    before it imports what Ray preloads: einjoin's actor module, ``ensure_ray``); their pids. Not
    by running tasks on them: Ray hands only a worker that never ran a task to a new actor."""
    import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)
    deadline = time.time() + timeout
    idle: set[int] = set()
    while time.time() < deadline:
        idle = {p.pid for p in psutil.Process().children(recursive=True) if _name(p) == "ray::IDLE"}
        if len(idle) >= cpus:
            break
        time.sleep(0.1)
    used = sum(_cpu(p) for p in idle)
    while time.time() < deadline:
        time.sleep(settle)
        now = sum(_cpu(p) for p in idle)
        if now - used < 0.02:
            break
        used = now
    return idle


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    import psutil
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:  # noqa: BLE001 - gone meanwhile
        return 0.0


def _name(p: object) -> str:
    try:
        return str(p.name())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return ""


FIRST_CASES = {
    "cold": "cold: actors start at the first run (as before)",
    "compiled": "ej.compile starts them while it plans (now)",
    "warmed": "RayBackend.warm(wait=True) before compile",
}


def _first_run_case(case: str, devices: int) -> None:
    """One row of the first-run table, in a process of its own (a fresh Ray: its prestarted idle
    workers are what a new actor takes; the actors of a closed backend do not give them back).
    Prints a ``ROW`` line of JSON."""
    import json

    import ray

    from einjoin.runtime.backends.ray import RayBackend, ensure_ray
    t0 = time.perf_counter()
    ensure_ray(num_cpus=devices, quiet=True)
    idle = _idle_workers(devices)
    up = time.perf_counter() - t0
    out = CASES["LLaMA block b1 s256 d512 h8 ffn 1376"][0]()
    feeds = _feeds(out)
    backend = RayBackend(quiet=True)
    if case == "cold":
        backend.warm = lambda *a, **k: False  # type: ignore[method-assign]  # the behaviour before
    idle_cpu = {p: _cpu(p) for p in idle}  # what the idle workers used before an actor took them
    t_warm, t0, c0 = 0.0, time.time(), time.process_time()
    if case == "warmed":
        t = time.perf_counter()
        backend.warm(devices, ej.Graph(out), wait=True)
        t_warm = time.perf_counter() - t
    t = time.perf_counter()
    prog = ej.compile(out, devices=devices, backend=backend, planner="eindecomp", quiet=True)
    t_compile = time.perf_counter() - t
    t = time.perf_counter()
    prog.run(**feeds)
    t_run = time.perf_counter() - t
    driver_cpu = time.process_time() - c0
    # per actor: (pid, (wall, CPU) when it began, (wall, CPU) when its preload ended, CPU now)
    info = ray.get([a.__ray_call__.remote(lambda w: (os.getpid(), getattr(w, "started", None),
                                                     getattr(w, "preloaded", None), time.process_time()))
                    for a in backend.actors])
    cpu = sum(now for *_, now in info) - sum(idle_cpu.get(pid, 0.0) for pid, *_ in info)
    starts = [st[0] - t0 for _, st, _, _ in info if st is not None]
    began = max(starts) if len(starts) == len(info) else None
    preloaded = [pre[0] - t0 for _, _, pre, _ in info if pre is not None]
    imports = max(preloaded) if len(preloaded) == len(info) else None
    t = time.perf_counter()
    ej.compile(out * 2.0, devices=devices, backend=backend, planner="eindecomp", quiet=True).run(**feeds)
    t_second = time.perf_counter() - t
    row = dict(up=up, idle=len(idle), warm=t_warm, compile=t_compile, run=t_run, cpu=cpu, second=t_second,
               reused=set(backend.pids) <= idle, began=began, imports=imports, driver_cpu=driver_cpu,
               end=time.time() - t0 - t_second)
    backend.close()
    if case == "cold":  # the threads backend's first run, in this process (it imports torch too)
        t = time.perf_counter()
        threads = ej.compile(out, devices=devices, backend="threads", planner="eindecomp", quiet=True)
        row["threads_compile"] = time.perf_counter() - t
        t = time.perf_counter()
        threads.run(**feeds)
        row["threads_run"] = time.perf_counter() - t
    print("ROW", json.dumps(row), flush=True)


def _first_runs(console: Console, devices: int, reps: int = 3) -> None:
    """The first run of the LLaMA block after Ray is up, timed from the ``prog.run`` call on fresh
    actors, each case in a fresh process with a fresh local Ray. "Ray is up": ``ray.init``
    returned and the workers it prestarts (one per CPU) are idle, done with what they import as
    they start (:func:`_idle_workers`: einjoin's actor module, ``ensure_ray``); no einjoin actor
    exists. "cold": the actors start at the first run (as before compile-time warm-up: each
    imports torch at its first attention block); "compiled": as
    ``ej.compile`` does now (it starts the actors, which import what the program's kernels need,
    then plans); "warmed": after ``RayBackend.warm(..., wait=True)`` (its time apart). With each:
    the actors' CPU seconds by the first run's end (since Ray handed them their workers; wall times
    on a busy machine are inflated, CPU seconds much less) and a second program's compile and first
    run on the same actors; the threads backend's first run (it imports torch too).

    Each case runs ``reps`` times (the cases alternating by round, each in a fresh process): the
    best wall of each column, the median of the CPU columns. Where the first run's time goes:
    "actors began" (their class loaded, einjoin imported: the first call of ``DeviceWorker``) and
    "imports done" (preload's torch) are seconds since compile began (since ``warm`` for
    "warmed"), beside the compile's end; the actors' CPU is what they used after Ray handed them
    their idle workers (class load, imports, plan, first run), the driver's its own for the case."""
    import json
    import subprocess
    import sys

    table = Table(title="first run of the LLaMA block after Ray is up (ray.init returned, its prestarted "
                        "workers idle, their start's imports done), fresh actors, a fresh process and Ray per case; "
                        "goal: first run <= 2 s")
    for col in ("case", "Ray up (s)", "warm (s)", "compile (s)", "first run (s)", "actors began (s)",
                "imports done (s)", "actors' CPU (s)", "driver CPU (s)", "idle workers taken",
                "2nd program: compile + run (s)"):
        table.add_column(col, justify="left" if col == "case" else "right")
    rows: dict[str, list[dict[str, object]]] = {case: [] for case in FIRST_CASES}
    for _ in range(reps):
        for case in FIRST_CASES:
            res = subprocess.run([sys.executable, __file__, "--first-run", case, "--devices", str(devices)],
                                 capture_output=True, text=True, timeout=600)
            line = next((x for x in res.stdout.splitlines() if x.startswith("ROW ")), None)
            if line is None:
                console.print(f"{case}: failed\n{res.stderr[-2000:]}")
                continue
            rows[case].append(json.loads(line[4:]))

    def best(rs: list[dict[str, object]], k: str, fn: Callable[[list[float]], float] = min) -> str:
        got = [float(r[k]) for r in rs if r.get(k) is not None]  # type: ignore[arg-type]
        return f"{fn(got):.2f}" if got else "-"

    median: Callable[[list[float]], float] = lambda xs: float(np.median(xs))  # noqa: E731
    for case, title in FIRST_CASES.items():
        rs = rows[case]
        if not rs:
            continue
        reused = sum(bool(r["reused"]) for r in rs)
        table.add_row(f"{title} (x{len(rs)})", best(rs, "up"), best(rs, "warm"), best(rs, "compile"), best(rs, "run"),
                      best(rs, "began"), best(rs, "imports"), best(rs, "cpu", median), best(rs, "driver_cpu", median),
                      f"{reused} of {len(rs)}", best(rs, "second"))
    console.print(table)
    threads = [float(r["threads_run"]) for r in rows["cold"] if "threads_run" in r]  # type: ignore[arg-type]
    if threads:
        console.print(f"the threads backend's first run of the block (a fresh process: it imports torch for the "
                      f"attention), best of {len(threads)}: {min(threads):.2f} s")


def main() -> None:
    import ray
    from threadpoolctl import threadpool_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--first-run", choices=sorted(FIRST_CASES), help="internal: one first-run case")
    ap.add_argument("--no-first-run", action="store_true", help="skip the first-run table (fresh Rays, slow)")
    ap.add_argument("--first-run-reps", type=int, default=3, help="fresh processes per first-run case (best of)")
    ap.add_argument("--only-first-run", action="store_true", help="the first-run table alone")
    args = ap.parse_args()
    if args.first_run:
        _first_run_case(args.first_run, args.devices)
        return
    console = Console(width=200)
    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i.get('threading_layer', '?')})"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    console.print(f"Ray {ray.__version__}; BLAS: {blas}; devices {args.devices}")
    if not args.no_first_run:
        _first_runs(console, args.devices, args.first_run_reps)
    if args.only_first_run:
        return
    table = Table(title=f"threads vs ray backend, same task graph (wall: best of {args.reps}, CPU: median, the "
                        f"backends alternating by round; goal: LLaMA block ray / threads <= 2.0). ray, no channel: "
                        f"RayBackend(channels=False), every move through Ray's object store")
    for col in ("case", "devices", "tasks", "moves", "threads (s)", "ray (s)", "ray / threads",
                "ray, no channel / threads", "threads CPU (ms)", "ray driver CPU (ms)", "ray actors' CPU (ms)",
                "threads per task (ms)", "ray per task (ms)", "ray extra per task (ms)", "bytes moved"):
        table.add_column(col, justify="left" if col == "case" else "right")
    from einjoin.runtime.backends.ray import RayBackend
    rays = {"ray": RayBackend(quiet=True), "ray, no channel": RayBackend(quiet=True, channels=False)}
    for name, (make, devices) in CASES.items():
        out = make()
        feeds = _feeds(out)
        devices = devices or args.devices
        backends: dict[str, object] = {"threads": "threads", **rays}
        progs = {k: ej.compile(out, devices=devices, backend=b, planner="eindecomp", quiet=True)
                 for k, b in backends.items()}
        want = progs["threads"].run(**feeds)
        for k in rays:
            np.testing.assert_allclose(progs[k].run(**feeds), want, rtol=1e-5, atol=1e-6)
        got = _timed({k: (lambda p=p, f=feeds: p.run(**f)) for k, p in progs.items()}, args.reps, rays)
        times = {k: v[0] for k, v in got.items()}
        n = len(progs["ray"].taskgraph)
        moves = sum(t.kind.value == "move" for t in progs["ray"].taskgraph.tasks)
        table.add_row(name, str(devices), str(n), str(moves), f"{times['threads']:.4f}", f"{times['ray']:.4f}",
                      f"{times['ray'] / times['threads']:.2f}", f"{times['ray, no channel'] / times['threads']:.2f}",
                      f"{got['threads'][1] * 1e3:.1f}", f"{got['ray'][1] * 1e3:.1f}", f"{got['ray'][2] * 1e3:.1f}",
                      f"{times['threads'] / n * 1e3:.3f}", f"{times['ray'] / n * 1e3:.3f}",
                      f"{(times['ray'] - times['threads']) / n * 1e3:.3f}", str(progs["ray"].run_stats.bytes_moved))
    for b in rays.values():
        b.close()
    console.print(table)


if __name__ == "__main__":
    main()
