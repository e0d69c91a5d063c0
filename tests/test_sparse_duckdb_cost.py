"""The DuckDB cost model (einjoin/sparse/duckdb_cost.py): with ``engine="duckdb"`` the layout is
chosen by its query's costs (rows, list elements, lambdas), not fixed per entry, and the chosen
layouts still equal the in-memory engine and numpy on the densified data."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse

import einjoin as ej
from einjoin.sparse import duckdb_cost

pytest.importorskip("duckdb")


def test_columns_limit_is_the_executors() -> None:
    from einjoin.sparse import duckdb_exec
    assert duckdb_cost.COLUMNS_MAX == duckdb_exec.COLUMNS_MAX


def test_full_blocks_without_a_sum_inside_are_keyed_per_block() -> None:
    # a Hadamard product of dense 16-blocks: one row per block (its 256 elements as columns)
    # costs less than a row per entry on DuckDB; the result is the same
    rng = np.random.default_rng(0)
    bd = scipy.sparse.block_diag([rng.standard_normal((16, 16)) for _ in range(12)]).tocsr()
    a = ej.sparse("A", bd)
    d = rng.standard_normal(bd.shape)
    duck = ej.sparse_compile("ij,ij->ij", a, d, engine="duckdb", duckdb_memory="256MB")
    assert duck.steps[0].layout.kernel == "sql"
    assert all(b is not None and b > 1 for b in duck.blocks.values()), duck.explain()
    per_entry = ej.sparse_compile("ij,ij->ij", a, d, engine="duckdb", blocks={"i": 1, "j": 1})
    assert duck.steps[0].layout.cost < per_entry.steps[0].layout.cost
    got = duck.run().todense()
    np.testing.assert_allclose(got, ej.sparse_compile("ij,ij->ij", a, d).run().todense(), rtol=1e-12)
    np.testing.assert_allclose(got, bd.toarray() * d, rtol=1e-12)


def test_a_scattered_graph_times_a_dense_matrix_is_keyed_per_entry() -> None:
    # lambdas over 16-blocks that hold ~1 entry each cost far more than a join per entry; the
    # memory engine's model (numpy's einsum) chooses on its own costs
    rng = np.random.default_rng(1)
    g = scipy.sparse.random(1500, 1500, density=3e-3, random_state=2, format="csr")
    a = ej.sparse("A", g)
    h = rng.standard_normal((1500, 32))
    duck = ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb")
    assert duck.blocks == {"i": 1, "k": None, "j": 1}, duck.explain()
    for b in (4, 16, 64):
        pinned = ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb", blocks={"i": b, "j": b})
        assert pinned.steps[0].layout.cost > duck.steps[0].layout.cost


def test_features_follow_the_query_shape() -> None:
    # up to COLUMNS_MAX output elements come back as columns, more as crossed rows; lambdas only
    # where a label is summed inside a payload
    f = duckdb_cost.features([10, 4], [4, 8], 10.0, 8, 32, 3.0, 0)
    assert f["outs"] == 80 and f["cross"] == 0 and f["lambda"] == 320 and f["lambda_rows"] == 0
    f = duckdb_cost.features([10, 4], [1, 300], 10.0, 300, 300, 3.0, 0)
    assert f["outs"] == 0 and f["cross"] == 3000 and f["lambda"] == f["lambda_rows"] == 0
    cost = duckdb_cost.duckdb_cost([10, 4], [1, 300], 10.0, 300, 300, 3.0, 0)
    assert cost == pytest.approx(sum(duckdb_cost.COSTS[k] * v for k, v in f.items()))
