"""The threads backend shares the cores with torch's kernels (attention, convolution, pooling run
on torch's CPU kernels): while a run is in flight torch's intra-op threads are cores // devices,
as the torch backend sets them, and the count is restored after."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

import einjoin as ej
from einjoin.runtime.backends.torch_backend import TORCH_THREADS


def test_device_threads_of_the_threads_backend_share_torchs_intra_op_threads() -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    class Threads:
        def on_start(self, task: Any) -> None:
            seen.append(torch.get_num_threads())

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass

    x = ej.input("x", (8, 4, 16, 8))
    out = ej.attention(x, x, x, causal=True)
    feeds = {"x": np.random.default_rng(0).standard_normal((8, 4, 16, 8)).astype(np.float32)}
    ej.compile(out, devices=2, backend="threads", quiet=True).run(callbacks=[Threads()], **feeds)
    assert seen and set(seen) == {max(1, (os.cpu_count() or 1) // 2)}
    assert torch.get_num_threads() == before and TORCH_THREADS._devices == 0
