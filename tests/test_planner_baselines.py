"""The named baseline planners (einjoin.planner.baselines): plans that run, data parallelism's
batch label, Megatron's column/row pattern and its bytes, the mesh ILP against brute force over
its own space, against exhaustive search and against data parallelism."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.models.graphs import transformer_block
from einjoin.planner import PLANNERS
from einjoin.planner.ilp import objective as _objective, problem
from einjoin.planner.baselines import mesh_candidates
from einjoin.planner.baselines import (NotApplicable, data_parallel, megatron,
                                     mesh_ilp, mesh_shapes, mesh_strategies, parameter_gradients, zero)
from einjoin.planner.cost import CostModel, model_cost, total_cost
from einjoin.planner.search import exhaustive
from budget import examples
from graphgen import graphs, oracle

BASELINES = ["data_parallel", "megatron", "mesh_ilp", "zero"]
F32 = 4


def _feeds(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}


def _mlp(m: int = 64, d: int = 32, h: int = 48) -> ej.Tensor:
    x = ej.input("x", (m, d))
    return (x @ ej.param("w1", (d, h))).relu() @ ej.param("w2", (h, d))


def _attention(seq: int = 16, d: int = 16, heads: int = 2) -> ej.Tensor:
    """Attention alone: q, k, v projections with parameters, no output projection."""
    x = ej.input("x", (seq, d))

    def heads_of(name: str) -> ej.Tensor:
        w = ej.param(name, (d, d))
        return ej.linear(x, w).reshape(seq, heads, d // heads).transpose(0, 1)

    return ej.attention(heads_of("wq"), heads_of("wk"), heads_of("wv"), causal=True)


def test_registered_and_not_applicable_is_an_einjoin_error() -> None:
    assert set(BASELINES) <= set(PLANNERS)
    assert issubclass(NotApplicable, ej.EinjoinError)


@pytest.mark.parametrize("name", BASELINES)
def test_plans_of_the_transformer_block_run_correctly(name: str) -> None:
    out, shapes = transformer_block(seq=32, d=32, heads=4, hidden=48)
    feeds = _feeds(shapes)
    prog = ej.compile(out, devices=4, planner=name)
    assert set(PLANNERS[name](prog.graph, prog.cluster)) == set(prog.graph.nodes)
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), rtol=1e-4, atol=1e-4)
    assert prog.run_stats is not None and prog.run_stats.bytes_moved == prog.stats.bytes_moved


# --------------------------------------------------------------------------------------------
# data parallelism


def test_data_parallel_splits_m_of_a_bare_matmul() -> None:
    z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
    g, c = ej.Graph(z), ej.local(4)
    specs = data_parallel(g, c)
    assert specs[z.node].counts() == {"m": 4, "n": 1, "k": 1}
    a, b = g.inputs
    assert specs[a].counts() == {"a": 4, "b": 1} and specs[b].counts() == {"a": 1, "b": 1}
    assert model_cost(g, c, specs) == 3 * 32 * 16 * F32  # b replicated to the other 3 devices


def test_data_parallel_needs_a_batch_at_least_p() -> None:
    z = ej.input("a", (2, 32)) @ ej.input("b", (32, 16))
    with pytest.raises(NotApplicable, match="batch"):
        data_parallel(ej.Graph(z), ej.local(4))
    with pytest.raises(NotApplicable):
        ej.compile(z, devices=4, planner="data_parallel", backend="null")
    assert data_parallel(ej.Graph(z), ej.local(2))[z.node].counts()["m"] == 2


def test_data_parallel_without_a_batch_label() -> None:
    z = ej.input("x", (64, 8)).sum()  # the reduction keeps no label
    with pytest.raises(NotApplicable, match="no batch label"):
        data_parallel(ej.Graph(z), ej.local(4))


def test_data_parallel_follows_the_batch_and_stops_at_attention_scores() -> None:
    out, _ = transformer_block(seq=32, d=32, heads=4, hidden=48)
    g = ej.Graph(out)
    specs = data_parallel(g, ej.local(4))
    by_eq = {}
    for n in g.ops:
        if n.facts.contracts:
            by_eq.setdefault(n.op.equation, []).append(specs[n].counts())
    # projections split their rows (the sequence), except the output projection after attention
    proj = by_eq["Ai,oi->Ao"]
    assert sum(c == {"A": 4, "o": 1, "i": 1} for c in proj) == 6
    assert sum(c == {"A": 1, "o": 1, "i": 1} for c in proj) == 1
    # attention (one fused node) reads every key for each query: the sequence is no batch there,
    # so one block
    assert [specs[n].counts() for n in g.ops if n.kind == "attention"] == [{"a": 1, "b": 1, "c": 1}]
    assert specs[g.outputs[0]].counts() == {"a": 4, "b": 1}


# --------------------------------------------------------------------------------------------
# Megatron


@pytest.mark.parametrize("p", [2, 4, 8])
def test_megatron_mlp_is_column_then_row_parallel(p: int) -> None:
    m, d, h = 64, 32, 48
    y = _mlp(m, d, h)
    prog = ej.compile(y, devices=p, planner="megatron", backend="null")
    first, relu, second = prog.graph.ops
    assert prog.specs[first].counts() == {"m": 1, "n": p, "k": 1}      # column-parallel
    assert prog.specs[relu].counts() == {"a": 1, "b": p}
    assert prog.specs[second].counts() == {"m": 1, "n": 1, "k": p}     # row-parallel
    assert [n for n, dd in prog.decomps.items() if dd.n_partials > 1] == [second]
    # x replicated to the other P - 1 devices, then P - 1 partial outputs travel to be summed
    want = (p - 1) * m * d * F32 + (p - 1) * m * d * F32
    assert prog.stats.bytes_moved == want == model_cost(prog.graph, prog.cluster, prog.specs)


def test_megatron_heads_parallel_attention() -> None:
    out, _ = transformer_block(seq=32, d=32, heads=4, hidden=48)
    g = ej.Graph(out)
    specs = megatron(g, ej.local(4))
    # the fused attention node (scores, mask, softmax and values in one kernel) by heads
    assert [specs[n].counts() for n in g.ops if n.kind == "attention"] == [{"a": 4, "b": 1, "c": 1}]
    aggregating = [n for n in g.ops if ej.decompose(n, specs[n]).n_partials > 1]
    # wo after attention, w2 after the MLP: the two row-parallel contractions
    assert len(aggregating) == 2 and all(n.op.equation == "Ai,oi->Ao" for n in aggregating)


def test_megatron_not_applicable() -> None:
    a = _attention(heads=2)
    assert megatron(ej.Graph(a), ej.local(2))  # 2 heads on 2 devices: fine
    with pytest.raises(NotApplicable, match="more devices than heads"):
        megatron(ej.Graph(a), ej.local(4))
    out, _ = transformer_block(seq=32, d=32, heads=4, hidden=48)
    with pytest.raises(NotApplicable, match="more devices than heads"):
        ej.compile(out, devices=8, planner="megatron", backend="null")
    z = ej.input("x", (64, 32)) @ ej.param("w", (32, 16))  # one linear: no pair, no heads
    with pytest.raises(NotApplicable, match="no MLP pair"):
        megatron(ej.Graph(z), ej.local(4))
    z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))  # no parameters at all
    with pytest.raises(NotApplicable, match="no MLP pair"):
        megatron(ej.Graph(z), ej.local(4))


def test_megatron_swiglu_pairs_both_up_projections() -> None:
    x = ej.input("x", (32, 16))
    w1, w3, w2 = ej.param("w1", (40, 16)), ej.param("w3", (40, 16)), ej.param("w2", (16, 40))
    y = ej.linear(ej.silu(ej.linear(x, w1)) * ej.linear(x, w3), w2)
    g = ej.Graph(y)
    specs = megatron(g, ej.local(4))
    counts = [specs[n].counts() for n in g.ops]
    assert counts.count({"A": 1, "o": 4, "i": 1}) == 2 and counts[-1] == {"A": 1, "o": 1, "i": 4}


# --------------------------------------------------------------------------------------------
# the mesh ILP


def test_mesh_shapes_and_strategies() -> None:
    assert mesh_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert mesh_shapes(4) == [(4,), (2, 2)] and mesh_shapes(2) == [(2,)]
    z = ej.input("a", (64, 64)) @ ej.input("b", (64, 64))
    counts = {tuple(s.counts().values()) for s in mesh_strategies(z.node, (2, 4))}
    assert len(counts) == 9 and (2, 4, 1) in counts and (8, 1, 1) in counts
    assert all(np.prod(c) == 8 for c in counts) and (2, 2, 2) not in counts


def _mesh_brute_force(graph: ej.Graph, p: int) -> int:
    """The mesh ILP's optimum by enumeration over the same strategies."""
    model = CostModel(graph, p)
    best = None
    for mesh in mesh_shapes(p):
        prob = problem(graph, model, mesh_candidates(graph, model, mesh, 12))
        for combo in itertools.product(*(prob.strategies[v] for v in prob.ops)):
            c = total_cost(graph, model, dict(zip(prob.ops, combo)))
            best = c if best is None else min(best, c)
    assert best is not None
    return best


