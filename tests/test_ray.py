"""The Ray backend on the session's two-node loopback cluster: placement across nodes with the
bytes counted at the receiving actors, a killed actor, cleanup, and Ray started on demand; and
the actors' executors run in this process (no Ray) with their sends handed straight to the
peer, checked against the reference: blocks exchanged actor to actor, dependencies that move no
block (signals), concurrent runs, aborts and failing kernels.
(The conformance suite runs on Ray too: tests/test_conformance.py.)

Starting actors is most of a Ray test's time: the tests that keep their actors share the session's
backend (``shared``: tests/conftest.py's ``ray_backend``, a pool per cluster shape); the
killed-actor test, which must see every actor of its own die, has a backend of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import einjoin as ej

pytestmark = pytest.mark.xdist_group("ray")
ray = pytest.importorskip("ray")


def _mlp():
    x = ej.input("x", (256, 64))
    w1, w2 = ej.param("w1", (64, 128)), ej.param("w2", (128, 64))
    out = ej.softmax(ej.silu(x @ w1) @ w2)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((256, 64)), "w1": rng.standard_normal((64, 128)) * 0.1,
             "w2": rng.standard_normal((128, 64)) * 0.1}
    return out, {k: v.astype(np.float32) for k, v in feeds.items()}


def _alive_actor_pids(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _einjoin_actors_alive(pids):
    """The einjoin actors among ``pids`` that Ray still lists alive (the session's shared backend
    keeps actors of its own alive)."""
    import ray._private.state as state
    return [a for a in state.actors().values()
            if a["State"] == "ALIVE" and "DeviceWorker" in a.get("ActorClassName", "") and a.get("Pid") in pids]


def _wait_dead(pids, seconds=30.0):  # a hang guard, not a timing: a loaded machine is slow
    deadline = time.time() + seconds
    while time.time() < deadline and (_alive_actor_pids(pids) or _einjoin_actors_alive(pids)):
        time.sleep(0.1)
    return _alive_actor_pids(pids), _einjoin_actors_alive(pids)


@pytest.fixture
def shared(ray_backend):
    """The session's backend (tests/conftest.py) for the tests that leave its actors alive."""
    return ray_backend


