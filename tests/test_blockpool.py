"""The per-program pool of large blocks (einjoin/runtime/blockpool.py): a later run writes the
arrays an earlier run's blocks used, so what it must never write is checked here -- a result the
caller holds (itself or a view of a pooled block), a program's state, a block still held by a
concurrent run -- and that runs with the pool, without it and under a memory cap give the same
numbers. The pool's threshold is lowered to 0 so that small blocks take it (it is read when a
program first runs), and every test checks that the pool was used (else it could not fail)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import einjoin as ej
from einjoin.runtime import blockpool


@pytest.fixture
def pool_all(monkeypatch):
    monkeypatch.setattr(blockpool, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(blockpool, "POOL_BLOCKS", True)


def _pool(prog) -> blockpool.BlockPool:
    return blockpool.engine_pool(prog._engine).pool


def _feeds(rng, names, shapes):
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in zip(names, shapes)}


@pytest.mark.parametrize("devices", [1, 2])
def test_results_the_caller_holds_are_never_written_by_a_later_run(pool_all, devices):
    """An intermediate product t (pooled) read by a transpose that is an output and by a chain on
    to an output; unfused, so that the transpose stays a kernel of its own. Every result of every
    earlier run still holds its own numbers after the later runs."""
    a, b, c = ej.input("bp_a", (512, 64)), ej.input("bp_b", (64, 384)), ej.input("bp_c", (384, 320))
    t = a @ b
    outs = [t.T, t @ c]
    prog = ej.compile(outs, devices=devices, backend="threads", quiet=True, fuse=False)
    rng = np.random.default_rng(0)
    runs = [_feeds(rng, ("bp_a", "bp_b", "bp_c"), ((512, 64), (64, 384), (384, 320))) for _ in range(4)]
    held = [prog.run(**f) for f in runs]
    pool = _pool(prog)
    assert pool.reused > 0  # later runs wrote arrays of earlier ones
    for f, got in zip(runs, held):
        for g, w in zip(got, ej.reference(outs, **f)):
            assert not pool.holds(g)
            np.testing.assert_array_equal(g, w)


def test_one_device_results_are_the_callers(pool_all):
    """On one device an output of one block is the block itself: it is never the pool's."""
    a, b, c = ej.input("bp1_a", (512, 64)), ej.input("bp1_b", (64, 384)), ej.input("bp1_c", (384, 320))
    prog = ej.compile(a @ b @ c, devices=1, backend="threads", quiet=True)
    rng = np.random.default_rng(1)
    runs = [_feeds(rng, ("bp1_a", "bp1_b", "bp1_c"), ((512, 64), (64, 384), (384, 320))) for _ in range(3)]
    held = [prog.run(**f) for f in runs]
    assert _pool(prog).reused > 0
    for f, got in zip(runs, held):
        assert not _pool(prog).holds(got)
        np.testing.assert_array_equal(got, ej.reference(a @ b @ c, **f))


def test_pool_on_off_and_under_a_cap_agree(pool_all, monkeypatch):
    """The MLP's relu writes into its pooled matmul block (plan/fuse_inplace.py): the same bits
    with the pool as without it; under a memory cap (no pool there) the same numbers."""
    x, w1, w2 = ej.input("bp_x", (1024, 32)), ej.input("bp_w1", (32, 256)), ej.input("bp_w2", (256, 16))
    out = ej.relu(x @ w1) @ w2
    f = _feeds(np.random.default_rng(2), ("bp_x", "bp_w1", "bp_w2"), ((1024, 32), (32, 256), (256, 16)))
    pooled = ej.compile(out, devices=2, backend="threads", quiet=True)
    got = [pooled.run(**f) for _ in range(3)]
    assert _pool(pooled).reused > 0
    capped = ej.compile(out, devices=2, backend="threads", quiet=True, memory_limit="600KB")
    assert capped.taskgraph.memory is not None
    want_capped = capped.run(**f)
    assert not blockpool.engine_pool(capped._engine).kernels  # a capped run takes no pooled block
    monkeypatch.setattr(blockpool, "POOL_BLOCKS", False)
    plain = ej.compile(out, devices=2, backend="threads", quiet=True, memory_limit=None)
    want = plain.run(**f)
    for g in got:
        np.testing.assert_array_equal(g, want)
    # the cap's plan cuts k (partial sums): other roundings, the same numbers
    np.testing.assert_allclose(want_capped, want, rtol=1e-5, atol=1e-4)


