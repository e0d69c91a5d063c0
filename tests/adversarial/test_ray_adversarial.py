"""The Ray backend under adversarial use (issue 16, items 1 and 3, and Ray's absence):

- 8 threads running one Ray program at once with different feeds each get what serial runs
  give (each run has its own namespace on the actors; they used to share one store and feeds);
- cancellation belongs to one run: a token cancelled before the run submits nothing, one
  cancelled mid-run raises at once, drops the run's namespace and leaves the program usable;
- an actor killed between runs is replaced before the next run (which used to raise a raw
  RayActorError for ever), and an actor killed while several runs are in flight is replaced
  once, every run completing on the fresh actors;
- a kernel that raises fails its own run only (named), not a concurrent one, and keeps the actors;
- programs of different shapes (device count, or the nodes of the devices) sharing one backend
  each keep their own actors, run at once without replacing each other's (they used to kill
  each other's actors on every switch), and run on the nodes their cluster names;
- close() during a run fails that run with an EinjoinError instead of being undone by its
  recovery, and a program compiled after it starts fresh actors while it plans; a Ctrl-C
  landing in a run's cleanup does not leave the run counted in flight;
- ray.shutdown() or a Ray restart between runs: the next run starts fresh actors (it used to
  raise a raw ``Exception: Failed to submit task`` for ever), one keeper thread for every re-init;
- the plans of programs that are gone are dropped from the actors;
- hostile arguments to RayBackend, RayBackend.warm and ray_cluster are EinjoinErrors naming the
  argument;
- without Ray installed, nothing is printed at exit and backend='ray' says it needs Ray.

Results are compared with ``ej.reference``; no timing is asserted (time bounds only catch hangs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej

pytestmark = pytest.mark.xdist_group("ray")

try:  # the shared interface (helper "runtime"); any object with a ``cancelled`` property works
    from einjoin.runtime.engine import CancelToken
except ImportError:  # pragma: no cover - until it lands
    class CancelToken:  # type: ignore[no-redef]
        def __init__(self) -> None:
            self._ev = threading.Event()

        def cancel(self) -> None:
            self._ev.set()

        @property
        def cancelled(self) -> bool:
            return self._ev.is_set()

HANG = 60  # seconds: only a hang gets near it
TOL = dict(rtol=1e-5, atol=1e-5)


def _graph():
    x = ej.input("x", (64, 32))
    w1, w2 = ej.param("w1", (32, 48)), ej.param("w2", (48, 32))
    return ej.softmax(ej.silu(x @ w1) @ w2)


def _feeds(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {"x": (rng.standard_normal((64, 32)) * (1 + i)).astype(np.float32),
            "w1": (rng.standard_normal((32, 48)) * 0.2).astype(np.float32),
            "w2": (rng.standard_normal((48, 32)) * 0.2).astype(np.float32)}


def _backend(**kw):
    from einjoin.runtime.backends.ray import RayBackend
    return RayBackend(quiet=True, **kw)


@pytest.fixture
def shared(ray_backend):
    """The session's backend (tests/conftest.py) for the tests that leave its actors alive:
    starting actors is most of a Ray test's time."""
    return ray_backend


def _no_open_runs(backend) -> bool:
    return all(r == [] for r in backend.open_runs())


def _wait_gone(pid: int, what: str) -> None:
    deadline = time.time() + HANG
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor pid {pid} {what}")


def _kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, "did not die")


@pytest.mark.slow  # make test-all: concurrent runs are checked on threads by default (test_concurrency)
def test_eight_concurrent_runs_of_one_ray_program_equal_serial_runs(shared):
    out = _graph()
    feeds = [_feeds(i) for i in range(8)]
    prog = ej.compile(out, devices=2, backend=shared, planner="split_largest")
    serial = [prog.run(**f) for f in feeds]
    for f, s in zip(feeds, serial):
        np.testing.assert_allclose(s, ej.reference(out, **f), **TOL)
    got: list = [None] * 8
    errors: list = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            barrier.wait(HANG)
            for _ in range(2):  # twice: runs of each thread overlap runs of the others
                got[i] = prog.run(**feeds[i])
                np.testing.assert_allclose(got[i], serial[i], rtol=1e-6, atol=1e-7)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG)
    assert not any(th.is_alive() for th in threads), "a concurrent run hung"
    assert not errors, errors[0]
    assert _no_open_runs(prog.backend)


