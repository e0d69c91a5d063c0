"""The model zoo in plain torch, written the way people write these models, for ``ej.from_torch``.

LLaMA (RMSNorm written out, RoPE with ``rotate_half`` and sin/cos tables, grouped-query attention
through ``scaled_dot_product_attention``, SwiGLU), a small LLaMA (embedding + blocks + final norm
+ lm head), a GPT-2 block (LayerNorm, fused qkv, a masked_fill causal mask, tanh GELU) and GPT-2, an
MLP and a matrix chain; ResNet-18 and ViT-Tiny (:mod:`einjoin.models.vision`), a Whisper-style
encoder, a top-2 MoE layer and a 2-layer LSTM (:mod:`einjoin.models.sequence`). Defaults are small
enough for a laptop; ``LLAMA_7B`` is for planning only.

>>> import torch
>>> from einjoin.models.zoo import ZOO, example
>>> sorted(ZOO)  # doctest: +NORMALIZE_WHITESPACE
['chain', 'gpt2', 'gpt2-block', 'llama', 'llama-block', 'lstm', 'mlp', 'moe', 'resnet18',
 'vit-tiny', 'whisper-encoder']
>>> module, args = example("llama-block")
>>> module(*args).shape
torch.Size([1, 32, 64])
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, fields, replace
from typing import Any
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from einjoin.errors import EinjoinError
from einjoin.models.sequence import LSTMModel, MoE, WhisperEncoder
from einjoin.models.vision import ResNet18, ViTTiny

__all__ = ["LlamaConfig", "LLAMA_7B", "RMSNorm", "LlamaBlock", "Llama", "GPT2Block", "GPT2", "MLP",
           "MatrixChain", "ZOO", "example", "block_with", "torch_block"]


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 96
    layers: int = 2
    vocab: int = 128
    seq: int = 32
    batch: int = 1
    eps: float = 1e-6
    rope_base: float = 10000.0


LLAMA_7B = LlamaConfig(dim=4096, heads=32, kv_heads=32, hidden=11008, layers=32, vocab=32000,
                       seq=2048, batch=1, eps=1e-6)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(seq).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaBlock(nn.Module):
    """One decoder block: pre-norm attention with RoPE and GQA, pre-norm SwiGLU MLP."""

    cos: torch.Tensor  # the rope tables, registered as buffers
    sin: torch.Tensor

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hd = c.dim // c.heads
        self.attention_norm = RMSNorm(c.dim, c.eps)
        self.wq = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.heads * hd, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)
        cos, sin = rope_tables(c.seq, hd, c.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.c
        hd = c.dim // c.heads
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.wk(h).view(b, s, c.kv_heads, hd).transpose(1, 2)
        v = self.wv(h).view(b, s, c.kv_heads, hd).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if c.kv_heads != c.heads:  # repeat_kv, as in the reference implementation
            rep = c.heads // c.kv_heads
            k = k[:, :, None].expand(b, c.kv_heads, rep, s, hd).reshape(b, c.heads, s, hd)
            v = v[:, :, None].expand(b, c.kv_heads, rep, s, hd).reshape(b, c.heads, s, hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, c.dim))
        h = self.ffn_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


# the names of einjoin.models.graphs.llama_block's weights -> LlamaBlock's state dict
_BLOCK_WEIGHTS = {"attn_norm": "attention_norm.weight", "wq": "wq.weight", "wk": "wk.weight",
                  "wv": "wv.weight", "wo": "wo.weight", "mlp_norm": "ffn_norm.weight",
                  "w1": "w1.weight", "w3": "w3.weight", "w2": "w2.weight"}


def block_with(weights: dict[str, Any], heads: int, seq: int, eps: float = 1e-6) -> LlamaBlock:
    """The zoo's :class:`LlamaBlock` (eval mode) holding the weights of an einjoin LLaMA block
    (:func:`einjoin.models.graphs.transformer_block` / ``llama_block``: ``attn_norm``, ``wq``, ...,
    numpy arrays or tensors); sizes are read from the weights.

    >>> import numpy as np
    >>> w = {k: np.ones(s, np.float32) for k, s in [("attn_norm", (8,)), ("wq", (8, 8)), ("wk", (4, 8)),
    ...      ("wv", (4, 8)), ("wo", (8, 8)), ("mlp_norm", (8,)), ("w1", (12, 8)), ("w3", (12, 8)),
    ...      ("w2", (8, 12))]}
    >>> block_with(w, heads=2, seq=4).c.kv_heads
    1
    """
    dim, hidden = weights["wq"].shape[1], weights["w1"].shape[0]
    kv_heads = weights["wk"].shape[0] // (dim // heads)
    module = LlamaBlock(LlamaConfig(dim=dim, heads=heads, kv_heads=kv_heads, hidden=hidden, layers=1,
                                    seq=seq, batch=1, eps=eps))
    module.load_state_dict({_BLOCK_WEIGHTS[k]: torch.as_tensor(v) for k, v in weights.items()
                            if k in _BLOCK_WEIGHTS})
    return module.eval()


def torch_block(feeds: dict[str, Any], heads: int) -> Any:
    """:func:`einjoin.models.graphs.transformer_block` in torch: its feeds (``x`` (seq, d) and the
    weights, numpy) through :func:`block_with`'s module; returns a numpy array (seq, d)."""
    x = torch.as_tensor(feeds["x"])
    module = block_with(feeds, heads, seq=x.shape[0])
    with torch.no_grad():
        return module(x[None])[0].numpy()