@pytest.mark.slow  # make test-all: fresh actors; test_ray_adversarial kills one between runs
def test_killed_actor_completes_then_raises_and_leaves_no_actor(ray_session):
    # "none left" is checked by pid: the session's shared backend keeps actors of its own alive
    from einjoin.runtime.backends.ray import RayBackend
    out, feeds = _mlp()
    backend = RayBackend(kernel_delay=0.3, quiet=True, retries=1)
    prog = ej.compile(out, devices=2, backend=backend, planner="split_largest")
    killed, seen = [], []

    def killer():
        while not backend.pids:
            time.sleep(0.02)
        time.sleep(1.0)  # kernels are outstanding: each sleeps 0.3 s
        killed.append(backend.pids[1])
        os.kill(backend.pids[1], signal.SIGKILL)

    for retries in (1, 0):
        backend.retries = retries
        th = threading.Thread(target=killer)
        th.start()
        t0 = time.time()
        if retries:  # the inputs are reachable: fresh actors re-run the graph and the run completes
            got = prog.run(**feeds)
            np.testing.assert_allclose(got, ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
            assert prog.run_stats.recoveries == 1 and prog.run_stats.bytes_moved == prog.stats.bytes_moved
            assert killed and killed[0] not in backend.pids
            seen += backend.pids
        else:  # the replacement actors are killed in turn: no retry left
            with pytest.raises(ej.EinjoinError, match=r"device 1 .*was lost|a device was lost"):
                prog.run(**feeds)
        assert time.time() - t0 < 120  # a hang guard
        th.join()
    # the program recovers on the next run with fresh actors
    backend.kernel_delay = 0.0
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
    seen += backend.pids
    assert not set(killed) & set(backend.pids)
    prog.close()
    assert _wait_dead(killed + seen) == ([], [])


def test_ray_cluster_sees_both_nodes(ray_session):
    cluster = ej.ray_cluster(devices_per_node=2)
    assert cluster.size == 4
    nodes = [d.node for d in cluster.devices]
    assert len(set(nodes)) == 2 and nodes.count(nodes[0]) == 2
    # the topology is in the costs: cross-node links are slower
    assert cluster.bandwidth[0][1] > cluster.bandwidth[0][2]


def test_two_nodes_cross_node_bytes_match_the_plan(shared):
    # a device per node (the shape test_autodiff's gradient program shares: two actors for both)
    cluster = ej.ray_cluster(devices_per_node=1)
    out, feeds = _mlp()
    prog = ej.compile(out, devices=cluster, backend=shared, planner="split_largest")
    got = prog.run(**feeds)
    np.testing.assert_allclose(got, ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
    node = [d.node for d in cluster.devices]
    # the actors really are on the nodes their devices name
    actor_nodes = ray.get([a.node.remote() for a in prog.backend.actors])
    assert actor_nodes == node
    measured = prog.backend.received_per_pair
    planned = prog.stats.bytes_per_pair
    assert measured == {k: v for k, v in planned.items() if v}
    cross = sum(b for (s, d), b in planned.items() if node[s] != node[d])
    assert cross > 0, "the plan must span both nodes"
    assert sum(b for (s, d), b in measured.items() if node[s] != node[d]) == cross
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    assert prog.run_stats.bytes_copied == prog.run_stats.bytes_moved  # every move crosses processes
    # every task ran once, and the callbacks saw each of them with the actors' measured times
    seen = []

    class Seen:
        def on_start(self, task):
            pass

        def on_end(self, task, start, end):
            seen.append((task.id, start, end))

    prog.run(**feeds, callbacks=[Seen()])
    assert sorted(t for t, _, _ in seen) == list(range(len(prog.taskgraph)))
    assert all(s <= e for _, s, e in seen) and prog.run_stats.tasks_run == len(prog.taskgraph)


def test_kernel_errors_name_the_task(shared):
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend=shared)
    got = prog.run(**feeds)
    assert got.shape == (256, 64)
    with pytest.raises(ej.EinjoinError, match="x"):
        prog.run(**dict(feeds, x=np.ones((3, 3), np.float32)))  # checked before any kernel
    shared.kernel_delay = -1.0  # time.sleep(-1) raises in the actor: the first kernel fails
    try:
        with pytest.raises(ej.EinjoinError, match=r"task #\d+ \(kernel .*ValueError"):
            prog.run(**feeds)
    finally:
        shared.kernel_delay = 0.0
    assert all(r == [] for r in shared.open_runs())
    np.testing.assert_allclose(prog.run(**feeds), got)


@pytest.mark.slow  # make test-all: conformance[ray] runs every device count on one backend's shared actors
def test_device_counts_share_actors_and_a_loss_replaces_all_that_share_it(shared):
    # device d is one actor for every device count of a local cluster: 1, 2 and 3 devices start 3
    out, feeds = _mlp()
    want = ej.reference(out, **feeds)
    progs = {n: ej.compile(out, devices=n, backend=shared, planner="split_largest", quiet=True) for n in (2, 1, 3)}
    pids = {}
    for n, prog in progs.items():
        np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-5, atol=1e-6)
        pids[n] = shared.pids
    assert pids[1] == pids[2][:1] and pids[3][:2] == pids[2] and len(set(pids[3])) == 3
    # device 1's actor dies between runs: the 1-device program does not use it; the 2-device one
    # finds it dead at its start, and every pool sharing it is replaced, the 1-device one's too
    os.kill(pids[3][1], signal.SIGKILL)
    deadline = time.time() + 30  # a hang guard
    while time.time() < deadline and _alive_actor_pids([pids[3][1]]):
        time.sleep(0.05)
    np.testing.assert_allclose(progs[1].run(**feeds), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(progs[2].run(**feeds), want, rtol=1e-5, atol=1e-6)
    fresh = shared.pids
    assert not set(fresh) & set(pids[3])
    for n in (1, 3):
        np.testing.assert_allclose(progs[n].run(**feeds), want, rtol=1e-5, atol=1e-6)
        assert shared.pids[:min(n, 2)] == fresh[:min(n, 2)]
    assert all(r == [] for r in shared.open_runs())


SCRIPT = r"""
import numpy as np, einjoin as ej, ray
x = ej.input("x", (8, 4)); w = ej.param("w", (4, 6))
prog = ej.compile((x @ w).relu(), devices=2, backend="ray")
out = prog.run(np.ones((8, 4), np.float32), np.ones((4, 6), np.float32))
assert out.shape == (8, 6) and float(out[0, 0]) == 4.0
node = ray._private.worker._global_node
pids = [p.process.pid for ps in node.all_processes.values() for p in ps] + prog.backend.pids
print("PIDS", *pids)
import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)
# the actors' workers imported einjoin's actor module as they started (Ray's preload), not on the first run
flag = "--worker-preload-modules=einjoin.runtime.backends.ray_worker"
argvs = ray.get([a.__ray_call__.remote(lambda w: __import__("sys").argv) for a in prog.backend.actors])
print("PRELOADED", all(flag in argv for argv in argvs))
procs = set(pids)
for pid in pids:
    try:
        procs |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        pass
for c in psutil.net_connections(kind="inet"):
    if c.pid in procs and c.status == psutil.CONN_LISTEN:
        p = psutil.Process(c.pid)
        print("LISTEN", c.laddr.ip, c.laddr.port, p.name().replace(" ", "_"),
              int(any(a.endswith(("dashboard/dashboard.py", "dashboard/agent.py")) for a in p.cmdline())))
"""

# Ray 2.60's own gRPC servers (GCS, raylets, core workers) bind every interface whatever the node
# address (no option turns it off; they require Ray's cluster token). Everything else that Ray
# lets einjoin place -- the node address, the runtime-env agent, the dashboard -- is loopback.
RAY_CORE = ("gcs_server", "raylet", "ray::IDLE", "ray::DeviceWorker")


@pytest.mark.slow  # make test-all: starts and stops a Ray of its own
def test_compile_starts_and_stops_its_own_ray(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "started a local Ray" in res.stderr
    assert "PRELOADED True" in res.stdout
    pids = [int(p) for p in res.stdout.split("PIDS", 1)[1].split("\n", 1)[0].split()]
    assert len(pids) >= 5
    # the local Ray einjoin starts is for this machine only, its dashboard off (issue 16)
    import ipaddress
    listening = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("LISTEN")]
    assert listening, res.stdout
    for ip, port, name, dashboard in listening:
        addr = ipaddress.ip_address(ip.split("%")[0])
        assert dashboard == "0" and port != "8265", f"a dashboard listens: {name} on {ip}:{port}"
        assert addr.is_loopback or (addr.is_unspecified and name.startswith(RAY_CORE)), \
            f"{name} listens on {ip}:{port}, not a loopback address"
    deadline = time.time() + 15
    while time.time() < deadline and _alive_actor_pids(pids):
        time.sleep(0.2)
    assert _alive_actor_pids(pids) == []


def test_feeds_changed_in_place_or_in_sign_bits_are_seen(shared, monkeypatch):
    # the driver puts only the feeds whose bytes differ from the program's last put: a weight
    # changed in place, a -0.0 for a 0.0 (equal as numbers, not as bytes) and a new input all reach
    # the actors; unchanged feeds are not put again (the feeds each run puts: counted exactly)
    x, w = ej.input("x", (64, 32)), ej.param("w", (32, 16))
    out = x @ (1.0 / w)   # a -0.0 in w gives a column of -inf (x > 0)
    prog = ej.compile(out, devices=2, backend=shared, planner="split_largest", quiet=True)
    names = {n: k for k, n in prog.graph.input_by_name.items()}
    puts: list[list[str]] = []
    real_put = ray.put

    def put(value, *args, **kwargs):  # the feeds go into the object store as one dict per put
        if isinstance(value, dict):
            puts.append(sorted(names[n] for n in value))
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", put)

    def put_by(run):
        del puts[:]
        run()
        return list(puts)
    rng = np.random.default_rng(1)
    xs = np.abs(rng.standard_normal((64, 32))).astype(np.float32) + 0.1
    ws = rng.standard_normal((32, 16)).astype(np.float32)
    ws[:, 3] = 0.0
    with np.errstate(divide="ignore"):
        def check(xv, wv):
            got = prog.run(x=xv, w=wv)
            np.testing.assert_allclose(got, xv @ (1.0 / wv), rtol=1e-4)
            return got
        assert put_by(lambda: (check(xs, ws)[:, 3] == np.inf).all()) == [["w", "x"]]
        held = shared._feeds.ref(prog._engine)
        assert put_by(lambda: check(xs, ws)) == []            # nothing changed: nothing put
        assert shared._feeds.ref(prog._engine) is held       # the same object
        ws[0, 0] += 1.0                                       # in place, the same array
        assert put_by(lambda: check(xs, ws)) == [["w"]]
        ws[:, 3] = -0.0
        assert put_by(lambda: (check(xs, ws)[:, 3] == -np.inf).all()) == [["w"]]
        assert put_by(lambda: check(xs * 2, ws)) == [["w", "x"]]   # most bytes new: put whole again
    assert shared._feeds.ref(prog._engine) is not held
    # the outputs came back over this process's channel (not in the actors' Ray replies), and no
    # run's entry is left behind
    from einjoin.runtime.backends.ray_channel import available
    if available():
        assert shared._outputs._channel._received >= 2
    assert shared._outputs._arrived == {}


def _unix_sockets() -> str:
    with open("/proc/net/unix") as f:
        return f.read()


def test_channel_names_show_no_part_of_the_secret(shared):
    # abstract socket names are listed in /proc/net/unix for every user of the machine: the
    # channels' names are random tokens, the secret only proves a connection
    from einjoin.runtime.backends.ray_channel import available
    if not available():
        pytest.skip("abstract Unix sockets are Linux's")
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend=shared, planner="split_largest", quiet=True)
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), rtol=1e-4, atol=1e-5)
    listed = _unix_sockets()
    names = [*shared._last.names, shared._outputs._channel.name]
    assert all("@" + n in listed for n in names)   # the actors' and the driver's channels are there
    secret = shared._secret.hex()
    windows = {secret[i:i + 6] for i in range(0, len(secret) - 5, 2)}   # every 3 bytes of it
    assert not [w for w in windows if w in listed]


