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
thread CPU on its part), the wall time the run would take on idle cores.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import einjoin as ej

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
        if cores > 1:
            peers[f"torch.sparse {cores} threads"] = torch_at(cores)
    except ImportError:
        pass
    got = {k: timed(f, reps)[:2] for k, f in peers.items()}
    best_cpu, best_wall = min(c for c, _ in got.values()), min(w_ for _, w_ in got.values())
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
        row(name, f"einjoin {n} device{'s' if n > 1 else ''} (threads)", c, best_cpu, note)
