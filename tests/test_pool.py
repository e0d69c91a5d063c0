"""Pooling (the Pool node kind, and adaptive pools / unfold built on it and on Conv) against
torch: random windows, strides, padding, dilation, ceil_mode, count_include_pad and
divisor_override, 1-3 spatial dims, blocked under random specs (spatial splits read a halo)
and on 2 devices; gradients against torch autograd; from_torch of the nn modules and a small
conv + max-pool net on 1 and 2 devices."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.decomp.spec import label_sizes
from einjoin.frontend.conv import max_pool_with_indices
from einjoin.ir import ops
from graphgen import oracle

F = torch.nn.functional
FAST = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def pool_cases(draw: Any) -> dict[str, Any]:
    nd = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    spatial = tuple(draw(st.integers(max(4, d * (k - 1) + 1), 9 if nd < 3 else 6))
                    for k, d in zip(kernel, dilation))
    return dict(nd=nd, kernel=kernel, stride=stride, padding=padding, dilation=dilation, spatial=spatial,
                ceil=draw(st.booleans()), include=draw(st.booleans()),
                divisor=draw(st.sampled_from([None, None, 3])), seed=draw(st.integers(0, 2**16)))


def _pool_nodes(y: ej.Tensor) -> list[ej.Node]:
    return [n for n in ej.Graph(y).nodes if n.kind in ("pool", "conv")]


def _random_specs(y: ej.Tensor, rng: np.random.Generator) -> dict[ej.Node, dict[str, int]]:
    return {n: {lab: int(rng.integers(1, min(3, s) + 1)) for lab, s in label_sizes(n).items() if s}
            for n in _pool_nodes(y)}


def _check(y: ej.Tensor, want: np.ndarray, feeds: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    np.testing.assert_allclose(ej.reference(y, **feeds), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ej.execute_blocked(y, _random_specs(y, rng), **feeds), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ej.compile(y, devices=2, quiet=True).run(**feeds), want, rtol=1e-10, atol=1e-12)


@given(pool_cases())
@FAST
def test_max_pool_equals_torch(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.standard_normal((2, 3) + c["spatial"])
    x = ej.input("x", X.shape, "float64")
    y = ej.max_pool(x, c["kernel"], c["stride"], c["padding"], c["dilation"], c["ceil"])
    fn = getattr(F, f"max_pool{c['nd']}d")
    _check(y, fn(torch.tensor(X), c["kernel"], c["stride"], c["padding"], c["dilation"], c["ceil"]).numpy(),
           dict(x=X), rng)


@given(pool_cases())
@FAST
def test_avg_pool_equals_torch(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.standard_normal((2, 3) + c["spatial"])
    x = ej.input("x", X.shape, "float64")
    divisor = c["divisor"] if c["nd"] > 1 else None  # avg_pool1d has no divisor_override
    y = ej.avg_pool(x, c["kernel"], c["stride"], c["padding"], c["ceil"], c["include"], divisor)
    args: tuple[Any, ...] = (c["kernel"], c["stride"], c["padding"], c["ceil"], c["include"])
    fn = getattr(F, f"avg_pool{c['nd']}d")
    want = fn(torch.tensor(X), *args, divisor) if c["nd"] > 1 else fn(torch.tensor(X), *args)
    _check(y, want.numpy(), dict(x=X), rng)


@given(st.integers(1, 3), st.integers(0, 2**16))
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_adaptive_pools_equal_torch(nd: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    spatial = tuple(int(rng.integers(3, 10 if nd < 3 else 7)) for _ in range(nd))
    out = tuple(int(rng.integers(1, n + 1)) for n in spatial)
    X = rng.standard_normal((2, 3) + spatial)
    x = ej.input("x", X.shape, "float64")
    for mine, theirs in ((ej.adaptive_avg_pool, f"adaptive_avg_pool{nd}d"),
                         (ej.adaptive_max_pool, f"adaptive_max_pool{nd}d")):
        _check(mine(x, out), getattr(F, theirs)(torch.tensor(X), out).numpy(), dict(x=X), rng)


@given(st.integers(0, 2**16))
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_unfold_equals_torch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    dil, pad, st_ = (int(rng.integers(1, 3)),) * 2, (int(rng.integers(0, 2)),) * 2, (int(rng.integers(1, 3)),) * 2
    X = rng.standard_normal((2, 3, 9, 8))
    x = ej.input("x", X.shape, "float64")
    _check(ej.unfold(x, k, dil, pad, st_), F.unfold(torch.tensor(X), k, dil, pad, st_).numpy(), dict(x=X), rng)


@given(pool_cases())
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_pool_gradients_equal_torch_autograd(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.standard_normal((2, 3) + c["spatial"])
    x = ej.input("x", X.shape, "float64")
    nd = c["nd"]
    cases = [(ej.max_pool(x, c["kernel"], c["stride"], c["padding"], c["dilation"], c["ceil"]),
              lambda t: getattr(F, f"max_pool{nd}d")(t, c["kernel"], c["stride"], c["padding"], c["dilation"],
                                                      c["ceil"])),
             (ej.avg_pool(x, c["kernel"], c["stride"], c["padding"], c["ceil"], c["include"]),
              lambda t: getattr(F, f"avg_pool{nd}d")(t, c["kernel"], c["stride"], c["padding"], c["ceil"],
                                                      c["include"])),
             (ej.adaptive_avg_pool(x, 2), lambda t: getattr(F, f"adaptive_avg_pool{nd}d")(t, 2)),
             (ej.adaptive_max_pool(x, 3), lambda t: getattr(F, f"adaptive_max_pool{nd}d")(t, 3))]
    if nd == 2:  # the windows' adjoint (col2im)
        cases.append((ej.unfold(x, c["kernel"], c["dilation"], c["padding"], c["stride"]),
                      lambda t: F.unfold(t, c["kernel"], c["dilation"], c["padding"], c["stride"])))
    for y, fn in cases:
        G = rng.standard_normal(y.shape)
        g = ej.input("g", y.shape, "float64")
        (dx,) = ej.grad((y * g).sum(), [x])
        tx = torch.tensor(X, requires_grad=True)
        (fn(tx) * torch.tensor(G)).sum().backward()
        assert tx.grad is not None
        feeds = {k: v for k, v in dict(x=X, g=G).items() if k in ej.Graph(dx).input_by_name}
        got = ej.compile(dx, devices=2, quiet=True).run(**feeds)  # a sum pool's reads g only
        np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-9, atol=1e-10)


def test_pool_kind_equals_the_index_arithmetic_oracle() -> None:
    rng = np.random.default_rng(3)
    X = rng.standard_normal((2, 3, 9, 7))
    x = ej.input("x", X.shape, "float64")
    for agg in ("max", "sum"):
        y = ej.Tensor(ops.pool_node(x.node, agg, (3, 2), (2, 1), ((1, 2), (-1, 1)), (1, 2)))
        (want,) = oracle([y], dict(x=X))
        np.testing.assert_allclose(ej.execute_blocked(y, {y.node: {"p": 3, "q": 2}}, x=X), want, rtol=1e-12)


class _ConvPoolNet(torch.nn.Module):
    """LeNet-like: conv, max-pool, conv, avg-pool, adaptive pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 6, 5, padding=2)
        self.p1 = torch.nn.MaxPool2d(2)
        self.c2 = torch.nn.Conv2d(6, 8, 3, stride=1, groups=2)
        self.p2 = torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False)
        self.ap = torch.nn.AdaptiveAvgPool2d((2, 2))
        self.fc = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.p1(torch.relu(self.c1(x)))
        x = self.ap(self.p2(torch.relu(self.c2(x))))
        return self.fc(torch.flatten(x, 1))


