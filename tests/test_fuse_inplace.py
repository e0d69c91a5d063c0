"""Elementwise kernels writing into a dying input block (einjoin.plan.fuse_inplace): the same bits as
the kernel writing a fresh block, and never over a block something else still reads."""

from __future__ import annotations


import numpy as np
import pytest

import einjoin as ej
from einjoin.plan import fuse_inplace as fi

RNG = np.random.default_rng(7)


def _feeds(**shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {k: RNG.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}


def _run(prog: ej.Program, feeds: dict[str, np.ndarray], donate: bool, monkeypatch: pytest.MonkeyPatch,
         hits: list[bool]) -> list[np.ndarray]:
    """Outputs of one run with donations on or off, and whether each donation wrote in place."""
    engine = prog._engine
    monkeypatch.setitem(fi._PLANS, engine, fi.donations(engine.tg, engine.decomps) if donate else {})
    out = prog.run(**feeds)
    return [np.array(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


@pytest.fixture
def hits(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    got: list[bool] = []
    orig = fi.Donation.__call__

    def call(self: fi.Donation, values: dict[int, object], pool: object = None) -> np.ndarray | None:
        r = orig(self, values, pool)
        got.append(r is not None)
        return r
    monkeypatch.setattr(fi.Donation, "__call__", call)
    return got


def test_mlp_relu_writes_into_the_matmul_block_with_the_same_bits(monkeypatch, hits) -> None:
    x, w1, w2 = ej.input("x", (256, 64)), ej.input("w1", (64, 512)), ej.input("w2", (512, 32))
    prog = ej.compile(ej.relu(x @ w1) @ w2, devices=ej.local(2), backend="threads", quiet=True)
    feeds = _feeds(x=(256, 64), w1=(64, 512), w2=(512, 32))
    off = _run(prog, feeds, False, monkeypatch, hits)
    assert hits == []
    on = _run(prog, feeds, True, monkeypatch, hits)
    assert hits and all(hits)
    assert all(np.array_equal(a, b) for a, b in zip(on, off))
    want = np.maximum(feeds["x"] @ feeds["w1"], 0) @ feeds["w2"]
    np.testing.assert_allclose(on[0], want, rtol=1e-4, atol=1e-4)


def test_bias_and_activation_chain_in_place(monkeypatch, hits) -> None:
    x, w, b = ej.input("x", (128, 64)), ej.input("w", (64, 256)), ej.input("b", (256,))
    y = ej.relu(x @ w + b) * 0.5 - 1.0
    prog = ej.compile(y @ ej.input("w2", (256, 16)), devices=ej.local(2), backend="threads", quiet=True)
    feeds = _feeds(x=(128, 64), w=(64, 256), b=(256,), w2=(256, 16))
    off = _run(prog, feeds, False, monkeypatch, hits)
    on = _run(prog, feeds, True, monkeypatch, hits)
    assert hits and all(hits)
    assert all(np.array_equal(a, c) for a, c in zip(on, off))
    want = (np.maximum(feeds["x"] @ feeds["w"] + feeds["b"], 0) * 0.5 - 1.0) @ feeds["w2"]
    np.testing.assert_allclose(on[0], want, rtol=1e-4, atol=1e-4)


def test_a_block_read_twice_or_returned_is_never_donated(monkeypatch, hits) -> None:
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    h = x @ w
    prog = ej.compile([ej.relu(h), h, ej.exp(x)], devices=ej.local(2), backend="threads", quiet=True)
    assert fi.donations(prog.taskgraph, prog.decomps) == {}  # h is an output; x a feed
    feeds = _feeds(x=(64, 32), w=(32, 48))
    outs = _run(prog, feeds, True, monkeypatch, hits)
    hh = feeds["x"] @ feeds["w"]
    np.testing.assert_allclose(outs[1], hh, rtol=1e-5, atol=1e-5)
    assert np.array_equal(outs[0], np.maximum(outs[1], 0))


def test_a_donor_something_else_holds_is_not_written() -> None:
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    prog = ej.compile(ej.relu(x @ w) @ ej.input("v", (48, 8)), devices=1, backend="sync", quiet=True)
    (d,) = fi.donations(prog.taskgraph, prog.decomps).values()
    block = RNG.standard_normal(d.shape, dtype=np.float32)
    keep = block.copy()
    view = block[:2]  # something else sees the block
    assert d({d.value: block}) is None and np.array_equal(block, keep)
    del view
    store = {d.value: RNG.standard_normal(d.shape, dtype=np.float32)}
    want = np.maximum(store[d.value], 0)
    kept = store[d.value]  # held elsewhere too
    assert d(store) is None and not np.array_equal(kept, want)
    del kept
    got = d(store)  # the store alone holds it: written in place
    assert got is store[d.value] and np.array_equal(got, want)


def test_a_reshaped_view_is_written_only_when_its_array_is_held_by_it_alone() -> None:
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 48))
    prog = ej.compile(ej.relu(x @ w) @ ej.input("v", (48, 8)), devices=1, backend="sync", quiet=True)
    (d,) = fi.donations(prog.taskgraph, prog.decomps).values()
    flat = RNG.standard_normal(64 * 48, dtype=np.float32)
    want = np.maximum(flat, 0).reshape(d.shape)
    store = {d.value: flat.reshape(d.shape)}  # a view of flat, which the test still holds
    assert d(store) is None and not np.array_equal(store[d.value], want)
    del flat
    got = d(store)
    assert got is store[d.value] and np.array_equal(got, want)
    half = {d.value: RNG.standard_normal((2, 64, 48), dtype=np.float32)[0]}  # a view of part of an array
    assert d(half) is None
