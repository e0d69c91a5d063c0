"""Session 40: gradients of imported torch modules against torch's autograd at the points where
derivatives are unusual (a norm of a zero vector, a floor division, ...). Each case is a module
whose parameters are the tensors; its loss is ``(f(*params) * c).sum()``, ``c`` a fixed cotangent."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
import pytest

import einjoin as ej

torch = pytest.importorskip("torch")
nn = torch.nn


class _Loss(nn.Module):
    def __init__(self, f: Callable[..., Any], vals: list[Any]) -> None:
        super().__init__()
        self.f = f
        self.ps = nn.ParameterList([nn.Parameter(v.clone()) for v in vals])

    def forward(self, c: Any) -> Any:
        return (self.f(*self.ps) * c).sum()


def _grads(f: Callable[..., Any], *vals: Any, backend: str = "sync") -> tuple[list[Any], list[Any]]:
    """(einjoin's gradients, torch's) of ``(f(*vals) * c).sum()`` w.r.t. each of ``vals``."""
    with torch.no_grad():
        out = f(*vals)
    c = torch.linspace(-1, 2, out.numel(), dtype=torch.float64).reshape(out.shape).to(out.dtype)
    m = _Loss(f, list(vals))
    got = _ej_grads(m, c, backend)
    m(c).backward()
    want = [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.ps]
    return got, want


def _ej_grads(m: Any, c: Any, backend: str = "sync") -> list[Any]:
    fn = ej.from_torch(m, (c,))
    grads = ej.grad(fn.outputs[0], list(fn.parameters.values()))
    got = ej.compile(fn.with_outputs(list(grads)), quiet=True, backend=backend).run(c)
    return [torch.as_tensor(np.asarray(g)) for g in got]


def _check(f: Callable[..., Any], *vals: Any, backend: str = "sync") -> None:
    got, want = _grads(f, *vals, backend=backend)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, equal_nan=True)


def _f64(*xs: float) -> Any:
    return torch.tensor(xs, dtype=torch.float64)


@pytest.mark.parametrize("f", [
    lambda a: a[0].norm(),
    lambda a: torch.linalg.vector_norm(a, dim=1),
    lambda a: torch.linalg.vector_norm(a, ord=3, dim=1),
    lambda a: torch.std(a, dim=1),
    lambda a: torch.nn.functional.normalize(a, dim=1),
], ids=["norm", "norm_dim", "norm3", "std", "normalize"])
def test_norms_of_zero_vectors_have_torchs_zero_gradient(f: Callable[..., Any]) -> None:
    # torch masks the norm's (and std's) backward where the result is 0; the square root's own
    # derivative there is inf, and inf * 0 gave NaN gradients (a zero row in F.normalize: NaN)
    _check(f, _f64(0.0, 0.0, 0.0, 1.0, -2.0, 2.0).reshape(2, 3))


def test_the_gradient_through_floor_division_is_torchs() -> None:
    # torch: div(rounding_mode="floor") has a zero gradient (it was refused here as "floordiv has
    # no derivative"); floor_divide (//) has no derivative in torch and stays refused
    a, b = _f64(3.5, -2.5, 7.0), _f64(2.0, 2.0, -3.0)
    _check(lambda x, y: torch.div(x, y, rounding_mode="floor") * 5 + x * y, a, b)
    with pytest.raises(ej.ExpressionError, match="floordiv has no derivative"):
        _ej_grads(_Loss(lambda x, y: torch.floor_divide(x, y) * 5 + x * y, [a, b]), a)


def test_hypot_gradient_at_zero_is_torchs_nan() -> None:
    # torch: grad * a / hypot(a, b), 0 / 0 at (0, 0); the overflow-safe form gave 0 there
    _check(torch.hypot, _f64(0.0, 3.0, -0.0), _f64(0.0, 4.0, 0.0))


@pytest.mark.parametrize("f", [
    lambda a, b: torch.clamp_min(a, b), lambda a, b: torch.clamp_max(a, b),
    lambda a, b: torch.clamp_min(a, 0.5) * b, lambda a, b: a.clamp_max(0.5) * b,
], ids=["min_t", "max_t", "min", "max"])
def test_clamp_min_max_at_the_bound_give_x_the_gradient(f: Callable[..., Any]) -> None:
    # torch's clamp_min / clamp_max pass the whole gradient to x where x equals the bound; they were
    # maximum / minimum, whose tie rule gives each half
    _check(f, _f64(0.5, 0.5, 2.0, float("nan"), -0.0), _f64(0.5, 1.0, 1.0, 1.0, 0.0))


@pytest.mark.parametrize("f", [torch.fmax, torch.fmin], ids=["fmax", "fmin"])
def test_fmax_fmin_ties_give_the_first_argument_the_gradient(f: Callable[..., Any]) -> None:
    # torch: self's gradient where self >= other (fmin: <=) or other is NaN, other's elsewhere;
    # the join used max / min, whose tie rule split the gradient in halves
    nan = float("nan")
    _check(f, _f64(nan, 1.0, 2.0, nan, -0.0, 3.0), _f64(1.0, nan, 2.0, nan, 0.0, -1.0))


def test_native_norm_statistics_carry_torchs_gradients() -> None:
    # native_layer_norm's mean and rstd carry no gradient in torch (output_differentiability);
    # native_group_norm's do. (Both were None before session 40: refused.)
    def f(x: Any) -> Any:
        out, mean, rstd = torch.native_layer_norm(x, (4,), None, None, 1e-5)
        g, gm, gr = torch.native_group_norm(x, None, None, 2, 3, 4, 3, 1e-5)
        return out * 2 + mean + rstd + g * 3 + (gm * gr).unsqueeze(-1)
    _check(f, torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
