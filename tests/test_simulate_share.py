"""The simulator's max-min fair sharing (einjoin.runtime.simulate_share.share, a heap of resources by
the level at which they fill) against the plain progressive filling it replaced, written out here
as the oracle: every rate rises together, one pass over the rising flows per fill. Random flows
over a few ports and the cores, demands as the cost rules give them (a transfer's bandwidth on
each of its ports, threads on the cores), and hand-computed cases."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from budget import examples
from einjoin.runtime.simulate import _Flow
from einjoin.runtime.simulate_share import Sharing
from einjoin.runtime.simulate_share import share as _share


def _oracle(res: list[tuple[tuple[Any, float], ...]], cap: dict[Any, float]) -> list[float]:
    """Progressive filling written plainly: raise every rising flow's rate by the largest step no
    resource overflows; the flows through a resource that filled stop; the rest go on, up to 1."""
    left = dict(cap)
    rate = [0.0] * len(res)
    rising, level = list(range(len(res))), 0.0
    while rising:
        use: dict[Any, float] = {}
        for k in rising:
            for r, dem in res[k]:
                use[r] = use.get(r, 0.0) + dem
        step = min([1.0 - level] + [left[r] / u for r, u in use.items()])
        level += step
        for r, u in use.items():
            left[r] -= step * u
        full = {r for r in use if left[r] <= 1e-12 * cap[r]}
        if level >= 1.0 - 1e-12 or not full:
            for k in rising:
                rate[k] = level
            break
        for k in rising:
            if any(r in full for r, _ in res[k]):
                rate[k] = level
        rising = [k for k in rising if not any(r in full for r, _ in res[k])]
    return rate


def _rates(res: list[tuple[tuple[Any, float], ...]], cap: dict[Any, float]) -> list[float]:
    flows = [_Flow(None, 0, ((1.0, r),), 0.0) for r in res]  # type: ignore[arg-type]
    for f in flows:
        f.advance()
    _share(flows, cap.__getitem__)
    return [f.rate for f in flows]


Res = tuple[tuple[Any, float], ...]
PORTS: list[Any] = ([("intra", d, k) for d in (0, 1) for k in range(4)]
                    + [("inter", d, k) for d in (0, 1) for k in range(2)])
CAP: dict[Any, float] = {**{p: 300e9 if p[0] == "intra" else 25e9 for p in PORTS}, ("cores",): 2.0}


@st.composite
def _flows(draw: st.DrawFn) -> list[Res]:
    out: list[Res] = []
    for _ in range(draw(st.integers(1, 24))):
        if draw(st.booleans()):  # a transfer: its bandwidth on one or two ports
            ports = draw(st.lists(st.sampled_from(PORTS), min_size=1, max_size=2, unique=True))
            bw = draw(st.sampled_from([25e9, 300e9, 100e9]))
            out.append(tuple((p, bw) for p in ports))
        else:  # a kernel on the cores, with some threads
            out.append(((("cores",), draw(st.sampled_from([1.0, 0.5, 2.0, 1.6]))),))
    return out


@settings(max_examples=examples(200), deadline=None)
@given(_flows())
def test_share_equals_plain_progressive_filling(res: list[tuple[tuple[Any, float], ...]]) -> None:
    assert _rates(res, CAP) == pytest.approx(_oracle(res, CAP), rel=1e-9)


def test_share_by_hand() -> None:
    a, b, c = ("p", "a"), ("p", "b"), ("p", "c")
    cap = {a: 1.0, b: 1.0, c: 1.0}
    # two flows through a, one of them through b too, a third through b alone: a splits 1/2 each;
    # b's spare half goes to the third, which is capped at its alone speed
    rates = _rates([((a, 1.0),), ((a, 1.0), (b, 1.0)), ((b, 1.0),)], cap)
    assert rates == pytest.approx([0.5, 0.5, 0.5])
    rates = _rates([((a, 1.0),), ((a, 1.0), (b, 0.5)), ((b, 0.5),), ((c, 0.25),)], cap)
    assert rates == pytest.approx([0.5, 0.5, 1.0, 1.0])
    # three through c at demand 1 with one also through a and b held by others
    rates = _rates([((c, 1.0), (a, 1.0)), ((a, 1.0),), ((a, 1.0),), ((a, 1.0),), ((c, 1.0),), ((c, 1.0),)], cap)
    assert rates == pytest.approx([0.25, 0.25, 0.25, 0.25, 0.375, 0.375])


def _per_flow_pushes(res: list[Res], cap: dict[Any, float]) -> list[float]:
    """The heap sharing as it was before :class:`Sharing` (resources hashed at every call, a
    level pushed after each frozen flow), written out: the simulator's goldens pin its rates
    bit for bit, so the faster one must give the very same floats."""
    import heapq
    index: dict[Any, int] = {}
    caps: list[float] = []
    use: list[float] = []
    through: list[list[int]] = []
    rate = [-1.0] * len(res)
    for k, rs in enumerate(res):
        for r, dem in rs:
            if r not in index:
                index[r] = len(caps)
                caps.append(cap[r])
                use.append(0.0)
                through.append([])
            use[index[r]] += dem
            through[index[r]].append(k)
    spare, at = list(caps), [0.0] * len(caps)
    heap = [(spare[i] / use[i], i, use[i]) for i in range(len(caps)) if use[i] > 0]
    heapq.heapify(heap)
    while heap:
        level, i, u = heapq.heappop(heap)
        if u != use[i]:
            continue
        if level >= 1.0 - 1e-12:
            break
        for k in through[i]:
            if rate[k] >= 0.0:
                continue
            rate[k] = level
            for r, dem in res[k]:
                j = index[r]
                spare[j] -= use[j] * (level - at[j])
                at[j] = level
                use[j] -= dem
                if use[j] > 1e-12 * caps[j] and j != i:
                    heapq.heappush(heap, (level + max(spare[j], 0.0) / use[j], j, use[j]))
        use[i] = 0.0
    return [1.0 if x < 0.0 else x for x in rate]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(_flows(), min_size=1, max_size=4))
def test_numbered_sharing_is_the_per_flow_heap_bit_for_bit(calls: list[list[Res]]) -> None:
    # one Sharing for several calls (as a simulation keeps one): each call's resources are
    # indexed afresh in the order its flows name them, whatever earlier calls numbered
    sharing = Sharing(CAP.__getitem__)
    for res in calls:
        flows = [_Flow(None, 0, ((1.0, r),), 0.0) for r in res]  # type: ignore[arg-type]
        for f in flows:
            f.advance()
            f.ids = sharing.number(f.res)
        sharing.share(flows)
        assert [f.rate for f in flows] == _per_flow_pushes(res, CAP)  # ==, not approx
