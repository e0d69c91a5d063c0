"""float16 / bfloat16 sparse einsums (issue 24): accepted on the memory and DuckDB engines with
torch's numerics (products accumulated in float32, rounded once; the result dtype torch gives for
the same dense op), compared with torch on the densified data."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej
from einjoin.sparse.plan import result_dtype

torch = pytest.importorskip("torch")

HALVES = [torch.float16, torch.bfloat16]
ENGINES = ["memory", pytest.param("duckdb", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("duckdb"), reason="duckdb not installed"))]
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _sparse(shape: tuple[int, ...], density: float, dtype: object, seed: int) -> object:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < density)
    return dense.to(dtype).to_sparse()


def _np(x: object) -> np.ndarray:
    d = x.todense() if hasattr(x, "todense") else x
    return np.asarray(np.asarray(d).astype(np.float32))


def _close(got: object, want: object, dtype: object) -> None:
    out = got.todense() if hasattr(got, "todense") else got
    assert str(np.asarray(out).dtype) == str(want.dtype).removeprefix("torch."), (np.asarray(out).dtype, want.dtype)
    # one rounding of a float32 sum: within an ulp of torch's (its sum order differs)
    w = want.float().numpy()
    np.testing.assert_allclose(_np(got), w, rtol=ULP[dtype], atol=ULP[dtype] * float(np.abs(w).max()) * 1e-2)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", HALVES)
def test_sparse_times_dense_accumulates_in_float32(dtype: object, engine: str) -> None:
    # a 600-long sum: accumulated in the half itself it would be off by far more than an ulp
    a = _sparse((40, 600), 0.5, dtype, 0)
    h = (torch.rand(600, 8, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    got = ej.sparse_compile("ij,jk->ik", ej.sparse("A", a), h, engine=engine).run()
    _close(got, a.to_dense() @ h, dtype)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", HALVES)
def test_max_and_three_operands_equal_torch(dtype: object, engine: str) -> None:
    a = _sparse((12, 9), 0.3, dtype, 2)
    h = torch.randn(9, 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    w = torch.randn(5, 4, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = ej.sparse_compile("ij,jk->ik", ej.sparse("A", a), h, agg="max", engine=engine).run()
    _close(got, (a.to_dense()[:, :, None] * h[None]).amax(1), dtype)
    three = ej.sparse_compile("ij,jk,kl->il", ej.sparse("A", a), h, w, engine=engine).run()
    want = (a.to_dense().float() @ h.float() @ w.float()).to(dtype)  # torch's per op rounding differs
    np.testing.assert_allclose(_np(three), want.float().numpy(), rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    assert str(_np_dtype(three)) == str(dtype).removeprefix("torch.")


def _np_dtype(x: object) -> object:
    return np.asarray(x.todense() if hasattr(x, "todense") else x).dtype


@pytest.mark.parametrize("engine", ENGINES)
def test_mixed_halves_promote_as_torch(engine: str) -> None:
    a = _sparse((7, 6), 0.4, torch.float16, 5)
    b = torch.randn(7, 6, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    got = ej.sparse_compile("ij,ij->ij", ej.sparse("A", a), b, engine=engine).run()
    want = a.to_dense() * b  # float16 * bfloat16 -> float32
    assert want.dtype == torch.float32
    np.testing.assert_allclose(_np(got), want.numpy(), rtol=1e-6)
    assert _np_dtype(got) == np.float32


@pytest.mark.parametrize("pair", [(torch.int64, torch.float16), (torch.int64, torch.bfloat16),
                                  (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float64),
                                  (torch.float16, torch.float32), (torch.bool, torch.bfloat16)])
def test_result_dtype_is_torchs(pair: tuple) -> None:
    from einjoin.ir.dtypes import numpy_dtype
    nps = [numpy_dtype(str(t).removeprefix("torch.")) for t in pair]
    assert str(result_dtype(nps)) == str(torch.promote_types(*pair)).removeprefix("torch.")
