"""A picture of a simulated trace: the demo's LLaMA block (the zoo's, ``einjoin demo``'s config,
imported from torch) planned for one DGX A100 (8 GPUs, ``ej.Cluster.preset("dgx-a100")``) and
replayed by the event simulator; one row per GPU and lane (kernels, host transfers, moves between
GPUs), one box per task, coloured by kind. Every time in it is simulated.

    python examples/sim_trace_png.py [out.png [trace.json]]   (default: docs/sim_trace_dgx_a100.png)

Given a second path it also writes the Perfetto trace there (``sim.trace(path)``), which
https://ui.perfetto.dev opens.
"""

from __future__ import annotations

import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

import einjoin as ej
from einjoin.demo import CONFIG
from einjoin.models.zoo import example

LANES = ("kernels", "host", "moves")  # Simulation.lanes: 0 compute, 1 host transfers, 2 GPU to GPU
COLORS = {"kernel": "tab:blue", "reduce": "tab:cyan", "move": "tab:orange", "load": "tab:green",
          "writeback": "tab:olive",
          "select": "tab:purple", "fill": "tab:gray", "touch": "tab:brown", "free": "lightgray",
          "evict": "tab:red", "reload": "tab:pink"}


def main(out: str = "docs/sim_trace_dgx_a100.png", trace: str | None = None) -> Path:
    module, args = example("llama-block", **CONFIG)
    fn = ej.from_torch(module, args)
    prog = ej.compile(fn, devices=ej.Cluster.preset("dgx-a100"), backend="null", quiet=True)
    sim = prog.simulate()
    path = Path(out)
    if trace is not None:
        sim.trace(trace)
    rows = [(d, lane) for d in sorted(sim.intervals) for lane in range(len(LANES))]
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    fig = Figure(figsize=(10, 4.8), dpi=100)
    ax = fig.add_subplot()
    for d, iv in sim.intervals.items():
        for start, end, tid in iv:
            task = sim.tasks[tid]
            lane = sim.lanes[tid] if sim.lanes else 0
            ax.barh(y[(d, lane)], (end - start) * 1e3, left=start * 1e3, height=0.8,
                    color=COLORS.get(str(task.kind.value), "black"), linewidth=0)
    ax.set_yticks([y[r] for r in rows], [f"GPU {d} {LANES[lane]}" for d, lane in rows], fontsize=6)
    ax.set_xlabel("simulated time (ms)")
    ax.set_xlim(0, sim.makespan * 1e3)
    ax.set_title(f"LLaMA block (batch {CONFIG['batch']}, seq {CONFIG['seq']}, dim {CONFIG['dim']}) on "
                 f"{sim.hardware}: makespan {sim.makespan * 1e3:.3f} ms (simulated)", fontsize=9)
    kinds = sorted({str(sim.tasks[t].kind.value) for iv in sim.intervals.values() for _, _, t in iv})
    ax.legend(handles=[Patch(color=COLORS.get(k, "black"), label=k) for k in kinds], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(kinds), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # the Agg canvas only: no GUI backend, no pyplot
    fig.savefig(path)
    print(f"{path}: {sim} ({len(prog.taskgraph)} tasks)")
    return path


if __name__ == "__main__":
    main(*sys.argv[1:3])