class Llama(nn.Module):
    """Token embedding, ``layers`` blocks, final norm, lm head: tokens (b, s) -> logits (b, s, vocab)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: torch.Tensor = self.output(self.norm(h))
        return logits


class GPT2Block(nn.Module):
    """GPT-2's block: LayerNorm, fused qkv projection, a registered tril mask with masked_fill,
    tanh GELU MLP, dropout (identity in eval)."""

    bias: torch.Tensor  # the causal mask, a registered buffer

    def __init__(self, dim: int = 64, heads: int = 4, seq: int = 32, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.drop(self.c_proj(y))
        out: torch.Tensor = x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))
        return out


class GPT2(nn.Module):
    """GPT-2: token and learned position embeddings, ``layers`` GPT2Blocks, a final LayerNorm and an
    lm head tied to the token embedding: tokens (b, s) -> logits (b, s, vocab)."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, seq: int = 32, layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(dim, heads, seq, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.h:
            h = block(h)
        out: torch.Tensor = self.lm_head(self.ln_f(h))
        return out


class MLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(dim, hidden) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(hidden, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs):
            x = x + down(torch.relu(up(x)))
        return x


class MatrixChain(nn.Module):
    """``x @ M1 @ M2 ...`` with the matrices as parameters."""

    def __init__(self, n: int = 64, length: int = 3):
        super().__init__()
        self.ms = nn.ParameterList(nn.Parameter(torch.randn(n, n) / math.sqrt(n)) for _ in range(length - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.ms:
            x = x @ m
        return x


Example = tuple[nn.Module, tuple[Any, ...]]
"""A zoo entry: the module and example arguments of its forward."""


def _llama_block(c: LlamaConfig = LlamaConfig()) -> Example:
    return LlamaBlock(c), (torch.randn(c.batch, c.seq, c.dim),)


def _llama(c: LlamaConfig = LlamaConfig()) -> Example:
    return Llama(c), (torch.randint(0, c.vocab, (c.batch, c.seq)),)


ZOO: dict[str, Callable[..., Example]] = {
    "llama-block": _llama_block,
    "llama": _llama,
    "gpt2-block": lambda dim=64, heads=4, seq=32, batch=2: (GPT2Block(dim, heads, seq),
                                                          (torch.randn(batch, seq, dim),)),
    "gpt2": lambda vocab=128, dim=64, heads=4, seq=32, layers=2, batch=2: (
        GPT2(vocab, dim, heads, seq, layers), (torch.randint(0, vocab, (batch, seq)),)),
    "mlp": lambda dim=64, hidden=256, layers=2, batch=16: (MLP(dim, hidden, layers),
                                                         (torch.randn(batch, dim),)),
    "chain": lambda n=64, length=3: (MatrixChain(n, length), (torch.randn(n, n),)),
    # vision, audio, routing and recurrent models (einjoin/models/vision.py, sequence.py)
    "resnet18": lambda num_classes=1000, width=64, image=64, batch=2: (
        ResNet18(num_classes, width), (torch.randn(batch, 3, image, image),)),
    "vit-tiny": lambda image=32, patch=8, dim=192, depth=12, heads=3, batch=2: (
        ViTTiny(image, patch, dim, depth, heads, 4 * dim), (torch.randn(batch, 3, image, image),)),
    "whisper-encoder": lambda mels=80, dim=64, heads=4, layers=2, frames=64, batch=2: (
        WhisperEncoder(mels, dim, heads, layers, frames), (torch.randn(batch, mels, frames),)),
    "moe": lambda dim=32, hidden=64, experts=4, k=2, seq=16, batch=2: (
        MoE(dim, hidden, experts, k), (torch.randn(batch, seq, dim),)),
    "lstm": lambda inputs=16, hidden=32, layers=2, outputs=8, seq=12, batch=2: (
        LSTMModel(inputs, hidden, layers, outputs), (torch.randn(batch, seq, inputs),)),
}


class UnknownModelError(EinjoinError, KeyError):
    """A zoo name that does not exist (a KeyError too, for callers that caught that)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def example(name: str, seed: int = 0, **config: Any) -> Example:
    """A zoo model (in eval mode, random weights from ``seed``) and example inputs. LLaMA
    models take ``LlamaConfig`` fields as keywords."""
    if not isinstance(name, str) or name not in ZOO:
        raise UnknownModelError(f"unknown zoo model {name!r}; known: {', '.join(sorted(ZOO))}")
    llama = name in ("llama-block", "llama")
    known = [f.name for f in fields(LlamaConfig)] if llama else list(inspect.signature(ZOO[name]).parameters)
    unknown = sorted(k for k in config if k not in known)
    if unknown:  # replace() / the builder would raise a bare TypeError
        raise EinjoinError(f"zoo model {name!r} has no setting {', '.join(map(repr, unknown))}; "
                           f"it takes {', '.join(known)}")
    torch.manual_seed(seed)
    if llama:
        module, args = ZOO[name](replace(LlamaConfig(), **config))
    else:
        module, args = ZOO[name](**config)
    return module.eval(), args
