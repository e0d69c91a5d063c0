"""Training steps with ``ej.Trainer``: forward + backward + AdamW update as one planned graph whose
parameters and optimizer state stay on their devices. One table:

* measured here: steps/s of the zoo's small LLaMA (2 layers, hidden 64, vocab 256; batch 16 x
  seq 128, cross-entropy) and the zoo's MLP (2 residual layers 512-2048-512, batch 1024, MSE),
  AdamW, ``ej.Trainer`` on ``ej.local(2)`` (threads backend; ``--leave-idle`` lets the Trainer plan
  the step on fewer of the two where they do not pay, the row says so) against torch (``torch.optim.AdamW``,
  single-tensor path) on the same cores (``torch.set_num_threads(2)``), in one process,
  alternating, median step time after a warm-up; the einjoin losses are checked against torch's
  (same initial weights and batches), and the host bytes each step loads after the first are
  measured (``run_stats.bytes_loaded``: the batch and the learning rate); and the CPU time of a
  step, einjoin's (every thread) against torch's on one thread (its work): CPU time hardly moves
  with other processes' load, where wall time does (torch's 2-thread steps most: on a busy
  2-core box they took 10-20x their quiet time), so on a busy machine this is the row to read;
* measured here: building the Trainer of a 2-layer, hidden-32 GPT (the zoo's GPT-2 blocks) on
  ``ej.local(2)``, and its step time;
* planned, not run (shapes only, the cost model's bytes with the state carry-over,
  :func:`einjoin.planner.state_cost`): a training step of one LLaMA-7B layer
  (``einjoin.models.graphs.llama_layers``, batch 8 x seq 2048, the loss ``sum(out * R)``,
  ``ej.grad`` w.r.t. its 9 weights and ``ej.optim.AdamW``'s update, weights and moments as state;
  its elementwise chains fused as ``ej.compile`` fuses them) at P in {8, 16, 64}: eindecomp (the
  registered one, seeded with the baselines' plans) against
  ``data_parallel``, ``zero``, ``megatron`` and the sum of per-op lower bounds; the host bytes a
  step loads after the first (the inputs that are not state); eindecomp's planning time.

Run it with ``make bench`` (or ``.venv/bin/python bench/train.py``); ``--full`` plans P = 64 with
eindecomp's default settings (the default run caps its ILP step's candidates per op there, and
says so in the row).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import pathlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

T_START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

import einjoin as ej  # noqa: E402
from einjoin.ir.fuse import fuse_elementwise  # noqa: E402
from einjoin.models.graphs import llama_layers  # noqa: E402
from einjoin.models.zoo import GPT2Block, example  # noqa: E402
from einjoin.plan.stats import human_bytes  # noqa: E402
from einjoin.planner import plan_specs, seeded_eindecomp, state_cost  # noqa: E402
from einjoin.planner.bounds import node_bound_bytes  # noqa: E402
from einjoin.planner.cost import CostModel  # noqa: E402
from einjoin.settings import SETTINGS  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from grad import _cpu, others_load, print_header  # noqa: E402  (the same BLAS and load reports)

DEVICES = 2
CORES = os.cpu_count() or 1
BASELINES = ["data_parallel", "zero", "megatron"]
FAST_ILP_KEEP = 8  # eindecomp's ILP candidates per op at P = 64 unless --full (default 40)
GOAL_RATIO = 1.3
GOAL_PLAN_S = 30.0


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return TF.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return TF.mse_loss(out, target)


# --------------------------------------------------------------------------------------------
# steps, timed


@dataclasses.dataclass
class Timed:
    name: str
    ops: int
    build_s: float
    ej_s: list[float]
    torch_s: list[float]
    ej_cpu: list[float]     # process CPU seconds of each timed einjoin step (every thread)
    torch1_cpu: list[float]  # CPU seconds of a torch step on one thread: torch's work
    loss_err: float     # max relative difference of the losses, every step
    loaded: int         # host bytes loaded by a step after the first (measured)
    batch_bytes: int
    used: int = DEVICES  # devices the step's plan uses (fewer where the Trainer's leave_idle left some idle)
    torch_alone_s: list[float] = dataclasses.field(default_factory=list)  # torch in a process of its own


def time_case(name: str, module: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]], loss_fn: Any,
              reps: int, log: Callable[[str], None], leave_idle: bool = False) -> Timed:
    reference = copy.deepcopy(module).train()
    t0 = time.perf_counter()
    trainer = ej.Trainer(module, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3),
                         devices=ej.local(DEVICES), backend="threads", leave_idle=leave_idle)
    build_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)

    def torch_step(*b: torch.Tensor) -> float:
        opt.zero_grad()
        loss = loss_fn(reference(*b[:-1]), b[-1])
        loss.backward()
        opt.step()
        return float(loss.item())

    err = 0.0
    ts: list[float] = []
    es: list[float] = []
    ecpu: list[float] = []
    warm = 3
    ours: list[float] = []
    theirs: list[float] = []
    # rounds of a few steps of each column back to back, as a training loop runs them, the
    # columns alternating by round so that background load hits both alike; a pause between:
    # a thread pool's workers spin after their last call (OpenBLAS ~0.1 s, torch's OpenMP team)
    # and would take the cores from the column timed next (step by step alternation made
    # torch's step 23 -> 47 ms after einjoin's one-device steps)
    chunk, total = 5, warm + reps
    for first in range(0, total, chunk):
        steps = range(first, min(total, first + chunk))
        time.sleep(0.3)
        for i in steps:
            b = batches[i % len(batches)]
            if i >= warm:
                log(f"{name}: step {i + 1 - warm}/{reps}")
            t0, c0 = time.perf_counter(), time.process_time()
            ours.append(trainer.step(*b))
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warm:
                es.append(t1 - t0)
                ecpu.append(c1 - c0)
        time.sleep(0.3)
        for i in steps:
            b = batches[i % len(batches)]
            t1 = time.perf_counter()
            theirs.append(torch_step(*b))
            if i >= warm:
                ts.append(time.perf_counter() - t1)
    err = max(abs(o - t) / abs(t) for o, t in zip(ours, theirs))
    # torch's work: CPU seconds of a step on one thread (on a copy: the reference stays in step
    # with the trainer). CPU time hardly moves with other processes' load, where wall time does
    # (torch's spinning OpenMP threads most of all): a busy machine's yardstick
    copy_module = copy.deepcopy(reference)
    copy_opt = torch.optim.AdamW(copy_module.parameters(), lr=1e-3, foreach=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t1cpu: list[float] = []
    try:
        for i in range(warm + reps):
            b = batches[i % len(batches)]
            c0 = time.process_time()
            copy_opt.zero_grad()
            loss_fn(copy_module(*b[:-1]), b[-1]).backward()
            copy_opt.step()
            if i >= warm:
                t1cpu.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(threads)
    stats = trainer.program.run_stats
    loaded = stats.bytes_loaded if stats is not None else -1
    batch_bytes = sum(t.numel() * t.element_size() for t in batches[0])
    return Timed(name, len(trainer.program.graph.ops), build_s, es, ts, ecpu, t1cpu, err, loaded, batch_bytes,
                 trainer.program.cluster.size)


def torch_steps(module: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]], loss_fn: Any,
                reps: int, warm: int = 3) -> list[float]:
    """Wall seconds of ``reps`` torch AdamW steps after ``warm``, nothing else in the process."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=False)
    out: list[float] = []
    for i in range(warm + reps):
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(module(*b[:-1]), b[-1])
        loss.backward()
        opt.step()
        float(loss.item())
        if i >= warm:
            out.append(time.perf_counter() - t0)
    return out


