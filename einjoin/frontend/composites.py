"""Composite ops that lower to a few einsum nodes each (plus selects, concats and fills).

Each is written as the join-aggregations it is, so the optimizer sees (and may split) every
piece: softmax is a max-reduction, an ``exp(x0 - x1)`` join, a sum and a division.
Attention is the exception: one fused node (:func:`fused_attention`), since its scores written
as einsums would be a tensor of the graph and its softmax several passes over it.

>>> import einjoin as ej
>>> x = ej.input("x", (4, 8))
>>> len(ej.Graph(ej.softmax(x)).ops)
4
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend.mask_pattern import band_of
from einjoin.frontend.functions import causal_mask, concat, einsum, fill
from einjoin.frontend.tensor import LETTERS, Tensor, _norm_dim, _t, elementwise
from einjoin.ir.attention import attention_node
from einjoin.ir.rotate import rotate_half_node
from einjoin.ir.scalar import parse_join

__all__ = ["softmax", "log_softmax", "layer_norm", "rms_norm", "silu", "gelu", "linear", "rope",
           "rotate_half", "attention", "fused_attention"]


def _real(v: Any, what: str) -> float:
    """``v`` as a Python float, or an EinjoinError naming ``what``: hyper-parameters are pasted into
    join expressions, so a string, None or numpy scalar must not reach the parser (whose error
    would name an expression the user never wrote)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise EinjoinError(f"{what} must be a real number, got {v!r}")
    try:
        return float(v)
    except OverflowError:
        raise EinjoinError(f"{what} = {v!r} does not fit a float64") from None


def _flag(v: Any, what: str) -> bool:
    """A True/False argument; an array or a string is refused rather than read as truthy."""
    if not isinstance(v, (bool, np.bool_)):
        raise EinjoinError(f"{what} must be True or False, got {v!r}")
    return bool(v)


def _labels(x: Tensor, dim: int) -> tuple[str, str]:
    """All labels of ``x`` and the labels without ``dim``."""
    ls = LETTERS[:x.ndim]
    return ls, ls.replace(ls[dim], "")


