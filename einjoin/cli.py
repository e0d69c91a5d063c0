"""Command line: ``einjoin demo`` (what ``make demo`` runs; see :mod:`einjoin.demo`),
``einjoin plan MODEL --devices N`` (the models of :mod:`einjoin.models.graphs`) and
``einjoin torch-ops``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any
from collections.abc import Sequence

import einjoin as ej

__all__ = ["main"]

# --help is read in a terminal: plain text here, not the module docstring's reST
DESCRIPTION = """\
einjoin runs einsum programs, PyTorch-like code and torch modules across many devices:
every op is a join-aggregation over blocks, planned to move as few bytes as it can."""
EPILOG = """\
examples:
  einjoin demo --devices 4          import a LLaMA block from torch, plan, run and verify it
  einjoin plan llama-block --devices 8 --planner eindecomp --planner megatron
  einjoin torch-ops > docs/torch_ops.md

'einjoin COMMAND --help' describes a command's options."""


def plan(model: str, devices: int, planners: Sequence[str], quiet: bool = False, **shape: Any) -> int:
    """Plan a built-in model with each planner; print bytes (the cost model's), ratios to the best
    planner and to the sum of per-op lower bounds, and planning time."""
    from rich.console import Console
    from rich.table import Table

    from einjoin.models import build
    from einjoin.planner import PLANNERS
    from einjoin.planner.bounds import node_bound_bytes
    from einjoin.planner.cost import model_cost
    from einjoin.plan.stats import human_bytes

    console = Console(quiet=quiet, width=None if sys.stdout.isatty() else 120)
    out = build(model, **{k: v for k, v in shape.items() if v is not None})
    graph = ej.Graph(out)
    cluster = ej.local(devices)
    bound = sum(node_bound_bytes(n, devices) or 0 for n in graph.ops)
    rows: list[tuple[str, int | None, float, str]] = []
    for name in planners:
        if name not in PLANNERS:
            console.print(f"unknown planner {name!r}; known: {', '.join(sorted(PLANNERS))}")
            return 2
        t0 = time.perf_counter()
        try:
            with console.status(f"planning with {name}...", spinner="dots"):
                specs = PLANNERS[name](graph, cluster)
        except ej.EinjoinError as e:  # a baseline that does not apply says why
            rows.append((name, None, time.perf_counter() - t0, str(e)))
            continue
        rows.append((name, model_cost(graph, cluster, specs), time.perf_counter() - t0, ""))
    best = min((r[1] for r in rows if r[1] is not None), default=None)
    table = Table(title=f"{model}: {len(graph.ops)} ops on {devices} devices "
                        f"(sum of per-op lower bounds {human_bytes(bound)})")
    for col in ("planner", "bytes moved", "/ best", "/ bound", "planning (s)", "note"):
        table.add_column(col, justify="left" if col in ("planner", "note") else "right")
    for name, cost, t, note in rows:
        if cost is None:
            table.add_row(name, "n/a", "", "", f"{t:.2f}", note)  # whole: it says why
        else:
            table.add_row(name, human_bytes(cost), f"{cost / best:.2f}" if best else "-",
                          f"{cost / bound:.2f}" if bound else "n/a", f"{t:.2f}", note)
    console.print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="einjoin", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=raw)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="import a LLaMA block from torch, plan, run and verify it",
                       description="Import a LLaMA-style block from torch, plan it for several "
                                   "devices, run it, check the result against torch, and write "
                                   "plan.png and trace.json.")
    d.add_argument("--quiet", action="store_true", help="print less")
    d.add_argument("--devices", type=int, default=4, help="how many local devices (default: 4)")
    d.add_argument("--out", default=".", help="where plan.png and trace.json go (default: here)")
    p = sub.add_parser("plan", help="plan a built-in model with every planner and compare",
                       description="Plan a built-in model with each planner and print the bytes each "
                                   "plan moves, against the best plan and the sum of per-op lower "
                                   "bounds. A planner that does not apply says why.")
    p.add_argument("model", help="matmul, chain, mlp, llama-block or llama-7b-layers")
    p.add_argument("--devices", type=int, default=8, help="how many devices (default: 8)")
    p.add_argument("--planner", action="append", help="a planner to compare; repeat for several "
                                                      "(default: all)")
    p.add_argument("--layers", type=int, help="layers (llama models)")
    p.add_argument("--seq", type=int, help="sequence length (llama models)")
    p.add_argument("--batch", type=int, help="batch size (llama models)")
    sub.add_parser("torch-ops", help="print the torch ops ej.from_torch translates (Markdown)",
                   description="Print the page docs/torch_ops.md: every torch op, function, tensor "
                               "method and nn module that ej.from_torch translates, generated from "
                               "the op table, with each translation's node kinds, the dims the "
                               "planner may split and whether it has a gradient.")
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except ej.EinjoinError as e:  # a user's mistake (unknown model, 0 devices): a line, no traceback
        print(f"einjoin {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.cmd == "demo":
        from einjoin.demo import demo
        return demo(args.quiet, args.devices, args.out)
    if args.cmd == "plan":
        from einjoin.planner import PLANNERS
        names = args.planner or [n for n in sorted(PLANNERS) if n not in ("auto", "exhaustive", "single")]
        shape = {"layers": args.layers, "seq": args.seq, "batch": args.batch}
        if args.model in ("matmul", "chain", "mlp") and any(shape.values()):
            parser.error("--layers/--seq/--batch apply to the llama models")
        return plan(args.model, args.devices, names, **(shape if args.model.startswith("llama") else {}))
    if args.cmd == "torch-ops":
        from einjoin.frontend.torch import ops_markdown
        sys.stdout.write(ops_markdown())
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