def torch_alone(case: str, reps: int) -> list[float]:
    """torch's step times measured in a fresh process of this script (``--torch-alone``). Why:
    in the benchmark's process, torch's steps between einjoin's were measured 22–40 ms where the
    same steps alone take 22 ms (the state einjoin's run leaves in the process — heap, caches —
    varies from build to build); the ratio is taken against the faster of the two, never a
    torch slowed by einjoin's presence."""
    cmd = [sys.executable, __file__, "--torch-alone", case, "--reps", str(reps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return [float(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def llama_case() -> tuple[str, torch.nn.Module, Sequence[tuple[torch.Tensor, ...]], Any]:
    batch, seq = 16, 128
    module, _ = example("llama", dim=64, layers=2, vocab=256, seq=seq, batch=batch)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (batch, seq + 1), generator=g) for _ in range(4)]
    return (f"small LLaMA (2 layers, hidden 64, vocab 256), batch {batch} x seq {seq}", module,
            [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data], cross_entropy)


def mlp_case() -> tuple[str, torch.nn.Module, Sequence[tuple[torch.Tensor, ...]], Any]:
    module, _ = example("mlp", dim=512, hidden=2048, layers=2, batch=1024)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(1024, 512, generator=g), torch.randn(1024, 512, generator=g)) for _ in range(4)]
    return "MLP 2 layers 512-2048-512, batch 1024", module, data, mse


