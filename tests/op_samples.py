"""One torch sample per translation of the op table (``einjoin.frontend.aten.OPS``), and what
running it through ``ej.from_torch`` shows: the node kinds each translation emits and whether
``ej.grad`` of it equals ``torch.autograd``. ``tests/test_op_table.py`` checks the facts
declared in ``einjoin/frontend/op_facts.json`` against these runs; after changing a translation,
regenerate that file (and then the docs page) with::

    .venv/bin/python -m tests.op_samples > einjoin/frontend/op_facts.json
    .venv/bin/python -m einjoin torch-ops > docs/torch_ops.md

A sample is a Python expression over the arguments ``a, b, c`` (torch tensors built from
specs: ``f:2,3`` normal float32 (``d:2,3`` float64), ``p:2,3`` in [0.5, 1.5), ``u:2,3`` in (0.05, 0.95),
``i5:2,3`` int64 in [0, 5), ``b:2,3`` bool) and the names ``torch``, ``F`` and ``nn``, captured
with ``method`` (``fx`` keeps torch's function / method names; ``export`` records ATen ops).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import einjoin as ej
from einjoin.frontend import aten
from einjoin.frontend.op_table import op_groups
from einjoin.decomp.split_facts import split_text
from einjoin.frontend.tensor import Tensor
from einjoin.ir.dtypes import kind as dtype_kind


@dataclass(frozen=True)
class Sample:
    expr: str
    args: tuple[str, ...] = ("f:3,4",)
    method: str = "fx"
    grad: bool = True  # False: the forward is checked, the gradient not (see the reason in NO_GRAD_CHECK)


def S(expr: str, *args: str, method: str = "fx", grad: bool = True) -> Sample:
    return Sample(expr, tuple(args) or ("f:3,4",), method, grad)


# ---------------------------------------------------------------- the arguments


def make_arg(spec: str, seed: int) -> torch.Tensor:
    kind, _, shape_s = spec.partition(":")
    shape = tuple(int(s) for s in shape_s.split(",") if s) if shape_s else ()
    g = torch.Generator().manual_seed(seed)
    if kind == "f":
        return torch.randn(shape, generator=g)
    if kind == "d":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "p":
        return torch.rand(shape, generator=g) + 0.5
    if kind == "u":
        return torch.rand(shape, generator=g) * 0.9 + 0.05
    if kind == "b":
        return torch.rand(shape, generator=g) > 0.5
    if kind.startswith("i"):
        return torch.randint(0, int(kind[1:]), shape, generator=g)
    if kind == "s":  # a sparse COO matrix, about a third of it stored (coalesced: its values are its entries)
        return (torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.35)).to_sparse()
    raise ValueError(f"arg spec {spec!r}")


class _M1(nn.Module):
    def __init__(self, f: Any) -> None:
        super().__init__()
        self.f = f

    def forward(self, a):
        return self.f(a)


class _M2(_M1):
    def forward(self, a, b):
        return self.f(a, b)


class _M3(_M1):
    def forward(self, a, b, c):
        return self.f(a, b, c)


def module_of(sample: Sample) -> nn.Module:
    names = "abc"[:len(sample.args)]
    f = eval(f"lambda {', '.join(names)}: {sample.expr}", {"torch": torch, "F": F, "nn": nn})  # noqa: S307
    return (_M1, _M2, _M3)[len(names) - 1](f).eval()


def args_of(sample: Sample) -> tuple[torch.Tensor, ...]:
    return tuple(make_arg(s, 7 + k) for k, s in enumerate(sample.args))


# ---------------------------------------------------------------- recording the translations' kinds


def _nodes(v: Any, out: list[Any]) -> None:
    if isinstance(v, Tensor):
        out.append(v.node)
    elif isinstance(v, ej.SparseInput):  # a torch sparse argument: its keys and values inputs
        out.extend(v.pattern)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _nodes(x, out)
    elif isinstance(v, dict):
        for x in v.values():
            _nodes(x, out)


def _reach(roots: list[Any]) -> set[Any]:
    seen: set[Any] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.inputs)
    return seen


@dataclass(frozen=True)
class Call:
    fn: Any
    name: str
    kinds: frozenset[str]
    texts: frozenset[tuple[str, str]]  # (kind, its split facts' line for that node)
    float_in: bool
    float_out: bool


@contextlib.contextmanager
def recording():
    """While active, every translation ``aten.call`` makes is recorded: ``calls`` is a list of
    :class:`Call` (the translation function, the name called, the node kinds it emitted: the
    nodes its results reach that its arguments do not, whether a float tensor went in / came out)."""
    calls: list[Call] = []
    real = aten.call

    def call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = real(name, args, kwargs)
        ins: list[Any] = []
        _nodes(args, ins)
        _nodes(kwargs, ins)
        outs: list[Any] = []
        _nodes(out, outs)
        new = _reach(outs) - _reach(ins)
        calls.append(Call(aten.OPS[name], name, frozenset(n.kind for n in new),
                          frozenset((n.kind, split_text(n)) for n in new),
                          any(dtype_kind(n.dtype) == "float" for n in ins),
                          any(dtype_kind(n.dtype) == "float" for n in outs)))
        return out

    aten.call = call
    try:
        yield calls
    finally:
        aten.call = real


# ---------------------------------------------------------------- running a sample


def _np(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor) and v.is_sparse:  # a sparse argument's gradient: its values (einjoin's)
        v = v.coalesce().values()
    return v.detach().numpy(force=True) if isinstance(v, torch.Tensor) else np.asarray(v)  # force: a ZeroTensor


def _flat(v: Any) -> list[Any]:
    if isinstance(v, (tuple, list)):
        return [x for item in v for x in _flat(item)]
    return [v]


def close(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-5, what: str = "") -> None:
    gs, ws = _flat(got), _flat(want)
    assert len(gs) == len(ws), f"{what}: {len(gs)} outputs, torch {len(ws)}"
    for k, (g, w) in enumerate(zip(gs, ws)):
        g, w = _np(g), _np(w)
        assert g.shape == w.shape, f"{what} output {k}: shape {g.shape}, torch {w.shape}"
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w, err_msg=f"{what} output {k}")
        else:
            fin = np.abs(w[np.isfinite(w)])
            scale = max(1.0, float(fin.max())) if fin.size else 1.0
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale, err_msg=f"{what} output {k}")


@dataclass
class Run:
    """What one sample showed: the translations it called (function -> its calls), the
    imported function, the torch module, its arguments and torch's outputs."""

    calls: dict[Any, list[Call]] = field(default_factory=dict)
    fn: Any = None
    module: Any = None
    args: tuple[Any, ...] = ()
    want: Any = None


