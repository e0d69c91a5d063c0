"""The tunables of the optimizer and the memory fitting, in one documented, frozen object.

Every knob that shapes a plan (how many kernels an op may be cut into, how much of a device a
kernel may hold, how much work the searches may do: work, never wall-clock time, so that a plan
depends on shapes alone) is a field of :class:`Settings`; the code reads them
from :data:`SETTINGS` (or from a ``settings`` argument where a function takes one), never from a
module constant of its own. Change one by building a new object, never by mutation:

>>> from einjoin.settings import SETTINGS
>>> SETTINGS.max_kernels
4096
>>> SETTINGS.replace(max_kernels=1024).max_kernels
1024

This module sits at the base floor: it imports nothing from einjoin but its errors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from einjoin.errors import EinjoinError

__all__ = ["Settings", "SETTINGS"]


@dataclass(frozen=True)
class Settings:
    """The tunables; each field's docstring says what it bounds and why it has its value."""

    max_kernels: int = 4096
    """Kernels one op may be cut into when cutting for a memory cap (by the optimizer's fitting
    or the memory planner's finer cuts): beyond this, per-task overhead dwarfs the kernels."""

    kernel_share: float = 0.75
    """Under a cap, the share of it one kernel may hold: the rest keeps the next kernel's inputs
    loading while this one runs (and values waiting for their readers), so transfers overlap
    compute instead of every kernel waiting for the eviction before it."""

    finer_window: int = 4
    """Among the cuts that fit a cap, none more than this many times finer than the coarsest:
    finer cuts only add per-task overhead and exchange, unless they line up with neighbours."""

    fit_beam: int = 16
    """Specs refined per step of the optimizer's fitting search: bounds that search for ops with
    many labels under tiny caps."""

    fit_leaps: int = 64
    """When no doubling lowers an op's need, the whole-or-element cuts tried at most (2^labels
    grows fast), and the divisor cuts tried per label of a reshape."""

    fit_rounds: int = 512
    """Rounds of cutting the ops at fault finer after lowering under a cap (each round doubles a
    block count of every op at fault) before giving up."""

    candidate_over: tuple[int, ...] = (1, 2, 4)
    """An op's candidate specs have k * P blocks for k in this tuple (over-decomposition lets
    cuts line up with neighbours and fit caps)."""

    refine_rounds: int = 6
    """Rounds of eindecomp's refinement (trees re-solved with their neighbours' choices, then
    single-op moves) while the total still falls."""

    local_search_rounds: int = 8
    """Sweeps of single-op moves in eindecomp's local search while one still lowers the total."""

    tie_break_rounds: int = 2
    """Sweeps of single-op moves that keep the bytes and lower the bytes waiting on compute."""

    ilp_max_ops: int = 200
    """eindecomp runs its global ILP step on graphs of at most this many (planned) ops."""

    ilp_keep: int = 40
    """Candidates per op offered to eindecomp's ILP step (besides the DP's choice)."""

    ilp_node_limit: int = 500
    """Branch-and-bound nodes HiGHS may explore in eindecomp's ILP step: the deterministic
    stopping rule (a plan depends on shapes alone, never on the machine's load), the best
    solution within it kept. Measured (HiGHS 1.12 via scipy 1.17, Dec 2026): every solve of the
    golden graphs (LLaMA block, MLP, chain at P = 2..64), of bench/plan_quality.py's cases
    (P = 2..64; up to 84k variables, LLaMA-7B b8) and the 419 of the planner tests needs 0 or 1
    node: the local-polytope relaxation is integral at the root. 500 leaves a wide margin while
    bounding a pathological solve (frustrated random problems needed 3 to ~1000 nodes)."""

    ilp_time_limit: float = 300.0
    """Seconds after which HiGHS gives up on eindecomp's ILP step: only a far safety net
    (``ilp_node_limit`` is the stopping rule). The slowest measured solve, LLaMA-7B b8 at P = 16
    (84k variables, one node), took 11 s, and 108 s on a loaded 2-core machine (the old 30 s
    limit made such plans depend on the load); the golden LLaMA block at P = 64 about 1 s.
    300 s is about three times the loaded worst: a compile never blocks for long on a
    pathological graph.
    Hitting it makes the plan depend on the machine, so it is reported by an
    ``einjoin.planner.ilp.IlpTimeLimitWarning``; the DP's plan is kept if HiGHS found none."""

    ilp_lp_first: bool = True
    """eindecomp's ILP step (and ``mesh_ilp``) in a tighter exact formulation (replica rows per
    op, strategies with equal edge costs merged) whose LP relaxation is solved first, by dual
    simplex: when it is integral (every planner ILP measured so far) it is the optimum, with no
    branch and bound; otherwise the MIP runs under ``ilp_node_limit``. 3 to 10 times faster
    (GPT-2 block's training graph at P = 2: ILP 4.7 s -> 0.5 s; ej.grad + compile 4.9 s -> 0.7 s,
    the LLaMA block's 1.4 s -> 0.5 s: issue 18's 1 s goal) and the same modelled bytes on every
    graph measured. Among plans of equal modelled bytes it may pick another than the MIP solver
    did, and placement moves different bytes for such ties (a cost-model blind spot: the
    partitions of elementwise ops), within about +-4% both ways: the golden LLaMA block at
    P = 64 moves 1.5% more (tests/test_plan_golden.py), GPT-2's forward at P = 2 3.2% less.
    False: the MIP on the looser formulation (the plans before issue 18's last change)."""

    ilp_cost_range: float = 1000.0
    """The planner ILPs' largest cost coefficient (all costs are bytes scaled by one factor):
    HiGHS's tolerances are about 1e-7 absolute, so scaled to 1 two plans of a 4 GB training
    graph 192 bytes apart looked equal and solves of the same problem returned either (measured,
    HiGHS 1.12 via scipy 1.17, Dec 2026); at 1000 they differ by 5e-5 and the solve is
    repeatable, while the costs stay far below where the LP's numerics suffer. Every golden plan
    (forward and training) is the same at 1 and at 1000."""

    exhaustive_max_ops: int = 4
    """The exhaustive search (ground truth for tests) takes graphs of at most this many ops."""

    mesh_ilp_keep: int = 12
    """Strategies per op and mesh offered to the ``mesh_ilp`` baseline (the cheapest by op bytes)."""

    mesh_ilp_node_limit: int = 500
    """Branch-and-bound nodes HiGHS may explore for each mesh of the ``mesh_ilp`` baseline (the
    deterministic stopping rule, as ``ilp_node_limit``). Measured as there: every mesh solve of
    the golden graphs, bench/plan_quality.py's cases (P = 2..64) and the planner tests needs 0
    or 1 node (at most 7k variables)."""

    mesh_ilp_time_limit: float = 600.0
    """Seconds after which HiGHS gives up on one mesh of the ``mesh_ilp`` baseline: only a far
    safety net (``mesh_ilp_node_limit`` is the stopping rule; the slowest measured mesh solve took
    1.4 s on a loaded machine); hitting it is reported by an
    ``einjoin.planner.ilp.IlpTimeLimitWarning``."""

    task_overhead: float = 5e-5
    """Seconds one task costs the threads backend beyond its kernel (dispatch, the ready queue,
    handing blocks between worker threads), for ``ej.compile(..., leave_idle=True)``'s choice of
    how many devices pay (:mod:`einjoin.planner.overhead`). A constant measured here until the
    simulator issue calibrates one. Tiny elementwise kernels and their frees (bench/plan_quality.py
    prints the figure) took 16-23 us a task on ``local(1)``/``local(2)`` on a 2-core machine,
    56-110 us when it was heavily loaded (Dec 2026); tasks of real models cost more than tiny
    ones, their moves hand blocks between threads (the LLaMA block on ``local(2)``: ~80 us a
    task all in); 50 us sits between."""

    flop_rate: float = 5e9
    """Modelled flops per second of one device's kernels (one core of numpy/BLAS), the other half
    of that choice: work per device against per-task overhead. A 512^3 float32 matmul ran at
    2.8 GFLOP/s on the same busy machine; 5e9 leans toward using the devices."""

    progress_plan_ops: int = 200
    """Graphs with at least this many ops show compile stages on a terminal."""

    progress_run_tasks: int = 2000
    """Task graphs with at least this many tasks show a run bar on a terminal."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "candidate_over":
                ok = (isinstance(value, tuple) and len(value) > 0
                      and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in value))
            elif f.name == "kernel_share":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
            elif isinstance(f.default, bool):
                ok = isinstance(value, bool)
            elif isinstance(f.default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not ok:
                raise EinjoinError(f"Settings.{f.name} = {value!r:.60} is not a valid value "
                                   f"(default {f.default!r})")

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied (checked as at construction)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise EinjoinError(f"Settings has no field {unknown[0]!r}")
        return dataclasses.replace(self, **changes)


SETTINGS = Settings()
"""The defaults every planner and the memory fitting use."""
