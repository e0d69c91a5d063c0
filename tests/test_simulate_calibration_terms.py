"""The terms of this machine's time model that depend on how the threads backend shares the cores
(einjoin.runtime.simulate_hardware, einjoin.cluster.calibration): which kernels run on torch's
threads, the threads a kernel of the other pool gets, a threaded GEMM's own half-work and the
attention kernel's own speed-up. Fixed calibrations: nothing is measured here."""

from __future__ import annotations

import pytest

import einjoin as ej
from einjoin.cluster.calibration import Calibration
from einjoin.runtime.backends.ray_worker import PRELOAD_FACTS
from einjoin.runtime.simulate import simulate
from einjoin.runtime.simulate_hardware import TORCH_KINDS, kernel_pools


def _cal(**kw: float) -> Calibration:
    base = dict(cores=2, matmul_rate=50e9, half_work=1e6, parallel=0.8, mem_bw=10e9, vector_rate=1e9,
                copy_bw=10e9, launch=0.0, launch_threads=0.0, attention_rate=20e9, attention_half=0.0)
    base.update(kw)
    return Calibration(machine="test", **base)  # type: ignore[arg-type]


def test_torch_kinds_are_the_preload_tables() -> None:
    on_torch = {k for k, modules in PRELOAD_FACTS.items() if "torch" in modules}
    assert on_torch == set(TORCH_KINDS)


def test_the_other_pool_gets_one_thread() -> None:
    x = ej.input("x", (1, 2, 64, 16))
    blas_main = ej.compile(ej.attention(x, x, x) @ ej.input("w", (16, 2048)), devices=1, quiet=True)
    torch_main = ej.compile(ej.attention(x, x, x) + 1.0, devices=1, quiet=True)
    hw = _cal().hardware(1)
    assert {k.__name__ for k in kernel_pools(blas_main.taskgraph, hw) or {}} == {"Attention"}
    assert "Attention" not in {k.__name__ for k in kernel_pools(torch_main.taskgraph, hw) or {}}
    assert kernel_pools(blas_main.taskgraph, _cal().hardware(2)) is None  # one thread each anyway
    plain = ej.compile(ej.input("a", (64, 64)) @ ej.input("b", (64, 64)), devices=1, quiet=True)
    assert kernel_pools(plain.taskgraph, hw) is None  # no torch kernel: BLAS has the share
    # the attention of the BLAS-main program runs on one thread: as long as on one device of two
    att = [t for t in blas_main.taskgraph.tasks if type(t.node.op).__name__ == "Attention"]
    sim = simulate(blas_main.taskgraph, hw)
    took = {tid: e - s for iv in sim.intervals.values() for s, e, tid in iv}
    one = att[0].flops / 20e9
    assert took[att[0].id] == pytest.approx(one, rel=1e-6)


def test_threaded_gemm_half_work_and_attention_speed_up() -> None:
    # -1: not measured, the single-thread figures as before
    assert _cal().hardware(1).models[0].half_work == 1e6
    assert _cal(parallel_half=9e6).hardware(1).models[0].half_work == 9e6  # every core: the measured one
    assert _cal(parallel_half=9e6).hardware(2).models[0].half_work == 1e6  # one thread each
    assert _cal(parallel_half=9e6, cores=5).hardware(2).models[0].half_work == pytest.approx(1e6 + 8e6 / 4)
    rates = dict(_cal(attention_parallel=0.1).hardware(1).models[0].kind_rates)
    assert rates["attention"] * 2 == pytest.approx(20e9 * 1.1)  # per thread, two threads: 1.1x one
    assert dict(_cal().hardware(1).models[0].kind_rates)["attention"] * 2 == pytest.approx(20e9 * 1.8)


def test_float64_steps_take_their_own_rates() -> None:
    """A fill's expression runs over float64 index grids: its functions at their float64 rates
    (measured: numpy's float64 cos ~16x slower than float32's), else twice the float32 time."""
    from einjoin.cluster.model import steps_time
    m32 = _cal(fn_rates={"cos": 1.6e9, "add": 6e9}, fn_call=0.0).hardware(1).models[0]
    m64 = _cal(fn_rates={"cos": 1.6e9, "add": 6e9}, fn_rates64={"cos": 0.1e9}, fn_call=0.0).hardware(1).models[0]
    n = 1e6
    assert steps_time(m32, [("cos", n)], 0.0, 8) == pytest.approx(2 * n / 1.6e9)
    assert steps_time(m64, [("cos", n)], 0.0, 8) == pytest.approx(n / 0.1e9)
    assert steps_time(m64, [("cos", n)], 0.0, 4) == pytest.approx(n / 1.6e9)  # float32 as before
    assert steps_time(m64, [("add", n)], 0.0, 8) == pytest.approx(2 * n / 6e9)  # not measured in float64


