"""The cluster model: devices and the links between them, as data.

Topology is a bandwidth/latency matrix, so two NVLink islands joined by PCIe, or nodes joined by
a network, are just numbers the cost model and the simulator read.

>>> import einjoin as ej
>>> c = ej.local(4)
>>> c.size, str(c.devices[1]), c.transfer_time(0, 1, 1 << 20) > 0
(4, 'cpu:1', True)
>>> two_islands = ej.Cluster.islands([2, 2], intra=300e9, inter=25e9)
>>> two_islands.bandwidth[0][1] > two_islands.bandwidth[1][2]
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from einjoin.errors import EinjoinError

__all__ = ["Device", "Cluster", "local", "as_cluster", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: "int | str | None") -> int | None:
    """``2147483648``, ``"2GiB"``, ``"512 MB"`` -> bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise EinjoinError(f"memory size must be bytes or a string such as '2GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise EinjoinError(f"memory size must be positive, got {value}")
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        try:
            n = float(num)
        except ValueError:
            n = -1.0
        if unit in _UNITS and n > 0:
            return int(n * _UNITS[unit])
    raise EinjoinError(f"memory size {value!r} is not bytes or a size such as '2GiB'")


@dataclass(frozen=True)
class Device:
    """One device: ``id`` is its index in the cluster; ``memory`` its capacity in bytes (None:
    unbounded)."""

    id: int
    kind: str = "cpu"
    memory: int | None = None
    node: str | None = None      # the machine it lives on (a Ray node id), None: this process

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@dataclass(frozen=True)
class Cluster:
    """Devices plus ``bandwidth[src][dst]`` (bytes/s) and ``latency[src][dst]`` (s)."""

    devices: tuple[Device, ...]
    bandwidth: tuple[tuple[float, ...], ...]
    latency: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n == 0:
            raise EinjoinError("a cluster needs at least one device")
        if [d.id for d in self.devices] != list(range(n)):
            raise EinjoinError(f"device ids must be 0..{n - 1} in order, got {[d.id for d in self.devices]}")
        for name, m in (("bandwidth", self.bandwidth), ("latency", self.latency)):
            if len(m) != n or any(len(row) != n for row in m):
                raise EinjoinError(f"cluster {name} must be a {n}x{n} matrix")
        for i in range(n):
            for j in range(n):
                if i != j and not self.bandwidth[i][j] > 0:
                    raise EinjoinError(f"bandwidth {self.devices[i]} -> {self.devices[j]} must be positive")

    @property
    def size(self) -> int:
        return len(self.devices)

    def transfer_time(self, src: int, dst: int, nbytes: int) -> float:
        if src == dst:
            return 0.0
        return self.latency[src][dst] + nbytes / self.bandwidth[src][dst]

    @staticmethod
    def uniform(n: int, kind: str = "cpu", memory: "int | str | None" = None,
                bandwidth: float = 20e9, latency: float = 5e-6) -> "Cluster":
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise EinjoinError(f"devices must be a positive int, got {n!r}")
        mem = parse_bytes(memory)
        devs = tuple(Device(i, kind, mem) for i in range(n))
        bw = tuple(tuple(float("inf") if i == j else bandwidth for j in range(n)) for i in range(n))
        lat = tuple(tuple(0.0 if i == j else latency for j in range(n)) for i in range(n))
        return Cluster(devs, bw, lat)

    @staticmethod
    def islands(sizes: Sequence[int], intra: float, inter: float, kind: str = "cpu",
                intra_latency: float = 2e-6, inter_latency: float = 2e-5,
                memory: "int | str | None" = None) -> "Cluster":
        """Groups of devices with fast links inside a group and slower ones between groups."""
        group = [g for g, k in enumerate(sizes) for _ in range(k)]
        n = len(group)
        base = Cluster.uniform(n, kind, memory)
        bw = tuple(tuple(float("inf") if i == j else intra if group[i] == group[j] else inter
                         for j in range(n)) for i in range(n))
        lat = tuple(tuple(0.0 if i == j else intra_latency if group[i] == group[j] else inter_latency
                          for j in range(n)) for i in range(n))
        return Cluster(base.devices, bw, lat)

    def with_memory(self, memory: "int | str | None | Mapping[int, int | None]") -> "Cluster":
        """The same cluster with every device's memory set to ``memory`` (or, from a mapping
        device id -> bytes, each its own; devices not named keep theirs)."""
        if isinstance(memory, Mapping):
            unknown = [d for d in memory if d not in range(self.size)]  # ids are 0..n-1
            if unknown:
                raise EinjoinError(f"with_memory names device {unknown[0]!r}; devices are 0..{self.size - 1}")
            mems = {d.id: parse_bytes(memory[d.id]) if d.id in memory else d.memory for d in self.devices}
        else:
            mem = parse_bytes(memory)
            mems = {d.id: mem for d in self.devices}
        return Cluster(tuple(Device(d.id, d.kind, mems[d.id], d.node) for d in self.devices), self.bandwidth,
                       self.latency)

    def __str__(self) -> str:
        kinds = sorted({d.kind for d in self.devices})
        return f"Cluster({self.size} x {'/'.join(kinds)})"


def local(n: int, memory: "int | str | None" = None) -> Cluster:
    """``n`` logical devices in this process: the embedded default."""
    return Cluster.uniform(n, "cpu", memory)


def as_cluster(devices: Any) -> Cluster:
    if isinstance(devices, Cluster):
        return devices
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise EinjoinError(f"devices must be a positive int or an ej.Cluster, got {devices!r}")
    if devices <= 0:
        raise EinjoinError(f"devices must be a positive int, got {devices}")
    return local(devices)