def run_sample(sample: Sample) -> Run:
    m = module_of(sample)
    args = args_of(sample)
    with torch.no_grad():  # on copies: an in-place sample (torch.celu_(a)) writes its argument
        want = m(*(a.clone() for a in args))
    with recording() as calls:
        fn = ej.from_torch(m, tuple(a.clone() for a in args), method=sample.method)
    r = Run(fn=fn, module=m, args=args, want=want)
    for c in calls:
        r.calls.setdefault(c.fn, []).append(c)
    return r


def check_forward(r: Run, devices: tuple[int, ...] = (1, 2), what: str = "", planner: str = "auto") -> None:
    """The import compiled for each device count (by ``planner``: ``split_largest`` cuts every op's
    largest label, and compiles in a quarter of the time) against torch's outputs."""
    for d in devices:
        got = ej.compile(r.fn, devices=d, planner=planner).run(*r.args)
        close(got, r.want, what=f"{what} on {d} device(s), planner {planner}")


def float_outputs(r: Run) -> list[int]:
    return [k for k, o in enumerate(r.fn.outputs) if dtype_kind(o.dtype) == "float"]


def check_grad(r: Run, devices: int | None = 2, what: str = "") -> bool:
    """``ej.grad`` of sum_k <w_k, out_k> (fixed random w_k, over the float outputs) w.r.t. the float
    arguments, compiled for ``devices`` (None: the numpy reference), against torch.autograd; True
    when torch's gradient is not all zero. An EinjoinError (no derivative) comes from einjoin
    before torch is asked."""
    keep = float_outputs(r)
    g = torch.Generator().manual_seed(3)
    want_dt = [o.dtype for o in _flat(r.want)]
    ws = [torch.randn(tuple(r.fn.outputs[k].shape), generator=g).to(want_dt[k]) for k in keep]
    by_name: dict[str, Any] = {}
    for o in r.fn.outputs:
        by_name.update(ej.Graph([o.node]).input_by_name)
    floats = [(n, a) for n, a in zip(r.fn.arg_names, r.args) if a.is_floating_point()]
    used = [k for k, (n, _) in enumerate(floats) if n in by_name]  # an argument read for its shape only: no input
    cts = [ej.input(f"ct_{k}", tuple(w.shape), r.fn.outputs[k].dtype) for k, w in zip(keep, ws)]
    grads = ej.vjp([r.fn.outputs[k] for k in keep], cts, [Tensor(by_name[floats[k][0]]) for k in used])
    args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in r.args)
    outs = _flat(r.module(*(a * 1 if a.is_floating_point() else a for a in args)))
    loss = sum((outs[k] * w).sum() for k, w in zip(keep, ws))
    fargs = [a for a in args if a.is_floating_point()]
    want = (torch.autograd.grad(loss, fargs, allow_unused=True) if isinstance(loss, torch.Tensor)
            and loss.requires_grad else [None] * len(fargs))
    want = [torch.zeros_like(a) if w is None else w for a, w in zip(fargs, want)]
    for k in range(len(floats)):
        if k not in used:
            assert not want[k].any(), f"{what}: torch has a gradient for {floats[k][0]}, einjoin no input"
    if used:
        both = r.fn.with_outputs(list(grads))
        read = ej.Graph([t.node for t in grads]).input_by_name
        feeds = {f"ct_{k}": w for k, w in zip(keep, ws) if f"ct_{k}" in read}
        got = (both.reference(*r.args, **feeds) if devices is None
               else ej.compile(both, devices=devices).run(*r.args, **feeds))
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        close(got, [want[k] for k in used], rtol=1e-3, atol=1e-4, what=f"{what} gradient")
    return any(bool(w.any()) for w in want)