def test_concurrent_kernels_share_the_cores_as_threads_do() -> None:
    """Two devices' GEMMs at once on 2 cores run at (1 + parallel) / 2 of one alone (a second
    busy core adds ``parallel`` of one: measured as the every-core GEMM's speed-up); one device's
    2-thread GEMM alone runs at its own threaded rate, not slowed twice."""
    a, b = ej.input("a", (512, 512)), ej.input("b", (512, 512))
    two = ej.compile(a @ b, devices=2, specs={(a @ b): {"m": 2, "n": 1, "k": 1}}, quiet=True)
    one = ej.compile(a @ b, devices=1, quiet=True)
    cal = _cal(parallel=0.6, half_work=0.0)
    sim2 = simulate(two.taskgraph, cal.hardware(2))
    sim1 = simulate(one.taskgraph, cal.hardware(1))
    flops = 2 * 512**3

    def kernel_secs(sim: object, prog: object) -> list[float]:
        kinds = {t.id: t.kind.value for t in prog.taskgraph.tasks}  # type: ignore[attr-defined]
        return [e - s for iv in sim.intervals.values() for s, e, tid in iv if kinds[tid] == "kernel"]  # type: ignore[attr-defined]
    assert kernel_secs(sim2, two) == pytest.approx([flops / 2 / 50e9 / 0.8] * 2, rel=1e-6)
    assert kernel_secs(sim1, one) == pytest.approx([flops / (50e9 * 1.6)], rel=1e-6)


def test_device_threads_cost_at_least_an_inline_task(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """A noisy line that reads a task on device threads cheaper than one inline is floored there."""
    from einjoin.runtime import simulate_calibrate as sc
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sc, "_gemm", lambda reps, quick: (10e9, 0.0, 0.5, 0.0))
    monkeypatch.setattr(sc, "_memory", lambda reps, quick: (5e9, 1e9, 4e9))
    monkeypatch.setattr(sc, "_dispatch", lambda reps, quick: ((3e-6, 1e-4, 3e-7, 3e-6), (1e-7, 3e-4, 4e-7, 2e-6)))
    monkeypatch.setattr(sc, "_dispatch_many", lambda reps, quick: (2e-7, 5e-4, 6e-7, 4e-6))
    monkeypatch.setattr(sc, "_attention", lambda reps, quick: (2e9, 1e6, 0.1))
    monkeypatch.setattr(sc, "_functions", lambda reps, quick, dtype=None: {"add": 1e9})
    monkeypatch.setattr(sc, "_step_call", lambda reps: 5e-6)
    cal = sc.calibrate(force=True)
    assert (cal.launch, cal.launch_threads, cal.launch_threads4) == (3e-6, 3e-6, 3e-6)
    assert (cal.overhead_threads, cal.overhead_threads4) == (3e-4, 5e-4)


def test_dispatch_on_device_threads_by_their_number() -> None:
    """A task and a run on n device threads cost what was measured on two and four (in proportion
    for three, four's beyond); a calibration from before the four-thread figures uses two's."""
    cal = _cal(launch=3e-6, launch_threads=8e-6, launch_threads4=12e-6, overhead=1e-4, overhead_threads=4e-4,
               overhead_threads4=8e-4)
    got = [(cal.hardware(n).models[0].launch, cal.hardware(n).overhead) for n in (1, 2, 3, 4, 8)]
    want = [(3e-6, 1e-4), (8e-6, 4e-4), (10e-6, 6e-4), (12e-6, 8e-4), (12e-6, 8e-4)]
    assert got == [pytest.approx(w, rel=1e-9) for w in want]
    old = _cal(launch=3e-6, launch_threads=8e-6, overhead_threads=4e-4)
    assert (old.hardware(4).models[0].launch, old.hardware(4).overhead) == (8e-6, 4e-4)


