"""Pictures and traces (``einjoin.viz``): the plan PNG and the Chrome / Perfetto trace of a run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.models.graphs import transformer_block
from einjoin.exchange import TaskKind
from einjoin.ir.printing import describe

PNG = b"\x89PNG\r\n\x1a\n"
DEVICES = 4


@pytest.fixture(scope="module")
def block() -> tuple[Any, dict[str, np.ndarray]]:
    out, shapes = transformer_block(seq=32, d=32, heads=2, hidden=48)
    prog = ej.compile(out, devices=DEVICES)
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return prog, feeds


def test_plan_png(block: Any, tmp_path: Any) -> None:
    prog, _ = block
    assert len(prog.graph.ops) >= 20
    path = prog.save_plan_png(tmp_path / "plan.png")
    data = path.read_bytes()
    assert len(data) > 0 and data.startswith(PNG)


def test_plan_png_caps_panels_and_bars(block: Any, tmp_path: Any) -> None:
    prog, _ = block
    from einjoin.viz import save_plan_png
    path = save_plan_png(prog, str(tmp_path / "small.png"), max_panels=6, top_bars=3, columns=3, dpi=50)
    assert path.read_bytes().startswith(PNG)


def _x_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    assert trace["displayTimeUnit"] == "ms"
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_trace_matches_task_graph(block: Any, tmp_path: Any) -> None:
    prog, feeds = block
    path = tmp_path / "run.json"
    got = prog.run(trace=path, **feeds)
    assert got.shape == (32, 32)
    with open(path) as f:
        trace = json.load(f)
    events = _x_events(trace)
    tasks = prog.taskgraph.tasks
    kernels = [t for t in tasks if t.kind is TaskKind.KERNEL]
    kernel_events = [e for e in events if e["cat"] == TaskKind.KERNEL]
    assert len(kernel_events) == len(kernels)
    assert sorted(e["args"]["task"] for e in kernel_events) == sorted(t.id for t in kernels)
    # every task ran once and sits on the track of the device the task graph gave it
    assert sorted(e["args"]["task"] for e in events) == [t.id for t in tasks]
    for e in events:
        t = tasks[e["args"]["task"]]
        assert e["tid"] in range(DEVICES) and e["tid"] == t.device, (e, t)
        assert e["pid"] == 0 and e["cat"] == t.kind == e["args"]["kind"]
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["args"]["bytes"] == t.nbytes
    for e in kernel_events:
        op = describe(tasks[e["args"]["task"]].node)
        assert op in e["name"] and e["args"]["op"] == op
    for e in events:
        if e["cat"] == TaskKind.MOVE:
            assert e["name"].startswith("move ")
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {d: f"device {d}" for d in range(DEVICES)}


class FailFirstKernel:
    """Raises when the first kernel task starts (device threads call it concurrently)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed: Any = None

    def on_start(self, task: Any) -> None:
        if task.kind is TaskKind.KERNEL:
            with self.lock:
                if self.failed is None:
                    self.failed = task
                    raise RuntimeError("injected failure")

    def on_end(self, task: Any, start: float, end: float) -> None:
        pass


@pytest.mark.parametrize("backend", ["threads", "sync"])
def test_failed_run_still_writes_trace(backend: str, tmp_path: Any) -> None:
    x = ej.input("x", (16, 8))
    w = ej.input("w", (8, 4))
    prog = ej.compile(ej.softmax(x @ w), devices=2, backend=backend)
    feeds = dict(x=np.ones((16, 8), np.float32), w=np.ones((8, 4), np.float32))
    cb = FailFirstKernel()
    path = tmp_path / "failed.json"
    with pytest.raises(ej.EinjoinError, match="injected failure"):
        prog.run(trace=path, callbacks=[cb], **feeds)
    with open(path) as f:
        events = _x_events(json.load(f))
    assert any(e["cat"] == TaskKind.LOAD for e in events)
    unfinished = [e for e in events if e["args"].get("unfinished")]
    assert [e["args"]["task"] for e in unfinished] == [cb.failed.id]
    # the program runs again, with a complete trace
    prog.run(trace=path, **feeds)
    with open(path) as f:
        events = _x_events(json.load(f))
    assert len(events) == len(prog.taskgraph) and not any(e["args"].get("unfinished") for e in events)


def test_null_backend_trace(tmp_path: Any) -> None:
    z = ej.input("a", (8, 8)) @ ej.input("b", (8, 8))
    prog = ej.compile(z, devices=3, backend="null", specs={z: {"m": 3}})
    assert prog.run(np.ones((8, 8), np.float32), np.ones((8, 8), np.float32), trace=tmp_path / "null.json") is None
    with open(tmp_path / "null.json") as f:
        events = _x_events(json.load(f))
    assert len(events) == len(prog.taskgraph)
    assert {e["tid"] for e in events} <= set(range(3))


def test_import_einjoin_does_not_import_matplotlib() -> None:
    code = "import sys, einjoin, einjoin.viz; assert 'matplotlib' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
