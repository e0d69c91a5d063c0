"""Built-in programs written with the frontend, for planning (``einjoin plan``) and benchmarks.
(The torch versions of the model zoo come with torch import.)

>>> from einjoin.models.graphs import MODELS, build
>>> sorted(MODELS)
['chain', 'llama-7b-layers', 'llama-block', 'matmul', 'mlp']
>>> out = build("llama-block", layers=1, seq=64, d=64, heads=4, kv_heads=2, hidden=96)
>>> out.shape
(1, 64, 64)
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Callable

from einjoin import frontend as ej  # the models build IR only (tests/test_imports.py)
from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph

__all__ = ["MODELS", "build", "matmul", "chain", "mlp", "llama_block", "llama_layers",
           "transformer_block"]


def matmul(m: int = 8192, k: int = 8192, n: int = 8192) -> ej.Tensor:
    return ej.input("a", (m, k)) @ ej.param("b", (k, n))


def _count(v: Any, what: str, least: int = 1) -> int:
    """A count argument (layers, heads, chain length) as an int >= ``least``, or an EinjoinError."""
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise EinjoinError(f"{what} must be an int >= {least}, got {v!r}")
    return v


def chain(n: int = 4096, length: int = 3) -> ej.Tensor:
    """A @ B @ C ... of ``length`` square matrices."""
    length = _count(length, "chain: length")
    out = ej.input("m0", (n, n))
    for i in range(1, length):
        out = out @ ej.param(f"m{i}", (n, n))
    return out


def mlp(batch: int = 8192, d: int = 1024, hidden: int = 4096) -> ej.Tensor:
    x = ej.input("x", (batch, d))
    return (x @ ej.param("w1", (d, hidden))).relu() @ ej.param("w2", (hidden, d))


def llama_block(x: ej.Tensor, prefix: str = "", heads: int = 32, kv_heads: int | None = None,
                hidden: int = 11008, eps: float = 1e-6) -> ej.Tensor:
    """One LLaMA decoder block on ``x`` (batch, seq, d): RMSNorm, rotary grouped-query attention,
    SwiGLU MLP, residuals. Weights are ``ej.param``s named ``{prefix}wq`` and so on."""
    if not isinstance(x, ej.Tensor) or x.ndim != 3:
        raise EinjoinError(f"llama_block: x must be an einjoin tensor (batch, seq, d), got "
                           f"{getattr(x, 'shape', type(x).__name__)}")
    return _decoder(x, prefix, heads, kv_heads, hidden, eps)


def _decoder(x: ej.Tensor, prefix: str, heads: int, kv_heads: int | None, hidden: int,
             eps: float) -> ej.Tensor:
    """The block itself, on ``x`` (batch, seq, d) or (seq, d): every leading dim is kept."""
    *lead, s, d = x.shape
    heads = _count(heads, "llama_block: heads")
    kv = heads if kv_heads is None else _count(kv_heads, "llama_block: kv_heads")
    hd = d // heads
    if hd * heads != d or heads % kv:
        raise EinjoinError(f"llama_block: d={d}, heads={heads}, kv_heads={kv} do not fit")

    def p(name: str, shape: tuple[int, ...]) -> ej.Tensor:
        return ej.param(prefix + name, shape)

    def heads_of(t: ej.Tensor, n: int) -> ej.Tensor:  # (..., s, n * hd) -> (..., n, s, hd)
        return t.reshape(*lead, s, n, hd).transpose(-3, -2)

    h = ej.rms_norm(x, p("attn_norm", (d,)), eps)
    q = heads_of(ej.linear(h, p("wq", (heads * hd, d))), heads)
    k = heads_of(ej.linear(h, p("wk", (kv * hd, d))), kv)
    v = heads_of(ej.linear(h, p("wv", (kv * hd, d))), kv)
    a = ej.attention(ej.rope(q), ej.rope(k), v, causal=True)
    x = x + ej.linear(a.transpose(-3, -2).reshape(*lead, s, d), p("wo", (d, d)))
    h = ej.rms_norm(x, p("mlp_norm", (d,)), eps)
    up = ej.silu(ej.linear(h, p("w1", (hidden, d)))) * ej.linear(h, p("w3", (hidden, d)))
    return x + ej.linear(up, p("w2", (d, hidden)))


def transformer_block(seq: int = 256, d: int = 256, heads: int = 4, hidden: int = 688
                      ) -> tuple[ej.Tensor, dict[str, tuple[int, ...]]]:
    """The LLaMA block (:func:`llama_block`, multi-head) on one sequence ``x`` (seq, d), the small
    case the tests, ``bench/local_exec.py`` and the viz share; returns (output, input shapes by
    name). Its plain-torch twin is :func:`einjoin.models.zoo.torch_block`.

    >>> out, shapes = transformer_block(seq=16, d=32, heads=4, hidden=48)
    >>> out.shape, shapes["wq"], shapes["w1"]
    ((16, 32), (32, 32), (48, 32))
    """
    out = _decoder(ej.input("x", (seq, d)), "", heads, None, hidden, 1e-6)
    return out, {name: x.shape for name, x in Graph(out).input_by_name.items()}


def llama_layers(layers: int = 32, batch: int = 1, seq: int = 2048, d: int = 4096, heads: int = 32,
                 kv_heads: int | None = None, hidden: int = 11008) -> ej.Tensor:
    """``layers`` LLaMA blocks (LLaMA-7B shapes by default) on an activation (batch, seq, d)."""
    layers = _count(layers, "llama_layers: layers")
    x = ej.input("x", (batch, seq, d))
    for i in range(layers):
        x = llama_block(x, f"l{i}.", heads, kv_heads, hidden)
    return x


def _block(layers: int = 1, **kw: Any) -> ej.Tensor:
    defaults = dict(batch=1, seq=2048, d=4096, heads=32, hidden=11008)
    defaults.update(kw)
    return llama_layers(layers, **defaults)


MODELS: dict[str, Callable[..., ej.Tensor]] = {
    "matmul": matmul,
    "chain": chain,
    "mlp": mlp,
    "llama-block": _block,
    "llama-7b-layers": lambda **kw: llama_layers(**kw),
}


def build(name: str, **kw: Any) -> ej.Tensor:
    """The built-in model ``name`` with its size keywords (``einjoin plan MODEL``)."""
    if not isinstance(name, str) or name not in MODELS:
        raise EinjoinError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    fn = MODELS[name]
    target = llama_layers if name.startswith("llama") else fn
    known = inspect.signature(target).parameters
    unknown = sorted(k for k in kw if k not in known)
    if unknown:  # a TypeError from deep inside would not say which model takes what
        raise EinjoinError(f"model {name!r} has no parameter {', '.join(map(repr, unknown))}; it takes "
                           f"{', '.join(known)}")
    return fn(**kw)
