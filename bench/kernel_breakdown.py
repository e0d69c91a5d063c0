"""Where the kernels' own CPU goes in bench/train.py's small LLaMA step (``ej.Trainer`` with AdamW
on ``ej.local(P)``, threads backend): every prepared kernel (:mod:`einjoin.runtime.fastkernels`,
which the local runtime calls directly, bypassing ``compute``, so ``train_profile.py
--breakdown`` no longer sees it) wrapped with ``time.thread_time`` around the call alone, summed
per kind (an einsum by its route: matmul, join, einsum) and per (kind, equation), with the calls
per step; then the same calls repeated on copies of their blocks, "hot" (their inputs and
temporaries in cache, one thread, BLAS and torch on one thread each).

In-step minus hot is what the step's memory traffic costs the kernels (cold inputs written by
another kernel, fresh output buffers): it is not the two device threads sharing the cores
(pinned to one core, the same in-step numbers).

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
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--top", type=int, default=25, help="rows of the per-equation table")
    args = ap.parse_args()

    spent: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    blocks: dict[tuple[int, int], tuple[Any, tuple[str, str], list[Any]]] = {}
    lock = threading.Lock()
    on = [False]
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
                c = time.thread_time()
                z = f(bs)
                d = time.thread_time() - c
                with lock:
                    spent[key] += d
                    calls[key] += 1
                    if tid not in blocks:
                        blocks[tid] = (f, key, [b.copy() if isinstance(b, np.ndarray) else b for b in bs])
                return z
            fast[t.id] = run
        return fast

    fastkernels.prepare_kernels = timed_prepare  # the engine imports it when it prepares
    try:
        _, module, batches, loss_fn = llama_case()
        tr = ej.Trainer(module, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3),
                        devices=ej.local(args.devices), backend="threads")
        for i in range(3):
            tr.step(*batches[i % len(batches)])
        on[0] = True
        c0 = time.process_time()
        for i in range(args.steps):
            tr.step(*batches[i % len(batches)])
        per_step = (time.process_time() - c0) / args.steps
        on[0] = False
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
          f"{sum(hot.values()) * 1e3:.1f} ms")
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for key, s in spent.items():
        kinds[key[0]][0] += s / n
        kinds[key[0]][1] += hot[key]
    print("per kind: in-step ms/step, hot ms/step")
    for kind, (s, h) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {s * 1e3:6.2f} {h * 1e3:6.2f}  {kind}")
    print("per (kind, equation): in-step ms/step, hot ms/step, calls/step")
    for key in sorted(spent, key=lambda k: -spent[k])[:args.top]:
        print(f"  {spent[key] / n * 1e3:6.2f} {hot[key] * 1e3:6.2f} {calls[key] / n:4.0f}  {key[0]:14s} {key[1]}")


if __name__ == "__main__":
    main()
