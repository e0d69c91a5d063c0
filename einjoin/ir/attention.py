"""Fused attention: the :class:`~einjoin.ir.opkinds.Attention` and
:class:`~einjoin.ir.opkinds.AttentionGrad` nodes (their constructors) and their kernels on dense
blocks, torch's CPU flash-attention kernels on zero-copy views of the numpy blocks.

Why a kind of its own rather than einsums: written as einsums, attention materialises the
``(..., L, S)`` score matrix and runs the mask, the softmax and their gradients as separate passes
over it; torch's fused kernel works in tiles and is several times faster. The kernels take a block
of query rows (its first row ``row0`` places the causal diagonal), so the forward node is cut over
its batch dims and its query rows; the gradient node over its batch dims.

Causal and sliding-window masks as block sparsity: a causal node with a ``window`` (keys
``i - window < j <= i``), or one whose block starts below row 0, runs its query rows by blocks of
:data:`BLOCK` (aligned to the whole query's rows), each over only the band of keys its mask
allows (:func:`key_band`); the key blocks outside the band are never read nor computed, and a
decomposition gives each query block only its band of k and v (the first key ``col0``). A causal
node without a window on whole rows keeps one call: torch's flash kernel skips the tiles above
the diagonal itself.

Numerics are torch's: float16/bfloat16 accumulate in float32 inside torch's kernel; a query with no
allowed key (every key masked, or ``S == 0``) gets zeros, as torch's ``scaled_dot_product_attention``;
``E == 0`` averages the allowed values (every score 0), and a causal node with a scale <= 0 gets
torch's math-kernel values (torch's flash kernels give NaN rows there: the causal part is then a mask).

>>> import numpy as np
>>> from einjoin.ir import ops
>>> q = ops.input_node("q", (2, 5, 4), "float32"); v = ops.input_node("v", (2, 7, 3), "float32")
>>> a = attention_node(q, ops.input_node("k", (2, 7, 4), "float32"), v, causal=True)
>>> a.shape, a.op
((2, 5, 3), Attention(scale=0.5, causal=True))
>>> x = np.ones((1, 2, 4), np.float32)
>>> attention_kernel(x, x, x, None, 0.5, True)
array([[[1., 1., 1., 1.],
        [1., 1., 1., 1.]]], dtype=float32)
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.ir.dtypes import is_bfloat16, kind, numpy_dtype
from einjoin.ir.node import Attention, AttentionGrad, Node

__all__ = ["attention_node", "attention_grad_node", "grad_rows", "attention_kernel", "attention_grad_kernel",
           "attention_torch", "attention_grad_torch", "GRAD_PARTS", "ForwardMemo", "forward_memo", "BLOCK",
           "key_band", "band_pairs", "check_window"]

BLOCK = 128  # query rows per block of a banded (windowed, or causal below row 0) kernel

GRAD_PARTS = ("q", "k", "v")  # the order of the stacked gradients (and of the node's inputs)


def _check(q: Node, k: Node, v: Node, mask: Node | None, what: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Node):
            raise EinjoinError(f"{what}: {name} must be an einjoin tensor, got {type(x).__name__}")
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShapeError(f"{what}: {shapes} must share one rank >= 2 ((..., L, E), (..., S, E), (..., S, Ev))")
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-2] != q.shape[:-2]:
        raise ShapeError(f"{what}: {shapes} must share their batch dims {q.shape[:-2]} (broadcast k and v "
                         f"first: grouped-query attention repeats them)")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ShapeError(f"{what}: {shapes}: q and k need one feature size E, k and v one key count S")
    if kind(q.dtype) != "float" or k.dtype != q.dtype or v.dtype != q.dtype:
        raise DTypeError(f"{what}: q, k and v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is None:
        return
    if not isinstance(mask, Node):
        raise EinjoinError(f"{what}: the mask must be an einjoin tensor, got {type(mask).__name__}")
    if mask.dtype not in ("bool", q.dtype):
        raise DTypeError(f"{what}: the mask is {mask.dtype}; it must be bool (True: may attend) or additive "
                         f"in the queries' dtype {q.dtype}")
    full = q.shape[:-1] + (k.shape[-2],)
    if mask.ndim != q.ndim or any(m not in (1, n) for m, n in zip(mask.shape, full)):
        raise ShapeError(f"{what}: a mask of shape {mask.shape} for scores of shape {full}: it needs q's rank "
                         f"{q.ndim}, each dim 1 or the scores' (reshape it to that rank first)")


def _scale(scale: Any, e: int, what: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(e) if e else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise EinjoinError(f"{what}: scale must be a real number, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise EinjoinError(f"{what}: scale must be finite, got {scale!r}")
    return float(scale)


def check_window(window: Any, causal: Any, what: str) -> int | None:
    """``window`` as an int >= 1 (or None), refused without ``causal`` (a sliding window over the
    past keys, as Mistral's: query ``i`` sees keys ``i - window < j <= i``)."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
        raise EinjoinError(f"{what}: window must be an int >= 1 or None, got {window!r}")
    if window < 1:
        raise EinjoinError(f"{what}: window must be >= 1 (query i sees keys i - window < j <= i), got {window}")
    if not causal:
        raise EinjoinError(f"{what}: window={window} needs causal=True (a sliding window over the past keys; "
                           f"for another pattern pass a mask)")
    return int(window)


def attention_node(q: Node, k: Node, v: Node, mask: Node | None = None, causal: bool = False,
                   scale: float | None = None, window: int | None = None) -> Node:
    """``softmax(q k^T * scale + mask) v`` as one :class:`~einjoin.ir.opkinds.Attention` node
    (``scale`` defaults to ``1 / sqrt(E)``; ``causal`` is top-left aligned, as torch's;
    ``window`` with ``causal``: query ``i`` sees keys ``i - window < j <= i``).

    >>> from einjoin.ir import ops
    >>> q = ops.input_node("q", (2, 4, 6, 8), "float32")
    >>> attention_node(q, q, q, causal=True).shape
    (2, 4, 6, 8)
    >>> attention_node(q, q, q, causal=True, window=3, scale=0.5).op
    Attention(scale=0.5, causal=True, window=3)
    """
    what = "attention"
    _check(q, k, v, mask, what)
    if not isinstance(causal, (bool, np.bool_)):
        raise EinjoinError(f"{what}: causal must be True or False, got {causal!r}")
    op = Attention(_scale(scale, q.shape[-1], what), bool(causal), check_window(window, causal, what))
    shape = q.shape[:-1] + (v.shape[-1],)
    return Node(op, (q, k, v) if mask is None else (q, k, v, mask), shape, q.dtype)


def grad_rows(q: Node, k: Node, parts: Sequence[str]) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` of each of ``parts`` (``q``, ``k``, ``v``) in a stacked gradient."""
    out, at = [], 0
    for p in parts:
        n = q.shape[-2] if p == "q" else k.shape[-2]
        out.append((at, at + n))
        at += n
    return out


def attention_grad_node(fwd: Node, dout: Node, parts: Sequence[str]) -> Node:
    """The gradients ``parts`` of the attention node ``fwd`` given its output's cotangent ``dout``:
    a run of ``("q", "k", "v")`` sharing one last dim, stacked along dim -2 (see
    :func:`grad_rows`), or ``("mask",)``, an additive mask's gradient.

    >>> from einjoin.ir import ops
    >>> q = ops.input_node("q", (2, 6, 8), "float32"); k = ops.input_node("k", (2, 5, 8), "float32")
    >>> a = attention_node(q, k, k)
    >>> attention_grad_node(a, ops.input_node("g", (2, 6, 8), "float32"), ("q", "k", "v")).shape
    (2, 16, 8)
    """
    if not isinstance(fwd.op, Attention):  # the IR may look at its own classes
        raise EinjoinError(f"attention_grad_node: {fwd} is no attention node")
    q, k, v = fwd.inputs[:3]
    mask = fwd.inputs[3] if len(fwd.inputs) > 3 else None
    if not isinstance(dout, Node) or dout.shape != fwd.shape or dout.dtype != fwd.dtype:
        raise ShapeError(f"attention gradient: the cotangent {getattr(dout, 'shape', dout)} must have the "
                         f"output's shape {fwd.shape} and dtype {fwd.dtype}")
    parts = tuple(parts)
    widths = {"q": q.shape[-1], "k": k.shape[-1], "v": v.shape[-1]}
    if parts == ("mask",):
        if mask is None or mask.dtype == "bool":
            raise EinjoinError("attention gradient: only an additive (float) mask has a gradient")
        shape = mask.shape
    elif (not parts or any(p not in GRAD_PARTS for p in parts) or list(parts) != sorted(parts, key=GRAD_PARTS.index)
          or len(set(parts)) != len(parts) or len({widths[p] for p in parts}) != 1):
        raise EinjoinError(f"attention gradient: parts {parts} must be ('mask',) or distinct q, k, v in that "
                           f"order sharing one last dim (widths {widths})")
    else:
        shape = q.shape[:-2] + (grad_rows(q, k, parts)[-1][1], widths[parts[0]])
    op = AttentionGrad(fwd.op.scale, fwd.op.causal, parts, fwd.op.window)
    return Node(op, (q, k, v, dout) if mask is None else (q, k, v, dout, mask), shape, fwd.dtype)


# ---------------------------------------------------------------- kernels (torch on numpy views)


def _view(x: np.ndarray) -> Any:
    """``x`` as a torch tensor sharing its memory (bfloat16 through its bits)."""
    import torch
    x = np.asarray(x)
    if is_bfloat16(x.dtype):
        return _view(x.view(np.int16)).view(torch.bfloat16)
    if any(s < 0 for s in x.strides):
        x = np.ascontiguousarray(x)
    if x.flags.writeable:
        return torch.from_numpy(x)
    with warnings.catch_warnings():  # torch warns of a read-only array; the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x)


def _array(t: Any, dtype: str) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:
        return np.asarray(t.contiguous().view(torch.int16).numpy()).view(numpy_dtype("bfloat16"))
    return np.asarray(t.contiguous().numpy()).astype(numpy_dtype(dtype), copy=False)


def _four(t: Any, batch: tuple[int, ...]) -> Any:
    """(*batch, rows, cols) as torch's (B, H, rows, cols)."""
    lead = (1, 1) if not batch else (1, batch[0]) if len(batch) == 1 else (math.prod(batch[:-1]), batch[-1])
    return t.reshape(lead + tuple(t.shape[-2:]))


def _mask(m: Any, like: Any, batch: tuple[int, ...], rows: int, cols: int, row0: int,
          causal: bool, fold: bool, window: int | None = None, col0: int = 0) -> tuple[Any, bool]:
    """(the additive mask of a block of ``rows`` queries starting at row ``row0``, as torch's 4-D
    (B, H, rows, cols), in the dtype and on the device of ``like``, or None; whether torch's own
    top-left ``is_causal`` is still to apply). The causal part joins the mask when ``fold``
    (torch's math kernel takes no mask with ``is_causal``; the flash kernel's own causal mask is
    NaN for a scale <= 0) or below the first row (its diagonal starts at ``row0``), or with a
    ``window`` or keys from ``col0`` on (torch's causal mask knows neither)."""
    import torch
    dtype, device = like.dtype, like.device
    if m is not None and m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    if causal and (row0 or fold or window is not None or col0):
        # made on q's device: torch's sdpa takes no mask from another device
        i = torch.arange(row0, row0 + rows, device=device).unsqueeze(1)
        j = torch.arange(col0, col0 + cols, device=device)
        off = j > i if window is None else (j > i) | (j <= i - window)
        c = torch.zeros((rows, cols), dtype=dtype, device=device).masked_fill_(off, float("-inf"))
        m = c if m is None else m + c
        causal = False
    if m is None:
        return None, causal
    return _four(m.expand(batch + (rows, cols)), batch), causal


def _flash(q: Any, v: Any) -> bool:
    # torch's CPU flash kernel: one head size for q, k and v (elsewhere: torch's sdpa dispatch)
    return bool(q.shape[-1] == v.shape[-1] and q.device.type == "cpu")


def _fold(q: Any, v: Any, mask: Any, scale: float) -> bool:
    """Whether the causal part must be an additive mask: torch's math kernel takes no mask with
    ``is_causal``, and its flash kernels (CPU and GPU) mask causally with ``-inf * scale``, NaN
    for a scale that is <= 0 in float32, the kernels' accumulation type (torch 2.13)."""
    return (mask is not None and not _flash(q, v)) or not _positive(scale)


def _positive(scale: float) -> bool:
    # above float32's normal range's floor (a smaller scale may round to 0 in the kernel; folding
    # the causal mask is always right, only a little slower)
    return scale > float(np.finfo(np.float32).tiny)


def _feature_pad(x: Any) -> Any:
    # E == 0: every score is 0; one zero feature gives the kernels the same scores
    import torch
    return torch.zeros(tuple(x.shape[:-1]) + (1,), dtype=x.dtype, device=x.device)


def key_band(a: int, b: int, window: int | None, n_keys: int) -> tuple[int, int]:
    """The keys ``[lo, hi)`` a causal block of query rows ``[a, b)`` may see (window: the
    sliding window's) among ``n_keys``; ``lo == hi`` where it sees none.

    >>> key_band(256, 384, None, 1000), key_band(256, 384, 64, 1000), key_band(0, 128, 64, 50)
    ((0, 384), (193, 384), (0, 50))
    """
    lo = 0 if window is None else max(0, a - window + 1)
    hi = min(n_keys, b)
    return min(lo, hi), hi


def _blocks(a: int, b: int) -> list[tuple[int, int]]:
    """Rows ``[a, b)`` cut where the whole query's :data:`BLOCK` rows are."""
    cuts = [a] + list(range((a // BLOCK + 1) * BLOCK, b, BLOCK)) + [b]
    return [(x, y) for x, y in zip(cuts, cuts[1:]) if y > x]


def band_pairs(row0: int, rows: int, window: int | None, n_keys: int, col0: int = 0, cols: int | None = None
               ) -> int:
    """The query-key pairs a causal kernel of query rows ``[row0, row0 + rows)`` over keys
    ``[col0, col0 + cols)`` computes: by :data:`BLOCK` rows, each block over its band of keys
    (:func:`key_band`); without a window on whole rows from row 0, torch's flash kernel's own
    skip, counted as the causal half.

    >>> [round(band_pairs(0, 8192, w, 8192) / 8192 ** 2, 4) for w in (None, 1024)]
    [0.5001, 0.1317]
    """
    cols = n_keys - col0 if cols is None else cols
    if window is None and row0 == 0 and col0 == 0:  # sum(min(cols, i + 1) for i in range(rows))
        d = min(rows, cols)
        return d * (d + 1) // 2 + (rows - d) * cols
    n = 0
    for a, b in _blocks(row0, row0 + rows):
        lo, hi = key_band(a, b, window, n_keys)
        lo, hi = max(lo, col0), min(hi, col0 + cols)
        n += (b - a) * max(0, hi - lo)
    return n


def attention_torch(q: Any, k: Any, v: Any, mask: Any, scale: float, causal: bool, row0: int = 0,
                    window: int | None = None, col0: int = 0) -> Any:
    """:func:`attention_kernel` on torch tensors (any device; the result on q's)."""
    return _forward_torch(q, k, v, mask, scale, causal, row0, window, col0)[0]


def _forward_torch(q: Any, k: Any, v: Any, mask: Any, scale: float, causal: bool, row0: int = 0,
                   window: int | None = None, col0: int = 0) -> tuple[Any, Any]:
    """(:func:`attention_torch`'s result, and (torch's 4-D output, its log-sum-exp) where torch's
    flash kernel computed them in one call, the two its fused backward needs; else None)."""
    if causal and (window is not None or row0 or col0):
        return _banded(q, k, v, mask, scale, row0, window, col0), None
    return _forward_call(q, k, v, mask, scale, causal, row0, window, col0)


def _band_masks(q: Any, mask: Any, row0: int, rows: int, col0: int, cols: int, window: int | None
                ) -> Iterator[tuple[int, int, int, int, Any]]:
    """``(a, b, lo, hi, m)`` per :data:`BLOCK` of query rows ``[a, b)`` that sees a key: its band of
    keys ``[lo, hi)`` and its additive mask there (the user's ``mask`` too, sliced: its dims of
    size 1 broadcast). Every block's mask is a slice of one template (a block's mask depends only
    on its first row's distance to its first key), made once: a mask per block cost more than
    the block's attention."""
    import torch
    blocks = [(a, b, max(lo, col0), hi) for a, b in _blocks(row0, row0 + rows)
              for lo, hi in [key_band(a, b, window, col0 + cols)]]
    blocks = [(a, b, lo, hi) for a, b, lo, hi in blocks if hi > lo]  # the others see no key: zeros
    if not blocks:
        return
    # template[r, c]: block row r may see column c where r + reach - window < c <= r + reach
    reach = max(a - lo for a, _, lo, _ in blocks)
    r = torch.arange(BLOCK, device=q.device).unsqueeze(1)
    c = torch.arange(BLOCK + reach, device=q.device)
    off = (c > r + reach) if window is None else (c > r + reach) | (c <= r + reach - window)
    template = torch.zeros((BLOCK, BLOCK + reach), dtype=q.dtype, device=q.device).masked_fill_(off, float("-inf"))
    for a, b, lo, hi in blocks:
        s = reach - (a - lo)
        m = template[:b - a, s:s + hi - lo]
        if mask is not None:
            u = mask[..., slice(a - row0, b - row0) if mask.shape[-2] > 1 else slice(None),
                     slice(lo - col0, hi - col0) if mask.shape[-1] > 1 else slice(None)]
            m = torch.where(u, m, float("-inf")) if u.dtype == torch.bool else m + u
        yield a, b, lo, hi, m


def _banded(q: Any, k: Any, v: Any, mask: Any, scale: float, row0: int, window: int | None, col0: int) -> Any:
    """A causal (windowed) kernel by :data:`BLOCK` query rows, each over its band of keys only:
    the key blocks its mask hides entirely are never read (block sparsity)."""
    import torch
    out = torch.zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype, device=q.device)
    for a, b, lo, hi, m in _band_masks(q, mask, row0, q.shape[-2], col0, k.shape[-2], window):
        keys = slice(lo - col0, hi - col0)
        out[..., a - row0:b - row0, :] = _forward_call(q[..., a - row0:b - row0, :], k[..., keys, :], v[..., keys, :],
                                                       m, scale, False, a, None, lo)[0]
    return out


def _banded_grad(q: Any, k: Any, v: Any, dout: Any, mask: Any, scale: float, window: int | None,
                 parts: Sequence[str]) -> Any:
    """dq, dk, dv of a windowed attention (torch's flash kernels, E == Ev) by :data:`BLOCK` query
    rows over their bands, as the forward: per block its flash forward (the log-sum-exp the
    backward needs) and fused backward; dk and dv sum the blocks' (float32)."""
    import torch
    batch = tuple(q.shape[:-2])
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    got = {p: torch.zeros(x.shape, dtype=torch.float32, device=q.device) for p, x in zip(GRAD_PARTS, (q, k, v))}
    with torch.no_grad():
        for a, b, lo, hi, m in _band_masks(q, mask, 0, q.shape[-2], 0, k.shape[-2], window):
            tq, tk, tv, tg = (_four(x, batch) for x in (q[..., a:b, :], k[..., lo:hi, :], v[..., lo:hi, :],
                                                        dout[..., a:b, :]))
            m4 = _four(m.expand(batch + (b - a, hi - lo)), batch)
            out, lse = flash(tq, tk, tv, 0.0, False, attn_mask=m4, scale=scale)[:2]
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                tg, tq, tk, tv, out, lse, 0.0, False, attn_mask=m4, scale=scale)
            got["q"][..., a:b, :] += gq.reshape(batch + (b - a, q.shape[-1]))
            got["k"][..., lo:hi, :] += gk.reshape(batch + (hi - lo, k.shape[-1]))
            got["v"][..., lo:hi, :] += gv.reshape(batch + (hi - lo, v.shape[-1]))
    pieces = [got[p].to(q.dtype) for p in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)


def _forward_call(q: Any, k: Any, v: Any, mask: Any, scale: float, causal: bool, row0: int,
                  window: int | None, col0: int) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as tf
    batch, rows, cols = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    if v.numel() == 0 or rows == 0:
        return torch.zeros(out_shape, dtype=q.dtype, device=q.device), None
    padded = q.shape[-1] == 0
    if padded:
        q, k = _feature_pad(q), _feature_pad(k)
    tq, tk, tv = (_four(x, batch) for x in (q, k, v))
    m, is_causal = _mask(mask, q, batch, rows, cols, row0, causal, _fold(q, v, mask, scale), window, col0)
    saved = None
    with torch.no_grad():
        if _flash(q, v):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                tq, tk, tv, 0.0, is_causal, attn_mask=m, scale=scale)[:2]
            saved = None if padded else (out, lse)
        else:
            out = tf.scaled_dot_product_attention(tq, tk, tv, attn_mask=m, is_causal=is_causal, scale=scale)
            out = torch.nan_to_num(out, nan=0.0)  # a row with no key: 0, as the flash kernel's
    return out.reshape(out_shape), saved


def attention_grad_torch(q: Any, k: Any, v: Any, dout: Any, mask: Any, scale: float, causal: bool,
                         parts: Sequence[str], saved: tuple[Any, Any] | None = None, window: int | None = None
                         ) -> Any:
    """:func:`attention_grad_kernel` on torch tensors (any device; the result on q's). ``saved``:
    the flash forward's (4-D output, log-sum-exp) of these very q, k, v and mask (from
    :class:`ForwardMemo`), which the fused backward then takes instead of running the forward
    again."""
    import torch
    import torch.nn.functional as tf
    batch, rows, cols = tuple(q.shape[:-2]), q.shape[-2], k.shape[-2]
    width = (v if parts == ("v",) else q).shape[-1]
    if v.numel() == 0 or rows == 0 or (parts != ("mask",) and width == 0):
        shape = tuple(mask.shape) if parts == ("mask",) else batch + (
            sum(rows if p == "q" else cols for p in parts), width)
        return torch.zeros(shape, dtype=q.dtype, device=q.device)
    if q.shape[-1] == 0:  # only dv or the mask's gradient are wanted (dq and dk are empty)
        q, k = _feature_pad(q), _feature_pad(k)
    if window is not None and parts != ("mask",) and _flash(q, v) and _positive(scale):
        return _banded_grad(q, k, v, dout, mask, scale, window, parts)  # over the bands only
    tq, tk, tv, tg = (_four(x, batch) for x in (q, k, v, dout))
    if parts == ("mask",) or not _flash(q, v):
        # autograd of torch's sdpa: the one that differentiates a mask; a row with no key has
        # NaN gradients there (softmax of -inf throughout), torch's flash kernel gives 0
        leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
        tm = mask
        if parts == ("mask",):
            tm = mask.detach().clone().requires_grad_()
        with torch.enable_grad():
            m4 = None if tm is None else tm.expand(batch + (rows, cols))
            m4, is_causal = _mask(m4, q, batch, rows, cols, 0, causal, m4 is not None or not _positive(scale), window)
            out = tf.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], attn_mask=m4, is_causal=is_causal,
                                                  scale=scale)
            wrt = [tm] if parts == ("mask",) else [leaves[GRAD_PARTS.index(p)] for p in parts]
            grads = torch.autograd.grad(out, wrt, tg)
        if parts == ("mask",):
            return torch.nan_to_num(grads[0], nan=0.0)
        got = dict(zip(parts, (torch.nan_to_num(g, nan=0.0) for g in grads)))
    else:
        m, is_causal = _mask(mask, q, batch, rows, cols, 0, causal, _fold(q, v, mask, scale), window)
        with torch.no_grad():
            if saved is None:
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    tq, tk, tv, 0.0, is_causal, attn_mask=m, scale=scale)[:2]
            else:  # the forward's own (the same call on the same blocks: the same bits)
                out, lse = saved
            got = dict(zip(GRAD_PARTS, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                tg, tq, tk, tv, out, lse, 0.0, is_causal, attn_mask=m, scale=scale)))
    pieces = [got[p].reshape(batch + tuple(got[p].shape[-2:])) for p in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)


def _name(x: np.ndarray) -> str:
    return "bfloat16" if is_bfloat16(x.dtype) else str(x.dtype)


class ForwardMemo:
    """The flash forward's (4-D output, log-sum-exp) of the attention blocks of one run, for the
    gradient kernels of the same blocks: torch's fused backward needs both, and the graph keeps
    only the output (a node has one), so without them the gradient kernel runs the forward again
    (a third of its time: the small LLaMA's training step spent 11 ms of ~200 ms CPU there).

    Keyed by the identity of the q, k, v (and mask) arrays -- a run's blocks are never written
    once produced, and the kernels must see the same blocks (rows and all): a forward cut into
    row blocks, or blocks the gradient reads through another copy, simply miss -- and held only
    while q is alive (a weak reference: the entry goes with q's last reader). A runtime scopes
    one memo to one run's threads (:func:`forward_memo`), so a user's array written in place
    between runs can never meet a stale entry.

    >>> memo = ForwardMemo(); q = np.ones((1, 2, 4), np.float32)
    >>> with forward_memo(memo):
    ...     out = attention_kernel(q, q, q, None, 0.5, True)
    ...     dq = attention_grad_kernel(q, q, q, q, None, 0.5, True, ("q",))
    >>> memo.hits, len(memo)
    (1, 1)
    """

    def __init__(self) -> None:
        self._items: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Drop every entry (a run's end: an entry must not outlive its run)."""
        with self._lock:
            self._items.clear()

    @staticmethod
    def _key(arrays: Sequence[Any], scale: float, causal: bool) -> tuple[Any, ...] | None:
        if not all(a is None or type(a) is np.ndarray for a in arrays):
            return None
        return (tuple(id(a) for a in arrays), scale, causal)

    def keep(self, arrays: Sequence[Any], scale: float, causal: bool, saved: tuple[Any, Any]) -> None:
        key = self._key(arrays, scale, causal)
        if key is None:
            return

        def gone(_: Any, key: tuple[Any, ...] = key) -> None:  # q died: its entry goes
            with self._lock:
                entry = self._items.get(key)
                if entry is not None and entry[0][0] is ref:
                    del self._items[key]
        ref = weakref.ref(arrays[0], gone)
        refs = (ref, *(None if a is None else weakref.ref(a) for a in arrays[1:]))
        with self._lock:
            self._items[key] = (refs, saved)

    def find(self, arrays: Sequence[Any], scale: float, causal: bool) -> tuple[Any, Any] | None:
        key = self._key(arrays, scale, causal)
        entry = self._items.get(key) if key is not None else None
        if entry is None or any((r is None) != (a is None) or (r is not None and r() is not a)
                                for r, a in zip(entry[0], arrays)):
            return None  # none, or an id reused by another array
        self.hits += 1
        saved: tuple[Any, Any] = entry[1]
        return saved


_SCOPE = threading.local()  # .memo: the ForwardMemo of the run this thread works for


@contextlib.contextmanager
def forward_memo(memo: ForwardMemo | None) -> Iterator[None]:
    """Within the block, this thread's attention kernels keep their forwards in ``memo`` and
    their gradient kernels take them from it (None: neither)."""
    before = getattr(_SCOPE, "memo", None)
    _SCOPE.memo = memo
    try:
        yield
    finally:
        _SCOPE.memo = before


def attention_kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                     causal: bool, row0: int = 0, window: int | None = None, col0: int = 0) -> np.ndarray:
    """The attention of a block of queries ``q`` (``..., Lb, E``; its first row is row ``row0`` of
    the whole query, which places the causal diagonal) over the keys ``k`` (its first row is key
    ``col0``: a causal block reads only the keys up to its last row, a windowed one its band):
    torch's CPU flash kernel (its math kernel where the value size differs from E), on views of
    the blocks; a banded one by :data:`BLOCK` rows, each over its band.

    >>> x = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
    >>> attention_kernel(x[:, 1:], x, x, None, 0.0, True, row0=1)   # row 1 sees rows 0 and 1 alike
    array([[[2., 3., 4., 5.]]], dtype=float32)
    """
    out, saved = _forward_torch(_view(q), _view(k), _view(v), None if mask is None else _view(mask), scale, causal,
                                row0, window, col0)
    memo: ForwardMemo | None = getattr(_SCOPE, "memo", None)
    if memo is not None and saved is not None and row0 == 0:  # a gradient's forward starts at row 0
        memo.keep((q, k, v, mask), scale, causal, saved)
    return _array(out, _name(q))


def attention_grad_kernel(q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray, mask: np.ndarray | None,
                          scale: float, causal: bool, parts: Sequence[str], window: int | None = None) -> np.ndarray:
    """The gradients ``parts`` of the attention of whole query rows (``q`` ``..., L, E``), stacked
    along dim -2, or an additive mask's gradient (``parts == ("mask",)``): torch's fused CPU
    backward after its forward (which recomputes the softmax statistics, the score matrix never
    being stored, unless this run's :class:`ForwardMemo` kept them), or autograd of torch's sdpa
    (a value size other than E; the mask).

    >>> x = np.ones((1, 2, 4), np.float32)
    >>> attention_grad_kernel(x, x, x, x, None, 0.5, False, ("v",))[0]    # dv: each key gets half
    array([[1., 1., 1., 1.],
           [1., 1., 1., 1.]], dtype=float32)
    """
    memo: ForwardMemo | None = getattr(_SCOPE, "memo", None)
    # a windowed forward keeps nothing (it runs by blocks): its gradient finds nothing either
    saved = (memo.find((q, k, v, mask), scale, causal) if memo is not None and tuple(parts) != ("mask",)
             and window is None else None)
    out = attention_grad_torch(_view(q), _view(k), _view(v), _view(dout), None if mask is None else _view(mask),
                               scale, causal, tuple(parts), saved, window)
    return _array(out, _name(q))
