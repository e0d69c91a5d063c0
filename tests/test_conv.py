"""Convolutions (the Conv node kind) against torch: ``ej.conv`` / ``ej.conv_transpose`` and
``from_torch`` of nn.Conv*d modules, with random stride, padding, dilation and groups (depthwise
7x7 included), 1-3 spatial dims, on 1 and 2 devices and under random join-agg specs (spatial
splits read a halo, input-channel splits make partial sums); gradients against torch autograd;
the graphgen oracle (index arithmetic, no torch) for the kind itself; one memory-capped run."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.decomp.spec import label_sizes
from einjoin.errors import DTypeError, ShapeError
from einjoin.ir import ops
from graphgen import oracle

F = torch.nn.functional
TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TORCH_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
FAST = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def conv_cases(draw: Any, transpose: bool = False) -> dict[str, Any]:
    nd = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cg, og = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3 if nd == 3 else 4)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    padding = tuple(draw(st.integers(0, (k - 1) * d)) if not transpose else draw(st.integers(0, (k - 1) * d))
                    for k, d in zip(kernel, dilation))
    lo = 4 if nd == 3 else 6
    spatial = tuple(max(draw(st.integers(lo, lo + 6)), d * (k - 1) + 1) for k, d in zip(kernel, dilation))
    return dict(nd=nd, groups=groups, cg=cg, og=og, kernel=kernel, stride=stride, dilation=dilation,
                padding=padding, spatial=spatial, n=draw(st.integers(1, 2)), seed=draw(st.integers(0, 2**16)))


def _random_spec(node: ej.Node, rng: np.random.Generator) -> dict[str, int]:
    """A random block count (up to 3) for each label of ``node``."""
    return {lab: int(rng.integers(1, min(3, n) + 1)) for lab, n in label_sizes(node).items() if n}


@given(conv_cases())
@FAST
def test_conv_equals_torch_blocked_and_on_two_devices(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    x_shape = (c["n"], c["groups"] * c["cg"]) + c["spatial"]
    w_shape = (c["groups"] * c["og"], c["cg"]) + c["kernel"]
    X, W, B = rng.standard_normal(x_shape), rng.standard_normal(w_shape), rng.standard_normal(w_shape[0])
    x, w = ej.input("x", x_shape, "float64"), ej.param("w", w_shape, "float64")
    b = ej.param("b", (w_shape[0],), "float64")
    y = ej.conv(x, w, b, stride=c["stride"], padding=c["padding"], dilation=c["dilation"], groups=c["groups"])
    want = TORCH_CONV[c["nd"]](torch.tensor(X), torch.tensor(W), torch.tensor(B), c["stride"], c["padding"],
                               c["dilation"], c["groups"]).numpy()
    feeds = dict(x=X, w=W, b=B)
    np.testing.assert_allclose(ej.reference(y, **feeds), want, rtol=1e-10, atol=1e-10)
    conv_node = next(n for n in ej.Graph(y).nodes if n.kind == "conv")
    spec = _random_spec(conv_node, rng)
    np.testing.assert_allclose(ej.execute_blocked(y, {conv_node: spec}, **feeds), want, rtol=1e-10, atol=1e-10)
    got = ej.compile(y, devices=2, quiet=True).run(**feeds)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@given(conv_cases(transpose=True))
@FAST
def test_conv_transpose_equals_torch(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    x_shape = (c["n"], c["groups"] * c["cg"]) + c["spatial"]
    w_shape = (c["groups"] * c["cg"], c["og"]) + c["kernel"]
    extra = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(c["stride"], c["dilation"]))
    X, W = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    x, w = ej.input("x", x_shape, "float64"), ej.param("w", w_shape, "float64")
    y = ej.conv_transpose(x, w, stride=c["stride"], padding=c["padding"], output_padding=extra,
                          dilation=c["dilation"], groups=c["groups"])
    want = TORCH_CONV_T[c["nd"]](torch.tensor(X), torch.tensor(W), None, c["stride"], c["padding"], extra,
                                 c["groups"], c["dilation"]).numpy()
    np.testing.assert_allclose(ej.reference(y, x=X, w=W), want, rtol=1e-10, atol=1e-10)
    conv_node = next(n for n in ej.Graph(y).nodes if n.kind == "conv")
    got = ej.execute_blocked(y, {conv_node: _random_spec(conv_node, rng)}, x=X, w=W)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@given(conv_cases())
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_conv_gradients_equal_torch_autograd(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    x_shape = (c["n"], c["groups"] * c["cg"]) + c["spatial"]
    w_shape = (c["groups"] * c["og"], c["cg"]) + c["kernel"]
    X, W = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    x, w = ej.input("x", x_shape, "float64"), ej.param("w", w_shape, "float64")
    y = ej.conv(x, w, stride=c["stride"], padding=c["padding"], dilation=c["dilation"], groups=c["groups"])
    G = rng.standard_normal(y.shape)
    g = ej.input("g", y.shape, "float64")
    dx, dw = ej.grad((y * g).sum(), [x, w])
    tx, tw = torch.tensor(X, requires_grad=True), torch.tensor(W, requires_grad=True)
    ty = TORCH_CONV[c["nd"]](tx, tw, None, c["stride"], c["padding"], c["dilation"], c["groups"])
    (ty * torch.tensor(G)).sum().backward()
    assert tx.grad is not None and tw.grad is not None
    got = ej.compile([dx, dw], devices=2, quiet=True).run(x=X, w=W, g=G)
    np.testing.assert_allclose(got[0], tx.grad.numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(got[1], tw.grad.numpy(), rtol=1e-9, atol=1e-9)


@given(conv_cases())
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_conv_kind_equals_the_index_arithmetic_oracle(c: dict[str, Any]) -> None:
    """The kind with general (lo, hi) padding (negative: cropped) and an input dilation, against
    tests/graphgen.py's oracle, which uses no torch."""
    rng = np.random.default_rng(c["seed"])
    nd = c["nd"]
    x_shape = (c["n"], c["groups"] * c["cg"]) + c["spatial"]
    w_shape = (c["groups"] * c["og"], c["cg"]) + c["kernel"]
    pads = tuple((int(rng.integers(-1, 3)), int(rng.integers(-1, 3))) for _ in range(nd))
    ld = tuple(int(rng.integers(1, 3)) for _ in range(nd))
    x, w = ej.input("x", x_shape, "float64"), ej.param("w", w_shape, "float64")
    try:
        y = ops.conv_node(x.node, w.node, c["stride"], pads, ld, c["dilation"], c["groups"])
    except ShapeError:
        return  # no output position (a crop larger than the input): refused at build time
    feeds = dict(x=rng.standard_normal(x_shape), w=rng.standard_normal(w_shape))
    (want,) = oracle([ej.Tensor(y)], feeds)
    np.testing.assert_allclose(ej.reference(ej.Tensor(y), **feeds), want, rtol=1e-10, atol=1e-10)
    got = ej.execute_blocked(ej.Tensor(y), {y: _random_spec(y, rng)}, **feeds)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