def test_state_blocks_are_not_the_pools(pool_all):
    """A program with state (a training step) keeps its new state between runs: it takes no
    pooled block, and its steps equal numpy's."""
    m, k, n = 1024, 32, 256
    x, y, w = ej.input("bps_x", (m, k)), ej.input("bps_y", (m, n)), ej.param("bps_w", (k, n))
    r = x @ w - y
    gw = ej.einsum("mk,mn->kn", x, r)
    prog = ej.compile([(r * r).sum()], 2, state={w - 0.01 * gw: w}, backend="threads", quiet=True)
    rng = np.random.default_rng(3)
    W = rng.standard_normal((k, n)).astype(np.float32)
    Wn = W.copy()
    for i in range(3):
        X, Y = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
        prog.run(bps_x=X, bps_y=Y, bps_w=W) if i == 0 else prog.run(bps_x=X, bps_y=Y)
        Wn = Wn - np.float32(0.01) * X.T @ (X @ Wn - Y)
    np.testing.assert_allclose(prog.read_state()["bps_w"], Wn, rtol=1e-3, atol=1e-3)
    assert _pool(prog).nbytes == 0


def test_concurrent_runs_never_share_a_pooled_block(pool_all):
    """Two threads run one program at once with different feeds: a block one run holds is not
    handed to the other (the pool reads reference counts after taking its own)."""
    a, b, c = ej.input("bpc_a", (512, 64)), ej.input("bpc_b", (64, 384)), ej.input("bpc_c", (384, 32))
    prog = ej.compile(a @ b @ c, devices=2, backend="threads", quiet=True)
    rng = np.random.default_rng(4)
    feeds = [_feeds(rng, ("bpc_a", "bpc_b", "bpc_c"), ((512, 64), (64, 384), (384, 32))) for _ in range(2)]
    wants = [ej.reference(a @ b @ c, **f) for f in feeds]
    bad: list[str] = []

    def loop(i: int) -> None:
        for _ in range(40):
            if not np.array_equal(prog.run(**feeds[i]), wants[i]):
                bad.append(f"thread {i}")

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert _pool(prog).reused > 0


def test_pool_keeps_at_most_its_cap():
    pool = blockpool.BlockPool(max_bytes=1000)
    a = pool.empty((100,), np.float32)  # 400 bytes: kept
    b = pool.empty((100,), np.float32)  # 800: kept
    c = pool.empty((100,), np.float32)  # 1200 > 1000: numpy's own, not kept
    assert pool.holds(a) and pool.holds(b) and not pool.holds(c) and pool.nbytes == 800
    del a
    assert pool.holds(pool.empty((100,), np.float32))


def test_a_view_or_a_holder_of_a_pooled_array_keeps_it_from_the_next_taker():
    pool = blockpool.BlockPool()
    a = pool.empty((64, 64), np.float32)
    a[:] = 1
    view, memory = a[3:5].T, memoryview(a)
    del a
    b = pool.empty((64, 64), np.float32)  # the view holds a: another array
    b[:] = 2
    assert (view == 1).all() and not np.shares_memory(view, b)
    del view
    c = pool.empty((64, 64), np.float32)  # the memoryview still holds a
    assert not np.shares_memory(c, np.asarray(memory)) and c is not b
    del memory, c
    assert pool.empty((64, 64), np.float32) is not b and pool.reused == 1  # a again (b is held)


def test_close_drops_the_pool_and_later_runs_still_agree(pool_all):
    a, b, c = ej.input("bpx_a", (512, 64)), ej.input("bpx_b", (64, 384)), ej.input("bpx_c", (384, 32))
    prog = ej.compile(a @ b @ c, devices=2, backend="threads", quiet=True)
    f = _feeds(np.random.default_rng(5), ("bpx_a", "bpx_b", "bpx_c"), ((512, 64), (64, 384), (384, 32)))
    want = ej.reference(a @ b @ c, **f)
    np.testing.assert_array_equal(prog.run(**f), want)
    engine = prog._engine
    assert _pool(prog).nbytes > 0
    prog.close()
    assert engine not in blockpool._POOLS
    np.testing.assert_array_equal(prog.run(**f), want)
