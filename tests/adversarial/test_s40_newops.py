"""Session 40 (H12): the transcendental ops the op_db sweep found refused (atan2, xlogy, logaddexp,
logaddexp2, logit, sinh, cosh, asin, acos, atan, asinh, acosh, atanh, copysign), imported with
``ej.from_torch`` on a tiny module, against torch: values and dtypes (float32, float64, bfloat16,
int64 where torch takes it; special values, signed zeros included) and gradients against
``torch.autograd`` (edge points: xlogy at x = 0, logit at 0 / 1 and with eps, copysign at 0,
atan2 at the origin)."""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest

import einjoin as ej
from tests.adversarial.test_s40_grads import _Loss  # (f(*params) * c).sum() as a module

torch = pytest.importorskip("torch")
nn = torch.nn

UNARY = ["sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "logit"]
BINARY = ["atan2", "copysign", "xlogy", "logaddexp", "logaddexp2"]
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 1e-8, 30.0, math.inf, -math.inf, math.nan]


class _Call(nn.Module):
    def __init__(self, f: Callable[..., Any]) -> None:
        super().__init__()
        self.f = f

    def forward(self, *xs: Any) -> Any:
        return self.f(*xs)


def _run(f: Callable[..., Any], *xs: Any) -> Any:
    got = ej.compile(ej.from_torch(_Call(f), xs), quiet=True).run(*xs)
    got = got[0] if isinstance(got, (list, tuple)) else got
    return got if isinstance(got, torch.Tensor) else torch.as_tensor(np.asarray(got))


def _close(got: Any, want: Any, dtype: Any) -> None:
    # numpy's and torch's transcendental kernels may differ in the last bit
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    tol = {torch.float64: 1e-12, torch.float32: 2e-6}.get(want.dtype, 1e-2)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    num = ~torch.isnan(want) & (want == 0)  # a zero's sign as torch's
    assert torch.equal(torch.signbit(got[num]), torch.signbit(want[num]))


def _values(dtype: Any) -> Any:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.int64:
        return torch.randint(-3, 4, (40,), generator=g)
    x = torch.cat([torch.randn(60, generator=g, dtype=torch.float64) * 2,
                   torch.rand(20, generator=g, dtype=torch.float64),
                   torch.tensor(SPECIAL, dtype=torch.float64)])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("name", UNARY)
def test_unary_values_and_dtypes_match_torch(name: str, dtype: Any) -> None:
    f = getattr(torch, name)
    x = _values(dtype)
    _close(_run(f, x), f(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("name", BINARY)
def test_binary_values_and_dtypes_match_torch(name: str, dtype: Any) -> None:
    f = getattr(torch, name)
    x = _values(dtype)
    # every pair of special values, and random pairs
    a = torch.cat([x, x[-len(SPECIAL):].repeat_interleave(len(SPECIAL))]) if dtype.is_floating_point else x
    b = torch.cat([x.flip(0), x[-len(SPECIAL):].repeat(len(SPECIAL))]) if dtype.is_floating_point else x.flip(0)
    try:
        want = f(a, b)
    except RuntimeError:  # torch refuses it (logaddexp of int64): not asked of einjoin
        return
    _close(_run(f, a, b), want, dtype)


def test_the_named_special_values() -> None:
    z, n, inf = 0.0, math.nan, math.inf
    a = torch.tensor([z, z, -z, 1.0])
    b = torch.tensor([z, n, 2.0, z])
    _close(_run(torch.xlogy, a, b), torch.tensor([0.0, n, 0.0, -inf]), torch.float32)
    a = torch.tensor([-inf, inf, -inf, inf, 1.0, -inf])
    b = torch.tensor([-inf, inf, inf, -inf, -inf, 2.0])
    _close(_run(torch.logaddexp, a, b), torch.tensor([-inf, inf, inf, inf, 1.0, 2.0]), torch.float32)
    _close(_run(torch.logaddexp2, a, b), torch.logaddexp2(a, b), torch.float32)
    a = torch.tensor([z, -z, z, -z, 1.0, -1.0])
    b = torch.tensor([z, z, -z, -z, -z, z])
    _close(_run(torch.atan2, a, b), torch.atan2(a, b), torch.float32)
    assert torch.equal(torch.signbit(_run(torch.copysign, b, a)), torch.signbit(a))
    x = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, -0.5, 1.5, n])
    for eps in (None, 0.0, 0.2):
        _close(_run(lambda t, e=eps: torch.logit(t, e), x), torch.logit(x, eps), torch.float32)


