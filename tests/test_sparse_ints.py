"""Narrow-integer sparse values keep their dtype (issue 24): a sparse einsum of int8 / uint8 /
int16 / int32 tensors gives torch's dtype and values (products wrap in the dtype as torch's do),
on the memory and DuckDB engines."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej

torch = pytest.importorskip("torch")

ENGINES = ["memory", pytest.param("duckdb", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("duckdb"), reason="duckdb not installed"))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_narrow_ints_keep_torchs_dtype_and_wrap(dtype: object, engine: str) -> None:
    g = torch.Generator().manual_seed(0)
    low = 0 if dtype == torch.uint8 else -100
    a = torch.randint(low, 100, (20, 30), generator=g).to(dtype) * (torch.rand(20, 30, generator=g) < 0.3)
    h = torch.randint(0, 50, (30, 4), generator=g).to(dtype)
    st = ej.sparse("A", a.to_sparse())
    assert str(st.dtype) == str(dtype).removeprefix("torch.")
    got = ej.sparse_compile("ij,jk->ik", st, h, engine=engine).run().todense()
    want = (a @ h).numpy()
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_mixed_narrow_ints_promote_as_torch() -> None:
    a = torch.tensor([[0, 3], [200, 0]], dtype=torch.uint8)
    b = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    got = ej.sparse_compile("ij,ij->ij", ej.sparse("A", a.to_sparse()), b).run().todense()
    want = (a * b).numpy()  # uint8 with int8: int16
    assert got.dtype == want.dtype == np.int16
    np.testing.assert_array_equal(got, want)
