"""Planners: graph + cluster -> one join-agg spec per node. All share one signature and one
registry, with ``auto`` (= ``eindecomp``, the EinDecomp dynamic program with refinement, see
:mod:`einjoin.planner.search`); ``exhaustive`` is ground truth for small graphs; the named
baselines ``data_parallel``, ``megatron`` and ``mesh_ilp`` (:mod:`einjoin.planner.baselines`) are
what a user would otherwise pick; ``split_largest`` and ``single`` are simple references.

>>> import einjoin as ej
>>> from einjoin.planner import plan_specs
>>> z = ej.input("x", (64, 32)) @ ej.input("w", (32, 16))
>>> specs = plan_specs("split_largest", ej.Graph(z), ej.local(4))
>>> print(specs[z.node])
{m: 4, n: 1, k: 1}
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import decompose
from einjoin.decomp.partition import check_bounds
from einjoin.decomp.spec import JoinAggSpec, dim_labels, label_sizes, output_labels
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.registry import Registry

__all__ = ["PLANNERS", "Planner", "register_planner", "plan_specs", "derive_input_specs",
           "resolve_planner", "check_planned"]

Planner = Callable[[Graph, Cluster], dict[Node, JoinAggSpec]]


PLANNERS: dict[str, Planner] = Registry()


def register_planner(name: str) -> Callable[[Planner], Planner]:
    def deco(fn: Planner) -> Planner:
        PLANNERS[name] = fn
        return fn
    return deco


@register_planner("split_largest")
def split_largest(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    """Every op cuts its largest output label into (up to) P blocks: no partial sums, every op
    spread over all devices. Inputs take the partition their first consumer needs."""
    p = cluster.size
    return derive_input_specs(graph, {n: largest_output_cut(n, p) for n in graph.ops})


def largest_output_cut(node: Node, p: int) -> JoinAggSpec:
    """The spec that cuts ``node``'s largest output label into (up to) ``p`` blocks, the rest
    whole (one block for a scalar): the simplest spread over ``p`` devices, no partial sums."""
    sizes = label_sizes(node)
    outs = output_labels(node)
    spec: dict[str, int] = {}
    if outs:
        lab = max(outs, key=lambda label: sizes[label])
        spec[lab] = min(p, sizes[lab])
    return JoinAggSpec.for_node(node, spec)


@register_planner("single")
def single_block(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    """One block per op (everything on one device): the baseline with nothing to move."""
    return {n: JoinAggSpec.for_node(n, None) for n in graph.nodes}


def _eindecomp(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    from einjoin.planner.search import eindecomp
    return eindecomp(graph, cluster)


def _exhaustive(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    from einjoin.planner.search import exhaustive
    return exhaustive(graph, cluster)


PLANNERS["eindecomp"] = _eindecomp
PLANNERS["exhaustive"] = _exhaustive
PLANNERS["auto"] = _eindecomp


def _baseline(name: str) -> Planner:
    def plan(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
        from einjoin.planner import baselines
        return getattr(baselines, name)(graph, cluster)
    plan.__name__ = name
    return plan


for _name in ("data_parallel", "megatron", "mesh_ilp"):
    PLANNERS[_name] = _baseline(_name)


def derive_input_specs(graph: Graph, specs: dict[Node, JoinAggSpec]) -> dict[Node, JoinAggSpec]:
    """Give every input without a spec the partition its first consumer needs of it, so that one
    copy is loaded where the first use wants it."""
    out = dict(specs)
    for x in graph.inputs:
        if x in out:
            continue
        for c in graph.users[x]:
            slot = c.inputs.index(x)
            need = decompose(c, out.get(c)).in_partitions[slot]
            out[x] = JoinAggSpec(dim_labels(x.ndim), need.bounds)
            break
        else:
            out[x] = JoinAggSpec.for_node(x, None)
    return out


def _planner_name(planner: Any) -> str:
    if isinstance(planner, str):
        return repr(planner)
    return getattr(planner, "__qualname__", None) or getattr(planner, "__name__", None) or repr(planner)[:60]


def resolve_planner(planner: Any) -> tuple[str, Planner]:
    """(a name for messages, the function) of ``planner``: a registered name or a callable
    ``(graph, cluster) -> {node: spec}``; else an :class:`EinjoinError` listing the names."""
    if isinstance(planner, str) and planner in PLANNERS:
        return repr(planner), PLANNERS[planner]
    if callable(planner) and not isinstance(planner, str):
        return _planner_name(planner), planner
    shown = repr(planner)
    raise EinjoinError(f"unknown planner {shown if len(shown) <= 60 else shown[:57] + '...'}: give a "
                       f"name ({', '.join(sorted(PLANNERS))}) or a callable (graph, cluster) -> "
                       f"{{node: join-agg spec}}")


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


def plan_specs(planner: "str | Planner", graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    """Run ``planner`` (a registered name or a callable) on ``graph`` and ``cluster`` and check
    what it returns (:func:`check_planned`): one join-agg spec per node it cuts. A planner's own
    non-einjoin exception is raised as an :class:`EinjoinError` naming it (the cause chained)."""
    who, fn = resolve_planner(planner)
    try:
        result = fn(graph, cluster)
    except (EinjoinError, MemoryError):
        raise
    except Exception as e:  # a user's planner (or a bug): name it, keep the cause
        raise EinjoinError(f"planner {who} failed: {type(e).__name__}: {e}") from e
    return check_planned(result, graph, who)


