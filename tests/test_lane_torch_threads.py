"""The threads backend's torch share on every lane. torch's intra-op thread count is a per-thread
setting under OpenMP (``omp_set_num_threads`` changes the asking thread's), so the limit entered
on the first lane in must be taken by each other lane on its own thread: else a lane kept its own
count (the cores), its torch kernels opened a team of OpenMP threads on cores the other lane was
computing on, and spun (the small LLaMA training step's attention gradients took ~3-4x their CPU).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import einjoin as ej
from einjoin.frontend.composites import fused_attention
from einjoin.ir import attention as A
from einjoin.runtime.backend import cores

torch = pytest.importorskip("torch")


def test_each_lane_runs_torch_kernels_at_its_share(monkeypatch):
    """Every torch kernel of a 2-device threaded run sees cores // 2 intra-op threads on its
    lane's thread, whatever count the lanes' threads had before (here: every core, set on each
    of them first), and the results are those of a sync run."""
    if cores() < 2:
        pytest.skip("one core: every share is one thread")
    q, k, v = (ej.input(n, (4, 2, 16, 8), "float32") for n in "qkv")
    out = fused_attention(q, k, v, None, True)
    g = ej.input("g", out.shape, "float32")
    grads = ej.grad((out * g).sum(), [q, k, v])
    prog = ej.compile([out, *grads], devices=ej.local(2), backend="threads", quiet=True)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((4, 2, 16, 8)).astype(np.float32) for n in "qkvg"}
    seen: list[tuple[str, int]] = []
    forward, backward = A._forward_torch, A.attention_grad_torch

    def fwd(*a, **kw):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return forward(*a, **kw)

    def bwd(*a, **kw):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return backward(*a, **kw)

    monkeypatch.setattr(A, "_forward_torch", fwd)
    monkeypatch.setattr(A, "attention_grad_torch", bwd)
    prog.run(**feeds)  # the engine's lane threads now exist: give each of them every core
    pool = prog._engine.workers()
    done = threading.Barrier(2 + 1, timeout=30)
    for lane in range(2):
        pool.post(lane, lambda: (torch.set_num_threads(cores()), done.wait()))
    done.wait()
    seen.clear()
    for _ in range(3):
        got = prog.run(**feeds)
    lanes = {name for name, _ in seen}
    assert len(lanes) == 2, lanes  # both lanes ran torch kernels (the batch is cut in two)
    assert {n for _, n in seen} == {max(1, cores() // 2)}, seen
    want = ej.compile([out, *grads], devices=ej.local(2), backend="sync", quiet=True).run(**feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_the_blas_share_holds_under_a_users_threadpool_limits():
    """A ``threadpool_limits`` held by the caller makes its thread threadpoolctl's controller of
    OpenBLAS, whose setter then ignores every other thread: the share a run's lane sets must
    still apply (else both lanes call OpenBLAS at every core and spin against each other). The
    caller's limit is back once the run and the context end."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if cores() < 2:
        pytest.skip("one core: every share is one thread")
    x, y = ej.input("x", (64, 64), "float32"), ej.input("y", (64, 64), "float32")
    prog = ej.compile([ej.einsum("ij,jk->ik", x, y)], devices=ej.local(2), backend="threads", quiet=True)

    def blas() -> list[int]:
        return [lc.num_threads for lc in threadpoolctl.ThreadpoolController().lib_controllers
                if lc.internal_api == "openblas"]

    if not blas():
        pytest.skip("no OpenBLAS loaded")
    seen: list[list[int]] = []

    class Record:
        def on_start(self, task):
            seen.append(blas())

        def on_end(self, task, start, end):
            pass

    a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
    before = blas()
    with threadpoolctl.threadpool_limits(cores(), user_api="blas"):
        got = prog.run(x=a, y=a, callbacks=[Record()])
        assert blas() == [cores()] * len(before)  # the caller's limit, back after the run
    assert seen and all(n == [max(1, cores() // 2)] * len(before) for n in seen), seen
    assert blas() == before
    np.testing.assert_allclose(np.asarray(got[0] if isinstance(got, (list, tuple)) else got), a @ a, rtol=1e-5)
