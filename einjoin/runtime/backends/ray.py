"""The Ray backend: one Ray actor per einjoin device, holding that device's block store.

The driver submits the whole task graph at once, in task-id (topological) order: every task is
a call on the actor of its device; a dependency on another device's task is passed as that
task's object reference, so Ray, not the driver, waits for it. A ``move`` is a ``send`` on the
source actor whose result (the block, in Ray's object store) is the argument of a ``receive``
on the destination actor: point to point, zero-copy reads (blocks received are only read;
kernels, reduces and touches write fresh arrays or local buffers). Blocks stay resident in the
actors between tasks; only the outputs are fetched. The task semantics are the engine's
(:func:`einjoin.plan.execute.compute` and :class:`einjoin.runtime.engine.Store`); Ray replaces
the engine's scheduler, which is why callbacks see each task after the run, with its measured
times.

Faults: a lost actor (killed, out of memory) is reported by Ray to every waiting reference within
seconds. The inputs are still reachable (the driver holds the feeds), so the chosen behaviour is
completion: every actor is replaced and the task graph runs again from the inputs (coarse
lineage: all producers, not only the lost blocks'), ``retries`` times (default 1); after that,
an :class:`EinjoinError` names the lost device and its actor's pid.

>>> import einjoin as ej
>>> ej.runtime.get_backend("ray").name        # nothing starts before the first run
'ray'
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from einjoin.cluster import Cluster, Device
from einjoin.errors import EinjoinError

__all__ = ["RayBackend", "ray_cluster", "DeviceWorker"]

_started_here = False          # this process started the local Ray it uses
_lock = threading.Lock()
_live: "set[RayBackend]" = set()


def _ray() -> Any:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency of the dev/ray extras
        raise EinjoinError("backend='ray' needs Ray: pip install 'einjoin[ray]'") from None
    return ray


def ensure_ray(num_cpus: int = 2, object_store_memory: int | None = None, quiet: bool = False) -> Any:
    """Ray, initialised: the running instance if there is one, else a new local one (never a
    remote address nobody gave)."""
    global _started_here
    ray = _ray()
    with _lock:
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                     object_store_memory=object_store_memory, log_to_driver=False,
                     configure_logging=False)
            _started_here = True
            if not quiet:
                import sys
                print(f"einjoin: started a local Ray ({num_cpus} CPUs); it stops at exit or with "
                      f"einjoin.runtime.backends.ray.shutdown()", file=sys.stderr)
    return ray


def shutdown() -> None:
    """Kill every einjoin actor; stop Ray if einjoin started it."""
    global _started_here
    for b in list(_live):
        b.close()
    ray = _ray()
    if _started_here and ray.is_initialized():
        ray.shutdown()
        _started_here = False


atexit.register(shutdown)


def ray_cluster(address: str | None = None, devices_per_node: int | None = None,
                intra_node: float = 20e9, inter_node: float = 1.25e9) -> Cluster:
    """A :class:`Cluster` from the live Ray cluster: per alive node, one device per GPU on GPU
    nodes, else ``devices_per_node`` (default: the node's CPUs) CPU devices; bandwidth
    ``intra_node`` between devices of one node and ``inter_node`` across nodes, so the
    optimizer's costs see the topology. ``address`` connects to that cluster first."""
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
    n = len(devices)
    same = [[devices[i].node == devices[j].node for j in range(n)] for i in range(n)]
    bw = tuple(tuple(float("inf") if i == j else intra_node if same[i][j] else inter_node
                     for j in range(n)) for i in range(n))
    lat = tuple(tuple(0.0 if i == j else 5e-6 if same[i][j] else 5e-5 for j in range(n)) for i in range(n))
    return Cluster(tuple(devices), bw, lat)


class _DeviceLost(Exception):
    """A device's actor died: internal, becomes a re-run or an EinjoinError."""


class DeviceWorker:
    """The actor body: one device's store and the task semantics the other backends use."""

    def __init__(self, device: int, blas_threads: int = 1):
        from threadpoolctl import threadpool_limits
        self.device = device
        self._limits = threadpool_limits(limits=max(1, blas_threads))
        self.delay = 0.0

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def setup(self, plan: Any) -> None:
        self.tg, self.decomps = plan

    def set_kernel_delay(self, seconds: float) -> None:
        """Test hook: sleep before every kernel (so a fault lands while work is outstanding)."""
        self.delay = float(seconds)

    def begin(self, feeds: Mapping[Any, np.ndarray]) -> None:
        from einjoin.runtime.engine import Store
        self.feeds = feeds
        self.store = Store(self.device)
        self.intervals: list[tuple[int, float, float]] = []
        self.received_from: dict[int, int] = {}

    def run(self, tid: int, *deps: Any) -> None:
        from einjoin.plan.execute import compute
        t = self.tg.tasks[tid]
        start = time.time()
        if t.kind == "free":
            self.store.free(t.frees)
        else:
            if t.kind == "kernel" and self.delay:
                time.sleep(self.delay)
            value = compute(t, self.store.get, self.feeds, self.decomps, self.tg.values[t.writes].shape)
            self.store.put(t.writes, value, value.nbytes)
            if t.kind == "load":
                self.store.loaded += value.nbytes
        self.intervals.append((tid, start, time.time()))

    def send(self, vid: int, *deps: Any) -> np.ndarray:
        return self.store.get(vid)

    def receive(self, tid: int, src: int, value: np.ndarray) -> None:
        # a zero-copy, read-only view of the object store: only read by later tasks
        t = self.tg.tasks[tid]
        start = time.time()
        self.store.put(t.writes, value, value.nbytes)
        self.store.received += value.nbytes   # counted here, at the receiving device
        self.received_from[src] = self.received_from.get(src, 0) + value.nbytes
        self.intervals.append((tid, start, time.time()))

    def fetch(self, vid: int) -> np.ndarray:
        return self.store.get(vid)

    def finish(self) -> dict[str, Any]:
        s = self.store
        out = {"received": s.received, "loaded": s.loaded, "peak": s.peak, "intervals": self.intervals,
               "received_from": self.received_from}
        self.feeds = {}
        return out


@dataclass(eq=False)
class RayBackend:
    """``backend="ray"``: actors are created on first run (on the node each device names, when
    the cluster came from :func:`ray_cluster`) and live until :meth:`close` or exit."""

    name: str = "ray"
    parallel: bool = True
    computes: bool = True
    remote: bool = True
    num_cpus: int = 2
    object_store_memory: int | None = None
    actor_cpus: float = 0.0          # CPUs each actor reserves: 0 lets devices outnumber CPUs
    kernel_delay: float = 0.0        # test hook, see DeviceWorker.set_kernel_delay
    retries: int = 1                 # re-runs after a lost device before raising
    quiet: bool = False
    actors: list[Any] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    _plan_id: int | None = None
    received_per_pair: dict[tuple[int, int], int] = field(default_factory=dict)

    def context(self, n_devices: int) -> Any:  # the engine's hook; unused by remote backends
        import contextlib
        return contextlib.nullcontext()

    def _start(self, cluster: Cluster | None, n: int) -> None:
        ray = ensure_ray(self.num_cpus, self.object_store_memory, self.quiet)
        cls = ray.remote(DeviceWorker)
        per_node: dict[Any, int] = {}
        for d in range(n):
            node = cluster.devices[d].node if cluster is not None else None
            per_node[node] = per_node.get(node, 0) + 1
        actors = []
        for d in range(n):
            node = cluster.devices[d].node if cluster is not None else None
            opts: dict[str, Any] = {"num_cpus": self.actor_cpus, "max_restarts": 0,
                                    "max_concurrency": 1}
            if node is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            cores = os.cpu_count() or 1
            actors.append(cls.options(**opts).remote(d, max(1, cores // per_node[node])))
        self.actors = actors
        self.pids = ray.get([a.pid.remote() for a in actors], timeout=120)
        if self.kernel_delay:
            ray.get([a.set_kernel_delay.remote(self.kernel_delay) for a in actors])
        self._plan_id = None
        _live.add(self)

    def run_graph(self, engine: Any, feeds: Mapping[Any, np.ndarray], cluster: Cluster | None,
                  callbacks: Sequence[Any] = ()) -> tuple[list[np.ndarray], Any]:
        """Run; when a device is lost and ``retries`` remain, start fresh actors and run again
        from the inputs (the driver holds them), so the run completes."""
        for attempt in range(self.retries + 1):
            try:
                outs, stats = self._run_once(engine, feeds, cluster, callbacks)
                stats.recoveries = attempt
                return outs, stats
            except _DeviceLost as e:
                if attempt == self.retries:
                    raise EinjoinError(str(e)) from None
                if not self.quiet:
                    import sys
                    print(f"einjoin: {e}; restarting the actors and re-running", file=sys.stderr)
        raise AssertionError  # pragma: no cover

    def _run_once(self, engine: Any, feeds: Mapping[Any, np.ndarray], cluster: Cluster | None,
                  callbacks: Sequence[Any] = ()) -> tuple[list[np.ndarray], Any]:
        from einjoin.plan.execute import assemble_outputs
        from einjoin.runtime.engine import RunStats
        ray = _ray()
        tg = engine.tg
        n = tg.n_devices
        if len(self.actors) != n:
            self.close()
            self._start(cluster, n)
        a = self.actors
        t0 = time.perf_counter()
        try:
            if self._plan_id != id(engine):  # ship the plan once per program
                plan = ray.put((tg, engine.decomps))
                ray.get([x.setup.remote(plan) for x in a])
                self._plan_id = id(engine)
            feeds_ref = ray.put(dict(feeds))
            ray.get([x.begin.remote(feeds_ref) for x in a])
            refs: list[Any] = [None] * len(tg.tasks)
            for t in tg.tasks:
                # same-device order is the actor's submission order; other devices' tasks by ref
                deps = [refs[d] for d in t.deps if tg.tasks[d].device != t.device]
                if t.kind == "move":
                    src_deps = [refs[d] for d in t.deps if tg.tasks[d].device == t.src_device]
                    val = a[t.src_device].send.remote(t.reads[0], *src_deps)
                    refs[t.id] = a[t.device].receive.remote(t.id, t.src_device, val)
                else:
                    refs[t.id] = a[t.device].run.remote(t.id, *deps)
            blocks = {v: a[tg.values[v].device].fetch.remote(v)
                      for lay in tg.outputs for v in lay.blocks.values()}
            finals = [x.finish.remote() for x in a]
            self._wait(refs, tg)
            fetched = dict(zip(blocks, ray.get(list(blocks.values()))))
            reports = ray.get(finals)
        except (EinjoinError, _DeviceLost):
            self.close()  # a lost or failed device: the next run starts fresh actors
            raise
        stats = RunStats(order="ray", intervals={d: [] for d in range(n)})
        stats.wall_time = time.perf_counter() - t0
        offset = time.perf_counter() - time.time()
        events = []
        for d, rep in enumerate(reports):
            for tid, s, e in rep["intervals"]:
                stats.intervals[d].append((s + offset, e + offset, tid))
                events.append((s + offset, e + offset, tid))
        for s, e, tid in sorted(events):
            for cb in callbacks:
                cb.on_start(tg.tasks[tid])
                cb.on_end(tg.tasks[tid], s, e)
        stats.tasks_run = len(events)
        stats.bytes_moved = sum(r["received"] for r in reports)
        stats.bytes_loaded = sum(r["loaded"] for r in reports)
        stats.peak_bytes_per_device = {d: r["peak"] for d, r in enumerate(reports)}
        # bytes per (src, dst) pair as the receiving actors counted them
        self.received_per_pair = {(src, d): b for d, r in enumerate(reports)
                                  for src, b in r["received_from"].items()}
        stats.busy_time_per_device = {d: sum(e - s for s, e, _ in iv) for d, iv in stats.intervals.items()}
        outs = assemble_outputs(tg, lambda v: fetched[v], feeds)
        stats.bytes_fetched = sum(o.nbytes for o in outs)
        return outs, stats

    def _wait(self, refs: list[Any], tg: Any) -> None:
        ray = _ray()
        from ray.exceptions import RayActorError, RayTaskError
        pending = list(refs)
        index = {r: i for i, r in enumerate(refs)}
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for r in done:
                try:
                    ray.get(r)
                except RayActorError as e:
                    t = tg.tasks[index[r]]
                    dev = t.device
                    raise _DeviceLost(f"device {dev} (Ray actor pid {self.pids[dev]}) was lost while "
                                      f"running task #{t.id} ({t.kind}): {type(e).__name__}") from None
                except RayTaskError as e:
                    t = tg.tasks[index[r]]
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    if isinstance(cause, RayActorError):
                        raise _DeviceLost(f"a device was lost (Ray actor died) before task #{t.id} "
                                          f"on device {t.device} could run: {type(cause).__name__}") from None
                    from einjoin.ir.printing import describe
                    raise EinjoinError(f"task #{t.id} ({t.kind} of {describe(t.node)}) on device {t.device} "
                                       f"failed: {type(cause).__name__}: {cause}") from None

    def close(self) -> None:
        """Kill this backend's actors (idempotent)."""
        if self.actors:
            ray = _ray()
            if ray.is_initialized():
                for x in self.actors:
                    try:
                        ray.kill(x, no_restart=True)
                    except Exception:  # noqa: BLE001 - already dead
                        pass
        self.actors, self.pids, self._plan_id = [], [], None
        _live.discard(self)