class _Net(torch.nn.Module):
    def __init__(self, nd: int, cin: int, cout: int, k: int, stride: int, padding: Any, dilation: int,
                 groups: int, transpose: bool) -> None:
        super().__init__()
        cls = getattr(torch.nn, f"ConvTranspose{nd}d" if transpose else f"Conv{nd}d")
        self.conv = cls(cin, cout, k, stride=stride, padding=padding, dilation=dilation, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("nd, cin, cout, k, stride, padding, dilation, groups, transpose", [
    (1, 4, 6, 3, 2, 1, 1, 2, False),
    (2, 4, 4, 7, 1, 3, 1, 4, False),          # depthwise 7x7 (ConvNeXt)
    (2, 3, 8, 3, 1, "same", 2, 1, False),
    (3, 2, 4, 3, 2, 1, 1, 1, False),
    (2, 4, 6, 3, 2, 1, 1, 2, True),
    (1, 3, 2, 4, 2, 1, 1, 1, True),
])
@pytest.mark.parametrize("devices", [1, 2])
def test_from_torch_conv_modules(nd: int, cin: int, cout: int, k: int, stride: int, padding: Any, dilation: int,
                                 groups: int, transpose: bool, devices: int) -> None:
    torch.manual_seed(nd * 10 + k)
    m = _Net(nd, cin, cout, k, stride, padding, dilation, groups, transpose).eval()
    x = torch.randn((2, cin) + (9,) * nd if nd < 3 else (2, cin, 6, 7, 5))
    fn = ej.from_torch(m, (x,))
    got = ej.compile(fn, devices=devices, quiet=True).run(x)
    torch.testing.assert_close(got, m(x).detach(), rtol=1e-5, atol=1e-5)


def test_from_torch_unbatched_conv1d_and_functional_forms() -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.conv1d(x, self.w, padding="same") + F.conv1d(x, self.w, padding="valid").sum()

    m = M()
    x = torch.randn(3, 12)  # unbatched (C, L), as torch allows
    got = ej.compile(ej.from_torch(m, (x,)), devices=2, quiet=True).run(x)
    torch.testing.assert_close(got, m(x).detach(), rtol=1e-5, atol=1e-4)


def test_conv_under_a_memory_cap_of_half_its_working_set() -> None:
    rng = np.random.default_rng(0)
    X, W = rng.standard_normal((2, 8, 40, 40)).astype("float32"), rng.standard_normal((8, 8, 3, 3)).astype("float32")
    x, w = ej.input("x", X.shape), ej.param("w", W.shape)
    y = ej.maximum(ej.conv(x, w, padding=1), 0.0)
    free = ej.compile(y, devices=2, quiet=True)
    peak = max(free.stats.peak_bytes_per_device.values())
    prog = ej.compile(y, devices=2, memory_limit=peak // 2, quiet=True)
    got = prog.run(x=X, w=W)
    want = F.relu(F.conv2d(torch.tensor(X), torch.tensor(W), padding=1)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert max(prog.run_stats.peak_bytes_per_device.values()) <= peak // 2


def test_half_precision_conv_accumulates_in_float32() -> None:
    rng = np.random.default_rng(1)
    X, W = rng.standard_normal((1, 64, 10)), rng.standard_normal((4, 64, 3))
    x, w = ej.input("x", X.shape, "bfloat16"), ej.param("w", W.shape, "bfloat16")
    y = ej.conv(x, w, padding=1)
    tx, tw = torch.tensor(X, dtype=torch.bfloat16), torch.tensor(W, dtype=torch.bfloat16)
    want = F.conv1d(tx.float(), tw.float(), padding=1).to(torch.bfloat16).float().numpy()
    feeds = dict(x=tx.float().numpy().astype(ej.ir.dtypes.numpy_dtype("bfloat16")),
                 w=tw.float().numpy().astype(ej.ir.dtypes.numpy_dtype("bfloat16")))
    conv_node = y.node
    got = ej.execute_blocked(y, {conv_node: {"c": 4}}, **feeds)  # float32 partials, one rounding
    np.testing.assert_array_equal(got.astype(np.float32), want)


def test_conv_errors_name_the_op_shapes_and_argument() -> None:
    x, w = ej.input("x", (2, 4, 8, 8)), ej.param("w", (6, 3, 3, 3))
    with pytest.raises(ShapeError, match=r"conv of input \(2, 4, 8, 8\) with weight \(6, 3, 3, 3\).*groups"):
        ej.conv(x, w)
    with pytest.raises(ShapeError, match="no output position"):
        ej.conv(ej.input("s", (1, 3, 2, 2)), w)
    with pytest.raises(DTypeError, match="float dtype"):
        ej.conv(ej.input("i", (2, 3, 8, 8), "int64"), w)
    with pytest.raises(ej.EinjoinError, match="padding='same' needs stride 1"):
        ej.conv(ej.input("y", (2, 3, 8, 8)), w, stride=2, padding="same")
    with pytest.raises(ShapeError, match="stride"):
        ej.conv(ej.input("z", (2, 3, 8, 8)), w, stride=0)
    with pytest.raises(ShapeError, match="bias"):
        ej.conv(ej.input("z", (2, 3, 8, 8)), w, ej.param("b", (5,)))


def test_conv_prints_and_hash_conses() -> None:
    x, w = ej.input("x", (2, 4, 8, 8)), ej.param("w", (6, 2, 3, 3))
    y = ej.conv(x, w, stride=2, padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2)
    assert "conv[stride=[2, 2], pad=[1:0, 2:1], dilation=[1, 2], groups=2](x, w)" in str(ej.Graph(y))
    assert ej.conv(x, w, stride=2, padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2).node is y.node


_MODULES = [
    (lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 11)),
    (lambda: torch.nn.Conv2d(3, 4, 3, padding="same", dilation=2), (2, 3, 9, 8)),
    (lambda: torch.nn.Conv3d(2, 2, 2, stride=(1, 2, 1), bias=False), (1, 2, 4, 5, 4)),
    (lambda: torch.nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 6)),
    (lambda: torch.nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 3, 9, 8)),
    (lambda: torch.nn.AvgPool2d(3, 2, 1, count_include_pad=False), (2, 3, 9, 8)),
    (lambda: torch.nn.AvgPool1d(2), (2, 3, 9)),
    (lambda: torch.nn.AdaptiveAvgPool2d((3, 2)), (2, 3, 9, 8)),
    (lambda: torch.nn.AdaptiveMaxPool1d(4), (2, 3, 9)),
    (lambda: torch.nn.Unfold(2, stride=2), (2, 3, 6, 6)),
]


