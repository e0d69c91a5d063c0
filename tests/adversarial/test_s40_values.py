"""Session 40: forward values of imported torch ops against torch, bit for bit, where einjoin
computed another number (half-precision rounding steps, ...)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import einjoin as ej

torch = pytest.importorskip("torch")


def _torch(v: Any) -> Any:
    return v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))


def _same_bits(got: Any, want: Any) -> None:
    got = _torch(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    num = ~torch.isnan(want)
    assert torch.equal(torch.signbit(got[num]), torch.signbit(want[num]))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


class _Div(torch.nn.Module):
    def forward(self, a: Any, b: Any) -> Any:
        return (torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"),
                a // b, a // 2.5, 3 // b)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_floor_and_trunc_division_round_as_torch(dtype: str) -> None:
    # torch rounds each step of its floor-division algorithm, and the quotient before truncating,
    # to the half dtype; one rounding at the end gave another integer for ~5% of random bfloat16
    # pairs (13.8125 / 1.2578125 truncated: 10, torch 11)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0., -0., 1., -1., math.inf, -math.inf, math.nan, 3.5, -2.5, 6e4, 1e-7, 7.])
    a = torch.cat([torch.randn(3000, generator=g) * 20, special.repeat_interleave(12)]).to(dt)
    b = torch.cat([torch.randn(3000, generator=g) * 2, special.repeat(12)]).to(dt)
    got = ej.compile(ej.from_torch(_Div(), (a, b)), quiet=True).run(a, b)
    for g_, w in zip(got, _Div()(a, b)):
        _same_bits(g_, w)


class _NativeNorms(torch.nn.Module):
    def forward(self, x: Any) -> Any:
        out, mean, rstd = torch.native_layer_norm(x, (4,), None, None, 1e-5)
        g, gm, gr = torch.native_group_norm(x, None, None, 2, 3, 4, 3, 1e-5)
        return out * mean + rstd, g, gm * gr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_norms_return_their_statistics(dtype: str) -> None:
    # native_layer_norm / native_group_norm returned None for mean and rstd: a forward reading
    # them failed ("mul: cannot combine an einjoin tensor with NoneType"; opdb: all 123 refused)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    got = ej.compile(ej.from_torch(_NativeNorms(), (x,)), quiet=True).run(x)
    for g, w in zip(got, _NativeNorms()(x)):
        g = _torch(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)
