"""Chrome / Perfetto traces of a run: one track per device, one box per task.

:class:`TraceRecorder` is an engine callback (``on_start`` / ``on_end``); pass it to
``Program.run(callbacks=[...])``, or just give ``Program.run(trace="run.json")``. The file is the
Chrome "Trace Event" JSON (``{"traceEvents": [...], "displayTimeUnit": "ms"}``): a complete
(``"X"``) event per task with ``ts``/``dur`` in microseconds, ``pid`` 0, ``tid`` = the device, and
a ``thread_name`` metadata event naming each track ``device N``. Open it in
https://ui.perfetto.dev or ``chrome://tracing``.

>>> import json, os, tempfile, numpy as np, einjoin as ej
>>> x = ej.input("x", (8, 8)); w = ej.input("w", (8, 8))
>>> prog = ej.compile(x @ w, devices=2)
>>> path = os.path.join(tempfile.mkdtemp(), "run.json")
>>> _ = prog.run(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), trace=path)
>>> events = json.load(open(path))["traceEvents"]
>>> {"kernel", "load"} <= {e["cat"] for e in events if e["ph"] == "X"}   # the task kinds, as strings in JSON
True
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time
from collections.abc import Mapping
from typing import Any

from einjoin.exchange import Task, TaskKind
from einjoin.ir.node import Node
from einjoin.ir.printing import describe

__all__ = ["TraceRecorder", "task_name", "output_path"]


def output_path(path: Any, what: str) -> pathlib.Path:
    """Check, before any work, that a file can be written at ``path`` (``what`` names the argument,
    e.g. ``"trace="``): its folder is created if missing; an :class:`EinjoinError` names the
    argument and the path when it cannot be (a directory, a file in place of a folder, no
    permission). A full disk shows only when writing."""
    from einjoin.errors import EinjoinError
    try:
        out = pathlib.Path(os.fspath(path))
    except TypeError:
        raise EinjoinError(f"{what} must be a file path (str or os.PathLike), got {type(path).__name__} "
                           f"{path!r:.80}") from None
    if str(out) in ("", "."):
        raise EinjoinError(f"{what} must name a file, got {str(path)!r}")
    if out.is_dir():
        raise EinjoinError(f"{what} {str(out)!r} is a directory; give a file path inside it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EinjoinError(f"{what} {str(out)!r}: cannot create its folder {str(out.parent)!r}: "
                           f"{e.strerror or e}") from None
    target = out if out.exists() else out.parent
    if not os.access(target, os.W_OK):
        raise EinjoinError(f"{what} {str(out)!r}: {str(target)!r} is not writable")
    return out


def task_name(task: Task, op: str | None = None) -> str:
    """The event name of a task: the op's description for a kernel, ``"<kind> <op>"`` otherwise
    (``"move einsum[...]"``), so the kinds stay apart on a track.

    >>> import einjoin as ej
    >>> from einjoin.exchange import Move, Task, TaskKind
    >>> z = ej.input("a", (2, 2)) @ ej.input("b", (2, 2))
    >>> task_name(Task(0, TaskKind.MOVE, 1, (), 0, (), 16, 0, z.node, Move(0)))
    'move einsum[mk,kn->mn | x0 * x1 | sum]'
    """
    op = describe(task.node) if op is None else op
    return op if task.kind is TaskKind.KERNEL else f"{task.kind} {op}"


class TraceRecorder:
    """Records every executed task as a trace event (thread-safe: the ``threads`` backend calls
    it from one thread per device).

    ``n_devices`` names that many tracks even when some device ran nothing; ``labels`` may give
    each op a short id (e.g. ``"%3"``) stored in the events' ``args["node"]``. A task that started
    but never ended (it failed, or the run was cancelled) is written with ``args["unfinished"]``
    and its duration up to the moment the trace is written.

    >>> rec = TraceRecorder(2)
    >>> [e["args"]["name"] for e in rec.events() if e["ph"] == "M" and e["name"] == "thread_name"]
    ['device 0', 'device 1']
    """

    def __init__(self, n_devices: int = 0, labels: Mapping[Node, str] | None = None):
        self.n_devices = n_devices
        self.labels = dict(labels or {})
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Task, float]] = {}
        self._done: list[dict[str, Any]] = []
        self._names: dict[Node, str] = {}

    # ---- the engine's callback protocol
    def on_start(self, task: Task) -> None:
        now = time.perf_counter()
        with self._lock:
            self._open[task.id] = (task, now)

    def on_end(self, task: Task, start: float, end: float) -> None:
        with self._lock:
            self._open.pop(task.id, None)
            self._done.append(self._event(task, start, end))

    # ---- output
    def _op(self, node: Node) -> str:  # under the lock
        name = self._names.get(node)
        if name is None:
            name = self._names[node] = describe(node)
        return name

    def _event(self, task: Task, start: float, end: float, unfinished: bool = False) -> dict[str, Any]:
        op = self._op(task.node)
        args = task.trace_args(op)
        if task.node in self.labels:
            args["node"] = self.labels[task.node]
        if unfinished:
            args["unfinished"] = True
        return {"name": task_name(task, op), "cat": task.kind.value, "ph": "X",
                "ts": (start - self._t0) * 1e6, "dur": max(end - start, 0.0) * 1e6,
                "pid": 0, "tid": task.device, "args": args}

    def events(self) -> list[dict[str, Any]]:
        """The metadata events, then the recorded tasks in start order (open ones last)."""
        now = time.perf_counter()
        with self._lock:
            done = sorted(self._done, key=lambda e: e["ts"])
            pending = [self._event(t, s, now, unfinished=True) for t, s in self._open.values()]
        devices = sorted(set(range(self.n_devices)) | {e["tid"] for e in done + pending})
        meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                       "args": {"name": "einjoin"}}]
        for d in devices:
            meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                         "args": {"name": f"device {d}"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d,
                         "args": {"sort_index": d}})
        return meta + done + pending

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike[str]) -> pathlib.Path:
        """Write the trace as JSON to ``path``; returns the path."""
        out = pathlib.Path(path)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._done)