@pytest.mark.parametrize("make, shape", _MODULES)
def test_the_nn_module_table_as_torch_fx_calls_it(make: Any, shape: tuple[int, ...]) -> None:
    """CONV_MODULES (merged into the fx path's module table): (module, its parameters, input)."""
    from einjoin.frontend.aten_conv import CONV_MODULES
    torch.manual_seed(0)
    m = make()
    X = torch.randn(shape)
    params = {name: ej.param(name, tuple(p.shape)) for name, p in m.named_parameters()}
    x = ej.input("x", shape)
    y = CONV_MODULES[type(m).__name__](m, params, x)
    feeds = {name: p.detach().numpy() for name, p in m.named_parameters()} | {"x": X.numpy()}
    np.testing.assert_allclose(ej.compile(y, devices=2, quiet=True).run(**feeds), m(X).detach().numpy(),
                               rtol=1e-5, atol=1e-5)


def test_conv_padding_modes_other_than_zeros_are_refused_on_the_fx_path() -> None:
    from einjoin.frontend.aten_conv import CONV_MODULES
    m = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    with pytest.raises(ej.UnsupportedOpError, match="padding_mode='reflect'.*torch.export"):
        CONV_MODULES["Conv2d"](m, {"weight": ej.param("w", (4, 3, 3, 3))}, ej.input("x", (1, 3, 8, 8)))


