"""Reviewer R1's checks of session 38's changes (each fails before its fix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej

# ---------------------------------------------------------------- narrow ints in fused joins


def _where(c, a, b):  # type: ignore[no-untyped-def]
    return torch.where(c, a, b) if isinstance(c, torch.Tensor) else ej.where(c, a, b)


FUSED = {
    "floordiv_mul_floordiv": lambda x: ((x // 3) * 1000) // 7,
    "mod_mul_compare": lambda x: ((x % 7) * 1000) < 100,
    "pow_floordiv": lambda x: (x ** 2) // 3,
    "pow_mod": lambda x: (x ** 2) % 5,
    "rpow_floordiv": lambda x: ((2 ** (x % 8)) * 100) // 3,
    "floordiv_mul_where": lambda x: _where(((x // 2) * 300) > 0, x, x + 1),
    "abs_chain": lambda x: (x // 1).abs() // 2 * 3000 // 5,
}


@pytest.mark.parametrize("dt", ["int8", "uint8", "int16", "int32"])
@pytest.mark.parametrize("case", sorted(FUSED))
def test_a_fused_narrow_int_chain_wraps_in_its_dtype(dt: str, case: str) -> None:
    # fusion puts x // 3, x % 7, x ** 2 and the ops after them into one join; its // % ** took
    # their Python-int constant as an int64 array, so the rest of the chain ran in int64 and
    # never wrapped: ((x // 3) * 1000) // 7 of int32 gave 1423301898 where torch (and the
    # unfused reference) give 196168385; the torch backend's ipow too
    info = np.iinfo(dt)
    a = np.random.default_rng(3).integers(int(info.min), int(info.max), (4, 6), endpoint=True).astype(dt)
    want = FUSED[case](torch.from_numpy(a)).numpy()
    y = FUSED[case](ej.input(f"fz_{dt}", a.shape, dt))
    assert y.dtype == str(want.dtype)
    np.testing.assert_array_equal(ej.reference(y, **{f"fz_{dt}": a}), want)
    for backend, devices in (("threads", 1), ("threads", 2), ("torch", 1)):
        got = np.asarray(ej.compile(y, devices=devices, backend=backend, quiet=True).run(**{f"fz_{dt}": a}))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=f"{backend} on {devices}")