# ---------------------------------------------------------------- the samples
# X4: an image batch, X3: a sequence batch, W*: conv weights
X3, X4, X5 = "f:2,4,9", "f:2,4,8,8", "f:1,2,5,6,6"
E = "export"
# names no torch 2.13 call reaches (kept in the table for other torch versions' spellings)
NO_SAMPLE: dict[str, str] = {
    "_adaptive_avg_pool1d": "no ATen op of that name in torch 2.13",
    "logsigmoid": "torch 2.13's F.logsigmoid is named log_sigmoid",
}
HAND: dict[str, tuple[Sample, ...]] = {
    "_adaptive_avg_pool2d": (S("torch.ops.aten._adaptive_avg_pool2d(a, [4, 3])", X4, method=E),),
    "adaptive_avg_pool2d": (S("F.adaptive_avg_pool2d(a, (4, 3))", X4),),
    "_adaptive_avg_pool3d": (S("torch.ops.aten._adaptive_avg_pool3d(a, [2, 3, 4])", X5, method=E),),
    "adaptive_avg_pool3d": (S("F.adaptive_avg_pool3d(a, (2, 3, 4))", X5),),
    "adaptive_max_pool2d": (S("torch.ops.aten.adaptive_max_pool2d(a, [4, 3])", X4, method=E),),
    "adaptive_max_pool3d": (S("torch.ops.aten.adaptive_max_pool3d(a, [2, 3, 4])", X5, method=E),),
    "F.adaptive_max_pool1d": (S("F.adaptive_max_pool1d(a, 4)", X3),),
    "F.adaptive_max_pool2d": (S("F.adaptive_max_pool2d(a, (4, 3))", X4),),
    "F.adaptive_max_pool3d": (S("F.adaptive_max_pool3d(a, (2, 3, 4))", X5),),
    "addcdiv": (S("torch.addcdiv(a, b, c, value=0.5)", "f:3,4", "f:3,4", "p:3,4"),),
    "addcmul": (S("torch.addcmul(a, b, c, value=0.5)", "f:3,4", "f:3,4", "f:3,4"),),
    "addmm": (S("torch.addmm(a, b, c)", "f:4", "f:3,5", "f:5,4", method=E),),
    "logical_and": (S("torch.logical_and(a, b)", "b:3,4", "b:3,4"),),
    "and_": (S("__import__('operator').and_(a, b)", "b:3,4", "b:3,4"),),
    "arange": (S("a * torch.arange(4)", "f:3,4", method=E),),
    "avg_pool2d": (S("F.avg_pool2d(a, 3, stride=2, padding=1)", X4),),
    "avg_pool3d": (S("F.avg_pool3d(a, 2, stride=2)", X5),),
    "baddbmm": (S("torch.baddbmm(a, b, c, alpha=0.5)", "f:2,3,4", "f:2,3,5", "f:2,5,4"),),
    "batch_norm": (S("F.batch_norm(a, b.detach(), c.detach(), weight=b, bias=c)", "f:3,4,5", "f:4", "p:4"),),
    "bfloat16": (S("a.bfloat16().float()"),),
    "binary_cross_entropy": (S("F.binary_cross_entropy(a, b)", "u:3,4", "u:3,4"),),
    "bitwise_and": (S("torch.bitwise_and(a, b)", "b:3,4", "b:3,4"),),
    "invert": (S("torch.bitwise_not(a)", "i5:3,4"),),
    # issue 39: the integer ops
    "bitwise_left_shift": (S("torch.bitwise_left_shift(a, b)", "i5:3,4", "i5:3,4"),),
    "bitwise_right_shift": (S("a >> b", "i5:3,4", "i5:3,4"),),
    "fmod": (S("torch.fmod(a, b)", "f:3,4", "p:3,4"),),
    # session 40: transcendental ops (einjoin/frontend/aten_math.py)
    "sinh": (S("torch.sinh(a)"),),
    "cosh": (S("torch.cosh(a)"),),
    "asin": (S("torch.asin(b)", "f:3,4", "u:3,4"),),
    "acos": (S("torch.acos(b)", "f:3,4", "u:3,4"),),
    "atan": (S("torch.atan(a)"),),
    "asinh": (S("torch.asinh(a)"),),
    "acosh": (S("torch.acosh(a + 1.5)", "p:3,4"),),
    "atanh": (S("torch.atanh(a)", "u:3,4"),),
    "atan2": (S("torch.atan2(a, b)", "f:3,4", "f:3,4"),),
    "copysign": (S("torch.copysign(a, b)", "f:3,4", "f:3,4"),),
    "xlogy": (S("torch.xlogy(a, b)", "f:3,4", "p:3,4"),),
    "logaddexp": (S("torch.logaddexp(a, b)", "f:3,4", "f:3,4"),),
    "logaddexp2": (S("torch.logaddexp2(a, b)", "f:3,4", "f:3,4"),),
    "logit": (S("torch.logit(a) + torch.logit(a, eps=0.2)", "u:3,4"),),
    "gcd": (S("torch.gcd(a, b)", "i5:3,4", "i5:3,4"),),
    "trace": (S("torch.trace(a)", "f:3,4"),),
    "diag": (S("torch.diag(a, 1)", "f:3,4"), S("torch.diag(a[0], -1)", "f:3,4")),
    "var_mean": (S("torch.var_mean(a, 1)[0] + torch.var_mean(a, 1)[1]", "f:3,4"),),
    "std_mean": (S("torch.std_mean(a, 0, keepdim=True)[0] * 2 + torch.std_mean(a)[1]", "f:3,4"),),
    "dist": (S("torch.dist(a, b, 3)", "f:3,4", "f:3,4"),),
    "cosine_similarity": (S("F.cosine_similarity(a, b[0], dim=-1)", "f:3,4", "f:3,4"),),
    "linalg_matrix_norm": (S("torch.linalg.matrix_norm(a) + torch.linalg.matrix_norm(a, 1)", "f:3,4"),),
    "cdist": (S("torch.cdist(a, b)", "f:3,4", "f:2,4"),),
    "median": (S("torch.median(a)", "f:3,4"), S("torch.median(a, 1).values", "f:3,4")),
    "cummax": (S("torch.cummax(a, 1)[0] + torch.cummax(a, 0)[1]", "f:3,4"),),
    "cummin": (S("torch.cummin(a, 1)[0]", "f:3,4"),),
    "logical_not": (S("torch.logical_not(a)", "f:3,4"),),
    "bitwise_or": (S("torch.bitwise_or(a, b)", "b:3,4", "b:3,4"),),
    "mm": (S("torch.matmul(a, b)", "f:2,3,5", "f:5,4"),),
    "_sparse_mm": (S("torch.sparse.mm(a, b)", "s:6,5", "f:5,4", method=E),),
    "_sparse_addmm": (S("torch.sparse.addmm(c, a, b, beta=0.5, alpha=2.0)", "s:6,5", "f:5,4", "f:6,4", method=E),),
    "expand": (S("a.expand(2, 3, 4)", "f:3,1"),),
    "cat": (S("torch.cat([a, b], 1)", "f:3,4", "f:3,2"),),
    "constant_pad_nd": (S("torch.ops.aten.constant_pad_nd(a, [1, 2, 0, 1], 0.5)", "f:2,3,4", method=E),),
    "conv1d": (S("F.conv1d(a, b, c, stride=2, padding=1, dilation=2)", X3, "f:6,4,3", "f:6"),),
    "conv2d": (S("F.conv2d(a, b, c, stride=(2, 1), padding=1, groups=2)", X4, "f:6,2,3,3", "f:6"),),
    "conv3d": (S("F.conv3d(a, b, c, padding=1)", X5, "f:3,2,3,3,3", "f:3"),),
    "conv_transpose1d": (S("F.conv_transpose1d(a, b, c, stride=2, padding=1)", X3, "f:4,3,3", "f:3"),),
    "conv_transpose2d": (S("F.conv_transpose2d(a, b, stride=2, padding=1, output_padding=1)", X4, "f:4,3,3,3"),),
    "conv_transpose3d": (S("F.conv_transpose3d(a, b, stride=2)", X5, "f:2,3,2,2,2"),),
    "convolution": (S("torch.ops.aten.convolution(a, b, c, [2, 2], [1, 1], [1, 2], False, [0, 0], 1)", X4,
                      "f:5,4,3,3", "f:5", method=E),),
    "cross_entropy": (S("F.cross_entropy(a, b, ignore_index=2, label_smoothing=0.1)", "f:6,5", "i5:6"),),
    "einsum": (S("torch.einsum('bij,bjk->bik', a, b)", "f:2,3,4", "f:2,4,5"),),
    "embedding": (S("F.embedding(b, a)", "f:7,4", "i7:2,3"),),
    "empty_like": (S("torch.where(a > -9, a, torch.empty_like(a))"),),
    "full": (S("a + torch.full((3, 4), 2.5)", method=E),),
    "gather": (S("torch.gather(a, 1, b)", "f:3,5", "i5:3,4"),),
    "ger": (S("torch.outer(a, b)", "f:3", "f:4"),),
    "getitem": (S("a[1:, None, ::2]", "f:4,5"),),
    "gru": (S("torch.gru(a, b, (c, c * 0.5, torch.zeros(9), torch.zeros(9)), True, 1, 0.0, False, False, True)",
              "f:2,4,3", "f:1,2,3", "f:9,3", method=E),),
    "gru_cell": (S("torch.gru_cell(a, b, c, c[:, :3] * 1.0)", "f:2,3", "f:2,3", "f:9,3", method=E),),
    "hardsigmoid_": (S("torch.ops.aten.hardsigmoid_(a * 1)"),),
    "hardswish_": (S("torch.ops.aten.hardswish_(a * 1)"),),
    "im2col": (S("F.unfold(a, 3, padding=1, stride=2)", X4, method=E),),
    "index": (S("a[b]", "f:5,3", "i5:4", method=E),),
    "index_add": (S("torch.index_add(a, 0, c, b)", "f:5,3", "f:4,3", "i5:4"),),
    "index_copy": (S("torch.index_copy(a, 0, c, b)", "f:5,3", "f:2,3", "i5:2"),),
    "index_fill": (S("torch.index_fill(a, 1, b, 2.0)", "f:3,5", "i5:2"),),
    "native_dropout": (S("torch.ops.aten.native_dropout(a, 0.5, False)[0]", "f:3,4", method=E),),
    "index_put": (S("torch.index_put(a, (c,), b, accumulate=True)", "f:5,3", "f:4,3", "i5:4"),),
    "index_select": (S("torch.index_select(a, 0, b)", "f:5,3", "i5:4"),),
    "instance_norm": (S("F.instance_norm(a, weight=b, bias=c)", X3, "f:4", "f:4"),),
    "upsample": (S("F.interpolate(a, scale_factor=2, mode='nearest')", X4),),
    "layer_norm": (S("F.layer_norm(a, (4, 5), b, c)", "f:3,4,5", "f:4,5", "f:4,5"),),
    "lerp": (S("torch.lerp(a, b, c)", "f:3,4", "f:3,4", "u:3,4"),),
    "linspace": (S("a * torch.linspace(0, 1, 4)", method=E),),
    "log_sigmoid_forward": (S("torch.ops.aten.log_sigmoid_forward(a)[0]", method=E),),
    "logical_or": (S("torch.logical_or(a, b)", "b:3,4", "b:3,4"),),
    "lstm": (S("torch.lstm(a, (b, b * 0.5), (c, c * 0.5, torch.zeros(12), torch.zeros(12)), True, 1, 0.0, "
               "False, False, True)", "f:2,4,3", "f:1,2,3", "f:12,3", method=E),),
    "lstm_cell": (S("torch.lstm_cell(a, (b, b * 0.5), c, c[:, :3] * 1.0)", "f:2,3", "f:2,3", "f:12,3",
                    method=E),),
    "masked_fill": (S("a.masked_fill(b, -1.5)", "f:3,4", "b:3,4"),),
    "max_pool2d": (S("F.max_pool2d(a, 3, stride=2, padding=1)", X4),),
    "max_pool2d_with_indices": (S("torch.ops.aten.max_pool2d_with_indices(a, [3, 3], [2, 2], [1, 1])", X4, method=E),),
    "max_pool3d": (S("F.max_pool3d(a, 2)", X5),),
    "max_pool3d_with_indices": (S("torch.ops.aten.max_pool3d_with_indices(a, [2, 2, 2], [2, 2, 2])[0]", X5, method=E),),
    "mish_": (S("torch.ops.aten.mish_(a * 1)"),),
    "native_batch_norm": (S("torch.ops.aten.native_batch_norm(a, b, c, None, None, True, 0.1, 1e-5)[0]",
                            "f:3,4,5", "f:4", "f:4", method=E),),
    "_native_batch_norm_legit_functional": (S("torch.ops.aten._native_batch_norm_legit_functional("
                                              "a, b, c, b.detach() * 0, b.detach() * 0 + 1, True, 0.1, 1e-5)[0]",
                                              "f:3,4,5", "f:4", "f:4", method=E),),
    "_native_batch_norm_legit_no_training": (S("torch.ops.aten._native_batch_norm_legit_no_training("
                                               "a, None, None, b.detach(), c.detach(), 0.1, 1e-5)[0]",
                                               "f:3,4,5", "f:4", "p:4", method=E),),
    "native_group_norm": (S("torch.ops.aten.native_group_norm(a, b, c, 2, 4, 9, 2, 1e-5)[0]", X3, "f:4", "f:4",
                            method=E),),
    "native_layer_norm": (S("torch.ops.aten.native_layer_norm(a, [5], b, c, 1e-5)[0]", "f:3,4,5", "f:5", "f:5",
                            method=E),),
    "nll_loss": (S("F.nll_loss(a, b, ignore_index=1)", "f:6,5", "i5:6"),),
    "nll_loss_forward": (S("torch.ops.aten.nll_loss_forward(a, b, None, 1, 1)", "f:6,5", "i5:6", method=E),),
    "one_hot": (S("F.one_hot(a, 6)", "i6:3,4"),),
    "or_": (S("__import__('operator').or_(a, b)", "b:3,4", "b:3,4"),),
    "pad": (S("F.pad(a, (1, 2, 2, 1), mode='reflect')", X4),),
    "_pad_circular": (S("torch.ops.aten._pad_circular(a, [1, 2])", X3, method=E),),
    "permute": (S("a.permute(2, 0, 1)", "f:2,3,4"),),
    "prelu": (S("F.prelu(a, b)", "f:2,3,4", "f:3"),),
    "_prelu_kernel": (S("torch.ops.aten._prelu_kernel(a, b)", "f:4,3", "f:3", method=E),),
    "reflection_pad1d": (S("torch.ops.aten.reflection_pad1d(a, [2, 1])", X3, method=E),),
    "reflection_pad2d": (S("torch.ops.aten.reflection_pad2d(a, [2, 1, 1, 2])", X4, method=E),),
    "reflection_pad3d": (S("torch.ops.aten.reflection_pad3d(a, [1, 1, 1, 0, 0, 1])", X5, method=E),),
    "relu6_": (S("torch.ops.aten.relu6_(a * 1)"),),
    "repeat": (S("a.repeat(2, 1, 3)", "f:3,4"),),
    "replication_pad1d": (S("torch.ops.aten.replication_pad1d(a, [2, 1])", X3, method=E),),
    "replication_pad2d": (S("torch.ops.aten.replication_pad2d(a, [2, 1, 1, 2])", X4, method=E),),
    "replication_pad3d": (S("torch.ops.aten.replication_pad3d(a, [1, 1, 1, 0, 0, 1])", X5, method=E),),
    "view": (S("a.view(2, 6)"),),
    "rms_norm": (S("F.rms_norm(a, (5,), b)", "f:3,4,5", "f:5"),),
    "rnn_relu": (S("torch.rnn_relu(a, b, (c, c * 0.5, torch.zeros(3), torch.zeros(3)), True, 1, 0.0, "
                   "False, False, True)", "f:2,4,3", "f:1,2,3", "f:3,3", method=E),),
    "rnn_relu_cell": (S("torch.rnn_relu_cell(a, b, c, c * 0.5)", "f:2,3", "f:2,3", "f:3,3", method=E),),
    "rnn_tanh": (S("torch.rnn_tanh(a, b, (c, c * 0.5, torch.zeros(3), torch.zeros(3)), True, 1, 0.0, "
                   "False, False, True)", "f:2,4,3", "f:1,2,3", "f:3,3", method=E),),
    "rnn_tanh_cell": (S("torch.rnn_tanh_cell(a, b, c, c * 0.5)", "f:2,3", "f:2,3", "f:3,3", method=E),),
    "scalar_tensor": (S("a * torch.ops.aten.scalar_tensor(2.0)", method=E),),
    "scaled_dot_product_attention": (S("F.scaled_dot_product_attention(a, b, c, is_causal=True)",
                                       "f:2,2,5,4", "f:2,2,5,4", "f:2,2,5,4"),),
    "_scaled_dot_product_flash_attention": (S("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(a, b, c)[0]",
                                              "f:2,2,5,4", "f:2,2,5,4", "f:2,2,5,4", method=E),),
    "scatter": (S("torch.scatter(a, 1, b.argsort(1)[:, :2], c)", "f:3,5", "f:3,5", "f:3,2"),),
    "scatter_add": (S("torch.scatter_add(a, 1, b, c)", "f:3,5", "i5:3,4", "f:3,4"),),
    "scatter_reduce": (S("torch.scatter_reduce(a, 1, b, c, 'amax')", "f:3,5", "i5:3,4", "f:3,4"),),
    "selu_": (S("torch.ops.aten.selu_(a * 1)"),),
    "stack": (S("torch.stack([a, b], 1)", "f:3,4", "f:3,4"),),
    "take_along_dim": (S("torch.take_along_dim(a, b, 1)", "f:3,5", "i5:3,4"),),
    "_threshold": (S("F.threshold(a, 0.1, -2.0)"),),
    "threshold": (S("torch.threshold(a, 0.1, -2.0)"),),
    "threshold_": (S("torch.threshold_(a * 1, 0.1, -2.0)"),),
    "unflatten": (S("a.unflatten(1, (2, 2))"),),
    "unfold": (S("a.unfold(1, 3, 2)", "f:3,8"),),
    "upsample_bicubic2d": (S("F.interpolate(a, scale_factor=2, mode='bicubic')", X4, method=E),),
    "upsample_bilinear2d": (S("F.interpolate(a, size=(5, 11), mode='bilinear')", X4, method=E),),
    "upsample_linear1d": (S("F.interpolate(a, scale_factor=2, mode='linear')", X3, method=E),),
    "upsample_nearest1d": (S("F.interpolate(a, scale_factor=2)", X3, method=E),),
    "upsample_nearest2d": (S("F.interpolate(a, size=(5, 11))", X4, method=E),),
    "upsample_nearest3d": (S("F.interpolate(a, scale_factor=2)", X5, method=E),),
    "_upsample_nearest_exact1d": (S("F.interpolate(a, size=13, mode='nearest-exact')", X3, method=E),),
    "_upsample_nearest_exact2d": (S("F.interpolate(a, size=(5, 11), mode='nearest-exact')", X4, method=E),),
    "_upsample_nearest_exact3d": (S("F.interpolate(a, scale_factor=2, mode='nearest-exact')", X5, method=E),),
    "upsample_trilinear3d": (S("F.interpolate(a, scale_factor=2, mode='trilinear')", X5, method=E),),
    "where": (S("torch.where(c, a, b)", "f:3,4", "f:1,4", "b:3,1"),),
    "slice_scatter": (S("torch.slice_scatter(a, b, 1, 1, 3)", "f:3,5", "f:3,2"),),
    "select_scatter": (S("torch.select_scatter(a, b, 0, 1)", "f:3,5", "f:5"),),
    "copy": (S("(a * 1).copy_(b)", "f:3,4", "f:1,4"),),
    "fill": (S("(a * 1).fill_(2.0)"),),
    "empty": (S("torch.where(a > -9, a, a.new_empty((3, 4)))"),),
    "eye": (S("a * torch.eye(3, 4)", method=E),),
    "std": (S("torch.std(a, 1)"), S("torch.std(a, correction=0)")),
    "meshgrid": (S("torch.meshgrid([a, b], indexing='xy')", "f:3", "f:4"),),
    "_weight_norm": (S("torch._weight_norm(a, b, 0)", "f:4,3", "p:4,1"),),
}

