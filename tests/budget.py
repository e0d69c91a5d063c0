"""Property-test budgets: how many examples a hypothesis test draws in this run.

``make test`` (the default) draws an eighth of a large budget (at least ``SMALL``), so that the
whole suite stays under the project's ten minutes on two cores; ``make test-all`` sets ``EINJOIN_HYPOTHESIS=full`` and
draws every example a test asks for. Small budgets (at most 20: tests whose every example traces a
module or compiles several programs) are the same in both runs.

>>> examples(12)  # a small budget: whole in either run
12
>>> examples(120) == (120 if FULL else 20)
True
"""

from __future__ import annotations

import os

FULL = os.environ.get("EINJOIN_HYPOTHESIS", "") == "full"
SHARE = 8  # the default run's fraction of a large budget: 1 / SHARE (3 until 2026-12-05: 14 min)
SMALL = 20  # budgets up to this are kept whole


def examples(n: int) -> int:
    """The examples to draw for a test that asks for ``n``: ``n`` in the full run, else an eighth
    of it and at least ``SMALL``."""
    if FULL or n <= SMALL:
        return n
    return max(SMALL, -(-n // SHARE))
