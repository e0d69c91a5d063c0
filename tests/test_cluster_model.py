"""The cluster's time model: presets as data, the roofline and transfer times as pure functions,
and the existing byte-only clusters unchanged."""

from __future__ import annotations

import pickle

import pytest

import einjoin as ej
from einjoin.cluster.model import DeviceModel, Fabric, Hardware, efficiency, kernel_time, transfer_time
from einjoin.cluster.presets import GPUS
from einjoin.errors import EinjoinError


def test_presets_carry_the_issue_figures():
    a100 = ej.Cluster.preset("dgx-a100")
    m = a100.hardware.models[0]
    assert a100.size == 8 and {d.kind for d in a100.devices} == {"a100"}
    assert (m.rate("bfloat16"), m.rate("float32"), m.mem_bw) == (312e12, 19.5e12, 2.0e12)
    assert a100.hardware.intra.bandwidth == 300e9 and a100.devices[3].memory == 80 * 2**30
    h100 = ej.Cluster.preset("dgx-h100").hardware
    assert (h100.models[0].rate("bfloat16"), h100.models[0].mem_bw, h100.intra.bandwidth) == (989e12, 3.35e12, 450e9)
    h200 = ej.Cluster.preset("h200")
    assert h200.size == 1 and h200.devices[0].memory == 141 * 10**9
    assert (h200.hardware.models[0].rate("bfloat16"), h200.hardware.models[0].mem_bw) == (989e12, 4.8e12)
    assert ej.Cluster.preset("dgx-h100", devices=2).size == 2


def test_nodes_route_through_nics_between_machines():
    c = ej.Cluster.nodes(2, per_node="dgx-a100", network_gbps=200)
    hw = c.hardware
    assert c.size == 16 and hw.groups[7] == 0 and hw.groups[8] == 1
    assert hw.route(0, 1) == (("intra", 0, 0), ("intra", 1, 1))
    assert hw.route(0, 9) == (("inter", 0, 0), ("inter", 1, 9))
    # 200 Gbit/s = 25 GB/s per NIC; the cluster's matrices agree with the model
    assert hw.transfer_time(0, 9, 25e9) == pytest.approx(1.0 + 5e-6)
    assert c.bandwidth[0][9] == 25e9 and c.bandwidth[0][1] == 300e9
    assert c.transfer_time(0, 9, 10**6) == pytest.approx(hw.transfer_time(0, 9, 10**6))


def test_bad_presets_and_models_are_refused():
    with pytest.raises(EinjoinError, match="unknown cluster preset 'tpu'"):
        ej.Cluster.preset("tpu")
    with pytest.raises(EinjoinError, match="network_gbps"):
        ej.Cluster.nodes(2, network_gbps=0)
    with pytest.raises(EinjoinError, match="mem_bw"):
        DeviceModel("x", peak=(("float32", 1e9),), mem_bw=-1, copy_bw=1, vector_rate=1, launch=0)
    with pytest.raises(EinjoinError, match="hardware"):
        ej.Cluster(ej.local(2).devices, ej.local(2).bandwidth, ej.local(2).latency, hardware="fast")


def test_local_clusters_are_as_before():
    # the byte-based planning reads these: a local cluster has no time model, compares and
    # hashes as before, and a preset survives with_memory and pickling
    assert ej.local(3).hardware is None
    assert ej.local(3) == ej.Cluster.uniform(3) and hash(ej.local(3)) == hash(ej.Cluster.uniform(3))
    c = ej.Cluster.preset("dgx-h100")
    assert c != ej.Cluster.uniform(8)
    capped = c.with_memory("1GiB")
    assert capped.hardware == c.hardware and capped.devices[0].memory == 2**30
    assert pickle.loads(pickle.dumps(c)) == c and hash(pickle.loads(pickle.dumps(c))) == hash(c)


def test_roofline_takes_the_slower_of_compute_and_memory():
    m = DeviceModel("x", peak=(("float32", 1e12), ("bfloat16", 4e12)), mem_bw=1e11, copy_bw=1e11,
                    vector_rate=1e10, launch=2e-6, e_max=0.5, half_work=1e9)
    # compute-bound contraction: W / (peak * e_max * W / (W + half)) = (W + half) / (peak * e_max); the
    # curve's start is a time (half_work at the top rate, bf16's), so float32 at 1/4 of the rate has
    # 1/4 of the flops in it: half 2.5e8
    w = 1e10
    assert kernel_time(m, w, 1e6, "float32") == pytest.approx((w + 2.5e8) / (1e12 * 0.5) + 2e-6)
    assert kernel_time(m, w, 1e6, "bfloat16") == pytest.approx((w + 1e9) / (4e12 * 0.5) + 2e-6)
    assert kernel_time(m, w, 1e6, "float16") == pytest.approx(kernel_time(m, w, 1e6, "float32"))  # float32's rate
    # memory-bound elementwise: bytes at mem_bw beat its flops at the vector rate
    assert kernel_time(m, 1e6, 1e9, "float32") == pytest.approx(1e9 / 1e11 + 2e-6)
    # elementwise with many flops per element (exp): the vector rate
    assert kernel_time(m, 5e8, 1e9, "float32", launch=False) == pytest.approx(5e8 / 1e10)
    # more threads of a CPU: a proportionally faster contraction
    assert kernel_time(m, w, 1e6, "float32", threads=2, launch=False) == pytest.approx((w + 2.5e8) / (2e12 * 0.5))
    assert efficiency(m, 1e9) == pytest.approx(0.25) and efficiency(m, 0) == 0.0
    assert efficiency(m, 1e9, "bfloat16") == efficiency(m, 2.5e8, "float32") == pytest.approx(0.25)


