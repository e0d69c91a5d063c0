"""Fused attention (the Attention and AttentionGrad node kinds): forward and gradients against
torch's scaled_dot_product_attention and autograd, whole, planned on 1, 2 and 4 devices, and cut
into random blocks (hypothesis); causal and masks; half types against a float32 reference;
the frontends that build it; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend.composites import fused_attention
from einjoin.ir.attention import attention_grad_node, attention_node
from einjoin.ir.dtypes import numpy_dtype

RNG = np.random.default_rng(0)


def _case(batch, L, S, E, Ev, mask, dtype="float32", seed=0):
    """Feeds (q, k, v, mask or None) for one case; mask: None, "bool" or "float"."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(batch + (L, E)).astype(np.float32)
    k = rng.standard_normal(batch + (S, E)).astype(np.float32)
    v = rng.standard_normal(batch + (S, Ev)).astype(np.float32)
    mshape = (1,) * (len(batch) - 1) + batch[-1:] + (L, S) if batch else (L, S)
    m = None
    if mask == "bool":
        m = rng.random(mshape) > 0.3
        m[..., 0, :] = False  # a query with no key: zeros, as torch's
    elif mask == "float":
        m = rng.standard_normal(mshape).astype(np.float32)
    cast = (lambda a: a.astype(numpy_dtype(dtype))) if dtype != "float32" else (lambda a: a)
    return cast(q), cast(k), cast(v), (m if m is None or m.dtype == bool else cast(m))


def _torch(q, k, v, m, causal, scale=None, wrt_mask=False, g=None):
    """torch's output and (given the cotangent g) autograd's gradients, in float32 or float64."""
    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64)).requires_grad_() for x in (q, k, v))
    tm = None if m is None else torch.tensor(m if m.dtype == bool else np.asarray(m, np.float64))
    if wrt_mask:
        tm.requires_grad_()
    am = tm
    if causal and tm is not None:  # torch takes no mask with is_causal: the top-left causal mask
        L, S = q.shape[-2], k.shape[-2]
        tril = torch.ones(L, S, dtype=torch.bool).tril()
        am = (tm & tril) if tm.dtype == torch.bool else tm + torch.zeros(L, S, dtype=tm.dtype).masked_fill(
            ~tril, float("-inf"))
    out = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=am, is_causal=causal and tm is None, scale=scale)
    if g is None:
        return out.detach().numpy()
    leaves = [tq, tk, tv] + ([tm] if wrt_mask else [])
    grads = torch.autograd.grad(out, leaves, torch.tensor(np.asarray(g, np.float64)))
    return out.detach().numpy(), [np.nan_to_num(x.numpy()) for x in grads]


def _graph(q, k, v, m, causal, wrt_mask=False):
    """(out, grads of sum(out * g) w.r.t. q, k, v [, mask]) as einjoin tensors, and the inputs."""
    tq, tk, tv = ej.input("q", q.shape, q.dtype), ej.input("k", k.shape, k.dtype), ej.input("v", v.shape, v.dtype)
    tm = None if m is None else ej.input("m", m.shape, m.dtype)
    out = fused_attention(tq, tk, tv, tm, causal)
    tg = ej.input("g", out.shape, out.dtype)
    wrt = [tq, tk, tv] + ([tm] if wrt_mask else [])
    grads = ej.grad((out * tg).sum(), wrt)
    return out, list(grads)


