"""Sparse einsums on DuckDB (issue 24, ``engine="duckdb"``): the same random problems as
tests/test_sparse.py (1-3 operands of rank 2-3, some dense, sum or max, densities 1e-4 to 0.5,
uniform or power-law patterns, duplicates and explicit zeros, random block pins) equal the
in-memory engine and numpy on the densified data; a relation larger than a tiny ``memory_limit``
spills and still equals. On one device; several (a connection per device) in
tests/test_sparse_matrix.py.

Few examples: every example opens a DuckDB connection and loads its tables.
"""

from __future__ import annotations

import builtins
import importlib
import sys
from unittest import mock

import numpy as np
import pytest
import scipy.sparse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sparse import DENSITIES, dense, reference, sparse_problems

import einjoin as ej
from einjoin.sparse import SparseTensor

pytest.importorskip("duckdb")


def both(eq: str, operands: list, agg: str = "sum", **kw: object) -> tuple:
    mem = ej.sparse_compile(eq, *operands, agg=agg, **kw)
    duck = ej.sparse_compile(eq, *operands, agg=agg, engine="duckdb", duckdb_memory="256MB", **kw)
    return mem, duck


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_problems(max_size=7))
def test_random_sparse_einsums_equal_memory_and_numpy(problem: tuple) -> None:
    eq, operands, agg, blocks, relational = problem
    mem, duck = both(eq, operands, agg, blocks=blocks, relational=relational)
    got, ref = duck.run(), mem.run()
    assert isinstance(got, SparseTensor) == isinstance(ref, SparseTensor), duck.explain()
    want = reference(eq, [dense(x) for x in operands], agg)
    assert dense(got).shape == want.shape and dense(got).dtype == dense(ref).dtype
    np.testing.assert_allclose(dense(got), dense(ref), rtol=1e-9, atol=1e-9, err_msg=duck.explain())
    np.testing.assert_allclose(dense(got), want, rtol=1e-9, atol=1e-9, err_msg=duck.explain())
    for s_mem, s_duck in zip(mem.steps, duck.steps):  # at the same layout, the same tuples met
        if s_mem.ran is not None and s_duck.ran is not None and s_mem.ran.blocks == s_duck.ran.blocks:
            assert s_duck.counts == s_mem.counts, duck.explain()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sparse_problems(max_size=7))
def test_payload_rows_and_key_ranges_equal_memory(problem: tuple) -> None:
    # the other query shapes: every output payload as (key, position) rows, and the output keys
    # split into ranges (as under a memory_limit too small for one aggregation)
    from einjoin.sparse import duckdb_exec
    eq, operands, agg, blocks, relational = problem
    with mock.patch.object(duckdb_exec, "COLUMNS_MAX", 0), mock.patch.object(duckdb_exec, "AGG_STATE_BYTES", 1e9):
        mem, duck = both(eq, operands, agg, blocks=blocks, relational=relational)
        got = duck.run()
    np.testing.assert_allclose(dense(got), dense(mem.run()), rtol=1e-9, atol=1e-9, err_msg=duck.explain())


@pytest.mark.parametrize("density", [1e-4, 0.01, 0.5])
@pytest.mark.parametrize("agg", ["sum", "max"])
def test_matrices_at_pinned_blocks(density: float, agg: str) -> None:
    # block sizes that do not divide the shape: edge padding in summed and output labels
    rng = np.random.default_rng(int(density * 1e4))
    a = ej.sparse("A", scipy.sparse.random(37, 29, density=density, random_state=1))
    h = rng.standard_normal((29, 11))
    for blocks in [{}, {"i": 4, "j": 5}, {"j": 8, "k": 3}]:
        mem, duck = both("ij,jk->ik", [a, h], agg, blocks=blocks)
        np.testing.assert_allclose(dense(duck.run()), dense(mem.run()), rtol=1e-9, atol=1e-9,
                                   err_msg=duck.explain())
        np.testing.assert_allclose(dense(duck.run()), reference("ij,jk->ik", [a.todense(), h], agg),
                                   rtol=1e-9, atol=1e-9)


def test_empty_results_all_zero_inputs_and_integers() -> None:
    empty = ej.sparse("A", (np.zeros((2, 0), np.int64), np.zeros(0), (4, 5)))
    zeros = ej.sparse("Z", (np.array([[0, 1], [2, 3]]), np.zeros(2), (4, 5)))
    h = np.random.default_rng(0).standard_normal((5, 3))
    for a in [empty, zeros]:
        for agg in ["sum", "max"]:
            for eq in ["ij,jk->ik", "ij,jk->k", "ij,jk->"]:
                mem, duck = both(eq, [a, h], agg)
                got = duck.run()
                np.testing.assert_array_equal(dense(got), dense(mem.run()))
                np.testing.assert_array_equal(dense(got), reference(eq, [a.todense(), h], agg))
    # disjoint supports: nothing joins
    b = ej.sparse("B", (np.array([[1], [2]]), np.array([5.0]), (5, 3)))
    a2 = ej.sparse("A", (np.array([[0], [0]]), np.array([7.0]), (4, 5)))
    assert ej.sparse_compile("ij,jk->ik", a2, b, engine="duckdb").run().nblocks == 0
    # integers stay exact integers (BIGINT in SQL)
    ai = ej.sparse("I", (np.array([[0, 0, 1], [0, 2, 2]]), np.array([3, 4, 5]), (2, 3)))
    hi = np.arange(6).reshape(3, 2)
    got = ej.sparse_compile("ij,jk->ik", ai, hi, engine="duckdb").run().todense()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, ai.todense() @ hi)


