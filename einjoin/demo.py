"""``einjoin demo`` (what ``make demo`` runs): a LLaMA block written in plain torch, imported with
``ej.from_torch``, planned for 4 local devices, run on the threads backend, checked against torch.

Steps: trace the zoo's LLaMA block (random weights); plan it with eindecomp and compare the bytes
it moves with the data-parallel and Megatron plans and the sum of per-op lower bounds; compile and
print the per-op plan; run it and compare with torch eager (error and time); write ``plan.png``
and ``trace.json`` into ``out_dir`` and say where they are.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

__all__ = ["demo"]

CONFIG = dict(dim=256, heads=8, kv_heads=4, hidden=688, seq=128, batch=4)


def _best_of(fn: Callable[[], Any], repeat: int) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def demo(quiet: bool = False, devices: int = 4, out_dir: str | os.PathLike[str] = ".") -> int:
    import torch
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    import einjoin as ej
    from einjoin.models.zoo import LlamaConfig, example
    from einjoin.planner import PLANNERS
    from einjoin.planner.bounds import node_bound_bytes
    from einjoin.planner.cost import model_cost
    from einjoin.plan.stats import human_bytes

    console = Console(quiet=quiet, width=None if sys.stdout.isatty() else 130)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    module, args = example("llama-block", **CONFIG)
    c = replace(LlamaConfig(), **CONFIG)  # the block's config, as example() builds it
    console.print(f"[bold]einjoin demo[/]: the zoo's LLaMA block in plain torch (batch {c.batch}, seq "
                  f"{c.seq}, dim {c.dim}, {c.heads} heads / {c.kv_heads} kv heads, SwiGLU {c.hidden}), "
                  f"random weights, on {devices} local devices")
    t0 = time.perf_counter()
    fn = ej.from_torch(module, args)
    graph = ej.Graph(list(fn.outputs))
    console.print(f"ej.from_torch: torch.export -> {len(graph.ops)} einjoin ops over "
                  f"{len(graph.inputs)} inputs ({len(fn.bound)} bound parameters/buffers) in "
                  f"{time.perf_counter() - t0:.2f} s")

    # the plan next to what a user would otherwise pick
    cluster = ej.local(devices)
    bound = sum(node_bound_bytes(n, devices) or 0 for n in graph.ops)
    table = Table(title=f"bytes moved on {devices} devices (cost model; bound = sum of per-op lower bounds "
                        f"{human_bytes(bound)})")
    for col in ("planner", "bytes moved", "/ eindecomp", "/ bound", "planning (s)"):
        table.add_column(col, justify="left" if col == "planner" else "right")
    costs: dict[str, int | None] = {}
    plans: dict[str, Any] = {}
    for name in ("eindecomp", "data_parallel", "megatron"):
        t0 = time.perf_counter()
        try:
            plans[name] = PLANNERS[name](graph, cluster)
            costs[name] = model_cost(graph, cluster, plans[name])
        except ej.EinjoinError:
            costs[name] = None  # the baseline does not apply to this graph
        dt = time.perf_counter() - t0
        cost, best = costs[name], costs["eindecomp"]
        table.add_row(name, "n/a" if cost is None else human_bytes(cost),
                      "" if cost is None or not best else f"{cost / best:.2f}",
                      "" if cost is None or not bound else f"{cost / bound:.2f}", f"{dt:.2f}")
    console.print(table)

    # the eindecomp plan just made (a planner is any function of graph and cluster)
    prog = ej.compile(fn, devices=devices, planner=lambda g, cl: plans["eindecomp"], backend="threads")
    console.print(escape(prog.explain(file=None)), soft_wrap=True)

    x = args[0]
    with torch.no_grad():
        expected, t_torch = _best_of(lambda: module(x), 3)
    got, t_ej = _best_of(lambda: prog.run(x), 3)
    trace_path = out_dir / "trace.json"
    png_path = out_dir / "plan.png"
    prog.run(x, trace=trace_path)
    prog.save_plan_png(png_path)
    err = float((got - expected).abs().max())
    rel = err / max(float(expected.abs().max()), 1e-30)
    measured = prog.run_stats
    assert measured is not None  # set by the runs above
    ok = (err < 1e-3 and rel < 1e-4 and measured.bytes_moved == prog.stats.bytes_moved)
    console.print(f"[bold]run[/] (threads backend, {devices} devices): {t_ej * 1e3:.1f} ms; torch eager "
                  f"{t_torch * 1e3:.1f} ms (ratio {t_ej / t_torch:.2f}; on one CPU the devices share "
                  f"{os.cpu_count()} cores, so this shows overhead, not speedup)")
    console.print(f"moved {human_bytes(measured.bytes_moved)} between devices (plan: "
                  f"{human_bytes(prog.stats.bytes_moved)}); peak per device "
                  f"{human_bytes(max(measured.peak_bytes_per_device.values()))}")
    console.print(f"wrote {png_path.resolve()} (specs and device grids per op) and "
                  f"{trace_path.resolve()} (open in https://ui.perfetto.dev or chrome://tracing)")
    console.print(f"[bold]verification[/]: einjoin == torch within float32 tolerance: "
                  f"{'OK' if ok else 'MISMATCH'} (max abs err {err:.2e}, max rel err {rel:.2e})")
    return 0 if ok else 1