@pytest.mark.parametrize("devices", [1, 2])
def test_from_torch_conv_max_pool_net(devices: int) -> None:
    torch.manual_seed(0)
    m = _ConvPoolNet().eval()
    x = torch.randn(2, 3, 20, 20)
    got = ej.compile(ej.from_torch(m, (x,)), devices=devices, quiet=True).run(x)
    torch.testing.assert_close(got, m(x).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_from_torch_pool_functions(devices: int) -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = F.max_pool1d(x.flatten(2), 3, 2, 1, ceil_mode=True)
            b = F.adaptive_max_pool2d(x, (3, 2)).flatten(2)
            c = F.unfold(x, 2, stride=2).sum(-1, keepdim=True)
            d = F.avg_pool3d(x.unsqueeze(1), 2, divisor_override=3).flatten(2)
            return torch.cat([a.sum(-1), b.sum(-1), c.flatten(1).reshape(2, 3, -1).sum(-1), d.sum(-1)], 1)

    x = torch.randn(2, 3, 6, 5)
    m = M()
    got = ej.compile(ej.from_torch(m, (x,)), devices=devices, quiet=True).run(x)
    torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)


@given(pool_cases())
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_max_pool_indices_equal_torch(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.standard_normal((2, 3) + c["spatial"])
    x = ej.input("x", X.shape, "float64")
    v, i = max_pool_with_indices(x, c["kernel"], c["stride"], c["padding"], c["dilation"], c["ceil"])
    tv, ti = getattr(F, f"max_pool{c['nd']}d")(torch.tensor(X), c["kernel"], c["stride"], c["padding"],
                                                c["dilation"], c["ceil"], return_indices=True)
    got = ej.execute_blocked([v, i], _random_specs(v, rng) | _random_specs(i, rng), x=X)
    np.testing.assert_array_equal(got[0], tv.numpy())
    np.testing.assert_array_equal(got[1], ti.numpy())


def test_windows_are_copied_exactly_inf_and_nan_included() -> None:
    """unfold, max-pool indices: the windows are copies (a pool with agg none), so an inf or
    NaN stays where it is (a conv by an identity kernel would spread 0 * inf = NaN)."""
    X = np.random.default_rng(0).random((2, 3, 6, 6))
    X[0, 1, 2, 3], X[1, 0, 0, 0], X[1, 2, 4, 4] = np.inf, np.nan, -np.inf
    x = ej.input("x", X.shape, "float64")
    u = ej.unfold(x, 3, padding=1, stride=2)
    want = F.unfold(torch.tensor(X), 3, padding=1, stride=2).numpy()
    win = next(n for n in ej.Graph(u).nodes if n.kind == "pool")
    for spec in (None, {"c": 5, "p": 2}, {"c": 27, "q": 3}):  # output blocks cutting a channel's windows
        got = ej.execute_blocked(u, {win: spec} if spec else None, x=X)
        np.testing.assert_array_equal(got, want)
    v, i = max_pool_with_indices(x, 2, 1)
    tv, ti = F.max_pool2d(torch.tensor(X), 2, 1, return_indices=True)
    got = ej.reference([v, i], x=X)
    np.testing.assert_array_equal(got[0], tv.numpy())
    np.testing.assert_array_equal(got[1], ti.numpy())


@pytest.mark.parametrize("devices", [1, 2])
def test_from_torch_max_pool_with_used_indices(devices: int) -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            v, i = F.max_pool2d(x, 3, 2, 1, return_indices=True)
            return v * 2, i + 1

    x = torch.randn(2, 3, 9, 8)
    got = ej.compile(ej.from_torch(M(), (x,)), devices=devices, quiet=True).run(x)
    want = M()(x)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])


