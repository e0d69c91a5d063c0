"""Local execution: einjoin on ``ej.local(2)`` (threads backend, numpy kernels) against numpy in
one process, dask.array on its threaded scheduler (with einjoin's blocks, and with dask's own
"auto" chunks) and torch eager, on four cases: a 4096^2 float32 matmul, a chain A@B@C, an MLP
and a LLaMA-style block: the graphs of :mod:`einjoin.models.graphs` (``matmul``, ``chain``, ``mlp``,
``transformer_block``); the torch peer of the block is the zoo's (``einjoin.models.zoo.torch_block``).
More rows are torch models imported with ``ej.from_torch``: the zoo's ResNet-18 and ViT-Tiny
(eval mode, batch 8 of 224x224 images) and its LLaMA block (the llama case's sizes): there the
peer is torch eager alone (no numpy or dask version of a ResNet exists to compare with), and
torch's output is the reference. The LLaMA block, and its import, also run on einjoin's torch
backend (``backend="torch"``, CPU), the import fed torch tensors (torch in, torch out); a table of
their own gives them against torch eager, and the bytes the torch backend copied between numpy
and torch (0: no round trip).

Two more rows of the table (``--cases`` keys ``memory`` and ``dispatch``):

* memory: the peak RSS (Linux's ``VmHWM``, else ``ru_maxrss``) of the llama case's block run
  twice on ``local(2)``, and of numpy's reference (``ej.reference``) and the hand-written numpy
  block, each in fresh child processes (``bench/llama_memory.py``, which imports only numpy and
  einjoin); the figure is the peak above the child's import baseline, the total beside it; goal
  <= 1.3x numpy's;
* dispatch: per-task time of the threads backend on ~10k tiny (8x8, elementwise, ``fuse=False``)
  tasks against dask's threaded scheduler running a raw graph of the same blocks and ops (its
  scheduler alone: no dask.array graph building timed); goal <= dask's.

Run it with ``make bench`` (or ``.venv/bin/python bench/local_exec.py``). Every time is a median
over a few repetitions after one warm-up run; each einjoin result is checked against numpy.

Thread settings, per column:

* einjoin: its threads backend, one worker per device, BLAS limited to cores // devices threads
  during a run (what the backend does by itself);
* numpy: one call per op, BLAS with its default thread count;
* dask, einjoin's blocks: ``num_workers`` = devices and BLAS limited like einjoin's, so that the
  two differ only in the runtime (same blocks, same kernels, same threads);
* dask, auto chunks: dask as it comes (``num_workers`` = cores, BLAS left alone);
* torch eager: ``torch.set_num_threads(cores)``.

The BLAS library in use and ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are printed, never set.

``--devices n`` runs the cases and the dispatch row on ``local(n)`` (the memory row stays
``local(2)``), for issue 22's 16-core table (``local(n)`` / numpy for n in {1, 4, 16}; the earlier
figures are ``../shared/measured/cpu16.md``, of main 3966c0f). No 16-core machine was available to
the sessions that built issue 22 (a GPU machine, which has 16 cores, was not lent to them): that
table was not re-measured, and this bench's committed figures are from a 2-core box.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import numpy as np

T_START = time.perf_counter()

from llama_memory import HEADS, block_math, in_children, llama_graph, randn as _randn  # noqa: E402

# run as a script, bench/ is first on sys.path: a bench named like a package (bench/sparse.py) would
# shadow it for the libraries below (dask.array imports sparse when it can)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

import einjoin as ej  # noqa: E402
from einjoin.models.graphs import chain, matmul, mlp, transformer_block  # noqa: E402
from einjoin.models.zoo import block_with  # noqa: E402
from einjoin.plan.stats import human_bytes  # noqa: E402

DEVICES = 2
TORCH_COL = "einjoin (torch backend)"
CORES = os.cpu_count() or 1
Feeds = dict[str, np.ndarray]


# --------------------------------------------------------------------------------------------
# the cases: an einjoin graph, its inputs, and the same math for numpy, dask and torch


@dataclass
class Case:
    name: str
    out: Any                                   # the einjoin tensor
    feeds: Feeds
    numpy_fn: Callable[[Feeds], np.ndarray] | None  # None: an imported torch model, torch is the reference
    numpy_label: str
    dask_fn: Callable[[dict[str, Any]], Any] | None  # dask arrays in, a lazy dask array out
    torch_fn: Callable[[Feeds], np.ndarray]
    reps: int = 3
    extra: dict[str, Callable[[Feeds], np.ndarray]] = field(default_factory=dict)  # more numpy peers
    torch_backend: bool = False  # also run einjoin on backend="torch" (CPU): a column of its own
    torch_in: bool = False       # ... fed torch tensors (torch in, torch out: no numpy round trip)


def _torch(fn: Callable[..., Any]) -> Callable[[Feeds], np.ndarray]:
    def run(feeds: Feeds) -> np.ndarray:
        return fn({k: torch.from_numpy(v) for k, v in feeds.items()}).numpy()
    return run


def matmul_case(rng: np.random.Generator) -> Case:
    n = 4096
    feeds = {"a": _randn(rng, (n, n)), "b": _randn(rng, (n, n))}
    mm = lambda t: t["a"] @ t["b"]  # noqa: E731  (numpy, dask and torch alike)
    return Case("matmul 4096x4096 @ 4096x4096", matmul(n, n, n), feeds, mm, "numpy", mm, _torch(mm))


def chain_case(rng: np.random.Generator) -> Case:
    n = 4096
    s = 1 / math.sqrt(n)
    feeds = {"m0": _randn(rng, (n, n)), "m1": _randn(rng, (n, n), s), "m2": _randn(rng, (n, n), s)}
    chain3 = lambda t: t["m0"] @ t["m1"] @ t["m2"]  # noqa: E731
    return Case("chain A@B@C, 4096^2 each", chain(n, 3), feeds, chain3, "numpy", chain3,
                _torch(chain3))


def mlp_case(rng: np.random.Generator) -> Case:
    feeds = {"x": _randn(rng, (8192, 1024)), "w1": _randn(rng, (1024, 4096), 1 / 32),
             "w2": _randn(rng, (4096, 1024), 1 / 64)}
    return Case("MLP relu(x@W1)@W2, x 8192x1024, W1 1024x4096", mlp(8192, 1024, 4096), feeds,
                lambda t: np.maximum(t["x"] @ t["w1"], 0) @ t["w2"], "numpy",
                lambda t: da.maximum(t["x"] @ t["w1"], 0) @ t["w2"],
                _torch(lambda t: torch.relu(t["x"] @ t["w1"]) @ t["w2"]))


def llama_case(rng: np.random.Generator) -> Case:
    out, feeds = llama_graph(rng)
    shapes = {k: v.shape for k, v in feeds.items()}
    module = block_with(feeds, HEADS, seq=shapes["x"][0])  # built once, outside the timed runs

    def torch_fn(t: Feeds) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(t["x"])[None])[0].numpy()

    return Case("LLaMA block seq 2048, d 1024, 8 heads, SwiGLU 2816", out, feeds,
                lambda t: ej.reference(out, **t), "numpy (ej.reference)",
                lambda t: block_math(da, t, HEADS), torch_fn,
                extra={"numpy (hand-written block)": lambda t: block_math(np, t, HEADS)}, torch_backend=True)


def llama_import_case(rng: np.random.Generator) -> Case:
    """The zoo's LLaMA block (the llama case's sizes and weights) imported with ``ej.from_torch``:
    on the torch backend it runs torch in, torch out (the bench reports the bytes it copied)."""
    _, shapes = transformer_block(seq=2048, d=1024, heads=HEADS, hidden=2816)
    weights = {k: _randn(rng, s, 0.05) for k, s in shapes.items() if k != "x"}
    for g in ("attn_norm", "mlp_norm"):
        weights[g] = np.ones(shapes[g], np.float32)
    case = _imported("llama-import", "LLaMA block (from_torch, zoo), seq 2048, d 1024, 8 heads",
                     block_with(weights, HEADS, seq=2048), _randn(rng, (1, 2048, 1024)))
    case.torch_backend = case.torch_in = True
    return case


def _imported(name: str, title: str, module: Any, x: np.ndarray) -> Case:
    """A torch model as a user has it: imported with ``ej.from_torch`` (its weights bound), run on
    the same input by einjoin and by torch eager."""
    fn = ej.from_torch(module, (torch.from_numpy(x),))
    (arg,) = fn.arg_names

    def torch_fn(t: Feeds) -> np.ndarray:
        with torch.no_grad():
            return module(torch.from_numpy(t[arg])).numpy()

    return Case(title, fn, {arg: x}, None, "torch eager", None, torch_fn)


def resnet_case(rng: np.random.Generator) -> Case:
    from einjoin.models.vision import ResNet18
    torch.manual_seed(0)
    return _imported("resnet18", "ResNet-18 (from_torch), batch 8 x 3x224x224", ResNet18().eval(),
                     _randn(rng, (8, 3, 224, 224)))


def vit_case(rng: np.random.Generator) -> Case:
    from einjoin.models.vision import ViTTiny
    torch.manual_seed(0)
    return _imported("vit-tiny", "ViT-Tiny (from_torch), batch 8 x 3x224x224, 197 tokens",
                     ViTTiny().eval(), _randn(rng, (8, 3, 224, 224)))


# --------------------------------------------------------------------------------------------
# measuring


class CpuWatch:
    """CPU time the rest of the machine used while we ran (other processes compete for the same
    cores and skew every column), and time the hypervisor stole, from /proc/stat (Linux)."""

    def __init__(self) -> None:
        self.start = self._read()
        self.start_wall = time.perf_counter()

    @staticmethod
    def _read() -> tuple[float, float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = v[0] + v[1] + v[2] + v[5] + v[6]          # user nice system irq softirq
        steal = v[7] if len(v) > 7 else 0
        return busy / tick, steal / tick, time.process_time(), time.perf_counter()

    def others(self) -> str:
        end = self._read()
        if self.start is None or end is None:
            return "n/a"
        busy, steal, own, wall = (b - a for a, b in zip(self.start, end))
        other = max(0.0, busy - own)
        frac = other / (wall * CORES) if wall > 0 else 0.0
        flag = "  [red]<- machine not quiet, timings skewed[/]" if frac > 0.05 else ""
        return (f"{other:.1f} core-s by other processes over {wall:.0f} s ({100 * frac:.0f}% of "
                f"the {CORES} cores), {steal:.1f} s stolen{flag}")


@dataclass
class Timing:
    times: list[float] = field(default_factory=list)
    # the process's CPU seconds per run (every thread's: the wall times of a shared box are noise)
    cpu: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def rel_err(got: Any, want: np.ndarray) -> float:
    """max |got - want| / max |want|, in float64, a slice at a time (no whole-size temporaries)."""
    got = np.asarray(got)
    if got.shape != want.shape:
        return float("inf")
    g, w = got.reshape(-1), want.reshape(-1)
    step = 1 << 20
    diff = scale = 0.0
    for i in range(0, w.size, step):
        wi = w[i:i + step].astype(np.float64)
        diff = max(diff, float(np.abs(g[i:i + step].astype(np.float64) - wi).max()))
        scale = max(scale, float(np.abs(wi).max()))
    return diff / (scale or 1.0)


def measure(columns: dict[str, Callable[[], Any]], reps: int, check: Callable[[str, Any], None],
            log: Callable[[str], None]) -> dict[str, Timing]:
    """``reps`` rounds, each timing every column once, in turn, so that a change in background
    load hits all columns alike; each round starts one column further on, so that no column
    always runs right after the same one (a library's idle worker threads spin for a while after
    its call, on the cores the next column runs on). Each result is checked, then dropped before
    the next run, so every run allocates its output the same way."""
    times = {k: Timing() for k in columns}
    labels = list(columns)
    for r in range(reps):
        log(f"repetition {r + 1}/{reps}")
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn = columns[label]
            c0, t0 = time.process_time(), time.perf_counter()
            result = fn()
            times[label].times.append(time.perf_counter() - t0)
            times[label].cpu.append(time.process_time() - c0)
            check(label, result)
            result = None
    return times


def chunks_of(prog: ej.Program, name: str) -> tuple[tuple[int, ...], ...]:
    """Dask chunks equal to the blocks of einjoin's partition of input ``name``."""
    node = prog.graph.input_by_name[name]
    bounds = prog.decomps[node].out_partition.bounds
    return tuple(tuple(int(b - a) for a, b in zip(bs[:-1], bs[1:])) for bs in bounds)