def test_close_closes_the_drivers_channel_and_its_threads():
    from einjoin.errors import EinjoinError
    from einjoin.runtime.backends.ray import RayBackend
    from einjoin.runtime.backends.ray_channel import Channel, available
    if not available():
        pytest.skip("abstract Unix sockets are Linux's")
    b = RayBackend(quiet=True)
    name = b._outputs.expect(1)
    actor = Channel(f"einjoin-test-{os.getpid()}-{time.monotonic_ns()}", b._secret, lambda *m: None)
    try:
        assert actor.send(name, 1, 0, 0, np.ones(3))   # as an actor sends a run's output block
        assert list(b._outputs.take(1, [0])) == [0]
        threads = [t for t in threading.enumerate() if t.name.endswith(name)]
        assert len(threads) == 2 and "@" + name in _unix_sockets()   # its listener and a reader
        b._outputs.expect(2)
        b.close()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), t.name
        assert "@" + name not in _unix_sockets()
        with pytest.raises(EinjoinError, match="closed"):   # a run waiting for its blocks fails
            b._outputs.take(2, [0], timeout=30)
        again = b._outputs.expect(3)   # a later run opens a new channel
        assert again != name and "@" + again in _unix_sockets()
        b.close()
        assert "@" + again not in _unix_sockets()
    finally:
        actor.close()
        b.close()


