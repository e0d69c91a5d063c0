"""Every cell of issue 24's differential matrix on each run: backend (sync, threads, torch on the
CPU) x devices 1, 2, 4 x engine memory / DuckDB, one fixed rank-3 power-law problem mixed with a
dense operand and a two-sparse-operand chain, sum and max, against numpy on the densified data.
tests/test_sparse_matrix.py draws the cells at random (about 20 memory and 6 DuckDB examples over 9
cells each: some cells go unchecked in a given run); this fixes one problem per cell (Ray: that file's
test_on_ray)."""

from __future__ import annotations

import numpy as np
import pytest
from test_sparse import random_coo
from test_sparse_matrix import check

import einjoin as ej
from einjoin.sparse import distribute

pytest.importorskip("duckdb")
pytest.importorskip("torch")

CELLS = [(backend, devices, engine) for engine in ("memory", "duckdb") for backend in ("sync", "threads", "torch")
         for devices in (1, 2, 4)]


@pytest.fixture(autouse=True)
def split_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distribute, "MIN_SPLIT_WORK", 0.0)  # small problems: split them anyway


def _problems() -> list[tuple[str, list]]:
    rng = np.random.default_rng(11)
    x = ej.sparse("X", (*random_coo(rng, (12, 9, 7), 0.05, "power"), (12, 9, 7)))  # duplicates, zeros
    a = ej.sparse("A", (*random_coo(rng, (10, 8), 0.2, "uniform"), (10, 8)))
    b = ej.sparse("B", (*random_coo(rng, (8, 6), 0.3, "power"), (8, 6)))
    return [("ijk,jl->ikl", [x, rng.standard_normal((9, 4))]),
            ("ij,jk,kl->il", [a, b, rng.standard_normal((6, 3))])]


@pytest.mark.parametrize("backend,devices,engine", CELLS)
def test_every_backend_device_count_and_engine(backend: str, devices: int, engine: str) -> None:
    runs = [(eq, operands, agg) for eq, operands in _problems() for agg in ("sum", "max")]
    if engine == "duckdb":  # a connection per device and query: one of the four per cell, each on some cell
        runs = [runs[(CELLS.index((backend, devices, engine)) + devices) % len(runs)]]
    for eq, operands, agg in runs:
        check(eq, operands, agg, {}, {"i"}, backend, devices, engine)
