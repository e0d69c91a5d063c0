"""einjoin.ir.evaluate: sub-expressions shared across the operand order of add and mul (the same
numbers as numpy's step-by-step evaluation), not of max and min (not commutative at -0.0)."""

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from einjoin.ir.evaluate import SlotProgram, evaluate
from einjoin.ir.scalar import parse_join

floats = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _bits(v: Any) -> np.ndarray:
    return np.asarray(v, np.float32).view(np.int32)


@settings(max_examples=60, deadline=None)
@given(st.lists(floats, min_size=6, max_size=6), st.lists(floats, min_size=6, max_size=6))
def test_swapped_products_are_computed_once_with_numpys_bits(a: list[float], b: list[float]) -> None:
    x = np.array(a, np.float32).reshape(2, 3)
    g = np.array(b[:2], np.float32).reshape(2, 1)
    prog = SlotProgram(parse_join("exp(x1) * x0 + x0 * exp(x1) + (x1 + x0) * (x0 + x1)", 2))
    assert [fn for _, fn, _, _ in prog.steps].count("mul") == 2  # exp(x1) * x0 and the square
    assert [fn for _, fn, _, _ in prog.steps].count("add") == 3
    with np.errstate(all="ignore"):
        e = np.exp(g)
        want = (e * x + x * e) + (g + x) * (x + g)
        got = evaluate(parse_join("exp(x1) * x0 + x0 * exp(x1) + (x1 + x0) * (x0 + x1)", 2), [x, g])
        replay = prog.replay()
        first, again = replay([x, g]), replay([x, g])
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan])
    assert np.array_equal(_bits(first), _bits(got)) and np.array_equal(_bits(again), _bits(got))


def test_max_and_min_keep_both_operand_orders() -> None:
    # numpy's maximum / minimum of -0.0 and 0.0 give another zero in the other order: merged, the
    # difference below would be +0.0 at both elements
    x = np.array([-0.0, 0.0], np.float32)
    y = np.array([0.0, -0.0], np.float32)
    for fn, u in (("max", np.maximum), ("min", np.minimum)):
        prog = SlotProgram(parse_join(f"{fn}(x0, x1) - {fn}(x1, x0)", 2))
        assert [f for _, f, _, _ in prog.steps].count(fn) == 2
        want = np.subtract(u(x, y), u(y, x))
        got = evaluate(parse_join(f"{fn}(x0, x1) - {fn}(x1, x0)", 2), [x, y])
        assert _bits(got).tolist() == _bits(want).tolist()