def test_mesh_ilp_square_matmul_takes_the_best_2d_mesh_plan() -> None:
    z = ej.input("a", (8192, 8192)) @ ej.input("b", (8192, 8192))
    g, c = ej.Graph(z), ej.local(8)
    cost = model_cost(g, c, mesh_ilp(g, c))
    best_2d = min(model_cost(g, c, {z.node: s, **{x: ej.JoinAggSpec.for_node(x, None) for x in g.inputs}})
                  for mesh in mesh_shapes(8) if len(mesh) == 2 for s in mesh_strategies(z.node, mesh))
    mat = 8192 * 8192 * F32
    assert cost == best_2d == 4 * mat
    assert cost > model_cost(g, c, exhaustive(g, c)) == 3 * mat  # (2, 2, 2) needs a 3-D mesh


def _small_graphs() -> list[ej.Tensor]:
    a, b, cc = (ej.input(n, s) for n, s in (("a", (64, 32)), ("b", (32, 48)), ("c", (48, 16))))
    x, w, v = ej.input("x", (64, 32)), ej.input("w", (32, 16)), ej.input("v", (32, 16))
    # a chain; x read by two ops (shared replicas, an input's second consumer); an MLP; a fill
    return [(a @ b) @ cc, x @ w + x @ v, _mlp(), (a @ b).relu() + 1.0]


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("case", range(4))
def test_mesh_ilp_is_exact_over_its_space_and_never_beats_exhaustive(case: int, p: int) -> None:
    out = _small_graphs()[case]
    g, c = ej.Graph(out), ej.local(p)
    cost = model_cost(g, c, mesh_ilp(g, c))
    assert cost == _mesh_brute_force(g, p)
    assert cost == model_cost(g, c, mesh_ilp(g, c, tight=False))  # the plain linearisation
    assert cost >= model_cost(g, c, exhaustive(g, c))
    try:
        assert cost <= model_cost(g, c, data_parallel(g, c))
    except NotApplicable:
        pass


