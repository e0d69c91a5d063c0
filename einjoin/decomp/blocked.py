"""The single-process blocked executor: the relational semantics made executable.

Every node is stored as a tensor relation under its spec's output partition. An op joins its
inputs' relations on block keys (each kernel names the input blocks it reads), runs the kernel
on each joined tuple and aggregates partial results by output key.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (6, 4)); w = ej.input("w", (4, 5))
>>> h = x @ w
>>> y = h.relu()
>>> xv, wv = np.random.rand(6, 4).astype(np.float32), np.random.rand(4, 5).astype(np.float32)
>>> out = ej.execute_blocked(y, {h: {"m": 2, "k": 2}, y: {"a": 3}}, x=xv, w=wv)
>>> bool(np.allclose(out, np.maximum(xv @ wv, 0), atol=1e-6))
True
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any
from collections.abc import Mapping

import numpy as np

from einjoin.decomp.block_kernels import run_kernel
from einjoin.decomp.decompose import Decomposition, decompose
from einjoin.decomp.partition import Partition
from einjoin.decomp.relation import TensorRelation
from einjoin.errors import EinjoinError, PartitionError
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.reference import bind_feeds

__all__ = ["execute_blocked", "SpecMap"]

SpecMap = "Mapping[Any, Any] | Callable[[Node], Any] | None"


def _spec_for(specs: Any, node: Node) -> Any:
    if specs is None:
        return None
    if callable(specs) and not isinstance(specs, Mapping):
        return specs(node)
    for key, value in specs.items():
        if getattr(key, "node", key) is node:
            return value
    return None


def _check_specs(specs: Any, graph: Graph) -> None:
    if specs is None or (callable(specs) and not isinstance(specs, Mapping)):
        return
    if not isinstance(specs, Mapping):
        raise PartitionError(f"specs must be a mapping tensor -> spec, a function node -> spec, or "
                             f"None; got {type(specs).__name__}")
    members = set(graph.nodes)
    for key in specs:
        if getattr(key, "node", key) not in members:
            raise PartitionError(f"a spec is given for {key!r}, which is not in the graph")


def execute_blocked(outputs: Any, specs: Any = None, *args: Any, deterministic: bool = False,
                    workers: int = 1, **feeds: Any) -> Any:
    """Evaluate ``outputs`` block by block. ``specs`` maps nodes (or tensors) to join-agg specs, or
    is a function node -> spec; nodes without a spec are one block. With ``workers > 1`` kernels
    run on a thread pool and partial results combine in arrival order; ``deterministic=True``
    combines them in kernel order, so repeated runs are bitwise equal."""
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise EinjoinError(f"execute_blocked: workers must be a positive integer (1 runs kernels "
                           f"inline, n > 1 on n threads); got {workers!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise EinjoinError(f"execute_blocked: deterministic must be True or False, got {deterministic!r}")
    graph = Graph(outputs)
    _check_specs(specs, graph)
    values = bind_feeds(graph, args, feeds)
    rels: dict[Node, TensorRelation] = {}
    pool = cf.ThreadPoolExecutor(int(workers)) if workers > 1 else None
    try:
        for node in graph.nodes:
            d = decompose(node, _spec_for(specs, node))
            if node.facts.fed:
                rels[node] = TensorRelation.from_dense(values[node], d.out_partition)
                continue
            ins = [rels[x].repartition(p) for x, p in zip(node.inputs, d.in_partitions)]
            rels[node] = _run_op(d, ins, pool, deterministic)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    results = tuple(rels[o].to_dense() for o in graph.outputs)
    return results if isinstance(outputs, (list, tuple)) else results[0]


def _run_op(d: Decomposition, ins: list[TensorRelation], pool: cf.ThreadPoolExecutor | None,
            deterministic: bool) -> TensorRelation:
    def one(i: int) -> tuple[int, np.ndarray]:
        k = d.kernels[i]
        blocks = [None if key is None else rel.blocks[key] for key, rel in zip(k.in_keys, ins)]
        # IEEE results (inf, nan) without numpy warnings, as on every backend; errstate is
        # per thread, so each pool thread sets it
        with np.errstate(all="ignore"):
            return i, run_kernel(d, k, blocks)

    out: dict[Any, np.ndarray] = {}
    if pool is None:
        results: Any = (one(i) for i in range(len(d.kernels)))
    elif deterministic:
        results = pool.map(one, range(len(d.kernels)))  # yields in submission order
    else:
        futures = [pool.submit(one, i) for i in range(len(d.kernels))]
        results = (f.result() for f in cf.as_completed(futures))
    with np.errstate(all="ignore"):
        for i, partial in results:
            key = d.kernels[i].out_key
            if key in out:
                out[key] = d.agg.combine(out[key], partial).astype(partial.dtype, copy=False)
            else:
                out[key] = partial if d.n_partials == 1 else np.array(partial)
        if d.n_partials > 1:
            # partials of a half-precision sum are float32 (see partial_dtype): cast once, here
            dtype = numpy_dtype(d.node.dtype)
            out = {key: v.astype(dtype, copy=False) for key, v in out.items()}
    return TensorRelation(d.out_partition, out)


def output_partition(node: Node, spec: Any = None) -> Partition:
    """The partition ``node``'s result comes in under ``spec``."""
    return decompose(node, spec).out_partition
