"""Reviewer R1's checks of session 39's changes (each fails before its fix)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.errors import ShapeError

# ---------------------------------------------------------------- a max over nothing (9721cfc)


@pytest.mark.parametrize("fed", [False, True])
def test_a_graph_max_over_an_empty_label_is_refused_as_the_dense_max_not_zero(fed: bool) -> None:
    # max over a label of extent 0 has no value: the dense einsum refuses it when the node is
    # built, and the compiled sparse run refused it in its kernel, but ej.reference of the same
    # sparse node gave 0 for every row (its docstring: "0, as the engine gives")
    a = ej.sparse_input("Aempty", (3, 0), nnz=1, dtype="float64") if fed else ej.sparse("Aempty", np.zeros((3, 0)))
    v = ej.input("v_empty", (0,), "float64")
    with pytest.raises(ShapeError, match="max over label"):
        ej.einsum("ij,j->i", ej.input("d_empty", (3, 0), "float64"), v, agg="max")
    with pytest.raises(ShapeError, match="max over label"):
        ej.einsum("ij,j->i", a, v, agg="max")
    # a summed extent of 0 under sum is still 0, and a max with nothing summed is fine
    np.testing.assert_array_equal(ej.reference(ej.einsum("ij,j->i", a, v), v_empty=np.zeros(0),
                                               **({"Aempty": ej.sparse("Aempty", np.zeros((3, 0)))} if fed else {})),
                                  np.zeros(3))


# ---------------------------------------------------------------- cummax / cummin of nothing (6db6fa6)


class _Scan(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


@pytest.mark.parametrize("shape,dim,dtype", [((0, 3), 0, torch.float32), ((2, 0), 1, torch.int32),
                                             ((2, 0), -1, torch.float64), ((0,), 0, torch.int64)])
def test_cummax_cummin_over_an_empty_dim_give_torchs_empty_results(shape: tuple[int, ...], dim: int,
                                                                    dtype: torch.dtype) -> None:
    # torch scans an empty dim to empty values and int64 indices; the translation refused it with
    # an einsum the user never wrote ("einsum 'ab,ca->cb': max over label(s) 'a' of size 0")
    x = torch.zeros(shape, dtype=dtype)
    fn = _Scan(lambda t: (torch.cummax(t, dim)[0], torch.cummax(t, dim)[1], torch.cummin(t, dim)[0],
                          torch.cummin(t, dim)[1]))  # fx: a proxy cannot be unpacked
    got = ej.compile(ej.from_torch(fn, (x,), method="fx"), quiet=True).run(x)
    for g, w in zip(got, fn(x)):
        g = np.asarray(g)
        assert g.shape == tuple(w.shape) and g.dtype == w.numpy().dtype


# ---------------------------------------------------------------- fmod / trunc division of a bool (6db6fa6)


class _Three(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, b: torch.Tensor, i: torch.Tensor, f: torch.Tensor) -> Any:
        return self.fn(b, i, f)


BOOL_MIXED = {  # a bool operand with a non-bool one: torch promotes it (int8 with int8, int64 with 2)
    "fmod_bool_int8": lambda b, i, f: torch.fmod(b, i),
    "fmod_bool_float": lambda b, i, f: torch.fmod(b, f),
    "fmod_bool_number": lambda b, i, f: torch.fmod(b, 2),
    "fmod_int8_bool": lambda b, i, f: torch.fmod(i, b | True),
    "trunc_bool_int8": lambda b, i, f: torch.div(b, i, rounding_mode="trunc"),
    "trunc_int8_bool": lambda b, i, f: torch.div(i, b | True, rounding_mode="trunc"),
    "trunc_bool_float": lambda b, i, f: torch.div(b, f, rounding_mode="trunc"),
}


@pytest.mark.parametrize("case", sorted(BOOL_MIXED))
def test_fmod_and_trunc_division_of_a_bool_with_a_number_match_torch(case: str) -> None:
    # fmod refused any bool operand ("torch's fmod is not implemented for bool": torch computes
    # fmod(bool, int8) as int8), and trunc division made a bool int64 first, so bool / int8 came
    # out int64 where torch gives int8
    b = torch.tensor([True, False, True, True])
    i = torch.tensor([3, -2, -5, 7], dtype=torch.int8)
    f = torch.tensor([2.5, 1.0, -3.0, 0.5])
    fn = _Three(BOOL_MIXED[case])
    want = fn(b, i, f)
    got = torch.as_tensor(np.asarray(ej.compile(ej.from_torch(fn, (b, i, f), method="fx"), quiet=True).run(b, i, f)))
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def test_fmod_and_trunc_division_of_two_bools_are_refused_as_torch() -> None:
    # torch: "div_trunc_cpu" / "fmod" not implemented for 'Bool'; the translation gave True / True = 1
    b = torch.tensor([True, True])
    for fn in (lambda x, y, z: torch.fmod(x, x), lambda x, y, z: torch.div(x, x, rounding_mode="trunc")):
        with pytest.raises(NotImplementedError):
            fn(b, b, b)
        with pytest.raises(ej.EinjoinError, match="bool"):
            ej.from_torch(_Three(fn), (b, b, b), method="fx")


SHIFTS_BOOL = {  # torch shifts a bool promoted beside a non-bool: int8 with int8, int64 with 1
    "int8_lshift_bool": lambda b, i, f: i << b,
    "bool_lshift_int8": lambda b, i, f: b << (i & 3),
    "bool_lshift_number": lambda b, i, f: b << 1,
    "bool_rshift_number": lambda b, i, f: torch.bitwise_right_shift(b, 1),
    "number_lshift_bool": lambda b, i, f: 1 << b,
}


@pytest.mark.parametrize("case", sorted(SHIFTS_BOOL))
def test_shifts_of_a_bool_with_a_number_match_torch(case: str) -> None:
    # refused with "torch's shifts are not implemented for bool"; torch refuses two bools only
    b = torch.tensor([True, False, True, True])
    i = torch.tensor([3, -2, 5, 7], dtype=torch.int8)
    fn = _Three(SHIFTS_BOOL[case])
    want = fn(b, i, i)
    got = torch.as_tensor(np.asarray(ej.compile(ej.from_torch(fn, (b, i, i), method="fx"), quiet=True).run(b, i, i)))
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    with pytest.raises(NotImplementedError):
        b << b  # noqa: B018
    with pytest.raises(ej.EinjoinError, match="bool"):
        ej.from_torch(_Three(lambda x, y, z: x << z), (b, i, b), method="fx")


# ---------------------------------------------------------------- narrow ints' max on DuckDB (0258c92)


@pytest.mark.parametrize("dt", ["int8", "uint8", "int16", "int32"])
def test_a_narrow_int_max_on_duckdb_is_the_max_of_the_wrapped_products_as_torch(dt: str) -> None:
    # torch's amax of an int8 product takes the products wrapped in int8 (100 * 2 is -56), and so
    # does the memory engine; DuckDB computed them in BIGINT and wrapped the maximum (-56 where the
    # wrapped products' maximum is 50): wrong values wherever a product overflows the dtype
    pytest.importorskip("duckdb")
    info = np.iinfo(dt)
    rng = np.random.default_rng(0)
    scale = {"int32": 30000, "int16": 300}.get(dt, 1)
    a = rng.integers(max(int(info.min), -100), min(int(info.max), 100), (5, 6)) * (rng.random((5, 6)) < 0.6)
    h = rng.integers(max(int(info.min), -100), min(int(info.max), 100), (6, 3))
    a, h = (a * scale).astype(dt), (h * scale).astype(dt)
    want = (torch.from_numpy(a)[:, :, None] * torch.from_numpy(h)[None]).amax(1).numpy()
    assert not np.array_equal(want, (a.astype(np.int64)[:, :, None] * h[None]).max(1).astype(dt))  # overflows
    for engine in ("memory", "duckdb"):
        got = ej.sparse_compile("ij,jk->ik", ej.sparse("Aw", a), h, agg="max", engine=engine).run()
        got = np.asarray(got.todense() if hasattr(got, "todense") else got)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=engine)


# ---------------------------------------------------------------- an uncoalesced sparse argument (51d8a0a)


class _Gcn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(5, 3)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.lin(x))


def test_an_uncoalesced_sparse_argument_with_more_raw_entries_than_the_dense_size_runs() -> None:
    # a torch COO argument with duplicates (torch sums them) storing 200 raw entries in a 12 x 12
    # matrix: the capacity was max(dense size, raw nnz) = 200 and its example tensor could not hold
    # 200 distinct entries: a raw "ValueError: index 144 is out of bounds for array with size 144"
    n, g = 12, torch.Generator().manual_seed(3)
    m, x = _Gcn().eval(), torch.randn(n, 5, generator=g)
    first = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 2]]), torch.ones(2), (n, n)).coalesce()
    prog = ej.compile(ej.from_torch(m, (first, x)), quiet=True)
    adj = torch.sparse_coo_tensor(torch.randint(0, n, (2, 200), generator=g), torch.rand(200, generator=g), (n, n))
    assert not adj.is_coalesced() and adj._nnz() > n * n
    np.testing.assert_allclose(np.asarray(prog.run(adj, x)), m(adj, x).detach().numpy(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- a bfloat16 sparse input (69dd7f9)


@pytest.mark.parametrize("agg", ["sum", "max"])
def test_a_bfloat16_sparse_input_in_a_graph_matches_torch(agg: str) -> None:
    # 69dd7f9 made sparse tensors hold bfloat16, but ej.sparse_input still refused the dtype
    # saying "sparse tensors hold no bfloat16 values" (every feed would be refused): a GCN with a
    # bfloat16 adjacency could not be declared or imported
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    a = (rng.normal(size=(9, 6)) * (rng.random((9, 6)) < 0.5)).astype(ml_dtypes.bfloat16)
    x = rng.normal(size=(6, 4)).astype(ml_dtypes.bfloat16)
    ta, tx = (torch.from_numpy(v.astype(np.float32)).bfloat16() for v in (a, x))
    want = (ta @ tx) if agg == "sum" else (ta[:, :, None] * tx[None]).amax(1)
    y = ej.einsum("ij,jk->ik", ej.sparse_input("Abf", (9, 6), nnz=40, dtype="bfloat16"),
                  ej.input("xbf", (6, 4), "bfloat16"), agg=agg)
    for devices in (1, 2):
        got = np.asarray(ej.compile(y, devices=devices, quiet=True).run(Abf=ej.sparse("Abf", a), xbf=x))
        assert got.dtype == x.dtype
        np.testing.assert_array_equal(got.astype(np.float32), want.float().numpy())
