"""Plan quality: bytes moved by every planner on a suite of cases x device counts, next to the
lower bound, plus the planning time of a 32-layer LLaMA-7B forward graph.

    make bench            (or: .venv/bin/python bench/plan_quality.py [--quick])

Bytes are the cost model's (einjoin.planner.cost.model_cost), the quantity every planner is
judged by; for placed plans the runtime's exchange moves what einjoin.planner.exact.plan_bytes says.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

import einjoin as ej
from einjoin.models.graphs import chain, llama_layers, matmul
from einjoin.planner import PLANNERS
from einjoin.planner.bounds import node_bound_bytes
from einjoin.planner.cost import model_cost
from einjoin.plan.stats import human_bytes


def attention(b: int = 1, h: int = 32, s: int = 2048, d: int = 128) -> ej.Tensor:
    q, k, v = (ej.input(n, (b, h, s, d)) for n in "qkv")
    return ej.attention(q, k, v, causal=True)


CASES = {
    "square matmul 8192^3": lambda: matmul(8192, 8192, 8192),
    "tall-skinny 65536x4096.4096x4096": lambda: matmul(65536, 4096, 4096),
    "MLP up 16384x4096.4096x16384": lambda: matmul(16384, 4096, 16384),
    "MLP down 16384x16384.16384x4096": lambda: matmul(16384, 16384, 4096),
    "chain A.B.C 4096": lambda: chain(4096, 3),
    "attention b1 h32 s2048 d128": attention,
    "LLaMA-7B block s2048 b1": lambda: llama_layers(1, batch=1),
    "LLaMA-7B block s2048 b8": lambda: llama_layers(1, batch=8),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="P in {2, 8} and no 32-layer timing")
    args = ap.parse_args()
    console = Console(width=160)
    devices = [2, 8] if args.quick else [2, 4, 8, 16, 64]
    planners = [n for n in sorted(PLANNERS) if n not in ("auto", "single", "exhaustive")]
    baselines = [n for n in planners if n != "eindecomp"]
    table = Table(title="bytes moved per planner (cost model); n/a = the baseline does not apply")
    for col in ["case", "P", *planners, "bound", "eindecomp / best baseline", "eindecomp / bound"]:
        table.add_column(col, justify="left" if col == "case" else "right")
    better: list[str] = []
    worse: list[str] = []
    for name, make in CASES.items():
        out = make()
        graph = ej.Graph(out)
        for p in devices:
            cluster = ej.local(p)
            costs: dict[str, int | None] = {}
            for planner in planners:
                try:
                    costs[planner] = model_cost(graph, cluster, PLANNERS[planner](graph, cluster))
                except ej.EinjoinError:
                    costs[planner] = None
            bound = sum(node_bound_bytes(n, p) or 0 for n in graph.ops)
            ours = costs["eindecomp"]
            base = [c for b, c in costs.items() if b in baselines and c is not None]
            best = min(base) if base else None
            ratio = f"{ours / best:.2f}" if best else ("-" if best is None else "0 = 0")
            if best is not None and ours is not None:
                if ours < best:
                    better.append(f"{name} P={p}: {ours / best:.2f}x of the best baseline")
                elif ours > best:
                    worse.append(f"{name} P={p}: {ours / best:.2f}x of the best baseline")
            table.add_row(name, str(p), *[human_bytes(costs[pl]) if costs[pl] is not None else "n/a"
                                          for pl in planners],
                          human_bytes(bound) if bound else "n/a", ratio,
                          f"{ours / bound:.2f}" if bound and ours is not None else "n/a")
    console.print(table)
    console.print("[bold]eindecomp strictly better than every baseline:[/]")
    for line in better or ["(none)"]:
        console.print("  " + line)
    console.print("[bold]eindecomp worse than the best baseline:[/]")
    for line in worse or ["(none)"]:
        console.print("  " + line)
    if not args.quick:
        graph = ej.Graph(llama_layers(32))
        for p in (8, 64):
            t0 = time.perf_counter()
            PLANNERS["eindecomp"](graph, ej.local(p))
            console.print(f"planning a 32-layer LLaMA-7B forward graph ({len(graph.ops)} ops) with "
                          f"eindecomp at P={p}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
