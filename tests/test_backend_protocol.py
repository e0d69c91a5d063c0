"""The task vocabulary (TaskKind, per-kind payloads) and the Backend protocol the engine runs every
backend through (issue 17, findings 4 and 5)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.exchange import PAYLOADS, TASK_KINDS, TaskKind
from einjoin.runtime import Backend, CancelToken, EagerSession, LocalSession, ReadySession, RunSpec
from einjoin.runtime.backends import BACKENDS

F32 = dict(rtol=1e-5, atol=1e-5)


def _graph() -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    x, w = ej.input("x", (24, 16)), ej.input("w", (16, 12))
    out = ej.softmax(ej.relu(x @ w) * 2.0)
    return out, {"x": rng.standard_normal((24, 16)).astype(np.float32),
                 "w": rng.standard_normal((16, 12)).astype(np.float32)}


def test_every_kind_has_one_payload_class_and_the_groups_nest() -> None:
    assert set(PAYLOADS) == set(TaskKind) and TASK_KINDS == tuple(TaskKind)
    for k in TaskKind:
        assert k == k.value and str(k) == k.value and TaskKind(k.value) is k
        assert not (k.to_host and not k.releases)   # a copy to the host also drops the value
        assert not (k.clean and not k.fresh)        # a clean value is written in one go
        assert not (k.releases and k.fresh)


@pytest.mark.parametrize("limit", [None, "24KiB"])
def test_built_tasks_carry_their_kinds_payload_and_pickle(limit: Any) -> None:
    out, _ = _graph()
    prog = ej.compile(out, devices=3, memory_limit=limit, quiet=True)
    tasks = prog.taskgraph.tasks
    kinds = {t.kind for t in tasks}
    assert {TaskKind.LOAD, TaskKind.KERNEL, TaskKind.FREE} <= kinds
    if limit is not None:
        assert TaskKind.WRITEBACK in kinds  # capped graphs end in the host store
    for t in tasks:
        assert type(t.payload) is PAYLOADS[t.kind], t
        assert (t.writes < 0) == t.kind.releases, t
        if t.kind.releases:
            assert 0 <= t.payload.frees < len(prog.taskgraph.values)
    assert pickle.loads(pickle.dumps(tasks)) == tasks  # plain data: Ray ships it


def test_the_builder_refuses_a_payload_of_another_kind() -> None:
    from einjoin.exchange import Kernel, TaskGraphBuilder
    x = ej.input("x", (2, 2)).node
    with pytest.raises(TypeError, match="load task takes a Block payload"):
        TaskGraphBuilder().produce(TaskKind.LOAD, 0, (), (2, 2), "float32", x, Kernel(0))


def test_a_kind_given_as_a_string_becomes_the_enum() -> None:
    # TaskKind is a str Enum, so "load" finds PAYLOADS' entry: the builder must store the member,
    # or the groups (kind.releases, ...) and `kind is TaskKind.X` tests would silently fail
    from einjoin.exchange import Block, Release, TaskGraphBuilder
    x = ej.input("x", (2, 2)).node
    b = TaskGraphBuilder()
    v = b.produce("load", 0, (), (2, 2), "float32", x, Block(((0, 2), (0, 2))))  # type: ignore[arg-type]
    b.add("free", 0, (v,), -1, x, Release(v))  # type: ignore[arg-type]
    assert [type(t.kind) for t in b.tasks] == [TaskKind, TaskKind]
    assert b.tasks[1].kind.releases and not b.tasks[0].kind.releases
    with pytest.raises(ValueError):
        b.add("teleport", 0, (), -1, x, Release(v))  # type: ignore[arg-type]


def test_a_backend_of_the_old_interface_is_told_what_replaced_it() -> None:
    class Old:
        name, parallel, computes = "old", False, True

        def context(self, n: int) -> Any:
            return None

    with pytest.raises(ej.EinjoinError, match="old interface.*einjoin.runtime.backend.Backend"):
        ej.compile(ej.input("x", (2, 2)) * 2, backend=Old(), quiet=True)


def test_every_backend_implements_the_protocol() -> None:
    from einjoin.runtime.backends import get_backend
    for b in [*BACKENDS.values(), get_backend("torch")]:  # (torch is imported on first use)
        assert isinstance(b, Backend), b
        out, feeds = _graph()
        prog = ej.compile(out, devices=2, backend=b, quiet=True)
        session = b.open(RunSpec(prog._engine, prog._bind((), dict(feeds))))
        assert isinstance(session, ReadySession) and not session.eager


class _Eager:
    """A backend that resolves dependencies itself, as Ray does: every task is handed over at
    submission, before its inputs exist, and runs them only at collect, in submission order.
    Built on the local session's task semantics."""

    name, computes, remote, retries = "eager-test", True, False, 0

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def open(self, run: RunSpec) -> Any:
        outer = self

        class Eager(LocalSession):
            eager = True  # type: ignore[assignment]

            def submit(self, t: Any) -> None:
                outer.submitted.append(t.id)

            def collect(self, cancel: Any) -> None:
                for tid in outer.submitted:
                    if cancel is not None and cancel.cancelled:
                        raise ej.EinjoinError("run cancelled")
                    self.execute(self.tg.tasks[tid])

            def finish(self, stats: Any) -> Any:
                for tid in outer.submitted:
                    t = self.tg.tasks[tid]
                    stats.intervals[t.device].append((0.0, 0.0, tid))
                return super().finish(stats)

        return Eager(run, computes=True, threaded=False)

    def close(self) -> None:
        pass


def test_an_eager_backend_is_run_by_the_engine() -> None:
    out, feeds = _graph()
    backend = _Eager()
    assert isinstance(backend, Backend)
    prog = ej.compile(out, devices=3, backend=backend, quiet=True)
    seen: list[int] = []

    class Seen:
        def on_start(self, task: Any) -> None:
            seen.append(task.id)

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass

    assert isinstance(backend.open(RunSpec(prog._engine, prog._bind((), dict(feeds)))), EagerSession)
    got = prog.run(callbacks=[Seen()], **feeds)
    np.testing.assert_allclose(got, ej.reference(out, **feeds), **F32)
    n = len(prog.taskgraph)
    assert backend.submitted == list(range(n))      # every task once, in dependency (id) order
    assert sorted(seen) == list(range(n))           # callbacks replayed after the run
    assert prog.run_stats.tasks_run == n and prog.run_stats.bytes_moved == prog.stats.bytes_moved
    tok = CancelToken()
    tok.cancel()
    with pytest.raises(ej.EinjoinError, match="before it started"):
        prog.run(cancel=tok, **feeds)
    assert len(backend.submitted) == n              # a cancelled run submits nothing
