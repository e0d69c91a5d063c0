"""The same plan on the ``threads`` backend and on ``ray`` (2 devices, a local Ray), for an MLP
and a LLaMA block: time per run (best of ``--reps`` after a warm-up), the ratio, and Ray's
per-task overhead = (ray time - threads time) / tasks.

    make bench            (or: .venv/bin/python bench/ray_exec.py [--reps 5])

Both programs are compiled from one graph with the same planner and placement, so they run the
identical task graph; outputs are checked equal. The BLAS library in use is printed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

import einjoin as ej
from einjoin.models.graphs import llama_layers, mlp

CASES = {
    "MLP relu(x@W1)@W2, x 2048x512, W1 512x2048": lambda: mlp(2048, 512, 2048),
    "LLaMA block b1 s256 d512 h8 ffn 1376": lambda: llama_layers(1, batch=1, seq=256, d=512, heads=8,
                                                                 hidden=1376),
}


def _feeds(out: ej.Tensor) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {x.op.name: (rng.standard_normal(x.shape) * 0.05).astype(np.float32)
            for x in ej.Graph(out).inputs}


def _best(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import ray
    from threadpoolctl import threadpool_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    console = Console(width=150)
    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i.get('threading_layer', '?')})"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    console.print(f"Ray {ray.__version__}; BLAS: {blas}; devices {args.devices}")
    table = Table(title=f"threads vs ray backend, same task graph, {args.devices} devices "
                        f"(best of {args.reps})")
    for col in ("case", "tasks", "threads (s)", "ray (s)", "ray / threads", "ray overhead per task (ms)",
                "bytes moved"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, make in CASES.items():
        out = make()
        feeds = _feeds(out)
        progs = {b: ej.compile(out, devices=args.devices, backend=b, planner="eindecomp", quiet=True)
                 for b in ("threads", "ray")}
        a = progs["threads"].run(**feeds)
        b = progs["ray"].run(**feeds)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        times = {k: _best(lambda p=p, f=feeds: p.run(**f), args.reps) for k, p in progs.items()}
        n = len(progs["ray"].taskgraph)
        table.add_row(name, str(n), f"{times['threads']:.4f}", f"{times['ray']:.4f}",
                      f"{times['ray'] / times['threads']:.2f}",
                      f"{(times['ray'] - times['threads']) / n * 1e3:.3f}",
                      str(progs["ray"].run_stats.bytes_moved))
        progs["ray"].close()
    console.print(table)


if __name__ == "__main__":
    main()
