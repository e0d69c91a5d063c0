"""Gradients: forward + backward graphs built by ``ej.grad``, run and planned. One table:

* measured here: forward + backward (a scalar loss ``sum(out * R)`` and its gradients w.r.t. every
  parameter) of the zoo's MLP and LLaMA block (:mod:`einjoin.models.zoo`, imported with
  ``ej.from_torch``) on ``ej.local(2)`` (threads backend, one BLAS thread per device) against torch
  autograd on the same cores (``torch.set_num_threads(2)``), in one process, median of a few runs
  after a warm-up; every einjoin result is checked against torch autograd in float64 (torch's
  own float32 gradients are measured against it too, and shown beside);
* planned, not run (shapes only, the cost model's bytes as ``bench/plan_quality.py`` reports them):
  forward + backward of the LLaMA-7B block (``einjoin.models.graphs.llama_layers``, batch 64 x
  seq 2048 so that the batch-splitting baselines apply at every P) at P in {8, 16, 64}: eindecomp
  (the registered one, seeded with the baselines' plans) against ``data_parallel``, ``megatron``,
  ``zero`` and the sum of per-op lower bounds (:mod:`einjoin.planner.bounds`);
* measured here: building (``ej.grad``) and compiling (``ej.compile(..., devices=2)``) the
  gradient graph of a model of at most 100 ops.

Run it with ``make bench`` (or ``.venv/bin/python bench/grad.py``); ``--full`` plans P = 64 with
eindecomp's default settings (about 3 minutes more; the default run caps its ILP step's candidates
per op there, and says so in the row).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

T_START = time.perf_counter()

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402
from threadpoolctl import threadpool_info  # noqa: E402

import einjoin as ej  # noqa: E402
from einjoin.models.graphs import llama_layers  # noqa: E402
from einjoin.models.zoo import example  # noqa: E402
from einjoin.plan.stats import human_bytes  # noqa: E402
from einjoin.planner import PLANNERS, seeded_eindecomp  # noqa: E402
from einjoin.planner.bounds import node_bound_bytes  # noqa: E402
from einjoin.planner.cost import model_cost  # noqa: E402
from einjoin.settings import SETTINGS  # noqa: E402

DEVICES = 2
CORES = os.cpu_count() or 1
BASELINES = ["data_parallel", "megatron", "zero"]
FAST_ILP_KEEP = 8  # eindecomp's ILP candidates per op at P = 64 unless --full (default 40)


def blas_lines() -> list[str]:
    """The BLAS libraries numpy and torch use, as found (nothing is set)."""
    lines = [f"  {lib.get('user_api')}: {lib.get('internal_api')} {lib.get('version')} "
             f"({os.path.basename(lib.get('filepath', ''))}), threads {lib.get('num_threads')}"
             for lib in threadpool_info()]
    cfg = torch.__config__.show()
    blas = "MKL" if torch.backends.mkl.is_available() else ("OpenBLAS" if "OpenBLAS" in cfg else "?")
    lines.append(f"  torch: BLAS {blas}, intra-op threads {torch.get_num_threads()}")
    return lines


def print_header(console: Console, title: str) -> None:
    """The title line with the versions, then the BLAS and threads as found (shared with train.py)."""
    console.print(f"[bold]{title}[/]: {CORES} cores; python {platform.python_version()}, "
                  f"numpy {np.__version__}, torch {torch.__version__}, einjoin {ej.__version__}")
    console.print("BLAS and threads (as found):")
    for line in blas_lines():
        console.print(escape(line))


def _cpu() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process, wall clock), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK"), time.process_time(), time.perf_counter()


def others_load(start: tuple[float, float, float] | None) -> str:
    """The share of the cores other processes used since ``start`` (they skew the timings)."""
    end = _cpu()
    if start is None or end is None:
        return "n/a"
    busy, own, wall = (b - a for a, b in zip(start, end))
    frac = max(0.0, busy - own) / (wall * CORES) if wall > 0 else 0.0
    return f"{100 * frac:.0f}% of the {CORES} cores" + (" (machine not quiet: timings skewed)" if frac > 0.05 else "")


# --------------------------------------------------------------------------------------------
# forward + backward, timed


@dataclasses.dataclass
class Timed:
    name: str
    ops: int
    compile_s: float
    ej_s: list[float]
    torch_s: list[float]
    err: float        # einjoin's float32 gradients vs torch's float64 ones (max rel, every run)
    torch_err: float  # torch's float32 gradients vs its float64 ones


def training(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, list[str], tuple[int, ...]]:
    """The import of ``module`` computing ``[loss, *grads]``, the parameter names, the output shape."""
    fn = ej.from_torch(module, args)
    out = fn.outputs[0]
    loss = (out * ej.input("loss_weights", out.shape)).sum()
    grads = ej.grad(loss, list(fn.parameters.values()))
    return fn.with_outputs([loss, *grads]), list(fn.parameters), out.shape


def time_case(name: str, module: torch.nn.Module, args: tuple[Any, ...], reps: int,
              log: Callable[[str], None]) -> Timed:
    module.eval()
    train, names, shape = training(module, args)
    weights = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    t0 = time.perf_counter()
    prog = ej.compile(train, devices=ej.local(DEVICES), backend="threads")
    compile_s = time.perf_counter() - t0
    r = torch.from_numpy(weights)
    params = dict(module.named_parameters())

    def torch_step() -> list[np.ndarray]:
        for p in params.values():
            p.grad = None
        loss = (module(*args) * r).sum()
        loss.backward()
        return [params[n].grad.numpy() for n in names]  # type: ignore[union-attr]

    def ej_step() -> list[np.ndarray]:
        return [np.asarray(g) for g in prog.run(*args, loss_weights=weights)[1:]]

    # the truth: torch autograd in float64 (float32 results of either side are compared with it)
    m64 = copy.deepcopy(module).double()
    loss64 = (m64(*(a.double() if a.is_floating_point() else a for a in args)) * r.double()).sum()
    loss64.backward()
    p64 = dict(m64.named_parameters())
    truth = [p64[n].grad.numpy() for n in names]  # type: ignore[union-attr]

    def rel(got: list[np.ndarray]) -> float:
        return max(float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30) for g, w in zip(got, truth))

    log(f"{name}: warm-up")
    torch_err = rel(torch_step())
    err = rel(ej_step())
    ts: list[float] = []
    es: list[float] = []
    for i in range(reps):  # alternate, so background load hits both columns alike
        log(f"{name}: repetition {i + 1}/{reps}")
        t0 = time.perf_counter()
        got = ej_step()
        es.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch_step()
        ts.append(time.perf_counter() - t0)
        err = max(err, rel(got))
    return Timed(name, len(prog.graph.ops), compile_s, es, ts, err, torch_err)


# --------------------------------------------------------------------------------------------
# plan bytes of the LLaMA-7B block's forward + backward


def llama_7b_training(batch: int, seq: int) -> ej.Graph:
    out = llama_layers(1, batch=batch, seq=seq)
    loss = (out * ej.input("loss_weights", out.shape)).sum()
    return ej.Graph([loss, *ej.grad(loss, [ej.Tensor(x) for x in ej.Graph(out).params])])


@dataclasses.dataclass
class Planned:
    p: int
    ours: int
    ours_s: float
    note: str
    base: dict[str, int | None]
    bound: int


def plan_row(graph: ej.Graph, p: int, full: bool, log: Callable[[str], None]) -> Planned:
    cluster = ej.local(p)
    base: dict[str, int | None] = {}
    for name in BASELINES:
        try:
            base[name] = model_cost(graph, cluster, PLANNERS[name](graph, cluster))
        except ej.EinjoinError:
            base[name] = None
    settings, note = SETTINGS, ""
    if p >= 64 and not full:
        settings = dataclasses.replace(SETTINGS, ilp_keep=FAST_ILP_KEEP)
        note = f" (ILP step: {FAST_ILP_KEEP} candidates per op, not {SETTINGS.ilp_keep}; --full)"
    log(f"LLaMA-7B fwd+bwd: eindecomp at P={p}{note}")
    t0 = time.perf_counter()
    ours = model_cost(graph, cluster, seeded_eindecomp(graph, cluster, settings=settings))
    bound = int(sum(node_bound_bytes(n, p) or 0 for n in graph.ops))
    return Planned(p, ours, time.perf_counter() - t0, note, base, bound)


# --------------------------------------------------------------------------------------------
# building and compiling a gradient graph


def build_and_compile(make: Callable[[], ej.Tensor]) -> tuple[int, int, float, float]:
    """(forward ops, gradient graph ops, seconds in ej.grad, seconds in ej.compile on 2 devices)."""
    out = make()
    fwd = ej.Graph(out)
    t0 = time.perf_counter()
    loss = (out * ej.input("loss_weights", out.shape)).sum()
    grads = ej.grad(loss, [ej.Tensor(x) for x in fwd.params])
    t1 = time.perf_counter()
    prog = ej.compile([loss, *grads], devices=DEVICES, backend="threads")
    t2 = time.perf_counter()
    return len(fwd.ops), len(prog.graph.ops), t1 - t0, t2 - t1


def mlp_graph() -> ej.Tensor:
    """The zoo's MLP (2 residual layers, 512 -> 2048 -> 512) written with the frontend."""
    x = ej.input("x", (1024, 512))
    for i in range(2):
        h = ej.linear(x, ej.param(f"up{i}.w", (2048, 512)), ej.param(f"up{i}.b", (2048,))).relu()
        x = x + ej.linear(h, ej.param(f"down{i}.w", (512, 2048)), ej.param(f"down{i}.b", (512,)))
    return x


