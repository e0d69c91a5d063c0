"""The simple reference planners (``split_largest``, ``single``) and the rule every planner's
plan ends with: graph inputs take the partition their first consumer needs.

>>> import einjoin as ej
>>> z = ej.input("x", (64, 32)) @ ej.input("w", (32, 16))
>>> print(split_largest(ej.Graph(z), ej.local(4))[z.node])
{m: 4, n: 1, k: 1}
"""

from __future__ import annotations

from einjoin.cluster import Cluster
from einjoin.decomp.decompose import decompose
from einjoin.decomp.spec import JoinAggSpec, dim_labels, label_sizes, output_labels
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.planner.fit import MemoryLimit

__all__ = ["split_largest", "single_block", "largest_output_cut", "derive_input_specs"]


def split_largest(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None
                  ) -> dict[Node, JoinAggSpec]:
    """Every op cuts its largest output label into (up to) P blocks: no partial sums, every op
    spread over all devices. Inputs take the partition their first consumer needs. It does not
    plan for memory (``memory_limit`` is accepted and ignored; the memory planner fits later)."""
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


def single_block(graph: Graph, cluster: Cluster, *, memory_limit: MemoryLimit | None = None
                 ) -> dict[Node, JoinAggSpec]:
    """One block per op (everything on one device): the baseline with nothing to move
    (``memory_limit`` is accepted and ignored)."""
    return {n: JoinAggSpec.for_node(n, None) for n in graph.nodes}


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