def softmax(x: Tensor, dim: int = -1, safe: bool = False) -> Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``: four einsums. ``safe``: a row that is
    -inf throughout gives zeros instead of NaN (torch's scaled_dot_product_attention does so for
    fully masked rows, as left-padded batches have)."""
    x = _t(x, "softmax")
    d = _norm_dim(x, dim)
    if x.shape[d] == 0:  # nothing to normalise: the empty tensor itself, as torch returns
        return x
    if _sum_overflows(x, d):
        return softmax(x.to("float32"), d, safe).to(x.dtype)
    ls, red = _labels(x, d)
    m = einsum(f"{ls}->{red}", x, agg="max")
    # the value is shift invariant, so its derivative through the max is 0: stop_gradient says so
    # (else ej.grad builds the max's tie masks over every row, as big as x, to add up to zero)
    if safe:  # a -inf max shifts by 0: every exp is 0, the sum 0, and the row 0 (not -inf - -inf)
        e = einsum(f"{ls},{red}->{ls}", x, m, join="exp(x0 - where(x1 == -inf, 0.0, stop_gradient(x1)))")
        s = einsum(f"{ls}->{red}", e)
        return einsum(f"{ls},{red}->{ls}", e, s, join="where(x1 == 0, 0.0, x0 / x1)")
    e = einsum(f"{ls},{red}->{ls}", x, m, join="exp(x0 - stop_gradient(x1))")
    s = einsum(f"{ls}->{red}", e)
    return einsum(f"{ls},{red}->{ls}", e, s, join="div")


def _sum_overflows(x: Tensor, d: int) -> bool:
    """Whether softmax's sum of exps (each at most 1, the max's is 1) can pass float16's 65504:
    a float16 row longer than that computes in float32, as torch does (its sum is float32)."""
    return x.dtype == "float16" and x.shape[d] > 65504


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    x = _t(x, "log_softmax")
    d = _norm_dim(x, dim)
    if x.shape[d] == 0:  # nothing to normalise: the empty tensor itself, as torch returns
        return x
    if _sum_overflows(x, d):
        return log_softmax(x.to("float32"), d).to(x.dtype)
    ls, red = _labels(x, d)
    m = einsum(f"{ls}->{red}", x, agg="max")
    # shift invariant as softmax: no derivative through the max
    s = einsum(f"{ls},{red}->{red}", x, m, join="exp(x0 - stop_gradient(x1))")
    return einsum(f"{ls},{red},{red}->{ls}", x, m, s, join="x0 - stop_gradient(x1) - log(x2)")


def _norm_labels(x: Tensor, n_trailing: int) -> tuple[str, str, str, int]:
    if n_trailing < 1 or n_trailing > x.ndim:
        raise ShapeError(f"normalising the last {n_trailing} dims of a tensor of shape {x.shape}")
    ls = LETTERS[:x.ndim]
    lead, tail = ls[:x.ndim - n_trailing], ls[x.ndim - n_trailing:]
    n = 1
    for s in x.shape[x.ndim - n_trailing:]:
        n *= s
    return ls, lead, tail, n


def _affine(y: Tensor, ls: str, tail: str, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    for p, name in ((weight, "weight"), (bias, "bias")):
        if p is not None and p.shape != y.shape[y.ndim - len(tail):]:
            raise ShapeError(f"norm {name} has shape {p.shape}, expected {y.shape[y.ndim - len(tail):]}")
    if weight is not None and bias is not None:
        return einsum(f"{ls},{tail},{tail}->{ls}", y, weight, bias, join="x0 * x1 + x2")
    if weight is not None:
        return einsum(f"{ls},{tail}->{ls}", y, weight)
    if bias is not None:
        return einsum(f"{ls},{tail}->{ls}", y, bias, join="add")
    return y


def _int_shape(v: Any, what: str) -> tuple[int, ...]:
    """An int or a sequence of ints (torch.Size included) as a tuple, or a ShapeError naming ``what``."""
    items = (v,) if not isinstance(v, (list, tuple)) else v
    try:
        if any(isinstance(i, (bool, np.bool_)) for i in items):
            raise TypeError
        return tuple(operator.index(i) for i in items)
    except TypeError:
        raise ShapeError(f"{what} must be an int or a sequence of ints, got {v!r}") from None


def _widen_half(x: Tensor, weight: Tensor | None, bias: Tensor | None
                ) -> tuple[Tensor, Tensor | None, Tensor | None, Callable[[Tensor], Tensor]]:
    """A norm of float16/bfloat16 data computes in float32 and rounds once at the end, as torch
    does: its statistics in half would overflow (a mean square past 65504 when |x| > 256) or lose
    the mean (x - mean in half is garbage when the mean is large against the spread). Returns
    the widened tensors and the function that casts the result back."""
    if x.dtype not in ("float16", "bfloat16"):
        return x, weight, bias, lambda y: y
    dtype = x.dtype

    def wide(p: Tensor | None) -> Tensor | None:
        return None if p is None else (p.to("float32") if p.dtype in ("float16", "bfloat16") else p)

    return x.to("float32"), wide(weight), wide(bias), lambda y: y.to(dtype)


def layer_norm(x: Tensor, normalized_shape: Any = None, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """torch's layer_norm over the trailing ``normalized_shape`` dims (default: the last dim)."""
    x = _t(x, "layer_norm")
    weight = None if weight is None else _t(weight, "layer_norm weight")
    bias = None if bias is None else _t(bias, "layer_norm bias")
    eps = _real(eps, "layer_norm: eps")
    ns = None
    if normalized_shape is None:
        k = weight.ndim if weight is not None else 1
    else:
        ns = _int_shape(normalized_shape, "layer_norm: normalized_shape")
        k = len(ns)
    ls, lead, tail, n = _norm_labels(x, k)
    if ns is not None and ns != x.shape[x.ndim - k:]:
        raise ShapeError(f"layer_norm: normalized_shape {ns} is not the trailing shape of the "
                         f"input {x.shape}")
    x, weight, bias, back = _widen_half(x, weight, bias)
    mu = einsum(f"{ls}->{lead}", x, join=f"x0 * {1.0 / n!r}")
    xc = einsum(f"{ls},{lead}->{ls}", x, mu, join="sub")
    var = einsum(f"{ls}->{lead}", xc, join=f"x0 * x0 * {1.0 / n!r}")
    y = einsum(f"{ls},{lead}->{ls}", xc, var, join=f"x0 * rsqrt(x1 + {eps!r})")
    return back(_affine(y, ls, tail, weight, bias))


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (LLaMA's RMSNorm)."""
    x = _t(x, "rms_norm")
    eps = _real(eps, "rms_norm: eps")
    weight = None if weight is None else _t(weight, "rms_norm weight")
    ls, lead, tail, n = _norm_labels(x, 1 if weight is None else weight.ndim)
    if weight is not None and weight.shape != x.shape[x.ndim - weight.ndim:]:
        raise ShapeError(f"rms_norm weight has shape {weight.shape}, expected {x.shape[x.ndim - weight.ndim:]}")
    x, weight, _, back = _widen_half(x, weight, None)
    ms = einsum(f"{ls}->{lead}", x, join=f"x0 * x0 * {1.0 / n!r}")
    if weight is None:
        return back(einsum(f"{ls},{lead}->{ls}", x, ms, join=f"x0 * rsqrt(x1 + {eps!r})"))
    return back(einsum(f"{ls},{lead},{tail}->{ls}", x, ms, weight, join=f"x0 * rsqrt(x1 + {eps!r}) * x2"))


def silu(x: Tensor) -> Tensor:
    return elementwise("silu", _t(x, "silu"))


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """torch's gelu: ``approximate`` is ``"none"`` (erf) or ``"tanh"``."""
    x = _t(x, "gelu")
    if not isinstance(approximate, str) or approximate not in ("none", "tanh"):
        raise EinjoinError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return x.gelu(approximate)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """torch's ``F.linear``: ``x @ weight.T + bias`` with ``weight`` of shape (out, in)."""
    x, weight = _t(x, "linear"), _t(weight, "linear weight")
    bias = None if bias is None else _t(bias, "linear bias")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(f"linear: input {x.shape} and weight {weight.shape} (out, in) do not fit")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ShapeError(f"linear: bias {bias.shape} does not fit weight {weight.shape}")
    if bias is None:
        return einsum("...i,oi->...o", x, weight)
    y = einsum("...i,oi->...o", x, weight)
    return y + bias


def rotate_half(x: Tensor) -> Tensor:
    """``cat(-x2, x1)`` of the two halves of the last dim (the usual rotary helper)."""
    x = _t(x, "rotate_half")
    d = x.shape[-1] if x.ndim else 1
    if d % 2:
        raise ShapeError(f"rotate_half: the last dim must be even, got shape {x.shape}")
    if x.dtype.startswith(("float", "bfloat")):  # one node (its gradient: the same, negated)
        return Tensor(rotate_half_node(x.node, -1))
    return concat([-x[..., d // 2:], x[..., : d // 2]], -1)


def rope(x: Tensor, base: float = 10000.0, start: int = 0) -> Tensor:
    """Rotary position embedding of ``x`` (..., seq, head_dim), positions ``start, start+1, ...``,
    in the rotate_half form of LLaMA: ``x * cos + rotate_half(x) * sin``. The cos/sin tables are
    fills, computed where they are needed."""
    x = _t(x, "rope")
    base = _real(base, "rope: base")
    if not 0 < base < math.inf:
        raise EinjoinError(f"rope: base must be a positive finite number, got {base!r}")
    if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)):
        raise EinjoinError(f"rope: start must be an int position, got {start!r}")
    start = int(start)
    if not -2 ** 53 < start < 2 ** 53:  # positions are computed in float64: exact below 2**53
        raise EinjoinError(f"rope: start must be an int of magnitude below 2**53, got {start}")
    if x.ndim < 2:
        raise ShapeError(f"rope: needs (..., seq, head_dim), got shape {x.shape}")
    s, d = x.shape[-2], x.shape[-1]
    if d % 2:
        raise ShapeError(f"rope: head_dim must be even, got shape {x.shape}")
    h = d // 2
    pos = f"(x0 + {start})" if start else "x0"
    angle = f"{pos} * pow({float(base)!r}, -2.0 * where(x1 < {h}, x1, x1 - {h}) / {d})"
    cos = fill((s, d), f"cos({angle})", x.dtype)
    sin = fill((s, d), f"sin({angle})", x.dtype)
    return elementwise(parse_join("x0 * x1 + x2 * x3", 4), x, cos, rotate_half(x), sin, name="rope")


def _repeat_heads(x: Tensor, group: int) -> Tensor:
    """(..., kv_heads, t, d) -> (..., kv_heads * group, t, d), each head repeated ``group`` times in
    a row (torch's ``repeat_interleave``, as grouped-query attention reads them)."""
    shape = x.shape[:-2] + (group,) + x.shape[-2:]
    y = x.unsqueeze(-3).broadcast_to(shape)
    return y.reshape(x.shape[:-3] + (x.shape[-3] * group,) + x.shape[-2:])


def _broadcast_batch(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v with their batch dims (all but the last two) broadcast to one shape, as torch's
    sdpa broadcasts them (a key set shared over the batch; the fused node takes one batch shape)."""
    try:
        batch = tuple(np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    except ValueError:
        raise ShapeError(f"attention: the batch dims of q {q.shape}, k {k.shape}, v {v.shape} do not "
                         f"broadcast") from None
    return tuple(x if x.shape[:-2] == batch else x.broadcast_to(batch + x.shape[-2:])  # type: ignore[return-value]
                 for x in (q, k, v))


def fused_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, causal: bool = False,
                    scale: float | None = None, window: int | None = None) -> Tensor:
    """torch's ``scaled_dot_product_attention`` as one fused node
    (:class:`~einjoin.ir.opkinds.Attention`): ``q`` (..., heads, L, E), ``k`` (..., kv_heads, S, E),
    ``v`` (..., kv_heads, S, Ev), fewer kv heads being repeated (grouped-query attention);
    ``mask`` bool (True: may attend) or additive in q's dtype, broadcastable to (..., heads, L, S);
    ``causal`` top-left aligned (key ``j`` for query ``i`` only where ``j <= i``), as torch's.
    A query with no allowed key gets zeros, as torch's. ``window`` (with ``causal``): a sliding
    window, query ``i`` sees keys ``i - window < j <= i`` (Mistral's); its blocks of queries
    read only their band of keys.

    >>> import einjoin as ej
    >>> q = ej.input("q", (2, 8, 16, 4)); kv = ej.input("kv", (2, 2, 16, 4))
    >>> out = fused_attention(q, kv, kv, causal=True)
    >>> out.shape, [n.kind for n in ej.Graph(out).ops][-1]
    ((2, 8, 16, 4), 'attention')
    """
    q, k, v = _t(q, "attention q"), _t(k, "attention k"), _t(v, "attention v")
    causal = _flag(causal, "attention: causal")
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} must have one rank >= 2")
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3] and 1 not in (q.shape[-3], k.shape[-3]):
        hq, hk = q.shape[-3], k.shape[-3]
        if hk == 0 or hq % hk or v.shape[-3] != hk:
            raise ShapeError(f"attention: {hq} query heads cannot share {hk} kv heads "
                             f"(q {q.shape}, k {k.shape}, v {v.shape})")
        k, v = _repeat_heads(k, hq // hk), _repeat_heads(v, hq // hk)
    q, k, v = _broadcast_batch(q, k, v)
    if scale is not None:
        scale = _real(scale, "attention: scale")
    node = None
    if mask is not None:
        mask = _t(mask, "attention mask")
        full = q.shape[:-1] + (k.shape[-2],)
        if mask.ndim > q.ndim or any(m not in (1, n) for m, n in zip(mask.shape[::-1], full[::-1])):
            raise ShapeError(f"attention: a mask of shape {mask.shape} does not broadcast to the scores' "
                             f"shape {full}")
        if mask.ndim < q.ndim:
            mask = mask.reshape((1,) * (q.ndim - mask.ndim) + mask.shape)
        node = mask.node
        # only a mask of the scores' own (L, S): a (1, S) or (L, 1) one is one row / column for all
        band = band_of(node, (full[-2], full[-1])) if window is None else None
        if band is not None:  # a constant causal / sliding-window mask: the flags' block sparsity instead
            node, causal, window = None, True, band[1]
    return Tensor(attention_node(q.node, k.node, v.node, node, causal, scale, window))


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: float | None = None,
              mask: Tensor | None = None, safe: bool = False, window: int | None = None) -> Tensor:
    """Scaled dot-product attention as one fused node (:func:`fused_attention`). ``q`` (..., heads,
    s, d), ``k`` (..., kv_heads, t, d), ``v`` (..., kv_heads, t, e); fewer kv heads than query heads
    is grouped-query attention. ``mask`` (bool, broadcastable to (s, t)) marks allowed pairs;
    ``causal`` adds the causal mask aligned to the bottom right (:func:`causal_mask`: the last
    query sees every key, as with a KV cache). A query that may attend nothing gets zeros, as
    torch's sdpa (``safe`` is that, always: the fused kernel gives no NaN there). ``window``
    (with ``causal``, ``s == t``): query ``i`` sees keys ``i - window < j <= i`` (Mistral's
    sliding window), computed by blocks over their band of keys only."""
    q, k, v = _t(q, "attention q"), _t(k, "attention k"), _t(v, "attention v")
    causal = _flag(causal, "attention: causal")
    _flag(safe, "attention: safe")
    if mask is not None:
        mask = _t(mask, "attention mask")
        if mask.dtype != "bool":
            raise DTypeError(f"attention: mask must be bool (True = may attend), got {mask.dtype}")
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} must have one rank >= 2")
    s, t = q.shape[-2], k.shape[-2]
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != t:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit")
    if window is not None and s != t:
        raise EinjoinError(f"attention: window={window} with {s} queries and {t} keys: a sliding window is "
                           f"top-left aligned (one query per key; no KV cache)")
    if causal and s != t:  # bottom-right aligned: the fused kind's causal flag is top-left
        cm = causal_mask(s, t)
        mask = cm if mask is None else (mask & cm)
        causal = False
    return fused_attention(q, k, v, mask, causal, scale, window)