def _feeds(q, k, v, m, g):
    f = {"q": q, "k": k, "v": v, "g": g}
    if m is not None:
        f["m"] = m
    return f


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("causal,mask", [(False, None), (True, None), (False, "bool"), (True, "float")])
def test_forward_and_gradients_match_torch_on_devices(devices, causal, mask):
    q, k, v, m = _case((2, 2), 6, 9 if not causal else 6, 8, 8, mask)
    g = RNG.standard_normal((2, 2, 6, 8)).astype(np.float32)
    out, grads = _graph(q, k, v, m, causal, wrt_mask=mask == "float")
    prog = ej.compile([out] + grads, devices=ej.local(devices))
    got = prog.run(**_feeds(q, k, v, m, g))
    want, wgrads = _torch(q, k, v, m, causal, wrt_mask=mask == "float", g=g)
    for a, b in zip(got, [want] + wgrads):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)
    kinds = {n.kind for n in prog.graph.ops}
    assert {"attention", "attentiongrad"} <= kinds
    # the score matrix is no tensor of the graph: no node has the (..., L, S) shape
    assert not any(n.shape[-2:] == (6, q.shape[-2] if causal else 9) and n.kind == "einsum" for n in prog.graph.ops)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_blocks_match_torch(data):
    """Any cut of the forward (batch dims, query rows, value dim) and of the gradient node (batch
    dims; rows and features recomputed) gives torch's values: the causal diagonal is placed by each
    query block's first row."""
    nb = data.draw(st.integers(0, 2), label="batch rank")
    batch = tuple(data.draw(st.lists(st.integers(1, 3), min_size=nb, max_size=nb), label="batch"))
    L, S = data.draw(st.integers(1, 7), label="L"), data.draw(st.integers(1, 7), label="S")
    E = data.draw(st.integers(1, 5), label="E")
    Ev = data.draw(st.sampled_from([E, E + 1]), label="Ev")
    causal = data.draw(st.booleans(), label="causal")
    mask = data.draw(st.sampled_from([None, "bool", "float"]), label="mask")
    q, k, v, m = _case(batch, L, S, E, Ev, mask, seed=data.draw(st.integers(0, 99)))
    g = np.random.default_rng(1).standard_normal(batch + (L, Ev)).astype(np.float32)
    out, grads = _graph(q, k, v, m, causal, wrt_mask=mask == "float")
    nodes = [n for n in ej.Graph([out.node] + [x.node for x in grads]).ops
             if n.kind in ("attention", "attentiongrad")]

    def counts(n):
        return {lab: data.draw(st.integers(1, size), label=f"{n.kind} {lab}")
                for lab, size in ej.decomp.spec.label_sizes(n).items() if size}

    specs = {n: counts(n) for n in nodes}
    got = ej.execute_blocked([out] + grads, specs, **_feeds(q, k, v, m, g))
    want, wgrads = _torch(q, k, v, m, causal, wrt_mask=mask == "float", g=g)
    for a, b in zip(got, [want] + wgrads):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_types_against_a_float32_reference(dtype, tol):
    """float16/bfloat16 compute with float32 accumulation (torch's kernel): within the type's
    rounding of the float32 result, on 2 devices."""
    q, k, v, m = _case((2, 3), 16, 16, 8, 8, "float", dtype=dtype)
    g = RNG.standard_normal((2, 3, 16, 8)).astype(numpy_dtype(dtype))
    out, grads = _graph(q, k, v, m, True)
    got = ej.compile([out] + grads, devices=ej.local(2)).run(**_feeds(q, k, v, m, g))
    want, wgrads = _torch(*(np.asarray(x, np.float32) for x in (q, k, v, m)), True, g=np.asarray(g, np.float32))
    for a, b in zip(got, [want] + wgrads):
        assert np.asarray(a).dtype == numpy_dtype(dtype)
        scale = max(1.0, float(np.abs(b).max()))
        assert float(np.abs(np.asarray(a, np.float64) - b).max()) <= tol * 4 * scale


def test_value_size_other_than_the_key_size_and_row_blocks():
    """Ev != E takes torch's math kernel (and two gradient nodes); a causal query block below the
    first row (the row cut of a plan) still gets the diagonal."""
    q, k, v, m = _case((3,), 10, 12, 4, 6, None)
    g = RNG.standard_normal((3, 10, 6)).astype(np.float32)
    out, grads = _graph(q, k, v, m, True)
    assert sum(n.kind == "attentiongrad" for n in ej.Graph([x.node for x in grads]).ops) == 2
    got = ej.execute_blocked([out] + grads, {out: {"b": 3, "c": 2}}, **_feeds(q, k, v, m, g))
    want, wgrads = _torch(q, k, v, m, True, g=g)
    for a, b in zip(got, [want] + wgrads):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)