@pytest.mark.slow  # make test-all: fresh actors; cancellation is test_concurrency's on threads
def test_cancel_before_start_submits_nothing_and_mid_run_cancel_leaves_the_program_usable(shared):
    out = _graph()
    f = _feeds(0)
    fresh = _backend()
    prog = ej.compile(out, devices=2, backend=fresh, planner="split_largest")
    values = prog._bind((), f)
    tok = CancelToken()
    tok.cancel()
    with pytest.raises(ej.EinjoinError, match="run cancelled before it started"):
        prog._engine.run(values, fresh, cancel=tok, cluster=prog.cluster)
    assert fresh.actors == []  # no run reached actors (compiling with Ray up may start them: warm)

    backend = shared
    # kernels sleep 0.5 s each, a device runs several in a row: 1 s in, the run is mid-way (with
    # actors that hold their part of the plan, a run of 0.2 s kernels could end before 1 s)
    backend.kernel_delay = 0.5
    prog = ej.compile(out, devices=2, backend=backend, planner="split_largest")
    try:
        tok = CancelToken()
        threading.Timer(1.0, tok.cancel).start()
        t0 = time.time()
        with pytest.raises(ej.EinjoinError, match="run cancelled with [1-9][0-9]* of"):
            prog._engine.run(values, backend, cancel=tok, cluster=prog.cluster)
        assert time.time() - t0 < HANG
        assert _no_open_runs(backend)  # its namespace is gone on every actor
        # through the Program: cancelling one of two concurrent runs leaves the other correct
        f2 = _feeds(2)
        victim, other = prog.run_async(**f), prog.run_async(**f2)
        threading.Timer(0.5, victim.cancel).start()
        with pytest.raises(ej.EinjoinError, match="run cancelled"):
            victim.result(HANG)
        np.testing.assert_allclose(other.result(HANG), ej.reference(out, **f2), **TOL)
        assert _no_open_runs(backend)
        backend.kernel_delay = 0.0
        tok = CancelToken()  # a fresh token: the program runs again, on the same actors
        pids = list(backend.pids)
        outs, _ = prog._engine.run(values, backend, cancel=tok, cluster=prog.cluster)
        np.testing.assert_allclose(outs[0], ej.reference(out, **f), **TOL)
        assert backend.pids == pids
    finally:
        backend.kernel_delay = 0.0


def test_actor_killed_between_runs_is_replaced_before_the_next_run(shared):
    out = _graph()
    f = _feeds(1)
    backend = shared
    prog = ej.compile(out, devices=2, backend=backend, planner="split_largest")
    np.testing.assert_allclose(prog.run(**f), ej.reference(out, **f), **TOL)
    old, gen = list(backend.pids), backend.generation
    _kill_and_wait(old[1])
    backend.retries = 0  # found on the run's own first call, not by a ping: replacing it is no retry
    try:
        for i in range(2):  # used to raise RayActorError from ray.get(begin) on every later run
            np.testing.assert_allclose(prog.run(**_feeds(i)), ej.reference(out, **_feeds(i)), **TOL)
            assert prog.run_stats.recoveries == 0  # found before the run: no re-run was needed
    finally:
        backend.retries = 1
    assert old[1] not in backend.pids and len(backend.pids) == 2 and backend.generation == gen + 1
    assert _no_open_runs(backend)


