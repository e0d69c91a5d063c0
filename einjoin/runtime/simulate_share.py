"""The event simulator's sharing of resources among the transfers and kernels in flight
(:func:`share`): max-min fair rates by progressive filling. Its own module because the simulator
(:mod:`einjoin.runtime.simulate`) calls it at every change of the set of shared phases, on
hundreds of flows at once on 64-256 GPUs.

>>> class F:  # a flow: its (resource, demand) pairs; share sets its rate
...     def __init__(self, *res): self.res, self.rate = res, 0.0
>>> a, b = F(("port", 1.0)), F(("port", 1.0), ("other", 1.0))
>>> share([a, b], lambda r: 1.0); (a.rate, b.rate)
(0.5, 0.5)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["share", "Sharing"]


def share(flows: Sequence[Any], cap: Callable[[Any], float]) -> None:
    """Set each flow's rate (the fraction of its alone speed, at most 1) max-min fair by
    progressive filling: every flow's rate rises together; when a resource fills, the flows
    through it stop there and the others go on rising (a transfer slowed by a busy outgoing
    port leaves the rest of its incoming port to the others). A flow of one resource gets
    ``cap / load`` of it, as plain fluid sharing. The flows' resources are any hashable keys
    (``flow.res``: (resource, demand) pairs); the simulator uses :class:`Sharing`, the same
    arithmetic on resources numbered once."""
    sharing = Sharing(cap)
    numbered = [_Numbered(sharing.number(f.res)) for f in flows]
    sharing.share(numbered)
    for f, n in zip(flows, numbered):
        f.rate = n.rate


class _Numbered:
    """A flow as :meth:`Sharing.share` takes it: its numbered resources and its rate."""

    __slots__ = ("ids", "rate")

    def __init__(self, ids: tuple[tuple[int, float], ...]):
        self.ids, self.rate = ids, 0.0


class Sharing:
    """:func:`share` for one simulation: each resource numbered once (:meth:`number`; its
    capacity asked once), so that a sharing indexes lists instead of hashing the resources'
    tuples again for every flow at every event (on 256 GPUs the simulator shares components of
    thousands of transfers at most events). The rates are those of :func:`share` bit for bit:
    the same sums in the same order, the resources in the order the flows first name them."""

    def __init__(self, cap: Callable[[Any], float]):
        self.cap = cap
        self.ids: dict[Any, int] = {}
        self.caps: list[float] = []
        self.local: list[int] = []  # per resource number: its index in the current sharing, or -1

    def number(self, res: Sequence[tuple[Any, float]]) -> tuple[tuple[int, float], ...]:
        """``res`` ((resource, demand) pairs) with each resource as its number."""
        ids = self.ids
        out = []
        for r, dem in res:
            i = ids.get(r)
            if i is None:
                i = ids[r] = len(self.caps)
                self.caps.append(self.cap(r))
                self.local.append(-1)
            out.append((i, dem))
        return tuple(out)

    def share(self, flows: Sequence[Any]) -> None:
        """Set the ``rate`` of each of ``flows`` (each with ``ids``: its :meth:`number`-ed
        resources), as :func:`share` does.

        The resources wait in a heap by the level at which they fill at their current load; each
        fill freezes its flows and lowers the load of the other resources they hold (whose levels
        are pushed again). That is O(pairs x log resources) per call rather than a pass over every
        rising flow per fill: hundreds of concurrent transfers on 64+ GPUs made the passes the
        simulator's cost (a 1-layer LLaMA-70B forward on 64 GPUs: 39 of its 43 s)."""
        index = self.local
        allcaps = self.caps
        named: list[int] = []     # the resources of this sharing, by first mention
        caps: list[float] = []
        use: list[float] = []     # demand of the still-rising flows through each resource
        through: list[list[Any]] = []
        for f in flows:
            f.rate = -1.0  # rising
            for r, dem in f.ids:
                i = index[r]
                if i < 0:
                    i = index[r] = len(named)
                    named.append(r)
                    caps.append(allcaps[r])
                    use.append(0.0)
                    through.append([])
                use[i] += dem
                through[i].append(f)
        spare = list(caps)        # capacity left at level ``at`` ...
        at = [0.0] * len(caps)    # ... the level it was last brought up to date at
        heap = [(spare[i] / use[i], i, use[i]) for i in range(len(caps)) if use[i] > 0]
        heapq.heapify(heap)
        while heap:
            level, i, u = heapq.heappop(heap)
            if u != use[i]:
                continue  # a stale entry: the resource's load changed since it was pushed
            if level >= 1.0 - 1e-12:
                break
            # resource i is full at ``level``: its rising flows stop here
            lowered = set()
            for f in through[i]:
                if f.rate >= 0.0:
                    continue
                f.rate = level
                for r, dem in f.ids:
                    j = index[r]
                    spare[j] -= use[j] * (level - at[j])
                    at[j] = level
                    use[j] -= dem
                    lowered.add(j)
            use[i] = 0.0
            # each lowered resource's new level, pushed once after all of i's flows: an entry
            # pushed after each flow would be stale by the next (its load lower), and the last
            # is this one (``spare`` moves only at a flow's first update at this level)
            for j in lowered:
                if use[j] > 1e-12 * caps[j] and j != i:
                    heapq.heappush(heap, (level + max(spare[j], 0.0) / use[j], j, use[j]))
        for r in named:
            index[r] = -1
        for f in flows:
            if f.rate < 0.0:
                f.rate = 1.0
