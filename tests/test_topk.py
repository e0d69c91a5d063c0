"""topk / sort / argsort (the TopK node kind) against torch: random ranks, dims, k and
direction, blocked under random specs (every label may be cut: a cut of the sorted dim
replicates its rows) and on 2 devices; ties in a stable order (the oracle's); gradients of the
values against torch autograd; from_torch of torch.topk / sort / argsort and a top-2 router."""

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
from einjoin.frontend.sorting import argsort, sort, topk
from graphgen import oracle

FAST = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return dict(shape=shape, dim=dim, k=draw(st.integers(0, shape[dim])), largest=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def _specs(outs: list[ej.Tensor], rng: np.random.Generator) -> dict[ej.Node, dict[str, int]]:
    return {t.node: {lab: int(rng.integers(1, min(3, n) + 1)) for lab, n in label_sizes(t.node).items() if n}
            for t in outs}


@given(cases())
@FAST
def test_topk_equals_torch(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.permutation(int(np.prod(c["shape"]))).reshape(c["shape"]).astype("float64")  # distinct values
    x = ej.input("x", X.shape, "float64")
    v, i = topk(x, c["k"], c["dim"], c["largest"])
    tv, ti = torch.topk(torch.tensor(X), c["k"], c["dim"], c["largest"])
    for got in (ej.reference([v, i], x=X), ej.execute_blocked([v, i], _specs([v, i], rng), x=X),
                ej.compile([v, i], devices=2, quiet=True).run(x=X)):
        np.testing.assert_array_equal(got[0], tv.numpy())
        np.testing.assert_array_equal(got[1], ti.numpy())


@given(cases())
@FAST
def test_sort_and_argsort_with_ties_are_stable(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.integers(0, 3, c["shape"]).astype("float32")  # many ties
    x = ej.input("x", X.shape, "float32")
    v, i = sort(x, c["dim"], descending=c["largest"])
    a = argsort(x, c["dim"], descending=c["largest"])
    want = oracle([v, i, a], dict(x=X))
    got = ej.execute_blocked([v, i, a], _specs([v, i, a], rng), x=X)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    tv, ti = torch.sort(torch.tensor(X), dim=c["dim"], descending=c["largest"], stable=True)
    np.testing.assert_array_equal(got[0], tv.numpy())
    np.testing.assert_array_equal(got[1], ti.numpy())


@given(cases())
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
def test_topk_values_gradient_equals_torch_autograd(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    X = rng.permutation(int(np.prod(c["shape"]))).reshape(c["shape"]).astype("float64") / 7
    x = ej.input("x", X.shape, "float64")
    v, _ = topk(x, c["k"], c["dim"], c["largest"])
    G = rng.standard_normal(v.shape)
    g = ej.input("g", v.shape, "float64")
    (dx,) = ej.grad((v * ej.exp(v) * g).sum(), [x])
    tx = torch.tensor(X, requires_grad=True)
    tv = torch.topk(tx, c["k"], c["dim"], c["largest"])[0]
    (tv * torch.exp(tv) * torch.tensor(G)).sum().backward()
    assert tx.grad is not None
    np.testing.assert_allclose(ej.compile(dx, devices=2, quiet=True).run(x=X, g=G), tx.grad.numpy(), rtol=1e-12)


def test_nan_is_the_largest_as_in_torch() -> None:
    X = np.array([[1.0, np.nan, 3.0, -1.0]], np.float32)
    x = ej.input("x", X.shape)
    for largest in (True, False):
        v, i = topk(x, 2, largest=largest)
        tv, ti = torch.topk(torch.tensor(X), 2, largest=largest)
        got = ej.reference([v, i], x=X)
        np.testing.assert_array_equal(got[0], tv.numpy())
        np.testing.assert_array_equal(got[1], ti.numpy())


def test_bfloat16_values_are_exact() -> None:
    X = torch.randn(3, 9).to(torch.bfloat16)
    x = ej.input("x", X.shape, "bfloat16")
    v, i = topk(x, 4)
    got = ej.reference([v, i], x=X.float().numpy().astype(ej.ir.dtypes.numpy_dtype("bfloat16")))
    tv, ti = torch.topk(X, 4)
    np.testing.assert_array_equal(got[0].astype(np.float32), tv.float().numpy())
    np.testing.assert_array_equal(got[1], ti.numpy())


class _Router(torch.nn.Module):
    """An MoE-style top-2 router: softmax gates of the two best experts, their ids, and sorts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.gate(x)
        w, idx = torch.topk(logits, 2, dim=-1)
        order = torch.argsort(logits, dim=0, descending=True)
        s, j = logits.sort(dim=-1)
        return torch.softmax(w, dim=-1), idx, order, s, j


def test_fx_reads_the_named_fields_values_and_indices() -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = torch.sort(x, dim=0)
            t = x.topk(2)
            return s.values + s.indices + t.values.sum() + t.indices.sum()

    x = torch.randn(4, 5)
    got = ej.compile(ej.from_torch(M(), (x,), method="fx"), devices=2, quiet=True).run(x)
    torch.testing.assert_close(got, M()(x))


@pytest.mark.parametrize("devices", [1, 2])
def test_from_torch_top2_router(devices: int) -> None:
    torch.manual_seed(0)
    m = _Router().eval()
    x = torch.randn(5, 8)
    got = ej.compile(ej.from_torch(m, (x,)), devices=devices, quiet=True).run(x)
    for g, w in zip(got, m(x)):
        if w.dtype == torch.int64:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w.detach(), rtol=1e-6, atol=1e-6)


def test_topk_errors_name_the_argument() -> None:
    x = ej.input("x", (3, 4))
    with pytest.raises(ShapeError, match=r"topk of input \(3, 4\).*k=5"):
        topk(x, 5)
    with pytest.raises(ShapeError, match="dim 2 out of range"):
        topk(x, 1, dim=2)
    with pytest.raises(DTypeError, match="bool"):
        topk(ej.input("b", (3,), "bool"), 1)
    assert "topk[dim=1, k=2, smallest, indices](x)" in str(ej.Graph(topk(x, 2, largest=False)[1]))


def test_a_gather_of_a_0d_index_from_a_row_split_table() -> None:
    """ir.kernels.gather_kernel on a 0-d index block of a table cut in rows (the unbatched
    cross_entropy pattern): a 0-d array, not a numpy scalar the masking cannot assign to."""
    for T in (np.arange(6.0), np.arange(12.0).reshape(6, 2)):
        t, i = ej.input("t", T.shape, "float64"), ej.input("i", (), "int64")
        y = ej.gather(t, i)
        for row in (1, 4):
            got = ej.execute_blocked(y, {y.node: {"row": 2}}, t=T, i=np.array(row))
            np.testing.assert_array_equal(got, T[row])
