"""Starting and finding Ray for the Ray backend (:mod:`einjoin.runtime.backends.ray`): the running
Ray, else a local one for this machine only (:func:`ensure_ray`: a loopback node address on
Linux, no dashboard unless asked, workers at nice 0 that import einjoin's actor module as they
start, started on a thread that outlives every run), and a :class:`~einjoin.cluster.Cluster` of a
live Ray's nodes (:func:`ray_cluster`).

>>> LOCAL_NODE_IP
'127.0.0.2'
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Any

import numpy as np

from einjoin.cluster import Cluster, Device, LinkMatrix
from einjoin.errors import EinjoinError
from einjoin.runtime.backend import wait_event

__all__ = ["ensure_ray", "ray_cluster", "stop_started", "LOCAL_NODE_IP"]

_started_here = False          # this process started the local Ray it uses
_lock = threading.Lock()
# the node address a local Ray is given: Ray rewrites 127.0.0.1 to the host's external address,
# but every 127/8 address is loopback on Linux (elsewhere only 127.0.0.1 is up: Ray's choice stays)
LOCAL_NODE_IP = "127.0.0.2"
# what the workers of a local Ray einjoin starts import before they take work (Ray's
# preload_python_modules): the actor module, and so einjoin (~0.5 s of CPU per worker, which a
# device actor otherwise pays when it starts, on its first run's path)
WORKER_MODULE = "einjoin.runtime.backends.ray_worker"


def _ray() -> Any:
    try:
        import ray
    except ImportError:  # ray is an optional extra
        raise EinjoinError("backend='ray' needs Ray, which is not installed: pip install 'einjoin[ray]' "
                           "(or use backend='threads')") from None
    return ray


def ensure_ray(num_cpus: int = 2, object_store_memory: int | None = None, quiet: bool = False,
               dashboard: bool = False) -> Any:
    """Ray, initialised: the running instance if there is one, else a new local one (never a
    remote address nobody gave). The local one is for this machine only: its node address is a
    loopback one (on Linux) and its dashboard is off unless ``dashboard`` (then it listens on
    127.0.0.1 only). Its workers, those it prestarts (one per CPU, which new actors take) and
    later ones, import einjoin's actor module (:data:`WORKER_MODULE`) before they take work, so a
    device actor starts without importing einjoin (what a program's kernels import, torch, is
    the actors' ``preload``: Ray stops a worker whose preload raises anything but ImportError);
    this process makes its serialization context at once (the first actor start made it)."""
    global _started_here
    ray = _ray()
    with _lock:
        if not ray.is_initialized():
            # worker_niceness 0: Ray starts its workers at nice 15 by default, and einjoin's device
            # actors are the program's compute (the threads backend runs at the caller's priority):
            # on a busy machine a niced actor waits seconds to start and run
            opts: dict[str, Any] = dict(address="local", num_cpus=num_cpus, include_dashboard=bool(dashboard),
                                        object_store_memory=object_store_memory, log_to_driver=False,
                                        configure_logging=False, _system_config={
                                            "worker_niceness": 0, "preload_python_modules": [WORKER_MODULE]})
            if dashboard:
                opts["dashboard_host"] = "127.0.0.1"
            node_ip = _loopback_node_ip()
            if node_ip is not None:
                opts["_node_ip_address"] = node_ip
            _init_on_a_lasting_thread(ray, opts)
            _started_here = True
            _prime_serialization(ray)
            if not quiet:
                where = f"node address {node_ip}" if node_ip else "Ray's default node address"
                print(f"einjoin: started a local Ray ({num_cpus} CPUs, {where}, "
                      f"{'dashboard on 127.0.0.1' if dashboard else 'no dashboard'}); it stops at exit or "
                      f"with einjoin.runtime.backends.ray.shutdown()", file=sys.stderr)
    return ray


def _init_on_a_lasting_thread(ray: Any, opts: dict[str, Any]) -> None:
    """``ray.init`` on the main thread, else on einjoin's one keeper thread, which never ends: the
    processes a local Ray starts die with the thread that started them (PR_SET_PDEATHSIG), so a
    first run from ``run_async`` or any worker thread would leave the next run a dead Ray. One
    keeper serves every re-init (after a ``ray.shutdown()``), so none leaks a thread."""
    if threading.current_thread() is threading.main_thread():
        ray.init(**opts)
        return
    global _keeper
    done, failed = threading.Event(), []

    def init() -> None:
        try:
            ray.init(**opts)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            failed.append(e)
        done.set()

    with _keeper_lock:
        if _keeper is None:
            _keeper = queue.SimpleQueue()
            threading.Thread(target=_keep, args=(_keeper,), name="einjoin-ray-keeper", daemon=True).start()
        _keeper.put(init)
    wait_event(done)  # in slices: a Ctrl-C while Ray starts is seen within WAIT_SLICE
    if failed:
        raise failed[0]


def _prime_serialization(ray: Any) -> None:
    """Make this process's Ray serialization context now, as Ray starts, not at the first call
    with arguments (a program's first actor start: ~0.2 s of CPU, mostly Ray importing pydantic's
    compatibility layer, before any actor is asked for). Best effort: Ray's private API."""
    try:
        ray._private.worker.global_worker.get_serialization_context()
    except Exception:  # noqa: BLE001 - another Ray version: the first call makes it, as before
        pass


_keeper: queue.SimpleQueue[Any] | None = None
_keeper_lock = threading.Lock()


def _keep(jobs: queue.SimpleQueue[Any]) -> None:
    while True:  # alive for ever: Ray's processes started here live as long as this thread
        jobs.get()()


def _loopback_node_ip() -> str | None:
    """LOCAL_NODE_IP when this machine can bind it (Linux: all of 127/8 is loopback), else None."""
    if not sys.platform.startswith("linux"):
        return None
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((LOCAL_NODE_IP, 0))
    except OSError:
        return None
    return LOCAL_NODE_IP

def stop_started() -> None:
    """Stop the local Ray if this process started it (``ensure_ray``); else nothing."""
    global _started_here
    ray = sys.modules.get("ray")
    if _started_here and ray is not None and ray.is_initialized():
        ray.shutdown()
    _started_here = False


def ray_cluster(address: str | None = None, devices_per_node: int | None = None,
                intra_node: float = 20e9, inter_node: float = 1.25e9) -> Cluster:
    """A :class:`Cluster` from the live Ray cluster: per alive node, one device per GPU on GPU
    nodes, else ``devices_per_node`` (default: the node's CPUs) CPU devices; bandwidth
    ``intra_node`` between devices of one node and ``inter_node`` across nodes, so the
    optimizer's costs see the topology. ``address`` connects to that cluster first."""
    if devices_per_node is not None:
        _check_int("ray_cluster", "devices_per_node", devices_per_node, 1)
    if address is not None and not isinstance(address, str):
        raise EinjoinError(f"ray_cluster: address must be a Ray address string such as 'auto' or "
                           f"'10.0.0.1:6379', got {type(address).__name__} {address!r:.60}")
    for name, bw in (("intra_node", intra_node), ("inter_node", inter_node)):
        _check_number("ray_cluster", name, bw, positive=True, finite=False)  # inf: a free link
    ray = _ray()
    if address is not None and not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    ensure_ray(quiet=True)
    devices: list[Device] = []
    for node in sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"]):
        res = node.get("Resources", {})
        gpus = int(res.get("GPU", 0))
        kind, count = ("gpu", gpus) if gpus else ("cpu", devices_per_node or max(1, int(res.get("CPU", 1))))
        for _ in range(count):
            devices.append(Device(len(devices), kind, None, node["NodeID"]))
    if not devices:
        raise EinjoinError("ray_cluster: the Ray cluster has no alive nodes")
    groups = [d.node for d in devices]  # links in O(devices): same node or not
    return Cluster(tuple(devices), LinkMatrix(groups, float("inf"), intra_node, inter_node),
                   LinkMatrix(groups, 0.0, 5e-6, 5e-5))


def _check_int(where: str, name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise EinjoinError(f"{where}: {name} must be an integer >= {least}, got {value!r:.60}")


def _check_number(where: str, name: str, value: Any, positive: bool = False, finite: bool = True) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
          and value == value and (value > 0 if positive else value >= 0)
          and (not finite or value != float("inf")))
    if not ok:
        raise EinjoinError(f"{where}: {name} must be a {'finite ' if finite else ''}number "
                           f"{'> 0' if positive else '>= 0'}, got {value!r:.60}")