class TinyGPT(torch.nn.Module):
    """A 2-layer GPT of hidden size 32: token and position embeddings, the zoo's GPT-2 blocks
    (dropout 0.1, active: the Trainer captures training mode), a final LayerNorm and a head."""

    def __init__(self, vocab: int = 256, dim: int = 32, seq: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(GPT2Block(dim, 4, seq) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(self.ln_f(h))
        return out


def gpt_build(reps: int) -> tuple[float, float]:
    """(seconds to build the Trainer of a 2-layer hidden-32 GPT on local(2), median step seconds)."""
    torch.manual_seed(0)
    module = TinyGPT()
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (8, 65), generator=g)
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous())
    t0 = time.perf_counter()
    trainer = ej.Trainer(module, batch, cross_entropy, optimizer=ej.optim.AdamW(lr=1e-3),
                         devices=ej.local(DEVICES), backend="threads")
    build = time.perf_counter() - t0
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        trainer.step(*batch)
        times.append(time.perf_counter() - t0)
    return build, statistics.median(times[1:])


# --------------------------------------------------------------------------------------------
# plan bytes of a LLaMA-7B layer's training step


@dataclasses.dataclass
class Step7B:
    graph: ej.Graph
    tied: dict[Any, Any]   # state input node -> its new value's node
    host_bytes: int        # the inputs that are not state: loaded by every step


def llama_7b_step(batch: int, seq: int) -> Step7B:
    out = llama_layers(1, batch=batch, seq=seq)
    loss = (out * ej.input("loss_weights", out.shape)).sum()
    params = {x.op.name: ej.Tensor(x) for x in ej.Graph(out).params}  # type: ignore[union-attr]
    grads = dict(zip(params, ej.grad(loss, list(params.values()))))
    upd = ej.optim.AdamW(lr=3e-4).update(params, grads)
    tied = {p.node: upd.params[n].node for n, p in params.items()}
    tied.update({upd.state_in[k].node: upd.state_out[k].node for k in upd.state_in})
    # fused as ej.compile fuses before planning (einjoin.ir.fuse): the planners see what a
    # compiled training step has; the new values follow their fused nodes
    outs = [loss.node, *tied.values()]
    fused = dict(zip(outs, fuse_elementwise(outs)))
    tied = {k: fused[v] for k, v in tied.items()}
    graph = ej.Graph([fused[loss.node], *tied.values()])
    host = sum(x.size * np.dtype(x.dtype).itemsize for x in graph.inputs if x not in tied)
    return Step7B(graph, tied, int(host))


@dataclasses.dataclass
class Planned:
    p: int
    ours: int
    ours_s: float
    note: str
    base: dict[str, int | None]
    bound: int


