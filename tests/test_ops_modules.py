"""nn.MultiheadAttention, nn.TransformerEncoderLayer / TransformerEncoder (batch_first, norm_first,
attention and key-padding masks) and torch.autocast regions (issue 20), imported with
``ej.from_torch`` and compiled for 1 and 2 devices, against torch. torch.export traces the
modules into ATen ops; torch.fx keeps them whole and einjoin translates the modules
(``einjoin.frontend.attention_modules``), also checked directly on the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej
from einjoin.frontend.nn_modules import MODULES
from einjoin.ir.graph import Graph
from tests.ops_harness import assert_close, check_grads, check_import


def _masks(b=2, tl=5, s=6):
    kpm = torch.zeros(b, s, dtype=torch.bool)
    kpm[0, s - 2:] = True  # padding at the end of the first sequence
    am = torch.zeros(tl, s, dtype=torch.bool)
    am[:, s - 1] = True
    return kpm, am


class MHA(nn.Module):
    def __init__(self, batch_first=True, **kw):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)

    def forward(self, q, k, v, kpm, am):
        out, w = self.attn(q, k, v, kpm, True, am)  # key_padding_mask, need_weights, attn_mask
        return out, w


class Encoder(nn.Module):
    def __init__(self, layers=1, **kw):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, **kw)
        self.enc = layer if layers == 1 else nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(8),
                                                                    enable_nested_tensor=False)
        self.layers = layers

    def forward(self, x, kpm, am):
        if self.layers == 1:
            return self.enc(x, am, kpm)  # src_mask, src_key_padding_mask
        # is_causal given: torch would otherwise compare the mask with a causal one (.item(): data-dependent)
        return self.enc(x, mask=am, src_key_padding_mask=kpm, is_causal=True)


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_with_masks(batch_first, method):
    kpm, am = _masks()
    q, k = torch.randn(2, 5, 8), torch.randn(2, 6, 8)
    if not batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    check_import(MHA(batch_first).eval(), (q, k, k, kpm, am), methods=(method,))


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_layer(norm_first, activation, method):
    kpm, _ = _masks(tl=6)
    am = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    m = Encoder(norm_first=norm_first, activation=activation).eval()
    x = torch.randn(2, 6, 8)
    with torch.enable_grad():  # grad on, as at the import below: slow path (no_grad: test_transformer_modules)
        want = m(x, kpm, am)
    fn = ej.from_torch(m, (x, kpm, am), method=method)
    for d in (1, 2):
        assert_close(ej.compile(fn, devices=d).run(x, kpm, am), want)


class MHAKeywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q, kpm, am):
        return self.attn(q, q, q, key_padding_mask=kpm, attn_mask=am, need_weights=False)[0]


def test_fx_module_keyword_arguments():
    kpm, _ = _masks(tl=6)
    am = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    check_import(MHAKeywords().eval(), (torch.randn(2, 6, 8), kpm, am), methods=("fx",))


@pytest.mark.slow  # make test-all; encoder gradients: test_transformer_modules' padding test
def test_transformer_encoder_stack_gradients():
    m = Encoder(layers=2).double().eval()
    kpm, _ = _masks(tl=6)
    am = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x):
            return (self.m(x, kpm, am) ** 2).sum()
    check_grads(Loss(), (torch.randn(2, 6, 8, dtype=torch.float64),))


def _direct(m, *args, **kw):
    """The fx module translation on ej.input / ej.param tensors, evaluated by ej.reference."""
    params = {n: ej.param(n, tuple(t.shape)) for n, t in m.named_parameters()}
    feeds = {n: t.detach().numpy() for n, t in m.named_parameters()}
    ins = []
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            ins.append(a)
            continue
        ins.append(ej.input(f"a{i}", tuple(a.shape), "bool" if a.dtype == torch.bool else "float32"))
        feeds[f"a{i}"] = a.numpy()
    out = MODULES[type(m).__name__](m, params, *ins, **kw)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    res = []
    for o in outs:
        used = Graph([o.node]).input_by_name
        res.append(ej.reference(o, **{k: v for k, v in feeds.items() if k in used}))
    return res


@pytest.mark.parametrize("batch_first,kdim", [(True, None), (False, None), (True, 4)])
@pytest.mark.parametrize("average", [True, False])
def test_multihead_attention_module_translation(batch_first, kdim, average):
    kw = {} if kdim is None else {"kdim": kdim, "vdim": 3}
    m = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw).eval()
    kpm, am = _masks()
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 6, kdim or 8), torch.randn(2, 6, 3 if kdim else 8)
    if not batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    want = m(q, k, v, key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
    got = _direct(m, q, k, v, kpm, True, am, average)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_multihead_attention_unbatched_float_mask_and_encoder_stack():
    m = nn.MultiheadAttention(8, 2).eval()
    q, k, fm = torch.randn(5, 8), torch.randn(6, 8), torch.randn(5, 6)
    want = m(q, k, k, attn_mask=fm)
    for g, w in zip(_direct(m, q, k, k, None, True, fm), want):
        np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-5, atol=1e-5)
    enc = Encoder(layers=2, norm_first=True).eval().enc
    x, am = torch.randn(2, 6, 8), torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    with torch.enable_grad():
        want = enc(x, mask=am)
    np.testing.assert_allclose(_direct(enc, x, am)[0], want.detach().numpy(), rtol=1e-5, atol=1e-5)


class Autocast(nn.Module):
    """A bfloat16 autocast region inside a float32 model (torch's CPU autocast dtype)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.a(x))
            y = h @ h.transpose(0, 1)
        return self.b(h.float()) + y.float().sum(1, keepdim=True)


def test_autocast_region_keeps_its_dtypes():
    m = Autocast().eval()
    x = torch.randn(6, 8)
    fn = ej.from_torch(m, (x,), method="export")
    with torch.no_grad():
        want = m(x)
    for d in (1, 2):
        out = ej.compile(fn, devices=d).run(x)
        assert out.dtype == want.dtype == torch.float32
        # the region computes in bfloat16 (float32 accumulation): as torch, to bfloat16's precision
        np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    # the bfloat16 matmul is in the graph (not computed in float32 throughout)
    dtypes = {n.dtype for n in Graph(list(o.node for o in fn.outputs)).nodes}
    assert "bfloat16" in dtypes
