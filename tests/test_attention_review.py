"""A hostile review of fused attention (the Attention / AttentionGrad kinds, session 31): the cases
the review found wrong, each against torch (its math kernel where torch's own CPU flash kernel is
wrong), and the ones it checked beyond tests/test_attention.py (torch's top-left causal for
L != S on 3 devices, a 2-D batchless sdpa, graph masks with gradients broadcast over batch and
rows, a fully masked row's gradients, half types against torch's own half sdpa)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import einjoin as ej
from einjoin.frontend.composites import fused_attention
from einjoin.ir.attention import attention_grad_torch, attention_torch
from einjoin.ir.dtypes import numpy_dtype


def _math_sdpa(q, k, v, mask=None, causal=False, scale=None):
    """torch's math kernel in float64 (the reference where the flash kernel is wrong)."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _program(shapes, causal, scale=None, mask=None, wrt_mask=False, devices=2, dtype="float32"):
    """(compiled program of (out, grads of sum(out * g)), the einjoin inputs' names)."""
    names = ["q", "k", "v"]
    ins = [ej.input(n, s, dtype) for n, s in zip(names, shapes)]
    tm = None
    if mask is not None:
        tm = ej.input("m", mask.shape, "bool" if mask.dtype == bool else dtype)
    out = fused_attention(*ins, tm, causal, scale)
    tg = ej.input("g", out.shape, dtype)
    grads = ej.grad((out * tg).sum(), ins + ([tm] if wrt_mask else []))
    return ej.compile([out, *grads], devices=ej.local(devices)), out.shape


def _torch_grads(q, k, v, g, mask=None, causal=False, scale=None, wrt_mask=False):
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    tm = None
    if mask is not None:
        tm = torch.tensor(mask) if mask.dtype == bool else torch.tensor(mask, dtype=torch.float64)
        if wrt_mask:
            tm.requires_grad_()
    am = tm
    if causal and tm is not None:  # torch takes no mask with is_causal: the top-left mask
        tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        am = (tm & tril) if tm.dtype == torch.bool else tm + torch.zeros(tril.shape, dtype=tm.dtype).masked_fill(
            ~tril, float("-inf"))
    out = _math_sdpa(*leaves, am, causal and tm is None, scale)
    wrt = leaves + ([tm] if wrt_mask else [])
    grads = torch.autograd.grad(out, wrt, torch.tensor(g, dtype=torch.float64))
    return [out.detach().numpy()] + [np.nan_to_num(x.numpy()) for x in grads]


def _close(got, want, tol=1e-5):
    for a, b in zip(got, want):
        a = np.asarray(a, np.float64)
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- the review's findings


@pytest.mark.parametrize("scale", [0.0, -0.5, 1e-300])
def test_causal_with_a_scale_of_zero_or_below_matches_the_math_kernel(scale):
    """scale 0 (uniform weights over the allowed keys) or negative: torch's flash kernel applies
    its causal mask as -inf * scale (NaN); the fused node must give the math kernel's values,
    forward and gradients, whole and cut over query rows."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 5, 4)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    want = _torch_grads(q, k, v, g, causal=True, scale=scale)
    prog, _ = _program([x.shape for x in (q, k, v)], True, scale)
    _close(prog.run(q=q, k=k, v=v, g=g), want, 1e-4)
    # ej.attention (the hostile-IR test's path: 3-D, float64, one device)
    x = ej.input("x", (2, 3, 4), "float64")
    xs = rng.standard_normal((2, 3, 4))
    t = torch.from_numpy(xs)
    np.testing.assert_allclose(ej.reference(ej.attention(x, x, x, causal=True, scale=scale), x=xs),
                               _math_sdpa(t, t, t, causal=True, scale=scale).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_zero_feature_size_attends_uniformly_as_torch(causal):
    """E == 0: every score is 0, so each query averages the values it may see (torch's result),
    and dv gets those weights; dq and dk are empty."""
    rng = np.random.default_rng(4)
    q, k = np.zeros((2, 4, 0), np.float32), np.zeros((2, 5, 0), np.float32)
    v = rng.standard_normal((2, 5, 3)).astype(np.float32)
    g = rng.standard_normal((2, 4, 3)).astype(np.float32)
    m = rng.standard_normal((1, 4, 5)).astype(np.float32)
    want = _torch_grads(q, k, v, g, m, causal, wrt_mask=True)
    prog, _ = _program([q.shape, k.shape, v.shape], causal, mask=m, wrt_mask=True)
    _close(prog.run(q=q, k=k, v=v, g=g, m=m), want, 1e-5)


def test_a_causal_row_block_off_the_cpu_stays_on_qs_device():
    """attention_torch's non-CPU path (torch's sdpa) with a causal row block (row0 > 0): its mask
    must be made on q's device. The meta device stands in for a GPU (the same device check)."""
    q = torch.empty(2, 3, 5, 4, device="meta")
    assert attention_torch(q, q, q, None, 0.5, True, row0=2).device.type == "meta"
    dout = torch.empty(2, 3, 5, 4, device="meta")
    m = torch.empty(1, 1, 5, 5, device="meta")
    assert attention_grad_torch(q, q, q, dout, m, 0.5, True, ("mask",)).device.type == "meta"