def grid(chunks: tuple[tuple[int, ...], ...]) -> str:
    return "x".join(str(len(c)) for c in chunks) or "1"


@dataclass
class Result:
    case: Case
    prog: ej.Program
    compile_s: float
    times: dict[str, Timing]
    errs: dict[str, float]
    chunks_same: dict[str, tuple[tuple[int, ...], ...]]
    chunks_auto: dict[str, tuple[tuple[int, ...], ...]]
    dask_tasks: dict[str, int]
    notes: list[str]
    load: str = ""
    torch_copies: int | None = None  # bytes the torch backend copied between numpy and torch (last run)


def run_case(case: Case, console: Console, time_left_s: float) -> Result:
    """Measure every column on ``case``; ``time_left_s`` is this case's share of the time budget
    (fewer repetitions, never smaller sizes, when one round of the columns would not fit)."""
    notes: list[str] = []
    watch = CpuWatch()
    log = lambda msg: console.log(f"{escape(case.name)}: {msg}")  # noqa: E731
    t0 = time.perf_counter()
    prog = ej.compile(case.out, devices=ej.local(DEVICES), backend="threads")
    compile_s = time.perf_counter() - t0
    names = [n for n in (x.op.name for x in prog.graph.inputs) if n in case.feeds]  # not bound weights
    feeds = case.feeds

    same = {k: chunks_of(prog, k) for k in names}
    engine_runs: list[tuple[float, float]] = []  # per einjoin run: its engine's wall, its devices' busy spread

    def einjoin_run() -> Any:
        out = prog.run(**feeds)
        rs = prog.run_stats
        busy = rs.busy_time_per_device.values()
        engine_runs.append((rs.wall_time, max(busy) - min(busy)))
        return out

    columns: dict[str, Callable[[], Any]] = {"einjoin": einjoin_run}
    if case.numpy_fn is not None:
        numpy_fn = case.numpy_fn
        columns["numpy"] = lambda: numpy_fn(feeds)
    columns.update({label: (lambda fn=fn: fn(feeds)) for label, fn in case.extra.items()})
    dask_tasks: dict[str, int] = {}
    auto: dict[str, tuple[tuple[int, ...], ...]] = {}
    if case.dask_fn is not None:
        lazy_same = case.dask_fn({k: da.from_array(feeds[k], chunks=same[k]) for k in names})
        auto_in = {k: da.from_array(feeds[k], chunks="auto") for k in names}
        auto = {k: auto_in[k].chunks for k in names}
        lazy_auto = case.dask_fn(auto_in)
        per_worker = max(1, CORES // DEVICES)

        def dask_same() -> np.ndarray:
            with threadpool_limits(limits=per_worker):
                return lazy_same.compute(scheduler="threads", num_workers=DEVICES)

        columns["dask (einjoin blocks)"] = dask_same
        columns["dask (auto chunks)"] = lambda: lazy_auto.compute(scheduler="threads")
        dask_tasks = {"same": len(lazy_same.__dask_graph__()), "auto": len(lazy_auto.__dask_graph__())}
    columns["torch eager"] = lambda: case.torch_fn(feeds)
    prog_t = None
    if case.torch_backend:  # einjoin's torch backend on the same devices, in this process
        from einjoin.runtime.backends.torch_backend import TorchBackend
        prog_t = ej.compile(case.out, devices=ej.local(DEVICES), backend=TorchBackend(), quiet=True)
        if case.torch_in:
            tensors = {k: torch.from_numpy(feeds[k]) for k in names}
            columns[TORCH_COL] = lambda: prog_t.run(**tensors)
        else:
            columns[TORCH_COL] = lambda: prog_t.run(**feeds)
    ref = "numpy" if case.numpy_fn is not None else "torch eager"  # what every result is checked against

    # warm-up: every column once; numpy's result is the reference every later result is checked
    # against (einjoin's warm-up is timed, to size the repetitions)
    log("warm-up")
    warm: dict[str, float] = {}

    def timed(label: str) -> Any:
        t0 = time.perf_counter()
        out = columns[label]()
        warm[label] = time.perf_counter() - t0
        return out

    want = np.asarray(timed(ref))
    ej_out = np.asarray(timed("einjoin"))
    errs = {"einjoin": rel_err(ej_out, want)}
    for label in columns:
        if label not in (ref, "einjoin"):
            errs[label] = rel_err(timed(label), want)
    if case.numpy_label not in ("numpy", ref):
        errs["einjoin vs torch"] = rel_err(ej_out, np.asarray(columns["torch eager"]()))
    ej_out = None
    round_s = sum(warm.values())
    reps = max(1, min(case.reps, int((time_left_s - (time.perf_counter() - watch.start_wall)) // round_s)))
    if reps < case.reps:
        notes.append(f"repetitions reduced from {case.reps} to {reps} for every column, sizes kept: one "
                     f"warm-up round of the columns took {round_s:.1f} s and this case's share of the "
                     f"time budget was {time_left_s:.0f} s")

    def check(label: str, result: Any) -> None:
        if label != ref:
            errs[label] = max(errs[label], rel_err(result, want))

    engine_runs.clear()  # the warm-up's
    times = measure(columns, reps, check, log)
    if engine_runs:
        outside = [t - w for t, (w, _) in zip(times["einjoin"].times, engine_runs)]
        notes.append(f"einjoin per run: {', '.join(f'{t:.3f}' for t in times['einjoin'].times)} s; in Program.run "
                     f"outside the engine's dispatch (checks, BLAS limit, outputs) median "
                     f"{statistics.median(outside) * 1e3:.1f} ms; devices' busy time spread median "
                     f"{statistics.median(s for _, s in engine_runs) * 1e3:.0f} ms")
    if "dask (einjoin blocks)" in times:
        e, d = (statistics.median(times[k].cpu) for k in ("einjoin", "dask (einjoin blocks)"))
        notes.append(f"CPU per run (the process's, every thread; a spinning BLAS thread of the column before "
                     f"counts too) median: einjoin {e:.3f} s, dask (einjoin blocks) {d:.3f} s, ratio {e / d:.2f}")
    copies = None
    if prog_t is not None:
        out = columns[TORCH_COL]()
        if case.torch_in and not isinstance(out, torch.Tensor):
            notes.append(f"torch in gave {type(out).__name__} out, not a tensor")
        copies = prog_t.backend.host_copies
    return Result(case, prog, compile_s, times, errs, same, auto, dask_tasks, notes, watch.others(),
                  torch_copies=copies)


# --------------------------------------------------------------------------------------------
# memory: peak RSS of one LLaMA-block run, each peer in a fresh child process

MIB = 1 << 20


@dataclass
class MemoryRow:
    got: dict[str, list[dict[str, Any]]]  # peer -> one report per fresh child

    def above(self, peer: str) -> float:
        """The peer's peak above its import baseline (MiB), the median over its children."""
        return statistics.median((g["peak"] - g["imports"]) / MIB for g in self.got[peer])

    def total(self, peer: str) -> float:
        return statistics.median(g["peak"] / MIB for g in self.got[peer])


def memory_row(children: int, log: Callable[[str], None]) -> MemoryRow:
    """``children`` fresh processes per peer, in turn (einjoin, numpy, hand-written, again ...)."""
    return MemoryRow(in_children(children, log))


# --------------------------------------------------------------------------------------------
# per-task dispatch: tiny elementwise tasks, einjoin's threads backend vs dask's threaded scheduler


@dataclass
class DispatchRow:
    tasks: int                     # kernel tasks per run (einjoin's; dask runs as many)
    all_tasks: int                 # einjoin's tasks per run, its loads and frees too
    einjoin: Timing                # seconds per kernel task, one entry per run
    dask: Timing


def dispatch_row(chain_ops: int, reps: int, log: Callable[[str], None]) -> DispatchRow:
    """Two 8x8 inputs, each through ``chain_ops`` alternating ``* 1.0001`` / ``- 0.25`` ops,
    compiled unfused (``fuse=False``: a task per op and block) on ``local(2)``; dask's threaded
    scheduler (2 workers) runs a raw graph of the same blocks and ops, a task per op and block
    (no graph building or optimisation timed: its scheduler alone). Per run, seconds / kernel
    tasks; ``reps`` runs each, alternating, after a warm-up."""
    import dask.threaded

    def op(i: int) -> Callable[[np.ndarray], np.ndarray]:
        return (lambda a: a * np.float32(1.0001)) if i % 2 else (lambda a: a - np.float32(0.25))

    ins = [ej.input(f"t{c}", (8, 8)) for c in range(2)]
    outs = []
    for y in ins:
        for i in range(chain_ops):
            y = y * 1.0001 if i % 2 else y - 0.25
        outs.append(y)
    log(f"dispatch: compiling {2 * chain_ops} tiny ops (fuse=False)")
    prog = ej.compile(outs, devices=ej.local(DEVICES), backend="threads", quiet=True, fuse=False)
    feeds = {f"t{c}": np.ones((8, 8), np.float32) for c in range(2)}
    kernels = prog.stats.task_counts.get("kernel", 0)
    fns = [op(i) for i in range(chain_ops)]
    dsk: dict[Any, Any] = {}
    keys = []
    for c in range(2):
        for b, box in enumerate(chunks_box(prog, f"t{c}")):
            dsk[(c, b, 0)] = feeds[f"t{c}"][box]
            for i in range(chain_ops):
                dsk[(c, b, i + 1)] = (fns[i], (c, b, i))
            keys.append((c, b, chain_ops))
    n_dask = len(dsk) - len(keys)
    want = [np.asarray(o) for o in prog.run(**feeds)]
    row = DispatchRow(kernels, sum(prog.stats.task_counts.values()), Timing(), Timing())
    dask.threaded.get(dsk, keys, num_workers=DEVICES)
    for r in range(reps):
        log(f"dispatch: repetition {r + 1}/{reps}")
        t0 = time.perf_counter()
        got = prog.run(**feeds)
        row.einjoin.times.append((time.perf_counter() - t0) / kernels)
        t0 = time.perf_counter()
        dask.threaded.get(dsk, keys, num_workers=DEVICES)
        row.dask.times.append((time.perf_counter() - t0) / n_dask)
    assert all(np.array_equal(a, b) for a, b in zip(want, got)), "einjoin's tiny chain changed between runs"
    if n_dask != kernels:  # the same blocks and ops: one dask task per einjoin kernel
        log(f"[yellow]dispatch: dask ran {n_dask} tasks, einjoin {kernels} kernels[/]")
    return row


def chunks_box(prog: ej.Program, name: str) -> list[tuple[slice, ...]]:
    """The slices of einjoin's blocks of input ``name`` (the dispatch row's dask blocks)."""
    node = prog.graph.input_by_name[name]
    part = prog.decomps[node].out_partition
    return [part.slices(k) for k in part.keys()]


# --------------------------------------------------------------------------------------------
# reporting


def blas_lines() -> list[str]:
    lines = []
    for lib in threadpool_info():
        lines.append(f"  {lib.get('user_api')}: internal_api={lib.get('internal_api')} "
                     f"version={lib.get('version')} architecture={lib.get('architecture', '-')} "
                     f"num_threads={lib.get('num_threads')} ({os.path.basename(lib.get('filepath', ''))})")
    cfg = torch.__config__.show()
    torch_blas = "MKL" if torch.backends.mkl.is_available() else ("OpenBLAS" if "OpenBLAS" in cfg else "?")
    lines.append(f"  torch: BLAS {torch_blas}, intra-op threads {torch.get_num_threads()}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        lines.append(f"  {var}={os.environ.get(var, '(unset)')}")
    return lines


def fmt_s(t: Timing | None) -> str:
    if t is None:
        return "-"
    return f"{t.median:.3f}" + ("" if len(t.times) > 1 else "*")


def report(results: list[Result], console: Console, total_s: float, watch: CpuWatch,
           memory: MemoryRow | None = None, dispatch: DispatchRow | None = None) -> None:
    cols = {"einjoin": "einjoin\nlocal(2)", "numpy": "numpy", "dask (einjoin blocks)": "dask\neinjoin's\nblocks",
            "dask (auto chunks)": "dask\nauto\nchunks", "torch eager": "torch\neager"}
    table = Table(title=f"einjoin on ej.local({DEVICES}) (threads backend, numpy kernels) vs "
                        f"single-process peers: median seconds")
    table.add_column("case", justify="left", max_width=52)
    for c in cols.values():
        table.add_column(c + "\n(s)", justify="right")
    table.add_column("einjoin\n/ numpy", justify="right")
    table.add_column("einjoin\n/ dask\nsame blocks", justify="right")
    table.add_column("einjoin\n/ torch\neager", justify="right")
    table.add_column("einjoin max\nrel err vs\nreference", justify="right")

    def ratio(t: dict[str, Timing], peer: str) -> str:
        return f"{t['einjoin'].median / t[peer].median:.2f}" if peer in t else "-"

    for r in results:
        t = r.times
        name = r.case.name
        if r.case.numpy_fn is None:
            name += "\n(no numpy or dask peer; error vs torch eager)"
        elif r.case.numpy_label != "numpy":
            name += f"\n(numpy column = {r.case.numpy_label})"
        table.add_row(escape(name), *(fmt_s(t.get(c)) for c in cols), ratio(t, "numpy"),
                      ratio(t, "dask (einjoin blocks)"), ratio(t, "torch eager"), f"{r.errs['einjoin']:.1e}")
    if memory is not None:
        mem_e, mem_n = memory.above("einjoin"), memory.above("numpy")
        table.add_row("LLaMA block peak RSS, MiB above the import baseline\n(VmHWM, a fresh process each; "
                      "goal <= 1.30 numpy)", f"{mem_e:.0f}", f"{mem_n:.0f}", "-", "-", "-", f"{mem_e / mem_n:.2f}",
                      "-", "-", "-")
    if dispatch is not None:
        us_e, us_d = dispatch.einjoin.median * 1e6, dispatch.dask.median * 1e6
        table.add_row(f"tiny tasks: us per task, {dispatch.tasks} 8x8 elementwise tasks\n(fuse=False; dask's "
                      f"scheduler on the same blocks; goal <= 1.00 dask)", f"{us_e:.1f}", "-", f"{us_d:.1f}", "-",
                      "-", "-", f"{us_e / us_d:.2f}", "-", "-")
    console.print(table)
    console.print("ratios < 1: einjoin faster. '*': a single timed repetition. Every column ran once "
                  "untimed (warm-up), then the timed repetitions went round the columns in turn; every "
                  "result, warm-up and timed, was checked against numpy's (torch's for the imported models; max "
                  "over all runs shown).")

    console.print("\n[bold]per case: einjoin's plan and run, the dask graphs, the peers' agreement[/]")
    for r in results:
        s, rs = r.prog.stats, r.prog.run_stats
        tc = ", ".join(f"{k} {v}" for k, v in sorted(s.task_counts.items(), key=lambda kv: -kv[1]))
        console.print(f"[bold]{escape(r.case.name)}[/]")
        per_device = ", ".join(f"{d}: {f / 1e9:.1f}" for d, f in sorted(s.flops_per_device.items()))
        console.print(f"  plan: moved {human_bytes(s.bytes_moved)}, loaded {human_bytes(s.bytes_loaded)}, "
                      f"fetched {human_bytes(s.bytes_fetched)}, {s.flops / 1e9:.1f} GFLOP "
                      f"(per device: {per_device}); "
                      f"{sum(s.task_counts.values())} tasks ({tc}); compiled in {r.compile_s * 1e3:.0f} ms")
        if rs is not None:
            busy = ", ".join(f"{d}: {b:.2f} s" for d, b in sorted(rs.busy_time_per_device.items()))
            peak = ", ".join(f"{d}: {human_bytes(p)}" for d, p in sorted(rs.peak_bytes_per_device.items()))
            console.print(f"  last run: moved {human_bytes(rs.bytes_moved)}, engine wall {rs.wall_time:.3f} s "
                          f"of {r.times['einjoin'].times[-1]:.3f} s in Program.run, busy per device {busy}, "
                          f"peak per device {peak}")
        blocks = ", ".join(f"{k} {grid(c)}" for k, c in r.chunks_same.items())
        if r.dask_tasks:
            autos = ", ".join(f"{k} {grid(c)}" for k, c in r.chunks_auto.items())
            console.print(f"  input blocks (einjoin = dask same): {blocks}; dask auto: {autos}; "
                          f"dask graph tasks: same {r.dask_tasks['same']}, auto {r.dask_tasks['auto']}")
        else:
            console.print(f"  input blocks: {blocks}; {len(r.prog.graph.ops)} ops imported from torch")
        errs = ", ".join(f"{k} {v:.1e}" for k, v in r.errs.items() if k != "einjoin")
        if errs:
            console.print(f"  max rel err vs {escape(r.case.numpy_label)}: {escape(errs)}")
        for label in r.case.extra:
            console.print(f"  {escape(label)}: {fmt_s(r.times[label])} s "
                          f"(einjoin / it = {r.times['einjoin'].median / r.times[label].median:.2f})")
        reps = {len(t.times) for t in r.times.values()}
        console.print(f"  timed repetitions: {', '.join(map(str, sorted(reps)))}; while it ran: {r.load}")
        for n in r.notes:
            console.print(f"  [yellow]note[/]: {escape(n)}")
    if memory is not None:
        report_memory(memory, console)
    if dispatch is not None:
        report_dispatch(dispatch, console)
    torch_rows = [r for r in results if TORCH_COL in r.times]
    if torch_rows:
        tt = Table(title=f"einjoin's torch backend (CPU, ej.local({DEVICES}): {DEVICES} device threads x "
                         f"{max(1, CORES // DEVICES)} torch threads) vs torch eager ({CORES} threads), "
                         f"one process, the same run: median seconds")
        for c in ("case", "einjoin\ntorch\nbackend (s)", "torch\neager (s)",
                  "einjoin torch\n/ torch eager\n(goal <= 1.10)", "einjoin torch\n/ einjoin\nthreads", "fed",
                  "bytes copied\nnumpy<->torch"):
            tt.add_column(c, justify="left" if c == "case" else "right")
        for r in torch_rows:
            t = r.times
            tt.add_row(escape(r.case.name), fmt_s(t[TORCH_COL]), fmt_s(t["torch eager"]),
                       f"{t[TORCH_COL].median / t['torch eager'].median:.2f}",
                       f"{t[TORCH_COL].median / t['einjoin'].median:.2f}",
                       "torch tensors" if r.case.torch_in else "numpy arrays",
                       str(r.torch_copies) if r.torch_copies is not None else "-")
        console.print(tt)
    console.print(f"\ntotal benchmark time: {total_s:.1f} s; while it ran: {watch.others()}")


def report_memory(m: MemoryRow, console: Console) -> None:
    console.print("\n[bold]memory: peak RSS of the llama case's block, each peer in fresh processes "
                  f"({len(m.got['einjoin'])} each, median), two runs each (results dropped between)[/]")
    console.print("  peak RSS (VmHWM, MiB) after: the imports (numpy, einjoin: every peer's the same) / the "
                  "feeds / compiling / the runs; the runs' peak above the import baseline; vs numpy's")
    for peer, got in m.got.items():
        g = got[len(got) // 2]
        comp = f" / {g['compiled'] / MIB:.0f}" if "compiled" in g else " / -"
        stores = f"; its stores counted {g['stores'] / MIB:.0f} MiB of blocks" if "stores" in g else ""
        console.print(f"  {escape(peer)}: {g['imports'] / MIB:.0f} / {g['feeds'] / MIB:.0f}{comp} / "
                      f"{m.total(peer):.0f}; above imports {m.above(peer):.0f} MiB "
                      f"({m.above(peer) / m.above('numpy'):.2f}x numpy's, "
                      f"total {m.total(peer) / m.total('numpy'):.2f}x){stores}")
    r = m.above("einjoin") / m.above("numpy")
    console.print(f"  einjoin local({DEVICES}) / numpy (ej.reference), above the import baseline: {r:.2f} "
                  f"(goal <= 1.30: {'met' if r <= 1.3 else 'NOT met'})")


def report_dispatch(d: DispatchRow, console: Console) -> None:
    e, k = d.einjoin.median, d.dask.median
    console.print(f"\n[bold]dispatch: {d.tasks} tiny kernel tasks per run ({d.all_tasks} with loads and "
                  f"frees), median of {len(d.einjoin.times)} runs[/]")
    console.print(f"  einjoin threads local({DEVICES}): {e * 1e6:.1f} us per kernel task "
                  f"({e * d.tasks / d.all_tasks * 1e6:.1f} us per task, loads and frees counted); dask threaded "
                  f"scheduler, {DEVICES} workers: {k * 1e6:.1f} us per task; einjoin / dask {e / k:.2f} "
                  f"(goal <= 1.00: {'met' if e <= k else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    global DEVICES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="matmul,chain,mlp,llama,llama-import,resnet18,vit-tiny,memory,dispatch",
                    help="comma-separated subset of matmul,chain,mlp,llama,llama-import,resnet18,vit-tiny and "
                         "the rows memory (peak RSS of the llama block, fresh processes) and dispatch (tiny tasks)")
    ap.add_argument("--memory-children", type=int, default=2, help="fresh processes per peer for the memory row")
    ap.add_argument("--tiny-tasks", type=int, default=10000,
                    help="about how many tiny kernel tasks the dispatch row's graph has")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per column (after a warm-up)")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="seconds for the whole run; cases get fewer repetitions (never smaller "
                         "sizes) when their share would be exceeded")
    ap.add_argument("--devices", type=int, default=2,
                    help="einjoin devices of the cases and the dispatch row (issue 22's 16-core table: 1, 4, 16)")
    args = ap.parse_args(argv)
    DEVICES = max(1, args.devices)
    console = Console(width=None if sys.stdout.isatty() else 190, log_path=False)
    torch.set_num_threads(CORES)
    dask.config.set(scheduler="threads")

    console.print(f"[bold]einjoin local execution benchmark[/]: {CORES} cores, {DEVICES} einjoin devices; "
                  f"python {platform.python_version()}, numpy {np.__version__}, dask {dask.__version__}, "
                  f"torch {torch.__version__}, einjoin {ej.__version__}")
    console.print("BLAS and threads (as found, nothing changed):")
    for line in blas_lines():
        console.print(escape(line))
    if CORES < 16:
        console.print(f"note: {CORES} cores: issue 22's 16-core table (local(n), n in 1, 4, 16) is not measured here")
    console.print(f"threads: einjoin {DEVICES} device threads x {max(1, CORES // DEVICES)} BLAS; "
                  f"dask (einjoin blocks) {DEVICES} workers x {max(1, CORES // DEVICES)} BLAS; "
                  f"dask (auto) default workers, BLAS untouched; numpy and torch {CORES} threads")

    makers = {"matmul": matmul_case, "chain": chain_case, "mlp": mlp_case, "llama": llama_case,
              "llama-import": llama_import_case, "resnet18": resnet_case, "vit-tiny": vit_case}
    la = os.getloadavg() if hasattr(os, "getloadavg") else ()
    console.print("load average at start: " + " ".join(f"{x:.2f}" for x in la))
    watch = CpuWatch()
    rng = np.random.default_rng(0)
    results = []
    keys = [k.strip() for k in args.cases.split(",")]
    rows = [k for k in keys if k in ("memory", "dispatch")]
    keys = [k for k in keys if k not in rows]
    for i, key in enumerate(keys):
        case = makers[key](rng)
        case.reps = args.reps
        # the case's share of what is left of the budget: weights by size of the work (the chain
        # and the LLaMA block take about twice the others)
        weights = {"chain": 2.0, "llama": 3.0, "llama-import": 2.5, "resnet18": 1.5, "vit-tiny": 1.5}
        weight = weights.get(key, 1.0)
        rest = sum(weights.get(k, 1.0) for k in keys[i:])
        share = (args.budget - (time.perf_counter() - T_START)) * weight / rest
        results.append(run_case(case, console, share))
    log = lambda msg: console.log(msg)  # noqa: E731
    memory = memory_row(args.memory_children, log) if "memory" in rows else None
    dispatch = dispatch_row(max(1, args.tiny_tasks // (2 * DEVICES)), args.reps, log) if "dispatch" in rows else None
    report(results, console, time.perf_counter() - T_START, watch, memory, dispatch)
    bad = [r.case.name for r in results if not r.errs["einjoin"] < 1e-3]
    if bad:
        console.print(f"[red]einjoin result differs from the reference[/] in: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
