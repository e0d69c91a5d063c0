"""The event simulator (einjoin.runtime.simulate): makespans of small hand-built task graphs equal
hand-computed values; the runtime's own ready-queue order; memory caps; the simulate backend and
its trace; the calibration cache. No test reads the real clock: the calibration used is a fixed
one, written to a temporary cache (XDG_CACHE_HOME)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from graphgen import graphs, specs_for
from einjoin.cluster.calibration import Calibration, cache_path, load_cached, machine_key, save_cached
from einjoin.cluster.model import DeviceModel, Fabric, Hardware
from einjoin.errors import EinjoinError
from einjoin.exchange import Kernel, Move, TaskGraphBuilder, TaskKind
from einjoin.ir.ops import input_node
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime import simulate_calibrate
from einjoin.runtime.engine import ORDERS, Engine
from einjoin.runtime.simulate import simulate

FIXED = Calibration(cores=2, matmul_rate=20e9, half_work=1e6, parallel=0.8, mem_bw=8e9, vector_rate=5e8,
                    copy_bw=6e9, launch=20e-6, launch_threads=35e-6, machine=machine_key(), overhead=1e-4,
                    overhead_threads=5e-4)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test here reads and writes a cache of its own, holding the fixed calibration."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_cached(FIXED)
    return tmp_path


# ---- hand-built graphs on a simple model: peak 1 GFLOP/s, no efficiency loss

def _model(launch: float = 0.0) -> DeviceModel:
    return DeviceModel("toy", peak=(("float32", 1e9),), mem_bw=1e12, copy_bw=1e12, vector_rate=1e9,
                       launch=launch, e_max=1.0, half_work=0.0)


def _hw(n: int, launch: float = 0.0, bw: float = 1e9, latency: float = 0.0, cores: int | None = None,
        shared: bool = False) -> Hardware:
    return Hardware("toy", (_model(launch),) * n, (0,) * n, Fabric(bw, latency), Fabric(bw, latency),
                    cores=cores, shared_memory=shared, copy_engines=not shared)


class _Graph:
    """Tasks added by hand: kernels of ``flops`` on a device, moves of ``nbytes``."""

    def __init__(self, n: int):
        self.n, self.b = n, TaskGraphBuilder()
        self.node = input_node("toy", (1,))

    def kernel(self, device: int, flops: float, reads: tuple[int, ...] = ()) -> int:
        return self.b.produce(TaskKind.KERNEL, device, reads, (1,), "float32", self.node, Kernel(0), int(flops))

    def move(self, src_value: int, dst: int, nbytes: int) -> int:
        v = self.b.value(dst, (nbytes // 4,), "float32", self.node)
        self.b.add(TaskKind.MOVE, dst, (src_value,), v, self.node, Move(self.b.values[src_value].device))
        return v

    def graph(self) -> TaskGraph:
        dependents: list[list[int]] = [[] for _ in self.b.tasks]
        for t in self.b.tasks:
            for d in t.deps:
                dependents[d].append(t.id)
        return TaskGraph(tuple(self.b.tasks), tuple(self.b.values), self.n, (), tuple(map(tuple, dependents)))


def test_a_chain_takes_the_sum_of_its_kernels_and_launches():
    g = _Graph(1)
    v = g.kernel(0, 1e9)
    v = g.kernel(0, 2e9, (v,))
    g.kernel(0, 0.5e9, (v,))
    sim = simulate(g.graph(), _hw(1, launch=0.1))
    assert sim.makespan == pytest.approx(1.0 + 2.0 + 0.5 + 3 * 0.1)
    assert sim.device_busy[0] == pytest.approx(sim.makespan)


def test_a_fan_in_waits_for_its_slowest_input_and_the_transfer():
    # a (1 s) on device 0, b (2 s) on device 1; b's 1e9-byte result moves to device 0 (latency
    # 1 ms + 1 s at 1 GB/s), then c (0.5 s) on device 0
    g = _Graph(2)
    a = g.kernel(0, 1e9)
    b = g.kernel(1, 2e9)
    moved = g.move(b, 0, 10**9)
    g.kernel(0, 0.5e9, (a, moved))
    sim = simulate(g.graph(), _hw(2, latency=1e-3))
    assert sim.makespan == pytest.approx(2.0 + 1e-3 + 1.0 + 0.5)
    assert sim.link_bytes == {(1, 0): 10**9}
    assert sim.device_busy[1] == pytest.approx(2.0) and sim.device_busy[0] == pytest.approx(1.0 + 1.001 + 0.5)


def test_two_transfers_through_one_port_share_its_bandwidth():
    # device 0 sends 1e9 bytes to device 1 and to device 2 at once: both leave through device
    # 0's port (1 GB/s), so each takes latency + 2 s; one transfer alone takes latency + 1 s
    g = _Graph(3)
    a = g.kernel(0, 0)
    g.move(a, 1, 10**9)
    g.move(a, 2, 10**9)
    sim = simulate(g.graph(), _hw(3, latency=1e-3))
    assert sim.makespan == pytest.approx(1e-3 + 2.0)
    alone = _Graph(3)
    alone.move(alone.kernel(0, 0), 1, 10**9)
    assert simulate(alone.graph(), _hw(3, latency=1e-3)).makespan == pytest.approx(1e-3 + 1.0)
    # transfers into two devices from two sources share nothing
    two = _Graph(4)
    two.move(two.kernel(0, 0), 2, 10**9)
    two.move(two.kernel(1, 0), 3, 10**9)
    assert simulate(two.graph(), _hw(4, latency=1e-3)).makespan == pytest.approx(1e-3 + 1.0)


def test_devices_beyond_the_cores_share_them():
    # 4 devices on 2 cores, a 1 s kernel each: they run at half speed, 2 s in all; on 4 cores 1 s
    g = _Graph(4)
    for d in range(4):
        g.kernel(d, 1e9)
    assert simulate(g.graph(), _hw(4, cores=2, shared=True)).makespan == pytest.approx(2.0)
    assert simulate(g.graph(), _hw(4, cores=4, shared=True)).makespan == pytest.approx(1.0)


def test_dispatch_on_a_cpu_machine_is_one_at_a_time():
    # the launches hold the GIL: two devices' 1 ms launches of 0-flop kernels take 2 ms in all
    g = _Graph(2)
    g.kernel(0, 0)
    g.kernel(1, 0)
    assert simulate(g.graph(), _hw(2, launch=1e-3, cores=2, shared=True)).makespan == pytest.approx(2e-3)
    assert simulate(g.graph(), _hw(2, launch=1e-3)).makespan == pytest.approx(1e-3)  # a GPU's own launch


# ---- programs

def _prog(devices, memory=None, backend="null", **kw):
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    out = ej.softmax(ej.relu(x @ w) @ ej.input("v", (48, 16)))
    cluster = devices if not isinstance(devices, int) else ej.local(devices, memory)
    return ej.compile(out, devices=cluster, backend=backend, quiet=True, **kw)


@pytest.mark.parametrize("order", ORDERS)
def test_one_device_runs_in_the_engines_own_order(order):
    prog = _prog(1, order=order, seed=3)
    sim = prog.simulate()
    got = [tid for _, _, tid in sorted(sim.intervals[0])]
    want = [t.id for t in Engine(prog.taskgraph, prog.decomps).schedule(order, 3)[0]]
    assert got == want


def test_the_schedule_respects_dependencies_and_lanes():
    prog = _prog(ej.Cluster.preset("dgx-h100", devices=4))
    sim = prog.simulate()
    _check_schedule(prog.taskgraph, sim)


def _check_schedule(tg, sim):
    ends = {tid: (s, e) for iv in sim.intervals.values() for s, e, tid in iv}
    assert sorted(ends) == list(range(len(tg.tasks)))  # every task once
    for t in tg.tasks:
        s, e = ends[t.id]
        assert 0 <= s <= e <= sim.makespan + 1e-12
        for d in t.deps:
            assert ends[d][1] <= s + 1e-12, (t, tg.tasks[d])


def test_simulated_runs_honour_memory_caps():
    cap = 24 * 1024
    prog = _prog(2, memory=cap)
    assert prog.taskgraph.memory is not None
    kinds = {t.kind for t in prog.taskgraph.tasks}
    assert {TaskKind.EVICT, TaskKind.RELOAD} & kinds or TaskKind.WRITEBACK in kinds
    sim = prog.simulate()
    assert 0 < max(sim.peak_memory.values()) <= cap
    # the same cap on a preset's devices: the host link's traffic is simulated
    gpu = _prog(ej.Cluster.preset("dgx-h100", devices=2).with_memory(cap))
    sim = gpu.simulate()
    assert 0 < max(sim.peak_memory.values()) <= cap
    assert any(s == -1 or d == -1 for s, d in sim.link_bytes)


def test_an_uncapped_peak_is_what_the_null_backend_counts():
    prog = _prog(2)
    prog.run(**_feeds(prog))
    sim = prog.simulate()
    assert sim.peak_memory == prog.run_stats.peak_bytes_per_device


def _feeds(prog):
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(n.shape).astype(np.float32) for k, n in prog.graph.input_by_name.items()}


def test_the_simulate_backend_returns_no_data_and_simulated_stats(tmp_path):
    prog = _prog(2, backend="simulate")
    assert prog.run(**_feeds(prog)) is None
    sim = prog.backend.last
    assert prog.run_stats.wall_time == sim.makespan > 0
    assert prog.run_stats.busy_time_per_device == pytest.approx(sim.device_busy)
    assert prog.run_stats.bytes_moved == _prog(2).stats.bytes_moved
    assert prog.simulate().makespan == pytest.approx(sim.makespan)  # the same model


def test_the_trace_is_the_real_runs_format_marked_simulated(tmp_path):
    prog = _prog(2, backend="threads")
    real = tmp_path / "real.json"
    prog.run(**_feeds(prog), trace=real)
    sim = prog.simulate()
    path = sim.trace(tmp_path / "sub" / "sim.json")
    doc, ref = json.loads(path.read_text()), json.loads(real.read_text())
    assert doc["otherData"]["simulated"] is True
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    rx = {e["args"]["task"]: e for e in ref["traceEvents"] if e["ph"] == "X"}
    assert len(xs) == len(prog.taskgraph) == len(rx)
    for e in xs:
        r = rx[e["args"]["task"]]
        assert set(e) == set(r) and (e["name"], e["cat"], e["tid"]) == (r["name"], r["cat"], r["tid"])
        assert e["args"].pop("simulated") is True and set(e["args"]) == set(r["args"]) - {"node"}
    assert "simulated" in next(e for e in doc["traceEvents"] if e["name"] == "process_name")["args"]["name"]
    assert str(sim).startswith("simulated") and "(simulated)" in str(sim)


def test_a_cluster_of_another_size_is_refused():
    with pytest.raises(EinjoinError, match="has 8 devices, the task graph 2"):
        _prog(2).simulate(ej.Cluster.preset("dgx-a100"))
    with pytest.raises(EinjoinError, match="must be an ej.Cluster"):
        _prog(2).simulate("dgx-a100")


# ---- the calibration and its cache

def test_the_cache_round_trips_and_is_per_machine(monkeypatch):
    assert load_cached() == FIXED
    assert cache_path().parent.parent.name == "cache"  # under XDG_CACHE_HOME
    with monkeypatch.context() as m:
        m.setattr("einjoin.cluster.calibration.machine_key", lambda: "another machine")
        assert load_cached() is None
    assert load_cached() == FIXED
    cache_path().write_text("{not json")
    assert load_cached() is None


def test_simulate_without_a_cache_calibrates_first(monkeypatch):
    cache_path().unlink()
    calls = []
    monkeypatch.setattr(simulate_calibrate, "_gemm", lambda reps, quick: calls.append("gemm") or (10e9, 0.0, 0.5, 0.0))
    monkeypatch.setattr(simulate_calibrate, "_memory", lambda reps, quick: (5e9, 1e9, 4e9))
    monkeypatch.setattr(simulate_calibrate, "_dispatch",
                        lambda reps, quick: ((1e-5, 1e-4, 3e-7, 3e-6), (2e-5, 3e-4, 4e-7, 2e-6)))
    monkeypatch.setattr(simulate_calibrate, "_attention", lambda reps, quick: (2e9, 1e6, 0.1))
    monkeypatch.setattr(simulate_calibrate, "_functions", lambda reps, quick, dtype=None: {"exp": 1e8, "add": 1e9})
    monkeypatch.setattr(simulate_calibrate, "_step_call", lambda reps: 5e-6)
    sim = _prog(2).simulate()
    assert calls == ["gemm"] and sim.makespan > 0
    cal = load_cached()
    assert cal is not None and (cal.matmul_rate, cal.launch_threads, cal.overhead_threads) == (10e9, 2e-5, 3e-4)
    assert (cal.attention_rate, cal.attention_half, cal.fn_rates, cal.fn_call) == (2e9, 1e6, {"exp": 1e8, "add": 1e9},
                                                                                  5e-6)
    _prog(2).simulate()  # cached now: not measured again
    assert calls == ["gemm"]


def test_the_calibrated_model_shares_the_cores():
    hw = FIXED.hardware(4)
    assert (hw.cores, hw.threads(), hw.shared_memory) == (2, 1.0, True)
    one = FIXED.hardware(1)
    # one device gets both cores: its per-thread rate times 2 threads is 1.8 cores' worth
    assert one.models[0].rate("float32") * one.threads() == pytest.approx(20e9 * 1.8)
    assert one.models[0].launch == 20e-6 and hw.models[0].launch == 35e-6


# ---- every program kind simulates

@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(st.data())
def test_random_programs_simulate(data: st.DataObject) -> None:
    outs, _ = data.draw(graphs("float32", max_dim=6, max_rank=3))
    specs = data.draw(specs_for(outs)) if data.draw(st.booleans()) else None
    devices = data.draw(st.sampled_from([1, 2, 3]))
    cluster = data.draw(st.sampled_from(["local", "preset", "nodes"]))
    order = data.draw(st.sampled_from(ORDERS))
    cl = {"local": ej.local(devices), "preset": ej.Cluster.preset("dgx-a100", devices=devices),
          "nodes": ej.Cluster.of_hardware(ej.Cluster.nodes(devices, "h200").hardware)}[cluster]
    prog = ej.compile(outs, devices=cl, backend="null", planner="split_largest", specs=specs, quiet=True,
                      order=order)
    sim = prog.simulate()
    _check_schedule(prog.taskgraph, sim)
    assert sim.makespan >= max(sim.device_busy.values()) / 3 - 1e-12  # at most 3 lanes per device


def test_the_simulate_backend_is_a_backend_and_its_runs_trace(tmp_path):
    from einjoin.runtime.backend import Backend
    from einjoin.runtime.backends import get_backend
    assert isinstance(get_backend("simulate"), Backend) and get_backend("simulate").computes is False
    prog = _prog(ej.Cluster.preset("dgx-h100", devices=2), backend="simulate")
    path = tmp_path / "run.json"
    assert prog.run(**_feeds(prog), trace=path) is None
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    sim = prog.backend.last
    want = sorted((e - s) * 1e6 for iv in sim.intervals.values() for s, e, _ in iv)
    # the simulated durations (through the engine's clock: perf_counter + simulated seconds, whose
    # float spacing after hours of uptime is ~1e-11 s: a microsecond task's duration moves ~1e-5 us)
    assert sorted(e["dur"] for e in events) == pytest.approx(want, abs=1e-3)


def test_programs_with_state_and_gradients_simulate():
    # a training step with state (the null-like simulate backend keeps no values) and a gradient
    x, y = ej.input("x", (16, 8)), ej.input("y", (16, 4))
    w = ej.param("w", (8, 4))
    r = x @ w - y
    loss = (r * r).sum()
    gw = ej.einsum("mk,mn->kn", x, r)
    step = ej.compile([loss], 2, state={w - 0.1 * gw: w}, backend="simulate", quiet=True)
    rng = np.random.default_rng(0)
    feeds = dict(x=rng.standard_normal((16, 8)).astype(np.float32), y=rng.standard_normal((16, 4)).astype(np.float32))
    assert step.run(**feeds, w=rng.standard_normal((8, 4)).astype(np.float32)) is None
    assert step.run_stats.wall_time == step.backend.last.makespan > 0
    _check_schedule(step.taskgraph, step.simulate())
    (g,) = ej.grad(loss, [w])
    grad = ej.compile(g, devices=ej.Cluster.preset("dgx-a100", devices=2), backend="null", quiet=True)
    _check_schedule(grad.taskgraph, grad.simulate())


def test_elementwise_kernels_are_timed_step_by_step_at_each_functions_rate():
    # numpy evaluates exp(x * 0.5) + y one function at a time: 8192 mul, exp and add; a row max
    # is one pass over its block's bytes; a matmul stays at the contraction rate
    m = DeviceModel("cpu", peak=(("float32", 1e9),), mem_bw=1e9, copy_bw=1e12, vector_rate=1e9, launch=0.0,
                    fn_rates={"exp": 1e6, "mul": 1e7, "add": 2e7})
    hw = Hardware("toy", (m,), (0,), Fabric(1e9, 0.0), Fabric(1e9, 0.0), cores=1, shared_memory=True,
                  copy_engines=False)
    x, y, w = ej.input("x", (64, 128)), ej.input("y", (64, 128)), ej.input("w", (128, 32))
    e = ej.exp(x * 0.5) + y
    out = [e, ej.einsum("ab->a", e, agg="max"), e @ w]
    prog = ej.compile(out, devices=1, backend="null", quiet=True)
    sim = simulate(prog.taskgraph, hw)
    took = {str(prog.taskgraph.tasks[t].node.op.join): e - s for s, e, t in sim.intervals[0]
            if prog.taskgraph.tasks[t].kind is TaskKind.KERNEL}
    n = 64 * 128
    assert took["exp(x0 * 0.5) + x1"] == pytest.approx(n / 1e6 + n / 1e7 + n / 2e7)
    assert took["x0"] == pytest.approx((4 * n + 4 * 64) / 1e9)          # the max: read the block, write a row
    assert took["x0 * x1"] == pytest.approx(2 * n * 32 / 1e9)            # the matmul: its flops at 1 GFLOP/s


def test_a_fills_expression_is_timed_over_its_broadcast_index_grids():
    # sin(x0 * 0.5) + x1 over a (64, 128) block: the mul covers dim 0's 64 indices, sin them too, the
    # add the whole box; float64 grids (twice float32's time), each call 1 ms, then the cast to float32
    m = DeviceModel("cpu", peak=(("float32", 1e9),), mem_bw=1e9, copy_bw=1e12, vector_rate=1e9, launch=0.0,
                    fn_rates={"sin": 1e6, "mul": 1e7, "add": 2e7}, fn_call=1e-3)
    hw = Hardware("toy", (m,), (0,), Fabric(1e9, 0.0), Fabric(1e9, 0.0), cores=1, shared_memory=True,
                  copy_engines=False)
    tg = ej.compile(ej.fill((64, 128), "sin(x0 * 0.5) + x1") * ej.input("y", (64, 128)), devices=1,
                    backend="null", quiet=True, fuse=False).taskgraph
    sim = simulate(tg, hw)
    [(s, e)] = [(s, e) for s, e, t in sim.intervals[0] if tg.tasks[t].kind is TaskKind.FILL]
    n = 64 * 128
    assert e - s == pytest.approx(2 * (64 / 1e7 + 64 / 1e6 + n / 2e7) + 3 * 1e-3 + n * (8 + 4) / 1e9)


def test_the_function_sweep_measures_every_float_function_as_a_step():
    from einjoin.ir.scalar import FUNCTIONS
    rates = simulate_calibrate._functions(1, quick=True)
    floats = {n for n, f in FUNCTIONS.items() if f.rule in ("float", "select")}
    assert floats <= set(rates) and all(r > 0 and math.isfinite(r) for r in rates.values())
    assert not {n for n, f in FUNCTIONS.items() if f.rule == "logical"} & set(rates)
    assert simulate_calibrate._step_call(1) >= 0.0


def test_a_busy_calibration_does_not_replace_a_quieter_cached_one(monkeypatch):
    # at load 6 on 2 cores the every-core GEMM speed-up read 0.00 and the session's later
    # simulations used it: figures measured under load return, but the quiet cache stays
    cores = os.cpu_count() or 1
    monkeypatch.setattr(simulate_calibrate.os, "getloadavg", lambda: (cores * 4.0, 0.0, 0.0))
    busy = simulate_calibrate.calibrate(quick=True, force=True, reps=1)
    assert busy.load == cores * 4.0 and load_cached() == FIXED
    monkeypatch.setattr(simulate_calibrate.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    quiet = simulate_calibrate.calibrate(quick=True, force=True, reps=1)
    assert load_cached() == quiet != FIXED
