"""Hostile review of issue 19's program state (``ej.compile(..., state=..., deterministic=...)``,
``prog.read_state`` / ``write_state`` / ``has_state``): bad writes and re-feeds leave the state
as it was, nothing aliases the caller's arrays, a cancelled first run leaves no state, int64 /
bool / float64 / 0-d state, bit-identical deterministic runs across backends and fresh programs,
four devices under memory caps (down to a 100-byte cap), and concurrent run / write_state /
read_state without a torn state. A toy least-squares step is checked against numpy doing the
same steps (tests/test_state.py's graph)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import einjoin as ej
from einjoin.errors import EinjoinError
from tests.test_state import _batches, _init, _np_step, _np_train, _step_graph


def _steps(prog, batches, W, B):
    return [float(prog.run(x=X, y=Y, w=W, b=B)[0]) if i == 0 else float(prog.run(x=X, y=Y)[0])
            for i, (X, Y) in enumerate(batches)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bad_refeeds_and_writes_leave_the_state_and_name_the_input():
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 2, state=state, quiet=True)
    (X, Y), (W, B) = _batches(1)[0], _init()
    prog.run(x=X, y=Y, w=W, b=B)
    before = prog.read_state()
    bad = [
        (lambda: prog.run(x=X, y=Y, w=np.ones((6, 8), np.float32)), ej.ShapeError, r"'w'.*\(8, 6\)"),
        (lambda: prog.run(x=X, y=Y, w=W.astype(np.float64) + 1e-12), ej.DTypeError, "'w'.*float32"),
        (lambda: prog.write_state({"w": np.ones((6, 8), np.float32)}), ej.ShapeError, "'w'"),
        (lambda: prog.write_state({"b": np.ones(6, np.int64)}), ej.DTypeError, "'b'.*int64"),
        (lambda: prog.write_state({"x": X}), EinjoinError, "'x' is not a state input"),
        (lambda: prog.write_state([W]), EinjoinError, "mapping"),
        (lambda: prog.read_state(["w", "nope"]), EinjoinError, "'nope'"),
        (lambda: prog.run(x=X, y=np.ones((3, 3), np.float32)), ej.ShapeError, "'y'"),
    ]
    for make, err, match in bad:
        with pytest.raises(err, match=match):
            make()
        assert _same(prog.read_state(), before)
    # the state still steps as numpy from where it was
    _, Wn, Bn = _np_step(X, Y, before["w"], before["b"])
    prog.run(x=X, y=Y)
    np.testing.assert_allclose(prog.read_state("w")["w"], Wn, rtol=1e-4, atol=1e-5)
    assert prog.read_state(("b",)).keys() == {"b"}


def test_nothing_aliases_the_callers_arrays():
    x, y, w, b, loss, state = _step_graph()
    (X, Y), (W, B) = _batches(1)[0], _init()
    keep = {k: v.copy() for k, v in dict(X=X, Y=Y, W=W, B=B).items()}
    for devices in (1, 2):
        prog = ej.compile([loss], devices, state=state, quiet=True)
        prog.run(x=X, y=Y, w=W, b=B)
        for k, v in dict(X=X, Y=Y, W=W, B=B).items():  # fed arrays are never written
            np.testing.assert_array_equal(v, keep[k], err_msg=k)
        s1 = prog.read_state()
        W[:] = 7.0  # mutating what was fed after the run changes nothing
        assert _same(prog.read_state(), s1)
        W[:] = keep["W"]
        mine = np.full((8, 6), 0.5, np.float32)
        prog.write_state({"w": mine})
        mine[:] = 99.0  # write_state copies
        assert float(prog.read_state("w")["w"].max()) == 0.5
        got = prog.read_state()
        got["w"][:] = -1.0  # read_state copies
        assert float(prog.read_state("w")["w"].max()) == 0.5
    # an unchanged state ({c: c}) fed once: the caller's array is still not the state
    c = ej.input("c", (4,))
    prog = ej.compile([c * 2.0], 2, state={c: c}, quiet=True)
    C = np.arange(4, dtype=np.float32)
    prog.run(c=C)
    C[:] = -5.0
    np.testing.assert_array_equal(prog.run()[0], np.arange(4, dtype=np.float32) * 2)


def test_cancelled_or_partial_first_run_leaves_no_state():
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 2, state=state, quiet=True)
    (X, Y), (W, B) = _batches(1)[0], _init()
    tok = ej.runtime.CancelToken()
    tok.cancel()
    with pytest.raises(EinjoinError, match="cancelled"):
        prog.run(x=X, y=Y, w=W, b=B, cancel=tok)
    assert not prog.has_state()
    with pytest.raises(EinjoinError, match="'w', 'b' have no value yet"):
        prog.run(x=X, y=Y)
    with pytest.raises(EinjoinError, match="'b' have no value yet"):
        prog.run(x=X, y=Y, w=W)
    prog.write_state({"w": W})
    assert not prog.has_state()
    with pytest.raises(EinjoinError, match="'b' has no value yet"):
        prog.read_state()
    np.testing.assert_array_equal(prog.read_state("w")["w"], W)
    prog.write_state({"b": B})
    assert prog.has_state()
    ref = prog.run_reference(x=X, y=Y)  # the oracle reads the state and leaves it
    got = prog.run(x=X, y=Y)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[0], _np_step(X, Y, W, B)[0], rtol=1e-4)


@pytest.mark.parametrize("backend", ["threads", "sync"])
def test_a_run_cancelled_midway_or_async_keeps_a_whole_state(backend):
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 3, state=state, backend=backend, quiet=True)
    (X, Y), (W, B) = _batches(1)[0], _init()
    prog.run(x=X, y=Y, w=W, b=B)
    before = prog.read_state()
    tok = ej.runtime.CancelToken()

    class CancelAfter:
        n = 0

        def on_start(self, task):
            self.n += 1
            if self.n == 25:  # a third of the way in: some new state blocks already exist
                tok.cancel()

        def on_end(self, task, start, end):
            pass

    with pytest.raises(EinjoinError, match="cancelled"):
        prog.run(x=X, y=Y, cancel=tok, callbacks=[CancelAfter()])
    assert _same(prog.read_state(), before)
    handle = prog.run_async(x=X, y=Y)
    handle.cancel()
    try:
        handle.result()
    except EinjoinError as e:
        assert "cancelled" in str(e)
    st = prog.read_state()
    _, Wn, Bn = _np_step(X, Y, before["w"], before["b"])
    if not _same(st, before):  # the cancel came too late: then exactly one whole step
        np.testing.assert_allclose(st["w"], Wn, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(st["b"], Bn, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_outputs_never_alias_blocks_a_later_run_reuses(devices):
    # returned arrays stay as they were after later runs, writing into them touches no state,
    # and an output is never a view of a fed array (zero-copy loads and moves, reused memory)
    x, y, w, b, loss, state = _step_graph()
    new_w = next(iter(state))
    prog = ej.compile([loss, new_w, x * 2.0], devices, state=state, quiet=True)
    batches, (W, B) = _batches(3), _init()
    first = prog.run(x=batches[0][0], y=batches[0][1], w=W, b=B)
    kept = [np.array(a, copy=True) for a in first]
    last = None
    for X, Y in batches[1:]:
        last = prog.run(x=X, y=Y)
    for a, k in zip(first, kept):
        np.testing.assert_array_equal(a, k)
    st = prog.read_state()
    for a in last:
        a[...] = 5.0
    assert _same(prog.read_state(), st)
    X = batches[0][0].copy()
    out = prog.run(x=X, y=batches[0][1])
    X[:] = 3.0
    np.testing.assert_allclose(out[2], batches[0][0] * 2.0)


@pytest.mark.parametrize("planner", ["auto", "split_largest", "single"])
@pytest.mark.parametrize("devices", [1, 3])
def test_state_that_swaps_rotates_or_resets_reads_the_old_values(devices, planner):
    # new values computed from other state inputs: every new value reads the OLD values (no
    # block is overwritten before all its readers ran, whatever moves are zero-copy)
    a, b, s = ej.input("a", (6,)), ej.input("b", (6,)), ej.input("s", (6,))
    A, Bv, S = np.zeros(6, np.float32), np.ones(6, np.float32), np.full(6, 2.0, np.float32)
    swap = ej.compile([(a * 1.0).sum()], devices, planner=planner, state={b * 2.0: a, a * 2.0: b}, quiet=True)
    swap.run(a=A, b=Bv)
    st = swap.read_state()
    np.testing.assert_array_equal(st["a"], Bv * 2)
    np.testing.assert_array_equal(st["b"], A * 2)
    swap.run()
    np.testing.assert_array_equal(swap.read_state()["b"], Bv * 4)
    rot = ej.compile([s.sum()], devices, planner=planner, state={b + 0.0: a, s * 1.0: b, a + 1.0: s}, quiet=True)
    rot.run(a=A, b=Bv, s=S)
    rot.run()
    st = rot.read_state()
    np.testing.assert_array_equal(st["a"], S)        # a <- b <- s
    np.testing.assert_array_equal(st["b"], A + 1)    # b <- s <- a + 1
    np.testing.assert_array_equal(st["s"], Bv + 1)   # s <- a + 1 <- b + 1
    reset = ej.compile([a.sum()], devices, planner=planner, state={ej.zeros((6,)): a}, quiet=True)
    assert [float(reset.run(a=Bv)[0]), float(reset.run()[0])] == [6.0, 0.0]
    with pytest.raises(EinjoinError, match="is the state input 'b' itself"):
        ej.compile([a.sum()], devices, planner=planner, state={b: a, a: b}, quiet=True)


def test_null_backend_state_is_tracked_but_never_read():
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 3, backend="null", state=state, quiet=True)
    (X, Y), (W, B) = _batches(1)[0], _init()
    with pytest.raises(EinjoinError, match="'w', 'b' have no value yet"):
        prog.run(x=X, y=Y)
    prog.write_state({"w": W, "b": B})
    assert prog.has_state()
    assert prog.run(x=X, y=Y) is None
    assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes + W.nbytes + B.nbytes  # written: loaded once
    prog.run(x=X, y=Y)
    assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes
    with pytest.raises(EinjoinError, match="null backend computes no values"):
        prog.read_state()


@pytest.mark.parametrize("devices", [1, 3])
def test_int_bool_float64_and_scalar_state(devices):
    cnt, acc, m = ej.input("cnt", (), "int64"), ej.input("acc", (5,), "float64"), ej.input("m", (5,), "bool")
    v = ej.input("v", (5,), "float64")
    prog = ej.compile([acc.sum()], devices, state={cnt + 1: cnt, acc + v * 0.1: acc, ej.logical_not(m): m},
                      quiet=True)
    mask = np.array([True, False, True, True, False])
    prog.run(v=np.ones(5), cnt=np.array(0), acc=np.zeros(5), m=mask)
    for _ in range(4):
        prog.run(v=np.ones(5))
    st = prog.read_state()
    assert st["cnt"].dtype == np.int64 and int(st["cnt"]) == 5
    assert st["acc"].dtype == np.float64
    want = np.zeros(5)
    for _ in range(5):
        want = want + np.ones(5) * 0.1  # float64 kept float64: the same roundings as numpy
    np.testing.assert_array_equal(st["acc"], want)
    np.testing.assert_array_equal(st["m"], ~mask)


def test_deterministic_is_bit_identical_across_backends_and_fresh_programs():
    x, y, w, b, loss, state = _step_graph()
    batches, (W, B) = _batches(4), _init()
    want, Wn, _ = _np_train(batches, W, B)
    for planner in ("auto", "zero", "data_parallel"):
        runs = []
        for backend in ("threads", "sync", "threads"):
            prog = ej.compile([loss], 4, planner=planner, backend=backend, state=state, deterministic=True,
                              quiet=True)
            runs.append((_steps(prog, batches, W, B), prog.read_state()))
        np.testing.assert_allclose(runs[0][0], want, rtol=1e-4)
        for losses, st in runs[1:]:
            assert losses == runs[0][0], planner
            assert _same(st, runs[0][1]), planner


@pytest.mark.parametrize("planner", ["auto", "zero", "data_parallel", "split_largest"])
def test_four_devices_under_memory_caps(planner):
    x, y, w, b, loss, state = _step_graph()
    batches, (W, B) = _batches(3), _init()
    want, Wn, Bn = _np_train(batches, W, B)
    for cap in (3000, 100):
        prog = ej.compile([loss], 4, planner=planner, state=state, memory_limit=cap, quiet=True)
        np.testing.assert_allclose(_steps(prog, batches, W, B), want, rtol=1e-4)
        st = prog.read_state()
        np.testing.assert_allclose(st["w"], Wn, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(st["b"], Bn, rtol=1e-4, atol=1e-5)
        X, Y = batches[-1]
        assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes  # state reloads are counted apart


def test_concurrent_run_write_and_read_never_tear_the_state():
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 2, state=state, quiet=True)
    (X, Y), (W, B) = _batches(1)[0], _init()
    prog.write_state({"w": W, "b": B})
    errors, reads = [], []

    def guard(fn):
        def body():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(e)
        return body

    def writer():
        for _ in range(8):
            prog.write_state({"w": W, "b": B})

    def reader():
        for _ in range(8):
            reads.append(prog.read_state())

    threads = [threading.Thread(target=guard(f)) for f in
               (writer, reader, lambda: [prog.run(x=X, y=Y) for _ in range(6)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # every state seen is (W, B) after some whole number of steps: never w of one and b of another
    chain = [(W, B)]
    for _ in range(6):
        chain.append(_np_step(X, Y, *chain[-1])[1:])
    for st in [*reads, prog.read_state()]:
        k = int(np.argmin([np.abs(st["w"] - cw).max() for cw, _ in chain]))
        np.testing.assert_allclose(st["w"], chain[k][0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(st["b"], chain[k][1], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_ray_state_survives_a_bad_feed_and_caps_are_refused_clearly(ray_session):
    pytest.importorskip("ray")
    x, y, w, b, loss, state = _step_graph()
    batches, (W, B) = _batches(3), _init()
    want, Wn, _ = _np_train(batches, W, B)
    with pytest.raises(EinjoinError, match="memory caps are not supported on the Ray backend"):
        ej.compile([loss], 3, backend="ray", state=state, memory_limit=3000, quiet=True)
    with ej.compile([loss], 3, backend="ray", state=state, deterministic=True, quiet=True) as prog:
        X0, Y0 = batches[0]
        prog.run(x=X0, y=Y0, w=W, b=B)
        before = prog.read_state()
        with pytest.raises(ej.ShapeError):
            prog.run(x=X0, y=np.ones((2, 2), np.float32))
        assert _same(prog.read_state(), before)
        losses = [float(prog.run(x=X, y=Y)[0]) for X, Y in batches[1:]]
        np.testing.assert_allclose(losses, want[1:], rtol=1e-4)
        np.testing.assert_allclose(prog.read_state()["w"], Wn, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("planner", ["megatron", "eindecomp", "mesh_ilp", "zero", "data_parallel", "auto"])
def test_adamw_mlp_state_under_every_planner_matches_torch(planner):
    # a whole AdamW step (parameters, both moments, the step count as state) on 2 and 4 devices
    import torch

    x, y = ej.input("x", (16, 8)), ej.input("y", (16, 4))
    ps = {"w1": ej.param("w1", (8, 32)), "w2": ej.param("w2", (32, 4))}
    loss = ej.mse_loss((x @ ps["w1"]).relu() @ ps["w2"], y)
    up = ej.optim.AdamW(lr=1e-2).update(ps, dict(zip(ps, ej.grad(loss, list(ps.values())))))
    state = {up.params[n]: ps[n] for n in ps}
    state.update({up.state_out[k]: up.state_in[k] for k in up.state_in})
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    W1 = (rng.standard_normal((8, 32)) * 0.3).astype(np.float32)
    W2 = (rng.standard_normal((32, 4)) * 0.3).astype(np.float32)
    tw = [torch.tensor(W1, requires_grad=True), torch.tensor(W2, requires_grad=True)]
    opt = torch.optim.AdamW(tw, lr=1e-2, foreach=False)
    want = []
    for _ in range(4):
        opt.zero_grad()
        t_loss = torch.nn.functional.mse_loss(torch.relu(torch.tensor(X) @ tw[0]) @ tw[1], torch.tensor(Y))
        t_loss.backward()
        opt.step()
        want.append(t_loss.item())
    for devices in (2, 4):
        prog = ej.compile([loss], devices, planner=planner, state=state, deterministic=True, quiet=True)
        first = {"w1": W1, "w2": W2, **up.init_state()}
        got = [float(prog.run(x=X, y=Y, **up.hyper_values(), **(first if i == 0 else {}))[0]) for i in range(4)]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        st = prog.read_state()
        np.testing.assert_allclose(st["w1"], tw[0].detach().numpy(), rtol=1e-5, atol=1e-6)
        assert float(st["step"]) == 4.0
        assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes + 8  # the batch and the lr


@pytest.mark.parametrize("devices", [1, 2])
def test_the_old_and_new_value_as_outputs_are_copies(devices):
    # outputs [w, new w]: the old value as fed or resident, the new one as computed; writing into
    # either touches neither the state nor the caller's array
    w, c = ej.input("w", (4, 3)), ej.input("c", (3,))
    new = w * 2.0 + c
    prog = ej.compile([w, new], devices, state={new: w}, quiet=True)
    W, C = np.ones((4, 3), np.float32), np.arange(3, dtype=np.float32)
    old, fresh = prog.run(w=W, c=C)
    np.testing.assert_array_equal(old, W)
    np.testing.assert_array_equal(fresh, W * 2 + C)
    old[:] = -9.0
    fresh[:] = -9.0
    np.testing.assert_array_equal(W, np.ones((4, 3), np.float32))
    np.testing.assert_array_equal(prog.read_state()["w"], W * 2 + C)
    old2, fresh2 = prog.run(c=C)
    np.testing.assert_array_equal(old2, W * 2 + C)
    np.testing.assert_array_equal(fresh2, (W * 2 + C) * 2 + C)
