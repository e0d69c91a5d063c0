"""Memory-capped execution: an MLP and a LLaMA block run under a per-device cap of 1/2 and 1/4
of their uncapped peak, with the Belady planner (evict the furthest next use, reload as soon as
memory frees: transfers overlap compute) and the naive policy (evict after every use, reload
synchronously before the next), next to the uncapped run — all in one process, with and
without an emulated host link (evictions, reloads, loads and write-backs throttled to
``--link`` bytes/s, PCIe-like 16 GB/s by default; here host and "device" share RAM).

    make bench            (or: .venv/bin/python bench/offload.py [--reps 9] [--cases mlp,llama] [--link 16e9])

Times are the best of ``--reps`` runs after a warm-up, the configurations of a case taking turns
in every round; ratios are the median over rounds of a configuration's time over the uncapped
one's in the same round (this VM's speed drifts by tens of percent within seconds: paired ratios
cancel that). Outputs are checked against the uncapped run. The BLAS library in use is printed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from rich.console import Console
from rich.table import Table

import einjoin as ej
from einjoin.models.graphs import llama_layers, mlp
from einjoin.plan.stats import human_bytes

CASES = {
    "mlp": ("MLP relu(x@W1)@W2, x 4096x1024, W1 1024x4096", lambda: mlp(4096, 1024, 4096)),
    "llama": ("LLaMA block b1 s512 d1024 h16 ffn 2816",
              lambda: llama_layers(1, batch=1, seq=512, d=1024, heads=16, hidden=2816)),
}


def _feeds(out: ej.Tensor) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {x.op.name: (rng.standard_normal(x.shape) * 0.05).astype(np.float32)
            for x in ej.Graph(out).inputs}


def _interleaved(progs: dict, feeds: dict[str, np.ndarray], reps: int, link: float | None) -> dict:
    """Times of ``reps`` runs of each program after a warm-up, the programs taking turns in every
    round: a slow spell of this shared VM then hits a whole round, and the per-round ratios to the
    first program (the uncapped one) cancel it."""
    for prog in progs.values():
        prog.run(**feeds, host_link=link)
    times: dict = {k: [] for k in progs}
    order = list(progs.items())
    for r in range(reps):
        for k, prog in order[r % len(order):] + order[:r % len(order)]:  # who goes first rotates
            t0 = time.perf_counter()
            prog.run(**feeds, host_link=link)
            times[k].append(time.perf_counter() - t0)
    return times


def _ratio(times: dict, cfg: object, base: object) -> float:
    """The median over rounds of this configuration's time over the uncapped one's."""
    return float(np.median([a / b for a, b in zip(times[cfg], times[base])]))


def main() -> None:
    from threadpoolctl import threadpool_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--link", type=float, default=16e9, help="emulated host link, bytes/s")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    console = Console(width=160)
    blas = ", ".join(f"{i['internal_api']} {i.get('version')} ({i.get('threading_layer', '?')})"
                     for i in threadpool_info() if i.get("user_api") == "blas") or "unknown"
    console.print(f"BLAS: {blas}; devices {args.devices}; emulated link {args.link / 1e9:g} GB/s")
    table = Table(title=f"memory-capped runs vs uncapped, {args.devices} devices ({args.reps} rounds)")
    for col in ("case", "cap", "policy", "tasks", "no link (s)", "x uncapped", f"{args.link / 1e9:g} GB/s link (s)",
                "x uncapped", "evicted", "reloaded", "peak / cap"):
        table.add_column(col, justify="left" if col in ("case", "policy") else "right")
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
        name, make = CASES[case]
        out = make()
        feeds = _feeds(out)
        base = ej.compile(out, devices=args.devices, quiet=True)
        want = base.run(**feeds)
        peak = max(base.run_stats.peak_bytes_per_device.values())  # type: ignore[union-attr]
        progs = {("none", "-"): base}
        for frac in (2, 4):
            for policy in ("belady", "naive"):
                progs[(f"1/{frac}", policy)] = ej.compile(out, devices=args.devices, memory_limit=peak // frac,
                                                         memory_policy=policy, quiet=True)
        t_free = _interleaved(progs, feeds, args.reps, None)
        t_link = _interleaved(progs, feeds, args.reps, args.link)
        for cfg, prog in progs.items():
            got = prog.run(**feeds)
            rs = prog.run_stats
            assert rs is not None
            err = float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))
            assert err < 1e-4, f"{name} cap {cfg[0]} {cfg[1]}: relative error {err:.2e}"
            used = max(rs.peak_bytes_per_device.values())
            if cfg[0] == "none":
                cap_s, fill = f"none ({human_bytes(peak)} peak)", "-"
            else:
                cap = peak // int(cfg[0][2:])
                assert used <= cap
                cap_s, fill = f"{cfg[0]} ({human_bytes(cap)})", f"{used / cap:.2f}"
            table.add_row(name if cfg[0] == "none" else "", cap_s, cfg[1], str(len(prog.taskgraph)),
                          f"{min(t_free[cfg]):.3f}", f"{_ratio(t_free, cfg, ('none', '-')):.2f}",
                          f"{min(t_link[cfg]):.3f}", f"{_ratio(t_link, cfg, ('none', '-')):.2f}",
                          human_bytes(rs.bytes_evicted),
                          human_bytes(rs.bytes_reloaded), fill)
        table.add_section()
    console.print(table)
    console.print("Times: the best of the runs. x uncapped: the median over rounds of the capped run's time over "
                  "the uncapped run's in the same round, under the same link. "
                  "Evicted/reloaded: host<->device bytes of one run (not part of bytes_moved).")


if __name__ == "__main__":
    main()
