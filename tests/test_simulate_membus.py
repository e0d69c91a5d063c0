"""The host's memory bus in this machine's time model: devices of the threads backend share one
RAM, so their memory-bound kernels divide its bandwidth (``Hardware.mem_bus``, from the
calibration's every-core ``mem_bw_all``) once a program's blocks leave the last-level cache
(``Hardware.cache``). Fixed calibrations, hand-computed times: nothing is measured here."""

from __future__ import annotations

import pytest

import einjoin as ej
from einjoin.cluster.calibration import Calibration
from einjoin.exchange import TaskKind
from einjoin.runtime.simulate import simulate

N = 512 * 1024  # elements of each device's block of exp(x): 2 MiB of float32


def _cal(**kw: float) -> Calibration:
    # no dispatch, no Python per step, every core a full core, exp far faster than its bytes:
    # an exp kernel takes its bytes at mem_bw alone
    base = dict(cores=2, matmul_rate=50e9, half_work=0.0, parallel=1.0, mem_bw=10e9, vector_rate=1e9,
                copy_bw=10e9, launch=0.0, launch_threads=0.0, fn_rates={"exp": 1e15}, fn_call=0.0,
                free_cost=0.0, view_cost=0.0, free_threads=0.0, view_threads=0.0)
    base.update(kw)
    return Calibration(machine="test", **base)  # type: ignore[arg-type]


def _kernel_secs(devices: int, cal: Calibration) -> list[float]:
    x = ej.input("x", (1024, 1024))
    out = ej.exp(x)
    prog = ej.compile(out, devices=devices, specs={out: {"a": devices, "b": 1}} if devices > 1 else None,
                      quiet=True)
    sim = simulate(prog.taskgraph, cal.hardware(devices))
    kinds = {t.id: t.kind for t in prog.taskgraph.tasks}
    return sorted(e - s for iv in sim.intervals.values() for s, e, tid in iv if kinds[tid] is TaskKind.KERNEL)


def test_two_devices_streaming_kernels_divide_the_bus() -> None:
    """Each device's exp reads its block and writes one as large: 2 x 2 MiB at 10 GB/s alone,
    demanding 10 GB/s of a 12 GB/s bus; both at once get 6 GB/s each (0.6 of alone), where the
    cores (two full ones) would let both run at full speed."""
    alone = 2 * N * 4 / 10e9
    assert _kernel_secs(2, _cal(mem_bw_all=12e9)) == pytest.approx([alone / 0.6] * 2, rel=1e-9)
    assert _kernel_secs(2, _cal()) == pytest.approx([alone] * 2, rel=1e-9)  # not measured: no bus


def test_a_program_that_fits_in_the_cache_holds_no_bus() -> None:
    """x and exp(x), 8 MiB in all: in a 32 MiB cache nothing streams; in a 4 MiB one it does."""
    alone = 2 * N * 4 / 10e9
    assert _kernel_secs(2, _cal(mem_bw_all=12e9, cache_bytes=32 << 20)) == pytest.approx([alone] * 2, rel=1e-9)
    assert _kernel_secs(2, _cal(mem_bw_all=12e9, cache_bytes=4 << 20)) == pytest.approx([alone / 0.6] * 2,
                                                                                          rel=1e-9)


def test_one_kernel_alone_is_never_slowed_by_the_bus() -> None:
    """One device's kernel alone takes its own time; a bus measured below one thread's bandwidth
    (a busy machine's reading) is taken as one thread's."""
    alone = 2 * (2 * N) * 4 / 10e9
    assert _kernel_secs(1, _cal(mem_bw_all=12e9)) == pytest.approx([alone], rel=1e-9)
    assert _cal(mem_bw_all=5e9).hardware(2).mem_bus == 10e9
    # the two devices then stream one after the other's share: 0.5 each
    half = 2 * N * 4 / 10e9 / 0.5
    assert _kernel_secs(2, _cal(mem_bw_all=5e9)) == pytest.approx([half] * 2, rel=1e-9)


def test_gpu_presets_share_no_bus() -> None:
    assert ej.Cluster.preset("dgx-a100", devices=2).hardware.mem_bus == 0.0


def test_blocks_of_a_multi_block_output_are_copied_into_it() -> None:
    """The threads backend allocates an output of several blocks once and copies each block into
    its slot as it is written (einjoin.runtime.outputs), except a matmul that computes into its
    slot: an elementwise kernel's block then costs a copy more (its bytes read and written at
    copy_bw), a large matmul's none."""
    from einjoin.runtime.simulate_hardware import output_copies
    x = ej.input("x", (1024, 1024))
    out = ej.exp(x)
    prog = ej.compile(out, devices=2, specs={out: {"a": 2, "b": 1}}, quiet=True)
    cal = _cal(copy_bw=4e9)
    hw = cal.hardware(2)
    kernels = [t for t in prog.taskgraph.tasks if t.kind is TaskKind.KERNEL]
    assert output_copies(prog._engine, hw) == frozenset(t.id for t in kernels)  # noqa: SLF001
    sim = simulate(prog.taskgraph, hw, landed=output_copies(prog._engine, hw))  # noqa: SLF001
    took = sorted(e - s for iv in sim.intervals.values() for s, e, tid in iv if tid in {t.id for t in kernels})
    assert took == pytest.approx([2 * N * 4 / 10e9 + 2 * N * 4 / 4e9] * 2, rel=1e-9)
    a, b = ej.input("a", (512, 512)), ej.input("b", (512, 512))
    mm = ej.compile(a @ b, devices=2, specs={(a @ b): {"m": 2, "n": 1, "k": 1}}, quiet=True)
    assert output_copies(mm._engine, hw) == frozenset()  # noqa: SLF001 - each product into its slot
    one = ej.compile(out, devices=1, quiet=True)
    assert output_copies(one._engine, cal.hardware(1)) == frozenset()  # noqa: SLF001 - one block: returned
    gpu = ej.Cluster.preset("dgx-a100", devices=2).hardware
    assert output_copies(prog._engine, gpu) == frozenset()  # noqa: SLF001
