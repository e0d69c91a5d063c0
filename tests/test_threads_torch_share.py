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


def _limits_seen(out: Any, feeds: dict[str, np.ndarray]) -> set[tuple[int, int]]:
    """(torch intra-op threads, numpy's BLAS threads) as the kernels of a 1-device run see them."""
    from threadpoolctl import threadpool_info
    seen: set[tuple[int, int]] = set()

    class Threads:
        def on_start(self, task: Any) -> None:
            blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"
                    and "numpy" in i["filepath"]]
            seen.add((torch.get_num_threads(), blas[0] if blas else -1))

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass

    ej.compile(out, devices=1, backend="threads", quiet=True).run(callbacks=[Threads()], **feeds)
    return seen


def test_one_device_on_several_cores_gives_the_share_to_the_pool_doing_most_flops() -> None:
    """Two pools of several threads on the same cores fight (OpenBLAS's workers spin after a call:
    a torch call right after a numpy matmul waited for them): the pool with most of the program's
    flops gets the device's cores, the other one thread."""
    import threadpoolctl
    cores = os.cpu_count() or 1
    if cores < 2:
        return  # one core: one thread each, nothing to choose
    # threadpoolctl (>= 3.6) lets one live thread change OpenBLAS's limit: a test that used
    # threadpool_limits on pytest's main thread would hold it (test_concurrency's blas_control)
    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    rng = np.random.default_rng(0)
    x = ej.input("x", (2, 4, 64, 32))
    w = ej.input("w", (32, 32))
    feeds = {"x": rng.standard_normal((2, 4, 64, 32)).astype(np.float32),
             "w": rng.standard_normal((32, 32)).astype(np.float32)}
    attention_heavy = ej.attention(x @ w, x, x)                      # the attention has most flops
    assert _limits_seen(attention_heavy, feeds) == {(cores, 1)}
    y = ej.input("y", (256, 256))
    matmul_heavy = ej.attention(x, x, x).sum() + (y @ y @ y).sum()  # the matmuls have most flops
    assert _limits_seen(matmul_heavy, {"x": feeds["x"], "y": rng.standard_normal((256, 256)).astype(np.float32)}) \
        == {(1, cores)}
    assert TORCH_THREADS._devices == 0