# ---------------------------------------------------------------- checked and right


@pytest.mark.parametrize("L,S", [(7, 4), (4, 7)])
def test_sdpa_causal_top_left_when_l_differs_from_s_on_three_devices(L, S):
    """torch's is_causal aligns the diagonal top-left (ej.attention's bottom-right is a mask):
    uneven query-row blocks on 3 devices place it from each block's first row."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, L, 4)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, S, 4)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((1, 2, L, 4)).astype(np.float32)
    prog, _ = _program([q.shape, k.shape, v.shape], True, devices=3)
    _close(prog.run(q=q, k=k, v=v, g=g), _torch_grads(q, k, v, g, causal=True), 1e-4)
    out = fused_attention(ej.input("q", q.shape), ej.input("k", k.shape), ej.input("v", v.shape), None, True)
    got = ej.execute_blocked([out], {out: {"c": 3}}, q=q, k=k, v=v)  # uneven row blocks
    _close(got, _torch_grads(q, k, v, g, causal=True)[:1], 1e-4)


def test_graph_masks_with_gradients_broadcast_and_a_fully_masked_row():
    """An additive mask broadcast over batch and rows (its gradient summed there) computed in the
    graph from a parameter, and a bool mask whose row 1 allows no key (zeros, zero gradients)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    k, v = (rng.standard_normal((2, 3, 6, 4)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    b = rng.standard_normal((1, 3, 1, 6)).astype(np.float32)
    tq, tk, tv, tb = (ej.input(n, x.shape) for n, x in zip("qkvb", (q, k, v, b)))
    out = fused_attention(tq, tk, tv, tb * 2.0, True)
    tg = ej.input("g", out.shape)
    got = ej.compile([out, *ej.grad((out * tg).sum(), [tq, tk, tv, tb])], devices=ej.local(4)).run(
        q=q, k=k, v=v, b=b, g=g)
    want = _torch_grads(q, k, v, g, b * 2.0, True, wrt_mask=True)
    want[-1] = want[-1] * 2.0
    _close(got, want, 1e-4)
    m = rng.random((5, 6)) > 0.3
    m[1] = False
    prog, _ = _program([q.shape, k.shape, v.shape], False, mask=m[None, None], devices=2)
    got = prog.run(q=q, k=k, v=v, g=g, m=m[None, None])
    assert not np.asarray(got[0])[:, :, 1].any()
    _close(got, _torch_grads(q, k, v, g, m[None, None]), 1e-4)


def test_batchless_sdpa_and_grouped_heads_through_from_torch():
    class Block(torch.nn.Module):
        def forward(self, q, k, v, q4, kv4):
            a = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            b = TF.scaled_dot_product_attention(q4, kv4, kv4, is_causal=True, enable_gqa=True, scale=0.3)
            return a.sum() + b.sum(-1)

    xs = (torch.randn(5, 8), torch.randn(3, 8), torch.randn(3, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8))
    fn = ej.from_torch(Block(), xs)
    assert sum(n.kind == "attention" for n in ej.Graph(list(fn.outputs)).ops) == 2
    np.testing.assert_allclose(np.asarray(fn.reference(*xs)), Block()(*xs).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_against_torchs_own_half_sdpa(dtype):
    """The half result is torch's half sdpa's (same kernel, float32 accumulation), cut over query
    rows on 2 devices: within a couple of the type's ulps of torch's."""
    rng = np.random.default_rng(7)
    tdt = getattr(torch, dtype)
    xs = [torch.tensor(rng.standard_normal((2, 2, 32, 16)), dtype=tdt) for _ in range(3)]
    want = TF.scaled_dot_product_attention(*xs, is_causal=True).float().numpy()
    feeds = {n: x.float().numpy().astype(numpy_dtype(dtype)) for n, x in zip("qkv", xs)}
    out = fused_attention(*(ej.input(n, (2, 2, 32, 16), dtype) for n in "qkv"), None, True)
    got = np.asarray(ej.compile(out, devices=ej.local(2)).run(**feeds), np.float32)
    eps = float(torch.finfo(tdt).eps)
    assert float(np.abs(got - want).max()) <= 2 * eps * max(1.0, float(np.abs(want).max()))


def test_sdpa_broadcasts_batch_dims_of_q_k_and_v_as_torch():
    """torch's sdpa broadcasts the batch dims of q, k and v (a shared k/v over the batch, one
    query for many key sets, GQA with a broadcast batch); gradients sum over the broadcast."""
    class Block(torch.nn.Module):
        def forward(self, q, k, q1, k2, q4, kv1):
            a = TF.scaled_dot_product_attention(q, k, k, is_causal=True)
            b = TF.scaled_dot_product_attention(q1, k2, k2)
            c = TF.scaled_dot_product_attention(q4, kv1, kv1, enable_gqa=True)
            return a.sum() + b.sum() + c.sum(-1)

    xs = (torch.randn(2, 3, 5, 8), torch.randn(1, 3, 6, 8), torch.randn(1, 3, 5, 8), torch.randn(2, 3, 6, 8),
          torch.randn(2, 4, 5, 8), torch.randn(1, 2, 6, 8))
    fn = ej.from_torch(Block(), xs)
    np.testing.assert_allclose(np.asarray(fn.reference(*xs)), Block()(*xs).numpy(), rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    k, v = (rng.standard_normal((1, 3, 6, 4)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    prog, _ = _program([q.shape, k.shape, v.shape], True)
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    out = _math_sdpa(*leaves, causal=True)
    want = [out.detach().numpy()] + [x.numpy() for x in torch.autograd.grad(out, leaves, torch.tensor(g).double())]
    _close(prog.run(q=q, k=k, v=v, g=g), want, 1e-4)
    with pytest.raises(ej.errors.ShapeError, match=r"q \(2, 3, 5, 8\), k \(3, 3, 6, 8\)"):
        fused_attention(ej.input("a", (2, 3, 5, 8)), ej.input("b", (3, 3, 6, 8)), ej.input("b", (3, 3, 6, 8)))


def test_the_footprint_counts_the_math_kernels_score_matrices():
    """Where the value size differs from E (and for an additive mask's gradient) the kernel is
    torch's math sdpa, which holds the (batch, L, S) weights, and its autograd their gradient as
    well: the scratch the memory planner reserves must cover them, or a cap is exceeded."""
    from einjoin.decomp.footprint import kernel_scratch

    B, L, S = 6, 64, 48
    scores = B * L * S * 4
    for ev, masked in ((5, False), (8, True)):
        q, k = ej.input("q", (2, 3, L, 8)), ej.input("k", (2, 3, S, 8))
        v, m = ej.input("v", (2, 3, S, ev)), ej.input("m", (1, 3, L, S))
        out = fused_attention(q, k, v, m if masked else None)
        grads = ej.grad(out.sum(), [q, k, v] + ([m] if masked else []))
        for n in ej.Graph([out.node] + [g.node for g in grads]).ops:
            math = ev != 8 or getattr(n.op, "parts", None) == ("mask",)
            if n.kind not in ("attention", "attentiongrad") or not math:
                continue
            d = ej.decompose(n, {})
            in_bytes = [int(np.prod(x.shape)) * 4 for x in n.inputs]
            need = scores if n.kind == "attention" else 2 * scores  # the weights (and their gradient)
            assert kernel_scratch(d, 0, in_bytes, int(np.prod(n.shape)) * 4) >= need, n
