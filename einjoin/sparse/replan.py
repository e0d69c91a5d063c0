"""A compiled sparse plan run on new operands: reuse its layouts or replan, per pattern.

A plan's layouts were chosen from its sparse operands' *block histograms* (non-empty blocks at
each candidate block size, :func:`einjoin.sparse.layout.histogram`). ``run(A=other)`` computes
the new operand's histogram (a bincount per size, cached on the tensor): the same histogram
reuses the plan as it is; another one replans for that pattern, and the steps are kept in a
cache keyed by the histograms, so that a pattern met again is not planned again. What each run
did is logged (``einjoin.sparse``) and shown by ``explain()``.

>>> import numpy as np, einjoin as ej
>>> a = ej.sparse("A", np.eye(8))
>>> plan = ej.sparse_compile("ij,jk->ik", a, np.ones((8, 4)))
>>> _ = plan.run(A=ej.sparse("A", 2 * np.eye(8)))   # the same pattern: the plan is reused
>>> plan.last_run
'reused the compiled plan (the same block histogram)'
>>> _ = plan.run(A=ej.sparse("A", np.ones((8, 8))))  # another pattern: replanned, and cached
>>> plan.last_run.split(" (")[0]
'replanned for a new block histogram'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.sparse.layout import Operand, histogram
from einjoin.sparse.tensor import SparseTensor

__all__ = ["Pattern", "PatternCache", "pattern_of", "bind_operands"]

log = logging.getLogger("einjoin.sparse")

Pattern = tuple[tuple[tuple[int, int], ...] | None, ...]  # per operand: its histogram, None if dense
S = TypeVar("S")  # what the cache holds per pattern (the plan's steps)

MAX_PATTERNS = 16  # step lists kept per plan (the oldest replan is dropped first)


def pattern_of(values: Sequence[SparseTensor | np.ndarray], labels: Sequence[tuple[str, ...]]) -> Pattern:
    """Each sparse operand's block histogram (dense operands: None, every block present)."""
    return tuple(tuple(histogram(Operand(v.name, ls, tuple(v.shape), v.coo()[0], _counts=v.counts)))
                 if isinstance(v, SparseTensor) else None for v, ls in zip(values, labels))


def bind_operands(names: Sequence[str], compiled: Sequence[Any], operands: Sequence[Any],
                  named: Mapping[str, Any], what: str) -> list[Any]:
    """The run's operands: all of them by position, or some by name (``run(A=other)``), the
    others the compiled ones. A name that is no operand's, or that two operands share, is refused."""
    if operands and len(operands) != len(compiled):
        raise EinjoinError(f"{what}: run got {len(operands)} operand(s) by position, compiled with "
                           f"{len(compiled)} ({', '.join(names)}); give all of them, or some by name")
    values = list(operands) if operands else list(compiled)
    for name, x in named.items():
        hits = [i for i, n in enumerate(names) if n == name]
        if not hits:
            raise EinjoinError(f"{what}: run got operand {name!r}, which is none of the plan's "
                               f"operands ({', '.join(names)}; a dense operand i is named x<i>)")
        if len(hits) > 1:
            raise EinjoinError(f"{what}: operands {', '.join(str(i) for i in hits)} are all named "
                               f"{name!r}; give them by position")
        if operands:
            raise EinjoinError(f"{what}: operand {name!r} given both by position and by name")
        values[hits[0]] = x
    return values


class PatternCache(Generic[S]):
    """The steps of a plan per operand pattern: the compiled ones, and each replan's."""

    def __init__(self, compiled: S) -> None:
        self.compiled = compiled
        self._key: Pattern | None = None  # the compiled operands' pattern, counted at first need
        self._plans: dict[Pattern, S] = {}
        self.last = "ran the compiled operands"

    def steps_for(self, key: Pattern, compiled_key: Callable[[], Pattern], replan: Callable[[], S],
                  what: str) -> S:
        """The steps for operands of pattern ``key``: the compiled ones when it is the compiled
        operands' pattern, a cached replan, or a new one."""
        if self._key is None:
            self._key = compiled_key()
        if key == self._key:
            self.last = "reused the compiled plan (the same block histogram)"
            steps = self.compiled
        elif key in self._plans:
            self.last = "reused the plan made for this block histogram (cached)"
            steps = self._plans[key]
        else:
            steps = replan()
            if len(self._plans) >= MAX_PATTERNS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = steps
            self.last = (f"replanned for a new block histogram ({_differs(self._key, key)}; "
                         f"{len(self._plans)} pattern(s) cached)")
        log.info("%s: %s", what, self.last)
        return steps

    def compiled_run(self) -> S:
        self.last = "ran the compiled operands"
        return self.compiled


def _differs(old: Pattern, new: Pattern) -> str:
    """Which operand's histogram changed, and at the first size that differs."""
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b and a is not None and b is not None:
            for (size, n_old), (_, n_new) in zip(a, b):
                if n_old != n_new:
                    return f"operand {i}: {n_new} blocks of size {size} where the plan had {n_old}"
    return "another pattern"