def test_mesh_ilp_objective_is_the_cost_model_on_the_transformer_block() -> None:
    out, _ = transformer_block(seq=32, d=32, heads=4, hidden=48)
    g = ej.Graph(out)
    model = CostModel(g, 4)
    rng = np.random.default_rng(0)
    for mesh in mesh_shapes(4):
        prob = problem(g, model, mesh_candidates(g, model, mesh, 12))
        for _ in range(20):
            pick = {v: int(rng.integers(len(prob.strategies[v]))) for v in prob.ops}
            chosen = {v: prob.strategies[v][j] for v, j in pick.items()}
            assert _objective(prob, pick) == total_cost(g, model, chosen)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_mesh_ilp_beats_the_other_baselines_on_the_transformer_block(p: int) -> None:
    out, _ = transformer_block(seq=32, d=32, heads=4, hidden=48)
    g, c = ej.Graph(out), ej.local(p)
    cost = model_cost(g, c, mesh_ilp(g, c))
    assert cost <= model_cost(g, c, data_parallel(g, c))
    if p <= 4:  # Megatron's plan cuts one label P ways everywhere: a 1-D mesh plan
        assert cost <= model_cost(g, c, megatron(g, c))


def test_mesh_ilp_plans_the_default_block_quickly() -> None:
    out, _ = transformer_block()
    g, c = ej.Graph(out), ej.local(8)
    t0 = time.perf_counter()
    specs = mesh_ilp(g, c)
    assert time.perf_counter() - t0 < 20
    assert model_cost(g, c, specs) <= model_cost(g, c, data_parallel(g, c))


# --------------------------------------------------------------------------------------------
# training graphs: forward + backward (ej.grad)


def _training(out: ej.Tensor) -> list[ej.Tensor]:
    """``[loss, *gradients w.r.t. every parameter]`` for ``loss = sum(out * R)``."""
    loss = (out * ej.input("loss_weights", out.shape)).sum()
    return [loss, *ej.grad(loss, [ej.Tensor(x) for x in ej.Graph(out).params])]


def _train_cases() -> dict[str, list[ej.Tensor]]:
    return {"mlp": _training(_mlp()),
            "block": _training(transformer_block(seq=32, d=32, heads=4, hidden=48)[0])}