def test_each_elementwise_step_hands_the_gil_over_on_device_threads() -> None:
    """On device threads each numpy call of an elementwise kernel lets the GIL go and takes it
    back, as the measured kernel's one BLAS call does: its step costs the hand-over that a kernel
    and its free cost there beyond two inline tasks, on one device nothing more."""
    x = ej.input("x", (64, 256))
    out = ej.exp(x)
    prog = ej.compile(out, devices=2, specs={out: {"a": 1, "b": 1}}, quiet=True)
    kernel, = [t for t in prog.taskgraph.tasks if t.kind.value == "kernel"]

    def took(cal: Calibration) -> float:
        hw = cal.hardware(2)
        sim = simulate(prog.taskgraph, hw)
        secs = {tid: e - s for iv in sim.intervals.values() for s, e, tid in iv}
        return secs[kernel.id] - hw.models[0].launch
    fn = {"exp": 1e9, "add": 4e9}
    quiet = _cal(launch=3e-6, launch_threads=3e-6, fn_rates=fn, fn_call=2e-6)
    busy = _cal(launch=3e-6, launch_threads=8e-6, fn_rates=fn, fn_call=2e-6)
    assert took(busy) - took(quiet) == pytest.approx(2 * (8e-6 - 3e-6), rel=1e-6)  # one step: exp
    assert busy.hardware(2).models[0].fn_call == pytest.approx(2e-6 + 2 * (8e-6 - 3e-6))
    assert busy.hardware(1).models[0].fn_call == quiet.hardware(1).models[0].fn_call == 2e-6


def test_the_simulator_reads_the_calibration_the_runtime_measures(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: object) -> None:
    """hardware_for reads this machine's calibration through einjoin.cluster.calibration (cached,
    else measured by what einjoin.runtime.simulate_calibrate registers): the measuring runs the
    threads backend itself, whose registry holds the simulator."""
    from einjoin.cluster import calibration
    from einjoin.runtime import simulate_calibrate as sc
    from einjoin.runtime.simulate_hardware import hardware_for
    assert calibration.MEASURE["calibrate"] is sc.local_calibration
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured: list[Calibration] = []

    def measure() -> Calibration:
        measured.append(_cal(launch=7e-6))
        calibration.save_cached(measured[-1])
        return measured[-1]
    monkeypatch.setitem(calibration.MEASURE, "calibrate", measure)
    assert hardware_for(ej.local(1)).models[0].launch == 7e-6 and len(measured) == 1
    assert hardware_for(ej.local(1)).models[0].launch == 7e-6 and len(measured) == 1  # cached now


def _intervals(prog: ej.Program, hw: object) -> dict[str, list[float]]:
    sim = simulate(prog.taskgraph, hw)  # type: ignore[arg-type]
    kinds = {t.id: t.kind.value for t in prog.taskgraph.tasks}
    out: dict[str, list[float]] = {}
    for iv in sim.intervals.values():
        for s, e, tid in iv:
            out.setdefault(kinds[tid], []).append(e - s)
    return out


def test_frees_and_views_cost_their_own_figures_and_kernels_a_kernels_dispatch() -> None:
    """The threads backend runs a free inline as its writer completes and loads a feed's block as a
    view (einjoin.plan.execute._load; a block of columns too) and hands a block over between
    devices: such tasks cost their calibrated figures, not a kernel's dispatch (a 2-device
    elementwise plan simulated 2.97 ms of frees that took 0.23). A calibration without them (an
    older one) charges every task a launch."""
    x, w = ej.input("x", (64, 64)), ej.input("w", (64, 64))
    out = ej.relu(x @ w)
    prog = ej.compile(out, devices=2, quiet=True)
    kinds = {t.kind.value for t in prog.taskgraph.tasks}
    assert {"free", "load", "kernel"} <= kinds
    new = _cal(launch=5e-6, launch_threads=1.2e-5, free_cost=3e-7, view_cost=3e-6, free_threads=4e-7,
               view_threads=2e-6)
    got = _intervals(prog, new.hardware(2))
    # a light task holds the GIL, so it takes its figure times the tasks sharing it (this plan: 2
    # at most; a full-suite run once saw more, the plan's overlaps are not pinned here): at most 4x
    # its own figure and far below a kernel's launch (1.2e-5), which is what an older calibration
    # charged it
    assert all(4e-7 - 1e-12 <= s <= 4 * 4e-7 for s in got["free"])
    assert all(2e-6 - 1e-12 <= s <= 4 * 2e-6 for s in got["load"] + got.get("move", []))
    assert min(got["kernel"]) >= 1.2e-5
    old = _intervals(prog, _cal(launch=5e-6, launch_threads=1.2e-5).hardware(2))
    assert min(old["free"] + old["load"]) >= 1.2e-5
    assert new.hardware(1).models[0].free_cost == 3e-7 and new.hardware(1).models[0].view_cost == 3e-6