def block_graph() -> ej.Tensor:
    return llama_layers(1, batch=1, seq=512, d=512, heads=8, hidden=1376)


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after a warm-up)")
    ap.add_argument("--full", action="store_true", help="eindecomp's default settings at P = 64 too")
    ap.add_argument("--devices", default="8,16,64", help="P for the LLaMA-7B plans")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 190, log_path=False)
    log = lambda msg: console.log(escape(msg))  # noqa: E731
    torch.set_num_threads(DEVICES)  # the cores einjoin's local(2) uses: one BLAS thread per device
    print_header(console, "einjoin gradient benchmark")

    torch.manual_seed(0)
    cases = [("MLP 2 layers 512-2048-512, batch 1024", *example("mlp", dim=512, hidden=2048, layers=2,
                                                               batch=1024)),
             ("LLaMA block d 512, 8 heads, seq 512, SwiGLU 1376",
              *example("llama-block", dim=512, heads=8, kv_heads=8, hidden=1376, seq=512, batch=1))]
    load0 = _cpu()
    timed = [time_case(name, module, a, args.reps, log) for name, module, a in cases]
    load = others_load(load0)

    builds = []
    for name, make in (("MLP (2 layers)", mlp_graph), ("LLaMA block", block_graph)):
        build_and_compile(make)  # warm caches (imports, first-call costs) once
        builds.append((name, *build_and_compile(make)))

    graph = llama_7b_training(batch=64, seq=2048)
    plans = [plan_row(graph, int(p), args.full, log) for p in args.devices.split(",")]

    table = Table(title="einjoin gradients: forward + backward (ej.grad), measured on this machine and "
                        "planned for LLaMA-7B (cost model, not run)")
    for col in ("what", "setting", "einjoin", "peers / baselines", "ratio", "goal", "met"):
        table.add_column(col, justify="left" if col in ("what", "setting", "peers / baselines") else "right")
    for t in timed:
        ej_med, th_med = statistics.median(t.ej_s), statistics.median(t.torch_s)
        ratio = ej_med / th_med
        table.add_row(f"fwd+bwd time (measured): {t.name}",
                      f"local({DEVICES}) threads vs torch autograd, {DEVICES} threads; median of {len(t.ej_s)}",
                      f"{ej_med:.3f} s (min {min(t.ej_s):.3f})", f"torch {th_med:.3f} s (min {min(t.torch_s):.3f})",
                      f"{ratio:.2f}x (min/min {min(t.ej_s) / min(t.torch_s):.2f}x)", "<= 1.5x",
                      "yes" if ratio <= 1.5 else "no")
    for pl in plans:
        known = {k: v for k, v in pl.base.items() if v is not None}
        best = min(known.values()) if known else None
        shown = ", ".join(f"{k} {human_bytes(v) if v is not None else 'n/a'}" for k, v in pl.base.items())
        ratio = f"{pl.ours / best:.2f}x best" if best else "-"
        table.add_row(f"fwd+bwd plan bytes (simulated, cost model): LLaMA-7B block b64 s2048, "
                      f"{len(graph.ops)} ops", f"P = {pl.p}; eindecomp {pl.ours_s:.0f} s{pl.note}",
                      human_bytes(pl.ours), f"{shown}; per-op bounds {human_bytes(pl.bound)}", ratio,
                      "<= best baseline", "-" if best is None else ("yes" if pl.ours <= best else "no"))
    for name, fops, gops, grad_s, comp_s in builds:
        total = grad_s + comp_s
        table.add_row(f"build + compile the gradient graph (measured): {name}",
                      f"{fops} forward ops -> {gops} ops; ej.grad {grad_s * 1e3:.0f} ms + "
                      f"ej.compile(devices={DEVICES}) {comp_s:.2f} s", f"{total:.2f} s", "-", "-",
                      "<= 1 s", "yes" if total <= 1.0 else "no")
    console.print(table)
    for t in timed:
        console.print(f"{escape(t.name)}: {t.ops} ops planned, compiled in {t.compile_s:.1f} s; max rel "
                      f"err of the float32 gradients vs torch autograd in float64: einjoin {t.err:.1e} "
                      f"(every run), torch {t.torch_err:.1e}")
    console.print(f"other processes while the timings ran: {load}")
    console.print("per-op bounds: the sum of each op's own lower bound; on a training graph it is not a lower "
                  "bound of the whole plan (replicas of forward activations are shared with the backward "
                  "ops and paid once)")
    console.print("zero's bytes: its gradient ops cut the batch and the parameter's largest dim P ways "
                  "each (P x P kernels, so the partials of each block meet on its device); the cost model "
                  "charges every input block read by kernels of another device, which the placer avoids.")
    console.print(f"total benchmark time: {time.perf_counter() - T_START:.0f} s")
    bad = [t.name for t in timed if not t.err < 1e-3]
    if bad:
        console.print(f"[red]einjoin gradients differ from torch's float64 ones[/] in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
