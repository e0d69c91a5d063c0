"""Issue 33 (session 33, H7): a hostile hunt for wrong answers and raw errors in the paths users
hit first: ``ej.einsum``, the Tensor API and ``ej.from_torch``, compared with torch and numpy.
Each test here failed before its fix."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.ir.dtypes import numpy_dtype
from tests.budget import examples

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "bool"]
TORCH = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
         "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}


def _value(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return torch.from_numpy(np.asarray(rng.random(shape) > 0.5))
    if dtype == "int64":
        return torch.from_numpy(np.asarray(rng.integers(-7, 8, shape)))
    return torch.from_numpy(np.asarray(rng.standard_normal(shape) * 3)).to(TORCH[dtype])


def _feed(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(numpy_dtype("bfloat16"))
    return t.numpy()


def _same(got: object, want: torch.Tensor, tol: float = 1e-2) -> None:
    g = torch.as_tensor(np.asarray(got).astype(np.float64)) if np.asarray(got).dtype.kind == "V" \
        else torch.as_tensor(np.asarray(got))
    assert str(np.asarray(got).dtype) == str(want.dtype).removeprefix("torch."), (got, want)
    assert tuple(g.shape) == tuple(want.shape)
    assert torch.allclose(g.double(), want.double(), atol=tol, rtol=tol, equal_nan=True), (g, want)


class _Fn(torch.nn.Module):
    def __init__(self, f, **buffers):  # type: ignore[no-untyped-def]
        super().__init__()
        self.f = f
        for k, v in buffers.items():
            self.register_buffer(k, v)

    def forward(self, *args):  # type: ignore[no-untyped-def]
        return self.f(self, *args)


def _torch_check(module: torch.nn.Module, args: tuple, tol: float = 1e-5) -> None:
    want = module.eval()(*args)
    fn = ej.from_torch(module, args)
    for devices in (1, 2):
        got = ej.compile(fn, devices=devices).run(*args)
        assert got.dtype == want.dtype, (devices, got.dtype, want.dtype)
        assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol), devices


# ---- finding 1: a 0-d tensor beside tensors with dims promoted like one of them (float32 data
# times a float64 0-d tensor gave float64, torch float32; float16 data times a float32 0-d gave
# float32, torch float16)

def test_a_zero_dim_tensor_promotes_as_in_torch() -> None:
    ops = [lambda x, y: x + y, lambda x, y: y * x,
           lambda x, y: (ej if isinstance(x, ej.Tensor) else torch).maximum(x, y)]
    for i, (d1, d2) in enumerate(itertools.product(DTYPES, DTYPES)):  # every pair, 1.5 s
        a, b = _value((3,), d1, i), _value((), d2, i + 1)
        op = ops[i % len(ops)]
        want = op(a, b)
        x, y = ej.input("x", (3,), d1), ej.input("c", (), d2)
        out = op(x, y)
        assert out.dtype == str(want.dtype).removeprefix("torch."), (d1, d2)
        _same(ej.reference(out, x=_feed(a), c=_feed(b)), want)


def test_zero_dim_buffers_and_arguments_of_an_imported_module_keep_the_datas_dtype() -> None:
    x = torch.randn(3, 4)
    _torch_check(_Fn(lambda s, x: x * s.c, c=torch.tensor(2.5, dtype=torch.float64)), (x,))
    _torch_check(_Fn(lambda s, x: x * s.c, c=torch.tensor(2.5)), (x.half(),), tol=1e-2)
    _torch_check(_Fn(lambda s, x, c: x + c.sum()), (x, torch.randn(3, dtype=torch.float64)))
    _torch_check(_Fn(lambda s, x, c: x + c), (torch.arange(4), torch.tensor(1.5).half()), tol=1e-2)


# ---- finding 2: softmax's dtype argument was dropped on import (torch.softmax(x, -1,
# dtype=torch.float32) of half data gave float16; log_softmax to float64 gave float32)

def test_softmax_and_log_softmax_dtype_arguments_import() -> None:
    x = torch.randn(3, 50) * 10
    _torch_check(_Fn(lambda s, x: torch.softmax(x, -1, dtype=torch.float32)), (x.half(),))
    _torch_check(_Fn(lambda s, x: F.log_softmax(x, -1, dtype=torch.float64)), (x,))
    _torch_check(_Fn(lambda s, x: x.softmax(0)), (x.half(),), tol=1e-2)


# ---- finding 3: reductions over dim=() reduced nothing (torch: every dim), and a 0-d tensor
# refused dim=0 / dim=-1 (torch takes them)

@pytest.mark.parametrize("red", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_an_empty_dim_list_reduces_every_dim_as_in_torch(red: str, keepdim: bool) -> None:
    t = _value((3, 4), "float32", 3)
    tname = {"max": "amax", "min": "amin"}.get(red, red)
    want = getattr(t, tname)(dim=(), keepdim=keepdim)
    x = ej.input("x", (3, 4))
    out = getattr(x, red)(dim=(), keepdim=keepdim)
    _same(ej.reference(out, x=t.numpy()), want, 1e-5)
    _same(ej.compile(out, devices=2).run(x=t.numpy()), want, 1e-5)


@pytest.mark.parametrize("red", ["sum", "mean", "max", "min", "prod"])
def test_a_zero_dim_tensor_reduces_over_dim_0_or_minus_1(red: str) -> None:
    x = ej.input("x", ())
    for dim, keepdim in itertools.product((0, -1, [0]), (False, True)):
        out = getattr(x, red)(dim, keepdim)
        t = torch.tensor(1.5)
        tname = {"max": "amax", "min": "amin"}.get(red, red)
        want = getattr(t, tname)(dim, keepdim=keepdim) if red != "prod" else t.prod(0, keepdim)
        _same(ej.reference(out, x=np.float32(1.5)), want, 1e-6)
    with pytest.raises(ej.ShapeError):
        x.sum(1)


# ---- finding 4: einsum refused a label of size 1 in one operand and n in another
# ('ij,ij->ij' of (2, 1) and (1, 3); 'ij,jk->ik' of (2, 1) and (3, 4)), which numpy and
# torch.einsum broadcast; now squeezed away as numpy does

@st.composite
def _broadcast_einsums(draw: st.DrawFn) -> tuple[str, list[tuple[int, ...]]]:
    labels = draw(st.lists(st.sampled_from("abcdE"), min_size=1, max_size=4, unique=True))
    size = {lab: draw(st.sampled_from([2, 3])) for lab in labels}
    terms, shapes = [], []
    for _ in range(draw(st.integers(1, 3))):
        ls = draw(st.lists(st.sampled_from(labels), min_size=0, max_size=3, unique=True))
        terms.append("".join(ls))
        shapes.append(tuple(draw(st.sampled_from([1, size[lab]])) for lab in ls))
    out = draw(st.lists(st.sampled_from(sorted(set("".join(terms)))), unique=True, max_size=3)) \
        if "".join(terms) else []
    return ",".join(terms) + "->" + "".join(out), shapes


@given(_broadcast_einsums(), st.integers(0, 2 ** 16))
@settings(max_examples=examples(160), deadline=None)
def test_einsum_broadcasts_size_one_labels_as_numpy(case: tuple[str, list[tuple[int, ...]]],
                                                   seed: int) -> None:
    eq, shapes = case
    rng = np.random.default_rng(seed)
    xs = [np.asarray(rng.standard_normal(s)) for s in shapes]
    ins = [ej.input(f"x{i}", s, "float64") for i, s in enumerate(shapes)]
    want = np.asarray(np.einsum(eq, *xs))
    out = ej.einsum(eq, *ins)
    feeds = {f"x{i}": x for i, x in enumerate(xs)}
    np.testing.assert_allclose(ej.reference(out, **feeds), want, atol=1e-12)
    assert torch.allclose(torch.einsum(eq, *map(torch.from_numpy, xs)), torch.from_numpy(want))


def test_einsum_broadcasting_compiles_and_imports() -> None:
    a, b = torch.randn(2, 1), torch.randn(3, 4)
    x, y = ej.input("x", (2, 1)), ej.input("y", (3, 4))
    got = ej.compile(ej.einsum("ij,jk->ik", x, y), devices=2).run(x=a.numpy(), y=b.numpy())
    np.testing.assert_allclose(got, torch.einsum("ij,jk->ik", a, b).numpy(), rtol=1e-5)
    _torch_check(_Fn(lambda s, x, y: torch.einsum("ij,ij->ij", x, y)), (a, torch.randn(1, 5)))
    _torch_check(_Fn(lambda s, x, y: torch.einsum("ii,i->i", x, y)), (torch.randn(1, 1), b[0]))
    with pytest.raises(ej.ShapeError):  # a diagonal's sizes must agree, as torch says
        ej.einsum("ij,ij->ij", ej.input("x", (2, 1)), ej.input("z", (3, 2)))


# ---- finding 5: Tensor x[i] with a negative index tensor was a run-time "index -1 out of
# range" (torch counts from the end, as imports already did), and x[:, i] was refused

def test_tensor_indexing_with_index_tensors_follows_torch() -> None:
    t, iv = torch.randn(3, 4, 5), torch.tensor([-1, 2])
    x, i = ej.input("x", (3, 4, 5)), ej.input("i", (2,), "int64")
    cases = [lambda x, i: x[i], lambda x, i: x[1, :, i], lambda x, i: x[..., i],
             lambda x, i: x[i, ..., i], lambda x, i: x[:, i, i], lambda x, i: x[i, 1:3]]
    outs = [f(x, i) for f in cases]
    got = ej.compile(outs, devices=2).run(x=t.numpy(), i=iv.numpy())
    for f, g, r in zip(cases, got, ej.reference(outs, x=t.numpy(), i=iv.numpy())):
        assert np.array_equal(g, f(t, iv).numpy()) and np.array_equal(r, g)
    with pytest.raises(ej.EinjoinError, match="out of range"):  # as torch: an error at run time
        ej.reference(x[i], x=t.numpy(), i=np.array([3, 0]))
    with pytest.raises(ej.UnsupportedOpError, match="data-dependent"):
        x[ej.input("m", (3, 4, 5), "bool")]


# ---- finding 6: half-precision norms and deviations squared in half: x.norm() of float16
# [300] * 10 was inf (torch 948.7), x.std() of [-300, 300, 0] inf (torch 300), F.normalize
# of such rows garbage; linalg.vector_norm's dtype argument was dropped

def test_half_norms_and_deviations_compute_in_float32_as_torch() -> None:
    big = torch.full((2, 10), 300.0).half()
    big[0, 0] = 1.0
    dev = torch.tensor([[-300.0, 300.0, 0.0], [1000.0, 1000.5, 1001.0]])
    _torch_check(_Fn(lambda s, x: x.norm(dim=-1)), (big,), tol=1e-3)
    _torch_check(_Fn(lambda s, x: torch.linalg.vector_norm(x, 3, dim=-1)), (big.bfloat16(),), tol=1e-2)
    _torch_check(_Fn(lambda s, x: F.normalize(x, dim=-1)), (big,), tol=1e-3)
    _torch_check(_Fn(lambda s, x: x.std(-1)), (dev.half(),), tol=1e-3)
    _torch_check(_Fn(lambda s, x: x.var(-1, correction=0)), (dev.bfloat16(),), tol=1e-2)
    _torch_check(_Fn(lambda s, x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)), (big,))


# ---- finding 7: softmax / log_softmax of a float16 row longer than 65504 summed its exps in
# float16: the sum overflowed, softmax gave 0 everywhere (torch 1/n), log_softmax -inf

def test_softmax_of_a_float16_row_longer_than_65504_sums_in_float32() -> None:
    t = torch.randn(1, 70000)
    x = ej.input("x", (1, 70000), "float16")
    outs = [ej.softmax(x, -1), ej.log_softmax(x, -1)]
    got = ej.reference(outs, x=t.half().numpy())
    wants = [t.half().float().softmax(-1).half(), t.half().float().log_softmax(-1).half()]
    for g, w in zip(got, wants):  # torch's float32 arithmetic (as on a GPU), rounded once
        _same(g, w, 1e-3)


# ---- finding 8: numpy took a lazy Tensor for a sequence: np.asarray(x) was an object array of
# 0-d tensors, np.add(x, 1) an object array of per-element graphs (silently); float(x),
# int(x), math.exp(x), [..][x] were raw TypeErrors

def test_numpy_and_python_conversions_of_a_lazy_tensor_are_refused_or_build_the_graph() -> None:
    x, s = ej.input("x", (3,)), ej.input("s", ())
    v = np.array([1.0, 2.0, np.nan], np.float32)
    for f in (lambda: np.asarray(x), lambda: np.array([x, x]), lambda: float(s), lambda: int(s),
              lambda: [1, 2, 3][s], lambda: np.einsum("i->", x)):
        with pytest.raises(ej.EinjoinError, match="lazy"):
            f()
    with pytest.raises(ej.EinjoinError, match="ndarray"):
        np.ones(3) + x
    for f in (lambda: np.add.accumulate(x), lambda: np.arctan2(x, x)):
        with pytest.raises(ej.UnsupportedOpError, match="accumulate|arctan2"):
            f()
    outs = [np.add(x, 1), np.exp(x), np.float32(2) * x, np.float64(2) > x, np.maximum(x, np.float16(1.5)),
            np.float16(3) - x]
    want = [v + 1, np.exp(v), 2 * v, 2 > v, np.maximum(v, 1.5), 3 - v]
    for o, w, r in zip(outs, want, ej.compile(outs, devices=2).run(x=v)):
        assert o.dtype == str(np.asarray(w).dtype) or (o.dtype, w.dtype) == ("float32", np.float64)
        np.testing.assert_allclose(r, w, rtol=1e-6)
