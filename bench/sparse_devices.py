"""bench/sparse.py's rows for sparse einsums on several devices (issue 24): GNN ``A·H`` and
``A·H·W`` on the power-law graph (H: nodes × 128, W: 128 × 32) on 1 and 2 devices
(``backend="threads"``) against ``scipy.sparse`` and ``torch.sparse`` (1 thread, and every core) on
the same data.

Each row gives CPU time (``time.process_time``: every thread counted) and, in its notes, wall time
(``time.perf_counter``), both medians of ``reps`` runs of the compiled plan; the ratio column is
CPU over the faster peer's CPU, the wall ratio over the faster peer's wall. On a shared box wall
times are noise: re-measure them on a quiet machine (``.venv/bin/python bench/sparse.py``).
The 2-device row names the split and what moved between the devices, and its busiest-device
path: the driver's CPU plus, per step, the CPU of the device that took longest (each device's
thread CPU on its part), the wall time the run would take on idle cores, and the issue's goal
verdict (ok / MISS): einjoin on 2 devices at most 1.0x the faster of scipy / torch.sparse at up to
2 threads, on CPU and on wall time. Last, the dense plan (A as a dense input, ``ej.compile`` on the
``null`` backend: planned, never run) with its planned peak bytes against this machine's memory, at
the bench's size and the issue's 200000 nodes: infeasible where they exceed it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import einjoin as ej
from einjoin.frontend.functions import input as dense_input  # ej.input, typed for mypy
from einjoin.frontend.tensor import einsum

Row = Callable[..., None]


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float, Any]:
    """(median CPU s, median wall s, last result)."""
    cpu, wall, out = [], [], None
    for _ in range(reps):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall), out


def devices_case(row: Row, g: Any, h: np.ndarray, w: np.ndarray, reps: int) -> None:
    """Rows for ``A·H`` (``ij,jk->ik``) and ``A·H·W`` (``ij,jk,kl->il``) on 1 and 2 devices and
    the peers, via ``row``."""
    for eq, dense in (("ij,jk->ik", [h]), ("ij,jk,kl->il", [h, w])):
        _case(row, g, eq, dense, reps)


def _case(row: Row, g: Any, eq: str, dense: list[np.ndarray], reps: int) -> None:
    name = f"{'A·H·W' if len(dense) > 1 else 'A·H'} devices ({g.shape[0]} nodes)"

    def chain(first: Any, rest: list[Any]) -> Any:
        for d in rest:
            first = first @ d
        return first
    want = chain(g @ dense[0], dense[1:])
    peers: dict[str, Callable[[], Any]] = {"scipy.sparse": lambda: chain(g @ dense[0], dense[1:])}
    try:
        import torch
        ta = torch.sparse_csr_tensor(torch.from_numpy(g.indptr.astype(np.int64)),
                                     torch.from_numpy(g.indices.astype(np.int64)), torch.from_numpy(g.data), g.shape)
        tds = [torch.from_numpy(d) for d in dense]
        threads = torch.get_num_threads()

        def torch_at(n: int) -> Callable[[], Any]:
            def go() -> Any:
                torch.set_num_threads(n)
                try:
                    return chain(torch.sparse.mm(ta, tds[0]), tds[1:])
                finally:
                    torch.set_num_threads(threads)
            return go
        peers["torch.sparse 1 thread"] = torch_at(1)
        cores = os.cpu_count() or 1
        for n in sorted({min(cores, 2), cores} - {1}):  # 2 threads: the 2 devices' match
            peers[f"torch.sparse {n} threads"] = torch_at(n)
    except ImportError:
        pass
    got = {k: timed(f, reps)[:2] for k, f in peers.items()}
    best_cpu, best_wall = min(c for c, _ in got.values()), min(w_ for _, w_ in got.values())
    # the goal's peers: scipy and torch on at most 2 threads (the 2 devices' cores)
    at2 = [v for k, v in got.items() if not k.startswith("torch") or int(k.split()[1]) <= 2]
    goal_cpu, goal_wall = min(c for c, _ in at2), min(w_ for _, w_ in at2)
    for k, (c, wl) in got.items():
        row(name, k, c, best_cpu, f"wall {wl * 1e3:.1f} ms ({wl / best_wall:.2f}x)")
    a = ej.sparse("A", g)
    for n in (1, 2):
        plan = ej.sparse_compile(eq, a, *dense, devices=n, backend="threads")
        plan.run()  # warm: the layouts of steps chosen at run, the device threads' BLAS share
        paths: list[float] = []

        def run_and_path(plan: Any = plan, paths: list[float] = paths) -> Any:
            c0 = time.process_time()
            out = plan.run()
            ex = [s.exchange for s in plan.steps if s.exchange is not None]
            if ex:  # the driver's CPU plus, per step, the busiest device's: the wall of idle cores
                paths.append(time.process_time() - c0 - sum(sum(e.cpu) for e in ex) + sum(max(e.cpu) for e in ex))
            return out
        c, wl, out = timed(run_and_path, reps)
        assert np.allclose(out.todense(), want)
        moved = [s.exchange for s in plan.steps if s.exchange is not None and s.exchange.split is not None]
        note = f"wall {wl * 1e3:.1f} ms ({wl / best_wall:.2f}x); {plan.notation()}"
        if paths:
            note += f"; busiest-device path {statistics.median(paths) * 1e3:.1f} ms CPU"
        if moved:
            note += "; " + "; ".join(f"split {e.split.label} ({e.split.kind}), moved {e.moved} tuples "
                                     f"{e.moved_bytes / 2 ** 20:.1f} MiB, joined/device {e.joined}"
                                     for e in moved if e.split is not None)
        if n == 2:
            note += (f"; goal <= 1.0x the faster peer at <= 2 threads: CPU {c / goal_cpu:.2f} "
                     f"{'ok' if c <= goal_cpu else 'MISS'}, wall {wl / goal_wall:.2f} "
                     f"{'ok' if wl <= goal_wall else 'MISS'}")
        row(name, f"einjoin {n} device{'s' if n > 1 else ''} (threads)", c, best_cpu, note)
    if len(dense) > 1:
        for nodes in sorted({g.shape[0], 200000}):
            _dense_infeasible(name.replace(f"({g.shape[0]} ", f"({nodes} "), nodes, dense)


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _dense_infeasible(name: str, nodes: int, dense: list[np.ndarray]) -> None:
    """A row for the dense plan of ``(A·H)·W`` on 2 devices with A a dense ``nodes``² input: its
    planned peak bytes (``ej.compile(..., backend="null")``, no data) against this machine's memory."""
    a = dense_input("A", (nodes, nodes), "float64")
    h = dense_input("H", (nodes, dense[0].shape[1]), "float64")
    w = dense_input("W", dense[1].shape, "float64")
    prog = ej.compile(einsum("ij,jk->ik", a, h) @ w, devices=2, backend="null", quiet=True)
    peak = sum(prog.stats.peak_bytes_per_device.values())  # local devices share this host's memory
    mem = machine_memory()
    verdict = "infeasible" if peak > mem else "feasible"
    per = " + ".join(f"{b / 2 ** 30:.1f}" for b in prog.stats.peak_bytes_per_device.values())
    print(f"{name:28s} {'einjoin dense A, 2 devices':26s} {'-':>10s} {'-':>8s}  not run: {verdict}, planned peak "
          f"{peak / 2 ** 30:.1f} GiB ({per}) vs {mem / 2 ** 30:.1f} GiB of memory; {prog.stats.flops / 1e9:.0f} GFLOP")