@pytest.mark.slow  # make test-all: a killed actor is test_ray's
def test_actor_killed_while_four_runs_are_in_flight_is_replaced_once(ray_session):
    out = _graph()
    feeds = [_feeds(i) for i in range(4)]
    backend = _backend(kernel_delay=0.08, retries=1)
    with ej.compile(out, devices=2, backend=backend, planner="split_largest") as prog:
        prog.run(**feeds[0])  # actors up
        gen, victim = backend.generation, backend.pids[0]
        got: list = [None] * 4
        errors: list = []
        started = threading.Barrier(5)

        def worker(i: int) -> None:
            try:
                started.wait(HANG)
                got[i] = prog.run(**feeds[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append((i, e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        started.wait(HANG)
        time.sleep(0.5)  # every run has kernels queued (7 per device and run, each sleeps 0.08 s)
        _kill_and_wait(victim)
        for th in threads:
            th.join(HANG)
        assert not any(th.is_alive() for th in threads), "a run hung after the actor died"
        assert not errors, errors[0]
        for f, g in zip(feeds, got):
            np.testing.assert_allclose(g, ej.reference(out, **f), **TOL)
        # one loss, one replacement, however many runs saw it
        assert backend.generation == gen + 1 and victim not in backend.pids
        backend.kernel_delay = 0.0
        np.testing.assert_allclose(prog.run(**feeds[1]), ej.reference(out, **feeds[1]), **TOL)
        assert _no_open_runs(backend)


def test_a_failing_kernel_fails_its_run_only_and_keeps_the_actors(shared):
    t = ej.param("t", (10, 4))
    i = ej.input("i", (6,), dtype="int64")
    out = ej.gather(t, i) * 2.0
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    good, bad = np.array([0, 1, 2, 3, 4, 9]), np.array([0, 1, 2, 3, 4, 99])
    backend = shared
    prog = ej.compile(out, devices=2, backend=backend)
    np.testing.assert_allclose(prog.run(i=good, t=table), table[good] * 2)
    pids = list(backend.pids)
    results: dict = {}

    def worker(name, idx):
        try:
            results[name] = prog.run(i=idx, t=table)
        except BaseException as e:  # noqa: BLE001 - checked below
            results[name] = e

    threads = [threading.Thread(target=worker, args=a) for a in (("bad", bad), ("good", good))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(HANG)
    assert isinstance(results["bad"], ej.EinjoinError), results["bad"]
    assert "gather" in str(results["bad"]) and "99" in str(results["bad"]) and "task #" in str(results["bad"])
    np.testing.assert_allclose(results["good"], table[good] * 2)
    assert backend.pids == pids  # a kernel error is not a lost device: the actors stay
    assert _no_open_runs(backend)
    np.testing.assert_allclose(prog.run(i=good[::-1].copy(), t=table), table[good[::-1]] * 2)


def _ray_get(refs):
    import ray  # only where ray_session ran: the no-Ray test below must not need it
    return ray.get(refs, timeout=HANG)


def _nodes_cluster(nodes):
    """A Cluster of CPU devices placed on the given Ray nodes (one device per entry)."""
    from einjoin.cluster import Cluster, Device, LinkMatrix
    devices = tuple(Device(i, "cpu", None, node) for i, node in enumerate(nodes))
    groups = list(nodes)
    return Cluster(devices, LinkMatrix(groups, float("inf"), 20e9, 1.25e9), LinkMatrix(groups, 0.0, 5e-6, 5e-5))


@pytest.mark.slow  # make test-all: actor sharing across device counts is test_ray's
def test_programs_of_different_shapes_share_a_backend_without_replacing_each_others_actors(shared):
    out = _graph()
    backend = shared
    backend.retries = 0  # a run that lost its actors fails instead of hiding it in a re-run
    try:
        p2 = ej.compile(out, devices=2, backend=backend, planner="split_largest")
        p1 = ej.compile(out, devices=1, backend=backend, planner="split_largest")
        p2.run(**_feeds(0))
        gen = backend.generation
        for p in (p1, p2, p1):  # each switch of shape used to kill the other shape's actors
            np.testing.assert_allclose(p.run(**_feeds(0)), ej.reference(out, **_feeds(0)), **TOL)
        assert backend.generation <= gen + 1  # the 1-device pool, started once
        gen = backend.generation
        backend.kernel_delay = 0.02
        handles = [(i, (p2, p1)[i % 2].run_async(**_feeds(i))) for i in range(6)]
        for i, h in handles:
            np.testing.assert_allclose(h.result(HANG), ej.reference(out, **_feeds(i)), **TOL)
            assert h.stats.recoveries == 0
        assert backend.generation == gen and _no_open_runs(backend)
        # same count, other nodes: actors of their own, on the nodes the cluster names
        backend.kernel_delay = 0.0
        head, second = sorted({d.node for d in ej.ray_cluster(devices_per_node=1).devices})
        for nodes in ((second,), (head,)):
            p = ej.compile(out, devices=_nodes_cluster(nodes), backend=backend, planner="split_largest")
            np.testing.assert_allclose(p.run(**_feeds(1)), ej.reference(out, **_feeds(1)), **TOL)
            assert _ray_get([a.node.remote() for a in backend.actors]) == list(nodes)
    finally:
        backend.kernel_delay, backend.retries = 0.0, 1


def test_close_during_a_run_fails_that_run_and_is_not_undone(shared):
    out = _graph()
    backend = shared
    prog = ej.compile(out, devices=2, backend=backend, planner="split_largest")
    prog.run(**_feeds(0))
    pids = backend.pids
    backend.kernel_delay, backend.retries = 0.1, 2
    try:
        h = prog.run_async(**_feeds(1))
        time.sleep(0.4)  # kernels are queued (each sleeps 0.1 s)
        backend.close()
        # the run's recovery used to start fresh actors again, undoing close()
        with pytest.raises(ej.EinjoinError, match=r"close\(\)"):
            h.result(HANG)
        assert backend.actors == [] and backend._in_flight == 0
        for pid in pids:
            _wait_gone(pid, "still alive after close()")
    finally:
        backend.kernel_delay, backend.retries = 0.0, 1
    # compiling with Ray up starts the actors while it plans (RayBackend.warm): the run takes them
    again = ej.compile(out * 2.0, devices=2, backend=backend, planner="split_largest")
    warmed = backend._pools[(2, (None, None))]
    assert backend.actors == [] and len(warmed.actors) == 2  # started, and no run yet
    np.testing.assert_allclose(again.run(**_feeds(2)), ej.reference(out * 2.0, **_feeds(2)), **TOL)
    assert backend.actors == warmed.actors and not set(pids) & set(backend.pids)
    np.testing.assert_allclose(prog.run(**_feeds(2)), ej.reference(out, **_feeds(2)), **TOL)
    assert backend.actors == warmed.actors


def test_a_second_ctrl_c_during_cleanup_leaves_no_run_in_flight(shared, monkeypatch):
    from einjoin.runtime.backends import ray as ej_ray
    out = _graph()
    prog = ej.compile(out, devices=2, backend=shared, planner="split_largest")
    prog.run(**_feeds(0))

    def interrupted(*a, **k):  # Ctrl-C while waiting, then again while the run is cleaned up
        raise KeyboardInterrupt

    monkeypatch.setattr(ej_ray._RaySession, "_wait", interrupted)  # the run's session waits
    shared._abandon = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            prog.run(**_feeds(1))
    finally:
        del shared._abandon
        monkeypatch.undo()
    assert shared._in_flight == 0  # used to stay 1: decremented only after the cleanup
    np.testing.assert_allclose(prog.run(**_feeds(2)), ej.reference(out, **_feeds(2)), **TOL)


def test_plans_of_programs_that_are_gone_are_dropped_from_the_actors(shared):
    import gc
    out = _graph()
    keep = ej.compile(out, devices=2, backend=shared, planner="split_largest")
    gc.collect()  # earlier tests' programs: gone before the count
    keep.run(**_feeds(0))
    before = _ray_get([a.__ray_call__.remote(lambda worker: sorted(worker.plans)) for a in shared.actors])
    for i in range(3):
        p = ej.compile(out * float(i + 2), devices=2, backend=shared, planner="split_largest")
        p.run(**_feeds(i))
        del p
        gc.collect()
    keep.run(**_feeds(1))
    after = _ray_get([a.__ray_call__.remote(lambda worker: sorted(worker.plans)) for a in shared.actors])
    assert [len(k) for k in after] == [len(k) for k in before]  # used to grow by one per program


RESTART = r"""
import threading, numpy as np, ray, einjoin as ej
from einjoin.runtime.backends.ray import RayBackend
x = ej.input("x", (16, 8)); w = ej.param("w", (8, 4))
X, W = np.arange(128, dtype=np.float32).reshape(16, 8), np.ones((8, 4), np.float32)
prog = ej.compile((x @ w).relu(), devices=2, backend=RayBackend(quiet=True, retries=0), quiet=True)
def run():
    box = []
    def target():
        try:
            box.append(prog.run(X, W))
        except BaseException as e:
            box.append(e)
    th = threading.Thread(target=target)  # Ray starts on the keeper thread, not this one
    th.start(); th.join(120)
    if isinstance(box[0], BaseException):
        raise box[0]
    np.testing.assert_allclose(box[0], np.maximum(X @ W, 0))
run()
ray.shutdown()          # the user's: every actor and object ref of the backend is gone
run()                   # used to raise a raw Exception('Failed to submit task ...') for ever
ray.shutdown()
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # the user's new Ray
np.testing.assert_allclose(prog.run(X, W), np.maximum(X @ W, 0))
keepers = [t for t in threading.enumerate() if t.name == "einjoin-ray-keeper"]
assert len(keepers) == 1, keepers   # one keeper for both inits from worker threads
prog.close()
print("OK")
"""


@pytest.mark.slow  # make test-all: restarts Ray twice; actor loss and replacement are test_ray's
def test_the_program_recovers_after_ray_shutdown_or_a_ray_restart(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    res = subprocess.run([sys.executable, "-c", RESTART], capture_output=True, text=True, env=env,
                         timeout=240, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]


HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True),
                   st.text(max_size=3), st.lists(st.integers(), max_size=2), st.just(object()))


def _is_int(v, least):
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _is_num(v, positive=False, finite=True):
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
            and (v > 0 if positive else v >= 0) and (not finite or v != float("inf")))


BACKEND_ARGS = {"num_cpus": lambda v: _is_int(v, 1), "retries": lambda v: _is_int(v, 0),
                "object_store_memory": lambda v: v is None or _is_int(v, 1),
                "actor_cpus": _is_num, "kernel_delay": _is_num}
CLUSTER_ARGS = {"devices_per_node": lambda v: v is None or _is_int(v, 1),
                "address": lambda v: v is None or isinstance(v, str),
                "intra_node": lambda v: _is_num(v, True, False), "inter_node": lambda v: _is_num(v, True, False)}


@settings(max_examples=examples(60), deadline=None)
@given(name=st.sampled_from(sorted(BACKEND_ARGS)), value=HOSTILE)
def test_hostile_ray_backend_arguments_are_named(name, value):
    from einjoin.runtime.backends.ray import RayBackend
    try:
        RayBackend(quiet=True, **{name: value})
    except ej.EinjoinError as e:
        assert name in str(e) and not BACKEND_ARGS[name](value)
    else:
        assert BACKEND_ARGS[name](value), f"RayBackend({name}={value!r}) was accepted"


@settings(max_examples=examples(40), deadline=None)
@given(value=HOSTILE)
def test_hostile_warm_devices_are_named(value):
    from einjoin.runtime.backends.ray import RayBackend
    if _is_int(value, 1):  # a valid count would start actors where Ray is up
        return
    with pytest.raises(ej.EinjoinError, match="devices"):
        RayBackend(quiet=True).warm(value)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CLUSTER_ARGS)), value=HOSTILE)