def test_frontends_build_the_fused_kind():
    class Block(torch.nn.Module):
        def forward(self, q, k, v, mask):
            a = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            b = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return a + b

    xs = [torch.randn(2, 4, 8, 16) for _ in range(3)] + [torch.randn(8, 8)]
    fn = ej.from_torch(Block(), tuple(xs))
    assert sum(n.kind == "attention" for n in ej.Graph(list(fn.outputs)).ops) == 2
    np.testing.assert_allclose(np.asarray(fn.reference(*xs)), Block()(*xs).numpy(), rtol=1e-5, atol=1e-5)
    # ej.attention: grouped-query heads repeated, its causal mask bottom-right aligned
    q, kv = ej.input("q", (1, 4, 3, 8)), ej.input("kv", (1, 2, 5, 8))
    out = ej.attention(q, kv, kv, causal=True)
    a = ej.Graph(out).ops[-1]
    assert a.kind == "attention" and a.inputs[1].shape == (1, 4, 5, 8) and len(a.inputs) == 4
    qv, kvv = RNG.standard_normal((1, 4, 3, 8)), RNG.standard_normal((1, 2, 5, 8))
    want = TF.scaled_dot_product_attention(torch.tensor(qv), torch.tensor(kvv), torch.tensor(kvv),
                                           attn_mask=torch.ones(3, 5, dtype=torch.bool).tril(2), enable_gqa=True)
    np.testing.assert_allclose(ej.reference(out, q=qv.astype(np.float32), kv=kvv.astype(np.float32)),
                               want.numpy(), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_the_shapes():
    q = ej.input("q", (2, 4, 8)).node
    cases = [
        (lambda: attention_node(q, ej.input("k3", (2, 4, 7)).node, q), ShapeError, "one feature size"),
        (lambda: attention_node(q, ej.input("k4", (2, 2, 4, 8)).node, q), ShapeError, "rank"),
        (lambda: attention_node(q, ej.input("k5", (3, 4, 8)).node, q), ShapeError, "batch dims"),
        (lambda: attention_node(q, ej.input("k6", (2, 4, 8), "float64").node, q), DTypeError, "float64"),
        (lambda: attention_node(q, q, q, ej.input("m1", (4, 4), "bool").node), ShapeError, "rank"),
        (lambda: attention_node(q, q, q, ej.input("m2", (2, 3, 4), "bool").node), ShapeError, "(2, 3, 4)"),
        (lambda: attention_node(q, q, q, ej.input("m3", (1, 4, 4), "int64").node), DTypeError, "int64"),
        (lambda: attention_node(q, q, q, scale=float("nan")), EinjoinError, "finite"),
        (lambda: attention_node(q, q, q, causal="yes"), EinjoinError, "causal"),
        (lambda: ej.attention(ej.input("q5", (1, 3, 4, 8)), ej.input("kv5", (1, 2, 4, 8)),
                              ej.input("kv5", (1, 2, 4, 8))), ShapeError, "3 query heads"),
        (lambda: fused_attention(ej.Tensor(q), ej.Tensor(q), ej.Tensor(q), ej.input("m4", (3, 4))),
         ShapeError, "does not broadcast"),
        (lambda: attention_grad_node(attention_node(q, q, q), q, ("v", "q")), EinjoinError, "in that order"),
        (lambda: attention_grad_node(attention_node(q, q, q), q, ("mask",)), EinjoinError, "additive"),
        (lambda: attention_grad_node(q, q, ("q",)), EinjoinError, "no attention node"),
    ]
    for make, err, text in cases:
        with pytest.raises(err, match=None) as info:
            make()
        assert text in str(info.value), (text, str(info.value))


def test_second_derivatives_are_refused():
    q = ej.input("q", (2, 4, 8), "float64")
    (gq,) = ej.grad(ej.attention(q, q, q, causal=False).sum(), [q])
    with pytest.raises(EinjoinError, match="second derivative"):
        ej.grad(gq.sum(), [q])


def test_the_torch_backend_runs_the_same_kernels():
    q, k, v, m = _case((2, 2), 6, 6, 8, 8, "float")
    g = RNG.standard_normal((2, 2, 6, 8)).astype(np.float32)
    out, grads = _graph(q, k, v, m, True, wrt_mask=True)
    feeds = _feeds(q, k, v, m, g)
    threads = ej.compile([out] + grads, devices=ej.local(2)).run(**feeds)
    on_torch = ej.compile([out] + grads, devices=ej.local(2), backend="torch").run(**feeds)
    for a, b in zip(on_torch, threads):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_a_cut_of_the_value_dim_holds_what_the_whole_rows_hold(causal, masked):
    """A cut of the forward's value dim reads v whole, and its kernel computes every column of
    its rows before it keeps its own: its scratch covers the uncut kernel's (same rows), plus
    the full-width result it copies its columns from. The rule once counted only the block's
    columns (16x too few rows at Ev / 16), so the planners took such cuts as 4x smaller."""
    from einjoin.decomp.footprint import kernel_scratch
    from einjoin.decomp.spec import JoinAggSpec

    q, k, v = ej.input("q", (2, 4, 32, 16)), ej.input("k", (2, 4, 24, 16)), ej.input("v", (2, 4, 24, 16))
    out = fused_attention(q, k, v, ej.input("m", (1, 4, 32, 24)) if masked else None, causal=causal).node
    last = sorted(JoinAggSpec.for_node(out, {}).counts())[-1]  # the labels follow the output's dims

    def scratch(counts):
        d = ej.decompose(out, JoinAggSpec.for_node(out, counts))
        ins = [int(np.prod(d.in_partitions[s].block_shape(key))) * 4 for s, key in enumerate(d.kernels[0].in_keys)]
        return kernel_scratch(d, 0, ins, int(np.prod(d.out_partition.block_shape(d.kernels[0].out_key))) * 4)

    whole = scratch({})
    assert scratch({last: 4}) >= whole + 2 * 4 * 32 * 16 * 4  # the full-width rows, as the kernel makes them