def test_relations_over_a_tiny_memory_limit_spill_and_still_equal(tmp_path) -> None:
    # A: 200k tuples (~5 MB), H: 20000 x 64 doubles (~10 MB) under a 12 MB limit: the tables
    # spill; ~20k output keys of 64 sums (~60 MB of aggregation states) go in ranges, a query each
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 20000, (2, 200000))  # not scipy.sparse.random: it permutes all 4e8 cells
    a = ej.sparse("A", (idx, rng.standard_normal(200000), (20000, 20000)))
    h = rng.standard_normal((20000, 64))
    mem = ej.sparse_compile("ij,jk->ik", a, h)
    duck = ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb", duckdb_memory="12MB",
                             duckdb_temp=str(tmp_path), duckdb_threads=1)
    got = duck.run()
    np.testing.assert_allclose(got.todense(), mem.run().todense(), rtol=1e-9, atol=1e-9)
    assert duck.engine.spilled > 0 and duck.engine.ranges > 1, duck.explain()
    assert "engine duckdb (memory_limit 12MB, last run spilled" in duck.explain()


def test_a_memory_limit_too_small_for_duckdb_is_a_clear_error() -> None:
    # 1 MB cannot hold DuckDB's buffers for this step (it fails loading 2000 x 64 doubles): an
    # EinjoinError naming the limit, the threads and what to set, not DuckDB's raw Out of Memory
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 2000, (2, 20000))
    a = ej.sparse("A", (idx, rng.standard_normal(20000), (2000, 2000)))
    h = rng.standard_normal((2000, 64))
    duck = ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb", duckdb_memory="1MB", duckdb_threads=1)
    with pytest.raises(ej.EinjoinError, match=r"memory_limit 1MB \(1 thread\).*duckdb_memory=.*duckdb_threads="):
        duck.run()


def test_duckdb_layout_keys_sparse_labels_per_entry() -> None:
    # blocks suit numpy kernels (in memory: block-diagonal times block-diagonal keys k at 16), not
    # SQL list arithmetic: DuckDB keys per entry
    rng = np.random.default_rng(0)
    b = ej.sparse("B", scipy.sparse.block_diag([rng.standard_normal((32, 32)) for _ in range(6)]))
    h = ej.sparse("C", scipy.sparse.block_diag([rng.standard_normal((32, 32)) for _ in range(6)]))
    assert max(v or 0 for v in ej.sparse_compile("ij,jk->ik", b, h).blocks.values()) > 1
    duck = ej.sparse_compile("ij,jk->ik", b, h, engine="duckdb")
    assert duck.blocks == {"i": 1, "k": 1, "j": 1}
    pinned = ej.sparse_compile("ij,jk->ik", b, h, engine="duckdb", blocks={"j": 16})
    assert pinned.blocks["j"] == 16
    np.testing.assert_allclose(pinned.run().todense(), b.todense() @ h.todense())
    np.testing.assert_allclose(duck.run().todense(), b.todense() @ h.todense())


def test_ej_einsum_stays_in_memory_and_errors_are_named(monkeypatch) -> None:
    a = ej.sparse("A", np.eye(3))
    assert ej.sparse_compile("ij->i", a).engine.name == "memory"
    with pytest.raises(ej.UnsupportedOpError, match="engine 'sqlite'"):
        ej.sparse_compile("ij->i", a, engine="sqlite")
    with pytest.raises(ej.EinjoinError, match="duckdb_memory"):
        ej.sparse_compile("ij->i", a, duckdb_memory="1GB")
    with pytest.raises(ej.EinjoinError, match="duckdb_threads=0"):
        ej.sparse_compile("ij->i", a, engine="duckdb", duckdb_threads=0)
    with pytest.raises(ej.EinjoinError, match="DuckDB refused"):
        ej.sparse_compile("ij->i", a, engine="duckdb", duckdb_memory="lots").run()
    # a missing duckdb: a clear error naming the extra
    real_import = builtins.__import__

    def no_duckdb(name: str, *args: object, **kw: object) -> object:
        if name == "duckdb":
            raise ImportError("no duckdb")
        return real_import(name, *args, **kw)
    monkeypatch.setitem(sys.modules, "duckdb", None)
    monkeypatch.setattr(builtins, "__import__", no_duckdb)
    with pytest.raises(ej.EinjoinError, match=r"einjoin\[duckdb\]"):
        ej.sparse_compile("ij->i", a, engine="duckdb")


def test_import_einjoin_does_not_import_duckdb() -> None:
    import subprocess
    code = "import sys, einjoin, einjoin.sparse; assert 'duckdb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert importlib.util.find_spec("duckdb") is not None


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2 ** 31), st.sampled_from(DENSITIES))
def test_chain_of_three_as_binary_steps(seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    a = ej.sparse("A", scipy.sparse.random(40, 30, density=density, random_state=seed % 1000))
    h = rng.standard_normal((30, 20))
    c = ej.sparse("C", scipy.sparse.random(20, 10, density=density, random_state=seed % 1000 + 1))
    mem, duck = both("ij,jk,kl->il", [a, h, c])
    np.testing.assert_allclose(dense(duck.run()), dense(mem.run()), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dense(duck.run()), a.todense() @ h @ c.todense(), rtol=1e-9, atol=1e-9)