@pytest.mark.parametrize("dim, size, step", [(1, 3, 2), (0, 2, 1), (-1, 4, 1), (2, 1, 3)])
def test_tensor_unfold_is_an_identity_kernel_conv(dim: int, size: int, step: int) -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.unfold(dim, size, step) * 2

    X = torch.randn(3, 10, 4)
    got = ej.compile(ej.from_torch(M(), (X,)), devices=2, quiet=True).run(X)
    torch.testing.assert_close(got, M()(X))


@given(conv_cases(), st.sampled_from([False, False, True]))
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_from_torch_random_conv_modules_on_one_and_two_devices(c: dict[str, Any], transpose: bool) -> None:
    """nn.Conv*d / nn.ConvTranspose*d with random stride, padding, dilation and groups, imported
    with from_torch (torch.export) and run on 1 and 2 devices."""
    torch.manual_seed(c["seed"])
    nd, g = c["nd"], c["groups"]
    cls = getattr(torch.nn, f"ConvTranspose{nd}d" if transpose else f"Conv{nd}d")
    m = cls(g * c["cg"], g * c["og"], c["kernel"], stride=c["stride"], padding=c["padding"],
            dilation=c["dilation"], groups=g).double().eval()
    x = torch.randn((c["n"], g * c["cg"]) + c["spatial"], dtype=torch.float64)
    want = m(x).detach()
    fn = ej.from_torch(m, (x,))
    for devices in (1, 2):
        torch.testing.assert_close(ej.compile(fn, devices=devices, quiet=True).run(x), want, rtol=1e-10, atol=1e-10)
