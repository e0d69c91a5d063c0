"""``ej.compile`` and the :class:`Program` it returns: a compiled plan (the pipeline in
:mod:`einjoin.compiler`) with an engine to run it (``run``, ``run_async``, ``cancel``, ``explain``).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (64, 32)); w = ej.input("w", (32, 16))
>>> prog = ej.compile(ej.softmax(x @ w), devices=4)
>>> out = prog.run(np.ones((64, 32), np.float32), np.ones((32, 16), np.float32))
>>> out.shape, prog.stats.bytes_loaded == (64 * 32 + 32 * 16) * 4, prog.run_stats.bytes_moved == prog.stats.bytes_moved
((64, 16), True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from einjoin.cluster import Cluster, as_cluster
from einjoin.compiler import CompiledPlan, CompileOptions, Source, build_plan, check_quiet
from einjoin.decomp.spec import JoinAggSpec
from einjoin.errors import DTypeError, EinjoinError
from einjoin.ir.dtypes import INT_DTYPES
from einjoin.ir.node import Node
from einjoin.ir.reference import bind_feeds
from einjoin.progress import RunBar
from einjoin import program_io
from einjoin.program_explain import explain_program
from einjoin.plan import PlanStats, run_reference
from einjoin.plan.execute import unshared
from einjoin.runtime import Engine, RunStats
from einjoin.runtime.engine import (CancelToken, RunHandle, check_callbacks, check_host_link, check_order,
                                    check_seed)
from einjoin.program_state import ProgramState
from einjoin.runtime.state import Resident
from einjoin.runtime.turns import Turns
from einjoin.variants import ShapeCache, Signature, bind_call, example_tensors, shown, signature

__all__ = ["compile", "load", "Program", "ProgramRunStats", "TraceWriteWarning", "CompileOptions", "CompiledPlan"]

log = logging.getLogger(__name__)  # "einjoin.program": compiles for new shapes, with their time

_nothing = contextlib.nullcontext


def _shapes(shapes: Mapping[str, tuple[int, ...]]) -> str:
    return ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items())


@dataclass
class ProgramRunStats(RunStats):
    """A run's :class:`~einjoin.runtime.engine.RunStats` and the shape cache's view of it (an
    imported torch module's program): ``cache_key``, the shape signature of the program that ran
    (``((argument, shape), ...)``; None for the shapes ``ej.compile`` compiled for, and for a
    program not imported from torch), and the cache's ``cache_hits`` / ``cache_misses`` so far
    (a run with the compiled shapes is a hit; a miss compiled a program)."""

    cache_key: Signature | None = None
    cache_hits: int = 0
    cache_misses: int = 0


class TraceWriteWarning(UserWarning):
    """A finished run's trace could not be written (a full disk, ...): the results are returned."""


def compile(outputs: Any, devices: int | Cluster = 1, *, planner: Any = "auto",
            backend: Any = "threads", specs: Any = None, placement: str = "greedy",
            order: str = "fifo", seed: int = 0, quiet: bool = False, memory_limit: Any = None,
            memory_policy: str = "belady", host_link: float | None = None,
            state: Mapping[Any, Any] | None = None, deterministic: bool = False,
            fuse: bool = True, shape_cache: int | None = 8, leave_idle: bool = False,
            objective: str | None = None, blocks: Mapping[str, int] | None = None,
            relational: Any = None, engine: str | None = None) -> Program:
    """Compile ``outputs`` (a tensor or a list/tuple of them, or ``ej.from_torch``'s result) for
    ``devices`` (an int = that many local devices, or an :class:`ej.Cluster`); every other option
    is keyword-only (:class:`~einjoin.compiler.CompileOptions` checks them, and the program keeps
    them as ``prog.plan.options``). ``specs`` overrides the planner's join-agg spec for some
    nodes; ``placement`` names a placer; ``order`` is the ready-queue policy. Large graphs show
    progress on a terminal unless ``quiet`` (which also holds for the program's runs).

    ``memory_limit`` caps each device's memory (bytes or a string such as ``"2GiB"``, or a
    mapping device -> size; default: the cluster's ``Device.memory``). Under a cap, ops whose
    single kernel would not fit are cut finer, and the task graph is memory-planned
    (:mod:`einjoin.memplan`, ``memory_policy`` "belady" or "naive"): blocks are evicted to host
    RAM and reloaded so that every run, in any order, stays within the cap. ``host_link`` (bytes
    per second) emulates a host<->device link for the program's runs.

    ``state`` (``{new_value: state_input}``) makes a program that carries values from one run to
    the next (parameters, optimizer moments, a step count): each new value is computed by every
    run but not returned; it stays resident on its devices and is the state input's value in the
    next run (see :meth:`Program.read_state`, :meth:`Program.write_state`). Shapes and dtypes of
    a pair must agree, and the state input must be a graph input. Every planner cuts and places a
    state input as its new value, so the carry-over moves nothing. ``deterministic``: the runs'
    results are bit-identical (partials combine in a fixed order; see
    :mod:`einjoin.runtime.state`). ``fuse``: chains of elementwise ops are fused into one node
    each before planning (:mod:`einjoin.ir.fuse`: fewer tasks and passes over memory, the same
    values; ``explain()`` shows the fused expressions); ``fuse=False`` plans the graph as written.
    ``leave_idle``: on local devices, plan on only as many as pay when the work per block is
    below the per-task overhead (:mod:`einjoin.planner.overhead`; ``explain()`` says so).
    ``objective``: ``"bytes"`` or ``"time"`` (bytes weighed by the links they cross); None:
    ``"time"`` on a preset cluster of several nodes, ``"bytes"`` otherwise.

    *Sparse einsums* (``ej.einsum`` with an ``ej.sparse`` / ``ej.sparse_input`` operand): ``blocks=
    {"j": 256}`` pins label ``j``'s block size (relational), ``relational={"i"}`` keeps ``i``
    relational (upper case), ``engine="memory"`` or ``"duckdb"`` selects their executor, for every
    sparse einsum that has the label (:mod:`einjoin.sparse.pins`; ``explain()`` shows the layouts).
    A label no sparse einsum has, a block larger than its label, or pins on a graph without sparse
    einsums are refused naming it.

    *Shapes that change.* A program compiled from ``ej.from_torch(module, example)`` may be
    called with other shapes: the module is imported again for them, compiled with the same
    devices and options, and kept per shape signature in an LRU of ``shape_cache`` programs (None:
    no bound), so a shape seen before costs nothing more (``run_stats.cache_key``,
    ``cache_hits``, ``cache_misses``; each compile's time is logged by the ``einjoin.program``
    logger). With ``from_torch(..., dynamic={"x": {0: "batch"}})`` only the named dims may change
    (else a :class:`ShapeError` naming the argument and dim); without it, any may. The parameters
    are the ones bound at compile time. A program with state, or with ``specs``, runs the
    shapes it was compiled for only; so does one built from tensors (a wrong shape is an error).

    >>> import einjoin as ej
    >>> prog = ej.compile(ej.input("a", (8, 4)) @ ej.input("b", (4, 2)), devices=2, quiet=True)
    >>> prog.plan.options.planner, prog.cluster.size
    ('auto', 2)
    """
    cluster = as_cluster(devices)
    options = CompileOptions(planner=planner, backend=backend, specs=specs, placement=placement,
                             order=order, seed=seed, quiet=quiet, memory_limit=memory_limit,
                             memory_policy=memory_policy, host_link=host_link, state=state,
                             deterministic=deterministic, fuse=fuse, shape_cache=shape_cache,
                             leave_idle=leave_idle, objective=objective, blocks=blocks,
                             relational=relational, engine=engine)
    outputs, writes = _buffer_writes(outputs)
    source = Source.of(outputs, options.state)
    warm = getattr(options.backend, "warm", None)
    if warm is not None and memory_limit is None:  # Ray: the actors start while the plan is made
        warm(cluster, source.graph)
    return Program(build_plan(source, cluster, options), writes, getattr(outputs, "guard", None))


def _buffer_writes(fn: Any) -> tuple[Any, Any]:
    """An imported forward that writes buffers (``self.n += 1``, BatchNorm's running statistics):
    the import computing their new values too, and how a run writes them back into the module
    (:mod:`einjoin.frontend.buffer_writes`); anything else as it is, and None."""
    if not getattr(fn, "buffer_updates", None):
        return fn, None
    from einjoin.frontend.buffer_writes import with_buffer_outputs  # a from_torch result: loaded
    return with_buffer_outputs(fn)


def load(path: str | os.PathLike[str], *, backend: Any = None) -> Program:
    """The program :meth:`Program.save` wrote to ``path``, ready to run: nothing is planned,
    placed or lowered again, and its runs give the saved program's results bit for bit (its
    state too). ``backend`` overrides the saved backend (a name or a backend object). A
    truncated, corrupted or newer file, or one that is not an einjoin program, raises an
    :class:`EinjoinError` that says which; loading never unpickles nor evaluates anything.

    >>> import numpy as np, tempfile, os, einjoin as ej
    >>> prog = ej.compile(ej.softmax(ej.input("x", (6, 5))), devices=2, quiet=True)
    >>> path = os.path.join(tempfile.mkdtemp(), "softmax.einjoin")
    >>> prog.save(path)
    >>> x = np.arange(30, dtype=np.float32).reshape(6, 5)
    >>> bool((ej.load(path).run(x) == prog.run(x)).all())
    True
    """
    plan, state = program_io.read(path, backend)
    prog = Program(plan)
    if state:
        prog.write_state(state)
    return prog


def returned(outs: Sequence[Any], many: bool, structure: Any) -> Any:
    """A run's results as the program returns them: rebuilt in ``structure`` (an imported
    forward's :class:`~einjoin.frontend.torch_args.OutputTree`: a dict, a nested tuple, a NamedTuple, a
    Hugging Face ModelOutput), else a tuple if ``many``, else the one result."""
    if structure is not None:
        return structure.unflatten(outs)
    return tuple(outs) if many else outs[0]


class _Guarded:
    """A user callback of a serialised program's run, marking its thread while it runs (so that
    a call back into the same program is refused, not a deadlock)."""

    def __init__(self, callback: Any, marks: threading.local):
        self.callback, self.marks = callback, marks

    def on_start(self, task: Any) -> None:
        self.marks.depth = getattr(self.marks, "depth", 0) + 1
        try:
            self.callback.on_start(task)
        finally:
            self.marks.depth -= 1

    def on_end(self, task: Any, start: float, end: float) -> None:
        self.marks.depth = getattr(self.marks, "depth", 0) + 1
        try:
            self.callback.on_end(task, start, end)
        finally:
            self.marks.depth -= 1


def _same_int_dtypes(graph: Any, arg_names: Sequence[str], given: Mapping[str, Any]) -> None:
    """An imported module's integer argument in another integer dtype than the import's is refused:
    torch computes in the argument's dtype (uint8 * 3 wraps at 256), the program in the import's
    (an exact feed cast would widen it and change the values)."""
    for name in arg_names:
        v = given.get(name)
        dt = getattr(v, "dtype", None)
        if dt is None or name not in graph.input_by_name:
            continue
        got, want = str(dt).removeprefix("torch."), graph.input_by_name[name].dtype
        if got != want and got in INT_DTYPES and want in INT_DTYPES:
            raise DTypeError(f"input {name!r}: the module was imported with a {want} argument and is given "
                             f"{got}; torch computes in the argument's dtype (wrapping differently): import "
                             f"it with a {got} example (ej.from_torch), or cast the argument to {want}")


def _bound_now(bound: Mapping[str, Any] | None) -> dict[str, Any]:
    """An imported module's bound values for this run: its tensors (``LiveTensor``) viewed where
    their storage is now, not where it was at import (``share_memory_()`` moves it and frees the
    old block: see einjoin.frontend.bound_tensors.LiveTensor)."""
    if not bound:
        return {}
    return {k: v if isinstance(v, np.ndarray) or not hasattr(v, "now") else v.now() for k, v in bound.items()}


class Program(ProgramState):
    """A compiled program: the graph, its specs and placement, the task graph, and the engine.

    Thread-safe to run: concurrent ``run`` / ``run_async`` calls of one program (threads, sync,
    null and Ray backends) are independent runs, each with its own feeds, stores, results and
    cancellation; ``run_stats`` is the stats of the run that finished last. The runs of a
    program with state (``ej.compile(..., state=...)``) are serialised instead: each starts from
    the state the previous one left (a failed or cancelled run leaves it unchanged); so are those
    of a ``deterministic`` program (concurrent runs would change the BLAS threads each kernel gets,
    and OpenBLAS's sums depend on them).

    Built from a :class:`~einjoin.compiler.CompiledPlan` (``prog.plan``); its parts are also
    attributes (``graph``, ``cluster``, ``decomps``, ``placement``, ``taskgraph``, ``stats``), as
    are the backend and the run defaults of its options (``order``, ``seed``, ``quiet``,
    ``host_link``)."""

    def __init__(self, plan: CompiledPlan, writes: Any = None, guard: Any = None):
        self.plan = plan
        self.graph = plan.graph
        self.cluster = plan.cluster
        self.decomps = plan.decomps
        self.placement = plan.placement
        self.taskgraph = plan.taskgraph
        self.stats: PlanStats = plan.stats
        options = plan.options
        self.backend = options.backend
        self.order = options.order
        self.seed = options.seed
        self.quiet = bool(options.quiet)                # no progress display
        self.host_link = options.host_link              # emulated host<->device bytes per second
        self._many = plan.many
        self._structure = plan.structure                # an imported forward's output pytree (or None)
        self._arg_names = plan.arg_names                # set for an imported torch module
        self._bound = plan.bound
        # the buffers an imported forward writes: after the forward's results, written back by
        # each run, one run at a time (each reads the buffers the one before wrote)
        self._writes = writes
        self._guard = guard  # an imported module's types and settings as imported: checked per run
        if writes is not None:
            self._many, self._structure = writes.many, writes.structure
        self.run_stats: RunStats | None = None
        self._slots = plan.state
        self.deterministic = bool(options.deterministic)
        self._serial = bool(plan.state) or self.deterministic or writes is not None
        self._state_names = frozenset(s.name for s in plan.state)
        # programs for other shapes (an imported module): shared with them, with its counts
        self._variants: ShapeCache[Program] | None = (
            ShapeCache(options.shape_cache) if plan.recapture is not None else None)
        self._key: Signature | None = None   # the signature this program was compiled for (None: ej.compile's)
        self._parent: Program | None = None  # the program whose cache holds this one
        self._fresh()
        if self._bound and plan.state:  # an imported module's bound parameters: the first state
            first = {s.name: self._bound.pop(s.name) for s in plan.state if s.name in self._bound}
            if first:
                self.write_state(first)

    def _fresh(self) -> None:
        """What a program holds only while it lives in one process (made again on unpickling): the
        engine (made on first run), the locks, the runs in progress, the resident state."""
        self._made_engine: Engine | None = None
        self._runs_lock = threading.Lock()
        self._active: set[CancelToken] = set()  # the runs in progress, for cancel()
        self._in_callback = threading.local()  # set while a user callback of a serialised run runs
        self._resident = Resident()
        self._turns = Turns()  # a serialised program's runs: in the order they were submitted

    def __getstate__(self) -> dict[str, Any]:
        """Plain data: the plan, the options, the state's current values (host arrays); no
        engine, lock or thread. The graph's nodes go first, in topological order, so that a deep
        graph pickles without deep recursion (each node's inputs are pickled before it)."""
        state: dict[str, Any] = {"_nodes": self.graph.nodes}
        skip = {"_made_engine", "_runs_lock", "_active", "_in_callback", "_resident", "_turns", "run_stats"}
        state.update((k, v) for k, v in self.__dict__.items() if k not in skip)
        if self._slots:
            with self._resident.lock:
                have = [s.name for s in self._slots if self._resident.has(s.node)]
            state["_state_values"] = self.read_state(have) if have and self.backend.computes else {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.pop("_nodes", None)
        values = state.pop("_state_values", None)
        state.setdefault("_structure", None)  # pickled by an einjoin that returned flat tuples
        state.setdefault("_writes", None)
        state.setdefault("_guard", None)
        self.__dict__.update(state)
        self.run_stats = None
        self._fresh()
        if values:
            self.write_state(values)

    @property
    def _engine(self) -> Engine:
        """The engine running this program's task graph (made on first use)."""
        engine = self._made_engine
        if engine is None:
            with self._runs_lock:
                if self._made_engine is None:
                    self._made_engine = Engine(self.taskgraph, self.decomps)
                engine = self._made_engine
        return engine

    # ---- shapes that change (an imported torch module)

    def _for_shapes(self, args: Sequence[Any], feeds: Mapping[str, Any]) -> Program:
        """The program for the shapes of this run's forward arguments: this one, or one from the
        shape cache (compiled now on a miss). Counts the cache's hits and misses."""
        cache = self._variants
        if cache is None or self._arg_names is None:
            return self
        given = {**dict(zip(self._arg_names, args)),
                 **{k: v for k, v in feeds.items() if k in self._arg_names}}
        compiled = {n: self.graph.input_by_name[n].shape for n in self._arg_names if n in self.graph.input_by_name}
        key = signature(self._arg_names, compiled, given, self.plan.dynamic)
        if key is None:
            with cache.lock:
                cache.hits += 1
            return self
        if self._slots:
            raise EinjoinError(f"this program has state ({', '.join(map(repr, self.state))}), which is laid "
                               f"out for the shapes it was compiled for ({_shapes(compiled)}); got "
                               f"{_shapes(dict(key))}: compile one program per shape (its state is not carried over)")
        if self.plan.options.specs:
            raise EinjoinError(f"this program was compiled with specs= for the nodes of its graph at shapes "
                               f"{_shapes(compiled)}; got {_shapes(dict(key))}: compile another program for them")
        with cache.lock:  # one compile per signature, however many threads ask
            prog = cache.get(key)
            if prog is None:
                prog = self._compile_for(key, given)
                cache.put(key, prog)
        return prog  # type: ignore[no-any-return]

    def _compile_for(self, key: Signature, given: Mapping[str, Any]) -> Program:
        """Import the module again for the shapes ``key`` and compile it as this program was."""
        assert self._arg_names is not None
        shapes = dict(key)
        dtypes = {n: self.graph.input_by_name[n].dtype for n in shapes}
        start = time.perf_counter()
        examples = example_tensors(self._arg_names, shapes, dtypes, given)
        # the forward's tensors positionally in arg_names order (TorchFunction.recapture's contract:
        # the import puts keyword tensors and non-tensor arguments back where they were)
        fn, writes = _buffer_writes(self.plan.recapture(examples, {}))
        if writes is not None and self._writes is not None:  # write where this program writes
            mine_at = dict(zip(self._writes.names, self._writes.targets))
            writes = dataclasses.replace(writes, targets=tuple(mine_at.get(n, t) for n, t in
                                                               zip(writes.names, writes.targets)))
        if len(fn.outputs) != len(self.graph.outputs) or tuple(fn.arg_names) != self._arg_names:
            raise EinjoinError(f"the module imported again for shapes {_shapes(shapes)} has {len(fn.outputs)} "
                               f"outputs and arguments {', '.join(fn.arg_names)}; the compiled one "
                               f"{len(self.graph.outputs)} and {', '.join(self._arg_names)}")
        if self._guard is not None:  # a forward may read other settings at other shapes: guard them too
            self._guard = self._guard.union(getattr(fn, "guard", None))
        source = Source.of(fn)
        if source.bound and self._bound:  # the parameters bound at compile time, not the module's now
            mine = self._bound
            source = dataclasses.replace(source, bound={
                k: (mine[k] if k in mine and np.shape(mine[k]) == np.shape(v) else v) for k, v in source.bound.items()})
        # with leave_idle, the devices asked for (the plan may have left some idle for these shapes)
        prog = Program(build_plan(source, self.plan.given or self.cluster, self.plan.options), writes)
        prog._key, prog._parent, prog._variants = key, self, None
        if writes is not None:  # runs of every shape write the same buffers: one at a time
            prog._resident.lock, prog._turns = self._resident.lock, self._turns
        assert self._variants is not None
        log.info("compiled %d ops for shapes %s in %.3f s (%d program(s) cached before, LRU of %s)",
                 len(prog.graph.ops), shown(shapes, given), time.perf_counter() - start, len(self._variants),
                 self._variants.maxsize)
        return prog

    def _cache_stats(self, stats: RunStats) -> ProgramRunStats:
        cache = (self._parent or self)._variants
        if cache is None:
            return ProgramRunStats(**vars(stats))
        return ProgramRunStats(**vars(stats), cache_key=self._key, cache_hits=cache.hits, cache_misses=cache.misses)

    @property
    def shape_cache(self) -> ShapeCache[Program] | None:
        """The programs compiled for other shapes (an imported module's; None otherwise)."""
        return self._variants

    def _torch_call(self, args: Sequence[Any], feeds: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """An imported module called as torch calls it (``run(x, (h, c), scale=2.0)``) as the
        graph's own call: tuples flattened as at the import, non-tensor arguments checked
        against the import's values (an error names a different one) and dropped."""
        if self._guard is not None:  # module.eval() / .train() / a setting changed: refused, not stale
            self._guard.check()
        if self._arg_names is None:
            return tuple(args), feeds
        return bind_call(self.plan.call, self._arg_names, args, feeds)

    def _bind(self, args: Sequence[Any], feeds: dict[str, Any]) -> dict[Node, np.ndarray]:
        """The run's feeds by node; a state input not given is left out (the state supplies it)."""
        optional = self._state_names  # a state input not given: the state supplies it
        if self._arg_names is None:
            return bind_feeds(self.graph, args, feeds, optional)
        if len(args) > len(self._arg_names):
            raise EinjoinError(f"{len(args)} positional inputs given but the module's forward takes "
                               f"{len(self._arg_names)}: {', '.join(self._arg_names)}")
        named = dict(zip(self._arg_names, args))
        for k in feeds:
            if k in named:
                raise EinjoinError(f"input {k!r} is given both by position and by name")
        used = self.graph.input_by_name
        # a forward argument the graph never reads (unused, or an alias of another) is accepted
        # and ignored, as torch would; TorchFunction.notes says which
        missing = [n for n in self._arg_names if n in used and n not in named and n not in feeds]
        if missing:
            raise EinjoinError(f"missing forward argument(s): {', '.join(missing)}")
        given = {k: v for k, v in {**named, **feeds}.items() if k in used or k not in self._arg_names}
        _same_int_dtypes(self.graph, self._arg_names, given)
        return bind_feeds(self.graph, (), {**_bound_now(self._bound), **given}, optional)

    @property
    def specs(self) -> dict[Node, JoinAggSpec]:
        return {n: d.spec for n, d in self.decomps.items()}

    def run(self, *args: Any, order: str | None = None, seed: int | None = None,
            callbacks: Sequence[Any] = (), trace: str | os.PathLike[str] | None = None,
            quiet: bool | None = None, host_link: float | None = None,
            cancel: CancelToken | None = None, **feeds: Any) -> Any:
        """Run with positional inputs (declaration order) and/or inputs by name. Returns numpy
        arrays (a tuple for several outputs), or torch tensors when torch tensors went in; the
        null backend returns None. ``order`` overrides the ready-queue policy for this run.
        ``trace``: write a Chrome / Perfetto trace of this run (one track per device) to that
        path (its folder is created first), also when the run fails (what was recorded; then the
        error is raised); when a finished run's trace cannot be written (a full disk) the results
        are returned and a :class:`TraceWriteWarning` says why. Large task graphs show a progress
        bar on a terminal unless ``quiet`` (default: the compile's). ``host_link``: emulated
        host<->device bytes per second (default: the compile's). ``cancel``: a
        :class:`~einjoin.runtime.engine.CancelToken` that cancels this run (also before it starts).

        Every argument and feed is checked before any task runs. A ``KeyboardInterrupt`` (Ctrl-C,
        or raised by a callback) stops the run and propagates as it is; the program stays usable.
        Several threads may run one program at once."""
        cancel = self._take_cancel(cancel, feeds)
        args, feeds = self._torch_call(args, feeds)
        prog = self._for_shapes(args, feeds)
        token = CancelToken()
        return prog._run(args, feeds, order, seed, callbacks, trace, quiet, host_link, cancel, token, None)

    def run_async(self, *args: Any, **kw: Any) -> RunHandle:
        """Start a run on a new thread and return its :class:`~einjoin.runtime.engine.RunHandle`
        (``result(timeout=None)``, ``done()``, ``cancel()``, ``stats``). Takes what :meth:`run`
        takes; arguments and feeds are checked here, before it returns. A program that must run
        one run at a time (state, buffer writes, ``deterministic=True``) runs queued runs in the
        order they were started, each seeing the previous one's writes."""
        cancel = self._take_cancel(kw.pop("cancel", None), kw)
        opts = {k: kw.pop(k) for k in ("order", "seed", "callbacks", "trace", "quiet", "host_link") if k in kw}
        args, kw = self._torch_call(args, kw)
        prog = self._for_shapes(args, kw)
        token = CancelToken()
        handle = RunHandle(token)
        prepared = prog._prepare(args, kw, opts.get("order"), opts.get("seed"), opts.get("callbacks", ()),
                                 opts.get("trace"), opts.get("quiet"), opts.get("host_link"), cancel)

        def target() -> None:
            try:
                out = prog._execute(prepared, token, handle)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever calls result()
                handle._set(False, exc, None)
            else:
                handle._set(True, out, handle.stats)
        with self._runs_lock:  # in progress from now on: a Program.cancel() right after reaches it
            self._active.add(token)
        handle.thread = threading.Thread(target=target, name="einjoin-run", daemon=True)
        try:
            handle.thread.start()
        except BaseException:
            if prepared["ticket"] is not None:  # never runs: the runs after it must not wait for it
                prog._turns.done(prepared["ticket"])
            raise
        return handle

    def _take_cancel(self, cancel: Any, feeds: dict[str, Any]) -> Any:
        """``cancel=`` is the run's token, unless the graph has an input named ``cancel`` and the
        value is not a token: then it is that input's feed (moved into ``feeds``)."""
        if cancel is not None and not isinstance(cancel, CancelToken) and "cancel" in self.graph.input_by_name:
            feeds["cancel"] = cancel
            return None
        return cancel

    def cancel(self) -> None:
        """Cancel every run of this program in progress at the moment of the call (from any
        thread); each raises ``EinjoinError("run cancelled ...")``. Later runs are not affected:
        to cancel one run only, use ``run(..., cancel=token)`` or ``run_async(...).cancel()``.
        Runs of the programs compiled for other shapes are this program's runs too."""
        with self._runs_lock:
            active = list(self._active)
        for tok in active:
            tok.cancel()
        for prog in self._variants.values() if self._variants is not None else ():
            prog.cancel()

    # ---- one run: check everything, then execute

    def _run(self, args: Sequence[Any], feeds: dict[str, Any], order: Any, seed: Any, callbacks: Any,
             trace: Any, quiet: Any, host_link: Any, cancel: Any, token: CancelToken,
             handle: RunHandle | None) -> Any:
        prepared = self._prepare(args, feeds, order, seed, callbacks, trace, quiet, host_link, cancel)
        return self._execute(prepared, token, handle)

    def _prepare(self, args: Sequence[Any], feeds: dict[str, Any], order: Any, seed: Any, callbacks: Any,
                 trace: Any, quiet: Any, host_link: Any, cancel: Any) -> dict[str, Any]:
        """Check every argument (each error names it) and bind the feeds, before any task runs."""
        order = check_order(self.order if order is None else order, "order")
        seed = check_seed(self.seed if seed is None else seed, "seed")
        try:
            callbacks = check_callbacks(callbacks)
        except TypeError as e:  # an iterable that cannot be iterated (a 0-d array)
            raise EinjoinError(f"callbacks must be a list of objects with on_start(task) and on_end(task, "
                               f"start, end) methods, got {type(callbacks).__name__} {callbacks!r:.60} "
                               f"({e})") from None
        check_quiet(quiet)
        host_link = self.host_link if host_link is None else host_link
        check_host_link(host_link)
        if cancel is not None and not isinstance(cancel, CancelToken):
            raise EinjoinError(f"cancel must be an einjoin CancelToken (einjoin.runtime.CancelToken()), got "
                               f"{type(cancel).__name__} {cancel!r:.60}")
        trace_path = None
        if trace is not None:  # its folder made (or refused) now, not after the run
            from einjoin.viz.trace import output_path
            trace_path = output_path(trace, "trace=")
        values = self._bind(args, feeds)  # every feed checked before any kernel runs
        use_torch = any(type(v).__module__.startswith("torch") for v in (*args, *feeds.values()))
        # the buffers the forward writes, not fed by the caller: read again when the run starts
        reread = () if self._writes is None else tuple(n for n in self._writes.names if n not in feeds)
        # a serialised run's turn: taken once every check passed, so _execute always follows
        ticket = self._turns.take() if self._serial else None
        return dict(values=values, reread=reread, use_torch=use_torch, order=order, seed=seed, callbacks=callbacks,
                    trace=trace_path, quiet=self.quiet if quiet is None else bool(quiet),
                    host_link=host_link, cancel=cancel, ticket=ticket)

    def _execute(self, p: dict[str, Any], token: CancelToken, handle: RunHandle | None) -> Any:
        """Run a prepared run; a serialised program's runs in the order they were prepared (a
        thread per run_async takes the run lock in no set order: queued runs of a module that
        writes a buffer returned 1, 3, 2). Its turn ends when it returns or fails."""
        try:
            return self._execute_in_turn(p, token, handle)
        finally:
            if p.get("ticket") is not None:
                self._turns.done(p["ticket"])

    def _execute_in_turn(self, p: dict[str, Any], token: CancelToken, handle: RunHandle | None) -> Any:
        callbacks = p["callbacks"]
        if self._serial:
            if getattr(self._in_callback, "depth", 0):
                # this program's runs are one at a time and the run that called this callback
                # waits for it: running it again from the callback would wait forever
                raise EinjoinError("a callback cannot run the program whose run called it: runs of a program "
                                   "with state (or deterministic=True) are serialised, so it would wait for "
                                   "itself; run it after that run returns")
            callbacks = tuple(_Guarded(cb, self._in_callback) for cb in callbacks)
        recorder = None
        if p["trace"] is not None:
            from einjoin.viz.trace import TraceRecorder
            recorder = TraceRecorder(self.cluster.size,
                                     labels={n: f"%{i}" for i, n in enumerate(self.graph.ops)})
            callbacks = (recorder, *callbacks)  # first: it sees a task that another callback fails
        bar = RunBar.maybe(p["quiet"], len(self.taskgraph))
        if bar is not None:
            callbacks = (*callbacks, bar)
        # the run's own token: cancelled by the user's token, by Program.cancel() or by the handle
        user = p["cancel"]
        unlink = user.subscribe(token.cancel) if user is not None else (lambda: None)
        with self._runs_lock:
            self._active.add(token)
        try:
            try:
                # a token cancelled before the start: Engine.run raises "run cancelled before it
                # started" before running anything; every backend (Ray too) runs through the engine
                with bar if bar is not None else _nothing():
                    # runs with state, or deterministic ones (a fixed BLAS share), one at a time
                    if p.get("ticket") is not None:
                        self._turns.wait(p["ticket"])  # the runs submitted before it went first
                    with self._resident.lock if self._serial else _nothing():
                        values, state = self._with_state(self._reread(p["values"], p.get("reread", ())))
                        try:
                            outs, stats = self._engine.run(values, self.backend, p["order"], p["seed"], callbacks,
                                                           p["host_link"], cancel=token, cluster=self.cluster,
                                                           state=state)
                        except BaseException:
                            if state is not None:  # a failed run's new blocks (kept remotely) go
                                self._release(list(state.kept_refs.values()))
                            raise
                        if state is not None:  # only a run that succeeded replaces the state
                            self._release(self._resident.commit(state))
                        if self._writes is not None and outs is not None:  # before the next run starts
                            self._writes.write(outs)
            except BaseException as exc:
                if recorder is not None:  # what was recorded; the run's error stays the error
                    self._write_trace(recorder, p["trace"], exc, handle)
                raise
        finally:
            unlink()
            with self._runs_lock:
                self._active.discard(token)
        if recorder is not None:
            self._write_trace(recorder, p["trace"], None, handle)
        stats = self._cache_stats(stats)
        self.run_stats = stats
        if self._parent is not None:  # the program the user called: its run_stats are the last run's
            self._parent.run_stats = stats
        if handle is not None:
            handle.stats = stats
        if outs is None:
            return None
        if self._writes is not None:
            outs = self._writes.user_outputs(outs)
        if self._slots:  # an output that is also a new state value never aliases the state's block
            news = {s.new for s in self._slots}
            outs = [np.array(o) if n in news else o for o, n in zip(outs, self.graph.outputs)]
        # a read-only result (Ray's object store hands them out, backed by its shared memory) is
        # copied: results are the caller's own writable arrays on every backend (torch would also
        # warn on wrapping a read-only array)
        outs = unshared([o if o.flags.writeable else np.array(o) for o in outs])  # no result aliases another
        if p["use_torch"]:
            import torch
            tensors = [torch.from_numpy(np.asarray(o, order="C")) if o.dtype.kind != "V" else torch.from_numpy(
                o.view(np.int16)).view(torch.bfloat16) for o in outs]
            return returned(tensors, self._many, self._structure)
        return returned(outs, self._many, self._structure)

    # ---- state: values that persist between runs

    def _reread(self, values: dict[Node, np.ndarray], names: Sequence[str]) -> dict[Node, np.ndarray]:
        """``values`` with the written buffers ``names`` bound again (under the run lock): a buffer
        bound through a copy (another device, a conjugate view) was read when the run was
        prepared, maybe before the run queued ahead of it wrote its new value."""
        bound = self._bound or {}
        fresh = {n: bound[n] for n in names if n in bound and n in self.graph.input_by_name}
        if not fresh:
            return values
        return {**values, **bind_feeds(self.graph, (), _bound_now(fresh), self.graph.input_by_name)}

    @staticmethod
    def _write_trace(recorder: Any, path: pathlib.Path, error: BaseException | None,
                     handle: RunHandle | None = None) -> None:
        """Write a run's trace; a failure to write never loses the run's results (a warning) nor
        replaces its error (a note on it; a warning on Python 3.10, which has no notes). A run
        started by ``run_async`` keeps the warning on its handle: ``result()`` issues it, on the
        caller's thread and pointing at the caller's line."""
        try:
            recorder.write(path)
        except OSError as e:
            what = f"the trace of this run could not be written to {str(path)!r}: {e.strerror or e}"
            add_note = getattr(error, "add_note", None)
            if error is not None and callable(add_note):  # Python >= 3.11
                add_note(f"einjoin: {what}")
                return
            message = (f"einjoin: {what}; the run's results are returned" if error is None else
                       f"einjoin: {what} (the run failed: {type(error).__name__}: {error})")
            if handle is not None:
                handle._warnings.append(TraceWriteWarning(message))
            else:  # _write_trace < _execute < _run < run < the caller
                warnings.warn(message, TraceWriteWarning, stacklevel=5)

    def run_reference(self, *args: Any, **feeds: Any) -> Any:
        """Run the task graph with the few-line reference executor (the engines' oracle). A state
        input not fed takes its current value; the state is not changed."""
        args, feeds = self._torch_call(args, feeds)
        values = self._bind(args, feeds)
        absent = [s.name for s in self._slots if s.node not in values]
        if absent:
            values.update({self.graph.input_by_name[n]: v for n, v in self.read_state(absent).items()})
        outs = run_reference(self.taskgraph, self.decomps, values)
        outs = outs[:len(outs) - len(self._slots)]
        if self._writes is not None:  # the buffers' new values: not written (nor returned)
            outs = self._writes.user_outputs(outs)
        return returned(outs, self._many, self._structure)

    def simulate(self, cluster: Any = None, *, order: str | None = None, seed: int | None = None,
                 resident: bool = False) -> Any:
        """Replay this program's task graph in the event simulator
        (:mod:`einjoin.runtime.simulate`): the same tasks and dependencies, no data, in the
        run's ready-queue order. ``cluster``: whose time model (default: the cluster it was
        compiled for; ``ej.local(n)`` is this machine, calibrated first when no calibration is
        cached, a few seconds). A simulated cluster must have as many devices as the program.
        ``resident``: inputs start on their devices and outputs stay there (weights kept on GPUs):
        loads and write-backs cost nothing.
        Returns a :class:`~einjoin.runtime.simulate.Simulation` (``makespan``, ``device_busy``,
        ``link_bytes``, ``peak_memory``, ``trace(path)``): every figure simulated.

        >>> import einjoin as ej
        >>> prog = ej.compile(ej.input("a", (512, 512)) @ ej.input("b", (512, 512)), devices=8, backend="null")
        >>> sim = prog.simulate(ej.Cluster.preset("dgx-a100"))
        >>> 0 < sim.makespan < 1e-3
        True
        """
        from einjoin.runtime.simulate import simulate_program
        return simulate_program(self, cluster, order, seed, resident)

    def explain(self, file: Any = "stdout") -> str:
        """Print (to ``file``; default the current ``sys.stdout``, None: don't) and return, per op,
        its join-agg spec, blocks, kernels, partials and bytes moved in and out, then the totals
        and bytes per device pair. A plan made for ``objective="time"`` says so, with its
        simulated makespan on a cluster that has a time model (a preset)."""
        to_stdout = isinstance(file, str) and file == "stdout"
        if not (file is None or to_stdout or callable(getattr(file, "write", None))):
            raise EinjoinError(f"explain(file=...): expected 'stdout', None or an open text file (an "
                               f"object with write()), got {type(file).__name__} {file!r:.60}")
        text = explain_program(self)
        if file is not None:
            print(text, file=sys.stdout if to_stdout else file)
        return text

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this program to the file ``path`` (a zip of JSON and safetensors; see
        :mod:`einjoin.program_io`): the graph, the plan (decompositions, placement, task graph,
        memory plan, options, cluster), the bound weights and the state's current values. ``ej.load``
        reads it back without planning again; runs give bit-identical results. Programs compiled
        for other shapes (:attr:`shape_cache`) are not saved, and a loaded program runs only the
        shapes it was compiled for (the torch module is not in the file)."""
        if self._writes is not None:
            raise EinjoinError(f"prog.save: the forward writes buffer(s) {', '.join(self._writes.names)} at "
                               f"each run, which a saved program cannot write back: save one whose forward "
                               f"writes none (eval mode)")
        state: dict[str, np.ndarray] = {}
        if self._slots and self.backend.computes:
            with self._resident.lock:
                have = [s.name for s in self._slots if self._resident.has(s.node)]
            state = self.read_state(have) if have else {}
        program_io.write(path, self.plan, dict(self._bound or {}), state)

    def save_plan_png(self, path: str | os.PathLike[str], **options: Any) -> pathlib.Path:
        """Draw the plan to the PNG file ``path``: per op its spec and the device holding each
        output block, and the bytes moved per op (see :func:`einjoin.viz.save_plan_png` for the
        ``options``). Needs matplotlib."""
        from einjoin.viz.plan_png import save_plan_png
        return save_plan_png(self, path, **options)

    def close(self) -> None:
        """Release resources: the Ray backend's actors, the threads backend's worker threads (a
        later run starts new ones)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        if self._made_engine is not None:
            self._made_engine.close()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Program {len(self.graph.ops)} ops on {self.cluster}, backend {self.backend.name}, "
                f"{len(self.taskgraph)} tasks; {self.stats}>")

