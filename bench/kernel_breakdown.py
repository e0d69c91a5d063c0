"""Where the kernels' own CPU goes in bench/train.py's small LLaMA step (``ej.Trainer`` with AdamW
on ``ej.local(P)``, threads backend): every prepared kernel (:mod:`einjoin.runtime.fastkernels`,
which the local runtime calls directly, bypassing ``compute``, so ``train_profile.py
--breakdown`` no longer sees it) wrapped with ``time.thread_time`` around the call alone, summed
per kind (an einsum by its route: matmul, join, einsum) and per (kind, equation), with the calls
per step; then the same calls repeated on copies of their blocks, "hot" (their inputs and
temporaries in cache, one thread, BLAS and torch on one thread each). Then, over as many more
steps, each kernel called a second time in the step right after its timed call, on the same
blocks ("again": its inputs now in cache, the other device still running); and steps whose
prepared kernels return the block they computed in an earlier step (computing nothing): the
runtime's own CPU per step (engine, stores, the tasks without a prepared kernel, the Trainer's
main-thread work), and that of the main thread alone (serial: before and after the workers).

In-step minus again is what cold inputs cost the kernels; again minus hot, the rest of running
inside a step (fresh output buffers, caches and predictors shared with the other kernels and the
other device's thread).

Run ``.venv/bin/python bench/kernel_breakdown.py --steps 10 --top 25``.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import threading
import time
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

import einjoin as ej
import einjoin.runtime.fastkernels as fastkernels
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.kernels import matmul_route

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train import llama_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--devices", type=int, default=2, help="devices the step runs on (every one: leave_idle=False)")
    ap.add_argument("--top", type=int, default=25, help="rows of the per-equation table")
    args = ap.parse_args()

    spent: dict[tuple[str, str], float] = collections.defaultdict(float)
    again: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    blocks: dict[tuple[int, int], tuple[Any, tuple[str, str], list[Any]]] = {}
    lock = threading.Lock()
    on = [""]  # "": not timed; "time": the in-step times; "again": and a second call; "fake": recorded blocks
    made: dict[tuple[int, int], Any] = {}
    prepare = fastkernels.prepare_kernels

    def timed_prepare(tg: Any, decomps: Any) -> Any:
        fast = prepare(tg, decomps)
        for t in tg.tasks:
            f = fast[t.id]
            if f is None:
                continue
            kind = type(t.node.op).__name__
            if kind == "Einsum":
                kind += "/" + matmul_route(t.node.op, [np.dtype(numpy_dtype(tg.values[r].dtype)) for r in t.reads]).path
            key = (kind, str(getattr(t.node.op, "equation", "")))

            def run(bs: Any, f: Any = f, key: tuple[str, str] = key, tid: tuple[int, int] = (id(tg), t.id)) -> Any:
                if not on[0]:
                    return f(bs)
                if on[0] == "fake":
                    return made[tid] if tid in made else f(bs)
                c = time.thread_time()
                z = f(bs)
                d = time.thread_time() - c
                if on[0] == "again":
                    c = time.thread_time()
                    f(bs)
                    with lock:
                        again[key] += time.thread_time() - c
                    return z
                with lock:
                    spent[key] += d
                    calls[key] += 1
                    made[tid] = z
                    if tid not in blocks:
                        blocks[tid] = (f, key, [b.copy() if isinstance(b, np.ndarray) else b for b in bs])
                return z
            fast[t.id] = run
        return fast

    fastkernels.prepare_kernels = timed_prepare  # the engine imports it when it prepares
    try:
        _, module, batches, loss_fn = llama_case()
        tr = ej.Trainer(module, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3),
                        devices=ej.local(args.devices), backend="threads", leave_idle=False)
        for i in range(3):
            tr.step(*batches[i % len(batches)])
        on[0] = "time"
        c0 = time.process_time()
        for i in range(args.steps):
            tr.step(*batches[i % len(batches)])
        per_step = (time.process_time() - c0) / args.steps
        on[0] = "again"
        for i in range(args.steps):
            tr.step(*batches[i % len(batches)])
        on[0] = "fake"
        c0, m0 = time.process_time(), time.thread_time()
        for i in range(args.steps):
            tr.step(*batches[i % len(batches)])
        runtime, main_thread = ((now - then) / args.steps for now, then in
                                ((time.process_time(), c0), (time.thread_time(), m0)))
        on[0] = ""
    finally:
        fastkernels.prepare_kernels = prepare

    hot: dict[tuple[str, str], float] = collections.defaultdict(float)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1, user_api="blas"), np.errstate(all="ignore"):
            for f, key, bs in blocks.values():
                f(bs)
                c = time.thread_time()
                for _ in range(5):
                    f(bs)
                hot[key] += (time.thread_time() - c) / 5
    finally:
        torch.set_num_threads(threads)

    n = args.steps
    print(f"process CPU per step {per_step * 1e3:.1f} ms; prepared kernels' own CPU in the step "
          f"{sum(spent.values()) / n * 1e3:.1f} ms in {sum(calls.values()) / n:.0f} calls; the same calls hot "
          f"{sum(hot.values()) * 1e3:.1f} ms, called again in the step {sum(again.values()) / n * 1e3:.1f} ms")
    print(f"the runtime without the prepared kernels' work: {runtime * 1e3:.1f} ms process CPU per step, "
          f"{main_thread * 1e3:.1f} ms of it on the main thread")
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for key, s in spent.items():
        kinds[key[0]][0] += s / n
        kinds[key[0]][1] += again[key] / n
        kinds[key[0]][2] += hot[key]
    print("per kind: in-step, again, hot (ms/step)")
    for kind, (s, a, h) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {s * 1e3:6.2f} {a * 1e3:6.2f} {h * 1e3:6.2f}  {kind}")
    print("per (kind, equation): in-step, again, hot (ms/step), calls/step")
    for key in sorted(spent, key=lambda k: -spent[k])[:args.top]:
        print(f"  {spent[key] / n * 1e3:6.2f} {again[key] / n * 1e3:6.2f} {hot[key] * 1e3:6.2f} {calls[key] / n:4.0f}"
              f"  {key[0]:14s} {key[1]}")


if __name__ == "__main__":
    main()
