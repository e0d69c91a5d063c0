"""One conformance suite, run unchanged against every backend: random graphs x random join-agg
specs x random placements x device counts x ready-queue orders -> outputs equal ej.reference,
and the bytes the device stores received equal the plan's accounting exactly. The torch backend
also runs float16 and bfloat16 graphs against a float32 oracle."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.planner.baselines import NotApplicable
from einjoin.planner.exact import plan_bytes
from einjoin.runtime import ORDERS
from budget import examples
from graphgen import graphs, specs_for

# Ray: fewer cases (a run costs ~10 ms per task round trip), up to 4 devices (each count's
# actor machinery is the same; 8-way plans are the other backends'), on the session's shared
# backend (tests/conftest.py: its actors stay up between programs and tests; 4 actors serve every
# count) on the two-node loopback cluster.
# null runs nothing (it checks the accounting, as every backend does): fewer cases too; the
# compile path is the same for every backend, so the four draw 875 programs in all.
BACKENDS = ["sync", "threads", "null", "torch", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))]
CASES = {"sync": 300, "threads": 300, "null": 150, "torch": 90, "ray": 25}  # make test: examples() of them


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_programs(backend: str, request: pytest.FixtureRequest) -> None:
    # Ray: one backend for every device count (device d is one actor in all of them)
    shared = request.getfixturevalue("ray_backend") if backend == "ray" else backend
    gc.collect()  # earlier programs' idle worker threads end with them
    threads_before = threading.active_count()

    @settings(max_examples=examples(CASES[backend]), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        outs, feeds = data.draw(graphs("float64"))
        planner = data.draw(st.sampled_from(["specs", "specs", "split_largest", "eindecomp",
                                             "data_parallel", "megatron", "mesh_ilp"]))
        specs = data.draw(specs_for(outs)) if planner == "specs" else None
        devices = data.draw(st.sampled_from([1, 2, 3, 4] if backend == "ray" else [1, 2, 3, 4, 8]))
        order = data.draw(st.sampled_from(ORDERS))
        placement = data.draw(st.sampled_from(["round_robin", "random", "greedy", "critical_path", "nums"]))
        seed = data.draw(st.integers(0, 1000))
        try:
            prog = ej.compile(outs, devices=devices, backend=shared, specs=specs,
                              placement=placement, order=order, seed=seed,
                              planner="split_largest" if planner == "specs" else planner)
        except NotApplicable:  # a baseline that does not fit this graph says so; nothing to run
            return
        got = prog.run(**feeds)
        rs = prog.run_stats
        assert rs is not None
        assert rs.bytes_moved == prog.stats.bytes_moved
        assert rs.bytes_loaded == prog.stats.bytes_loaded == sum(v.nbytes for v in feeds.values())
        assert rs.bytes_fetched == prog.stats.bytes_fetched
        assert rs.tasks_run == len(prog.taskgraph)
        # the optimizer's exact cost formula agrees with the synthesised exchange programs
        assert plan_bytes(prog.graph, prog.decomps, prog.placement) == prog.stats.bytes_moved
        if backend == "null":
            assert got is None
            return
        want = ej.reference(outs, **feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)

    check()
    if backend != "ray":  # Ray's client keeps its own threads
        gc.collect()  # each program's idle worker threads (einjoin.runtime.workers) end with it
        assert threading.active_count() == threads_before, threading.enumerate()  # no worker left running


# half precision on the torch backend: float16 / bfloat16 graphs against the float32 oracle (the
# same half inputs, widened; every op in float64, nothing rounded in between), within four times
# the half type's epsilon of the size of what was computed (measured over 150 random graphs each:
# at most 0.4 epsilon for float16, 0.9 for bfloat16). Graphs this small cannot tell float32
# accumulation from half accumulation: tests/test_torch_backend.py checks that on long sums.
HALF_TOL = {"float16": 4 * 2.0 ** -11, "bfloat16": 4 * 2.0 ** -8}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_random_programs_in_half_precision_on_torch(dtype: str) -> None:
    from graphgen import oracle

    @settings(max_examples=examples(60), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data: st.DataObject) -> None:
        outs, feeds = data.draw(graphs(dtype))
        specs = data.draw(specs_for(outs))
        devices = data.draw(st.sampled_from([1, 2, 3]))
        prog = ej.compile(outs, devices=devices, backend="torch", specs=specs, planner="split_largest",
                          seed=data.draw(st.integers(0, 1000)))
        got = prog.run(**feeds)
        wide = {k: v.astype(np.float32) if v.dtype.kind in "fV" else v for k, v in feeds.items()}
        want = oracle(outs, wide)
        tol = HALF_TOL[dtype]
        for g, w, o in zip(got, want, outs):
            assert g.shape == w.shape and g.dtype == np.dtype(ej.ir.dtypes.numpy_dtype(o.dtype))
            # the float32 oracle rounded once to the output's type, as torch's result is: a value
            # beyond the half range is inf there (exp(12) in float16), not a mismatch
            with np.errstate(over="ignore"):
                w = np.asarray(w, np.float32).astype(g.dtype).astype(np.float64)
            scale = max(1.0, float(np.abs(w[np.isfinite(w)]).max(initial=0.0)))
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=tol, atol=tol * scale)

    check()