def plan_row(step: Step7B, p: int, full: bool, log: Callable[[str], None]) -> Planned:
    graph, cluster = step.graph, ej.local(p)
    model = CostModel(graph, p)
    base: dict[str, int | None] = {}
    for name in BASELINES:
        log(f"LLaMA-7B training step: {name} at P={p}")
        try:
            base[name] = state_cost(graph, model, plan_specs(name, graph, cluster, tied=step.tied), step.tied)
        except ej.EinjoinError:
            base[name] = None
    settings, note = SETTINGS, ""
    if p >= 64 and not full:
        settings = dataclasses.replace(SETTINGS, ilp_keep=FAST_ILP_KEEP)
        note = f" (ILP step: {FAST_ILP_KEEP} candidates per op, not {SETTINGS.ilp_keep}; --full)"

    def ours_planner(g: ej.Graph, c: ej.Cluster, *, memory_limit: Any = None) -> Any:
        return seeded_eindecomp(g, c, memory_limit=memory_limit, settings=settings)

    log(f"LLaMA-7B training step: eindecomp at P={p}{note}")
    t0 = time.perf_counter()
    specs = plan_specs(ours_planner, graph, cluster, tied=step.tied)
    took = time.perf_counter() - t0
    ours = state_cost(graph, model, specs, step.tied)
    bound = int(sum(node_bound_bytes(n, p) or 0 for n in graph.ops))
    return Planned(p, ours, took, note, base, bound)


# --------------------------------------------------------------------------------------------


