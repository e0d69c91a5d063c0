"""Issue 39 (H15): torch ops the op_db sweep (tests/adversarial/opdb_sweep.py) found refused in
forms torch computes, differential against torch: ``fmax`` / ``fmin`` of bools, ``outer`` of bools,
``index_select`` with a 0-d index, ``round(x, decimals=k)``.
"""

from __future__ import annotations

import pytest
import torch

from tests.adversarial.test_issue39_intops import _run, _same  # torch-exact comparison


def test_fmax_fmin_of_bools_are_or_and():
    a = torch.tensor([[True, False, True, False]] * 3)
    b = torch.tensor([True, True, False, False])
    _same(*_run(lambda x, y: (torch.fmax(x, y), torch.fmin(x, y), torch.fmax(y, x), torch.fmin(y, x)), a, b))


def test_outer_of_bools_is_and():
    a, b = torch.tensor([True, False, True]), torch.tensor([True, True, False, False])
    _same(*_run(lambda x, y: (torch.outer(x, y), torch.outer(y, x)), a, b))


def test_index_select_of_a_0d_tensor_with_a_0d_or_one_element_index():
    x = torch.tensor(2.5)
    _same(*_run(lambda v, i, j: (torch.index_select(v, 0, i), torch.index_select(v, -1, j)),
                x, torch.tensor(0), torch.tensor([0])))
    y = torch.arange(6).reshape(2, 3)  # a 0-d index of a matrix keeps the dim, as torch
    _same(*_run(lambda v, i: torch.index_select(v, 1, i), y, torch.tensor(2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_round_with_decimals_is_torchs_bit_for_bit(dtype):
    # torch: nearbyint(x * 10**k) / 10**k (x / 10**-k, then * for k < 0), 16-bit floats in float32;
    # halfway points, signed zeros, inf, NaN and overflow included
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(400, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-3, 5, (400,), generator=g)).to(dtype)
    edge = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.125, 0.0125, -0.0001, -0.3, -0.0, 1e30, -1e30,
                         float("inf"), float("-inf"), float("nan"), 1e-30, 3.4e38]).to(dtype)
    half = ((torch.arange(-40, 40, dtype=torch.float64) + 0.5) / 100).to(dtype)
    x = torch.cat([x, edge, half])
    _same(*_run(lambda v: (torch.round(v, decimals=2), torch.round(v, decimals=1), torch.round(v, decimals=-2),
                           torch.round(v, decimals=5), torch.round(v)), x))


@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_of_bools(include_self):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 2, (3, 5), generator=g).bool()
    src = torch.randint(0, 2, (3, 4), generator=g).bool()
    idx = torch.randint(0, 5, (3, 4), generator=g)
    _same(*_run(lambda a, i, s: tuple(a.scatter_reduce(1, i, s, r, include_self=include_self)
                                      for r in ("prod", "amax", "amin")), x, idx, src))


def test_scatter_reduce_of_a_0d_tensor():
    x, i = torch.tensor(3.0), torch.tensor(0)
    _same(*_run(lambda a, j, s: tuple(a.scatter_reduce(0, j, s, r, include_self=inc)
                                      for r in ("sum", "prod", "mean", "amax", "amin") for inc in (True, False)),
                x, i, torch.tensor(-2.0)))
