"""The Ray backend: one Ray actor per einjoin device, holding that device's block stores.

The engine runs it like every backend (:class:`einjoin.runtime.backend.Backend`): ``open`` gives
an eager session (the engine does not dispatch ready tasks). The driver stays out of the per-task
and the data path: a program's plan goes to Ray's object store once and each actor builds its
part of the task graph from it once (:class:`~einjoin.runtime.backends.ray_worker.Part`, cached
on the actor by the program's key); per run the driver puts the feeds once (only those that
differ from the program's last run's, when most bytes are the same) and sends each actor
a ``go`` and a ``finish`` (which returns that actor's report when its part is done; its output
blocks come over a block channel to this process, :class:`~einjoin.runtime.backends.ray_io.OutputInbox`,
or in the report from another host; the feeds: :class:`~einjoin.runtime.backends.ray_io.FeedCache`),
so a run costs two Ray calls per device, not one per task, and the session's ``submit``
does nothing. Each actor runs its tasks on an executor thread as their dependencies finish; a
``move`` is a send on the source actor: over the pair's block channel when both run on one host
(:mod:`~einjoin.runtime.backends.ray_channel`, a Unix socket: no object store, no Ray call), else
a call of the destination's ``deliver`` with the block (through the object store, point to point;
a zero-copy, read-only view there: blocks received are only read, kernels, reduces and touches
write fresh arrays or local buffers). Blocks stay
resident in the actors between tasks; only the outputs come back. The task semantics are the
local devices' (:func:`einjoin.plan.execute.compute`, the prepared kernels of
:mod:`einjoin.runtime.fastkernels`, :class:`einjoin.runtime.local.Store`); callbacks see each
task after the run (the engine replays them), with its measured times.

Runs are independent: every session (one run attempt) gets a run id, and each actor
keeps that run's feeds, store, intervals and byte counts under it (dropped when the run ends,
fails or is cancelled), so concurrent runs of one program never see each other's values. The
executor of an actor interleaves the ready tasks of every run in flight, and a ``go`` only
queues work, so runs never wait for each other (no deadlock, however many are in flight).

Faults: a lost actor (killed, out of memory) is reported by Ray to every waiting reference within
seconds. The inputs are still reachable (the driver holds the feeds), so the chosen behaviour is
completion: the session raises :class:`~einjoin.runtime.backend.DeviceLost`, the lost device's
pool of actors is replaced (once per loss, however many runs saw it: a generation counter) and
the engine runs the task graph again from the inputs (coarse lineage: all producers, not only
the lost blocks'), ``retries`` times (default 1); after that, an
:class:`EinjoinError` names the lost device and its actor's pid, and the next run starts on fresh
actors. Nothing is pinged before a run: an actor that died between runs fails the run's first call
(``go``) on it, before any of the run's work, and is replaced without using up a retry. A task
that raises fails its run only (the actor's report names it); the run is then aborted on every
actor (``abort``, on the actors' control thread: queued tasks skipped, late blocks dropped).
``ray.shutdown()`` or a Ray restart is noticed at the next run (the Ray session changed) and fresh
actors start; :meth:`RayBackend.close` during a run fails that run with an EinjoinError instead of
being undone by its recovery.

Actor pools: one per cluster shape (device count and the node of each device), so programs of
different shapes can share one backend and run at once without replacing each other's actors.
Shapes whose devices name no node (``devices=n``, ``ej.local(n)``) share actors: device ``d`` is
the backend's ``d``-th local actor for every count (each run sets the BLAS threads its count
wants), so 1, 2 and 4 devices start 4 actors, not 7; a lost actor replaces every pool holding it.

First run: starting an actor (Ray hands it one of its prestarted idle workers, which imports
einjoin then, unless the Ray is one einjoin started: its workers import einjoin as they start,
:func:`~einjoin.runtime.backends.ray_start.ensure_ray`) and the imports its kernels make on first
use (torch for attention: ~1.2 s of CPU) are most of it. :meth:`RayBackend.warm`, which
``ej.compile`` calls before planning when Ray is up, starts the program's actors without
waiting for them and has each import what the program's
kernels need (:func:`~einjoin.runtime.backends.ray_worker.preload_modules`), so both overlap the
planning; ``warm(..., wait=True)`` returns once they are done (a first run then only ships the plan).

Ray that einjoin starts runs its workers at nice 0 (Ray's default is 15): the actors are the
program's compute, and on a busy machine a niced actor takes seconds to start and to run.

>>> import einjoin as ej
>>> ej.runtime.get_backend("ray").name        # nothing starts before the first run
'ray'
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from einjoin.cluster import Cluster
from einjoin.errors import EinjoinError
from einjoin.exchange import Task, TaskKind
from einjoin.runtime.backend import DeviceLost, RunSpec, TaskFailed
from einjoin.runtime.backends import ray_start
from einjoin.runtime.backends.ray_io import FeedCache, OutputInbox
from einjoin.runtime.backends.ray_start import (LOCAL_NODE_IP, _check_int, _check_number, _ray, ensure_ray,
                                                ray_cluster)
from einjoin.runtime.backends.ray_worker import DeviceWorker

if TYPE_CHECKING:
    from einjoin.runtime.engine import RunStats

__all__ = ["RayBackend", "ray_cluster", "DeviceWorker", "ensure_ray", "shutdown", "LOCAL_NODE_IP"]

_live: set[RayBackend] = set()   # backends holding actors, for shutdown()
_run_ids = itertools.count(1)  # one namespace per run on every actor (process-wide: backends share Ray)
_state_keys = itertools.count(1)  # the keys of state blocks kept on the actors between runs
_plan_ids = itertools.count(1)
_channel_ids = itertools.count(1)  # the actors' channel names (with the backend's random token and this pid)
CONTROL = "control"            # the actors' concurrency group for aborts (not queued behind work)
WAIT = "wait"                  # the actors' concurrency group for ``finish`` calls, which wait for a run
WAITERS = 32                   # its threads: runs in flight beyond it only queue their finish


def shutdown() -> None:
    """Kill every einjoin actor; stop Ray if einjoin started it. A no-op (and no import of Ray)
    when this process never used Ray, so an absent Ray prints nothing at exit."""
    ray = sys.modules.get("ray")
    if ray is None:  # never imported (or blocked): nothing of ours can be running
        return
    for b in list(_live):
        b.close()
    ray_start.stop_started()


atexit.register(shutdown)

class _Pool:
    """The actors of one cluster shape: a device count and the node each device is placed on.
    ``pids``: per actor its pid, or the reference of its ``pid`` call while it starts (a pool
    warmed at compile time is not waited for: :meth:`RayBackend._started` waits at the run)."""

    __slots__ = ("shape", "actors", "pids", "names", "shipped", "generation")

    def __init__(self, shape: tuple[int, tuple[Any, ...]], actors: list[Any], pids: list[Any], generation: int,
                 names: list[str | None]):
        self.shape = shape
        self.actors, self.pids, self.names = actors, pids, names   # names: of the actors' block channels
        self.shipped: list[set[int]] = [set() for _ in actors]   # per actor: the plan keys it holds
        self.generation = generation


def _actor_class(ray: Any) -> Any:
    """The actor class of :class:`DeviceWorker`, one per Ray job: Ray exports an actor class to its
    GCS on the class's first ``remote()`` in a job (pickled, and disassembled for a collision
    check: ~0.1-0.2 s of the driver, before any actor of it is asked for), so a new class per
    pool paid that on every later pool's start. The default thread takes the calls that only queue
    work (setup, go, deliver) in order; finish calls wait on threads of their own, aborts on the
    control thread."""
    global _cls
    job = _ray_session(ray)
    if _cls is None or _cls[0] != job or _cls[1] is not DeviceWorker:
        _cls = (job, DeviceWorker, ray.remote(concurrency_groups={CONTROL: 1, WAIT: WAITERS},
                                              max_concurrency=1)(DeviceWorker))
    return _cls[2]


_cls: tuple[Any, type, Any] | None = None   # (Ray job, the worker class, its actor class)


def _blas_threads(nodes: Sequence[Any], d: int) -> int:
    """BLAS threads for device ``d``'s actor: this machine's cores over the devices on its node."""
    same = sum(1 for node in nodes if node == nodes[d])
    return max(1, (os.cpu_count() or 1) // same)


def _shape(cluster: Cluster | None, n: int) -> tuple[int, tuple[Any, ...]]:
    return n, tuple(cluster.devices[d].node if cluster is not None else None for d in range(n))


def _ray_session(ray: Any) -> tuple[str, str] | None:
    """Which Ray this process is connected to (cluster session, job), None when none: actors
    belong to one job and die with it, so a change means every actor handle is stale."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return ctx.get_session_name(), ctx.get_job_id()


