"""Clusters we do not have, from their data sheets: the figures of :data:`GPUS` and :data:`SYSTEMS`
(plain data), turned into time models (:class:`~einjoin.cluster.model.Hardware`); ``ej.Cluster.preset``
and ``ej.Cluster.nodes`` make clusters of them.

The efficiency curves of the GPUs come from measured GEMM rates: one H200 here
(``../shared/measured/h200.md``) ran bf16 GEMMs at up to ~740 TFLOP/s (0.75 of its 989 peak),
and a GEMM of W flops took about ``W / 740e12 + 20 µs``: ``e_max = 0.75``, ``half_work = 740e12
· 20e-6 ≈ 1.5e10`` flops. The H100 shares the H200's chip; the A100's curve is scaled to its peak.

>>> hw = preset_hardware("dgx-h100")
>>> hw.size, hw.models[0].rate("bfloat16"), hw.intra.bandwidth
(8, 989000000000000.0, 450000000000.0)
>>> nodes_hardware(2, "dgx-h100", network_gbps=400).inter.bandwidth
50000000000.0
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from einjoin.cluster.model import DeviceModel, Fabric, Hardware
from einjoin.errors import EinjoinError

__all__ = ["GPUS", "SYSTEMS", "PRESETS", "preset_hardware", "nodes_hardware", "size_of"]

GiB = 2**30

# one GPU each: peak dense rates (flop/s), HBM bandwidth, device-to-device copy (read + write
# counted), memory, the fixed cost of a kernel in a stream, the host link (PCIe), the GEMM curve
GPUS: dict[str, dict[str, Any]] = {
    "a100": dict(peak=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12), ("float64", 19.5e12)),
                 mem_bw=2.0e12, copy_bw=1.7e12, vector_rate=19.5e12, launch=5e-6, e_max=0.8,
                 half_work=0.8 * 312e12 * 20e-6, memory=80 * GiB, host_bw=25e9, host_latency=10e-6),
    "h100": dict(peak=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12), ("float64", 67e12)),
                 mem_bw=3.35e12, copy_bw=2.9e12, vector_rate=67e12, launch=5e-6, e_max=0.75,
                 half_work=1.5e10, memory=80 * GiB, host_bw=50e9, host_latency=10e-6),
    "h200": dict(peak=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12), ("float64", 67e12)),
                 mem_bw=4.8e12, copy_bw=4.15e12, vector_rate=67e12, launch=5e-6, e_max=0.75,
                 half_work=1.5e10, memory=141 * 10**9, host_bw=54.7e9, host_latency=10e-6),
}

# systems: which GPU, how many, and the fabric between them (bytes/s per direction per GPU, s)
SYSTEMS: dict[str, dict[str, Any]] = {
    "dgx-a100": dict(gpu="a100", count=8, link_bw=300e9, link_latency=2e-6),   # NVSwitch, NVLink 3
    "dgx-h100": dict(gpu="h100", count=8, link_bw=450e9, link_latency=2e-6),   # NVSwitch, NVLink 4
    "h200": dict(gpu="h200", count=1, link_bw=450e9, link_latency=2e-6),
}

PRESETS = tuple(SYSTEMS)
NETWORK_LATENCY = 5e-6  # one hop through an InfiniBand switch, NIC to NIC


def _system(name: Any) -> dict[str, Any]:
    if not isinstance(name, str) or name not in SYSTEMS:
        raise EinjoinError(f"unknown cluster preset {name!r}; known: {', '.join(PRESETS)}")
    return SYSTEMS[name]


def size_of(name: str) -> int:
    """How many GPUs preset system ``name`` has."""
    return int(_system(name)["count"])


def _hardware(name: str, gpu: str, groups: tuple[int, ...], intra: Fabric, inter: Fabric) -> Hardware:
    model = DeviceModel(gpu, **GPUS[gpu])
    return Hardware(name, (model,) * len(groups), groups, intra, inter, cores=None, shared_memory=False,
                    copy_engines=True)


def preset_hardware(name: str, devices: int | None = None) -> Hardware:
    """The time model of preset system ``name`` (:data:`PRESETS`), or of ``devices`` of its GPUs
    on its fabric (a count checked by the caller). More GPUs than the system has are refused:
    no data sheet describes them on one switch (:func:`nodes_hardware` joins systems)."""
    s = _system(name)
    n = s["count"] if devices is None else devices
    if n > s["count"]:
        raise EinjoinError(f"preset {name!r} has {s['count']} GPU{'s' if s['count'] > 1 else ''}, not {n}; "
                           f"for more, join systems over a network: ej.Cluster.nodes(k, per_node={name!r})")
    fabric = Fabric(s["link_bw"], s["link_latency"])
    return _hardware(name, s["gpu"], (0,) * n, fabric, fabric)


def nodes_hardware(count: int, per_node: str = "dgx-a100", network_gbps: float = 200) -> Hardware:
    """The time model of ``count`` machines of preset ``per_node``, one NIC of ``network_gbps``
    Gbit/s per GPU between them."""
    s = _system(per_node)
    if (isinstance(network_gbps, bool) or not isinstance(network_gbps, numbers.Real)  # numpy numbers too
            or not 0 < float(network_gbps) < math.inf):
        raise EinjoinError(f"network_gbps must be a positive finite number (Gbit/s per NIC), got {network_gbps!r}")
    network_gbps = float(network_gbps)
    groups = tuple(k for k in range(count) for _ in range(s["count"]))
    return _hardware(f"{count}x{per_node}", s["gpu"], groups, Fabric(s["link_bw"], s["link_latency"]),
                     Fabric(network_gbps * 1e9 / 8, NETWORK_LATENCY))