def test_unfold_gradient_equals_torch_autograd() -> None:
    rng = np.random.default_rng(5)
    X = rng.standard_normal((2, 3, 9, 8))
    x = ej.input("x", X.shape, "float64")
    y = ej.unfold(x, (3, 2), (1, 2), 1, (2, 1))
    G = rng.standard_normal(y.shape)
    (dx,) = ej.grad((y * ej.input("g", y.shape, "float64")).sum(), [x])
    tx = torch.tensor(X, requires_grad=True)
    (F.unfold(tx, (3, 2), (1, 2), 1, (2, 1)) * torch.tensor(G)).sum().backward()
    assert tx.grad is not None
    got = ej.compile(dx, devices=2, quiet=True).run(g=G)
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def _grad(X: np.ndarray, mine: Any, theirs: Any) -> tuple[np.ndarray, np.ndarray]:
    x = ej.input("x", X.shape, "float64")
    y = mine(x)
    G = np.random.default_rng(1).standard_normal(y.shape)
    (dx,) = ej.grad((y * ej.input("g", y.shape, "float64")).sum(), [x])
    tx = torch.tensor(X, requires_grad=True)
    (theirs(tx) * torch.tensor(G)).sum().backward()
    assert tx.grad is not None
    return ej.compile(dx, devices=2, quiet=True).run(x=X, g=G), tx.grad.numpy()