def test_hostile_ray_cluster_arguments_are_named(ray_session, name, value):
    try:
        cluster = ej.ray_cluster(**{name: value})  # a running Ray: an address is not used
    except ej.EinjoinError as e:
        assert name in str(e) and not CLUSTER_ARGS[name](value)
    else:
        assert CLUSTER_ARGS[name](value), f"ray_cluster({name}={value!r}) was accepted"
        assert cluster.size >= 1


NO_RAY = r"""
import sys
sys.modules["ray"] = None          # as if Ray were not installed: `import ray` raises ImportError
import numpy as np, einjoin as ej
x = ej.input("x", (8, 4)); w = ej.param("w", (4, 6))
out = ej.compile((x @ w).relu(), devices=2, backend="threads").run(np.ones((8, 4), np.float32),
                                                                   np.ones((4, 6), np.float32))
assert float(out[0, 0]) == 4.0
for make in (lambda: ej.compile(x @ w, devices=2, backend="ray"), lambda: ej.ray_cluster()):
    try:
        make()
    except ej.EinjoinError as e:
        assert "needs Ray" in str(e) and "pip install" in str(e), e
    else:
        raise AssertionError("backend='ray' without Ray did not raise")
print("OK")
"""


def test_without_ray_nothing_is_printed_at_exit_and_ray_backend_says_it_needs_ray(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    res = subprocess.run([sys.executable, "-c", NO_RAY], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr[-3000:]
    assert res.stderr == ""  # the exit hook used to raise EinjoinError('needs Ray'): a traceback
