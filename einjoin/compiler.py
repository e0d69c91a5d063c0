"""The compile pipeline behind ``ej.compile``: outputs, devices and :class:`CompileOptions` in, a
:class:`CompiledPlan` out (plan the join-agg specs, decompose, place, synthesise the exchanges,
build the task graph, fit the memory caps). :class:`einjoin.program.Program` runs a plan.

Each option of ``ej.compile`` is one field of :class:`CompileOptions`, checked once when the
object is built; an option to come (an objective, fusion, an engine, training state) is one more
field and one more check there, and whatever reads it finds it on ``plan.options``.

>>> import einjoin as ej
>>> from einjoin.compiler import CompileOptions, Source, build_plan
>>> x = ej.input("x", (64, 32)); w = ej.input("w", (32, 16))
>>> plan = build_plan(Source.of(x @ w), ej.local(4), CompileOptions(planner="split_largest", quiet=True))
>>> plan.cluster.size, plan.options.backend.name, plan.stats == plan.taskgraph.stats()
(4, 'threads', True)
>>> CompileOptions(placement="nearest")  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
einjoin.errors.EinjoinError: unknown placement 'nearest'; known: ...
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

import numpy as np

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import Decomposition, decompose
from einjoin.decomp.spec import JoinAggSpec
from einjoin.errors import EinjoinError
from einjoin.exchange.tasks import TaskKind
from einjoin.ir.fuse import fuse_elementwise
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.memplan import POLICIES, parse_caps, plan_memory, task_needs
from einjoin.memplan.chain import chain_reduces
from einjoin.memplan.needs import blamed_op, cap_error, refuse_unfittable
from einjoin.ir.printing import describe
from einjoin.placement import PLACERS, Placement, place, tie_homes
from einjoin.plan import PlanStats, TaskGraph, build_taskgraph
from einjoin.plan.stats import with_state
from einjoin.planner import PLANNERS, derive_input_specs, plan_specs, tie_state
from einjoin.planner.cost import OBJECTIVES
from einjoin.planner.fit import element_spec, finer_spec
from einjoin.planner.gcpause import old_objects_frozen
from einjoin.planner.overhead import device_ladder, plan_time, time_floor
from einjoin.progress import stages
from einjoin.runtime import get_backend
from einjoin.runtime.engine import check_host_link, check_order, check_seed
from einjoin.runtime.state import StateSlot
from einjoin.settings import SETTINGS
from einjoin.sparse.pins import check_pins, pin_graph
from einjoin.variants import call_template, check_cache_size

__all__ = ["CompileOptions", "CompiledPlan", "Source", "build_plan", "check_quiet"]


def check_quiet(quiet: Any) -> None:
    """``quiet`` is True, False or None (None: the default)."""
    if quiet is not None and not isinstance(quiet, (bool, np.bool_)):
        raise EinjoinError(f"quiet must be True or False, got {type(quiet).__name__} {quiet!r:.60}")


@dataclass(frozen=True)
class CompileOptions:
    """The options of ``ej.compile`` (all but the outputs and the devices), checked when built:
    a bad one raises an :class:`EinjoinError` naming it, before anything is planned.

    - ``planner``: a registered name (:data:`einjoin.planner.PLANNERS`) or a
      :class:`einjoin.planner.Planner`, ``(graph, cluster, *, memory_limit) -> {node: join-agg
      spec}`` (a plain ``(graph, cluster)`` callable is adapted);
    - ``backend``: ``"threads"``, ``"sync"``, ``"null"``, ``"ray"`` or a backend object; the
      options hold the backend object (a name is resolved when they are built; ``"ray"`` is a
      fresh Ray backend, owning the actors of one program);
    - ``specs``: a mapping tensor -> join-agg spec that overrides the planner's for those nodes;
    - ``placement``: a registered placer (:data:`einjoin.placement.PLACERS`); ``seed`` seeds it
      and the ``"random"`` ready order; ``order``: the ready-queue policy of the runs;
    - ``quiet``: no progress display (while compiling and in the program's runs);
    - ``memory_limit``: per-device caps (bytes, ``"2GiB"``, or a mapping device -> size; None:
      the cluster's ``Device.memory``); ``memory_policy``: ``"belady"`` or ``"naive"`` evictions;
    - ``host_link``: emulated host<->device bytes per second for the runs (None: none);
    - ``state``: a mapping new value -> state input (a program with state; see ``ej.compile``);
    - ``deterministic``: every run's results are bit-identical (partials combine in a fixed order;
      see :mod:`einjoin.runtime.state`);
    - ``fuse``: chains of elementwise einsums are fused into one node before planning
      (:mod:`einjoin.ir.fuse`; the same values); not for a planner given as a callable, nor
      when ``specs`` name nodes that fusing would replace;
    - ``shape_cache``: for an imported torch module, the programs compiled for other shapes
      kept (an LRU, :mod:`einjoin.variants`; an int >= 1, or None: no bound);
    - ``leave_idle``: on devices of this process (``ej.local(n)``, no caps), plan on
      as many of them as pay: the counts of :func:`einjoin.planner.overhead.device_ladder` are
      planned and the fastest by the modelled per-task overhead and work per device
      (:func:`einjoin.planner.overhead.plan_time`) is kept; the rest stay idle, and
      ``explain()`` says so; a program's state lives on the devices kept. Off by default: a
      plan uses every device it is given;
    - ``objective``: what the planner minimises: ``"bytes"`` (bytes moved) or ``"time"`` (each
      transfer weighed by the links it crosses: :class:`einjoin.planner.cost.TimeWeights`);
      None: :func:`default_objective` of the cluster (``"time"`` where its hardware's links
      differ, e.g. ``ej.Cluster.nodes(2)``; ``"bytes"`` otherwise);
    - ``blocks`` / ``relational`` / ``engine``: pins of the graph's sparse einsums
      (:mod:`einjoin.sparse.pins`): a label's block size, labels kept relational, the executor
      (``"memory"`` or ``"duckdb"``); held as plain data (``blocks`` as sorted (label, size)
      pairs, ``relational`` as a sorted tuple).

    >>> CompileOptions(seed=np.int64(3)).seed, CompileOptions().backend.name
    (3, 'threads')
    >>> CompileOptions().replace(quiet=True).quiet
    True
    """

    planner: Any = "auto"
    backend: Any = "threads"
    specs: Any = None
    placement: str = "greedy"
    order: str = "fifo"
    seed: int = 0
    quiet: bool = False
    memory_limit: Any = None
    memory_policy: str = "belady"
    host_link: float | None = None
    state: Any = None
    deterministic: bool = False
    fuse: bool = True
    shape_cache: int | None = 8
    leave_idle: bool = False
    objective: str | None = None
    blocks: Any = None
    relational: Any = None
    engine: str | None = None

    def __post_init__(self) -> None:
        # names must be hashable strings before any `in` test (a list would raise a raw TypeError)
        planner = self.planner
        if not callable(planner) and not (isinstance(planner, str) and planner in PLANNERS):
            raise EinjoinError(f"unknown planner {planner!r}; known: {', '.join(sorted(PLANNERS))}")
        object.__setattr__(self, "backend", get_backend(self.backend))
        placement = self.placement
        if not (isinstance(placement, str) and placement in PLACERS):
            raise EinjoinError(f"unknown placement {placement!r}; known: {', '.join(sorted(PLACERS))}")
        check_order(self.order)
        object.__setattr__(self, "seed", check_seed(self.seed))  # a numpy integer becomes an int
        check_quiet(self.quiet)
        policy = self.memory_policy
        if not (isinstance(policy, str) and policy in POLICIES):
            raise EinjoinError(f"unknown memory policy {policy!r}; known: {', '.join(POLICIES)}")
        check_host_link(self.host_link)
        if self.state:
            _state_pairs(self.state)  # checked now; Source.of builds the graph with it
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise EinjoinError(f"deterministic must be True or False, got {self.deterministic!r:.60}")
        if not isinstance(self.fuse, (bool, np.bool_)):
            raise EinjoinError(f"fuse must be True or False, got {self.fuse!r:.60}")
        if not isinstance(self.leave_idle, (bool, np.bool_)):
            raise EinjoinError(f"leave_idle must be True or False, got {self.leave_idle!r:.60}")
        check_cache_size(self.shape_cache)
        if self.objective is not None and not (isinstance(self.objective, str) and self.objective in OBJECTIVES):
            raise EinjoinError(f"unknown objective {self.objective!r:.60}; known: {', '.join(OBJECTIVES)} "
                               f"(or None: the cluster's default)")
        blocks, relational, engine = check_pins(self.blocks, self.relational, self.engine)
        object.__setattr__(self, "blocks", blocks or None)
        object.__setattr__(self, "relational", relational or None)
        object.__setattr__(self, "engine", engine)

    def replace(self, **changes: Any) -> CompileOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CompiledPlan:
    """What compiling produced, as data: the graph, the cluster, each node's decomposition
    (its join-agg spec, blocks and kernels), the placement of every block, the task graph (with
    its memory plan under caps), its stats, and the options it was compiled with. ``many``: the
    outputs were a list or tuple (runs return a tuple). For an imported torch module,
    ``arg_names`` are its forward's arguments and ``bound`` its parameters and buffers by input
    name (those the graph reads)."""

    graph: Graph
    cluster: Cluster
    decomps: dict[Node, Decomposition]
    placement: Placement
    taskgraph: TaskGraph
    stats: PlanStats
    options: CompileOptions
    many: bool
    arg_names: tuple[str, ...] | None = None
    bound: dict[str, Any] | None = None
    state: tuple[StateSlot, ...] = ()
    recapture: Any = field(default=None, repr=False, compare=False)
    dynamic: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    call: tuple[tuple[str, Any], ...] | None = None
    """An imported module's forward parameters as torch calls it (``variants.call_template``):
    how ``run(x, (h, c), 2.0)`` binds to the graph's inputs; None: by ``arg_names`` only."""
    structure: Any = None
    """An imported forward's output structure (``TorchFunction.structure``: a TreeSpec runs
    rebuild, a dict / nested tuple / ModelOutput); None: a tensor or a tuple (``many``)."""
    devices_note: str | None = None
    """With ``leave_idle``, why the plan uses fewer devices than it was given (``explain()``
    prints it); None: it uses them all, or was not asked to choose."""
    given: Cluster | None = field(default=None, compare=False)
    """With ``leave_idle`` and fewer devices used, the cluster the plan was asked for (a program
    compiled again for other shapes chooses among its devices again); None: ``cluster``."""

    @property
    def specs(self) -> dict[Node, JoinAggSpec]:
        """Each node's join-agg spec."""
        return {n: d.spec for n, d in self.decomps.items()}


@dataclass(frozen=True)
class Source:
    """What is compiled: the graph reaching the outputs, whether they were several (a list or
    tuple: runs return a tuple), and for ``ej.from_torch``'s result its forward's argument names
    and bound parameters and buffers. With ``state`` (``{new value: state input}``), the graph's
    outputs are the user's then the new values (:class:`StateSlot` s say which)."""

    graph: Graph
    many: bool = False
    arg_names: tuple[str, ...] | None = None
    bound: dict[str, Any] | None = None
    state: tuple[StateSlot, ...] = ()
    recapture: Any = field(default=None, repr=False, compare=False)
    dynamic: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    call: tuple[tuple[str, Any], ...] | None = None
    """An imported module's forward parameters as torch calls it (``variants.call_template``):
    how ``run(x, (h, c), 2.0)`` binds to the graph's inputs; None: by ``arg_names`` only."""
    structure: Any = None
    """An imported forward's output structure (``TorchFunction.structure``); None: ``many``."""

    @staticmethod
    def of(outputs: Any, state: Mapping[Any, Any] | None = None) -> Source:
        """``outputs``: a tensor, a list/tuple of them, or ``ej.from_torch``'s result; ``state``:
        a mapping new value -> the graph input it replaces after each run (checked here)."""
        recapture, dynamic, call, structure = None, {}, None, None
        if hasattr(outputs, "arg_names") and hasattr(outputs, "bound"):  # ej.from_torch's result
            # the bound values to feed at each run (from_torch's live module tensors, viewed when fed:
            # a view taken now would not follow a storage that share_memory_() moves)
            from einjoin.frontend.bound_tensors import feeds_of  # a from_torch result: its frontend is loaded
            bound = feeds_of(outputs.bound)
            arg_names, many = tuple(outputs.arg_names), bool(outputs.many)
            outs = list(outputs.outputs) if many else outputs.outputs[0]
            # how to import it again for other shapes (None after with_outputs: no longer the forward)
            recapture = getattr(outputs, "recapture", None)
            dynamic = {k: dict(v) for k, v in getattr(outputs, "dynamic", {}).items()}
            call = call_template(getattr(outputs, "call_args", ()) or arg_names,
                                 getattr(outputs, "constants", {}), arg_names, getattr(outputs, "defaults", {}))
            structure = getattr(outputs, "structure", None)
        else:
            arg_names, bound, many, outs = None, None, isinstance(outputs, (list, tuple)), outputs
        if not state:
            graph = Graph(outs)
            slots: tuple[StateSlot, ...] = ()
        else:
            user = Graph(outs).outputs
            pairs = _state_pairs(state)
            graph = Graph([*user, *(new for new, _ in pairs)])
            slots = tuple(StateSlot(old.op.name, old, new, len(user) + i)  # type: ignore[union-attr]
                          for i, (new, old) in enumerate(pairs))
            for slot in slots:
                if slot.node not in graph.input_by_name.values():
                    raise EinjoinError(f"state input {slot.name!r} is read neither by the outputs nor by any "
                                       f"new state value: leave it out of state=")
        if bound is not None:  # parameters the forward never reads are not graph inputs
            bound = {k: v for k, v in bound.items() if k in graph.input_by_name}
        return Source(graph, many, arg_names, bound, slots, recapture, dynamic, call, structure)


def _state_pairs(state: Mapping[Any, Any]) -> list[tuple[Node, Node]]:
    """``state`` ({new value: state input}) as (new, old) nodes, checked: the old side is a
    graph input, each at most once and not another state's new value; shapes and dtypes agree."""
    if not isinstance(state, Mapping):
        raise EinjoinError(f"state must be a mapping new value -> state input ({{w_new: w}}), got "
                           f"{type(state).__name__}")
    pairs: list[tuple[Node, Node]] = []
    seen: dict[Node, Node] = {}
    for new_t, old_t in state.items():
        new, old = getattr(new_t, "node", new_t), getattr(old_t, "node", old_t)
        for side, n in (("new value", new), ("state input", old)):
            if not isinstance(n, Node):
                raise EinjoinError(f"state: a {side} must be a tensor, got {type(n).__name__} {n!r:.60}")
        if not old.facts.fed:
            raise EinjoinError(f"state: the old side of a pair must be a graph input (ej.input / ej.param), "
                               f"got {describe(old)} (new value {describe(new)})")
        name = old.op.name
        if old in seen:
            raise EinjoinError(f"state input {name!r} is given two new values: {describe(seen[old])} and "
                               f"{describe(new)}")
        if new.shape != old.shape or new.dtype != old.dtype:
            raise EinjoinError(f"state input {name!r} is {old.dtype}{list(old.shape)} but its new value "
                               f"{describe(new)} is {new.dtype}{list(new.shape)}: they must agree")
        seen[old] = new
        pairs.append((new, old))
    for new, old in pairs:
        if new.facts.fed and new is not old and new in seen:
            raise EinjoinError(f"the new value of state input {old.op.name!r} is the state input "  # type: ignore[union-attr]
                               f"{new.op.name!r} itself: give it a computed value (or w itself: unchanged)")  # type: ignore[union-attr]
    return pairs


def default_objective(cluster: Cluster) -> str:
    """The planner's objective when none is given: ``"time"`` for a cluster whose time model
    (``Cluster.hardware``: the presets) has links of two speeds (several nodes), ``"bytes"``
    otherwise, so every plan on ``ej.local(n)``, one preset node or a cluster described by its
    links alone is the bytes-optimal one.

    >>> default_objective(Cluster.nodes(2)), default_objective(Cluster.preset("dgx-a100"))
    ('time', 'bytes')
    """
    hw = cluster.hardware
    if hw is not None and len(set(hw.groups)) > 1 and hw.inter.bandwidth != hw.intra.bandwidth:
        return "time"
    return "bytes"


def objective_of(options: CompileOptions, cluster: Cluster) -> str:
    """The objective ``options`` plan ``cluster`` with."""
    return options.objective if options.objective is not None else default_objective(cluster)


def build_plan(source: Source, cluster: Cluster, options: CompileOptions) -> CompiledPlan:
    """Plan the join-agg specs of ``source``'s graph for ``cluster``, decompose, place, build the
    task graph and, under memory caps, cut finer until every task fits and plan evictions.

    With ``objective="time"`` on a cluster with a time model (a preset) and no state, the bytes
    plan is built too and the one the simulator finishes first is kept (ties: the time plan).
    Why: the time weights guess where the placer puts kernels
    (:class:`einjoin.planner.cost.TimeWeights`); where it does not, the bytes plan can be the
    faster, and a plan for time must not lose to it. Still a function of shapes and the cluster."""
    with old_objects_frozen():  # planning and lowering allocate much; torch's objects are not re-scanned
        source, options = _pinned(source, options)
        return _build_best(source, cluster, options)


def _pinned(source: Source, options: CompileOptions) -> tuple[Source, CompileOptions]:
    """``source`` with its sparse einsums over operands carrying ``options``' pins
    (:func:`einjoin.sparse.pins.pin_graph`: those nodes and the ones reading them rebuilt, the
    outputs in their places, state new values and ``specs`` keys followed to the rebuilt nodes)."""
    new = pin_graph(source.graph, (options.blocks or (), options.relational or (), options.engine))
    if not new:
        return source, options
    outs = [new.get(n, n) for n in source.graph.outputs]
    state = tuple(dataclasses.replace(s, new=new.get(s.new, s.new)) for s in source.state)
    if isinstance(options.specs, Mapping) and options.specs:
        keys = [getattr(k, "node", k) for k in options.specs]  # tensors or nodes; another key is refused later
        specs = {new.get(k, k) if isinstance(k, Node) else k: v for k, v in zip(keys, options.specs.values())}
        options = options.replace(specs=specs)
    return dataclasses.replace(source, graph=Graph(outs), state=state), options


def _build_best(source: Source, cluster: Cluster, options: CompileOptions) -> CompiledPlan:
    plan = _build_plan(source, cluster, options)
    if (objective_of(options, cluster) == "time" and isinstance(options.planner, str)
            and cluster.hardware is not None and not source.state):
        other = _build_plan(source, cluster, options.replace(objective="bytes"))
        if other.specs != plan.specs and _makespan(other) < _makespan(plan):
            return dataclasses.replace(other, options=options)
    return plan


def _makespan(plan: CompiledPlan) -> float:
    """The simulated makespan of ``plan``'s task graph on its cluster's time model."""
    return _simulated(plan.taskgraph, plan.cluster, plan.options)


def _simulated(tg: TaskGraph, cluster: Cluster, options: CompileOptions) -> float:
    """The simulated makespan of ``tg`` on ``cluster``'s time model, weights resident (a GPU
    benchmark's view), in the runs' order."""
    from einjoin.runtime.simulate import simulate
    return simulate(tg, cluster.hardware, options.order, options.seed, resident=True).makespan


def _build_plan(source: Source, cluster: Cluster, options: CompileOptions) -> CompiledPlan:
    if options.fuse and isinstance(options.planner, str):
        source = _fused(source, options.specs)
    graph = source.graph
    caps = parse_caps(options.memory_limit, cluster.size, cluster)
    user = _user_specs(graph, options.specs)  # checked once, before the planner; read every lowering
    tied = {s.node: s.new for s in source.state}  # state input -> new value: one layout, one home
    note, given = None, cluster
    refuse_unfittable(graph, caps)  # an op no cut fits: refused now, not after cutting it to elements
    with stages(options.quiet, len(graph.ops)) as say:
        say("planning")
        # the planner receives the caps: eindecomp then picks cuts that fit
        chosen = dict(plan_specs(options.planner, graph, cluster, memory_limit=caps, tied=tied,
                                 objective=objective_of(options, cluster)))
        say("placing, synthesising exchanges, building the task graph")
        decomps, placed, tg = _lower(graph, cluster, chosen, user, options, tied)
        if options.leave_idle and all(c is None for c in caps.values()):
            cluster, chosen, decomps, placed, tg, note = _fewer_devices(
                graph, cluster, options, user, (chosen, decomps, placed, tg), tied)
        if any(c is not None for c in caps.values()):
            if getattr(options.backend, "remote", False):
                raise EinjoinError("memory caps are not supported on the Ray backend yet: compile with "
                                   "backend='threads' (or without memory_limit / Device.memory)")
            say("fitting the memory caps, planning evictions")
            decomps, placed, tg = _fit_caps(graph, cluster, chosen, user, options, caps, decomps, placed,
                                            chain_reduces(tg, caps), tied)
            tg = plan_memory(tg, decomps, caps, options.memory_policy)
    stats = tg.stats()
    if source.state:  # state is loaded by the first run only, and never fetched
        stats = with_state(stats, tg, set(tied), {s.output for s in source.state})
    return CompiledPlan(graph, cluster, decomps, placed, tg, stats, options, source.many,
                        source.arg_names, source.bound, source.state, source.recapture, source.dynamic,
                        source.call, source.structure, note, given if given is not cluster else None)


_Lowered = tuple[dict[Node, JoinAggSpec], dict[Node, Decomposition], Placement, TaskGraph]


def _fewer_devices(graph: Graph, cluster: Cluster, options: CompileOptions, user: dict[Node, JoinAggSpec],
                   full: _Lowered, tied: dict[Node, Node]) -> tuple[Cluster, dict[Node, JoinAggSpec],
                                                                    dict[Node, Decomposition], Placement,
                                                                    TaskGraph, str | None]:
    """``leave_idle``: the plan on as many of ``cluster``'s devices as pay (see
    :mod:`einjoin.planner.overhead`), ``full`` being the plan on all of them. Only for devices of
    this process, alike and uniformly linked (``ej.local(n)``): their first k are a cluster of k.
    A program with state (``tied``) plans each k with its ties, as the full plan: the state then
    lives on the k devices kept (its values are read and written by name, so ``read_state``,
    ``write_state`` and a Trainer's save / load do not depend on where)."""
    p = cluster.size
    d0 = cluster.devices[0]
    if p == 1 or cluster != Cluster.uniform(p, d0.kind, d0.memory) or d0.node is not None \
            or getattr(options.backend, "remote", False):  # Ray's devices are other processes: not modelled
        return (cluster, *full, None)
    cores = os.cpu_count() or 1

    def modelled(tg: TaskGraph) -> float:
        st = tg.stats()
        return plan_time(sum(st.task_counts.values()), st.flops_per_device, cores, devices=tg.n_devices)

    best, best_k, best_time = full, p, modelled(full[3])
    flops = full[3].stats().flops
    ops = sum(1 for n in graph.ops if not n.facts.free)  # every plan runs at least a kernel per op
    times = {p: best_time}
    for k in device_ladder(p)[:-1]:
        if time_floor(flops, ops, k, cores) >= best_time:
            continue  # no plan on k devices can beat the best so far
        sub = Cluster.uniform(k, d0.kind, d0.memory)
        chosen = dict(plan_specs(options.planner, graph, sub, memory_limit=None, tied=tied,
                                 objective=objective_of(options, sub)))
        lowered = (chosen, *_lower(graph, sub, chosen, dict(user), options, tied))
        times[k] = modelled(lowered[3])
        if times[k] < best_time:
            best, best_k, best_time = lowered, k, times[k]
    if best_k == p:
        return (cluster, *full, None)
    shown = ", ".join(f"{k}: {t * 1e3:.2f} ms" for k, t in sorted(times.items()))
    note = (f"planned on {best_k} of the {p} devices given (leave_idle=True; the other {p - best_k} stay idle): "
            f"the work per block is below the per-task overhead (modelled run time by devices used "
            f"{shown}; Settings.task_overhead {SETTINGS.task_overhead * 1e6:.0f} us, flop_rate "
            f"{SETTINGS.flop_rate / 1e9:.0f} GFLOP/s, {cores} cores)")
    return (Cluster.uniform(best_k, d0.kind, d0.memory), *best, note)


def _fused(source: Source, specs: Any) -> Source:
    """``source`` with its elementwise chains fused (:func:`einjoin.ir.fuse.fuse_elementwise`):
    the same outputs in the same places, state new values followed to their fused nodes. Left
    as written when user ``specs`` name a node the fused graph lacks (specs of the graph as
    written; a fused program's ``prog.specs`` name the fused one). A planner given as a callable
    is never fused for (it may return specs of the graph as written): the caller checks."""
    outs = fuse_elementwise(source.graph.outputs)
    if all(a is b for a, b in zip(outs, source.graph.outputs)):
        return source
    if isinstance(specs, Mapping) and specs:
        kept = set(Graph(outs).nodes)
        if not all(getattr(k, "node", k) in kept for k in specs):
            return source
    state = tuple(dataclasses.replace(s, new=outs[s.output]) for s in source.state)
    return dataclasses.replace(source, graph=Graph(outs), state=state)


def _user_specs(graph: Graph, specs: Any) -> dict[Node, JoinAggSpec]:
    if specs is None:
        return {}
    if not isinstance(specs, Mapping):
        raise EinjoinError(f"specs must be a mapping tensor -> join-agg spec, got {type(specs).__name__}")
    members = set(graph.nodes)
    out = {}
    for key, spec in specs.items():
        node = getattr(key, "node", key)
        if node not in members:
            raise EinjoinError(f"a spec is given for {key!r}, which is not in the graph")
        out[node] = JoinAggSpec.for_node(node, spec)
    return out


def _lower(graph: Graph, cluster: Cluster, chosen: dict[Node, JoinAggSpec], user: dict[Node, JoinAggSpec],
           options: CompileOptions, tied: dict[Node, Node]) -> tuple[dict[Node, Decomposition], Placement, TaskGraph]:
    chosen.update(user)
    # an input keeps the user's or the planner's partition, unless a user spec changed one of its
    # consumers: then it follows its first consumer again; a state input follows its new value
    stale = {x for x in graph.inputs if x not in user and any(c in user for c in graph.users[x])}
    chosen = tie_state(derive_input_specs(graph, {n: s for n, s in chosen.items() if n not in stale}), tied)
    for old in tied:
        if old in user and user[old] != chosen[old]:
            raise EinjoinError(f"state input {old.op.name!r}: the join-agg spec given for it, {user[old]}, "  # type: ignore[union-attr]
                               f"differs from its new value's layout {chosen[old]} (a state input is cut as "
                               f"its new value: give the spec to {describe(tied[old])} instead)")
    decomps = {n: decompose(n, chosen.get(n)) for n in graph.nodes}
    if options.placement in ("search", "doppler") and cluster.hardware is not None:
        placement = _searched(graph, decomps, cluster, options, tied)
    else:
        placement = place(options.placement, decomps, cluster, options.seed)
    placed = tie_homes(decomps, placement, tied)
    return decomps, placed, build_taskgraph(graph, decomps, placed, cluster.size)


def _searched(graph: Graph, decomps: dict[Node, Decomposition], cluster: Cluster, options: CompileOptions,
              tied: dict[Node, Node]) -> Placement:
    """``placement="search"`` (or ``"doppler"``) on a cluster with a time model: the placement
    search (:mod:`einjoin.placement.search`; the learned policy, :mod:`einjoin.placement.doppler`;
    floor 2) scored by what it cannot import, the simulated makespan of the task graph each
    candidate gives (weights resident, as :func:`_makespan`)."""
    from einjoin.placement.doppler import doppler
    from einjoin.placement.search import search

    def makespan(pl: Placement) -> float:
        return _simulated(build_taskgraph(graph, decomps, tie_homes(decomps, pl, tied), cluster.size),
                          cluster, options)
    return (doppler if options.placement == "doppler" else search)(decomps, cluster, options.seed, score=makespan)


def _fit_caps(graph: Graph, cluster: Cluster, chosen: dict[Node, JoinAggSpec], user: dict[Node, JoinAggSpec],
              options: CompileOptions, caps: dict[int, int | None], decomps: dict[Node, Decomposition],
              placed: Placement, tg: TaskGraph, tied: dict[Node, Node]
              ) -> tuple[dict[Node, Decomposition], Placement, TaskGraph]:
    """Cut the ops whose tasks alone exceed a cap finer until every task fits; the clear
    :class:`MemoryCapError` (op, block shapes, bytes, cap) when no finer cut helps."""
    cut_inputs: set[Node] = set()  # inputs cut for their own loads keep that partition
    for _ in range(SETTINGS.fit_rounds):  # each round doubles a block count of every op at fault
        over = [(nd, cap) for nd in task_needs(tg, decomps)
                if (cap := caps.get(nd.device)) is not None and nd.needed > cap]
        if not over:
            return decomps, placed, tg
        done: set[Node] = set()
        for nd, cap in over:
            op = blamed_op(nd.task, tg)
            if op.facts.free and graph.users[op] and op not in graph.outputs:
                op = graph.users[op][0]  # a fill is computed in the blocks its consumer reads
            if op in tied and tied[op] is not op:
                op = tied[op]  # a state input is cut as its new value: cut that
            if op in done:
                continue
            done.add(op)
            if op in user:
                raise cap_error(nd, cap, "; the join-agg spec given for it does not fit (give a finer "
                                         "one or none)", op)
            finer = finer_spec(op, decomps[op].spec)
            if finer is None and nd.task.kind == TaskKind.TOUCH and op is nd.task.consumer:
                finer = element_spec(op, decomps[op].spec)  # the buffer it assembles must shrink
            if finer is None:
                raise cap_error(nd, cap, "; no finer decomposition of it fits either (at most "
                                         f"{SETTINGS.max_kernels} kernels per op)", op)
            chosen[op] = finer
            if op.facts.fed:
                cut_inputs.add(op)
            for x in op.inputs:  # inputs it reads first take its new partition
                if x.facts.fed and graph.users[x][0] is op and x not in cut_inputs:
                    chosen.pop(x, None)
        decomps, placed, tg = _lower(graph, cluster, chosen, user, options, tied)
        tg = chain_reduces(tg, caps)
    raise cap_error(over[0][0], over[0][1], "; gave up cutting finer")
