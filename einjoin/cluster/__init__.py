"""The cluster model: devices and the links between them, as data.

Topology is a bandwidth/latency matrix, so two NVLink islands joined by PCIe, or nodes joined by
a network, are just numbers the cost model and the simulator read. The matrices of the usual
topologies (uniform, islands, one group per machine) are :class:`LinkMatrix` objects: they read
as ``n x n`` matrices but hold O(n) data, so a cluster's memory grows linearly in its devices.
At most :data:`MAX_DEVICES` devices: the planner and the task-graph builder are not made for
more (see the constant's comment for what was measured).

>>> import einjoin as ej
>>> c = ej.local(4)
>>> c.size, str(c.devices[1]), c.transfer_time(0, 1, 1 << 20) > 0
(4, 'cpu:1', True)
>>> two_islands = ej.Cluster.islands([2, 2], intra=300e9, inter=25e9)
>>> two_islands.bandwidth[0][1] > two_islands.bandwidth[1][2]
True
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

from einjoin.cluster.sizes import parse_bytes, short as _short
from einjoin.errors import EinjoinError

__all__ = ["Device", "Cluster", "LinkMatrix", "MAX_DEVICES", "local", "as_cluster", "parse_bytes",
           "check_device_count"]

# The most devices a cluster may have. Planning time grows faster than the device count P (ops get
# up to 4P kernels, each exchange pieces of them; repartition estimates are O(P) each), memory
# linearly. Measured on this project's 2-core VM (shared, so times are upper bounds), a whole
# ej.compile(..., backend="null"): a matmul + relu (512x256 @ 256x128) in ~2 s at 1024 devices,
# ~5 s and 55 MB at 4096 (43 s with placement="critical_path" or "nums", which weigh every device
# for every kernel), ~38 s and 250 MB at 10_000; a 3-op MLP (8192x1024, hidden 4096) in 15 s at
# 1024 and 63 s at 4096; a 43-op LLaMA block in 90 s at 256 and 285 s (730 MB) at 1024. Beyond
# 4096 a graph of a few ops takes minutes, so larger counts are refused up front.
MAX_DEVICES = 4096

def _positive_int(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise EinjoinError(f"{what} must be a positive int (a device count) or an ej.Cluster, got "
                           f"{type(n).__name__} {_short(n)}")
    count = operator.index(n)
    if count <= 0:
        raise EinjoinError(f"{what} must be a positive int, got {count}")
    return count


def check_device_count(n: Any, what: str = "devices") -> int:
    """``n`` as a device count: a positive int (numpy ints too, not bool) of at most
    :data:`MAX_DEVICES`; else an :class:`EinjoinError` naming ``what`` and the value."""
    count = _positive_int(n, what)
    if count > MAX_DEVICES:
        raise EinjoinError(f"{what}={_short(count)} is more than einjoin plans for: at most {MAX_DEVICES} devices "
                           f"(einjoin.cluster.MAX_DEVICES: planning time grows faster than the device "
                           f"count). Plan for fewer, larger devices, e.g. one per node or GPU")
    return count


def _number(value: Any, what: str) -> float:
    """A link value (bandwidth, latency) as a float; NaN, bools, non-numbers and ints beyond
    float64 refused."""
    try:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise EinjoinError(f"cluster {what} must be a number, got {type(value).__name__} {_short(value)}") from None
    if math.isnan(v):
        raise EinjoinError(f"cluster {what} must be a number, got {value!r}")
    return v


class LinkMatrix(Sequence["_LinkRow"]):
    """An ``n x n`` matrix of link values held in O(n) memory: ``m[i][j]`` is ``diag`` for
    ``i == j``, ``intra`` for two devices of the same group, else ``inter``. It reads like a
    tuple of rows (``m[i][j]``, ``len``, iteration) and compares equal to one with the same
    values.

    >>> m = LinkMatrix((0, 0, 1), diag=0.0, intra=1.0, inter=2.0)
    >>> [list(row) for row in m]
    [[0.0, 1.0, 2.0], [1.0, 0.0, 2.0], [2.0, 2.0, 0.0]]
    """

    __slots__ = ("groups", "diag", "intra", "inter")

    def __init__(self, groups: Sequence[Any], diag: float, intra: float, inter: float):
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise EinjoinError(f"LinkMatrix groups must be a sequence (a group per device), got "
                               f"{type(groups).__name__}")
        self.groups = tuple(groups)
        self.diag, self.intra, self.inter = (_number(v, "link value") for v in (diag, intra, inter))

    def value(self, i: int, j: int) -> float:
        """``m[i][j]`` without building a row."""
        if i == j:
            return self.diag
        return self.intra if self.groups[i] == self.groups[j] else self.inter

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: Any) -> Any:
        picked = range(len(self.groups))[i]  # negative indices, slices and IndexError as a tuple's
        if isinstance(picked, range):
            return tuple(_LinkRow(self, k) for k in picked)
        return _LinkRow(self, picked)

    def __iter__(self) -> Iterator[_LinkRow]:
        return (_LinkRow(self, i) for i in range(len(self.groups)))

    def _key(self) -> tuple[Any, ...]:
        return (self.groups, self.diag, self.intra, self.inter)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LinkMatrix):
            if self._key() == other._key():
                return True
        elif not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(tuple(a) == tuple(b) for a, b in zip(self, other))

    def __hash__(self) -> int:
        # equal to the dense tuple of tuples it equals (O(n^2): clusters are rarely hashed)
        return hash(tuple(tuple(row) for row in self))

    def __repr__(self) -> str:
        return (f"LinkMatrix({len(self)} devices, {len(set(self.groups))} groups, diag={self.diag}, "
                f"intra={self.intra}, inter={self.inter})")


class _LinkRow(Sequence[float]):
    """Row ``i`` of a :class:`LinkMatrix` (a view)."""

    __slots__ = ("m", "i")

    def __init__(self, m: LinkMatrix, i: int):
        self.m, self.i = m, i

    def __len__(self) -> int:
        return len(self.m)

    def __getitem__(self, j: Any) -> Any:
        picked = range(len(self.m))[j]
        if isinstance(picked, range):
            return tuple(self.m.value(self.i, k) for k in picked)
        return self.m.value(self.i, picked)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self)) if len(self) <= 16 else f"<row {self.i} of {self.m!r}>"


@dataclass(frozen=True)
class Device:
    """One device: ``id`` is its index in the cluster; ``memory`` its capacity in bytes (None:
    unbounded; a string such as ``"2GiB"`` is converted)."""

    id: int
    kind: str = "cpu"
    memory: int | None = None
    node: str | None = None      # the machine it lives on (a Ray node id), None: this process

    def __post_init__(self) -> None:
        if isinstance(self.id, bool) or not isinstance(self.id, numbers.Integral) or self.id < 0:
            raise EinjoinError(f"Device id must be a non-negative int, got {self.id!r}")
        object.__setattr__(self, "id", operator.index(self.id))
        if not isinstance(self.kind, str) or not self.kind:
            raise EinjoinError(f"Device kind must be a non-empty string such as 'cpu', got {self.kind!r}")
        object.__setattr__(self, "memory", parse_bytes(self.memory))
        if self.node is not None and not isinstance(self.node, str):
            raise EinjoinError(f"Device node must be a string (a node id) or None, got {self.node!r}")

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


def _check_matrix(m: Any, name: str, n: int) -> Any:
    """A link matrix as a :class:`LinkMatrix` or a tuple of tuples of floats, checked: n x n,
    numbers, bandwidth positive off the diagonal, latency non-negative."""
    def bad(v: float) -> bool:
        return not v > 0 if name == "bandwidth" else not v >= 0

    if isinstance(m, LinkMatrix):
        if len(m) != n:
            raise EinjoinError(f"cluster {name} must be a {n}x{n} matrix, got {len(m)}x{len(m)}")
        values = [m.diag] if name == "latency" else []
        values += [m.inter] + ([m.intra] if len(set(m.groups)) < n else [])
        for v in values:
            if bad(_number(v, name)):
                raise EinjoinError(f"cluster {name} {v} must be {'positive' if name == 'bandwidth' else '>= 0'}")
        return m
    if isinstance(m, (str, bytes)) or not isinstance(m, Sequence) or len(m) != n:
        raise EinjoinError(f"cluster {name} must be a {n}x{n} matrix (a sequence of rows), got "
                           f"{type(m).__name__}")
    rows = []
    for i, row in enumerate(m):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) != n:
            raise EinjoinError(f"cluster {name} must be a {n}x{n} matrix; row {i} is {row!r:.60}")
        vals = tuple(_number(v, name) for v in row)
        for j, v in enumerate(vals):
            if bad(v) and (i != j or name == "latency"):
                raise EinjoinError(f"{name} {i} -> {j} must be {'positive' if name == 'bandwidth' else '>= 0'}, "
                                   f"got {v}")
        rows.append(vals)
    return tuple(rows)


@dataclass(frozen=True)
class Cluster:
    """Devices plus ``bandwidth[src][dst]`` (bytes/s) and ``latency[src][dst]`` (s): each a
    sequence of rows, or a :class:`LinkMatrix` (O(n) memory)."""

    devices: tuple[Device, ...]
    bandwidth: Sequence[Sequence[float]]
    latency: Sequence[Sequence[float]]
    # the time model (einjoin.cluster.model.Hardware) of a preset; None: the devices are this
    # machine's (the simulator calibrates them) or are known by their links alone
    hardware: Any = None

    def __post_init__(self) -> None:
        devs = self.devices
        if isinstance(devs, (str, bytes)) or not isinstance(devs, Sequence):
            raise EinjoinError(f"Cluster devices must be a sequence of ej.Device, got {type(devs).__name__}")
        n = len(devs)
        if n == 0:
            raise EinjoinError("a cluster needs at least one device")
        check_device_count(n, "Cluster devices")
        wrong = [d for d in devs if not isinstance(d, Device)]
        if wrong:
            raise EinjoinError(f"Cluster devices must be ej.Device objects, got {_short(wrong[0])}")
        if any(d.id != i for i, d in enumerate(devs)):
            raise EinjoinError(f"device ids must be 0..{n - 1} in order, got {[d.id for d in devs][:20]}")
        object.__setattr__(self, "devices", tuple(devs))
        for name in ("bandwidth", "latency"):
            object.__setattr__(self, name, _check_matrix(getattr(self, name), name, n))
        if self.hardware is not None:
            from einjoin.cluster.model import Hardware
            if not isinstance(self.hardware, Hardware) or self.hardware.size != n:
                raise EinjoinError(f"Cluster hardware must be an einjoin.cluster.model.Hardware for {n} devices, "
                                   f"got {_short(self.hardware)}")

    @property
    def size(self) -> int:
        return len(self.devices)

    def transfer_time(self, src: int, dst: int, nbytes: int) -> float:
        if src == dst:
            return 0.0
        return _at(self.latency, src, dst) + nbytes / _at(self.bandwidth, src, dst)

    @staticmethod
    def uniform(n: int, kind: str = "cpu", memory: int | str | None = None,
                bandwidth: float = 20e9, latency: float = 5e-6) -> Cluster:
        """``n`` alike devices, every pair linked at ``bandwidth`` bytes/s and ``latency`` s."""
        n = check_device_count(n)
        mem = parse_bytes(memory)
        devs = tuple(Device(i, kind, mem) for i in range(n))
        groups = (0,) * n
        bw, lat = _number(bandwidth, "bandwidth"), _number(latency, "latency")
        return Cluster(devs, LinkMatrix(groups, float("inf"), bw, bw), LinkMatrix(groups, 0.0, lat, lat))

    @staticmethod
    def islands(sizes: Sequence[int], intra: float, inter: float, kind: str = "cpu",
                intra_latency: float = 2e-6, inter_latency: float = 2e-5,
                memory: int | str | None = None) -> Cluster:
        """Groups of devices with fast links inside a group and slower ones between groups."""
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
            raise EinjoinError(f"islands sizes must be a non-empty list of device counts, got {sizes!r}")
        counts = [_positive_int(k, "islands sizes") for k in sizes]
        check_device_count(sum(counts), "islands devices in all")
        return Cluster.grouped([g for g, k in enumerate(counts) for _ in range(k)], intra, inter,
                               kind, intra_latency, inter_latency, memory)

    @staticmethod
    def grouped(groups: Sequence[Any], intra: float, inter: float, kind: str = "cpu",
                intra_latency: float = 2e-6, inter_latency: float = 2e-5,
                memory: int | str | None = None, nodes: Sequence[str | None] | None = None) -> Cluster:
        """One device per entry of ``groups`` (any hashable: a node id, an island number);
        devices of one group are linked at ``intra``, others at ``inter`` (bytes/s). ``nodes``
        gives each device's ``Device.node``. The matrices take O(n) memory."""
        n = check_device_count(len(groups), "devices (the length of groups)")
        mem = parse_bytes(memory)
        if nodes is not None and len(nodes) != n:
            raise EinjoinError(f"grouped: {len(nodes)} nodes for {n} devices")
        devs = tuple(Device(i, kind, mem, None if nodes is None else nodes[i]) for i in range(n))
        return Cluster(devs, LinkMatrix(groups, float("inf"), _number(intra, "bandwidth"),
                                        _number(inter, "bandwidth")),
                       LinkMatrix(groups, 0.0, _number(intra_latency, "latency"),
                                  _number(inter_latency, "latency")))

    def with_memory(self, memory: int | str | None | Mapping[int, int | None]) -> Cluster:
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
                       self.latency, self.hardware)

    @staticmethod
    def preset(name: str, devices: int | None = None) -> Cluster:
        """A cluster of hardware we describe by its data sheet (:mod:`einjoin.cluster.presets`):
        ``"dgx-a100"``, ``"dgx-h100"`` (8 GPUs on NVSwitch), ``"h200"`` (one GPU); ``devices``
        takes that many of its GPUs instead. It carries its time model (``hardware``) for
        ``prog.simulate()``.

        >>> c = Cluster.preset("dgx-a100")
        >>> c.size, str(c.devices[0]), c.devices[0].memory == 80 * 2**30
        (8, 'a100:0', True)
        """
        from einjoin.cluster.presets import preset_hardware
        return Cluster.of_hardware(preset_hardware(name, None if devices is None else check_device_count(devices)))

    @staticmethod
    def nodes(n: int, per_node: str = "dgx-a100", network_gbps: float = 200) -> Cluster:
        """``n`` machines of preset ``per_node``, one NIC of ``network_gbps`` Gbit/s per GPU
        between them (a transfer between nodes goes out of its GPU's NIC and into the other's).

        >>> c = Cluster.nodes(2)
        >>> c.size, c.bandwidth[0][1] > c.bandwidth[0][8] == 25e9
        (16, True)
        """
        from einjoin.cluster.presets import nodes_hardware, size_of
        count = check_device_count(n, "nodes")
        check_device_count(count * size_of(per_node), f"devices of {count} nodes of {per_node}")
        return Cluster.of_hardware(nodes_hardware(count, per_node, network_gbps))

    @staticmethod
    def of_hardware(hw: Any) -> Cluster:
        """The cluster a time model (:class:`einjoin.cluster.model.Hardware`) describes: a device
        per model (its name the kind, its memory), links as its fabrics."""
        devs = tuple(Device(i, m.name, m.memory) for i, m in enumerate(hw.models))
        return Cluster(devs, LinkMatrix(hw.groups, float("inf"), hw.intra.bandwidth, hw.inter.bandwidth),
                       LinkMatrix(hw.groups, 0.0, hw.intra.latency, hw.inter.latency), hw)

    def __str__(self) -> str:
        kinds = sorted({d.kind for d in self.devices})
        return f"Cluster({self.size} x {'/'.join(kinds)})"


def _at(m: Any, i: int, j: int) -> float:
    return m.value(i, j) if isinstance(m, LinkMatrix) else m[i][j]


def local(n: int, memory: int | str | None = None) -> Cluster:
    """``n`` logical devices in this process: the embedded default (1 <= n <= MAX_DEVICES)."""
    return Cluster.uniform(n, "cpu", memory)


def as_cluster(devices: Any) -> Cluster:
    """``devices`` as a cluster: an :class:`Cluster` as it is, a device count as ``local(n)``."""
    if isinstance(devices, Cluster):
        return devices
    return local(check_device_count(devices))