# found by trying torch.{name}(a), a.{name}(), F.{name}(a), ... on each name of a group (fx unless said)
AUTO: dict[str, tuple[Sample, ...]] = {
    'abs': (S('torch.abs(a)', 'f:3,4'),),
    'adaptive_avg_pool1d': (S('torch.adaptive_avg_pool1d(a, 4)', X3),),
    'adaptive_max_pool1d': (S('torch.adaptive_max_pool1d(a, 4)', X3),),
    'add': (S('torch.add(a, b)', 'f:3,4', 'f:3,4'),),
    'alias': (S('torch.ops.aten.alias(a)', 'f:3,4', method=E),),
    'all': (S('torch.all(a)', 'f:3,4'),),
    'alpha_dropout': (S('torch.ops.aten.alpha_dropout(a, 0.5, False)', 'f:3,4', method=E),),
    'amax': (S('torch.amax(a)', 'f:3,4'),),
    'amin': (S('torch.amin(a)', 'f:3,4'),),
    'any': (S('torch.any(a)', 'f:3,4'),),
    'argmax': (S('torch.argmax(a)', 'f:3,4'),),
    'argmin': (S('torch.argmin(a)', 'f:3,4'),),
    'argsort': (S('torch.argsort(a)', 'f:3,4'),),
    'avg_pool1d': (S('torch.avg_pool1d(a, 3, 2, 1)', X3),),
    'binary_cross_entropy_with_logits': (S('torch.ops.aten.binary_cross_entropy_with_logits(a, b)', 'f:3,4', 'f:3,4',
                                           method=E),),
    'logical_xor': (S('torch.logical_xor(a, b)', 'f:3,4', 'f:3,4'),),
    'bitwise_xor': (S('torch.bitwise_xor(a, b)', 'b:3,4', 'b:3,4'),),
    'bool': (S('a.bool()', 'f:3,4'),),
    'broadcast_tensors': (S('torch.broadcast_tensors(a)', 'f:3,4'),),
    'byte': (S('a.byte()', 'f:3,4'),),
    'ceil': (S('torch.ceil(a)', 'f:3,4'),),
    'ceil_': (S('torch.ceil_(a * 1)', 'f:3,4'),),
    'celu': (S('torch.celu(a)', 'f:3,4'),),
    'celu_': (S('torch.celu_(a * 1)', 'f:3,4'),),
    'char': (S('a.char()', 'f:3,4'),),
    'chunk': (S('torch.chunk(a, 2, 1)', 'f:3,4'),),
    'clip': (S('torch.clamp(a, b)', 'f:3,4', 'f:3,4'),),
    'clamp_max': (S('torch.clamp_max(a, b)', 'f:3,4', 'f:3,4'),),
    'clamp_min': (S('torch.clamp_min(a, b)', 'f:3,4', 'f:3,4'),),
    'cos': (S('torch.cos(a)', 'f:3,4'),),
    'cross_entropy_loss': (S('torch.ops.aten.cross_entropy_loss(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'cumprod': (S('torch.cumprod(a, 1)', 'f:3,4'),),
    'cumsum': (S('torch.cumsum(a, 1)', 'f:3,4'),),
    'detach': (S('torch.detach(a)', 'f:3,4'),),
    'diff': (S('torch.diff(a)', 'f:3,4'),),
    'div': (S('torch.div(a, b)', 'f:3,4', 'f:3,4'),),
    'double': (S('a.double()', 'f:3,4'),),
    'dropout': (S('torch.ops.aten.dropout(a, 0.5, False)', 'f:3,4', method=E),),
    'elu': (S('F.elu(a)', 'f:3,4'),),
    'eq': (S('torch.eq(a, b)', 'f:3,4', 'f:3,4'),),
    'erf': (S('torch.erf(a)', 'f:3,4'),),
    'erfc': (S('torch.erfc(a)', 'f:3,4'),),
    'erfc_': (S('(a * 1).erfc_()', 'f:3,4'),),
    'exp': (S('torch.exp(a)', 'f:3,4'),),
    'exp2': (S('torch.exp2(a)', 'f:3,4'),),
    'exp2_': (S('(a * 1).exp2_()', 'f:3,4'),),
    'expand_as': (S('a.expand_as(b)', 'f:1,4', 'f:3,4'),),
    'expm1': (S('torch.expm1(a)', 'f:3,4'),),
    'expm1_': (S('(a * 1).expm1_()', 'f:3,4'),),
    'fix': (S('torch.fix(a)', 'f:3,4'),),
    'flatten': (S('torch.flatten(a)', 'f:3,4'),),
    'flip': (S('a.flip(1)', 'f:3,4'),),
    'float': (S('a.float()', 'f:3,4'),),
    'floor': (S('torch.floor(a)', 'f:3,4'),),
    'floor_': (S('torch.floor_(a * 1)', 'f:3,4'),),
    'floordiv': (S('torch.floor_divide(a, b)', 'f:3,4', 'f:3,4'),),
    'fmax': (S('torch.fmax(a, b)', 'f:3,4', 'f:3,4'),),
    'fmin': (S('torch.fmin(a, b)', 'f:3,4', 'f:3,4'),),
    'frac': (S('torch.frac(a)', 'f:3,4'),),
    'frac_': (S('torch.frac_(a * 1)', 'f:3,4'),),
    'full_like': (S('torch.full_like(a, 1)', 'f:3,4'),),
    'ge': (S('torch.ge(a, b)', 'f:3,4', 'f:3,4'),),
    'gelu': (S('F.gelu(a)', 'f:3,4'),),
    'glu': (S('F.glu(a)', 'f:3,4'),),
    'group_norm': (S('torch.group_norm(a, 2, b, c)', X3, 'f:4', 'f:4'),),
    'gt': (S('torch.gt(a, b)', 'f:3,4', 'f:3,4'),),
    'half': (S('a.half()', 'f:3,4'),),
    'hardsigmoid': (S('F.hardsigmoid(a)', 'f:3,4'),),
    'hardswish': (S('F.hardswish(a)', 'f:3,4'),),
    'hardtanh': (S('F.hardtanh(a)', 'f:3,4'),),
    'hardtanh_': (S('F.hardtanh_(a * 1)', 'f:3,4'),),
    'huber_loss': (S('torch.ops.aten.huber_loss(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'hypot': (S('torch.hypot(a, b)', 'f:3,4', 'f:3,4'),),
    'mul': (S('torch.mul(a, b)', 'f:3,4', 'f:3,4'),),
    'int': (S('a.int()', 'f:3,4'),),
    'isfinite': (S('torch.isfinite(a)', 'f:3,4'),),
    'isinf': (S('torch.isinf(a)', 'f:3,4'),),
    'isnan': (S('torch.isnan(a)', 'f:3,4'),),
    'sub': (S('torch.sub(a, b)', 'f:3,4', 'f:3,4'),),
    'kl_div': (S('torch.ops.aten.kl_div(a, b)', 'p:3,4', 'p:3,4', method=E),),
    'l1_loss': (S('torch.ops.aten.l1_loss(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'le': (S('torch.le(a, b)', 'f:3,4', 'f:3,4'),),
    'leaky_relu': (S('F.leaky_relu(a)', 'f:3,4'),),
    'leaky_relu_': (S('F.leaky_relu_(a * 1)', 'f:3,4'),),
    'norm': (S('torch.ops.aten.linalg_vector_norm(a)', 'f:3,4', method=E),),
    'linear': (S('torch.ops.aten.linear(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'log': (S('torch.log(a)', 'p:3,4'),),
    'log10': (S('torch.log10(a)', 'p:3,4'),),
    'log10_': (S('(a * 1).log10_()', 'p:3,4'),),
    'log1p': (S('torch.log1p(a)', 'p:3,4'),),
    'log1p_': (S('(a * 1).log1p_()', 'p:3,4'),),
    'log2': (S('torch.log2(a)', 'p:3,4'),),
    'log2_': (S('(a * 1).log2_()', 'p:3,4'),),
    'log_sigmoid': (S('torch.ops.aten.log_sigmoid(a)', 'f:3,4', method=E),),
    'log_softmax': (S('torch.ops.aten._log_softmax(a, 1, False)', 'f:3,4', method=E),),
    'logsumexp': (S('torch.logsumexp(a, 1)', 'f:3,4'),),
    'long': (S('a.long()', 'f:3,4'),),
    'lt': (S('torch.lt(a, b)', 'f:3,4', 'f:3,4'),),
    'max': (S('torch.max(a)', 'f:3,4'), S('torch.max(a, 1)', 'f:3,4')),
    'maximum': (S('torch.maximum(a, b)', 'f:3,4', 'f:3,4'),),
    'max_pool1d': (S('torch.max_pool1d(a, 3, 2, 1)', X3),),
    'max_pool1d_with_indices': (S('torch.max_pool1d_with_indices(a, 3, 2)', X3),),
    'mean': (S('torch.mean(a)', 'f:3,4'),),
    'min': (S('torch.min(a)', 'f:3,4'), S('torch.min(a, 0, keepdim=True)', 'f:3,4')),
    'minimum': (S('torch.minimum(a, b)', 'f:3,4', 'f:3,4'),),
    'mish': (S('F.mish(a)', 'f:3,4'),),
    'mod': (S('torch.remainder(a, b)', 'f:3,4', 'f:3,4'),),
    'mse_loss': (S('torch.ops.aten.mse_loss(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'nan_to_num': (S('torch.nan_to_num(a)', 'f:3,4'),),
    'ne': (S('torch.ne(a, b)', 'f:3,4', 'f:3,4'),),
    'neg': (S('torch.neg(a)', 'f:3,4'),),
    'ones': (S('a.new_ones(1)', 'f:3,4'),),
    'zeros': (S('a.new_zeros(1)', 'f:3,4'),),
    't': (S('torch.ops.aten.numpy_T(a)', 'f:3,4', method=E),),
    'ones_like': (S('torch.ones_like(a)', 'f:3,4'),),
    'pow': (S('torch.pow(a, b)', 'p:3,4', 'p:3,4'),),
    'prod': (S('torch.prod(a)', 'f:3,4'),),
    'reciprocal': (S('torch.reciprocal(a)', 'f:3,4'),),
    'relu': (S('torch.relu(a)', 'f:3,4'),),
    'relu6': (S('F.relu6(a)', 'f:3,4'),),
    'repeat_interleave': (S('torch.repeat_interleave(a, 2, dim=1)', 'f:3,4'),),
    'view_as': (S('a.view_as(b)', 'f:3,4', 'f:4,3'),),
    'roll': (S('torch.roll(a, 1)', 'f:3,4'), S('torch.roll(a, (1, -1), (1, 0))', 'f:3,4')),
    'round': (S('torch.round(a)', 'f:3,4'),),
    'round_': (S('torch.round_(a * 1)', 'f:3,4'),),
    'rsqrt': (S('torch.rsqrt(a)', 'p:3,4'),),
    'rsub': (S('torch.rsub(a, b)', 'f:3,4', 'f:3,4'),),
    'select': (S('torch.ops.aten.select(a, 1, False)', 'f:3,4', method=E),),
    'selu': (S('torch.selu(a)', 'f:3,4'),),
    'sgn': (S('torch.sgn(a)', 'f:3,4'),),
    'short': (S('a.short()', 'f:3,4'),),
    'sigmoid': (S('torch.sigmoid(a)', 'f:3,4'),),
    'silu': (S('F.silu(a)', 'f:3,4'),),
    'sin': (S('torch.sin(a)', 'f:3,4'),),
    'slice': (S('torch.ops.aten.slice(a, 1, 1, 4, 2)', 'f:3,4', method=E),),
    'narrow': (S('torch.ops.aten.narrow(a, 1, -3, 2)', 'f:3,4', method=E), S('a.narrow(0, 1, 2)', 'f:3,4')),
    'smooth_l1_loss': (S('torch.ops.aten.smooth_l1_loss(a, b)', 'f:3,4', 'f:3,4', method=E),),
    'softmax': (S('torch.ops.aten._softmax(a, 1, False)', 'f:3,4', method=E), S('F.softmax(a, 0)', 'f:3,4')),
    'softmin': (S('F.softmin(a)', 'f:3,4'),),
    'softplus': (S('F.softplus(a)', 'f:3,4'),),
    'softsign': (S('F.softsign(a)', 'f:3,4'),),
    'sort': (S('torch.sort(a, dim=0, descending=True)', 'f:3,4'),),
    'special_erfc': (S('torch.ops.aten.special_erfc(a)', 'f:3,4', method=E),),
    'split': (S('torch.split(a, [1, 3], 1)', 'f:3,4'),),
    'sqrt': (S('torch.sqrt(a)', 'p:3,4'),),
    'square': (S('torch.square(a)', 'f:3,4'),),
    'squeeze': (S('torch.squeeze(a)', 'f:3,4'),),
    'sum': (S('torch.sum(a)', 'f:3,4'),),
    'swapaxes': (S('torch.ops.aten.swapaxes(a, 1, False)', 'f:3,4', method=E),),
    'tanh': (S('torch.tanh(a)', 'f:3,4'),),
    'to': (S('torch.ops.aten._to_copy(a)', 'f:3,4', method=E),),
    'topk': (S('torch.topk(a, 2, dim=0)', 'f:3,4'),),
    'tril': (S('torch.tril(a)', 'f:3,4'),),
    'triu': (S('torch.triu(a)', 'f:3,4'),),
    'trunc': (S('torch.trunc(a)', 'f:3,4'),),
    'trunc_': (S('torch.trunc_(a * 1)', 'f:3,4'),),
    'type_as': (S('a.type_as(b)', 'f:3,4', 'd:3,4'),),
    'unbind': (S('torch.unbind(a)', 'f:3,4'),),
    'unsqueeze': (S('torch.unsqueeze(a, 1)', 'f:3,4'),),
    'var': (S('torch.var(a)', 'f:3,4'),),
    'zeros_like': (S('torch.zeros_like(a)', 'f:3,4'),),
}
SAMPLES: dict[str, tuple[Sample, ...]] = {**AUTO, **HAND}
_GROUPS = op_groups()


def samples_for(key: str) -> tuple[Sample, ...]:
    """The samples of the translation known as ``key``: those listed under any of its names (a
    group's key changes when a name joins it)."""
    return tuple(s for n in _GROUPS[key] for s in SAMPLES.get(n, ()))


def unsampled(key: str) -> str | None:
    """Why the translation known as ``key`` has no sample (:data:`NO_SAMPLE`), or None."""
    return next((NO_SAMPLE[n] for n in _GROUPS[key] if n in NO_SAMPLE), None)


# ---------------------------------------------------------------- the facts of one group


# the kinds that move or make data, listed after the kinds that compute (and not in the dims column
# when a computing kind is there)
_MOVES = ("reshape", "broadcast", "select", "concat", "cast", "fill", "input")
_ORDER = ("attention", "conv", "pool", "topk", "scatteradd", "gather", "sparseeinsum", "einsum") + _MOVES


def dims_text(texts: set[tuple[str, str]]) -> str:
    """The docs' decomposable-dims cell for a translation whose nodes have these (kind, split
    facts line) pairs: the lines of its computing kinds (of its first data-movement kind when it
    has none), the fullest line of each kind (a reducing einsum's over an elementwise one's)."""
    by_kind: dict[str, str] = {}
    for k, t in texts:
        if len(t) > len(by_kind.get(k, "")):
            by_kind[k] = t
    main = [k for k in _ORDER if k in by_kind and k not in _MOVES] or [k for k in _ORDER if k in by_kind][:1]
    if not main:
        return "— (no node: the input itself)"
    if len(main) == 1:
        return by_kind[main[0]]
    return "; ".join(f"{k}: {by_kind[k]}" for k in main)


def kinds_of(key: str, runs: list[Run]) -> tuple[list[Call], frozenset[str]]:
    f = aten.OPS[key]
    calls = [c for r in runs for c in r.calls.get(f, [])]
    return calls, frozenset(k for c in calls for k in c.kinds)


def grad_verdict(key: str, runs: list[Run], devices: int | None = 2) -> str:
    """``yes`` when ej.grad of every sample equals torch.autograd; else why not."""
    calls, _ = kinds_of(key, runs)
    if not any(c.float_in for c in calls):
        return "—, no float input"
    if not any(c.float_out for c in calls):
        return "—, integer output"
    nonzero = False
    for r in runs:
        try:
            nonzero |= check_grad(r, devices=devices, what=key)
        except ej.EinjoinError as e:  # its first clause: "floordiv has no derivative"
            return "—, " + str(e).splitlines()[0].split(" (")[0].split(";")[0][:100]
    return "yes" if nonzero else "yes (zero, as torch)"


def observe(key: str) -> dict[str, Any]:
    """The facts of group ``key`` as its samples show them: kinds, dims, grad."""
    why = unsampled(key)
    if why:
        return {"kinds": (), "dims": "—", "grad": "—", "note": f"not sampled: {why}"}
    samples = samples_for(key)
    runs = [run_sample(s) for s in samples]
    calls, kinds = kinds_of(key, runs)
    assert calls, f"the samples of {key} never reach its translation"
    texts = {t for c in calls for t in c.texts}
    return {"kinds": tuple(k for k in _ORDER if k in kinds), "dims": dims_text(texts),
            "grad": grad_verdict(key, runs), "note": ""}


def render(facts: dict[str, dict[str, Any]]) -> str:
    """``facts`` as the text of ``einjoin/frontend/op_facts.json``: one op group a line."""
    import json
    rows = [f"  {json.dumps(k)}: {json.dumps({n: v for n, v in f.items() if n != 'note' or v}, ensure_ascii=False)}"
            for k, f in facts.items()]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def main() -> None:
    import warnings
    warnings.filterwarnings("ignore")
    keys = sys.argv[1:] or list(op_groups())
    facts = {}
    for key in keys:
        try:
            facts[key] = observe(key)
        except Exception as e:  # every failure at once, on stderr
            print(f"{key}: {type(e).__name__}: {str(e)[:400]}", file=sys.stderr)
    sys.stdout.write(render(facts))


if __name__ == "__main__":
    main()