@pytest.mark.slow  # make test-all
def test_results_are_writable_arrays_on_ray_as_on_threads(shared):
    # Ray's object store hands out read-only arrays backed by its shared memory; a result is the
    # caller's own writable array on every backend (and torch in gives writable torch tensors)
    torch = pytest.importorskip("torch")
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 16))
    xs, ws = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
    for devices in (1, 2):
        prog = ej.compile([x @ w, (x @ w).sum()], devices=devices, backend=shared)
        outs = prog.run(xs, ws)
        assert all(o.flags.writeable for o in outs), devices
        outs[0][:] = 0  # the caller's own array
        t = prog.run(torch.from_numpy(xs), torch.from_numpy(ws))[0]
        assert torch.equal(t, torch.full((64, 16), 32.0))
        t.add_(1)


# ---- the actors' executors in this process: DeviceWorker without Ray, a send handed straight to
# the peer's deliver (what the Ray call does, minus the object store)

class _Direct:
    """A stand-in for an actor handle: ``h.method.remote(*args)`` calls the worker at once
    (``calls`` counts them by method, of every handle)."""

    calls: dict[str, int] = {}

    def __init__(self, worker):
        self._w = worker

    def __getattr__(self, name):
        fn = getattr(self._w, name)

        class _Method:
            @staticmethod
            def remote(*args):
                _Direct.calls[name] = _Direct.calls.get(name, 0) + 1
                return fn(*args)
        return _Method


