"""Planners: graph + cluster + memory limit -> one join-agg spec per node. All share one
signature (:class:`Planner`) and one registry, with ``auto`` (= ``eindecomp``, the EinDecomp
dynamic program with refinement, see :mod:`einjoin.planner.search`, seeded with the named
baselines' plans so that it never loses to them: :func:`seeded_eindecomp`); ``exhaustive`` is ground
truth for small graphs; the named baselines ``data_parallel``, ``megatron``, ``mesh_ilp`` and
``zero`` (:mod:`einjoin.planner.baselines`) are what a user would otherwise pick; ``split_largest`` and
``single`` are simple references (:mod:`einjoin.planner.basic`).

The package's rooms, lower first (none imports a higher one, nor this one): ``fit`` (cutting an
op finer for a memory cap, shared with the memory planner), ``cost`` (the one cost model),
``candidates`` (the specs each op may take), ``ilp`` (choosing one per op exactly), ``search``
(eindecomp, exhaustive), ``basic`` and ``baselines`` (the other planners); ``bounds`` and
``exact`` measure plans.

>>> import einjoin as ej
>>> from einjoin.planner import plan_specs
>>> z = ej.input("x", (64, 32)) @ ej.input("w", (32, 16))
>>> specs = plan_specs("split_largest", ej.Graph(z), ej.local(4))
>>> print(specs[z.node])
{m: 4, n: 1, k: 1}
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Protocol, cast
from collections.abc import Callable, Mapping

from einjoin.cluster import Cluster, LinkMatrix
from einjoin.decomp.decompose import decompose
from einjoin.decomp.partition import check_bounds
from einjoin.decomp.spec import JoinAggSpec, dim_labels, label_sizes, output_labels
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.planner.baselines import data_parallel, megatron, mesh_ilp, zero
from einjoin.planner.basic import derive_input_specs, largest_output_cut, single_block, split_largest
from einjoin.planner.cost import OBJECTIVES, CostModel, total_cost
from einjoin.planner.fit import MemoryLimit, device_memory
from einjoin.planner.search import eindecomp, exhaustive
from einjoin.registry import Registry
from einjoin.settings import SETTINGS, Settings

__all__ = ["PLANNERS", "Planner", "register_planner", "plan_specs", "derive_input_specs", "seeded_eindecomp",
           "largest_output_cut", "resolve_planner", "as_planner", "takes_memory_limit",
           "check_planned", "memory_limit_for", "MemoryLimit", "tie_state", "align_state",
           "state_cost", "clear_plan_cache", "PLAN_CACHE_STATS", "PLAN_CACHE_SIZE"]


class Planner(Protocol):
    """What every planner is: ``planner(graph, cluster, *, memory_limit) -> {node: spec}``.

    ``memory_limit`` maps each device id of ``cluster`` to its cap in bytes (None: uncapped);
    :func:`plan_specs` always passes it (the devices' ``Device.memory`` unless the caller gives
    caps), so a planner never reads caps from the cluster. A planner that does not plan for
    memory accepts it and ignores it (the memory planner fits its plan later). The result maps
    nodes (or tensors) to join-agg specs (a ``JoinAggSpec``, a mapping label -> blocks, counts
    in label order, or None); nodes left out run in one block. A plain callable
    ``(graph, cluster)`` is still accepted and adapted (:func:`as_planner`).

    >>> import einjoin as ej
    >>> def halves(graph, cluster, *, memory_limit=None):   # every op's rows cut in two
    ...     return {n: {"m": 2} for n in graph.ops}
    >>> z = ej.input("x", (4, 3)) @ ej.input("w", (3, 2))
    >>> print(plan_specs(halves, ej.Graph(z), ej.local(2))[z.node])
    {m: 2, n: 1, k: 1}
    """

    def __call__(self, graph: Graph, cluster: Cluster, *,
                 memory_limit: MemoryLimit | None = None) -> Mapping[Any, Any]: ...


PLANNERS: dict[str, Callable[..., Any]] = Registry()
"""Registered planners by name: :class:`Planner` s (plain ``(graph, cluster)`` callables are
adapted when resolved)."""


def register_planner(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator registering a planner under ``name`` (for ``ej.compile(..., planner=name)``)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        PLANNERS[name] = fn
        return fn
    return deco


def seeded_eindecomp(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None,
                     settings: Settings = SETTINGS, objective: str = "bytes") -> dict[Node, JoinAggSpec]:
    """eindecomp (:func:`einjoin.planner.search.eindecomp`) seeded with the plans of the named
    baselines that apply (``data_parallel``, ``megatron``, ``zero``): by the cost model it is
    never worse than any of them whose cuts are even (a seed with uneven cuts is ignored: the
    bytes model cannot see an overloaded device), without a memory cap, where seeds are used. The
    registered ``eindecomp`` and ``auto``.

    >>> import einjoin as ej
    >>> from einjoin.planner.cost import model_cost
    >>> x = ej.input("x", (64, 32)); w = ej.param("w", (32, 16))
    >>> g, c = ej.Graph((x @ w).relu()), ej.local(4)
    >>> model_cost(g, c, seeded_eindecomp(g, c)) <= model_cost(g, c, data_parallel(g, c))
    True
    """
    seeds = []
    for base in (data_parallel, megatron, zero):
        try:
            seeds.append(base(graph, cluster, memory_limit=memory_limit))
        except EinjoinError:  # NotApplicable: the baseline does not fit this graph
            pass
    return eindecomp(graph, cluster, memory_limit=memory_limit, settings=settings, seeds=seeds,
                     objective=objective)


PLANNERS["split_largest"] = split_largest
PLANNERS["single"] = single_block
PLANNERS["eindecomp"] = seeded_eindecomp
PLANNERS["exhaustive"] = exhaustive
PLANNERS["auto"] = seeded_eindecomp
PLANNERS["data_parallel"] = data_parallel
PLANNERS["megatron"] = megatron
PLANNERS["mesh_ilp"] = mesh_ilp
PLANNERS["zero"] = zero


def _planner_name(planner: Any) -> str:
    if isinstance(planner, str):
        return repr(planner)
    return getattr(planner, "__qualname__", None) or getattr(planner, "__name__", None) or repr(planner)[:60]


def takes_memory_limit(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` can be called with the keyword ``memory_limit`` (it names it, or takes
    ``**kwargs``); a callable whose signature cannot be read is taken for a plain one."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == "memory_limit" and p.kind in (p.KEYWORD_ONLY,
                                                                                     p.POSITIONAL_OR_KEYWORD))
               for p in params)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (by name, not through ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def as_planner(fn: Callable[..., Any]) -> Planner:
    """``fn`` as a :class:`Planner`: itself if it takes ``memory_limit``; a plain callable
    ``(graph, cluster) -> {node: spec}`` (the signature before planners received the limit) is
    wrapped to receive it as before, as the devices' memory: ``fn(graph,
    cluster.with_memory(memory_limit))``.

    >>> import einjoin as ej
    >>> seen = []
    >>> plan = as_planner(lambda graph, cluster: seen.append(cluster.devices[0].memory) or {})
    >>> plan(ej.Graph(ej.input("x", (2,))), ej.local(1), memory_limit={0: 1024})
    {}
    >>> seen
    [1024]
    """
    if takes_memory_limit(fn):
        return cast(Planner, fn)

    def plain(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None) -> Any:
        return fn(graph, cluster if memory_limit is None else cluster.with_memory(memory_limit))
    plain.__name__ = plain.__qualname__ = _planner_name(fn)
    plain.__wrapped__ = fn  # type: ignore[attr-defined]
    return plain


def resolve_planner(planner: Any) -> tuple[str, Planner]:
    """(a name for messages, the :class:`Planner`) of ``planner``: a registered name or a
    callable (a :class:`Planner`, or a plain ``(graph, cluster) -> {node: spec}`` adapted by
    :func:`as_planner`); else an :class:`EinjoinError` listing the names."""
    if isinstance(planner, str) and planner in PLANNERS:
        return repr(planner), as_planner(PLANNERS[planner])
    if callable(planner) and not isinstance(planner, str):
        return _planner_name(planner), as_planner(planner)
    shown = repr(planner)
    raise EinjoinError(f"unknown planner {shown if len(shown) <= 60 else shown[:57] + '...'}: give a "
                       f"name ({', '.join(sorted(PLANNERS))}) or a callable (graph, cluster, *, "
                       f"memory_limit) -> {{node: join-agg spec}}")


def _checked_spec(node: Node, spec: Any) -> JoinAggSpec:
    """``spec`` normalised for ``node``; a ``JoinAggSpec`` built by hand also has its boundaries
    checked (``for_node`` trusts its labels' last boundaries only)."""
    if isinstance(spec, JoinAggSpec):
        sizes = label_sizes(node)
        if not isinstance(spec.bounds, tuple) or len(spec.bounds) != len(sizes) or spec.labels != tuple(sizes):
            raise EinjoinError(f"a JoinAggSpec with labels {spec.labels!r:.60} for labels {tuple(sizes)}")
        spec = JoinAggSpec(spec.labels, tuple(check_bounds(b, sizes[lab], f"label {lab!r} (size {sizes[lab]})")
                                              for lab, b in zip(spec.labels, spec.bounds)))
    return JoinAggSpec.for_node(node, spec)


def check_planned(result: Any, graph: Graph, who: str) -> dict[Node, JoinAggSpec]:
    """What a planner returned, checked: a mapping from nodes (or tensors) of ``graph`` to
    join-agg specs valid for them (a ``JoinAggSpec``, a mapping label -> blocks, counts in label
    order, or None); nodes left out get one block. Anything else is an :class:`EinjoinError`
    naming the planner ``who`` and what is wrong."""
    if not isinstance(result, Mapping):
        raise EinjoinError(f"planner {who} returned {type(result).__name__}, not a mapping node -> "
                           f"join-agg spec (a dict with a spec for each op it cuts)")
    members = set(graph.nodes)
    out: dict[Node, JoinAggSpec] = {}
    for key, spec in result.items():
        node = getattr(key, "node", key)  # a frontend tensor stands for its node
        if not isinstance(node, Node):
            shown = repr(key)
            raise EinjoinError(f"planner {who} returned a spec keyed by {type(key).__name__} "
                               f"{shown if len(shown) <= 60 else shown[:57] + '...'}; keys must be the graph's nodes")
        if node not in members:
            raise EinjoinError(f"planner {who} returned a spec for {describe(node)}, which is not in the graph")
        try:
            out[node] = _checked_spec(node, spec)
        except EinjoinError as e:
            raise EinjoinError(f"planner {who} returned an invalid spec for {describe(node)}: {e}") from None
    return out


def memory_limit_for(cluster: Cluster, memory_limit: Mapping[int, Any] | None) -> dict[int, int | None]:
    """The per-device caps a planner receives: ``memory_limit`` (device id -> bytes, a size
    string or None) checked against ``cluster``, or, if None, the devices' ``Device.memory``."""
    if memory_limit is None:
        return device_memory(cluster)
    if not isinstance(memory_limit, Mapping):
        raise EinjoinError(f"memory_limit must map device ids to bytes (or None), not "
                           f"{type(memory_limit).__name__}")
    # with_memory checks the ids and the sizes, and keeps an unnamed device's own memory
    return device_memory(cluster.with_memory(memory_limit))


def tie_state(specs: Mapping[Node, JoinAggSpec], tied: Mapping[Node, Node] | None) -> dict[Node, JoinAggSpec]:
    """``specs`` with every state input (a key of ``tied``: state input -> its new value) cut as
    its new value's output is, so one step's result is the next step's input where it lies: the
    carry-over between runs moves nothing (the inputs' first readers repartition them inside the
    step, where the task graph counts it). A new value that is its own input is left as it is.

    >>> import einjoin as ej
    >>> w = ej.input("w", (8, 4)); new = (w * 2.0).node
    >>> tie_state({new: JoinAggSpec.for_node(new, {"a": 2})}, {w.node: new})[w.node].bounds
    ((0, 4, 8), (0, 4))
    """
    out = dict(specs)
    for old, new in (tied or {}).items():
        if old is not new:
            part = decompose(new, out.get(new)).out_partition
            out[old] = JoinAggSpec(dim_labels(old.ndim), part.bounds)
    return out


def state_cost(graph: Graph, model: CostModel, specs: Mapping[Node, JoinAggSpec], tied: Mapping[Node, Node]) -> int:
    """The model's bytes of a plan of a program with state: the step's (:func:`total_cost`, where
    an input is loaded as its first reader needs it), plus, per state input, turning its new
    value's layout (the input's, :func:`tie_state`) into what that first reader needs: the
    repartition from the step's end back to its start."""
    ops = [n for n in graph.ops if not n.facts.free]
    chosen = {n: model.info(n, JoinAggSpec.for_node(n, specs.get(n))) for n in ops}
    total = total_cost(graph, model, chosen)
    for old, new in tied.items():
        if old is new or not graph.users[old]:
            continue
        reader = graph.users[old][0]
        need = chosen[reader].ins[reader.inputs.index(old)]
        have = chosen[new].out if new in chosen else decompose(new, specs.get(new)).out_partition
        total += model.repart(have, need, old.dtype)
    return total


def align_state(graph: Graph, cluster: Cluster, specs: Mapping[Node, JoinAggSpec],
                tied: Mapping[Node, Node] | None) -> dict[Node, JoinAggSpec]:
    """``specs`` where, for each state pair, the new value is computed in the layout the state
    input's first reader needs when that costs fewer modelled bytes (:func:`state_cost`): then
    the step starts without a repartition of the state. Pairs are tried one at a time, in order.

    >>> import einjoin as ej
    >>> x, w = ej.input("x", (64, 32)), ej.param("w", (32, 16))
    >>> new = w - 0.1 * ej.einsum("mk,mn->kn", x, x @ w)
    >>> g, tied = ej.Graph([(x @ w).sum(), new]), {w.node: new.node}
    >>> specs = {n: JoinAggSpec.for_node(n, None) for n in g.ops}
    >>> specs[(x @ w).node] = JoinAggSpec.for_node((x @ w).node, {"k": 2})   # reads w cut in rows
    >>> align_state(g, ej.local(2), specs, tied)[new.node].bounds[0]        # so the update is cut so
    (0, 16, 32)
    """
    out = dict(specs)
    if not tied:
        return out
    model = CostModel(graph, cluster.size)
    best = state_cost(graph, model, out, tied)
    for old, new in tied.items():
        if old is new or new.facts.fed or new.facts.free or not graph.users[old]:
            continue
        reader = graph.users[old][0]
        need = decompose(reader, out.get(reader)).in_partitions[reader.inputs.index(old)]
        spec = JoinAggSpec.for_node(new, out.get(new))
        outs = output_labels(new)
        if len(set(outs)) != len(outs):  # a label on two output dims (a diagonal): left as it is
            continue
        bounds = dict(zip(spec.labels, spec.bounds))
        bounds.update(zip(outs, need.bounds))
        trial = JoinAggSpec(spec.labels, tuple(bounds[lab] for lab in spec.labels))
        if trial == spec:
            continue
        cost = state_cost(graph, model, {**out, new: trial}, tied)
        if cost < best:
            best, out[new] = cost, trial
    return out


def plan_specs(planner: str | Callable[..., Any], graph: Graph, cluster: Cluster, *,
               memory_limit: Mapping[int, Any] | None = None,
               tied: Mapping[Node, Node] | None = None, objective: str = "bytes") -> dict[Node, JoinAggSpec]:
    """Run ``planner`` (a registered name or a callable) on ``graph`` and ``cluster`` with the
    per-device ``memory_limit`` (see :func:`memory_limit_for`; default: the devices' memory)
    and check what it returns (:func:`check_planned`): one join-agg spec per node it cuts. A
    planner's own non-einjoin exception is raised as an :class:`EinjoinError` naming it (the
    cause chained). ``tied`` (state input -> new value, a program with state) constrains the
    plan for every planner: each new value is computed in its input's first reader's layout
    where that pays (:func:`align_state`, without memory caps), and each state input takes its
    new value's layout (:func:`tie_state`). ``objective`` (``"bytes"`` or ``"time"``) goes to a
    planner that takes it (eindecomp, exhaustive); the others plan as they always do.

    A registered planner's result is cached for the process (the last :data:`PLAN_CACHE_SIZE`
    calls): planning the same graph for the same cluster, caps and state again returns the
    same specs without searching (:func:`clear_plan_cache` forgets them)."""
    who, fn = resolve_planner(planner)
    limit = memory_limit_for(cluster, memory_limit)
    if objective not in OBJECTIVES:
        raise EinjoinError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    extra = {"objective": objective} if objective != "bytes" and _takes(fn, "objective") else {}
    key = _cache_key(planner, graph, cluster, limit, tied, objective)
    if key is not None and key in _PLANNED:
        _PLANNED.move_to_end(key)
        PLAN_CACHE_STATS["hits"] += 1
        return dict(_PLANNED[key])
    try:
        result = fn(graph, cluster, memory_limit=limit, **extra)
    except (EinjoinError, MemoryError):
        raise
    except Exception as e:  # a user's planner (or a bug): name it, keep the cause
        raise EinjoinError(f"planner {who} failed: {type(e).__name__}: {e}") from e
    planned = check_planned(result, graph, who)
    if tied and all(c is None for c in limit.values()):
        planned = align_state(graph, cluster, planned, tied)
    planned = tie_state(planned, tied)
    if key is not None:
        PLAN_CACHE_STATS["misses"] += 1
        _PLANNED[key] = dict(planned)
        while len(_PLANNED) > PLAN_CACHE_SIZE:
            _PLANNED.popitem(last=False)
    return planned


# Plans of registered planners, by everything they depend on: the planner's function (a name
# registered again is another key), the graph's outputs (nodes are hash-consed, and a key holds
# them, so an identical graph built again is the same nodes), the cluster, the caps, the tied
# state and the settings. A planner is a deterministic function of these (work limits, never
# wall-clock ones: see einjoin.settings), so a hit returns what planning again would. Why:
# a Trainer loaded from a file, a program compiled again, a per-shape variant seen before and
# leave_idle's device ladder all plan the same graph again, each for seconds.
PLAN_CACHE_SIZE = 32
PLAN_CACHE_STATS = {"hits": 0, "misses": 0}
_PLANNED: OrderedDict[Any, dict[Node, JoinAggSpec]] = OrderedDict()


def _cache_key(planner: Any, graph: Graph, cluster: Cluster, limit: Mapping[int, Any],
               tied: Mapping[Node, Node] | None, objective: str = "bytes") -> Any:
    """The plan cache's key of a call, or None: not cached (a planner given as a callable, whose
    result may depend on anything, or an unhashable part)."""
    if not (isinstance(planner, str) and planner in PLANNERS):
        return None
    from einjoin import settings  # read at call time: a test or user may swap SETTINGS
    parts = (PLANNERS[planner], graph.outputs, _cluster_key(cluster), tuple(sorted(limit.items())),
             tuple((tied or {}).items()), settings.SETTINGS, objective)
    try:
        return _Key(parts)
    except TypeError:
        return None


class _Key:
    """A cache key hashed once (a dict hashes its key at every lookup and insert)."""

    __slots__ = ("parts", "hashed")

    def __init__(self, parts: tuple[Any, ...]):
        self.parts, self.hashed = parts, hash(parts)

    def __hash__(self) -> int:
        return self.hashed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hashed == other.hashed and self.parts == other.parts


def _cluster_key(cluster: Cluster) -> tuple[Any, ...]:
    """``cluster`` as a key without hashing an O(n^2) link matrix cell by cell (a LinkMatrix
    hashes as the dense matrix it equals, in Python: 30 s of a 512-device compile's 33 under
    tracemalloc): a LinkMatrix by its groups and values. Equal clusters written differently
    (dense vs LinkMatrix) just miss."""
    def matrix(m: Any) -> Any:
        return ("groups", m.groups, m.diag, m.intra, m.inter) if isinstance(m, LinkMatrix) else m
    return (cluster.devices, matrix(cluster.bandwidth), matrix(cluster.latency), cluster.hardware)


def clear_plan_cache() -> None:
    """Forget every cached plan (see :func:`plan_specs`)."""
    _PLANNED.clear()
