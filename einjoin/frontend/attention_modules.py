"""``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` as the
einsums they are, for the torch.fx path (which keeps these modules whole; torch.export traces
through them into ATen ops the op table translates). :func:`multi_head_attention` follows
``F.multi_head_attention_forward``: in-projection (packed or separate q/k/v weights), per-head
scaled scores, the attention mask and key-padding mask (bool: True is masked out; float: added),
softmax, the values, the out-projection, and the head-averaged weights when asked for.

:data:`ATTENTION_MODULES` is merged into ``nn_modules.MODULES``; each reads the module's
sub-module weights under their dotted names (``out_proj.weight``).

**Which of torch's paths an import follows.** torch computes these modules in eval mode on one
of two paths that give different values for some inputs: the *slow* path (the module's Python
code; what torch.export traces) and the *fast* path (fused kernels, and for ``TransformerEncoder``
with a ``src_key_padding_mask`` a nested tensor without the padded positions). torch takes the
fast path only when no autograd is recorded (``torch.no_grad()``, or nothing involved requires
grad) and the module qualifies (``batch_first``, an even number of heads, bool masks for
``MultiheadAttention``, not ``norm_first`` for the nested encoder, ...: :func:`_encoder_static`
and its siblings list torch's conditions). Where they differ:

- ``TransformerEncoder`` (nested path): the output is 0 at padded positions (then its ``norm``),
  when every row's padding is at its end (``mask_check=True``, the default; checked on the data,
  as torch does) or always, padding taken as the last ``count`` positions (``mask_check=False``);
- a query that may attend no key (a fully padded row, a fully masked attention row) gets NaN on
  the fast path and zeros from the slow path's ``scaled_dot_product_attention`` (the output is
  then the out-projection's bias); ``need_weights=True`` gives NaN on both;
- the fast path ignores an ``is_causal`` hint (the mask decides; no mask: no masking), the slow
  path replaces the mask by the causal one when no key padding mask is given and refuses the
  hint without a mask; ``nn.GELU(approximate="tanh")`` is exact GELU on the layer's fast path.

An import follows the path torch takes for the same call made **where ``from_torch`` is called**:
under ``torch.no_grad()`` (or with no parameter and no example input requiring grad) the fast
path, otherwise the slow one (the parameters a module reads and its input are taken to require
grad when grad is enabled and any parameter of the imported module, or an example input, does).
A recapture for new shapes keeps the first import's choice. When the choice can change values
(masks given), ``TorchFunction.notes`` says which path was followed and how to get the other.
``MultiheadAttention``'s fast path also needs query, key and value to be one tensor: inside a
module (``self.attn(x, x, x)``) that is seen; an imported ``MultiheadAttention`` called as
``mha(q, q, q)`` is traced on copies (the program takes distinct tensors), so its slow path.
Both captures agree: torch.fx through these translations, torch.export through the same rules
written in torch ops (:func:`export_forwards`), since export traces the slow path. (torch also
takes the slow path inside ``torch.autocast``: the export capture sees such a region, the fx
translations do not.)

>>> import einjoin as ej
>>> q = ej.input("q", (2, 5, 8)); w = ej.input("w", (24, 8)); o = ej.input("o", (8, 8))
>>> out, weights = multi_head_attention(q, q, q, 2, w, None, o, None, batch_first=True)
>>> out.shape, weights.shape
((2, 5, 8), (2, 5, 5))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from einjoin.errors import EinjoinError, ShapeError, UnsupportedOpError
from einjoin.frontend import aten
from einjoin.frontend import composites as C
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor, _t, einsum

__all__ = ["multi_head_attention", "ATTENTION_MODULES", "ImportPaths", "paths_at_import", "following",
           "forced", "export_forwards"]


def _additive(mask: Any, dtype: str, what: str) -> Tensor | None:
    """A bool mask (True: masked out) as -inf / 0, or a float mask as it is (in ``dtype``)."""
    if mask is None:
        return None
    m = _t(mask, what)
    if m.dtype == "bool":
        return F.where(m, float("-inf"), F.zeros((), dtype))
    return m if m.dtype == dtype else m.to(dtype)


def _no_causal_mask() -> EinjoinError:
    return ShapeError("multi_head_attention: is_causal=True needs the attn_mask too (torch: 'Need attn_mask if "
                      "specifying the is_causal hint'; nn.Transformer.generate_square_subsequent_mask makes one)")


def multi_head_attention(query: Tensor, key: Tensor, value: Tensor, num_heads: int, in_proj_weight: Tensor | None,
                         in_proj_bias: Tensor | None, out_proj_weight: Tensor, out_proj_bias: Tensor | None, *,
                         q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
                         v_proj_weight: Tensor | None = None, key_padding_mask: Tensor | None = None,
                         attn_mask: Tensor | None = None, need_weights: bool = True,
                         average_attn_weights: bool = True, is_causal: bool = False,
                         batch_first: bool = False, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """torch's multi-head attention forward (no dropout, no bias_k / bias_v, no zero attention):
    (the output, the attention weights — averaged over heads unless ``average_attn_weights`` is
    False — or None when ``need_weights`` is False).

    As ``F.multi_head_attention_forward`` (``fused=False``): ``is_causal`` needs ``attn_mask`` and,
    without weights or a key padding mask, means the causal mask instead of it; without weights a
    query that may attend no key gets zeros (``scaled_dot_product_attention``), with weights NaN.
    ``fused=True`` is torch's fused fast path: the masks as given, ``is_causal`` ignored, NaN for
    such a query either way."""
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
    safe = not (fused or need_weights)  # scaled_dot_product_attention: a query with no key gets zeros
    if fused:
        is_causal = False  # the fused kernels take the masks as they are
    elif is_causal and attn_mask is None:
        raise _no_causal_mask()
    if is_causal and key_padding_mask is None and not need_weights:
        mask: Tensor | None = F.where(F.fill((tl, s), "x1 > x0", "bool"), float("-inf"), F.zeros((), scores.dtype))
    else:
        mask = _additive(attn_mask, scores.dtype, "mha attn_mask")
    if mask is not None and mask.ndim == 3:  # (B * H, L, S)
        mask = mask.reshape((b, h, tl, s))
    pad = _additive(key_padding_mask, scores.dtype, "mha key_padding_mask")
    if pad is not None:
        pad = pad.reshape((b, 1, 1, s))
        mask = pad if mask is None else mask + pad
    if mask is not None:
        scores = scores + mask
    p = C.softmax(scores, -1, safe=safe)
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


# ---------------------------------------------------------------- which of torch's paths


@dataclass(frozen=True)
class ImportPaths:
    """The autograd state of the call an import stands for: grad enabled where ``from_torch`` was
    called, and whether an example input requires grad (with the parameters' ``requires_grad``,
    this decides torch's fast or slow path)."""

    grad_enabled: bool
    inputs_require_grad: bool = False


@dataclass
class _Following:
    paths: ImportPaths
    top: Any
    names: dict[int, str]
    fastpath: bool
    notes: dict[str, str] = field(default_factory=dict)
    inside: int = 0


_FORCED: ContextVar[ImportPaths | None] = ContextVar("einjoin_forced_paths", default=None)
_FOLLOWING: ContextVar[_Following | None] = ContextVar("einjoin_attention_paths", default=None)


def paths_at_import(args: Any, kwargs: Any) -> ImportPaths:
    """The grad state now (the first import's inside a recapture: :func:`forced`)."""
    given = _FORCED.get()
    if given is not None:
        return given
    import torch
    from torch.utils._pytree import tree_leaves
    tensors = [t for t in tree_leaves((tuple(args), dict(kwargs or {}))) if isinstance(t, torch.Tensor)]
    return ImportPaths(torch.is_grad_enabled(), any(t.requires_grad for t in tensors))


@contextlib.contextmanager
def following(module: Any, paths: ImportPaths) -> Iterator[list[str]]:
    """While importing ``module``: the translations and :func:`export_forwards` follow torch's path
    for ``paths``; the list yielded gets, on exit, a note per module where that choice matters."""
    import torch
    notes: list[str] = []
    named = module.named_modules() if isinstance(module, torch.nn.Module) else ()  # else from_torch refuses it
    state = _Following(paths, module, {id(m): n for n, m in named}, bool(torch.backends.mha.get_fastpath_enabled()))
    token = _FOLLOWING.set(state)
    try:
        yield notes
    finally:
        _FOLLOWING.reset(token)
        notes.extend(state.notes.values())


@contextlib.contextmanager
def forced(paths: ImportPaths) -> Iterator[None]:
    """Imports inside take ``paths`` as their grad state (a recapture runs inside ``Program.run``, in
    whatever grad mode the caller is in then: it keeps the first import's)."""
    token = _FORCED.set(paths)
    try:
        yield
    finally:
        _FORCED.reset(token)


def _device_reason(tensors: list[Any]) -> str:
    import torch
    ok = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
    bad = sorted({t.device.type for t in tensors if t is not None and t.device.type not in ok})
    return f"its tensors are on {', '.join(bad)}" if bad else ""


def _mha_tensors(m: Any) -> list[Any]:
    return [m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias]


def _layer_tensors(m: Any) -> list[Any]:
    return [*_mha_tensors(m.self_attn), m.norm1.weight, m.norm1.bias, m.norm2.weight, m.norm2.bias,
            m.linear1.weight, m.linear1.bias, m.linear2.weight, m.linear2.bias]


def _mha_static(m: Any, batched: bool, same_qkv: bool, float_mask: bool) -> str:
    """Why torch's ``MultiheadAttention.forward`` takes its slow path whatever the grad mode ("" if
    it may take the fast one)."""
    f = _FOLLOWING.get()
    if float_mask:
        return "a floating-point mask"
    for why, bad in (("the fast path is turned off (torch.backends.mha)", f is not None and not f.fastpath),
                     ("the input is unbatched", not batched),
                     ("query, key and value are not one tensor", not same_qkv),
                     ("it has separate q/k/v projection weights", m.in_proj_weight is None),
                     ("it is in training mode", m.training), ("its number of heads is odd", m.num_heads % 2),
                     ("batch_first is False", not m.batch_first),
                     ("it has bias_k / bias_v or add_zero_attn", m.bias_k is not None or m.add_zero_attn),
                     ("it has no in-projection bias", m.in_proj_bias is None)):
        if bad:
            return why
    return _device_reason(_mha_tensors(m))


def _layer_static(m: Any, batched: bool) -> str:
    """Why torch's ``TransformerEncoderLayer.forward`` takes its slow path whatever the grad mode."""
    f = _FOLLOWING.get()
    a = m.self_attn
    for why, bad in (("the fast path is turned off (torch.backends.mha)", f is not None and not f.fastpath),
                     ("the input is unbatched", not batched), ("it is in training mode", m.training),
                     ("batch_first is False", not a.batch_first), ("it has no attention bias", a.in_proj_bias is None),
                     ("its attention has separate q/k/v weights", not a._qkv_same_embed_dim),
                     ("its activation is not relu or gelu", not getattr(m, "activation_relu_or_gelu", 0)),
                     ("norm1.eps differs from norm2.eps", m.norm1.eps != m.norm2.eps),
                     ("its number of heads is odd", a.num_heads % 2),
                     ("it has forward hooks", any(len(getattr(s, "_forward_hooks", {})) +
                                                  len(getattr(s, "_forward_pre_hooks", {})) for s in m.modules()))):
        if bad:
            return why
    return _device_reason(_layer_tensors(m))


def _encoder_static(m: Any, batched: bool, padding: bool, mask: bool) -> str:
    """Why torch's ``TransformerEncoder.forward`` does not make a nested tensor whatever the grad
    mode (the left-alignment check of ``mask_check`` is on the data: computed in the graph)."""
    f = _FOLLOWING.get()
    for why, bad in (("the fast path is turned off (torch.backends.mha)", f is not None and not f.fastpath),
                     ("enable_nested_tensor is off (or its layers do not allow it)",
                      not getattr(m, "use_nested_tensor", False)),
                     ("its first layer is in training mode", m.layers[0].training),
                     ("the input is unbatched", not batched), ("no src_key_padding_mask is given", not padding),
                     ("a mask is given with the src_key_padding_mask", mask)):
        if bad:
            return why
    return _device_reason([*_layer_tensors(m.layers[0])])


def _grad_reason(m: Any, own: list[Any]) -> str:
    """Why the call the import stands for records autograd for ``m`` ("" if it does not)."""
    f = _FOLLOWING.get()
    if f is None:
        return "(no import: the slow path)"
    if not f.paths.grad_enabled:
        return ""
    if any(t is not None and t.requires_grad for t in own):
        return "grad was enabled and its parameters require grad"
    if f.paths.inputs_require_grad:
        return "grad was enabled and an example input requires grad"
    mine = {id(p) for p in m.parameters()}
    if any(p.requires_grad for p in f.top.parameters() if id(p) not in mine):
        return "grad was enabled and parameters of the module require grad (taken to reach its input)"
    return ""


_FAST = {"TransformerEncoder": "the nested-tensor fast path: 0 at padded positions (before its norm)",
         "TransformerEncoderLayer": "the fused fast path: NaN for a query with no key to attend, the is_causal "
                                    "hint ignored",
         "MultiheadAttention": "the fused fast path: NaN for a query with no key to attend, the is_causal hint "
                               "ignored"}
_SLOW = {"TransformerEncoder": "padded positions computed like the others (under torch.no_grad() torch returns 0 "
                               "there)",
         "TransformerEncoderLayer": "a query with no key to attend gets zeros (NaN under torch.no_grad())",
         "MultiheadAttention": "without weights a query with no key to attend gets zeros (NaN under "
                               "torch.no_grad())"}


def _follow(m: Any, static: str, own: list[Any]) -> tuple[bool, str]:
    """Whether the import follows torch's fast path for module ``m`` (``static``: why torch would
    not whatever the grad mode), and why not when only autograd is the reason."""
    if static:
        return False, ""
    grad = _grad_reason(m, own)
    return not grad, grad


def _note(m: Any, fast: bool, grad: str, what: str | None = None) -> None:
    """Say in the import's notes which of torch's paths module ``m`` follows (once per module; not
    for the layers inside an encoder, whose note says it for them)."""
    f = _FOLLOWING.get()
    if f is None or f.inside:
        return
    kind = type(m).__name__
    name = f.names.get(id(m)) or "(the module)"
    if fast:
        why = "under torch.no_grad()" if not f.paths.grad_enabled else "with nothing requiring grad"
        how = (f"as torch computes it {why}: {what or _FAST[kind]}; with grad enabled and parameters requiring "
               f"grad torch takes its slow path (import so to follow it)")
    else:
        how = (f"as torch computes it with autograd ({grad}): the slow path, {what or _SLOW[kind]}; import "
               f"under torch.no_grad() to follow the fast path")
    f.notes.setdefault(name, f"nn.{kind} {name!r} was imported {how}")


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    """The layers of an encoder: their notes are the encoder's."""
    f = _FOLLOWING.get()
    if f is not None:
        f.inside += 1
    try:
        yield
    finally:
        if f is not None:
            f.inside -= 1


def _mode(m: Any, p_static: str, own: list[Any], masked: bool) -> bool:
    """:func:`_follow` and, when masks can make the paths differ, its note."""
    fast, grad = _follow(m, p_static, own)
    if masked and (fast or grad):
        _note(m, fast, grad)
    return fast


def _encoder_mode(m: Any, batched: bool, padding: bool, mask: bool) -> bool:
    """Whether the import follows torch's nested-tensor encoder, with the note of the choice (or
    of its layers' path when they alone can differ)."""
    nested, grad = _follow(m, _encoder_static(m, batched, padding, mask), _layer_tensors(m.layers[0]))
    if nested or grad:
        if padding:
            _note(m, nested, grad)
        return nested
    first = m.layers[0]
    fast, grad = _follow(first, _layer_static(first, batched), _layer_tensors(first))
    if (fast or grad) and (padding or mask):
        _note(m, fast, grad, f"its layers' {_FAST['TransformerEncoderLayer'][4:]}" if fast
              else _SLOW["TransformerEncoderLayer"])
    return False


def _is_float(mask: Any) -> bool:
    if mask is None:
        return False
    import torch
    return bool(mask.is_floating_point()) if isinstance(mask, torch.Tensor) else _t(mask, "mask").dtype != "bool"


# ---------------------------------------------------------------- the module translations (torch.fx)


def _sub(p: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def _need(p: dict[str, Any], key: str, module: str) -> Any:
    if key not in p:
        raise UnsupportedOpError(f"nn.{module} on the torch.fx path needs its sub-module weights ({key!r}), "
                                 f"which this einjoin's fx capture does not pass yet; use method='export'")
    return p[key]


def _mha_m(m: Any, p: dict[str, Any], query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Any = None,
           need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
           is_causal: bool = False, fused: bool | None = None) -> tuple[Tensor, Tensor | None]:
    if m.training and m.dropout > 0:
        raise UnsupportedOpError(f"nn.MultiheadAttention with dropout={m.dropout} in training mode; call module.eval()")
    if m.bias_k is not None or m.add_zero_attn:
        raise UnsupportedOpError("nn.MultiheadAttention with add_bias_kv or add_zero_attn")
    if fused is None:  # called as a module: torch's choice of path
        static = _mha_static(m, _t(query, "mha query").ndim == 3, query is key and key is value,
                             _is_float(attn_mask) or _is_float(key_padding_mask))
        fused = _mode(m, static, _mha_tensors(m), attn_mask is not None or key_padding_mask is not None)
    return multi_head_attention(
        query, key, value, m.num_heads, p.get("in_proj_weight"), p.get("in_proj_bias"),
        _need(p, "out_proj.weight", "MultiheadAttention"), p.get("out_proj.bias"),
        q_proj_weight=p.get("q_proj_weight"), k_proj_weight=p.get("k_proj_weight"),
        v_proj_weight=p.get("v_proj_weight"), key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        need_weights=need_weights, average_attn_weights=average_attn_weights, is_causal=is_causal,
        batch_first=m.batch_first, fused=fused)


def _activation(m: Any, x: Tensor, fused: bool = False) -> Tensor:
    if fused:  # the fused layer knows relu and (exact) gelu only: torch's activation_relu_or_gelu
        return F.relu(x) if m.activation_relu_or_gelu == 1 else C.gelu(x)
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
                   is_causal: bool = False, fused: bool | None = None) -> Tensor:
    if m.training and (m.dropout1.p > 0 or m.dropout2.p > 0 or m.self_attn.dropout > 0):
        raise UnsupportedOpError("nn.TransformerEncoderLayer with dropout in training mode; call module.eval()")
    x = _t(x, "TransformerEncoderLayer src")
    if fused is None:  # called as a module: torch's choice of path
        fused = _mode(m, _layer_static(m, x.ndim == 3), _layer_tensors(m),
                      src_mask is not None or src_key_padding_mask is not None)

    def norm(which: str, y: Tensor) -> Tensor:
        ln = getattr(m, which)
        return C.layer_norm(y, ln.normalized_shape, _need(p, f"{which}.weight", "TransformerEncoderLayer")
                            if ln.elementwise_affine else None, p.get(f"{which}.bias"), ln.eps)

    def sa(y: Tensor) -> Tensor:
        # the masks reach the attention as floats (torch's _canonical_mask): never its fused path
        return _mha_m(m.self_attn, _sub(p, "self_attn."), y, y, y, src_key_padding_mask, False, src_mask,
                      True, is_causal, fused=fused)[0]

    def ff(y: Tensor) -> Tensor:
        h = _activation(m, C.linear(y, _need(p, "linear1.weight", "TransformerEncoderLayer"), p.get("linear1.bias")),
                        fused)
        return C.linear(h, p["linear2.weight"], p.get("linear2.bias"))

    if m.norm_first:
        x = x + sa(norm("norm1", x))
        return x + ff(norm("norm2", x))
    x = norm("norm1", x + sa(x))
    return norm("norm2", x + ff(x))


def _nested_padding(kpm: Tensor, mask_check: bool) -> tuple[Tensor, Tensor]:
    """torch's nested-tensor encoder on a (B, S) key padding mask (bool, or float: nonzero is
    padding): (the mask its layers see, where its output is 0). torch keeps each row's first
    ``count`` positions (``count`` = its unpadded ones); with ``mask_check`` only when every row's
    padding is at its end (else no nested tensor: the layers see the mask, nothing is zeroed)."""
    pad = kpm if kpm.dtype == "bool" else kpm != 0
    b, s = pad.shape
    count = (~pad).to("float32").sum(1, keepdim=True)  # (B, 1)
    tail = F.fill((1, s), "x1", "float32") >= count  # (B, S): the positions past each row's count
    if mask_check:
        aligned = (pad != tail).to("float32").sum() == 0  # a 0-d bool
        return kpm, pad & aligned
    return tail, tail


def _encoder(m: Any, p: dict[str, Any], src: Tensor, mask: Any = None, src_key_padding_mask: Any = None,
             is_causal: Any = None) -> Tensor:
    x = _t(src, "TransformerEncoder src")
    kpm = src_key_padding_mask
    # is_causal=None: torch compares the mask with a causal one; if it is one, the hint changes nothing
    causal = is_causal is True
    zero = None
    if _encoder_mode(m, x.ndim == 3, kpm is not None, mask is not None):
        kpm, zero = _nested_padding(_t(kpm, "TransformerEncoder src_key_padding_mask"), getattr(m, "mask_check", True))
    with _inside():
        for i, layer in enumerate(m.layers):
            x = _encoder_layer(layer, _sub(p, f"layers.{i}."), x, mask, kpm, causal)
    if zero is not None:
        x = F.where(zero.unsqueeze(-1), F.zeros((), x.dtype), x)
    if m.norm is not None:
        x = C.layer_norm(x, m.norm.normalized_shape, p.get("norm.weight"), p.get("norm.bias"), m.norm.eps)
    return x


ATTENTION_MODULES: dict[str, Callable[..., Any]] = {
    "MultiheadAttention": _mha_m,
    "TransformerEncoderLayer": _encoder_layer,
    "TransformerEncoder": _encoder,
}
"""The attention ``nn`` modules torch.fx keeps whole, merged into ``nn_modules.MODULES``."""


# ---------------------------------------------------------------- the same rules for torch.export


def _torch_dead(attn_mask: Any, kpm: Any, b: int, h: int, tl: int, s: int) -> Any:
    """(B, L) bool: the queries that may attend no key under these masks (bool True, or -inf: masked)."""
    import torch
    blocked = torch.zeros((b, h, tl, s), dtype=torch.bool)
    for mk in (attn_mask, kpm):
        if mk is None:
            continue
        neg = mk if mk.dtype == torch.bool else mk == float("-inf")
        if mk is kpm:
            neg = neg.reshape(b, 1, 1, s)
        elif neg.dim() == 3:
            neg = neg.reshape(b, h, tl, s)
        blocked = blocked | neg
    return blocked.all(-1).any(1)


def _autocast() -> str:
    import torch
    return "autocast is enabled" if torch.is_autocast_enabled() else ""


def _mha_export(m: Any) -> Callable[..., Any]:
    orig = type(m).forward.__get__(m)

    def forward(query: Any, key: Any, value: Any, key_padding_mask: Any = None, need_weights: bool = True,
                attn_mask: Any = None, average_attn_weights: bool = True, is_causal: bool = False) -> Any:
        static = _mha_static(m, query.dim() == 3, query is key and key is value,
                             _is_float(attn_mask) or _is_float(key_padding_mask)) or _autocast()
        if not _mode(m, static, _mha_tensors(m), attn_mask is not None or key_padding_mask is not None):
            return orig(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                        attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)
        # the fused kernel: the masks as given (the hint ignored), NaN for a query with no key
        out, weights = orig(query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                            attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=False)
        if not need_weights and (attn_mask is not None or key_padding_mask is not None):
            b, tl, _ = out.shape
            dead = _torch_dead(attn_mask, key_padding_mask, b, m.num_heads, tl, key.shape[1])
            out = out.masked_fill(dead.unsqueeze(-1), float("nan"))
        return out, weights
    return forward


def _layer_export(m: Any) -> Callable[..., Any]:
    import torch
    import torch.nn.functional as TF
    orig = type(m).forward.__get__(m)

    def forward(src: Any, src_mask: Any = None, src_key_padding_mask: Any = None, is_causal: bool = False) -> Any:
        static = _layer_static(m, src.dim() == 3) or _autocast()
        if not _mode(m, static, _layer_tensors(m), src_mask is not None or src_key_padding_mask is not None):
            return orig(src, src_mask, src_key_padding_mask, is_causal)
        kpm = TF._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                 other_type=TF._none_or_dtype(src_mask), other_name="src_mask",
                                 target_type=src.dtype)
        am = TF._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None, other_name="",
                                target_type=src.dtype, check_other=False)
        b, tl, _ = src.shape
        dead = None if am is None and kpm is None else _torch_dead(am, kpm, b, m.self_attn.num_heads, tl, tl)

        def sa(y: Any) -> Any:
            a = m.self_attn(y, y, y, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
            return a if dead is None else a.masked_fill(dead.unsqueeze(-1), float("nan"))

        def ff(y: Any) -> Any:  # the fused layer knows relu and (exact) gelu only
            act = torch.relu if m.activation_relu_or_gelu == 1 else TF.gelu
            return m.linear2(act(m.linear1(y)))

        x = src
        if m.norm_first:
            x = x + sa(m.norm1(x))
            return x + ff(m.norm2(x))
        x = m.norm1(x + sa(x))
        return m.norm2(x + ff(x))
    return forward


def _encoder_export(m: Any) -> Callable[..., Any]:
    import torch
    import torch.nn.functional as TF
    orig = type(m).forward.__get__(m)

    def forward(src: Any, mask: Any = None, src_key_padding_mask: Any = None, is_causal: Any = None) -> Any:
        batched = src.dim() == 3
        if _autocast() or not _encoder_mode(m, batched, src_key_padding_mask is not None, mask is not None):
            with _inside():
                return orig(src, mask, src_key_padding_mask, is_causal)
        kpm: Any = TF._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                      other_type=None, other_name="mask", target_type=src.dtype)
        pad: Any = kpm != 0  # torch keeps the positions where the mask is 0 (False)
        tail = torch.arange(pad.shape[1]).unsqueeze(0) >= (~pad).sum(1, keepdim=True)
        if getattr(m, "mask_check", True):
            zero = pad & (pad == tail).all()
        else:
            zero, kpm = tail, torch.zeros_like(kpm).masked_fill(tail, float("-inf"))
        out = src
        with _inside():
            for layer in m.layers:
                out = layer(out, src_mask=None, is_causal=is_causal is True, src_key_padding_mask=kpm)
        out = out.masked_fill(zero.unsqueeze(-1), 0.0)
        return out if m.norm is None else m.norm(out)
    return forward


_EXPORT_FORWARDS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "MultiheadAttention": _mha_export, "TransformerEncoderLayer": _layer_export,
    "TransformerEncoder": _encoder_export}


@contextlib.contextmanager
def export_forwards(module: Any) -> Iterator[None]:
    """While torch.export traces ``module`` (inside :func:`following`): each of its
    ``nn.MultiheadAttention`` / ``TransformerEncoderLayer`` / ``TransformerEncoder`` (torch's own
    forward, not a subclass's) computes the path :func:`following` chose, in torch ops export can
    trace (export alone traces the slow path). The modules' forwards are restored afterwards."""
    import torch.nn as nn
    patched = []
    if _FOLLOWING.get() is not None:
        for m in module.modules():
            make = _EXPORT_FORWARDS.get(type(m).__name__)
            base = getattr(nn, type(m).__name__, None)
            if make is None or base is None or type(m).forward is not base.forward or "forward" in vars(m):
                continue
            m.forward = make(m)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
