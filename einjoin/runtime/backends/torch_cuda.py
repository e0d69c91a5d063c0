"""Where the torch backend puts a program's plan devices (``TorchBackend(device_map=...)``) and, on
CUDA, the per-device streams and cross-stream events.

The mapping (:func:`map_devices`) is plain logic, tested on the CPU: ``"cpu"`` puts every plan
device on the CPU (one worker thread each); ``"cuda"`` puts plan device ``d`` on GPU ``d % g`` of
the ``g`` GPUs present (several plan devices on one GPU when there are fewer GPUs than devices,
each with its own stream); a list names each plan device's torch device.

UNTESTED ON A GPU (no CUDA device was available when it was written): :class:`CudaLanes`, the
stream, event and pinned-memory handling below. A plan device's kernels run on its own stream;
a value produced on one stream records an event that a reader on another stream waits for (and
the reader's stream is recorded on the tensor, so the caching allocator does not reuse its memory
early); host copies go to pinned memory with ``non_blocking=True``.

>>> map_devices("cuda", 3, gpus=2)
['cuda:0', 'cuda:1', 'cuda:0']
>>> map_devices("cpu", 2, gpus=0)
['cpu', 'cpu']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from einjoin.errors import EinjoinError

__all__ = ["map_devices", "check_caps", "CudaLanes"]


def map_devices(device_map: str | Sequence[str], n_devices: int, gpus: int | None = None) -> list[str]:
    """Each plan device's torch device (see the module docstring). ``gpus``: the CUDA devices
    present (default: ``torch.cuda.device_count()``)."""
    if isinstance(device_map, str):
        if device_map == "cpu":
            return ["cpu"] * n_devices
        if device_map == "cuda":
            g = torch.cuda.device_count() if gpus is None else gpus
            if g < 1:
                raise EinjoinError(f"device_map='cuda' but no CUDA device is present (torch "
                                   f"{torch.__version__}, torch.cuda.is_available() is False); use "
                                   f"device_map='cpu'")
            return [f"cuda:{d % g}" for d in range(n_devices)]
        if device_map.startswith("cuda:") or device_map.startswith("cpu"):
            return [device_map] * n_devices
        raise EinjoinError(f"device_map must be 'cpu', 'cuda', 'cuda:k' or a list of one torch device per "
                           f"plan device, got {device_map!r}")
    names = [str(x) for x in device_map]
    if len(names) != n_devices:
        raise EinjoinError(f"device_map lists {len(names)} torch devices but the program has {n_devices} plan "
                           f"devices; give one per plan device, or 'cuda' to spread them over the GPUs")
    for x in names:
        if not (x == "cpu" or x.startswith("cuda")):
            raise EinjoinError(f"device_map: {x!r} is not a torch device this backend runs on ('cpu', 'cuda:k')")
    return names


def check_caps(devices: Sequence[str], caps: dict[int, int | None] | None,
               free: dict[str, int]) -> None:
    """Refuse a memory plan whose caps do not fit the GPUs: the plan devices mapped onto one GPU
    share it, so their caps must add up to at most its free memory (``free``: per torch device,
    what the caching allocator can still get: free memory plus what it already holds unused)."""
    if not caps:
        return
    need: dict[str, int] = {}
    for d, dev in enumerate(devices):
        cap = caps.get(d)
        if dev.startswith("cuda") and cap is not None:
            need[dev] = need.get(dev, 0) + cap
    for dev, n in need.items():
        if dev in free and n > free[dev]:
            raise EinjoinError(f"the memory plan's caps of the plan devices on {dev} add up to {n} bytes, but "
                               f"{dev} has {free[dev]} bytes free; compile with a smaller memory_limit")


class CudaLanes:  # pragma: no cover - needs a CUDA device (UNTESTED ON A GPU)
    """Per plan device its CUDA stream, and per value the event recorded after it was produced,
    so a reader on another stream waits for exactly what it reads."""

    def __init__(self, devices: Sequence[str]):
        self.devices = [torch.device(d) for d in devices]
        self.streams = [torch.cuda.Stream(device=d) if d.type == "cuda" else None  # type: ignore[no-untyped-call]
                        for d in self.devices]
        self.events: dict[int, Any] = {}

    def context(self, device: int) -> Any:
        """Run a task of plan device ``device`` on its stream, with factory functions (``arange``,
        ``zeros``) on its GPU."""
        import contextlib
        stack = contextlib.ExitStack()
        s = self.streams[device]
        if s is not None:
            stack.enter_context(torch.cuda.stream(s))
        stack.enter_context(self.devices[device])
        return stack

    def wait_for(self, device: int, vid: int, value: Any) -> None:
        """Before plan device ``device`` reads value ``vid``: wait on its event (made on another
        stream) and tell the allocator that this stream uses the tensor."""
        s = self.streams[device]
        ev = self.events.get(vid)
        if s is None or ev is None:
            return
        s.wait_event(ev)
        if isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(s)

    def produced(self, device: int, vid: int) -> None:
        s = self.streams[device]
        if s is not None:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(s)
            self.events[vid] = ev

    def synchronize(self) -> None:
        for s in self.streams:
            if s is not None:
                s.synchronize()


def pinned_copy(value: torch.Tensor) -> torch.Tensor:  # pragma: no cover - needs CUDA (UNTESTED ON A GPU)
    """A host copy of a CUDA tensor in pinned memory (the copy is asynchronous on the current
    stream; the caller synchronises before reading it)."""
    out = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    out.copy_(value, non_blocking=True)
    return out
