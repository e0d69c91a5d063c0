"""The Ray backend on the session's two-node loopback cluster: placement across nodes with the
bytes counted at the receiving actors, a killed actor, cleanup, and Ray started on demand.
(The conformance suite runs on Ray too: tests/test_conformance.py.)"""

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


def _einjoin_actors_alive():
    import ray._private.state as state
    return [a for a in state.actors().values()
            if a["State"] == "ALIVE" and "DeviceWorker" in a.get("ActorClassName", "")]


def _wait_dead(pids, seconds=10.0):
    deadline = time.time() + seconds
    while time.time() < deadline and (_alive_actor_pids(pids) or _einjoin_actors_alive()):
        time.sleep(0.1)
    return _alive_actor_pids(pids), _einjoin_actors_alive()


def test_ray_cluster_sees_both_nodes(ray_session):
    cluster = ej.ray_cluster(devices_per_node=2)
    assert cluster.size == 4
    nodes = [d.node for d in cluster.devices]
    assert len(set(nodes)) == 2 and nodes.count(nodes[0]) == 2
    # the topology is in the costs: cross-node links are slower
    assert cluster.bandwidth[0][1] > cluster.bandwidth[0][2]


def test_two_nodes_cross_node_bytes_match_the_plan(ray_session):
    cluster = ej.ray_cluster(devices_per_node=2)
    out, feeds = _mlp()
    prog = ej.compile(out, devices=cluster, backend="ray", planner="split_largest")
    try:
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
    finally:
        prog.close()


@pytest.mark.parametrize("retries", [1, 0])
def test_killed_actor_completes_or_raises_and_leaves_no_actor(ray_session, retries):
    from einjoin.runtime.backends.ray import RayBackend
    out, feeds = _mlp()
    backend = RayBackend(kernel_delay=0.3, quiet=True, retries=retries)
    prog = ej.compile(out, devices=2, backend=backend, planner="split_largest")
    killed = []

    def killer():
        while not backend.pids:
            time.sleep(0.02)
        time.sleep(1.0)  # kernels are outstanding: each sleeps 0.3 s
        killed.append(backend.pids[1])
        os.kill(backend.pids[1], signal.SIGKILL)

    th = threading.Thread(target=killer)
    th.start()
    t0 = time.time()
    if retries:  # the inputs are reachable: fresh actors re-run the graph and the run completes
        got = prog.run(**feeds)
        np.testing.assert_allclose(got, ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
        assert prog.run_stats.recoveries == 1 and prog.run_stats.bytes_moved == prog.stats.bytes_moved
        assert killed and killed[0] not in backend.pids
        killed += backend.pids
    else:
        with pytest.raises(ej.EinjoinError, match=r"device 1 .*was lost|a device was lost"):
            prog.run(**feeds)
    assert time.time() - t0 < 30
    th.join()
    pids = list(killed)
    prog.close()
    assert _wait_dead(pids) == ([], [])
    # the program recovers on the next run with fresh actors
    backend.kernel_delay = 0.0
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(out, **feeds), rtol=1e-5, atol=1e-6)
    pids = list(backend.pids)
    prog.close()
    assert _wait_dead(pids) == ([], [])


def test_kernel_errors_name_the_task(ray_session):
    out, feeds = _mlp()
    with ej.compile(out, devices=2, backend="ray") as prog:
        feeds = dict(feeds, x=feeds["x"].astype(np.float32))
        got = prog.run(**feeds)
        assert got.shape == (256, 64)
        with pytest.raises(ej.EinjoinError, match="x"):
            prog.run(**dict(feeds, x=np.ones((3, 3), np.float32)))  # checked before any kernel


SCRIPT = r"""
import numpy as np, einjoin as ej, ray
x = ej.input("x", (8, 4)); w = ej.param("w", (4, 6))
prog = ej.compile((x @ w).relu(), devices=4, backend="ray")
out = prog.run(np.ones((8, 4), np.float32), np.ones((4, 6), np.float32))
assert out.shape == (8, 6) and float(out[0, 0]) == 4.0
node = ray._private.worker._global_node
pids = [p.process.pid for ps in node.all_processes.values() for p in ps] + prog.backend.pids
print("PIDS", *pids)
import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)
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


def test_compile_starts_and_stops_its_own_ray(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "started a local Ray" in res.stderr
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


def test_results_are_writable_arrays_on_ray_as_on_threads(ray_session):
    # Ray's object store hands out read-only arrays backed by its shared memory; a result is the
    # caller's own writable array on every backend (and torch in gives writable torch tensors)
    torch = pytest.importorskip("torch")
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 16))
    xs, ws = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
    for devices in (1, 2):
        with ej.compile([x @ w, (x @ w).sum()], devices=devices, backend="ray") as prog:
            outs = prog.run(xs, ws)
            assert all(o.flags.writeable for o in outs), devices
            outs[0][:] = 0  # the caller's own array
            t = prog.run(torch.from_numpy(xs), torch.from_numpy(ws))[0]
            assert torch.equal(t, torch.full((64, 16), 32.0))
            t.add_(1)
