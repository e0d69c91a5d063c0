"""Programs with state on the Ray backend: state blocks stay in the actors' stores between runs
(the driver keeps only keys), only the batch is loaded after the first step, read_state /
write_state / re-feed, a failed run keeps the state, and runs are bit-identical.

Starting actors is most of a Ray test's time: every test here shares the session's backend
(tests/conftest.py's ``ray_backend``, a pool of actors per device count). A test ends by moving
its program's state to the host (``write_state(read_state())`` releases the blocks on the
actors), so each starts with actors that keep nothing and counts every block they keep as its
own."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej
from einjoin.errors import EinjoinError

pytestmark = pytest.mark.xdist_group("ray")
ray = pytest.importorskip("ray")

from tests.test_state import _batches, _init, _np_step, _np_train, _step_graph, _train  # noqa: E402


@pytest.fixture
def shared(ray_backend):
    return ray_backend


def _kept(backend):
    return ray.get([a.kept_keys.remote() for a in backend.actors])


def _to_host(prog):
    """Move the program's state to the host: the actors keep none of its blocks after."""
    prog.write_state(prog.read_state())
    assert all(k == [] for k in _kept(prog.backend))


# on one device the three planners choose the same program (the same decompositions, 21 tasks):
# one device runs once, three devices under each planner
@pytest.mark.parametrize("devices, planner", [(1, "auto"), (3, "auto"),  # data_parallel: make test-all
                                              pytest.param(3, "data_parallel", marks=pytest.mark.slow),
                                              (3, "zero")])
def test_ray_steps_match_numpy_and_load_only_the_batch(shared, planner, devices):
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], devices, planner=planner, backend=shared, state=state, quiet=True)
    batches = _batches(4)
    W, B = _init()
    losses = _train(prog, batches, W, B)
    want, Wn, Bn = _np_train(batches, W, B)
    np.testing.assert_allclose(losses, want, rtol=1e-4)
    X, Y = batches[-1]
    assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes
    assert prog.run_stats.bytes_fetched == 4
    st = prog.read_state()
    np.testing.assert_allclose(st["w"], Wn, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(st["b"], Bn, rtol=1e-4, atol=1e-5)
    # the replaced blocks were released: the actors keep one step's state blocks only
    kept = _kept(prog.backend)
    blocks = sum(prog.decomps[s.new].out_partition.num_blocks for s in prog.plan.state)
    assert sum(len(k) for k in kept) == blocks
    per_device = [0] * devices
    for s in prog.plan.state:
        for v in prog.taskgraph.outputs[s.output].blocks.values():
            per_device[prog.taskgraph.values[v].device] += 1
    assert [len(k) for k in kept] == per_device
    _to_host(prog)


def test_ray_write_refeed_failure_and_determinism(shared):
    x, y, w, b, loss, state = _step_graph()
    prog = ej.compile([loss], 2, backend=shared, state=state, quiet=True, deterministic=True)
    W, B = _init()
    prog.write_state({"w": W, "b": B})
    (X, Y), = _batches(1)
    prog.run(x=X, y=Y)
    assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes + W.nbytes + B.nbytes
    # a pool of another shape starting on the backend leaves the state where it is (read_state
    # used to compare the backend's latest pool generation with the state's own pool's)
    from einjoin.cluster import Cluster, Device, LinkMatrix
    node = ray.get_runtime_context().get_node_id()
    shared.warm(Cluster((Device(0, "cpu", None, node),), LinkMatrix([node], float("inf"), 1e9, 1e9),
                        LinkMatrix([node], 0.0, 0.0, 0.0)), wait=True)
    assert shared.generation != shared._pools[(2, (None, None))].generation  # a later pool's
    before = prog.read_state()
    _, Wn, Bn = _np_step(X, Y, W, B)
    np.testing.assert_allclose(before["w"], Wn, rtol=1e-4, atol=1e-5)
    tok = ej.runtime.CancelToken()
    tok.cancel()
    with pytest.raises(EinjoinError, match="cancelled"):
        prog.run(x=X, y=Y, cancel=tok)
    with pytest.raises(EinjoinError):  # a kernel fails (a feed of the wrong kind cannot: checked)
        prog.backend.kernel_delay = -1.0  # time.sleep(-1) raises in the actor
        try:
            prog.run(x=X, y=Y)
        finally:
            prog.backend.kernel_delay = 0.0
    after = prog.read_state()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    # the failed runs' new blocks were released too
    kept = _kept(prog.backend)
    assert sum(len(k) for k in kept) == sum(prog.decomps[s.new].out_partition.num_blocks
                                            for s in prog.plan.state)
    # re-feed w: loaded and counted; the rest carries on
    out = prog.run(x=X, y=Y, w=W)
    assert prog.run_stats.bytes_loaded == X.nbytes + Y.nbytes + W.nbytes
    want, Wn2, _ = _np_step(X, Y, W, Bn)
    np.testing.assert_allclose(out[0], want, rtol=1e-4)
    # deterministic: the same steps from the same state give the same bits, run after run;
    # and the threads backend's numbers (the same bits when BLAS gets as many threads)
    start = prog.read_state()
    local = ej.compile([loss], 2, state=state, quiet=True, deterministic=True)
    local.write_state(start)
    runs = []
    for _ in range(2):
        prog.write_state(start)
        runs.append([prog.run(x=Xb, y=Yb)[0] for Xb, Yb in _batches(3, seed=4)] + [prog.read_state()])
    np.testing.assert_array_equal(runs[0][:3], runs[1][:3])
    for k in start:
        np.testing.assert_array_equal(runs[0][3][k], runs[1][3][k])
    theirs = [local.run(x=Xb, y=Yb)[0] for Xb, Yb in _batches(3, seed=4)]
    np.testing.assert_allclose(runs[0][:3], theirs, rtol=1e-6)
    for k, v in local.read_state().items():
        np.testing.assert_allclose(runs[0][3][k], v, rtol=1e-6, atol=1e-7)
    _to_host(prog)