def _check_grads(f: Callable[..., Any], *vals: Any) -> None:
    with torch.no_grad():
        out = f(*vals)
    c = torch.linspace(-1, 2, out.numel(), dtype=torch.float64).reshape(out.shape).to(out.dtype)
    m = _Loss(f, list(vals))
    fn = ej.from_torch(m, (c,))
    grads = ej.grad(fn.outputs[0], list(fn.parameters.values()))
    got = ej.compile(fn.with_outputs(list(grads)), quiet=True).run(c)
    m(c).backward()
    for g, p in zip(got, m.ps):
        w = p.grad if p.grad is not None else torch.zeros_like(p)
        g = torch.as_tensor(np.asarray(g))
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, equal_nan=True)


def _f64(*xs: float) -> Any:
    return torch.tensor(xs, dtype=torch.float64)


@pytest.mark.parametrize("name", UNARY)
def test_unary_gradients_match_autograd(name: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(20, generator=g, dtype=torch.float64) * 2,
                   torch.rand(20, generator=g, dtype=torch.float64), _f64(0.0, 1.0, -1.0, 0.5)])
    _check_grads(getattr(torch, name), x)


@pytest.mark.parametrize("name", BINARY)
def test_binary_gradients_match_autograd(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    a = torch.cat([torch.randn(20, generator=g, dtype=torch.float64), _f64(0.0, 0.0, 0.0, -0.0, 2.0, 1.0)])
    b = torch.cat([torch.randn(20, generator=g, dtype=torch.float64).abs(), _f64(0.0, 1.0, -2.0, 0.0, 0.0, 0.0)])
    _check_grads(getattr(torch, name), a, b)


def test_gradients_at_the_edge_points() -> None:
    z, n, inf = 0.0, math.nan, math.inf
    # xlogy at x = 0: d/dx is log y for y > 0, 0 for y <= 0, NaN where y is NaN; d/dy is x / y
    _check_grads(torch.xlogy, _f64(z, z, z, -z, 1.0, 2.0, n, z, 1.0),
                 _f64(z, 3.0, n, -1.0, z, -1.0, 3.0, inf, 2.0))
    _check_grads(lambda x: torch.xlogy(x, 0.0), _f64(z, 1.0, -2.0))
    _check_grads(lambda y: torch.xlogy(2.0, y), _f64(z, 1.0, 3.0))
    # logit at 0 and 1 (inf), outside [0, 1] (NaN), and with eps (0 outside the bounds, kept at them)
    x = _f64(0.0, 1.0, 0.5, -0.5, 1.5, 0.2, 0.8, 0.1, 0.95)
    _check_grads(torch.logit, x)
    _check_grads(lambda t: torch.logit(t, 0.2), x)
    # copysign at 0 and of signed zeros; atan2 at the origin; logaddexp with infinities
    _check_grads(torch.copysign, _f64(z, -z, 2.0, -2.0), _f64(-1.0, 1.0, -z, z))
    _check_grads(torch.atan2, _f64(z, z, 1.0, 1e-200, 1e-160, -z), _f64(z, -1.0, z, z, z, -z))
    _check_grads(torch.logaddexp, _f64(-inf, 1.0, inf), _f64(1.0, -inf, 2.0))
    _check_grads(torch.logaddexp2, _f64(-inf, 1.0, 3.0), _f64(1.0, -inf, 3.0))
    _check_grads(torch.atanh, _f64(0.5, -0.99, z))
    _check_grads(torch.acosh, _f64(1.5, 3.0, 1.0))


def test_float32_gradients_and_the_arc_spellings() -> None:
    g = torch.Generator().manual_seed(4)
    a, b = torch.rand(12, generator=g) * 0.9 + 0.05, torch.rand(12, generator=g) + 0.5
    for f in (torch.arcsin, torch.arccos, torch.arctan, torch.arcsinh, torch.arctanh, torch.special.logit):
        _close(_run(f, a), f(a), torch.float32)
    for f2 in (torch.arctan2, torch.special.xlogy):
        _close(_run(f2, a, b), f2(a, b), torch.float32)
    _close(_run(lambda t: t.clone().sinh_(), a), torch.sinh(a), torch.float32)


# ---------------------------------------------------------------- compositions: trace, diag, var_mean, dist


def _run_all(f: Callable[..., Any], *xs: Any) -> list[Any]:
    got = ej.compile(ej.from_torch(_Call(f), xs), quiet=True).run(*xs)
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    return [g if isinstance(g, torch.Tensor) else torch.as_tensor(np.asarray(g)) for g in got]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool])
def test_trace_and_diag_match_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(5)
    m = (torch.randn(4, 6, generator=g) * 3).to(dtype)
    m[0, 0] = math.inf if dtype.is_floating_point else m[0, 0]  # off-diagonal zeros stay 0, not NaN
    v = m[1]

    def f(m: Any, v: Any) -> Any:
        traces = () if dtype == torch.bool else (torch.trace(m), torch.trace(m.T))  # torch: no bool trace
        return (*traces, torch.diag(m), torch.diag(m, 2), torch.diag(m, -3),
                torch.diag(m, 7), torch.diag(v), torch.diag(v, 2), torch.diag(v, -1))
    for got, want in zip(_run_all(f, m, v), f(m, v)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_var_mean_std_mean_dist_match_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(3, 5, generator=g).to(dtype) + 100, torch.randn(3, 5, generator=g).to(dtype)

    def f(a: Any, b: Any) -> Any:
        return (*torch.var_mean(a, 1), *torch.var_mean(a, 0, keepdim=True, correction=0), *torch.var_mean(a),
                *torch.std_mean(a, 1, unbiased=False), torch.dist(a, b), torch.dist(a, b, 1),
                torch.dist(a, b, math.inf), torch.dist(a, b, 0.5))
    for got, want in zip(_run_all(f, a, b), f(a, b)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_composition_gradients_match_autograd() -> None:
    g = torch.Generator().manual_seed(7)
    m = torch.randn(4, 5, generator=g, dtype=torch.float64)
    _check_grads(lambda m: torch.trace(m).reshape(1), m)
    _check_grads(lambda m: torch.diag(m, 1), m)
    _check_grads(lambda v: torch.diag(v, -2), m[0].clone())
    _check_grads(lambda m: torch.stack(torch.var_mean(m, 1)), m)
    _check_grads(lambda m: torch.stack(torch.std_mean(m, 0)), m)
    # dist at a == b: the norm's gradient at 0 is 0, as torch's
    _check_grads(lambda a, b: torch.dist(a, b).reshape(1), m, m.clone())
    _check_grads(lambda a, b: torch.dist(a, b, 3).reshape(1), m, m.flip(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cosine_similarity_matches_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(3, 4, generator=g).to(dtype), torch.randn(4, generator=g).to(dtype)
    a[0] = 0  # a zero row: the norm clamped at eps

    def f(a: Any, b: Any) -> Any:
        import torch.nn.functional as F
        return (F.cosine_similarity(a, b, dim=-1), F.cosine_similarity(a, a * 2, dim=0, eps=0.5),
                F.cosine_similarity(a, torch.ones(3, 4, dtype=torch.int64)))
    for got, want in zip(_run_all(f, a, b), f(a, b)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_cosine_similarity_gradients_flow_through_the_clamped_norm() -> None:
    # torch clamps the norms in place under no_grad: below eps the value is eps, the gradient the
    # norm's (a zero row gets 0 from the norm's backward at 0)
    import torch.nn.functional as F
    a = torch.tensor([[0.0, 0, 0], [1e-4, 0, 0], [1, 2, 3], [-1, 0.5, 2]], dtype=torch.float64)
    b = torch.tensor([[1.0, 2, 3]], dtype=torch.float64)
    _check_grads(lambda a, b: F.cosine_similarity(a, b, dim=-1, eps=1e-3), a, b)
    _check_grads(lambda a, b: F.cosine_similarity(a, b, dim=0), a, a.flip(1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_gcd_matches_torch(dtype: Any) -> None:
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(9)
    edge = torch.tensor([info.min, info.max, 0, 1, -1 if info.min else 3, 12, 7], dtype=torch.int64).to(dtype)
    a = torch.cat([torch.randint(info.min, info.max, (60,), generator=g, dtype=torch.int64).to(dtype),
                   edge.repeat_interleave(len(edge))])
    b = torch.cat([torch.randint(info.min, info.max, (60,), generator=g, dtype=torch.int64).to(dtype),
                   edge.repeat(len(edge))])
    got, want = _run(torch.gcd, a, b), torch.gcd(a, b)  # |int min| wraps as in torch's kernel
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_gcd_of_floats_is_refused_as_by_torch() -> None:
    x = torch.ones(3)
    with pytest.raises(RuntimeError):
        torch.gcd(x, x)
    with pytest.raises(ej.EinjoinError, match="gcd"):
        _run(torch.gcd, x, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matrix_norm_matches_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(10)
    a = torch.randn(2, 3, 4, generator=g).to(dtype)
    mn = torch.linalg.matrix_norm

    def f(a: Any) -> Any:
        return (mn(a), mn(a, 1), mn(a, -1), mn(a, math.inf), mn(a, -math.inf, keepdim=True),
                mn(a, 1, dim=(0, 2)), mn(a, math.inf, dim=(2, 0), keepdim=True), mn(a, "fro", dim=(1, 0)))
    for got, want in zip(_run_all(f, a), f(a)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)
    with pytest.raises(ej.EinjoinError, match="nuc"):
        _run_all(lambda a: mn(a, "nuc"), a.float())  # singular values: refused


def test_matrix_norm_gradients_match_autograd() -> None:
    g = torch.Generator().manual_seed(11)
    a = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    for o in ("fro", 1, -1, math.inf, -math.inf):
        _check_grads(lambda a, o=o: torch.linalg.matrix_norm(a, o), a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cdist_matches_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(2, 30, 3, generator=g).to(dtype), torch.randn(1, 4, 3, generator=g).to(dtype)
    b[0, 0] = a[0, 0]  # a zero distance

    def f(a: Any, b: Any, mode: str = "use_mm_for_euclid_dist_if_necessary") -> Any:
        return (torch.cdist(a, b, compute_mode=mode), torch.cdist(a, b, 1), torch.cdist(a[0], b[0], math.inf),
                torch.cdist(a, b, 0.5), torch.cdist(a[:, :5], b, 3))
    # P = 30 > 25: torch's default p = 2 goes through a matrix product, whose rounding reads a zero
    # distance as ~2e-4 in float32; einjoin computes the differences: compared with torch's own
    want_all = f(a, b, "donot_use_mm_for_euclid_dist")
    torch.testing.assert_close(f(a, b)[0], want_all[0], atol=1e-3, rtol=1e-4)
    for got, want in zip(_run_all(f, a, b), want_all):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_cdist_gradients_match_autograd() -> None:
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    b[1] = a[2]  # a zero distance: torch's backward gives 0 there
    for p in (2.0, 1.0, 3.0, math.inf):
        _check_grads(lambda a, b, p=p: torch.cdist(a, b, p), a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_median_matches_torch(dtype: Any) -> None:
    g = torch.Generator().manual_seed(14)
    for x in (torch.randint(-3, 4, (3, 4), generator=g).to(dtype), torch.randn(7, generator=g).to(dtype)):
        nan = torch.tensor([math.nan]).to(dtype) if dtype.is_floating_point else None
        for v in ([x] if nan is None else [x, torch.cat([x.flatten(), nan])]):
            got, want = _run(torch.median, v), torch.median(v)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # over a dim: the values and torch's index among ties (a stable sort's), the first NaN's index
    n = math.nan
    for v in (torch.randint(0, 3, (40, 7), generator=g).to(dtype), torch.randint(0, 3, (6, 4), generator=g).to(dtype)):
        for dim, keep in ((1, False), (0, True), (-1, True)):
            got = _run_all(lambda t, d=dim, k=keep: tuple(torch.median(t, d, keepdim=k)), v)
            want = torch.median(v, dim, keepdim=keep)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and torch.equal(a, b)
    if dtype.is_floating_point:
        v = torch.tensor([[1.0, n, 2.0, n, 0.0], [3, 1, 2, 2, 2]]).to(dtype)
        got = _run_all(lambda t: tuple(torch.median(t, 1)), v)
        want = torch.median(v, 1)
        torch.testing.assert_close(got[0], want.values, equal_nan=True)
        assert torch.equal(got[1], want.indices)


def test_median_gradient_is_shared_by_the_tied_elements() -> None:
    # torch's evenly_distribute_backward: the elements equal to the median (the NaNs when it is NaN)
    _check_grads(lambda x: torch.median(x).reshape(1), _f64(3.0, 2.0, 1.0, 2.0, 5.0, 2.0, 0.0))
    _check_grads(lambda x: torch.median(x).reshape(1), _f64(3.0, math.nan, 1.0, math.nan))
    _check_grads(lambda x: torch.median(x).reshape(1), torch.randn(3, 4, dtype=torch.float64))
    # over a dim: the gradient goes to the returned index only
    _check_grads(lambda x: torch.median(x, 1).values, _f64(2.0, 1.0, 2.0, 2.0, 0.0, 2.0, 1.0, 1.0).reshape(2, 4))
