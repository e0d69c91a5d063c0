"""Causal and sliding-window attention as block sparsity (issue 24): the Attention node's
``window``, its banded kernel (query rows by blocks, each over only the keys its mask allows),
its decomposition (a query block reads only its band of k and v) and its flops, against torch's
scaled_dot_product_attention with the equivalent dense boolean mask."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
import einjoin.ir.attention as attn
from einjoin.decomp.flops import kernel_flops
from einjoin.errors import EinjoinError
from einjoin.frontend.composites import fused_attention
from einjoin.ir.attention import attention_node, band_pairs
from einjoin.ir.dtypes import numpy_dtype


def _dense_mask(L: int, S: int, window: int | None) -> np.ndarray:
    """torch's equivalent boolean mask: key j for query i where j <= i (and i - j < window)."""
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    allowed = j <= i
    return allowed if window is None else allowed & (i - j < window)


def _want(q, k, v, window, m=None):
    allowed = torch.tensor(_dense_mask(q.shape[-2], k.shape[-2], window))
    if m is not None:
        allowed = allowed & torch.tensor(m)
    t = [torch.tensor(np.asarray(x, np.float64)) for x in (q, k, v)]
    out = TF.scaled_dot_product_attention(*t, attn_mask=allowed)
    return np.nan_to_num(out.numpy())  # a query with no allowed key: zeros, as einjoin's


def _inputs(batch, L, S, E, dtype, seed):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(batch + (n, E)).astype(np.float32) for n in (L, S, S)]
    return [x.astype(numpy_dtype(dtype)) for x in xs]


def _tol(dtype):
    return (1e-4, 1e-5) if dtype == "float32" else (0, 3e-2)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_banded_blocks_match_torch_with_a_dense_mask(data):
    """Random shapes (the sequence no multiple of the block), windows, row cuts, float32 and
    bfloat16: each query block over only its band of keys gives the dense masked values."""
    blk = data.draw(st.sampled_from([2, 3, 4]), label="block")
    L = data.draw(st.integers(1, 13), label="L")
    S = data.draw(st.sampled_from([L, max(1, L - 2), L + 3]), label="S")
    window = data.draw(st.sampled_from([None, 1, 2, 5, 40]), label="window")
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    batch = (2, 2)
    q, k, v = _inputs(batch, L, S, 4, dtype, data.draw(st.integers(0, 99), label="seed"))
    out = fused_attention(*(ej.input(n, x.shape, dtype) for n, x in zip("qkv", (q, k, v))), causal=True,
                          window=window)
    spec = {lab: data.draw(st.integers(1, size), label=lab)
            for lab, size in ej.decomp.spec.label_sizes(out.node).items() if size}
    with mock.patch.object(attn, "BLOCK", blk):
        got = ej.execute_blocked([out], {out.node: spec}, q=q, k=k, v=v)[0]
    want = _want(*(np.asarray(x, np.float32) for x in (q, k, v)), window)
    rtol, atol = _tol(dtype)
    assert np.asarray(got).dtype == numpy_dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [None, 100, 7])
def test_a_real_block_size_with_a_tail_and_a_mask(dtype, window):
    """128-row blocks on 300 queries (a tail of 44), rows cut in two for two devices, a user's
    bool mask on top of the window."""
    q, k, v = _inputs((1, 2), 300, 300, 16, dtype, 0)
    m = np.random.default_rng(1).random((1, 1, 300, 300)) > 0.2
    tq, tk, tv = (ej.input(n, x.shape, dtype) for n, x in zip("qkv", (q, k, v)))
    out = fused_attention(tq, tk, tv, ej.input("m", m.shape, "bool"), causal=True, window=window)
    got = ej.compile(out, devices=ej.local(2)).run(q=q, k=k, v=v, m=m)
    want = _want(*(np.asarray(x, np.float32) for x in (q, k, v)), window, m)
    rtol, atol = _tol(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


def test_gradients_of_a_window_match_torch_autograd():
    q, k, v = _inputs((2,), 9, 9, 4, "float32", 3)
    g = np.random.default_rng(4).standard_normal((2, 9, 4)).astype(np.float32)
    tq, tk, tv = (ej.input(n, x.shape) for n, x in zip("qkv", (q, k, v)))
    out = ej.attention(tq, tk, tv, causal=True, window=3)
    grads = ej.grad((out * ej.input("g", g.shape)).sum(), [tq, tk, tv])
    got = ej.compile([out, *grads], devices=ej.local(2)).run(q=q, k=k, v=v, g=g)
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    want = TF.scaled_dot_product_attention(*leaves, attn_mask=torch.tensor(_dense_mask(9, 9, 3)))
    wgrads = torch.autograd.grad(want, leaves, torch.tensor(g, dtype=torch.float64))
    for a, b in zip(got, [want.detach(), *wgrads]):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=1e-4, atol=1e-5)