@pytest.mark.parametrize("X, mine, theirs", [
    (np.ones((1, 1, 4, 4)), lambda x: ej.max_pool(x, 2), lambda t: F.max_pool2d(t, 2)),
    (np.round(np.random.default_rng(0).standard_normal((1, 2, 5, 5))), lambda x: ej.max_pool(x, 3, 1, 1),
     lambda t: F.max_pool2d(t, 3, 1, 1)),
    (np.array([[[1.0, np.nan, 2.0, 3.0, np.nan, np.nan]]]), lambda x: ej.max_pool(x, 2),
     lambda t: F.max_pool1d(t, 2)),
    (np.array([[[np.nan, 1.0, np.nan, 3.0, np.nan, 2.0, 2.0]]]), lambda x: ej.max_pool(x, 3, 1, 1),
     lambda t: F.max_pool1d(t, 3, 1, 1)),
    (np.array([[[np.nan, 1.0, np.nan, 3.0, np.nan, 2.0, 2.0]]]), lambda x: ej.adaptive_max_pool(x, 3),
     lambda t: F.adaptive_max_pool1d(t, 3)),
    (np.ones((1, 1, 4, 3)), lambda x: ej.adaptive_max_pool(x, 2), lambda t: F.adaptive_max_pool2d(t, 2)),
    (np.round(np.random.default_rng(2).standard_normal((2, 2, 7, 5))), lambda x: ej.adaptive_max_pool(x, (3, 2)),
     lambda t: F.adaptive_max_pool2d(t, (3, 2))),
])
def test_max_pool_gradients_route_to_the_first_maximum_as_torch(X: np.ndarray, mine: Any, theirs: Any) -> None:
    """Ties (and NaN windows) send each window's cotangent to one position — the first maximum
    in row-major window order, or the last NaN — as torch's indices do."""
    got, want = _grad(X, mine, theirs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)  # (overlapping windows: sums in another order)


def test_adaptive_max_pool_indices_equal_torch() -> None:
    from einjoin.frontend.conv import adaptive_max_pool_with_indices
    rng = np.random.default_rng(4)
    for shape, out in (((2, 3, 7, 8), (3, 5)), ((2, 3, 9), 4), ((1, 2, 5, 6, 7), (2, 4, 3)), ((2, 3, 8, 8), 4)):
        X = np.round(rng.standard_normal(shape))  # ties
        x = ej.input("x", shape, "float64")
        v, i = adaptive_max_pool_with_indices(x, out)
        tv, ti = getattr(F, f"adaptive_max_pool{len(shape) - 2}d")(torch.tensor(X), out, return_indices=True)
        got = ej.compile([v, i], devices=2, quiet=True).run(x=X)
        np.testing.assert_array_equal(got[0], tv.numpy())
        np.testing.assert_array_equal(got[1], ti.numpy())


def test_half_precision_average_pools_round_once_as_torch() -> None:
    X = (torch.rand(2, 3, 7, 9, generator=torch.Generator().manual_seed(0)) * 200).to(torch.bfloat16)
    x = ej.input("x", tuple(X.shape), "bfloat16")
    feeds = dict(x=X.float().numpy().astype(ej.ir.dtypes.numpy_dtype("bfloat16")))
    for mine, theirs in ((lambda t: ej.adaptive_avg_pool(t, (3, 4)), lambda t: F.adaptive_avg_pool2d(t, (3, 4))),
                         (lambda t: ej.avg_pool(t, 3, 2, 1), lambda t: F.avg_pool2d(t, 3, 2, 1)),
                         (lambda t: ej.adaptive_avg_pool(t, 1), lambda t: F.adaptive_avg_pool2d(t, 1))):
        y = mine(x)
        assert y.dtype == "bfloat16"
        want = theirs(X.float()).to(torch.bfloat16).float().numpy()
        got = ej.compile(y, devices=2, quiet=True).run(**feeds).astype(np.float32)
        # float32 sums in another order (blocks on 2 devices) may land a mean on the other side of a
        # bfloat16 tie: one ulp (2**-8 relative) apart, never more (rounding twice errs by several)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=0)
