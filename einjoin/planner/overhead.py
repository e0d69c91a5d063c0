"""When more devices do not pay: a plan's modelled run time from its task count and its work
per device, so that a small model is not cut into blocks whose work is below the per-task
overhead (``ej.compile(..., leave_idle=True)``; the compiler tries the device counts of
:func:`device_ladder` and keeps the fastest by :func:`plan_time`, leaving the rest idle).

The model, with ``o`` = ``Settings.task_overhead`` and ``r`` = ``Settings.flop_rate``:

    time(plan on P devices) = tasks * o + max(max_d flops_d / s, flops / cores) / r,
    s = max(1, cores // P)   (the cores each device's kernels get)

Tasks are dispatched by one process (the threads backend's workers share its interpreter), so
their overhead adds up over all devices; kernels run in parallel on at most ``cores`` cores, and
with fewer devices than cores a device's kernels get its share ``s`` of them (the threads backend
gives its main thread pool that many threads: ``einjoin.runtime.backends.cores_limit``).
Bytes moved are not in it: on one machine a move is a task like any other (its copy is far
below ``o`` for the block sizes where this choice matters). Both constants are measured on the
threads backend (see their docstrings) until the simulator issue calibrates them.

>>> plan_time(tasks=100, flops_per_device={0: 10**6, 1: 10**6}, cores=2)   # 100 * 50us + 1e6 / 5e9
0.0052
>>> plan_time(tasks=100, flops_per_device={0: 2 * 10**6}, cores=2, devices=1)  # one device, both cores
0.0052
>>> device_ladder(6)
[1, 2, 4, 6]
"""

from __future__ import annotations

from collections.abc import Mapping

from einjoin.settings import SETTINGS, Settings

__all__ = ["plan_time", "time_floor", "device_ladder"]


def _share(devices: int, cores: int) -> int:
    return max(1, max(cores, 1) // max(devices, 1))


def plan_time(tasks: int, flops_per_device: Mapping[int, int], cores: int, devices: int | None = None,
              settings: Settings = SETTINGS) -> float:
    """Modelled seconds of one run of a plan on ``devices`` devices (default: those in
    ``flops_per_device``) with ``tasks`` tasks and ``flops_per_device`` (device -> modelled flops)
    on a machine of ``cores`` cores (see the module's docstring)."""
    total = sum(flops_per_device.values())
    busiest = max(flops_per_device.values(), default=0)
    share = _share(len(flops_per_device) if devices is None else devices, cores)
    return tasks * settings.task_overhead + max(busiest / share, total / max(cores, 1)) / settings.flop_rate


def time_floor(flops: int, tasks: int, devices: int, cores: int, settings: Settings = SETTINGS) -> float:
    """A lower bound of :func:`plan_time` for any plan of ``flops`` on ``devices`` devices that
    has at least ``tasks`` tasks: the work spread perfectly over the cores they get."""
    used = min(max(cores, 1), max(1, devices) * _share(devices, cores))
    return tasks * settings.task_overhead + flops / used / settings.flop_rate


def device_ladder(p: int) -> list[int]:
    """The device counts tried for ``p`` devices: the powers of two below ``p``, and ``p``."""
    out, k = [], 1
    while k < p:
        out.append(k)
        k *= 2
    return out + [p]
