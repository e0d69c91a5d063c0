"""Turns: runs of one serialised program (state, buffer writes, deterministic) execute in the
order they were submitted. Each ``run_async`` starts its own thread, and threads that wait on a
plain lock get it in no particular order (a busy machine may start the third before the second):
the second call would then see the third's buffer write. A run takes a ticket when it is
submitted (:meth:`Turns.take`), waits for it before it starts (:meth:`Turns.wait`) and gives it
back when it ends or is abandoned before its turn (:meth:`Turns.done`), so one failed run never
holds up the runs after it.

>>> t = Turns()
>>> a, b, c = t.take(), t.take(), t.take()
>>> t.done(b)          # b given up before its turn (a run refused before it started)
>>> t.wait(a); t.done(a)
>>> t.wait(c); t.done(c)  # c's turn: b was skipped
"""

from __future__ import annotations

import threading

__all__ = ["Turns"]


class Turns:
    """A first-come, first-served ticket queue (a ticket lock that can skip given-up tickets)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0      # the next ticket handed out
        self._serving = 0   # the ticket whose turn it is
        self._given_up: set[int] = set()  # tickets done before their turn

    def take(self) -> int:
        """A ticket: its turn comes after every ticket taken before it is done."""
        with self._cond:
            ticket = self._next
            self._next += 1
            return ticket

    def wait(self, ticket: int) -> None:
        """Block until it is ``ticket``'s turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._serving == ticket)

    def done(self, ticket: int) -> None:
        """End ``ticket``'s turn, or give it up before its turn came (then it is skipped)."""
        with self._cond:
            if ticket != self._serving:
                self._given_up.add(ticket)
                return
            self._serving += 1
            while self._serving in self._given_up:
                self._given_up.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()
