"""``RunStats.bytes_copied``: the physical bytes a run's moves copied, beside ``bytes_moved`` (the
plan's logical bytes, equal to ``prog.stats.bytes_moved`` on every backend). Each local backend's
count is checked against what its stores really hold after each move (a block sharing no memory
with its source was copied); the simulator's against the moves it models as copies. The Ray
backend's (every move crosses processes) is checked in ``tests/test_ray.py``'s two-node test."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.exchange import TaskKind


def _graph() -> tuple[Any, dict[str, np.ndarray]]:
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 32)).astype(np.float32),
             "w": rng.standard_normal((32, 48)).astype(np.float32)}
    return ej.tanh(x @ w).sum(0), feeds


def _observe_moves(monkeypatch: pytest.MonkeyPatch, session_cls: Any, shares: Any) -> list[int]:
    """Per move a session executes, the bytes it copied: its block's bytes when the block shares
    no memory with the source block, else 0."""
    copied: list[int] = []
    real = session_cls.execute

    def execute(self: Any, t: Any) -> None:
        real(self, t)
        if t.kind is TaskKind.MOVE:
            src = self.stores[t.payload.src_device].get(t.reads[0])
            dst = self.stores[t.device].get(t.writes)
            copied.append(0 if shares(dst, src) else dst.nbytes)

    monkeypatch.setattr(session_cls, "execute", execute)
    return copied


@pytest.mark.parametrize("backend", ["sync", "threads"])
@pytest.mark.parametrize("capped", [False, True])
def test_local_moves_copy_only_under_a_memory_cap(monkeypatch: pytest.MonkeyPatch, backend: str,
                                                  capped: bool) -> None:
    from einjoin.runtime.local import LocalSession

    copied = _observe_moves(monkeypatch, LocalSession, np.shares_memory)
    y, feeds = _graph()
    prog = ej.compile(y, devices=2, backend=backend, planner="split_largest", quiet=True,
                      **({"memory_limit": "1GiB"} if capped else {}))
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(y, **feeds), rtol=1e-5, atol=1e-5)
    s = prog.run_stats
    assert s.bytes_moved == prog.stats.bytes_moved > 0 and copied
    assert s.bytes_copied == sum(copied)
    assert s.bytes_copied == (s.bytes_moved if capped else 0)


@pytest.mark.parametrize("capped", [False, True])
def test_null_backend_counts_the_copies_threads_would_make(capped: bool) -> None:
    y, feeds = _graph()
    kw: dict[str, Any] = {"memory_limit": "1GiB"} if capped else {}
    counts = []
    for backend in ("threads", "null"):
        prog = ej.compile(y, devices=2, backend=backend, planner="split_largest", quiet=True, **kw)
        prog.run(**feeds)
        counts.append((prog.run_stats.bytes_moved, prog.run_stats.bytes_copied))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("capped", [False, True])
def test_torch_backend_counts_move_copies_and_host_copies(monkeypatch: pytest.MonkeyPatch, capped: bool) -> None:
    torch = pytest.importorskip("torch")
    from einjoin.runtime.backends.torch_backend import TorchSession, _shares

    copied = _observe_moves(monkeypatch, TorchSession, _shares)
    y, feeds = _graph()
    prog = ej.compile(y, devices=2, backend="torch", planner="split_largest", quiet=True,
                      **({"memory_limit": "1GiB"} if capped else {}))
    tfeeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
    got = prog.run(**tfeeds)
    np.testing.assert_allclose(np.asarray(got), ej.reference(y, **feeds), rtol=1e-5, atol=1e-5)
    s = prog.run_stats
    assert s.bytes_moved == prog.stats.bytes_moved and copied
    assert prog.backend.host_copies == 0  # tensors in, tensors out: no host copy
    assert s.bytes_copied == sum(copied) == (s.bytes_moved if capped else 0)
    # a feed torch cannot share (reversed strides) is copied once: counted beside the moves
    flipped = {"x": feeds["x"][::-1], "w": feeds["w"]}
    prog.run(**flipped)
    assert prog.backend.host_copies == flipped["x"].nbytes
    assert prog.run_stats.bytes_copied == sum(copied[len(copied) // 2:]) + flipped["x"].nbytes


@pytest.mark.parametrize("capped", [False, True])
def test_simulator_counts_the_copies_it_models(capped: bool) -> None:
    y, feeds = _graph()
    kw: dict[str, Any] = {"memory_limit": "1GiB"} if capped else {}
    # local(2): shared memory hands an uncapped block over; a cluster with links of its own copies
    for devices, copies in ((2, capped), (ej.Cluster.uniform(2, bandwidth=1e9), True)):
        prog = ej.compile(y, devices=devices, backend="simulate", planner="split_largest", quiet=True, **kw)
        prog.run(**feeds)
        s = prog.run_stats
        assert s.source == "simulated" and s.bytes_moved == prog.stats.bytes_moved > 0
        assert s.bytes_copied == (s.bytes_moved if copies else 0)