def _rebuilt(cls: type, settings: dict[str, Any]) -> Any:
    """A :class:`RayBackend` from its pickled settings (:meth:`RayBackend.__reduce__`)."""
    return cls(**settings)


@dataclass(eq=False)
class RayBackend:
    """``backend="ray"``: actors are created on first run (on the node each device names, when
    the cluster came from :func:`ray_cluster`) and live until :meth:`close` or exit. Thread-safe:
    concurrent runs (of one program or of several sharing this backend) are independent.

    Programs sharing one backend with different cluster shapes (device count, or the node of
    each device) get a pool of actors per shape, kept until :meth:`close`: a program never
    replaces the actors another program's runs are using. After ``ray.shutdown()`` or a Ray
    restart, the next run starts fresh actors on the Ray then running (a new local one if none)."""

    name: str = "ray"
    parallel: bool = True
    computes: bool = True
    remote: bool = True
    num_cpus: int = 2
    object_store_memory: int | None = None
    actor_cpus: float = 0.0          # CPUs each actor reserves: 0 lets devices outnumber CPUs
    kernel_delay: float = 0.0        # test hook: seconds each kernel sleeps first (read per run)
    retries: int = 1                 # re-runs after a lost device before raising
    quiet: bool = False
    dashboard: bool = False          # a Ray that einjoin starts gets its dashboard (on 127.0.0.1)
    channels: bool = True            # blocks between actors of one host over Unix sockets (ray_channel)
    received_per_pair: dict[tuple[int, int], int] = field(default_factory=dict)  # of the last run
    generation: int = field(default=0, init=False)   # bumped whenever a pool of actors starts

    def __post_init__(self) -> None:
        _check_int("RayBackend", "num_cpus", self.num_cpus, 1)
        _check_int("RayBackend", "retries", self.retries, 0)
        if self.object_store_memory is not None:
            _check_int("RayBackend", "object_store_memory", self.object_store_memory, 1)
        _check_number("RayBackend", "actor_cpus", self.actor_cpus)
        _check_number("RayBackend", "kernel_delay", self.kernel_delay)
        _ray()  # a missing Ray is said at compile time, not at the first run
        self._mu = threading.RLock()          # pools, plans shipped, Ray session (held while actors start)
        self._count = threading.Lock()        # _in_flight only: never held across anything that blocks
        self._pools: dict[tuple[int, tuple[Any, ...]], _Pool] = {}
        self._last: _Pool | None = None       # the pool of the last run (actors / pids)
        self._session: tuple[str, str] | None = None
        self._closes = 0                      # close() calls: a run that saw one fails, never restarts
        self._plans: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()
        self._forgotten: list[int] = []       # plan keys of programs gone, to drop on the actors
        self._in_flight = 0
        self._secret = os.urandom(16)          # proves the actors' channel connections (ray_channel)
        self._token = os.urandom(8).hex()      # in the channels' names (public: never of the secret)
        self._feeds = FeedCache()              # per program, its last run's feeds in the object store
        self._outputs = OutputInbox(self._secret, self.channels)  # output blocks over a channel

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its settings (a program sent to another process): the copy starts its own
        actors on its first run; the pools, locks and Ray handles belong to this process."""
        from dataclasses import fields
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "received_per_pair"}
        return (_rebuilt, (type(self), settings))

    @property
    def actors(self) -> list[Any]:
        """The actors of the pool the last run used (tests and debugging)."""
        pool = self._last
        return list(pool.actors) if pool is not None else []

    @property
    def pids(self) -> list[int]:
        """The pids of :attr:`actors`."""
        pool = self._last
        return list(pool.pids) if pool is not None else []

    # -- actors ------------------------------------------------------------------------------
    def _start(self, cluster: Cluster | None, shape: tuple[int, tuple[Any, ...]],
               modules: Sequence[str] = ()) -> _Pool:
        """The actors of one shape (under ``_mu``): started, or, for a cluster whose devices name no
        node (``ej.local(n)``, ``devices=n``), the first ``n`` of this backend's local actors, of which
        only those missing start. Starting an actor (a process that imports einjoin) is most of a
        first run's time; device ``d`` is actor ``d`` whatever the count, so programs of 1, 2 and 4
        devices share 4 actors (their runs are independent as every run is). Nothing waits for the
        actors here: each new one is asked its pid (waited for by :meth:`_started`) and, with
        ``modules``, to import them (``preload``, on a thread of its ``wait`` group)."""
        n, nodes = shape
        ray = ensure_ray(self.num_cpus, self.object_store_memory, self.quiet, self.dashboard)
        base = self._local_base(shape)
        if base is not None and len(base.actors) >= n:  # a prefix of live actors: nothing starts
            pool = self._pools[shape] = _Pool(shape, base.actors[:n], base.pids[:n], base.generation,
                                              base.names[:n])
            return pool
        have, have_pids, have_names = ((list(base.actors), list(base.pids), list(base.names)) if base is not None
                                       else ([], [], []))
        cls = _actor_class(ray)
        new: list[Any] = []
        names = have_names + [f"einjoin-{self._token}-{os.getpid()}-{next(_channel_ids)}"
                              if self.channels else None for _ in range(len(have), n)]
        try:
            for d in range(len(have), n):
                node = nodes[d]
                opts: dict[str, Any] = {"num_cpus": self.actor_cpus, "max_restarts": 0}
                if node is not None:
                    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
                    opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
                new.append(cls.options(**opts).remote(d, _blas_threads(nodes, d), names[d], self._secret))
            if modules:
                for a in new:
                    a.preload.options(concurrency_group=WAIT).remote(list(modules))
            actors = have + new
            for a in actors:
                a.set_peers.remote(actors, names)  # before any run: sends go actor to actor (a longer list
                #                             for the old ones: the devices they know keep their actors)
            pids = have_pids + [a.pid.remote() for a in new]
        except Exception as e:  # noqa: BLE001 - any failure to start is the user's to see, typed
            self._kill(new)
            raise EinjoinError(f"the Ray backend could not start {n} device actors: {type(e).__name__}: "
                               f"{e}") from None
        self.generation += 1
        pool = self._pools[shape] = _Pool(shape, actors, pids, self.generation, names)
        self._session = _ray_session(ray)
        _live.add(self)
        return pool

    def _started(self, pool: _Pool) -> None:
        """Wait (under ``_mu``) until every actor of ``pool`` runs (its pid known); an actor that
        failed to start fails the run with an EinjoinError, and every pool holding it is dropped."""
        ray = _ray()
        waiting = [i for i, p in enumerate(pool.pids) if not isinstance(p, int)]
        if not waiting:
            return
        try:
            got = ray.get([pool.pids[i] for i in waiting], timeout=120)
        except Exception as e:  # noqa: BLE001 - any failure to start is the user's to see, typed
            self._retire(pool, pool.generation)
            raise EinjoinError(f"the Ray backend could not start {len(pool.actors)} device actors: "
                               f"{type(e).__name__}: {e}") from None
        started = dict(zip((pool.pids[i] for i in waiting), got))  # the pools sharing these actors too
        for other in self._pools.values():
            other.pids[:] = [started.get(p, p) if not isinstance(p, int) else p for p in other.pids]
        pool.pids[:] = [started.get(p, p) if not isinstance(p, int) else p for p in pool.pids]

    def warm(self, devices: int | Cluster, graph: Any = None, wait: bool = False) -> bool:
        """Start the actors a program on ``devices`` runs on, ahead of its first run, and have them
        import what the kernels of ``graph`` (an :class:`~einjoin.ir.graph.Graph`, or its nodes)
        import on first use (torch for attention, convolutions, pools and top-k; see
        :func:`~einjoin.runtime.backends.ray_worker.preload_modules`). ``ej.compile`` calls it
        before planning, so the actors start while the plan is made; then only when Ray is up
        (it never starts Ray: the first run does). ``wait``: start Ray if needed and return once
        the actors run and their imports are done (a warm-up a caller times apart). Returns
        whether anything was started or asked.

        >>> ray_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        >>> RayBackend(quiet=True).warm(2) == ray_up   # no Ray running (and no wait): nothing starts
        True
        """
        if isinstance(devices, Cluster):
            cluster, n = devices, devices.size
        else:
            _check_int("RayBackend.warm", "devices", devices, 1)
            cluster, n = None, int(devices)
        ray = sys.modules.get("ray")
        if not wait and (ray is None or not ray.is_initialized()):
            return False
        from einjoin.runtime.backends.ray_worker import preload_modules
        modules = preload_modules(graph) if graph is not None else ()
        shape = _shape(cluster, n)
        with self._mu:
            try:
                self._check_session(_ray())
                known = self._pools.get(shape)
                fresh = known is None
                pool = self._start(cluster, shape, modules) if known is None else known
                acks = [] if fresh and not wait else [
                    x.preload.options(concurrency_group=WAIT).remote(list(modules)) for x in pool.actors]
                if wait:
                    self._started(pool)
            except EinjoinError:
                raise
            except Exception as e:  # noqa: BLE001 - Ray's own errors, typed for the user
                raise EinjoinError(f"the Ray backend could not warm {n} device actors: "
                                   f"{type(e).__name__}: {e}") from None
        if wait:  # the imports, waited for outside _mu: other shapes' runs go on meanwhile
            try:
                _ray().get(acks, timeout=300)
            except Exception as e:  # noqa: BLE001 - a lost actor: the next run replaces it
                raise EinjoinError(f"the Ray backend could not warm {n} device actors: "
                                   f"{type(e).__name__}: {e}") from None
        return True

    def device_actors(self, n: int) -> list[Any]:
        """The live actors of devices 0..n-1 of a local shape (started if needed; Ray too), for
        work that is not a task graph: :mod:`einjoin.sparse.distribute` runs a sparse step's
        per-device parts with ``DeviceWorker.call``. A lost actor fails that work (no retry)."""
        _check_int("RayBackend.device_actors", "n", n, 1)
        shape = _shape(None, n)
        with self._mu:
            try:
                self._check_session(_ray())
                pool = self._pools.get(shape) or self._start(None, shape)
                self._started(pool)
            except EinjoinError:
                raise
            except Exception as e:  # noqa: BLE001 - Ray's own errors, typed for the user
                raise EinjoinError(f"the Ray backend could not start {n} device actors: "
                                   f"{type(e).__name__}: {e}") from None
            self._last = pool
            return list(pool.actors)

    def _check_session(self, ray: Any) -> None:
        """Under ``_mu``: after ``ray.shutdown()`` or a Ray restart every actor and object
        reference of this backend is gone: forget them (the next run starts afresh)."""
        if self._session is not None and _ray_session(ray) != self._session:
            if self._pools and not self.quiet:
                print("einjoin: Ray was shut down or restarted since the last run; starting "
                      "fresh actors", file=sys.stderr)
            self._pools.clear()
            self._plans.clear()  # their object refs went with the old Ray too
            self._feeds.clear()
            self._session = None

    def _local_base(self, shape: tuple[int, tuple[Any, ...]]) -> _Pool | None:
        """For a shape whose devices name no node, the live pool of such a shape with the most
        actors (each such pool's actors are a prefix of the next larger one's), else None."""
        n, nodes = shape
        if any(node is not None for node in nodes):
            return None  # placed on named nodes: actors of its own, as the cluster says
        local = [p for p in self._pools.values() if all(node is None for node in p.shape[1])]
        return max(local, key=lambda p: len(p.actors), default=None)

    def _kill(self, actors: Sequence[Any]) -> None:
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        for x in actors:
            try:
                ray.kill(x, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def _retire(self, pool: _Pool, seen: int) -> None:
        """Kill a pool that lost a device, unless another run (or close) already replaced it
        since generation ``seen``: once per loss. The next run's :meth:`_prepare` starts fresh
        actors for that shape; other shapes' pools are untouched."""
        with self._mu:
            if self._pools.get(pool.shape) is pool and pool.generation == seen:
                lost = {id(x) for x in pool.actors}
                for shape, other in list(self._pools.items()):  # the pools sharing its actors too
                    if other is pool or lost.intersection(map(id, other.actors)):
                        del self._pools[shape]
                self._kill(pool.actors)

    def _prepare(self, engine: Any, cluster: Cluster | None, n: int) -> tuple[_Pool, int, int, int]:
        """Live actors of this shape holding the engine's plan, the run counted in flight:
        (pool, plan key, its generation, close count). No actor is pinged: one that died since
        the last run is found on the run's own ``go`` and replaced without using a retry."""
        ray = _ray()
        shape = _shape(cluster, n)
        with self._mu:
            try:
                self._check_session(ray)
                pool = self._pools.get(shape)
                if pool is None:
                    pool = self._start(cluster, shape)
                self._started(pool)
                if engine not in self._plans:  # the plan goes to the object store once per program
                    key = next(_plan_ids)
                    self._plans[engine] = (key, ray.put((engine.tg, engine.decomps)))
                    weakref.finalize(engine, self._forgotten.append, key)  # dropped on the actors later
                key, plan = self._plans[engine]
                if self._forgotten:
                    self._forget()
            except EinjoinError:
                raise
            except Exception as e:  # noqa: BLE001 - Ray's own errors, typed for the user
                raise EinjoinError(f"the Ray backend could not prepare a run on {n} devices: "
                                   f"{type(e).__name__}: {e}") from None
            for d, x in enumerate(pool.actors):
                if key not in pool.shipped[d]:
                    try:
                        x.setup.remote(key, plan)  # runs before this run's go (same actor, in order)
                    except Exception as e:  # noqa: BLE001 - the handle is dead: replace the pool
                        self._retire(pool, pool.generation)
                        raise DeviceLost(f"device {d} (Ray actor pid {pool.pids[d]}) could not be "
                                          f"reached: {type(e).__name__}", before_start=True) from None
                    pool.shipped[d].add(key)
            with self._count:
                self._in_flight += 1
            self._last = pool
            return pool, key, pool.generation, self._closes

    def _forget(self) -> None:
        """Drop the plans of programs that are gone from the actors holding them (under ``_mu``)."""
        keys = self._forgotten[:]
        del self._forgotten[:len(keys)]
        for pool in self._pools.values():
            for d, x in enumerate(pool.actors):
                held = [k for k in keys if k in pool.shipped[d]]
                if held:
                    pool.shipped[d].difference_update(held)
                    try:
                        x.forget.remote(held)
                    except Exception:  # noqa: BLE001 - a dead actor holds nothing
                        pass

    # -- runs: the engine opens a session per run attempt --------------------------------------
    def open(self, run: RunSpec) -> _RaySession:
        """A session for one run attempt (an :class:`~einjoin.runtime.backend.EagerSession`): the
        actors hold the program's task graph, so the run is started on them when the session
        opens and the engine's per-task ``submit`` does nothing."""
        return _RaySession(self, run)

    def run_graph(self, engine: Any, feeds: Any, cluster: Any = None, callbacks: Any = (),
                  cancel: Any = None) -> Any:
        """Run ``engine``'s task graph on this backend (kept from before the engine ran Ray; the
        same as ``engine.run(feeds, self, callbacks=..., cancel=..., cluster=...)``)."""
        return engine.run(feeds, self, callbacks=callbacks, cancel=cancel, cluster=cluster)

    def read_state(self, refs: Mapping[Any, tuple[int, int, int, Any]]) -> dict[Any, np.ndarray]:
        """The state blocks ``refs`` (box -> (pool generation, device, key, actor)) kept on the
        actors, fetched to the host (``Program.read_state``)."""
        ray = _ray()
        with self._mu:  # a pool's actors with the generation they had when the state was kept
            live = {(id(x), pool.generation) for pool in self._pools.values() for x in pool.actors}
        if any((id(actor), g) not in live for g, _, _, actor in refs.values()):
            raise EinjoinError("the Ray actors that held this program's state were replaced (a lost device or "
                               "close()): the state is lost; write_state() it again")
        by_actor: dict[int, tuple[Any, list[Any]]] = {}  # one read per actor, of all its blocks
        for box, (_, _dev, _k, actor) in refs.items():
            by_actor.setdefault(id(actor), (actor, []))[1].append(box)
        groups = list(by_actor.values())
        got = ray.get([actor.read.remote([refs[b][2] for b in boxes]) for actor, boxes in groups])
        return {b: np.asarray(v) for (_, boxes), vs in zip(groups, got) for b, v in zip(boxes, vs)}

    def release_state(self, refs: Mapping[Any, tuple[int, int, int, Any]]) -> None:
        """Drop kept state blocks on the actors (best effort: a dead actor dropped them)."""
        by_actor: dict[int, tuple[Any, list[int]]] = {}
        for _, _dev, k, actor in refs.values():
            by_actor.setdefault(id(actor), (actor, []))[1].append(k)
        for actor, keys in by_actor.values():
            try:
                actor.release.remote(keys)
            except Exception:  # noqa: BLE001 - the actor is gone, and its blocks with it
                pass

    def _done(self) -> None:
        with self._count:
            self._in_flight -= 1

    def _abandon(self, actors: Sequence[Any], run: int) -> None:
        """Best effort, never raising: drop the run on every actor (``abort`` runs on the control
        thread, at once: its queued tasks are skipped, a late block or ``go`` for it ignored),
        and wait a little for the acknowledgements, so that a failed run's new state blocks are
        kept (and then released by the program) or never kept. Not ``ray.cancel``: a cancelled
        actor task leaves a hole in the actor's sequence numbers that stalls every later task on
        it for 30 s."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            return
        acks = []
        for x in actors:
            try:
                acks.append(x.abort.options(concurrency_group=CONTROL).remote(run))
            except Exception:  # noqa: BLE001 - the actor is gone: so is the namespace
                pass
        try:
            ray.wait(acks, num_returns=len(acks), timeout=5.0)
        except Exception:  # noqa: BLE001
            pass

    def open_runs(self) -> list[list[int]]:
        """Per actor of every pool, the run ids it holds a namespace for (tests and debugging:
        ``[]`` each once every run ended). Waits for the tasks queued before it on each actor."""
        ray = _ray()
        with self._mu:
            actors = list({id(x): x for pool in self._pools.values() for x in pool.actors}.values())
        runs: list[list[int]] = ray.get([x.open_runs.remote() for x in actors])
        return runs

    def close(self) -> None:
        """Kill this backend's actors, every pool's (idempotent). A run in flight fails with an
        EinjoinError saying so (it does not start actors again); the next run starts fresh ones."""
        with self._mu:
            self._closes += 1
            ray = sys.modules.get("ray")
            if ray is not None and _ray_session(ray) == self._session:  # else the actors died with their Ray
                for pool in self._pools.values():
                    self._kill(pool.actors)
            self._pools.clear()
            self._last = None
            self._outputs.close()  # this process's channel: its socket and threads (a next run opens one)
        _live.discard(self)


def _is_ray_error(e: BaseException) -> bool:
    """An error raised by Ray itself (not einjoin's), to be wrapped in an EinjoinError."""
    mod = type(e).__module__ or ""
    return mod.startswith("ray.") or mod == "ray"


class _RaySession:
    """One run attempt on the actors: ``go`` and a ``finish`` on every actor when opened (the
    actors hold the program's task graph already, so nothing is sent per task and ``submit``
    does nothing), waited for (``collect``: the run's token polled every 0.2 s, failures
    typed), then its stats and outputs (``finish``). Leaving it with an exception abandons the
    run on the actors (other runs are untouched) and retires the pool when a device was lost."""

    eager: Literal[True] = True

    def __init__(self, backend: RayBackend, spec: RunSpec):
        self.backend, self.spec = backend, spec
        self.tg = spec.engine.tg
        self.run = next(_run_ids)

    def __enter__(self) -> _RaySession:
        b, tg = self.backend, self.tg
        self.ray = _ray()
        self.pool, key, self.gen, self.closes = b._prepare(self.spec.engine, self.spec.cluster, tg.n_devices)
        self.actors = a = self.pool.actors
        try:
            resident = self._state()  # its errors are the user's, not a lost device
            # the outputs without the new state (it stays on the actors), as finish assembles them
            self.out_tg = tg if self.spec.state is None else self.spec.state.fetched(tg)
            fetch: list[list[int]] = [[] for _ in a]
            for lay in self.out_tg.outputs:
                for v in lay.blocks.values():
                    fetch[tg.values[v].device].append(v)
            try:
                feeds_ref, fresh_ref = b._feeds.refs(self.spec.engine, self.spec.feeds)
                outputs_to = b._outputs.expect(self.run)
                delay = float(b.kernel_delay)
                nodes = self.pool.shape[1]  # BLAS threads as this shape wants them (actors are shared)
                self.begins = [x.go.remote(self.run, key, feeds_ref, delay, resident[d], self.keep[d], fetch[d],
                                           _blas_threads(nodes, d), fresh_ref, outputs_to)
                               for d, x in enumerate(a)]
                self.finals = [x.finish.options(concurrency_group=WAIT).remote(self.run) for x in a]
            except Exception as e:  # noqa: BLE001 - Ray refused a submission: its actor is gone
                raise _unreachable(e) from None
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _state(self) -> list[dict[int, int]]:
        """For a program with state: per device, the load tasks served by kept state blocks
        (load task id -> key), and the new state blocks this run keeps (``self.keep``: value id
        -> a fresh key, also handed to the run's state as ``kept_refs``, committed by the program
        only when the run succeeds)."""
        tg, st, n = self.tg, self.spec.state, len(self.actors)
        resident: list[dict[int, int]] = [{} for _ in range(n)]
        self.keep: list[dict[int, int]] = [{} for _ in range(n)]
        if st is None:
            return resident
        if any(g != self.gen for refs in st.refs.values() for g, _, _, _ in refs.values()):
            raise EinjoinError("the Ray actors that held this program's state were replaced (a lost device or "
                               "close()): the state is lost; write_state() it (or feed it) and run again")
        for t in tg.tasks:
            if t.kind is TaskKind.LOAD and t.node in st.refs:
                _, dev, k, _ = st.refs[t.node][t.payload.box]
                assert dev == t.device, "a state block is not loaded where the last run left it"
                resident[t.device][t.id] = k
        st.kept_refs.clear()
        for slot in st.slots:
            lay = tg.outputs[slot.output]
            refs = st.kept_refs[slot.node] = {}
            for bk, vid in lay.blocks.items():
                dev, k = tg.values[vid].device, next(_state_keys)
                self.keep[dev][vid] = k
                refs[lay.partition.box(bk)] = (self.gen, dev, k, self.actors[dev])
        return resident

    def submit(self, t: Task) -> None:
        """Nothing to send: every actor holds its part of the task graph and was told ``go``."""

    def collect(self, cancel: Any) -> None:
        """Wait for every actor's report (its output blocks in it)."""
        self._wait(cancel)

    def _wait(self, cancel: Any) -> None:
        ray, n_begins = self.ray, len(self.begins)
        refs = [*self.begins, *self.finals]
        index = {r: i for i, r in enumerate(refs)}
        self.reports: list[Any] = [None] * len(self.finals)
        pending = refs
        while pending:
            if cancel is not None and cancel.cancelled:
                raise EinjoinError(f"run cancelled with {self._cancel()} of {len(self.tg.tasks)} tasks left")
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            if not done:
                continue
            done.sort(key=index.__getitem__)  # a go's failure before its actor's report
            try:
                got = ray.get(done)  # in bulk: one call for the whole batch when nothing failed
            except Exception:  # noqa: BLE001 - find the first failure, begins first
                for r in done:
                    self._check(r, index[r], n_begins)
                raise
            for r, rep in zip(done, got):
                i = index[r] - n_begins
                if i >= 0:
                    if rep is None:  # aborted: only this session aborts its run, so never seen
                        raise EinjoinError(f"device {i} dropped run {self.run} before its end")
                    if "failed" in rep:
                        tid, cause = rep["failed"]
                        raise TaskFailed(self.tg.tasks[tid], cause)
                    self.reports[i] = rep

    def _cancel(self) -> int | str:
        """Abort the run on every actor now; how many of its tasks had not run ("an unknown number"
        when an actor does not answer: a busy machine can delay the answers, and a guessed 0 would
        say the run had finished)."""
        acks, devs = [], []
        for d, x in enumerate(self.actors):
            try:
                acks.append(x.abort.options(concurrency_group=CONTROL).remote(self.run))
                devs.append(d)
            except Exception:  # noqa: BLE001 - a dead actor runs nothing
                pass
        try:
            counts = dict(zip(devs, self.ray.get(acks, timeout=10.0), strict=True))
            # -1: the run is not on that actor. If its go has not run there (the first run of a
            # program waits for the actor to build its part), every task of that device is left.
            started, _ = self.ray.wait(list(self.begins), num_returns=len(self.begins), timeout=0)
            started_set = set(started)
            left = 0
            for d, c in counts.items():
                if c >= 0:
                    left += c
                elif self.begins[d] not in started_set:
                    left += sum(t.device == d for t in self.tg.tasks)
            return left
        except Exception:  # noqa: BLE001 - a count is only said; __exit__ abandons the run anyway
            return "an unknown number"

    def _check(self, r: Any, i: int, n_begins: int) -> None:
        """Raise what the finished ref ``r`` (``i``-th of the run: begins first) failed with."""
        from ray.exceptions import RayActorError, RayTaskError
        pids = self.pool.pids
        d = i if i < n_begins else i - n_begins
        try:
            self.ray.get(r)
        except RayActorError as e:
            if i < n_begins:  # nothing of this run ran on it: it died before (or as) the run began
                raise DeviceLost(f"device {d} (Ray actor pid {pids[d]}) was found dead when the run "
                                 f"began: {type(e).__name__}", before_start=True) from None
            raise DeviceLost(f"device {d} (Ray actor pid {pids[d]}) was lost during the run: "
                             f"{type(e).__name__}") from None
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, RayActorError):
                raise DeviceLost(f"a device was lost (Ray actor died) while device {d} ran: "
                                 f"{type(cause).__name__}") from None
            if i < n_begins:
                raise EinjoinError(f"device {d} could not open the run: {type(cause).__name__}: "
                                   f"{cause}") from None
            raise EinjoinError(f"the Ray backend failed on device {d}: {type(cause).__name__}: {cause}") from None

    def finish(self, stats: RunStats) -> list[np.ndarray]:
        """The run's stats from the actors' reports (intervals on the driver's clock), and its
        outputs assembled from the blocks they returned."""
        from einjoin.plan.execute import assemble_outputs
        reports = self.reports
        stats.order = "ray"
        offset = time.perf_counter() - time.time()
        for d, rep in enumerate(reports):
            stats.intervals[d] = [(s + offset, e + offset, tid) for tid, s, e in rep["intervals"]]
        stats.bytes_moved = sum(r["received"] for r in reports)
        stats.bytes_copied = stats.bytes_moved  # every move crosses processes (actor to actor)
        stats.bytes_loaded = sum(r["loaded"] for r in reports)
        stats.peak_bytes_per_device = {d: r["peak"] for d, r in enumerate(reports)}
        # bytes per (src, dst) pair as the receiving actors counted them
        self.backend.received_per_pair = {(src, d): b for d, r in enumerate(reports)
                                          for src, b in r["received_from"].items()}
        blocks = {v: b for r in reports for v, b in r["blocks"].items()}
        sent = [v for r in reports for v in r.get("sent", ())]
        if sent:
            blocks.update(self.backend._outputs.take(self.run, sent))
        outs = assemble_outputs(self.out_tg, blocks.__getitem__, self.spec.feeds)
        stats.bytes_fetched = sum(o.nbytes for o in outs)
        return outs

    def __exit__(self, exc_type: Any, e: BaseException | None, tb: Any) -> None:
        b = self.backend
        b._done()  # first, before anything that can block (a 2nd Ctrl-C in _abandon)
        b._outputs.forget(self.run)
        if e is None:
            return
        # this run only: stop what is queued, drop its namespace; other runs are untouched
        b._abandon(self.actors, self.run)
        if isinstance(e, DeviceLost):
            if self.closes != b._closes:  # close() killed the actors: not a loss to recover from
                raise EinjoinError(f"the run was stopped by RayBackend.close() ({e}); the next run "
                                   f"starts fresh actors") from None
            b._retire(self.pool, self.gen)  # once per loss, whichever run saw it first
        elif not isinstance(e, (EinjoinError, TaskFailed, KeyboardInterrupt)) and _is_ray_error(e):
            raise EinjoinError(f"the Ray backend failed: {type(e).__name__}: {e}") from None


def _unreachable(e: BaseException) -> DeviceLost:
    return DeviceLost(f"a device actor could not be reached: {type(e).__name__}: {str(e)[:200]}",
                      before_start=True)
