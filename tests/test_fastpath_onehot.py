"""einjoin.runtime.fastkernels: a join ``X + where(i == r, Y, 0)`` over a range block (a
cross-entropy's gradient) computed without the dense one-hot gives the general path's bits
(einjoin.ir.kernels.einsum_kernel), whatever the values (-0.0, inf, nan, indices outside the
range, an ignore index; nan where it gives nan); a range block that is not consecutive ints
takes the dense join."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from einjoin.ir.agg import get_agg
from einjoin.ir.kernels import einsum_kernel
from einjoin.ir.opkinds import Einsum
from einjoin.ir.scalar import parse_join
from einjoin.runtime import fastkernels
from einjoin.runtime.fastkernels import _join_core

# the small LLaMA's cross-entropy gradient join, and X and Y simpler, the where first
JOINS = [
    ("ab,a,a,,,a,a,b->ab", "exp(x0 - stop_gradient(x1)) * where(x2 == (-100), 0.0, x3 / x4 * x5 / x6)"
                           " + where(x2 == x7, where(x2 == (-100), 0.0, -(x3 / x4 * x5)), 0.0)"),
    ("ab,a,b,a->ab", "where(x2 == x1, x3, 0) + x0"),
    ("ab,a,b,a->ab", "stop_gradient(x0) + where(x1 == x2, x3 * 2.0, 0.0)"),
]
floats = st.floats(width=32)  # with -0.0, inf and nan


def _op(eq: str, join: str) -> Einsum:
    ins, out = eq.split("->")
    labels = tuple(tuple(s) for s in ins.split(","))
    return Einsum(labels, tuple(out), parse_join(join, len(labels)), get_agg(None))


def _blocks(eq: str, rows: int, cols: int, start: int, draw: Any) -> list[np.ndarray]:
    xs = []
    for k, ls in enumerate(eq.split("->")[0].split(",")):
        shape = tuple(rows if lab == "a" else cols for lab in ls)
        if ls == "b":
            xs.append(np.arange(start, start + cols, dtype=np.int64))
        elif (eq.startswith("ab,a,a") and k == 2) or (not eq.startswith("ab,a,a") and k == 1):
            xs.append(draw(hnp.arrays(np.int64, shape, elements=st.sampled_from([-100, start - 1, start, start + 1,
                                                                              start + cols - 1, start + cols]))))
        else:
            xs.append(draw(hnp.arrays(np.float32, shape, elements=floats)))
    return xs


def _bits(v: np.ndarray) -> list[int]:
    bits: list[int] = np.ascontiguousarray(v, np.float32).view(np.int32).ravel().tolist()
    return bits


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from(range(len(JOINS))), st.integers(1, 5), st.integers(1, 6), st.integers(-3, 3))
def test_the_onehot_add_gives_the_dense_joins_bits(data: Any, which: int, rows: int, cols: int, start: int) -> None:
    eq, join = JOINS[which]
    op = _op(eq, join)
    xs = _blocks(eq, rows, cols, start, data.draw)
    dtypes = [x.dtype for x in xs]
    core = _join_core(op, [x.shape for x in xs], dtypes)
    assert core is not None
    assert fastkernels._onehot_add(op, dtypes, (rows, cols)) is not None  # the path under test
    with np.errstate(all="ignore"):
        want = einsum_kernel(op, xs, "float32")
        for _ in range(2):  # recorded, then replayed
            got = core([x.copy() for x in xs])
            # nan where the join gives nan; the sign of nan + nan is the ufunc loop's (x86
            # returns one operand's, and which one numpy's loops differ on): not compared
            nan = np.isnan(want)
            assert np.isnan(got).tolist() == nan.tolist()
            assert _bits(got[~nan]) == _bits(want[~nan])


def test_a_range_block_not_of_consecutive_ints_takes_the_dense_join() -> None:
    eq, join = JOINS[1]
    op = _op(eq, join)
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((4, 5)).astype(np.float32)
    idx = np.array([0, 2, 4, 1])
    y = rng.standard_normal(4).astype(np.float32)
    dtypes = [x0.dtype, idx.dtype, idx.dtype, y.dtype]
    onehot = fastkernels._onehot_add(op, dtypes, (4, 5))
    assert onehot is not None
    core = _join_core(op, [(4, 5), (4,), (5,), (4,)], dtypes)
    assert core is not None
    for r in (np.array([0, 2, 1, 3, 4]), np.array([0, 1, 2, 3, 5])):
        xs = [x0, idx, r, y]
        assert onehot([x0, idx[:, None], r[None, :], y[:, None]]) is None
        assert _bits(core(xs)) == _bits(einsum_kernel(op, xs, "float32"))
    # its inputs are never written: X = x0 itself is added to 0 in a fresh array
    before = x0.copy()
    core([x0, idx, np.arange(5), y])
    assert _bits(x0) == _bits(before)


def test_a_negative_zero_plus_a_negative_zero_at_the_target_stays_negative() -> None:
    # the join adds Y to X itself there, not to X + 0 (which is +0.0): -0.0 + -0.0 is -0.0
    eq, join = JOINS[1]
    op = _op(eq, join)
    x0 = np.full((2, 3), -0.0, np.float32)
    idx, r, y = np.array([1, -100]), np.arange(3), np.full(2, -0.0, np.float32)
    core = _join_core(op, [(2, 3), (2,), (3,), (2,)], [x0.dtype, idx.dtype, r.dtype, y.dtype])
    assert core is not None
    with np.errstate(all="ignore"):
        want = einsum_kernel(op, [x0, idx, r, y], "float32")
        got = core([x0, idx, r, y])
    assert np.signbit(want[0, 1]) and _bits(got) == _bits(want)
