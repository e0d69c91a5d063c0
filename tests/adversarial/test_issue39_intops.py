"""Issue 39 (H7): integer ops of imported torch modules, differential against torch 2.13.

Before this issue bitwise and / or / xor / not of integers, shifts, ``fmod``,
``div(rounding_mode="trunc")`` and ``cummax`` / ``cummin`` had no translation (bitwise ops took
bool masks only), ``clamp(uint8, -5, 7)`` was refused where torch wraps -5, sorting a bool tensor
was refused, and the mean of an integer tensor (reachable through the torch.fx capture, which does
not run the op) gave float32 where torch refuses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej
from einjoin.errors import EinjoinError

NAN = float("nan")


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


class _One(nn.Module):  # torch.fx traces no *args forward
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _run(fn, *xs, method: str = "auto"):
    m = _Fn(fn) if method != "fx" else _One(fn)
    return ej.compile(ej.from_torch(m, xs, method=method), quiet=True).run(*xs), m(*xs)


def _same(got, want) -> None:
    gs = got if isinstance(got, (tuple, list)) else (got,)
    ws = want if isinstance(want, tuple) else (want,)
    assert len(gs) == len(ws)
    for g, w in zip(gs, ws):
        g = g if isinstance(g, torch.Tensor) else torch.as_tensor(np.asarray(g))
        assert g.dtype == w.dtype and g.shape == w.shape, (g, w)
        if w.is_floating_point():  # bitwise, signed zeros and NaN included
            num = ~torch.isnan(w)
            assert torch.equal(torch.signbit(g[num]), torch.signbit(w[num])), (g, w)
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            assert torch.equal(g, w), (g, w)


def _ints(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_bitwise_and_or_xor_not_match_torch(dtype):
    a, b = _ints(dtype, 24, 1), _ints(dtype, 24, 2)
    _same(*_run(lambda x, y: (x & y, x | y, x ^ y, ~x, torch.bitwise_and(x, 3 if dtype != torch.bool else True),
                              x | (300 if dtype != torch.bool else False)), a, b))


def test_bitwise_mixed_dtypes_promote_as_torch():
    a, b = _ints(torch.int8, 12, 3), _ints(torch.int64, 12, 4)
    _same(*_run(lambda x, y, z: (x & y, z ^ x, torch.bitwise_or(z, y)), a, b, a > 0))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_shifts_match_torch_counts_out_of_range_included(dtype):
    a = _ints(dtype, 40, 5)
    width = torch.iinfo(dtype).bits
    s = torch.tensor([0, 1, 3, width - 1, width, width + 5, -1, -7] * 5)[:40].to(dtype)
    _same(*_run(lambda x, y: (x << y, x >> y, x << 3, x >> 2, x >> width), a, s))


def test_fmod_matches_torch_floats_and_ints():
    a = torch.tensor([-7.5, 7.5, 3.0, -0.0, 5.0, NAN, float("inf"), 1e30], dtype=torch.float64)
    b = torch.tensor([2.0, -2.0, 0.0, 3.0, float("inf"), 1.0, 2.0, 7.0], dtype=torch.float64)
    _same(*_run(lambda x, y: (torch.fmod(x, y), torch.fmod(x.float(), 2.5), x.fmod(y)), a, b))
    ai, bi = torch.tensor([-7, 7, -8, 9], dtype=torch.int32), torch.tensor([2, -2, 3, -4], dtype=torch.int32)
    _same(*_run(lambda x, y: (torch.fmod(x, y), torch.fmod(x, 3)), ai, bi))


def test_integer_fmod_and_trunc_division_by_zero_are_refused():
    a, b = torch.tensor([1, 2]), torch.tensor([1, 0])
    for f, what in ((lambda x, y: torch.fmod(x, y), "fmod"),
                    (lambda x, y: torch.div(x, y, rounding_mode="trunc"), "trunc division")):
        prog = ej.compile(ej.from_torch(_Fn(f), (a, torch.tensor([1, 1]))), quiet=True)
        with pytest.raises(EinjoinError, match=f"integer {what} by zero"):  # the op the user wrote
            prog.run(a, b)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.float32, torch.float64])
def test_trunc_division_matches_torch(dtype):
    a = torch.tensor([-7, 7, -8, 9, 0, 5, -1, 100]).to(dtype)
    b = torch.tensor([2, -2, 3, -4, 5, 5, 3, -7]).to(dtype)
    _same(*_run(lambda x, y: (torch.div(x, y, rounding_mode="trunc"), torch.div(x, 3, rounding_mode="trunc")), a, b))


def test_trunc_division_of_floats_by_zero_and_infinities():
    a = torch.tensor([1.0, -1.0, 0.0, float("inf"), -3.5, NAN])
    b = torch.tensor([0.0, 0.0, 0.0, 2.0, float("inf"), 1.0])
    _same(*_run(lambda x, y: torch.div(x, y, rounding_mode="trunc"), a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_cummax_cummin_values_and_indices_match_torch(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 4, (3, 9), generator=g).to(dtype)  # ties: torch names the last
    _same(*_run(lambda t: (*torch.cummax(t, 1), *torch.cummin(t, 0), torch.cummax(t, -1).indices), x))


def test_cummax_cummin_with_nans_and_signed_zeros():
    x = torch.tensor([1.0, NAN, 0.0, NAN, 5.0, -0.0, 0.0, -0.0])
    y = torch.tensor([0.0, -0.0, -1.0, -0.0, 0.0])
    _same(*_run(lambda a, b: (*torch.cummax(a, 0), *torch.cummin(a, 0), *torch.cummax(b, 0), *torch.cummin(b, 0)),
                x, y))


def test_clamp_of_uint8_wraps_negative_bounds_as_torch():
    x = torch.tensor([0, 3, 200, 255], dtype=torch.uint8)
    _same(*_run(lambda t: (torch.clamp(t, -5, 7), torch.clamp(t, min=-255), torch.clamp(t, max=-1)), x))


def test_clamp_out_of_torchs_range_is_refused():
    for dt, v in ((torch.uint8, -256), (torch.int8, 128)):
        with pytest.raises(EinjoinError, match="overflow"):
            _run(lambda t, v=v: torch.clamp(t, min=v), torch.tensor([1, 2], dtype=dt), method="fx")


def test_sorting_bool_tensors_matches_torch():
    x = torch.tensor([[True, False, True, False, False], [False, False, True, True, True]])
    _same(*_run(lambda t: (*torch.sort(t, 1), *torch.sort(t, 0, descending=True), torch.argsort(t, stable=True)), x))


def test_logical_ops_of_numbers_match_torch():
    a = torch.tensor([0.0, 2.0, NAN, -0.0, 1.0])
    b = torch.tensor([0, 1, 0, 3, -1])
    _same(*_run(lambda x, y: (torch.logical_and(x, y), torch.logical_or(x, y), torch.logical_xor(x, y),
                              torch.logical_not(x), torch.logical_not(y)), a, b))


def test_mean_of_integers_is_refused_as_torch_does():
    class M(nn.Module):
        def forward(self, x):
            return x.mean()
    with pytest.raises(EinjoinError, match="mean of a int64"):
        ej.from_torch(M(), (torch.tensor([1, 2]),), method="fx")
    got, want = _run(lambda x: x.mean(dtype=torch.float64), torch.tensor([1, 2]))
    _same(got, want)


def test_bitwise_of_floats_is_refused_clearly():
    with pytest.raises(EinjoinError, match="integer or bool"):
        _run(lambda x: torch.bitwise_and(x.long(), 1) & x, torch.tensor([1.0]), method="fx")


def test_the_gradient_through_trunc_division_is_torchs_zero() -> None:
    # torch: div(rounding_mode="trunc") is piecewise constant and its gradient is 0 (it was refused
    # here as "floor_divide has no derivative"); the product beside it keeps its gradient
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor([3.5, -2.5, 7.0], dtype=torch.float64))
            self.b = nn.Parameter(torch.tensor([2.0, 2.0, -3.0], dtype=torch.float64))

        def forward(self, s):
            return ((torch.div(self.a, self.b, rounding_mode="trunc") * 5 + self.a * self.b) * s).sum()

    m, s = M(), torch.tensor(1.0, dtype=torch.float64)
    m(s).backward()
    fn = ej.from_torch(m, (s,))
    grads = ej.grad(fn.outputs[0], list(fn.parameters.values()))
    ga, gb = ej.compile(fn.with_outputs(list(grads)), quiet=True).run(s)
    np.testing.assert_array_equal(np.asarray(ga), m.a.grad.numpy())
    np.testing.assert_array_equal(np.asarray(gb), m.b.grad.numpy())
