"""Planners: graph + cluster -> one join-agg spec per node. All share one signature and one
registry, with ``auto`` (= ``eindecomp``, the EinDecomp dynamic program with refinement, see
:mod:`einjoin.optim.search`); ``exhaustive`` is ground truth for small graphs; the named
baselines ``data_parallel``, ``megatron`` and ``mesh_ilp`` (:mod:`einjoin.optim.baselines`) are
what a user would otherwise pick; ``split_largest`` and ``single`` are simple references.

>>> import einjoin as ej
>>> from einjoin.optim import plan_specs
>>> z = ej.input("x", (64, 32)) @ ej.input("w", (32, 16))
>>> specs = plan_specs("split_largest", ej.Graph(z), ej.local(4))
>>> print(specs[z.node])
{m: 4, n: 1, k: 1}
"""

from __future__ import annotations

from typing import Callable

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import decompose
from einjoin.decomp.spec import JoinAggSpec, dim_labels, label_sizes, output_labels
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node

__all__ = ["PLANNERS", "Planner", "register_planner", "plan_specs", "derive_input_specs"]

Planner = Callable[[Graph, Cluster], dict[Node, JoinAggSpec]]
PLANNERS: dict[str, Planner] = {}


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
    specs: dict[Node, JoinAggSpec] = {}
    for n in graph.ops:
        sizes = label_sizes(n)
        outs = output_labels(n)
        spec = {}
        if outs:
            lab = max(outs, key=lambda l: sizes[l])
            spec[lab] = min(p, sizes[lab])
        specs[n] = JoinAggSpec.for_node(n, spec)
    return derive_input_specs(graph, specs)


@register_planner("single")
def single_block(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    """One block per op (everything on one device): the baseline with nothing to move."""
    return {n: JoinAggSpec.for_node(n, None) for n in graph.nodes}


def _eindecomp(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    from einjoin.optim.search import eindecomp
    return eindecomp(graph, cluster)


def _exhaustive(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    from einjoin.optim.search import exhaustive
    return exhaustive(graph, cluster)


PLANNERS["eindecomp"] = _eindecomp
PLANNERS["exhaustive"] = _exhaustive
PLANNERS["auto"] = _eindecomp


def _baseline(name: str) -> Planner:
    def plan(graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
        from einjoin.optim import baselines
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


def plan_specs(planner: "str | Planner", graph: Graph, cluster: Cluster) -> dict[Node, JoinAggSpec]:
    if callable(planner):
        return planner(graph, cluster)
    if planner not in PLANNERS:
        raise EinjoinError(f"unknown planner {planner!r}; known: {', '.join(sorted(PLANNERS))}")
    return PLANNERS[planner](graph, cluster)