def _workers(prog, names=None):
    """The program's device workers in this process; ``names``: their block channels' (None: every
    block by a ``deliver`` call, as between hosts)."""
    from einjoin.runtime.backends.ray_worker import DeviceWorker
    n = prog.taskgraph.n_devices
    ws = [DeviceWorker(d, 1, names[d] if names else None, b"s" * 16) for d in range(n)]
    for w in ws:
        w.set_peers([_Direct(p) for p in ws], names or ())
        w.setup(1, (prog.taskgraph, prog.plan.decomps))
    return ws


def _run_in_process(prog, ws, run, feeds, delay=0.0):
    """One run on the in-process workers: go everywhere, then each one's report (its outputs)."""
    tg = prog.taskgraph
    values = {prog.graph.input_by_name[k]: v for k, v in feeds.items()}
    fetch = [[] for _ in ws]
    for lay in tg.outputs:
        for v in lay.blocks.values():
            fetch[tg.values[v].device].append(v)
    for d, w in enumerate(ws):
        w.go(run, 1, values, delay, None, None, fetch[d])
    return [w.finish(run) for w in ws]


def _outputs(prog, reports):
    from einjoin.plan.execute import assemble_outputs
    blocks = {v: b for r in reports for v, b in r["blocks"].items()}
    return assemble_outputs(prog.taskgraph, blocks.__getitem__)


def test_in_process_workers_exchange_blocks_and_run_concurrent_runs():
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend="sync", planner="split_largest", quiet=True)
    tg = prog.taskgraph
    moves = [t for t in tg.tasks if t.kind.value == "move"]
    assert moves, "the plan must move blocks"
    ws = _workers(prog)
    want = ej.reference(out, **feeds)
    # every task is an item of its device's part, every move a send on its source too
    from einjoin.runtime.backends.ray_worker import SEND
    assert sorted(tid for w in ws for kind, tid in w.plans[1].items if kind != SEND) == list(range(len(tg.tasks)))
    assert sorted(tid for w in ws for kind, tid in w.plans[1].items if kind == SEND) == [t.id for t in moves]
    reports = _run_in_process(prog, ws, 1, feeds)
    np.testing.assert_allclose(_outputs(prog, reports)[0], want, rtol=1e-5, atol=1e-6)
    assert sum(r["received"] for r in reports) == prog.stats.bytes_moved
    assert sorted(tid for r in reports for tid, _, _ in r["intervals"]) == list(range(len(tg.tasks)))
    # runs in flight at once keep their own namespaces: different feeds, each its own result
    other = {k: v * 2 for k, v in feeds.items()}
    values = [{prog.graph.input_by_name[k]: v for k, v in f.items()} for f in (feeds, other)]
    fetch = [[v for lay in tg.outputs for v in lay.blocks.values() if tg.values[v].device == d] for d in (0, 1)]
    for run, vals in ((2, values[0]), (3, values[1])):
        for d, w in enumerate(ws):
            w.go(run, 1, vals, 0.0, None, None, fetch[d])
    got = {run: _outputs(prog, [w.finish(run) for w in ws])[0] for run in (3, 2)}
    np.testing.assert_allclose(got[2], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[3], ej.reference(out, **other), rtol=1e-5, atol=1e-5)
    assert [w.open_runs() for w in ws] == [[], []]


