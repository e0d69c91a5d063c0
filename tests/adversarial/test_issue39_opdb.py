"""Issue 39 (H7): the torch import against torch's own op database (``op_db``'s OpInfo samples).

Each case wraps one OpInfo sample in a module, imports it with ``ej.from_torch``, runs it and
compares with torch (``opdb_sweep.run_case``): it must match (dtype, shape, values) or be refused
with an ``EinjoinError``; a wrong value or a raw exception fails. ``make test`` runs a fixed,
seeded subset (one sample of 48 (op, dtype) pairs); ``make test-all`` the sweep over every
translated OpInfo and dtype (``EINJOIN_OPDB_SAMPLES`` samples each, 4 by default).
Also the regressions the sweep found, each on its own.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej

pytest.importorskip("expecttest")  # torch's op_db imports it

import opdb_sweep as S  # noqa: E402 - after the skip

SHARDS = 6


def _subset() -> list[tuple[str, torch.dtype]]:
    """48 (op, dtype) pairs drawn with a fixed seed from the translated OpInfos."""
    pairs = sorted({(i.name + ("." + i.variant_test_name if i.variant_test_name else ""), str(dt))
                    for i in S.op_db() if S.translated(i) for dt in S.DTYPES
                    if dt in i.supported_dtypes("cpu")})
    return [(n, getattr(torch, d.removeprefix("torch."))) for n, d in random.Random(39).sample(pairs, 48)]


def _check(results: dict[str, list[tuple[str, str]]]) -> None:
    bad = results.get("wrong", []) + results.get("raw", [])
    assert not bad, "\n".join(f"{k}: {why}" for k, why in bad)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_a_seeded_subset_of_op_db_matches_torch_or_is_refused(shard):
    infos = {i.name + ("." + i.variant_test_name if i.variant_test_name else ""): i for i in S.op_db()}
    out: dict[str, list[tuple[str, str]]] = {}
    for name, dt in _subset()[shard::SHARDS]:
        case = next(S.cases(infos[name], dt, 1), None)
        if case is not None:
            status, why = S.run_case(case)
            out.setdefault(status, []).append((case.key, why))
    _check(out)


@pytest.mark.slow  # make test-all: every translated OpInfo, dtype and (capped) sample
@pytest.mark.parametrize("shard", range(8))
def test_the_op_db_sweep_matches_torch_or_is_refused(shard):
    per_op = int(os.environ.get("EINJOIN_OPDB_SAMPLES", "4"))
    _check(S.sweep(per_op=per_op, shard=(shard, 8)))


# ---------------------------------------------------------------- what the sweep found


class _Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _same(fn, x) -> None:
    m = _Fn(fn)
    got, want = ej.compile(ej.from_torch(m, (x,)), quiet=True).run(x), m(x)
    got = torch.as_tensor(np.asarray(got))
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (got, want)


def test_square_of_bools_is_int64_as_torch():
    _same(torch.square, torch.tensor([True, False]))  # was bool


@pytest.mark.parametrize("eq", ["ij->i", "ij->", "ii", "ii->i"])
def test_one_operand_einsum_of_narrow_ints_sums_in_int64_as_torch(eq):
    _same(lambda t: torch.einsum(eq, t), torch.arange(9, dtype=torch.int32).reshape(3, 3) * 300_000_000)


def test_squeeze_with_an_empty_dim_list_squeezes_nothing():
    _same(lambda t: torch.squeeze(t, ()), torch.ones(1, 1, 2))  # was shape (2,)


@pytest.mark.parametrize("reduce", ["amax", "amin"])
def test_scatter_reduce_extrema_of_int32_match_torch(reduce):
    x = torch.tensor([[5, -7, 2], [1, 0, 9]], dtype=torch.int32)
    idx = torch.tensor([[0, 0, 2], [1, 1, 1]])
    src = torch.tensor([[3, 4, -8], [2, 6, -1]], dtype=torch.int32)
    _same(lambda t: t.scatter_reduce(1, idx, src, reduce), x)  # was refused: int64's bound met int32


def test_var_and_std_with_the_unbiased_flag_in_dims_place():
    x = torch.tensor([[1.0, 2.0, 4.0], [0.5, -3.0, 8.0]])
    _same(lambda t: torch.var(t, False), x)  # was a ShapeError: the flag read as a dim
    _same(lambda t: torch.std(t, True), x)