def test_the_torch_backend_runs_the_same_banded_kernels():
    q, k, v = _inputs((2,), 20, 20, 4, "float32", 5)
    out = ej.attention(*(ej.input(n, x.shape) for n, x in zip("qkv", (q, k, v))), causal=True, window=5)
    with mock.patch.object(attn, "BLOCK", 4):
        threads = ej.compile(out, devices=ej.local(2)).run(q=q, k=k, v=v)
        on_torch = ej.compile(out, devices=ej.local(2), backend="torch").run(q=q, k=k, v=v)
    np.testing.assert_allclose(np.asarray(on_torch), np.asarray(threads), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(threads), _want(q, k, v, 5), rtol=1e-4, atol=1e-5)


def test_flops_count_only_the_blocks_the_mask_allows():
    """The issue's case (seq 8192, 8 heads of 64, 128-blocks): causal ~0.5 of the dense pairs, a
    1024 window ~0.13, and the same whatever the query rows' cut."""
    q = ej.input("q", (1, 8, 8192, 64))
    dense = fused_attention(q, q, q).node
    causal = fused_attention(q, q, q, causal=True).node
    windowed = fused_attention(q, q, q, causal=True, window=1024).node

    def flops(node, rows=1):
        d = ej.decompose(node, {"c": rows})
        return sum(kernel_flops(d, k.index) for k in d.kernels)

    full = flops(dense)
    assert full == 2 * 8 * 8192 * 8192 * 128
    assert flops(causal) / full == pytest.approx(0.5, abs=1e-3)
    # 128-row blocks over their bands (the first: torch's own causal skip, the exact triangle)
    assert flops(causal, 64) / full == pytest.approx((128 * 129 // 2 + 128 * 128 * 2079) / 8192 ** 2)
    assert flops(windowed) == flops(windowed, 8) == 2 * 8 * 128 * band_pairs(0, 8192, 1024, 8192)
    assert flops(windowed) / full < 0.14


def test_bad_windows_are_refused():
    q = ej.input("q", (2, 4, 8)).node
    for window, text in [(0, ">= 1"), (-3, ">= 1"), (2.5, "an int"), (True, "an int"), ("4", "an int")]:
        with pytest.raises(EinjoinError, match=text):
            attention_node(q, q, q, causal=True, window=window)
    with pytest.raises(EinjoinError, match="needs causal=True"):
        attention_node(q, q, q, window=4)
    kv = ej.input("kv", (2, 6, 8))
    with pytest.raises(EinjoinError, match="window=2 with 4 queries and 6 keys"):
        ej.attention(ej.Tensor(q), kv, kv, window=2)


def test_the_window_is_printed_and_kept_by_the_gradient():
    q = ej.input("q", (2, 4, 8))
    out = ej.attention(q, q, q, causal=True, window=2)
    assert "window=2" in repr(out.node.op) and "window=2" in str(ej.Graph(out))
    (gq,) = ej.grad(out.sum(), [q])
    grads = [n for n in ej.Graph(gq).ops if n.kind == "attentiongrad"]
    assert grads and all(n.op.window == 2 for n in grads)
    assert "window" not in repr(ej.attention(q, q, q).node.op)  # the common node prints as before


@pytest.mark.parametrize("lo, window", [(-2, 3), (-6, None), (-1, 2)])
def test_an_imported_sliding_window_mask_becomes_the_window(lo, window):
    """A torch model with Mistral's sliding-window mask as a bool tensor (tril & triu) imports as an
    attention with causal=True and that window, the mask dropped (its query blocks then read only
    their band), and equals torch; ej.attention(window=) gives the same values."""
    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[-2]
            ones = torch.ones(n, n, dtype=torch.bool, device=q.device)
            return TF.scaled_dot_product_attention(q, k, v, attn_mask=ones.tril() & ones.triu(lo))

    xs = [torch.randn(1, 2, 7, 4) for _ in range(3)]
    fn = ej.from_torch(Block(), tuple(xs))
    (node,) = [n for n in ej.Graph(list(fn.outputs)).ops if n.kind == "attention"]
    assert len(node.inputs) == 3 and node.op.causal and node.op.window == window
    want = Block()(*xs).numpy()
    np.testing.assert_allclose(np.asarray(fn.reference(*xs)), want, rtol=1e-5, atol=1e-5)
    if window is None:
        return
    tq, tk, tv = (ej.input(n, (1, 2, 7, 4)) for n in "qkv")
    got = ej.reference(ej.attention(tq, tk, tv, causal=True, window=window),
                       **{n: x.numpy() for n, x in zip("qkv", xs)})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, ev, masked", [(1, 4, False), (5, 4, True), (5, 3, False)])
def test_banded_gradients_by_blocks_match_torch_autograd(window, ev, masked):
    """dq, dk, dv by 4-row blocks over their bands (E == Ev; a user's additive mask too), or the
    dense masked backward (Ev != E: torch's math kernel), equal autograd of the dense mask."""
    rng = np.random.default_rng(window + ev)
    q, k = (rng.standard_normal((2, 13, 4)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 13, ev)).astype(np.float32)
    m = rng.standard_normal((2, 13, 13)).astype(np.float32) if masked else None
    g = rng.standard_normal((2, 13, ev)).astype(np.float32)
    tq, tk, tv = (ej.input(n, x.shape) for n, x in zip("qkv", (q, k, v)))
    tm = ej.input("m", (2, 13, 13)) if masked else None
    out = fused_attention(tq, tk, tv, tm, causal=True, window=window)
    grads = ej.grad((out * ej.input("g", g.shape)).sum(), [tq, tk, tv])
    feeds = dict(q=q, k=k, v=v, g=g, **({"m": m} if masked else {}))
    with mock.patch.object(attn, "BLOCK", 4):
        got = ej.execute_blocked([out, *grads], **feeds)
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    dense = torch.zeros(13, 13, dtype=torch.float64).masked_fill(~torch.tensor(_dense_mask(13, 13, window)),
                                                                 float("-inf"))
    want = TF.scaled_dot_product_attention(*leaves, attn_mask=dense + (torch.tensor(m, dtype=torch.float64)
                                                                       if masked else 0))
    wgrads = torch.autograd.grad(want, leaves, torch.tensor(g, dtype=torch.float64))
    for a, b in zip(got, [want.detach(), *wgrads]):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=1e-4, atol=1e-5)


def test_other_constant_masks_stay_masks():
    """Only exact top-left causal / sliding-window fills become flags: a strict-lower mask, a
    bottom-right causal one (a KV cache), a mask over heads, or data stay masks."""
    from einjoin.frontend.mask_pattern import band_of
    n = 6
    i, j = ej.arange(n).reshape((n, 1)), ej.arange(n).reshape((1, n))
    assert band_of((j < i).reshape((1, n, n)).node, (n, n)) is None
    assert band_of(ej.causal_mask(4, 6).reshape((1, 4, 6)).node, (4, 6)) is None
    assert band_of(((j <= i) & (i - j < 2)).reshape((1, 1, n, n)).node, (n, n)) == (True, 2)
    assert band_of(ej.input("m", (1, n, n), "bool").node, (n, n)) is None
    assert band_of((j <= i).reshape((1, 1, n, n)).broadcast_to((1, 2, n, n)).node, (n, n)) is None
    assert band_of((j <= 0).reshape((1, 1, n)).node, (n, n)) is None  # one row for every query