def test_in_process_workers_send_blocks_over_their_channels_else_by_deliver():
    from einjoin.runtime.backends.ray_channel import available
    if not available():
        pytest.skip("abstract Unix sockets are Linux's")
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend="sync", planner="split_largest", quiet=True)
    n_moves = sum(t.kind.value == "move" for t in prog.taskgraph.tasks)
    want = ej.reference(out, **feeds)
    tag = f"einjoin-test-{os.getpid()}-{time.monotonic_ns()}"
    # both on this host: every block over a channel, no deliver call
    ws = _workers(prog, [f"{tag}-0", f"{tag}-1"])
    before = _Direct.calls.get("deliver", 0)
    reports = _run_in_process(prog, ws, 1, feeds)
    np.testing.assert_allclose(_outputs(prog, reports)[0], want, rtol=1e-5, atol=1e-6)
    assert _Direct.calls.get("deliver", 0) == before
    assert sum(r["received"] for r in reports) == prog.stats.bytes_moved
    assert [w.open_runs() for w in ws] == [[], []]
    # a peer whose name nobody listens on here (another host): its blocks go by deliver
    ws = _workers(prog, [f"{tag}-2", f"{tag}-3"])
    ws[0].set_peers(ws[0].peers, [f"{tag}-2", f"{tag}-elsewhere"])  # device 0 knows no name device 1 listens on
    before = _Direct.calls.get("deliver", 0)
    reports = _run_in_process(prog, ws, 1, feeds)
    np.testing.assert_allclose(_outputs(prog, reports)[0], want, rtol=1e-5, atol=1e-6)
    to_1 = sum(t.kind.value == "move" and t.device == 1 for t in prog.taskgraph.tasks)
    assert _Direct.calls.get("deliver", 0) - before == to_1 and 0 < to_1 <= n_moves


def test_in_process_workers_abort_and_fail_a_run_only():
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend="sync", planner="split_largest", quiet=True)
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
    ws = _workers(prog)
    # a failing kernel (time.sleep(-1) raises): the run's report names the task, the workers carry on
    for w in ws:
        w.go(1, 1, {prog.graph.input_by_name[k]: v for k, v in feeds.items()}, -1.0)
    with ThreadPoolExecutor(2) as pool:
        waits = [pool.submit(w.finish, 1) for w in ws]
        done, _ = wait(waits, timeout=60, return_when=FIRST_COMPLETED)
        tid, e = next(iter(done)).result()["failed"]
        assert prog.taskgraph.tasks[tid].kind.value == "kernel" and isinstance(e, ValueError)
        for w in ws:
            w.abort(1)  # as the driver does when a run fails: the other device waits for it no more
        for f in waits:
            r = f.result(60)
            assert r is None or "failed" in r
    assert [w.open_runs() for w in ws] == [[], []]
    # aborted before its go and its blocks came: nothing of it runs or stays, finish answers None
    for w in ws:
        assert w.abort(2) == -1  # not here (its go has not run): the driver counts its tasks
    assert _run_in_process(prog, ws, 2, feeds) == [None, None]
    assert [w.open_runs() for w in ws] == [[], []]
    # the workers still run the program
    np.testing.assert_allclose(_outputs(prog, _run_in_process(prog, ws, 3, feeds))[0], ej.reference(out, **feeds),
                               rtol=1e-5, atol=1e-6)


def test_actors_preload_what_the_kernels_of_a_graph_import():
    import sys
    from einjoin.runtime.backends.ray_worker import DeviceWorker, preload_modules
    x = ej.input("x", (4, 8, 16))
    assert preload_modules(ej.Graph(ej.softmax(x.sum(0) @ x.sum(1).T))) == ()  # numpy kernels: nothing
    half = ej.input("h", (4, 8), "bfloat16")
    assert preload_modules(ej.Graph([ej.attention(x, x, x), half.sum()])) == ("torch", "ml_dtypes")
    sys.modules.pop("colorsys", None)  # a module nothing of einjoin imports
    DeviceWorker(0).preload(["colorsys", "einjoin_no_such_module"])  # a failing one is the kernel's to say
    assert "colorsys" in sys.modules