def test_transfer_time_is_latency_plus_bytes_at_the_slowest_link():
    assert transfer_time(1e-6, 1e9, (1e10, 2e9)) == pytest.approx(1e-6 + 0.5)
    assert transfer_time(1e-6, 1e9, ()) == 1e-6
    hw = Hardware("t", (DeviceModel("a100", **GPUS["a100"]),) * 2, (0, 1), Fabric(1e11, 1e-6), Fabric(1e9, 1e-5))
    assert hw.transfer_time(0, 1, 1e9) == pytest.approx(1.0 + 1e-5) and hw.transfer_time(1, 1, 1e9) == 0.0


def test_a_kind_of_its_own_runs_at_its_own_rate():
    from einjoin.cluster.model import work_time
    m = DeviceModel("cpu", peak=(("float32", 1e10),), mem_bw=1e12, copy_bw=1e12, vector_rate=1e9, launch=0.0,
                    kind_rates=(("attention", 1e8),))
    assert work_time(m, 1e9, 1e3, "float32", kind="attention") == pytest.approx(10.0)
    assert work_time(m, 1e9, 1e3, "float32", threads=2, kind="attention") == pytest.approx(5.0)
    assert work_time(m, 1e9, 1e3, "float32", kind="einsum") == pytest.approx(0.1)
    with pytest.raises(EinjoinError, match="kind_rates"):
        DeviceModel("x", peak=(("float32", 1.0),), mem_bw=1, copy_bw=1, vector_rate=1, launch=0,
                    kind_rates=(("attention", 0.0),))


def test_a_kind_of_its_own_has_a_fixed_start():
    from einjoin.cluster.model import work_time
    m = DeviceModel("cpu", peak=(("float32", 1e10),), mem_bw=1e12, copy_bw=1e12, vector_rate=1e9, launch=0.0,
                    kind_rates=(("attention", 1e8),), kind_half=(("attention", 5e7),))
    assert work_time(m, 1e8, 1e3, "float32", kind="attention") == pytest.approx(1.5)
    assert work_time(m, 1e8, 1e3, "float32", threads=2, kind="attention") == pytest.approx(0.75)
    with pytest.raises(EinjoinError, match="kind_half"):
        DeviceModel("x", peak=(("float32", 1.0),), mem_bw=1, copy_bw=1, vector_rate=1, launch=0,
                    kind_half=(("attention", -1.0),))


def test_step_by_step_elementwise_time_sums_each_function_at_its_rate():
    from einjoin.cluster.model import steps_time
    m = DeviceModel("cpu", peak=(("float32", 1e10),), mem_bw=2e9, copy_bw=1e9, vector_rate=1e9, launch=0.0,
                    fn_rates={"exp": 1e8, "add": 1e9, "tanh": 5e7})
    # 1e8 exps (1 s), 1e8 tanh (2 s), 1e9 subs at add's rate (1 s), 2e9 bytes of a reduction's pass (1 s)
    assert steps_time(m, [("exp", 1e8), ("tanh", 1e8), ("sub", 1e9)], 2e9) == pytest.approx(5.0)
    assert steps_time(m, [("exp", 1e8)], 0.0, itemsize=8) == pytest.approx(2.0)   # float64: twice the bytes
    assert steps_time(m, [], 2e9) == pytest.approx(1.0)
    called = DeviceModel("cpu", peak=(("float32", 1e10),), mem_bw=2e9, copy_bw=1e9, vector_rate=1e9, launch=0.0,
                         fn_rates={"exp": 1e8}, fn_call=0.5)
    assert steps_time(called, [("exp", 1e8), ("exp", 1e8)], 0.0) == pytest.approx(2.0 + 2 * 0.5)  # + a call each
    gpu = DeviceModel("gpu", peak=(("float32", 1e10),), mem_bw=2e9, copy_bw=1e9, vector_rate=1e9, launch=0.0)
    assert steps_time(gpu, [("exp", 1e8)], 0.0) is None   # no function rates: one fused pass (the roofline)
    with pytest.raises(EinjoinError, match="fn_rates"):
        DeviceModel("x", peak=(("float32", 1.0),), mem_bw=1, copy_bw=1, vector_rate=1, launch=0,
                    fn_rates={"exp": 0})
