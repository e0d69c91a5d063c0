"""Where a training step's CPU time goes: bench/train.py's small LLaMA step (``ej.Trainer`` on
``ej.local(P)``, threads backend) against torch's on one thread, in CPU time, in one process.

CPU time, not wall time: on a shared machine wall time is noise, CPU time hardly moves with other
processes' load (except where a BLAS pool spins waiting for a descheduled thread: run the one-device
case on a quiet machine). Printed:

* einjoin's process CPU per step (every thread) and torch's on one thread (its work), measured in
  alternating rounds of 5 steps, medians, and their ratio; the step's task graph: tasks per kind
  (frees included) and the plan's modelled bytes moved;
* with ``--breakdown``: the thread CPU of every computing task (``time.thread_time`` around
  :func:`einjoin.plan.execute.compute` as the local runtime calls it: with it wrapped, every
  task goes through it), per task kind and per (task kind, op kind, equation), the tasks per
  step, and what is left outside them (the runtime's dispatch, the Trainer's feeds and state);
* with ``--glue``: the runtime's own CPU per step, with no instrument inside it: steps in which
  every prepared kernel returns the block it computed last at once (its numpy / torch work
  left out, everything else as it is: dispatch, stores, loads, selects, moves, reduces, frees,
  the Trainer's feeds and state), alternating with real steps in one process; the difference is
  the kernels' own work.

Run ``.venv/bin/python bench/train_profile.py --breakdown --glue`` (``--devices 1`` for one device).
"""

from __future__ import annotations

import argparse
import collections
import copy
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

import torch

import einjoin as ej
import einjoin.runtime.local as local_runtime

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train import llama_case  # noqa: E402  (the same model, batches and loss)


def step_cpu(trainer: Any, torch_step: Any, batches: Any, rounds: int) -> tuple[list[float], list[float]]:
    """(einjoin's process CPU seconds per step, torch's on one thread), in alternating rounds."""
    ours: list[float] = []
    theirs: list[float] = []
    threads = torch.get_num_threads()
    for _ in range(rounds):
        for i in range(5):
            b = batches[i % len(batches)]
            c0 = time.process_time()
            trainer.step(*b)
            ours.append(time.process_time() - c0)
        torch.set_num_threads(1)
        try:
            for i in range(5):
                b = batches[i % len(batches)]
                c0 = time.process_time()
                torch_step(*b)
                theirs.append(time.process_time() - c0)
        finally:
            torch.set_num_threads(threads)
    return ours, theirs


def breakdown(trainer: Any, batches: Any, steps: int) -> tuple[float, dict[tuple[str, str, str], list[float]]]:
    """(process CPU seconds per step, {(task kind, op kind, equation): [CPU seconds, tasks] per
    step}) over ``steps`` steps with every computing task timed on its thread."""
    orig = local_runtime.__dict__["compute"]  # the name the local runtime calls
    acc: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    lock = threading.Lock()  # the device threads add to the same entries

    def timed(t: Any, *args: Any) -> Any:
        c0 = time.thread_time()
        out = orig(t, *args)
        cpu = time.thread_time() - c0
        op = t.node.op
        with lock:
            e = acc[(t.kind.name, type(op).__name__, str(getattr(op, "equation", "")))]
            e[0] += cpu
            e[1] += 1
        return out

    local_runtime.__dict__["compute"] = timed
    try:
        c0 = time.process_time()
        for i in range(steps):
            trainer.step(*batches[i % len(batches)])
        total = (time.process_time() - c0) / steps
    finally:
        local_runtime.__dict__["compute"] = orig
    return total, {k: [v[0] / steps, v[1] / steps] for k, v in acc.items()}


def glue(trainer: Any, batches: Any, rounds: int) -> tuple[float, float, int]:
    """(process CPU seconds per real step, per step whose prepared kernels return their last
    block at once, prepared kernels per step), medians over ``rounds`` alternating rounds of
    5 steps each."""
    fast = trainer.program._engine.fast_kernels()
    kept = list(fast)
    last: dict[int, Any] = {}

    def keep(i: int, f: Any) -> Any:
        def run(blocks: Any) -> Any:
            last[i] = out = f(blocks)
            return out
        return run

    fast[:] = [f if f is None else keep(i, f) for i, f in enumerate(kept)]
    try:
        trainer.step(*batches[0])
        canned = [None if f is None else (lambda blocks, out=last[i]: out) for i, f in enumerate(kept)]
        full: list[float] = []
        bare: list[float] = []
        for _ in range(rounds):
            for kernels, into in ((kept, full), (canned, bare)):
                fast[:] = kernels
                for i in range(5):
                    c0 = time.process_time()
                    trainer.step(*batches[i % len(batches)])
                    into.append(time.process_time() - c0)
    finally:
        fast[:] = kept
    return statistics.median(full), statistics.median(bare), sum(f is not None for f in kept)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of 5 steps per column")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel CPU of the einjoin step")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--glue", action="store_true", help="the runtime's own CPU: steps without the kernels' work")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.devices)
    _, module, batches, loss_fn = llama_case()
    reference = copy.deepcopy(module).train()
    trainer = ej.Trainer(module, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3),
                         devices=ej.local(args.devices), backend="threads")
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)

    def torch_step(*b: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(reference(*b[:-1]), b[-1]).backward()
        opt.step()

    for i in range(3):  # warm-up: the first step loads the state
        trainer.step(*batches[i % len(batches)])
        torch_step(*batches[i % len(batches)])
    ours, theirs = step_cpu(trainer, torch_step, batches, args.rounds)
    e, t = statistics.median(ours), statistics.median(theirs)
    print(f"small LLaMA step, CPU per step (median of {len(ours)}): einjoin local({args.devices}) "
          f"{e * 1e3:.1f} ms ({len(trainer.program.graph.ops)} ops), torch 1 thread {t * 1e3:.1f} ms: "
          f"{e / t:.2f}x")
    kinds_tg = collections.Counter(t.kind.name.lower() for t in trainer.program.taskgraph.tasks)
    print(f"task graph of a step: {sum(kinds_tg.values())} tasks ("
          + ", ".join(f"{k} {n}" for k, n in kinds_tg.most_common()) + f"), modelled bytes moved "
          f"{trainer.program.stats.bytes_moved}")
    if args.breakdown:
        total, acc = breakdown(trainer, batches, 5)
        inside = sum(v[0] for v in acc.values())
        print(f"timed steps: {total * 1e3:.1f} ms CPU per step, {inside * 1e3:.1f} ms in "
              f"{sum(v[1] for v in acc.values()):.0f} computing tasks, {(total - inside) * 1e3:.1f} ms "
              f"outside them (dispatch, frees, feeds, state)")
        kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for (kind, _, _), (cpu, n) in acc.items():
            kinds[kind][0] += cpu
            kinds[kind][1] += n
        for kind, (cpu, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"  {kind:8s} {cpu * 1e3:7.2f} ms {n:5.0f} tasks")
        for (kind, op, eq), (cpu, n) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {cpu * 1e3:7.2f} ms {n:5.0f}  {kind:7s} {op:13s} {eq}")
    if args.glue:
        full, bare, n = glue(trainer, batches, args.rounds)
        print(f"runtime's own CPU: {full * 1e3:.1f} ms per step, {bare * 1e3:.1f} ms with each of the {n} prepared "
              f"kernels returning its last block at once: the kernels' work {(full - bare) * 1e3:.1f} ms, the rest "
              f"(dispatch, stores, loads, selects, moves, reduces, frees, feeds, state) {bare * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