def test_in_process_workers_signal_a_dependency_that_moves_no_block():
    # the planner makes none today: a kernel on device 1 made to wait for a kernel on device 0
    import dataclasses
    out, feeds = _mlp()
    prog = ej.compile(out, devices=2, backend="sync", planner="split_largest", quiet=True)
    tg = prog.taskgraph
    k0 = max(t.id for t in tg.tasks if t.kind.value == "kernel" and t.device == 0)
    k1 = next(t.id for t in tg.tasks if t.kind.value == "kernel" and t.device == 1 and t.id > k0)
    tasks = list(tg.tasks)
    tasks[k1] = dataclasses.replace(tasks[k1], deps=tasks[k1].deps + (k0,))
    tg2 = dataclasses.replace(tg, tasks=tuple(tasks))
    from einjoin.runtime.backends.ray_worker import DeviceWorker
    ws = [DeviceWorker(d) for d in range(2)]
    for w in ws:
        w.set_peers([_Direct(p) for p in ws])
        w.setup(1, (tg2, prog.plan.decomps))
    assert any(k0 == ws[0].plans[1].items[i][1] for i in ws[0].plans[1].signals)
    reports = _run_in_process(prog, ws, 1, feeds, delay=0.01)
    np.testing.assert_allclose(_outputs(prog, reports)[0], ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
    end0 = next(e for tid, _, e in reports[0]["intervals"] if tid == k0)
    start1 = next(s for tid, s, _ in reports[1]["intervals"] if tid == k1)
    assert start1 >= end0


def test_preload_never_imports_beside_a_running_kernel(tmp_path, monkeypatch):
    # two threads importing torch at once can deadlock in Python's per-module import locks, which
    # Python breaks by handing one the partially initialised module: an actor's preload (a thread
    # of the wait group) therefore waits for the kernel running on the executor thread
    from einjoin.runtime.backends.ray_worker import DeviceWorker
    (tmp_path / "einjoin_probe_import.py").write_text("import time\nAT = time.time()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "einjoin_probe_import", raising=False)
    out, feeds = _mlp()
    prog = ej.compile(out, devices=1, backend="sync", quiet=True)
    w = DeviceWorker(0)
    w.set_peers([_Direct(w)])
    w.setup(1, (prog.taskgraph, prog.plan.decomps))
    result: list = []
    runner = threading.Thread(target=lambda: result.append(_run_in_process(prog, [w], 1, feeds, delay=0.05)))
    runner.start()
    while not w._runs and not result:  # the run has begun
        time.sleep(0.001)
    w.preload(["einjoin_probe_import"])
    runner.join()
    at = sys.modules["einjoin_probe_import"].AT
    assert not any(s < at < e for _, s, e in result[0][0]["intervals"]), "imported while a kernel ran"


def test_a_runs_outputs_are_sent_outside_the_actors_lock():
    # the driver's socket buffer full (a slow driver): the actor still answers its other calls
    # (abort, deliver, open_runs) while its outputs are written, and the report lists them as sent
    out, feeds = _mlp()
    prog = ej.compile(out, devices=1, backend="sync", quiet=True)
    (w,) = _workers(prog)
    entered, release = threading.Event(), threading.Event()

    class _SlowDriver:
        def send(self, peer, run, tid, src, block):
            entered.set()
            return release.wait(60)

    w._channel = _SlowDriver()
    fetch = [v for lay in prog.taskgraph.outputs for v in lay.blocks.values()]
    w.go(1, 1, {prog.graph.input_by_name[k]: v for k, v in feeds.items()}, 0.0, None, None, fetch, 0, None, "driver")
    try:
        assert entered.wait(60)
        answered: list = []
        t = threading.Thread(target=lambda: answered.append(w.open_runs()), daemon=True)
        t.start()
        t.join(30)   # a hang guard: before, the send held the actor's lock until the driver read
        assert answered == [[]]
    finally:
        release.set()
    report = w.finish(1)
    assert report["sent"] == fetch and report["blocks"] == {}
    assert w.open_runs() == []


def test_a_subclass_of_the_worker_runs_its_own_item_and_done():
    from einjoin.runtime.backends.ray_worker import DeviceWorker

    class Counting(DeviceWorker):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = {"item": 0, "done": 0}

        def _item(self, r, i):
            self.calls["item"] += 1
            return super()._item(r, i)

        def _done(self, r, i):
            self.calls["done"] += 1
            return super()._done(r, i)

    out, feeds = _mlp()
    prog = ej.compile(out, devices=1, backend="sync", quiet=True)
    w = Counting(0)
    w.set_peers([_Direct(w)])
    w.setup(1, (prog.taskgraph, prog.plan.decomps))
    reports = _run_in_process(prog, [w], 1, feeds)
    np.testing.assert_allclose(_outputs(prog, reports)[0], ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
    n = len(w.plans[1].items)
    assert w.calls == {"item": n, "done": n}
    from einjoin.runtime.backends.ray_worker import _unshimmed
    # as ray.remote makes it: a class of Ray's on top (its methods wrapped in a tracing shim); the
    # executor calls the class's own (the subclass's) functions under it
    shim = type("Class", (Counting,), {"__ray_actor_class__": Counting, "_item": lambda self, r, i: None})
    assert _unshimmed(shim(0), "_item").__func__ is Counting._item
    assert _unshimmed(w, "_done").__func__ is Counting._done
