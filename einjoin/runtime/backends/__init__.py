"""The backends the engine runs on (each implements :class:`einjoin.runtime.backend.Backend`):
``sync`` (one inline worker, for debugging, under the same share of the cores), ``threads`` (a
worker thread per local device, numpy kernels, BLAS threads limited so that device threads times
BLAS threads fit the cores), ``null`` (runs the schedule and counts bytes, computes nothing),
``ray`` (:mod:`.ray`: an actor per device) and ``torch`` (:mod:`.torch_backend`: torch tensors
and kernels)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from einjoin.errors import EinjoinError
from einjoin.exchange import TaskKind
from einjoin.runtime.backend import Backend, RunSpec, cores, join_thread, wait_event
from einjoin.runtime.local import LocalSession
from einjoin.runtime.malloc import tune_malloc

__all__ = ["BACKENDS", "get_backend", "SyncBackend", "ThreadsBackend", "NullBackend", "BlasLimiter", "BLAS_LIMITER",
           "tune_malloc", "cores_limit"]

class _Ticket:
    """One run's share of the BLAS limit: ``n`` device threads, and whether they are counted
    (``state``: new, in, out). Entering and leaving are idempotent, and a leave that the helper
    sees first makes a late enter a no-op, so an interrupt at any point of the caller can neither
    count a run twice nor leave it counted."""

    __slots__ = ("n", "state")

    def __init__(self, n: int) -> None:
        self.n = n
        self.state = "new"


class BlasLimiter:
    """The process-wide BLAS thread limit while parallel runs are in flight.

    threadpoolctl's limits are process-wide, so nesting one ``threadpool_limits`` per run breaks
    when concurrent runs end out of order (each restores what it saw on entry: the first run to
    end restores the original, the last restores the first run's limit, for ever). Here the
    first run in saves the original limits, every entry and exit sets cores // (devices of all
    runs in flight), and the last run out restores the original limits exactly.

    A change asked for on the main thread is made on a short-lived helper thread (one asked for
    on another thread, a threaded run's device thread, is made there: no Ctrl-C reaches it, and
    the control is given up after the change, as the helper does): threadpoolctl (>= 3.6) lets
    only one live thread at a time change a pthreads OpenBLAS's limit (others are silently
    ignored), so changes made on the caller's thread would pin that control to it (a user's main
    thread, or a run's thread that is not the last one out, whose restore would then be
    ignored); the helper gives the control up and ends. When some other live thread holds it
    (the user's own ``threadpool_limits``), einjoin leaves the limits alone. A helper never
    receives a ``KeyboardInterrupt`` (Python delivers signals to the main thread), so a Ctrl-C
    on the caller cannot cut a change in half: the caller only waits (on an event, not with
    ``join``, which an interrupt confuses: CPython bpo-45274) and hands the interrupt on once
    the change is made. One ``ThreadpoolController`` (the scan of the loaded libraries, ~2 ms)
    is reused until more modules have been imported (a BLAS library arrives with an extension
    module: scipy's own OpenBLAS, loaded by a later import, is limited too); a run that leaves
    the share of the cores as it is (another run in flight set it) is counted on the caller's
    thread, without a helper, and a library already at the wanted limit is not touched. Only
    BLAS libraries are limited: the kernels are numpy's, and an OpenMP limit is per thread."""

    def __init__(self) -> None:
        # the count and the limits: held by helpers; the caller's thread only ever tries it
        # without blocking (a blocked acquire is where a Ctrl-C would land)
        self._lock = threading.Lock()
        self._devices = 0
        self._original: list[int] | None = None  # each BLAS library's limit before the first run in
        self._libs: list[Any] | None = None      # threadpoolctl's BLAS library controllers
        self._modules = 0                        # len(sys.modules) when they were scanned
        self._current: int | None = None         # the share last set (None: the original limits)
        self.changes = 0  # limit changes made (for tests and benchmarks)
        if hasattr(os, "register_at_fork"):  # a child forked mid-change must not inherit a held lock
            os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        # the parent's runs do not exist in the child: count none; the original limits are kept
        # so that the child's last run out restores them
        self._lock = threading.Lock()
        self._devices = 0

    @staticmethod
    def _share(devices: int) -> int:
        return max(1, cores() // max(1, devices))

    @property
    def devices_in_flight(self) -> int:
        """Device threads of the parallel runs in progress (0: the original limits hold)."""
        return self._devices

    # ---- on the helper thread

    def _blas_libs(self) -> list[Any]:
        # rescanned only when no limit is set (a library found mid-flight would have no original
        # limit to restore) and modules were imported since: len(sys.modules) is the cheap sign
        if self._libs is None or (self._original is None and len(sys.modules) != self._modules):
            from threadpoolctl import ThreadpoolController
            self._modules = len(sys.modules)
            self._libs = [lc for lc in ThreadpoolController().lib_controllers if lc.user_api == "blas"]
        return self._libs

    def _apply(self, ticket: _Ticket, entering: bool) -> None:
        with self._lock:
            if entering:
                if ticket.state != "new":  # left already (an interrupt before the enter came)
                    return
                ticket.state = "in"
                self._devices += ticket.n
            else:
                if ticket.state == "in":
                    self._devices -= ticket.n
                ticket.state = "out"
            libs = self._blas_libs()
            if self._devices:
                if self._original is None:
                    self._original = [lc.num_threads for lc in libs]
                self._current = self._share(self._devices)
                want = [self._current] * len(libs)
            elif self._original is not None:
                want, self._original, self._current = self._original, None, None
            else:
                return
            changed = [lc for lc, w in zip(libs, want) if lc.num_threads != w]
            for lc in changed:  # only a limit that differs: the others cost nothing
                # the library's own setter: threadpoolctl's lets only the thread that controls
                # OpenBLAS change it and ignores the others, so a user's threadpool_limits held
                # on the main thread made every run's share a silent no-op (both lanes' OpenBLAS
                # at every core, spinning: the small LLaMA trainer step ~20x its CPU)
                getattr(lc, "_real_set_num_threads", lc.set_num_threads)(want[libs.index(lc)])
            for cls in {type(lc) for lc in changed}:  # give up the OpenBLAS control (threadpoolctl >= 3.6)
                clear = getattr(cls, "clear_controlling_thread", None)
                if clear is not None:
                    clear()
            if changed:
                self.changes += 1

    # ---- on the caller's thread

    def _unchanged(self, ticket: _Ticket, entering: bool) -> bool:
        """Count ``ticket`` in or out here, without a helper, when that leaves the share of the
        cores as it is (another run in flight already set it); False: the helper must."""
        if not self._lock.acquire(blocking=False):  # never block here: a helper is at work
            return False
        try:
            if entering and ticket.state == "new":
                devices = self._devices + ticket.n
            elif not entering and ticket.state == "in":
                devices = self._devices - ticket.n
            elif not entering and ticket.state == "new":  # never counted (an interrupt came first)
                ticket.state = "out"  # an enter still on its way finds it so and does nothing
                return True
            else:
                return False
            if not (self._devices and devices and self._share(devices) == self._current):
                return self._nothing_to_set(ticket, entering, devices)
            ticket.state, self._devices = ("in" if entering else "out"), devices  # no call between
            return True
        finally:
            self._lock.release()

    def _nothing_to_set(self, ticket: _Ticket, entering: bool, devices: int) -> bool:  # under _lock
        """The first run in when every BLAS library is at its share already (one device: all the
        cores, the usual default), or the last run out when every library is back at its
        original limit: counted here, without a helper (reading a limit pins nothing), since
        the helper would change nothing. A helper thread per run cost a one-device program
        ~1-5 ms per run (its start and the wait for it, more on a loaded machine). Reads the
        libraries only once a helper has found them."""
        libs = self._libs
        if libs is None:
            return False
        if entering and not self._devices and devices:
            share = self._share(devices)
            current = [lc.num_threads for lc in libs]
            if any(c != share for c in current):
                return False
            self._original, self._current = current, share
            ticket.state, self._devices = "in", devices
            return True
        if not entering and not devices and self._original is not None:
            if [lc.num_threads for lc in libs] != self._original:
                return False
            self._original = self._current = None
            ticket.state, self._devices = "out", 0
            return True
        return False

    def _send(self, ticket: _Ticket, entering: bool) -> BaseException | None:
        """Have the helper enter or leave ``ticket`` and wait until it has; returns a
        KeyboardInterrupt that arrived meanwhile (deferred: the change is made first)."""
        if self._unchanged(ticket, entering):
            return None
        if threading.current_thread() is not threading.main_thread():
            # no Ctrl-C reaches this thread, and _apply gives the OpenBLAS control up after a
            # change: made here, without a helper (a run's device thread, LocalSession._lanes_limit)
            self._apply(ticket, entering)
            return None
        done, began = threading.Event(), threading.Event()
        box: list[BaseException] = []

        def helper() -> None:
            began.set()
            try:
                self._apply(ticket, entering)
            except Exception as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            finally:
                done.set()
        th = threading.Thread(target=helper, name="einjoin-blas-limit", daemon=True)
        interrupted = None
        try:
            th.start()
        except KeyboardInterrupt as e:
            # start() waits for the new thread to begin: cut short there, the helper exists and
            # begins at once (wait for it as usual); cut before its creation, there is none.
            # Either way the tickets keep the count right.
            interrupted = e
            while True:
                try:
                    if not began.wait(1.0):
                        return e
                    break
                except KeyboardInterrupt:
                    pass
        while True:
            try:
                # an Event only the helper sets, never join()/is_alive() alone: an interrupt
                # inside join() marks a live thread stopped (CPython bpo-45274); in slices, so
                # that a Ctrl-C landing just before the wait is seen (see wait_event)
                if wait_event(done):
                    break
            except KeyboardInterrupt as e:
                interrupted = e
        while True:  # its work is done: wait for its end, so that no thread outlives the run
            try:
                join_thread(th)
                break
            except KeyboardInterrupt as e:
                interrupted = e
        if box:
            raise box[0]
        return interrupted

    @contextlib.contextmanager
    def limit(self, n_devices: int) -> Iterator[None]:
        """Hold a share of the cores for ``n_devices`` device threads while the block runs (the
        last run out restores the original limits). A Ctrl-C anywhere in here leaves the count
        and the limits as they were before the block."""
        ticket = _Ticket(max(1, n_devices))
        try:
            pending = self._send(ticket, True)
            if pending is not None:
                raise pending
            yield
        finally:
            late = None
            while ticket.state != "out":  # idempotent: resent if an interrupt cut the send short
                try:
                    late = self._send(ticket, False) or late
                except KeyboardInterrupt as e:
                    late = e
        if late is not None:  # the block ended normally: the interrupt goes on now
            raise late


BLAS_LIMITER = BlasLimiter()


@dataclass(frozen=True)
class SyncBackend:
    """One inline worker runs every task (debugging: deterministic, one thread), under the threads
    backend's share of the cores for the program's devices (:func:`share_of_cores`)."""

    name: str = "sync"
    computes: bool = True
    remote: bool = False
    retries: int = 0

    def open(self, run: RunSpec) -> LocalSession:
        if not self.computes:  # null: no kernel runs, no limit to hold
            return LocalSession(run, False, threaded=False)
        tune_malloc()
        return LocalSession(run, True, threaded=False, limit=share_of_cores(run))

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class NullBackend(SyncBackend):
    """Runs the schedule and counts the plan's bytes; computes nothing (``run`` returns None)."""

    name: str = "null"
    computes: bool = False


@dataclass(frozen=True)
class ThreadsBackend:
    """A worker thread per device (and a host-transfer lane per device under a memory cap or an
    emulated host link); BLAS threads limited so that device threads x BLAS threads <= cores,
    process-wide, while runs are in flight (:data:`BLAS_LIMITER`)."""

    name: str = "threads"
    computes: bool = True
    remote: bool = False
    retries: int = 0

    def open(self, run: RunSpec) -> LocalSession:
        if self.computes:
            tune_malloc()
        return LocalSession(run, self.computes, threaded=True, limit=share_of_cores(run))

    def close(self) -> None:
        pass


def share_of_cores(run: RunSpec) -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """The limit a local run holds (``limit(n_devices)``): :func:`cores_limit`, with the program's
    main pool (:func:`_main_pool`) when a device's share is several cores and torch is loaded.
    The threads backend's lanes hold it, and so does the sync backend's inline worker: unlimited,
    its numpy calls opened every core's OpenBLAS threads and torch's OpenMP team after them, each
    pool's spinning workers taking the cores from the other (a small LLaMA trainer step on
    local(2): 1.27 s of CPU, 64 ms held, the threads backend's 62 ms)."""
    if run.engine.tg.n_devices < cores() and "torch" in sys.modules:
        return functools.partial(cores_limit, pool=_main_pool(run.engine))
    return cores_limit


_POOLS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # engine -> its main pool


def _main_pool(engine: Any) -> str:
    """Which thread pool does most of an engine's kernel flops: ``"torch"`` (attention,
    convolutions, pools, top-k run on torch's CPU kernels, :data:`ray_worker.PRELOAD_FACTS`) or
    ``"blas"`` (numpy's contractions), by the kernels' modelled flops; once per engine (program)."""
    got = _POOLS.get(engine)
    if got is not None:
        return got
    from einjoin.ir.node import rule_for
    from einjoin.runtime.backends.ray_worker import PRELOAD_FACTS
    flops = {"torch": 0, "blas": 0}
    for t in engine.tg.tasks:
        if t.kind is TaskKind.KERNEL and t.flops:
            pool = "torch" if "torch" in rule_for(PRELOAD_FACTS, t.node.op, "preload") else "blas"
            flops[pool] += t.flops
    _POOLS[engine] = main = "torch" if flops["torch"] > flops["blas"] else "blas"
    return main


@contextlib.contextmanager
def cores_limit(n_devices: int, pool: str | None = None) -> Iterator[None]:
    """The threads backend's share of the cores: BLAS threads, and torch's intra-op threads when
    torch is loaded (the attention, convolution and pooling kernels run on torch's CPU kernels:
    with torch's own count, 2 device threads each opened a team of 2 OpenMP threads on 2 cores,
    whose spinning workers took the cores the other device computed on).

    ``pool``: with fewer devices than cores a device's share is several threads, and two pools of
    them on the same cores fight: OpenBLAS's workers spin after a call, so a torch call right after
    a numpy matmul waited for them (an attention of 0.12 ms took 4 ms, measured; vit-tiny on one
    device 125 ms against 48 ms on two). The pool doing most of the program's flops gets the
    share, the other one thread."""
    n_cores = cores()
    blas_n, torch_n = n_devices, n_devices
    if pool == "torch":
        blas_n = max(n_devices, n_cores)   # counted as `cores` devices: one BLAS thread
    elif pool == "blas":
        torch_n = max(n_devices, n_cores)
    with BLAS_LIMITER.limit(blas_n):
        if "torch" not in sys.modules:  # not loaded: no torch kernel can run (and none is imported)
            yield
            return
        from einjoin.runtime.backends.torch_backend import TORCH_THREADS
        with TORCH_THREADS.limit(torch_n):
            yield


BACKENDS: dict[str, Any] = {"sync": SyncBackend(), "threads": ThreadsBackend(), "null": NullBackend()}


def get_backend(name: Any) -> Any:
    """The backend named ``name`` (``sync``, ``threads``, ``null``, ``ray``, ``torch``, ``simulate``), or
    ``name`` itself
    when it already is a backend object."""
    if not isinstance(name, str) and isinstance(name, Backend):
        return name
    if isinstance(name, str) and name == "ray":  # a fresh one per program: it owns that program's actors
        from einjoin.runtime.backends.ray import RayBackend
        return RayBackend()
    if isinstance(name, str) and name == "torch":  # imported on first use: torch is slow to import
        from einjoin.runtime.backends.torch_backend import TorchBackend
        return TorchBackend()
    if isinstance(name, str) and name == "simulate":  # einjoin.runtime.simulate: no data, simulated times
        from einjoin.runtime.simulate import SimulateBackend
        return SimulateBackend()
    if not isinstance(name, str) and hasattr(name, "context") and not hasattr(name, "open"):
        # the interface before issue 17 (parallel, context()): say what replaced it
        raise EinjoinError(f"backend {name!r} has the old interface (parallel, context()); a backend now "
                           "implements einjoin.runtime.backend.Backend (name, computes, remote, retries, "
                           "open(run) -> session, close()): see docs/architecture.md, Backends")
    if not isinstance(name, str) or name not in BACKENDS:  # a list would be unhashable
        raise EinjoinError(f"unknown backend {name!r}; known: {', '.join([*BACKENDS, 'ray', 'torch', 'simulate'])}, "
                           "or an object "
                           "implementing einjoin.runtime.backend.Backend")
    return BACKENDS[name]
