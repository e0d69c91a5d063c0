"""``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` as the
einsums they are, for the torch.fx path (which keeps these modules whole; torch.export traces
through them into ATen ops the op table translates). :func:`multi_head_attention` follows
``F.multi_head_attention_forward``: in-projection (packed or separate q/k/v weights), per-head
scaled scores, the attention mask and key-padding mask (bool: True is masked out; float: added),
softmax, the values, the out-projection, and the head-averaged weights when asked for.

:data:`ATTENTION_MODULES` is merged into ``nn_modules.MODULES``; each reads the module's
sub-module weights under their dotted names (``out_proj.weight``).

>>> import einjoin as ej
>>> q = ej.input("q", (2, 5, 8)); w = ej.input("w", (24, 8)); o = ej.input("o", (8, 8))
>>> out, weights = multi_head_attention(q, q, q, 2, w, None, o, None, batch_first=True)
>>> out.shape, weights.shape
((2, 5, 8), (2, 5, 5))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from einjoin.errors import ShapeError, UnsupportedOpError
from einjoin.frontend import aten
from einjoin.frontend import composites as C
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor, _t, einsum

__all__ = ["multi_head_attention", "ATTENTION_MODULES"]


def _additive(mask: Any, dtype: str, what: str) -> Tensor | None:
    """A bool mask (True: masked out) as -inf / 0, or a float mask as it is (in ``dtype``)."""
    if mask is None:
        return None
    m = _t(mask, what)
    if m.dtype == "bool":
        return F.where(m, float("-inf"), F.zeros((), dtype))
    return m if m.dtype == dtype else m.to(dtype)


def multi_head_attention(query: Tensor, key: Tensor, value: Tensor, num_heads: int, in_proj_weight: Tensor | None,
                         in_proj_bias: Tensor | None, out_proj_weight: Tensor, out_proj_bias: Tensor | None, *,
                         q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
                         v_proj_weight: Tensor | None = None, key_padding_mask: Tensor | None = None,
                         attn_mask: Tensor | None = None, need_weights: bool = True,
                         average_attn_weights: bool = True, is_causal: bool = False,
                         batch_first: bool = False) -> tuple[Tensor, Tensor | None]:
    """torch's multi-head attention forward (no dropout, no bias_k / bias_v, no zero attention):
    (the output, the attention weights — averaged over heads unless ``average_attn_weights`` is
    False — or None when ``need_weights`` is False)."""
    query, key, value = _t(query, "mha query"), _t(key, "mha key"), _t(value, "mha value")
    unbatched = query.ndim == 2
    if unbatched:  # (L, E): one batch of the batch-first form
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        key_padding_mask = None if key_padding_mask is None else _t(key_padding_mask, "mha mask").unsqueeze(0)
    elif not batch_first:  # (L, B, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    b, tl, e = query.shape
    s = key.shape[1]
    h = int(num_heads)
    if e % h:
        raise ShapeError(f"multi_head_attention: embed dim {e} is not divisible by {h} heads")
    d = e // h
    if in_proj_weight is not None:
        wq, wk, wv = F.split(_t(in_proj_weight, "mha in_proj_weight"), e, 0)
    else:
        if q_proj_weight is None or k_proj_weight is None or v_proj_weight is None:
            raise ShapeError("multi_head_attention: needs in_proj_weight or q/k/v_proj_weight")
        wq, wk, wv = q_proj_weight, k_proj_weight, v_proj_weight
    bq = bk = bv = None
    if in_proj_bias is not None:
        bq, bk, bv = F.split(_t(in_proj_bias, "mha in_proj_bias"), e, 0)
    q = C.linear(query, wq, bq).reshape((b, tl, h, d))
    k = C.linear(key, wk, bk).reshape((b, s, h, d))
    v = C.linear(value, wv, bv).reshape((b, s, h, d))
    scores = einsum("blhd,bshd->bhls", q * (1.0 / math.sqrt(d)), k)
    mask = _additive(attn_mask, scores.dtype, "mha attn_mask")
    if mask is None and is_causal:
        mask = F.where(F.fill((tl, s), "x1 > x0", "bool"), float("-inf"), F.zeros((), scores.dtype))
    if mask is not None and mask.ndim == 3:  # (B * H, L, S)
        mask = mask.reshape((b, h, tl, s))
    pad = _additive(key_padding_mask, scores.dtype, "mha key_padding_mask")
    if pad is not None:
        pad = pad.reshape((b, 1, 1, s))
        mask = pad if mask is None else mask + pad
    if mask is not None:
        scores = scores + mask
    p = C.softmax(scores, -1)
    out = einsum("bhls,bshd->blhd", p, v).reshape((b, tl, e))
    out = C.linear(out, out_proj_weight, out_proj_bias)
    weights = None
    if need_weights:
        weights = p.mean(1) if average_attn_weights else p
        if unbatched:
            weights = weights.squeeze(0)
    if unbatched:
        out = out.squeeze(0)
    elif not batch_first:
        out = out.transpose(0, 1)
    return out, weights


def _sub(p: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def _need(p: dict[str, Any], key: str, module: str) -> Any:
    if key not in p:
        raise UnsupportedOpError(f"nn.{module} on the torch.fx path needs its sub-module weights ({key!r}), "
                                 f"which this einjoin's fx capture does not pass yet; use method='export'")
    return p[key]


def _mha_m(m: Any, p: dict[str, Any], query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any = None,
           need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
           is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    if m.training and m.dropout > 0:
        raise UnsupportedOpError(f"nn.MultiheadAttention with dropout={m.dropout} in training mode; call module.eval()")
    if m.bias_k is not None or m.add_zero_attn:
        raise UnsupportedOpError("nn.MultiheadAttention with add_bias_kv or add_zero_attn")
    return multi_head_attention(
        query, key, value, m.num_heads, p.get("in_proj_weight"), p.get("in_proj_bias"),
        _need(p, "out_proj.weight", "MultiheadAttention"), p.get("out_proj.bias"),
        q_proj_weight=p.get("q_proj_weight"), k_proj_weight=p.get("k_proj_weight"),
        v_proj_weight=p.get("v_proj_weight"), key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        need_weights=need_weights, average_attn_weights=average_attn_weights, is_causal=is_causal,
        batch_first=m.batch_first)


def _activation(m: Any, x: Tensor) -> Tensor:
    act = m.activation
    name = getattr(act, "__name__", None) or type(act).__name__
    fn = {"relu": "relu", "ReLU": "relu", "gelu": "gelu", "GELU": "gelu", "silu": "silu", "SiLU": "silu",
          "tanh": "tanh", "Tanh": "tanh"}.get(name)
    if fn is None:
        raise UnsupportedOpError(f"nn.TransformerEncoderLayer with activation {name!r} (relu, gelu, silu, tanh)")
    if fn == "gelu" and getattr(act, "approximate", "none") != "none":
        return C.gelu(x, act.approximate)
    out: Tensor = aten.OPS[fn](x)
    return out


def _encoder_layer(m: Any, p: dict[str, Any], x: Tensor, src_mask: Any = None, src_key_padding_mask: Any = None,
                   is_causal: bool = False) -> Tensor:
    if m.training and (m.dropout1.p > 0 or m.dropout2.p > 0 or m.self_attn.dropout > 0):
        raise UnsupportedOpError("nn.TransformerEncoderLayer with dropout in training mode; call module.eval()")

    def norm(which: str, y: Tensor) -> Tensor:
        ln = getattr(m, which)
        return C.layer_norm(y, ln.normalized_shape, _need(p, f"{which}.weight", "TransformerEncoderLayer")
                            if ln.elementwise_affine else None, p.get(f"{which}.bias"), ln.eps)

    def sa(y: Tensor) -> Tensor:
        return _mha_m(m.self_attn, _sub(p, "self_attn."), y, y, y, src_key_padding_mask, False, src_mask,
                      True, is_causal)[0]

    def ff(y: Tensor) -> Tensor:
        h = _activation(m, C.linear(y, _need(p, "linear1.weight", "TransformerEncoderLayer"), p.get("linear1.bias")))
        return C.linear(h, p["linear2.weight"], p.get("linear2.bias"))

    if m.norm_first:
        x = x + sa(norm("norm1", x))
        return x + ff(norm("norm2", x))
    x = norm("norm1", x + sa(x))
    return norm("norm2", x + ff(x))


def _encoder(m: Any, p: dict[str, Any], src: Tensor, mask: Any = None, src_key_padding_mask: Any = None,
             is_causal: Any = None) -> Tensor:
    x = src
    for i, layer in enumerate(m.layers):
        x = _encoder_layer(layer, _sub(p, f"layers.{i}."), x, mask, src_key_padding_mask, bool(is_causal))
    if m.norm is not None:
        x = C.layer_norm(x, m.norm.normalized_shape, p.get("norm.weight"), p.get("norm.bias"), m.norm.eps)
    return x


ATTENTION_MODULES: dict[str, Callable[..., Any]] = {
    "MultiheadAttention": _mha_m,
    "TransformerEncoderLayer": _encoder_layer,
    "TransformerEncoder": _encoder,
}
"""The attention ``nn`` modules torch.fx keeps whole, merged into ``nn_modules.MODULES``."""
