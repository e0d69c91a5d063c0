"""A/B of the small LLaMA training step's graph, in one process: the step as ``ej.Trainer`` builds
it (A) against the same step built or run another way (B), both from the same weights and batches.

Printed: graph nodes, tasks and kernel tasks per step of each; CPU per step (process time, every
thread) of each in alternating rounds of 5 steps (the order of A and B swapped every round),
medians and their ratio; the largest relative difference of their losses. CPU time in one process
against a baseline measured beside it: on a shared machine wall time is noise.

Variants (``--variant``):

* ``nofuse``: B compiled with ``fuse=False`` (what the fusion pass buys; losses bit-identical);
* ``order=lifo`` / ``order=priority``: B runs the same plan with another ready-queue order;
* ``--patch FILE``: a Python file with ``apply() -> undo``: B is built while the patch holds (a
  graph pass tried out before it is built into einjoin: measure which pays before building).

Measured on 2026-12-07 (a 2-core box shared with other work, load 2-10):
``--variant nofuse``: 500 -> 331 nodes, 1853 -> 1149 tasks, 755 -> 443 kernel tasks; CPU per step
67.0 -> 61.8 ms (8 rounds) and 57.7 -> 54.9 ms (4 rounds), i.e. ~4-7 us per task or ~9-17 us
per kernel task removed, the passes fusion saves included: at that rate removing the ~50
reshape/transpose tasks would save ~0.5 ms of ~50. A patch inlining every elementwise producer
read once into a one-input sum (RMSNorm's ``x * x`` into its ``sum``; it changes bits, so it is
not in ``ir/fuse.py``): 1149 -> 1125 tasks, B/A 1.005 and 0.989, no gain. ``order=lifo``: B/A
0.965-1.018 over five runs, inside the noise.

Run ``.venv/bin/python bench/graph_ab.py --variant nofuse --rounds 8``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import einjoin as ej
import einjoin.trainer as trainer_module

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train import llama_case  # noqa: E402  (the same model, batches and loss)


def _nofuse() -> Callable[[], None]:
    """ej.compile as the Trainer calls it, with ``fuse=False``."""
    names = trainer_module.__dict__  # the name the Trainer calls
    orig = names["ej_compile"]

    def compile_unfused(*args: Any, **kw: Any) -> Any:
        kw["fuse"] = False
        return orig(*args, **kw)

    names["ej_compile"] = compile_unfused

    def undo() -> None:
        names["ej_compile"] = orig
    return undo


def _patch(path: str) -> Callable[[], Callable[[], None]]:
    spec = importlib.util.spec_from_file_location("graph_ab_patch", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--patch {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    apply: Callable[[], Callable[[], None]] = mod.apply
    return apply


def _sizes(t: Any) -> tuple[int, int, int]:
    """(graph nodes, tasks, kernel tasks) of a trainer's step program."""
    tg = t.program.taskgraph
    return len(t.program.graph.nodes), len(tg.tasks), sum(1 for x in tg.tasks if x.kind.name == "KERNEL")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default="nofuse", help="nofuse, order=lifo, order=priority or order=fifo")
    ap.add_argument("--patch", default=None, help="a Python file with apply() -> undo, held while B is built")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds of 5 steps each")
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()

    _, module, batches, loss_fn = llama_case()
    module_b = copy.deepcopy(module)

    def build(m: Any) -> Any:
        return ej.Trainer(m, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3),
                          devices=ej.local(args.devices), backend="threads")

    a = build(module)
    order = None
    if args.patch is not None:
        undo = _patch(args.patch)()
        label = f"--patch {args.patch}"
    elif args.variant == "nofuse":
        undo = _nofuse()
        label = "fuse=False"
    elif args.variant.startswith("order="):
        order = args.variant.split("=", 1)[1]
        undo = lambda: None  # noqa: E731
        label = f"ready-queue order {order}"
    else:
        raise SystemExit(f"unknown --variant {args.variant!r}")
    try:
        b = build(module_b)
    finally:
        undo()
    if order is not None:
        b.program.order = order
    for name, t in (("A (as built)", a), (f"B ({label})", b)):
        nodes, tasks, kernels = _sizes(t)
        print(f"{name}: {nodes} graph nodes, {tasks} tasks, {kernels} kernel tasks per step")

    losses: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    wall: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(3):  # warm-up, the same batches for both
        losses["A"].append(a.step(*batches[i % len(batches)]))
        losses["B"].append(b.step(*batches[i % len(batches)]))
    for r in range(args.rounds):
        pair = (("A", a), ("B", b)) if r % 2 == 0 else (("B", b), ("A", a))
        for key, t in pair:
            for i in range(5):
                batch = batches[(3 + 5 * r + i) % len(batches)]
                c0, w0 = time.process_time(), time.perf_counter()
                losses[key].append(t.step(*batch))
                cpu[key].append(time.process_time() - c0)
                wall[key].append(time.perf_counter() - w0)
    ma, mb = statistics.median(cpu["A"]), statistics.median(cpu["B"])
    print(f"CPU per step, median of {len(cpu['A'])}: A {ma * 1e3:.2f} ms, B {mb * 1e3:.2f} ms, B/A {mb / ma:.3f}")
    wa, wb = statistics.median(wall["A"]), statistics.median(wall["B"])
    print(f"wall per step (noise on a shared machine): A {wa * 1e3:.2f} ms, B {wb * 1e3:.2f} ms, B/A {wb / wa:.3f}")
    rel = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(losses["A"], losses["B"]))
    print(f"losses: largest relative difference {rel:.2e}" + (" (identical)" if losses["A"] == losses["B"] else ""))


if __name__ == "__main__":
    main()
