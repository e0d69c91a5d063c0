"""Numerics (issue 16): half-precision ops accumulate in float32 everywhere — inside kernels, in
partial sums kept, reduced and moved across devices — and cast once at the op's output; kernels'
floating-point edge cases give IEEE results without numpy warnings on every backend; and the
accounting (task graph, run stats, exact bytes, cost model, memory needs) follows the float32
partials.

The data of the accumulation tests is integer-valued, so float32 accumulation is exact and the
result rounds exactly as the float64 result does; each test first checks that its data is
adversarial (rounding partial sums to the half type overflows or loses > 1e-2 relative)."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.decomp.footprint import kernel_scratch, op_need
from einjoin.errors import EinjoinError
from einjoin.exchange.tasks import TaskKind
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.kernels import partial_dtype
from einjoin.planner.cost import agg_cost
from einjoin.planner.exact import aggregation_bytes, plan_bytes
from einjoin.planner.cost import CostModel
from einjoin.placement import NodePlacement
from einjoin.plan import build_taskgraph
from einjoin.memplan.needs import task_needs
from einjoin.plan.execute import compute, run_reference
from budget import examples
from graphgen import graphs, specs_for

HALF = ["float16", "bfloat16"]
F64 = np.float64


def _split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, parts + 1).astype(int)
    return list(zip(edges[:-1], edges[1:]))


def _half_accumulated(partials: list[np.ndarray], dtype: str) -> np.ndarray:
    """What the old code computed: each partial rounded to the half type, summed in it."""
    dt = numpy_dtype(dtype)
    with np.errstate(all="ignore"):
        acc = partials[0].astype(dt)
        for p in partials[1:]:
            acc = (acc + p.astype(dt)).astype(dt)
    return acc


def _assert_adversarial(partials: list[np.ndarray], exact: np.ndarray, dtype: str) -> None:
    # the data must break half-precision partial sums, or the test could not fail on them
    bad = _half_accumulated(partials, dtype).astype(F64)
    err = np.abs(bad - exact).max() / max(np.abs(exact).max(), 1.0)
    assert not np.isfinite(bad).all() or err > 1e-2, (dtype, err)


def _assert_close(got: np.ndarray, exact: np.ndarray, dtype: str) -> None:
    """Within 1e-3 relative of the float64 result cast to ``dtype`` (NaN/inf fail)."""
    assert got.dtype == numpy_dtype(dtype)
    want = exact.astype(numpy_dtype(dtype)).astype(F64)
    assert np.isfinite(got.astype(F64)).all()
    np.testing.assert_allclose(got.astype(F64), want, rtol=1e-3, atol=0)


def _matmul_data(dtype: str, m: int = 4, k: int = 16, n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """a @ b whose k-blocks (first half of k large positive, second half large negative, b the
    same in both halves) sum far beyond the half type's range or precision, then cancel."""
    rng = np.random.default_rng(16)
    big = 8000 if dtype == "float16" else 256
    sign = np.where(np.arange(k) < k // 2, 1, -1)
    a = big * sign[None, :] + rng.integers(1, 8, (m, k))
    b_half = rng.integers(3, 6, (k // 2, n))
    b = np.concatenate([b_half, b_half])
    return a.astype(numpy_dtype(dtype)), b.astype(numpy_dtype(dtype))


def _sum_data(dtype: str, m: int = 3, k: int = 64) -> np.ndarray:
    rng = np.random.default_rng(61)
    big = 4096 if dtype == "float16" else 300
    sign = np.where(np.arange(k) < k // 2, 1, -1)
    x = big * sign[None, :] + 4 * rng.integers(1, 8, (m, k))
    return x.astype(numpy_dtype(dtype))


# ------------------------------------------------------------------ float32 accumulation


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("k_blocks", [2, 4])
def test_half_matmul_split_k_accumulates_in_float32(dtype: str, devices: int, k_blocks: int) -> None:
    av, bv = _matmul_data(dtype)
    exact = av.astype(F64) @ bv.astype(F64)
    _assert_adversarial([av[:, s:e].astype(F64) @ bv[s:e].astype(F64)
                         for s, e in _split_bounds(av.shape[1], k_blocks)], exact, dtype)
    a = ej.input("a", av.shape, dtype)
    b = ej.input("b", bv.shape, dtype)
    z = a @ b
    prog = ej.compile(z, devices=devices, specs={z: {"k": k_blocks}}, backend="sync", quiet=True)
    _assert_close(prog.run(a=av, b=bv), exact, dtype)
    _assert_close(prog.run_reference(a=av, b=bv), exact, dtype)
    _assert_close(ej.execute_blocked(z, {z: {"k": k_blocks}}, a=av, b=bv), exact, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_half_sum_split_accumulates_in_float32(dtype: str, devices: int) -> None:
    xv = _sum_data(dtype)
    exact = xv.astype(F64).sum(1)
    _assert_adversarial([xv[:, s:e].astype(F64).sum(1) for s, e in _split_bounds(xv.shape[1], 4)],
                        exact, dtype)
    x = ej.input("x", xv.shape, dtype)
    z = x.sum(1)
    (agg,) = z.node.op.agg_labels
    for backend in ("sync", "threads"):
        prog = ej.compile(z, devices=devices, specs={z: {agg: 4}}, backend=backend, quiet=True)
        _assert_close(prog.run(x=xv), exact, dtype)
    # the default planner, whatever it splits
    _assert_close(ej.compile(z, devices=devices, quiet=True).run(x=xv), exact, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_reference_and_blocked_accumulate_in_float32(dtype: str) -> None:
    av, bv = _matmul_data(dtype, m=6, k=32, n=3)
    a = ej.input("a", av.shape, dtype)
    b = ej.input("b", bv.shape, dtype)
    z = a @ b
    exact = av.astype(F64) @ bv.astype(F64)
    _assert_close(ej.reference(z, a=av, b=bv), exact, dtype)
    for devices in (1, 2, 4):
        _assert_close(ej.compile(z, devices=devices, quiet=True).run(a=av, b=bv), exact, dtype)
    for workers, det in ((1, False), (3, False), (3, True)):
        got = ej.execute_blocked(z, {z: {"k": 4, "m": 2}}, a=av, b=bv, workers=workers,
                                 deterministic=det)
        _assert_close(got, exact, dtype)
    xv = _sum_data(dtype)
    x = ej.input("x", xv.shape, dtype)
    s = x.sum(1)
    (agg,) = s.node.op.agg_labels
    _assert_close(ej.reference(s, x=xv), xv.astype(F64).sum(1), dtype)
    _assert_close(ej.execute_blocked(s, {s: {agg: 8}}, x=xv, workers=2), xv.astype(F64).sum(1), dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_contractions_property(dtype: str) -> None:
    """Random integer-valued half matmuls and sums (float32 sums of them are exact) under random
    splits of the contracted label, devices, placements and backends: the result is exactly the
    float64 result rounded once to the dtype (inf where that overflows)."""
    top = 2048 if dtype == "float16" else 256  # the integers the dtype holds exactly

    @settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(m=st.integers(1, 4), k=st.integers(2, 40), n=st.integers(1, 4), data=st.data())
    def check(m: int, k: int, n: int, data: st.DataObject) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        av = rng.integers(-top, top + 1, (m, k)).astype(numpy_dtype(dtype))
        bv = rng.integers(-8, 9, (k, n)).astype(numpy_dtype(dtype))
        a = ej.input("a", av.shape, dtype)
        b = ej.input("b", bv.shape, dtype)
        use_sum = data.draw(st.booleans())
        z = ej.einsum("mk->m", a) if use_sum else a @ b
        (lab,) = z.node.op.agg_labels
        cuts = sorted(data.draw(st.sets(st.integers(1, k - 1), min_size=1, max_size=min(k - 1, 5))))
        prog = ej.compile(z, devices=data.draw(st.sampled_from([1, 2, 3, 4])),
                          specs={z: {lab: [0, *cuts, k]}},
                          placement=data.draw(st.sampled_from(["round_robin", "random", "greedy"])),
                          backend=data.draw(st.sampled_from(["sync", "threads"])), quiet=True)
        feeds = {"a": av} if use_sum else {"a": av, "b": bv}
        exact = av.astype(F64).sum(1) if use_sum else av.astype(F64) @ bv.astype(F64)
        with np.errstate(over="ignore"):
            want = exact.astype(numpy_dtype(dtype))
        got = prog.run(**feeds)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(F64), want.astype(F64))

    check()


@pytest.mark.parametrize("dtype", HALF)
def test_half_partials_under_a_memory_cap(dtype: str) -> None:
    """A capped plan chains its reduces (memplan.chain): the accumulator between steps stays
    float32, only the last step casts."""
    av, bv = _matmul_data(dtype)
    a = ej.input("a", av.shape, dtype)
    b = ej.input("b", bv.shape, dtype)
    z = a @ b
    # 512 bytes: below what the values need at once (~750), so the reduce is chained (a cap that
    # holds everything keeps the n-ary reduce, f20dcd3)
    prog = ej.compile(z, devices=1, specs={z: {"k": 4}}, memory_limit=512, backend="sync",
                      quiet=True)
    steps = [t for t in prog.taskgraph.tasks if t.kind == TaskKind.REDUCE]
    assert len(steps) == 3  # a chain of two-input steps
    assert [prog.taskgraph.values[t.writes].dtype for t in steps] == ["float32", "float32", dtype]
    assert [t.dtype for t in steps] == ["float32", "float32", dtype]
    _assert_close(prog.run(a=av, b=bv), av.astype(F64) @ bv.astype(F64), dtype)
    rs = prog.run_stats
    assert rs is not None and max(rs.peak_bytes_per_device.values()) <= 512


@pytest.mark.slow  # make test-all: fresh Ray actors; half partials travel as float32 on threads by default
@pytest.mark.xdist_group("ray")
def test_half_partials_on_ray(ray_session: object) -> None:
    """The Ray backend runs the same tasks: float32 partials travel through the object store and
    the measured bytes are the plan's."""
    from einjoin.runtime.backends.ray import RayBackend
    backend = RayBackend(quiet=True)
    try:
        for dtype in HALF:
            av, bv = _matmul_data(dtype)
            a = ej.input("a", av.shape, dtype)
            b = ej.input("b", bv.shape, dtype)
            z = a @ b
            prog = ej.compile(z, devices=2, specs={z: {"k": 4}}, placement="round_robin",
                              backend=backend, quiet=True)
            _assert_close(prog.run(a=av, b=bv), av.astype(F64) @ bv.astype(F64), dtype)
            assert prog.run_stats is not None
            assert prog.run_stats.bytes_moved == prog.stats.bytes_moved > 0
    finally:
        backend.close()


def test_max_min_partials_stay_in_the_op_dtype() -> None:
    """max/min pick one of their arguments: exact in half, so partials are not widened."""
    x = ej.input("x", (4, 8), "float16")
    for z in (x.max(1), x.min(1)):
        assert partial_dtype(z.node) == "float16"
    assert partial_dtype(x.sum(1).node) == partial_dtype(x.prod(1).node) == "float32"
    assert partial_dtype(ej.input("y", (4, 8), "float32").sum(1).node) == "float32"
    assert partial_dtype(ej.input("w", (4, 8), "float64").sum(1).node) == "float64"
    xv = (np.arange(32).reshape(4, 8) * 1000.0).astype(np.float16)
    z = x.max(1)
    (agg,) = z.node.op.agg_labels
    prog = ej.compile(z, devices=2, specs={z: {agg: 2}}, placement="round_robin", quiet=True)
    np.testing.assert_array_equal(prog.run(x=xv), xv.max(1))
    assert prog.stats.bytes_moved == 4 * 2  # one float16 partial of 4 elements


# ------------------------------------------------------------------ accounting


@pytest.mark.parametrize("dtype", HALF)
def test_half_partials_travel_and_are_counted_as_float32(dtype: str) -> None:
    av, bv = _matmul_data(dtype, m=8, k=16, n=8)
    a = ej.input("a", av.shape, dtype)
    b = ej.input("b", bv.shape, dtype)
    z = a @ b
    prog = ej.compile(z, devices=2, specs={z: {"k": 2}}, placement="round_robin", backend="threads",
                      quiet=True)
    moves = [t for t in prog.taskgraph.tasks if t.kind == TaskKind.MOVE and t.node is z.node]
    assert [(t.dtype, t.nbytes) for t in moves] == [("float32", 8 * 8 * 4)]
    prog.run(a=av, b=bv)
    assert prog.run_stats is not None
    # measured (the arrays that arrived) == planned == the exact formula == the cost model
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved == 8 * 8 * 4
    assert plan_bytes(prog.graph, prog.decomps, prog.placement) == prog.stats.bytes_moved
    d = ej.decompose(z.node, {"k": 2})
    assert agg_cost(d) == 8 * 8 * 4
    info = CostModel(ej.Graph(z), 2).info(z.node, d.spec)
    assert info.agg_bytes == agg_cost(d)  # the search's inline copy of the model agrees
    assert prog.stats.bytes_fetched == 8 * 8 * 2  # the output is the op's dtype


def test_partials_all_on_one_device_away_from_home_travel_cast() -> None:
    """When every partial of a block sits on one device that is not the block's home, that
    device's reduce is the last step: it casts, and the half-precision result travels."""
    av, bv = _matmul_data("float16")
    a = ej.input("a", av.shape, "float16")
    b = ej.input("b", bv.shape, "float16")
    z = a @ b
    graph = ej.Graph(z)
    decomps = {n: ej.decompose(n, {"k": 4} if n is z.node else None) for n in graph.nodes}
    placement = {n: NodePlacement((0,), {(0, 0): 0}) for n in graph.inputs}
    d = decomps[z.node]
    placement[z.node] = NodePlacement((1,) * len(d.kernels), {(0, 0): 0})  # kernels on 1, home 0
    tg = build_taskgraph(graph, decomps, placement, 2)
    moves = [t for t in tg.tasks if t.kind == TaskKind.MOVE and t.node is z.node]
    assert [(t.dtype, t.nbytes) for t in moves] == [("float16", z.node.size * 2)]
    assert aggregation_bytes(d, placement[z.node].kernel_devices, placement[z.node].homes) == \
        z.node.size * 2
    assert plan_bytes(graph, decomps, placement) == tg.stats().bytes_moved
    (got,) = run_reference(tg, decomps, {a.node: av, b.node: bv})
    _assert_close(got, av.astype(F64) @ bv.astype(F64), "float16")


@pytest.mark.parametrize("dtype", HALF)
def test_op_need_covers_what_half_partial_tasks_hold(dtype: str) -> None:
    """The optimizer's per-op estimate (op_need) bounds what the memory planner finds each task
    of the op holding (task_needs, from the task graph's float32 partial values)."""
    a = ej.input("a", (16, 64), dtype)
    b = ej.input("b", (64, 16), dtype)
    z = a @ b
    prog = ej.compile(z, devices=2, specs={z: {"k": 4, "m": 2}}, memory_limit="1MiB", quiet=True)
    tasks = [n for n in task_needs(prog.taskgraph, prog.decomps)
             if n.task.node is z.node and n.task.kind in (TaskKind.KERNEL, TaskKind.REDUCE)]
    assert {n.task.kind for n in tasks} == {TaskKind.KERNEL, TaskKind.REDUCE}
    assert max(n.needed for n in tasks) <= op_need(prog.decomps[z.node])


def test_kernel_scratch_of_a_half_join_is_float32() -> None:
    """A non-contraction join of half inputs runs on float32 copies: the joined block it
    materialises is 4 bytes an element, not 2."""
    x = ej.input("x", (8, 16), "float16")
    m = x.max(1)
    e = ej.einsum("ij,i->i", x, m, join="exp(x0 - x1)")
    d = ej.decompose(e.node, None)
    ins = [8 * 16 * 2, 8 * 2]
    # the float32 copies of the inputs, plus the joined block and a temporary, in float32
    assert kernel_scratch(d, 0, ins, 8 * 2) >= 2 * sum(ins) + 2 * 8 * 16 * 4


def _checked_run_reference(tg, decomps, feeds):  # type: ignore[no-untyped-def]
    """run_reference, asserting that every array a task writes has its value's dtype and shape."""
    vals: dict[int, np.ndarray] = {}
    host: dict[int, np.ndarray] = {}
    for t in tg.tasks:
        p = t.payload  # a kind's own fields
        if t.kind == TaskKind.FREE:
            del vals[p.frees]
        elif t.kind in (TaskKind.EVICT, TaskKind.WRITEBACK):
            host[p.host_key] = vals.pop(p.frees)
        elif t.kind == TaskKind.RELOAD:
            vals[t.writes] = np.array(host[p.host_key] if p.box is None else
                                      feeds[t.node][tuple(slice(a, b) for a, b in p.box)])
        else:
            v = tg.values[t.writes]
            out = compute(t, vals.get, feeds, decomps, v.shape)
            assert out.dtype == numpy_dtype(v.dtype) and out.shape == v.shape, (t, out.dtype)
            assert t.dtype == v.dtype
            vals[t.writes] = out


@pytest.mark.parametrize("dtype", HALF)
def test_half_graphs_accounting_property(dtype: str) -> None:
    """Random half-precision graphs under random specs: every task writes an array of its value's
    dtype, measured bytes equal the plan's and the exact formula's, outputs have the reference's
    dtype."""

    @settings(max_examples=examples(40), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        outs, feeds = data.draw(graphs(dtype))
        specs = data.draw(specs_for(outs))
        devices = data.draw(st.sampled_from([1, 2, 3, 4]))
        placement = data.draw(st.sampled_from(["round_robin", "random", "greedy"]))
        capped = data.draw(st.booleans())
        prog = ej.compile(outs, devices=devices, specs=specs, placement=placement,
                          planner="split_largest", backend="threads", quiet=True,
                          memory_limit="64MiB" if capped else None)
        _checked_run_reference(prog.taskgraph, prog.decomps,
                               {x: feeds[x.op.name] for x in prog.graph.inputs})
        got = prog.run(**feeds)
        rs = prog.run_stats
        assert rs is not None and rs.bytes_moved == prog.stats.bytes_moved
        assert plan_bytes(prog.graph, prog.decomps, prog.placement) == prog.stats.bytes_moved
        want = ej.reference(outs, **feeds)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape

    check()


# ------------------------------------------------------------------ no numpy warnings


def _edge_case_program() -> tuple[list[ej.Tensor], dict[str, np.ndarray], list[np.ndarray]]:
    """log(0), 0/0, overflow in a product, a matmul and a cast: IEEE inf/nan, as numpy gives
    them with warnings silenced."""
    x = ej.input("x", (4, 4))
    y = ej.input("y", (4, 4))
    xv = np.zeros((4, 4), np.float32)
    xv[0] = 3e38
    xv[1] = -3e38
    yv = np.zeros((4, 4), np.float32)
    yv[0] = 3e38
    yv[2] = np.inf
    outs = [x.log(), x / y, x * y, x @ y, x.half(), x.prod(1)]
    with np.errstate(all="ignore"):
        want = [np.log(xv), xv / yv, xv * yv, (xv.astype(F64) @ yv.astype(F64)).astype(np.float32),
                xv.astype(np.float16), xv.prod(1)]
    return outs, {"x": xv, "y": yv}, want


def _assert_ieee(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])


@pytest.mark.parametrize("backend", ["sync", "threads"])
def test_kernel_warnings_do_not_leak(backend: str) -> None:
    outs, feeds, want = _edge_case_program()
    specs = {outs[3]: {"k": 2}, outs[5]: {lab: 2 for lab in outs[5].node.op.agg_labels}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning anywhere (any thread) fails the run
        for devices in (1, 2):
            prog = ej.compile(outs, devices=devices, backend=backend, specs=specs, quiet=True)
            _assert_ieee(list(prog.run(**feeds)), want)
            _assert_ieee(list(prog.run_reference(**feeds)), want)
        _assert_ieee(list(ej.reference(outs, **feeds)), want)
        for workers in (1, 2):
            _assert_ieee(list(ej.execute_blocked(outs, specs, workers=workers, **feeds)), want)


def test_half_overflow_at_the_output_is_inf_without_warning() -> None:
    """A half sum whose true value passes 65504 is inf (as torch gives), silently."""
    x = ej.input("x", (2, 8), "float16")
    z = x.sum(1)
    (agg,) = z.node.op.agg_labels
    xv = np.full((2, 8), 60000, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = ej.compile(z, devices=2, specs={z: {agg: 2}}, quiet=True).run(x=xv)
    assert np.isposinf(got).all() and got.dtype == np.float16


# ------------------------------------------------------------------ execute_blocked arguments


@pytest.mark.parametrize("workers", [0, -1, -8, 1.5, "2", None, True])
def test_execute_blocked_rejects_bad_workers(workers: object) -> None:
    x = ej.input("x", (2, 2))
    with pytest.raises(EinjoinError, match="workers"):
        ej.execute_blocked(x.sum(), None, x=np.ones((2, 2), np.float32), workers=workers)


def test_execute_blocked_accepts_numpy_integer_workers() -> None:
    x = ej.input("x", (4, 4))
    xv = np.arange(16, dtype=np.float32).reshape(4, 4)
    got = ej.execute_blocked(x.sum(1), None, x=xv, workers=np.int64(2))
    np.testing.assert_array_equal(got, xv.sum(1))


def test_bfloat16_is_ml_dtypes() -> None:
    # the tests above build bfloat16 data through numpy_dtype; make sure that is ml_dtypes'
    assert numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)


# ---------------------------------------------------------------- norms of half data, as torch

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_half_norms_compute_in_float32_like_torch(norm: str, dtype: str) -> None:
    """A norm of half data keeps its statistics in float32 and rounds once, as torch does: in
    half, a mean square past 65504 (|x| > 256) overflows and a large mean loses x - mean."""
    import torch
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    x = ((1000 + torch.randn(4, 64, generator=g)) if norm == "layer_norm"
         else 300 * torch.randn(4, 64, generator=g)).to(tdt)
    w, b = torch.randn(64, generator=g).to(tdt), torch.randn(64, generator=g).to(tdt)
    X, W, B = (ej.input(n, tuple(t.shape), dtype) for n, t in (("x", x), ("w", w), ("b", b)))
    if norm == "layer_norm":
        want, y, feeds = torch.nn.functional.layer_norm(x, (64,), w, b), ej.layer_norm(X, None, W, B), (x, w, b)
    else:
        want, y, feeds = torch.nn.functional.rms_norm(x, (64,), w, 1e-6), ej.rms_norm(X, W), (x, w)
    for devices in (1, 2):
        got = ej.compile(y, devices=devices, quiet=True).run(*feeds)
        assert got.dtype == tdt
        err = (got.double() - want.double()).abs().max().item()
        assert err <= (0.01 if dtype == "float16" else 0.02), (norm, dtype, devices, err)