def test_a_block_of_columns_of_a_feed_loads_as_a_view() -> None:
    """Any block of a C-ordered feed is a view on this machine (einjoin.plan.execute._load): the
    simulator charges a strided block of columns a view, not a copy of its bytes."""
    import numpy as np

    from einjoin.exchange import TaskKind
    a, b = ej.input("a", (256, 512)), ej.input("b", (512, 1024))
    out = a @ b
    prog = ej.compile(out, devices=2, specs={out: {"m": 1, "k": 1, "n": 2}}, quiet=True)  # b's columns cut
    loads = [t for t in prog.taskgraph.tasks if t.kind is TaskKind.LOAD and t.node is b.node]
    assert loads and all(t.payload.box[1] != (0, 1024) for t in loads)
    feed = np.zeros((512, 1024), np.float32)
    for t in loads:  # the runtime's load of it: a view of the feed
        from einjoin.plan.execute import _load
        block = _load(t, lambda v: None, {t.node: feed}, prog.decomps, (512, 512))
        assert np.shares_memory(block, feed) and not block.flags.c_contiguous
    cal = _cal(launch=5e-6, launch_threads=1.2e-5, free_cost=3e-7, view_cost=3e-6, free_threads=4e-7,
               view_threads=2e-6, copy_bw=1e9)  # a copy of a 1 MiB block would take 1 ms
    got = _intervals(prog, cal.hardware(2))
    assert max(got["load"]) <= 2 * 2e-6 + 1e-12


def test_an_elementwise_step_streams_its_arrays_at_the_memory_bandwidth_at_best() -> None:
    """numpy's ufuncs read their array arguments and write their result: however fast a function
    runs on cached data (its measured rate), a step over blocks out of the caches takes their
    bytes at mem_bw. x0 * x1 moves three arrays, x0 * 0.5 two (a constant is no array), a column
    broadcast over the rows its share."""
    from einjoin.cluster.model import DeviceModel, Fabric, Hardware
    from einjoin.exchange import TaskKind
    m = DeviceModel("cpu", peak=(("float32", 1e9),), mem_bw=1e9, copy_bw=1e12, vector_rate=1e9, launch=0.0,
                    fn_rates=(("mul", 1e15), ("add", 1e15), ("exp", 1e6)))
    hw = Hardware("toy", (m,), (0,), Fabric(1e9, 0.0), Fabric(1e9, 0.0), cores=1, shared_memory=True,
                  copy_engines=False)
    x, y, c = ej.input("x", (64, 128)), ej.input("y", (64, 128)), ej.input("c", (64, 1))
    outs = [x * y, x * 0.5, x * c, ej.exp(x)]
    prog = ej.compile(outs, devices=1, backend="null", quiet=True, fuse=False)
    sim = simulate(prog.taskgraph, hw)
    took = {prog.taskgraph.tasks[t].node: e - s for s, e, t in sim.intervals[0]
            if prog.taskgraph.tasks[t].kind is TaskKind.KERNEL}
    n = 64 * 128
    mul, half, col, ex = (took[o.node] for o in outs)
    assert mul == pytest.approx(3 * n * 4 / 1e9)
    assert half == pytest.approx(2 * n * 4 / 1e9)
    assert col == pytest.approx((2 * n + 64) * 4 / 1e9)
    assert ex == pytest.approx(n / 1e6)  # slower than its bytes: its own rate


def test_a_launch_takes_a_core_as_well_as_the_gil() -> None:
    """A task's launch is the runtime's Python: it holds the GIL and runs on a core. On one core
    (capacity 1) no phase overlaps another, so four devices' tasks take at least the sum of their
    phases (a launch beside another device's kernel used to take no core: four devices on two
    cores were simulated faster than their CPU allows)."""
    from einjoin.runtime.simulate import COSTS, _Ctx
    from tests.test_simulate_golden import _graph
    tg = _graph(4, 6, 1)  # layered kernels and moves of mixed sizes over 4 devices
    hw = _cal(cores=1, launch=1e-4, launch_threads=1e-4, overhead=0.0, overhead_threads=0.0).hardware(4)
    assert hw.core_capacity == 1
    ctx = _Ctx(hw, tg)
    alone = sum(secs for t in tg.tasks for secs, _ in COSTS[t.kind](ctx, t))
    assert simulate(tg, hw).makespan >= alone * (1 - 1e-12)  # 7.081 s before, 7.094 the phases' sum