@pytest.mark.parametrize("name", ["data_parallel", "megatron", "zero"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("case", ["mlp", "block"])
def test_baselines_on_training_graphs_run_correctly(name: str, p: int, case: str) -> None:
    outs = _train_cases()[case]
    feeds = _feeds({k: x.shape for k, x in ej.Graph(outs).input_by_name.items()})
    prog = ej.compile(outs, devices=p, planner=name)
    for got, want in zip(prog.run(**feeds), ej.reference(outs, **feeds)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
    assert prog.run_stats is not None and prog.run_stats.bytes_moved == prog.stats.bytes_moved


@pytest.mark.parametrize("p", [2, 4])
def test_data_parallel_gradients_sum_partials_across_the_batch(p: int) -> None:
    outs = _train_cases()["mlp"]
    g = ej.Graph(outs)
    specs = data_parallel(g, ej.local(p))
    grads = parameter_gradients(g)
    assert len(grads) == 2 and {x.shape for x in grads} == {x.shape for x in g.params}
    for v in grads:  # the baseline's specs, on the graph as written
        assert sorted(specs[v].counts().values())[-1] == p
    prog = ej.compile(outs, devices=p, planner="data_parallel")
    # the program plans the fused graph (a gradient's transposed input is read through, so its
    # node is a new one): its gradients are found there the same way
    compiled = parameter_gradients(prog.graph)
    assert len(compiled) == 2 and {x.shape for x in compiled} == {x.shape for x in g.params}
    for v in compiled:
        # the batch label is contracted and cut P ways: P partial sums, on P devices, that the
        # exchange adds up (the all-reduce is not a node of the graph)
        d = prog.decomps[v]
        assert d.n_partials == p and sorted(d.spec.counts().values())[-1] == p
        assert sorted(prog.placement[v].kernel_devices) == list(range(p))
    for x in g.params:  # replicated, as data parallelism holds them
        assert specs[x].num_kernels == 1


@pytest.mark.parametrize("p", [2, 4])
def test_zero_shards_parameters_and_their_gradients(p: int) -> None:
    outs = _train_cases()["block"]
    g = ej.Graph(outs)
    specs = zero(g, ej.local(p))
    dp = data_parallel(g, ej.local(p))
    grads = parameter_gradients(g)
    assert len(grads) == len(g.params) == 9
    for x in [*g.params, *grads]:
        part = specs[x].partition(ej.decomp.spec.output_labels(x))
        sizes = [int(np.prod(part.block_shape(k))) for k in part.keys()]
        assert len(sizes) == p and set(sizes) == {int(np.prod(x.shape)) // p}  # 1/P each
        d = max(range(x.ndim), key=lambda i: x.shape[i])
        assert len(part.bounds[d]) == p + 1  # cut along the largest dim
    for v in grads:  # the batch stays cut: the partials of each block meet where it lives
        assert specs[v].num_kernels == p * p and dp[v].num_kernels == p
    # non-parameter ops plan as data parallelism does
    assert all(specs[v] == dp[v] for v in g.ops if v not in grads)
    # placed round robin, block i of every parameter and of its gradient lives on device i
    # fuse=False: these very nodes are planned (fusion rebuilds a gradient over fused inputs)
    prog = ej.compile(outs, devices=p, planner="zero", placement="round_robin", backend="null", fuse=False)
    for x in grads:
        assert sorted(prog.placement[x].homes.values()) == list(range(p))


def test_zero_needs_parameters() -> None:
    z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
    with pytest.raises(NotApplicable, match="no parameters"):
        zero(ej.Graph(z), ej.local(2))


def test_megatron_splits_the_backward_of_its_chains() -> None:
    outs = _train_cases()["mlp"]
    g = ej.Graph(outs)
    specs = megatron(g, ej.local(4))
    w1, w2 = g.params
    g1, g2 = outs[1:]
    # column-parallel W1 (its output columns cut) and row-parallel W2 (its rows cut): their
    # gradients are cut the same way, each device computing its own slice
    assert specs[w1].counts() == {"a": 1, "b": 4} and specs[w2].counts() == {"a": 4, "b": 1}
    for grad, param in ((g1, w1), (g2, w2)):
        part = ej.decompose(grad.node, specs[grad.node]).out_partition
        assert part.bounds == specs[param].partition(("a", "b")).bounds


# --------------------------------------------------------------------------------------------
# any graph: a plan that runs, or NotApplicable


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_baselines_on_random_graphs_run_or_do_not_apply(data: st.DataObject) -> None:
    outs, feeds = data.draw(graphs("float64"))
    name = data.draw(st.sampled_from(BASELINES))
    p = data.draw(st.sampled_from([1, 2, 3, 4]))
    try:
        prog = ej.compile(outs, devices=p, planner=name, backend="threads")
    except NotApplicable:
        assert name != "mesh_ilp"
        return
    got = prog.run(**feeds)
    for g, w in zip(got, oracle(outs, feeds)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)