def _used(t: Timed) -> str:
    """How many of the devices the step's plan uses, where the Trainer left some idle."""
    return f" (leave_idle: {t.used} used)" if t.used != DEVICES else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--full", action="store_true", help="eindecomp's default settings at P = 64 too")
    ap.add_argument("--devices", default="8,16,64", help="P for the LLaMA-7B plans")
    ap.add_argument("--leave-idle", action="store_true",
                    help="ej.Trainer(..., leave_idle=True): each measured step on as many of the devices as pay")
    ap.add_argument("--torch-alone", choices=("llama", "mlp"), help=argparse.SUPPRESS)  # see torch_alone()
    args = ap.parse_args(argv)
    if args.torch_alone:
        torch.set_num_threads(DEVICES)
        _, module, batches, loss_fn = (llama_case if args.torch_alone == "llama" else mlp_case)()
        print(json.dumps(torch_steps(module.train(), batches, loss_fn, args.reps)))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 190, log_path=False)
    log = lambda msg: console.log(escape(msg))  # noqa: E731
    torch.set_num_threads(DEVICES)  # the cores einjoin's local(2) uses: one BLAS thread per device
    print_header(console, "einjoin training benchmark")

    load0 = _cpu()
    timed = [time_case(name, module, batches, loss_fn, args.reps, log, args.leave_idle)
             for name, module, batches, loss_fn in (llama_case(), mlp_case())]
    for t, case in zip(timed, ("llama", "mlp")):
        log(f"{t.name}: torch alone in a fresh process")
        t.torch_alone_s = torch_alone(case, args.reps)
    log("2-layer hidden-32 GPT: building the Trainer")
    gpt_s, gpt_step = gpt_build(args.reps)
    load = others_load(load0)

    step = llama_7b_step(batch=8, seq=2048)
    plans = [plan_row(step, int(p), args.full, log) for p in args.devices.split(",")]

    table = Table(title="einjoin training steps (ej.Trainer): measured on this machine, and planned for a "
                        "LLaMA-7B layer (cost model, not run)")
    for col in ("what", "setting", "einjoin", "peers / baselines", "ratio", "goal", "met"):
        table.add_column(col, justify="left" if col in ("what", "setting", "peers / baselines") else "right")
    for t in timed:
        ej_med, th_in = statistics.median(t.ej_s), statistics.median(t.torch_s)
        th_alone = statistics.median(t.torch_alone_s)
        th_med = min(th_in, th_alone)  # the faster torch: never one slowed by einjoin's presence
        ratio = ej_med / th_med
        table.add_row(f"training step (measured): {t.name}",
                      f"local({DEVICES}) threads{_used(t)} vs torch, {DEVICES} threads; AdamW; median of "
                      f"{len(t.ej_s)}",
                      f"{1 / ej_med:.1f} steps/s ({ej_med * 1e3:.0f} ms)",
                      f"torch {1 / th_med:.1f} steps/s ({th_med * 1e3:.0f} ms; between einjoin's steps "
                      f"{th_in * 1e3:.0f} ms, alone {th_alone * 1e3:.0f} ms)", f"{ratio:.2f}x",
                      f"<= {GOAL_RATIO}x", "yes" if ratio <= GOAL_RATIO else "no")
        work = statistics.median(t.ej_cpu) / statistics.median(t.torch1_cpu)
        table.add_row(f"CPU time per step (measured): {t.name}",
                      f"einjoin local({DEVICES}){_used(t)}, every thread, vs torch on 1 thread (its work); median of "
                      f"{len(t.ej_cpu)}; robust to other load, not the goal",
                      f"{statistics.median(t.ej_cpu) * 1e3:.0f} ms CPU",
                      f"torch {statistics.median(t.torch1_cpu) * 1e3:.0f} ms CPU", f"{work:.2f}x", "-", "-")
        table.add_row(f"host bytes loaded per step after the first (measured): {t.name}",
                      "run_stats.bytes_loaded of the last step", human_bytes(t.loaded),
                      f"batch {human_bytes(t.batch_bytes)} (+ 8 B learning rate)", "-", "the batch only",
                      "yes" if 0 <= t.loaded <= t.batch_bytes + 8 else "no")
    table.add_row("build the Trainer (measured): GPT, 2 layers, hidden 32, batch 8 x seq 64, dropout on",
                  f"ej.Trainer(..., devices=local({DEVICES})): capture, grad, AdamW, plan, compile",
                  f"{gpt_s:.1f} s", "-", "-", "<= 20 s", "yes" if gpt_s <= 20 else "no")
    table.add_row("training step (measured): the same GPT", f"local({DEVICES}) threads; median of {args.reps}",
                  f"{gpt_step:.3f} s", "-", "-", "<= 1 s", "yes" if gpt_step <= 1 else "no")
    g = step.graph
    for pl in plans:
        known = {k: v for k, v in pl.base.items() if v is not None}
        best = min(known.values()) if known else None
        shown = ", ".join(f"{k} {human_bytes(v) if v is not None else 'n/a'}" for k, v in pl.base.items())
        ratio = f"{pl.ours / best:.2f}x best" if best else "-"
        table.add_row(f"bytes moved per step (simulated, cost model): LLaMA-7B layer b8 s2048 fwd+bwd+AdamW, "
                      f"{len(g.ops)} ops", f"P = {pl.p}; with the state's carry-over{pl.note}",
                      human_bytes(pl.ours), f"{shown}; per-op bounds {human_bytes(pl.bound)}", ratio,
                      "<= best baseline", "-" if best is None else ("yes" if pl.ours <= best else "no"))
        table.add_row(f"planning time (measured): LLaMA-7B layer training step, P = {pl.p}",
                      f"eindecomp + state alignment{pl.note}", f"{pl.ours_s:.1f} s", "-", "-",
                      f"<= {GOAL_PLAN_S:.0f} s" if pl.p == 64 else "-",
                      ("yes" if pl.ours_s <= GOAL_PLAN_S else "no") if pl.p == 64 else "-")
    state_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in step.tied)
    table.add_row("host bytes loaded per step after the first (from shapes): LLaMA-7B layer training step",
                  "every input that is not state: x (8 x 2048 x 4096 fp32), loss weights, lr",
                  human_bytes(step.host_bytes), f"weights + AdamW moments stay on the devices: "
                  f"{human_bytes(state_bytes)} of state", "-", "the batch only", "yes")
    console.print(table)
    for t in timed:
        console.print(f"{escape(t.name)}: {t.ops} ops planned, Trainer built in {t.build_s:.1f} s; max rel "
                      f"difference of the losses vs torch: {t.loss_err:.1e} (every step)")
    console.print(f"other processes while the timings ran: {load}")
    console.print("per-op bounds: the sum of each op's own lower bound; on a training graph it is not a lower "
                  "bound of the whole plan (replicas of forward activations are shared with the backward "
                  "ops and paid once). n/a: the baseline does not apply (batch 8 cannot be cut 64 ways).")
    console.print(f"total benchmark time: {time.perf_counter() - T_START:.0f} s")
    bad = [t.name for t in timed if not t.loss_err < 1e-3]
    if bad:
        console.print(f"[red]einjoin losses differ from torch's[/] in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
