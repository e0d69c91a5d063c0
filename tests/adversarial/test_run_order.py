"""Queued runs of a serialised program (buffer writes, state) apply their writes in the order they
were submitted, as torch's calls do, however their threads are scheduled. Each run_async has a
thread of its own; under load the third could take the run lock before the second (a loaded
suite run saw 1, 3, 2 for test_issue36_torch's counter; 51 of 300 tries with 4 busy loops on a
2-core box). These tests force that interleaving instead of waiting for the scheduler."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import einjoin as ej
from einjoin.runtime import CancelToken

torch = pytest.importorskip("torch")


class _SpyLock:
    """The run lock, counting the runs that released it (each run holds it once)."""

    def __init__(self, lock: Any, released: threading.Event, after: int) -> None:
        self.lock, self.released, self.after, self.exits = lock, released, after, 0

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.exits += 1
        self.lock.release()
        if self.exits >= self.after:
            self.released.set()

    def acquire(self, *a: Any) -> bool:
        return bool(self.lock.acquire(*a))

    def release(self) -> None:
        self.lock.release()


class _HeldToken(CancelToken):
    """A cancel token whose run stalls (before it asks for the run lock) until ``go`` is set."""

    def __init__(self, go: threading.Event) -> None:
        super().__init__()
        self.go = go

    def subscribe(self, fn: Any) -> Any:
        self.go.wait(timeout=30)  # a guard against a hang only: go is set by the other runs
        return super().subscribe(fn)


def _hold_second_run(prog: Any) -> tuple[threading.Event, Any]:
    """An event that lets the held (second) run go once the third run went ahead of it: it
    finished (no ordering: it ran first) or it waits for its turn (runs in submission order)."""
    go = threading.Event()
    prog._resident.lock = _SpyLock(prog._resident.lock, go, after=2)  # runs 1 and 3 ended
    turns = getattr(prog, "_turns", None)
    if turns is not None:
        wait = turns.wait

        def spy(ticket: int) -> None:
            if ticket == turns._next - 1:  # the last submitted (third) run waits for its turn
                go.set()
            wait(ticket)
        turns.wait = spy
    return go, turns


class Counter(torch.nn.Module):
    def __init__(self, copy: bool) -> None:
        super().__init__()
        n = torch.zeros(2, 3)
        self.register_buffer("n", n._neg_view() if copy else n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return x * self.n


@pytest.mark.parametrize("copy", [True, False], ids=["bound-through-a-copy", "bound-in-place"])
def test_a_stalled_second_run_still_sees_the_first_write_and_the_third_sees_its(copy: bool) -> None:
    x = torch.ones(2, 3)
    mod, ref = Counter(copy), Counter(copy)
    prog = ej.compile(ej.from_torch(mod, (x,)), devices=2, backend="threads", quiet=True)
    go, _ = _hold_second_run(prog)
    handles = [prog.run_async(x), prog.run_async(x, cancel=_HeldToken(go)), prog.run_async(x)]
    got = [float(h.result(timeout=30)[0, 0]) for h in handles]
    want = [float(ref(x)[0, 0]) for _ in range(3)]
    assert got == want == [1.0, 2.0, 3.0] and float(mod.n[0, 0]) == 3.0


def test_queued_runs_of_a_program_with_state_apply_their_steps_in_submission_order() -> None:
    w = ej.input("w", (3,))
    new = w * 2.0 + 1.0
    prog = ej.compile([new], state={new: w}, devices=2, backend="threads", quiet=True)
    prog.write_state({"w": np.zeros(3, np.float32)})
    go, _ = _hold_second_run(prog)
    handles = [prog.run_async(), prog.run_async(cancel=_HeldToken(go)), prog.run_async()]
    got = [float(np.asarray(h.result(timeout=30)).ravel()[0]) for h in handles]
    assert got == [1.0, 3.0, 7.0] and prog.read_state()["w"][0] == 7.0


def test_a_run_refused_before_its_turn_does_not_hold_up_the_runs_after_it() -> None:
    # a run refused after taking its turn's ticket, before its turn (a callback running the
    # program whose run called it), or at its start (a cancelled token), gives the turn up: the
    # runs submitted after it still run, in order
    x = torch.ones(2, 3)
    mod = Counter(True)
    prog = ej.compile(ej.from_torch(mod, (x,)), devices=2, backend="threads", quiet=True)
    refused: list[BaseException] = []

    class Reenter:
        def on_start(self, task: Any) -> None:
            if not refused:
                try:
                    prog.run(x)
                except ej.EinjoinError as e:
                    refused.append(e)

        def on_end(self, task: Any, start: float, end: float) -> None:
            pass
    assert float(prog.run(x, callbacks=[Reenter()])[0, 0]) == 1.0 and "callback" in str(refused[0])
    dead = CancelToken()
    dead.cancel()
    with pytest.raises(ej.EinjoinError, match="cancel"):
        prog.run_async(x, cancel=dead).result(timeout=30)
    handles = [prog.run_async(x) for _ in range(2)]
    assert [float(h.result(timeout=30)[0, 0]) for h in handles] == [2.0, 3.0]
