"""Audio, routing and recurrent models of the zoo in plain torch, for ``ej.from_torch``: a
Whisper-style audio encoder (a conv1d front end over log-mel frames, sinusoidal positions,
pre-norm transformer blocks), a mixture-of-experts layer with top-2 routing (softmax gate, ``topk``,
renormalised weights, the experts combined through a one-hot dispatch mask: static shapes, no
data-dependent token lists) and a 2-layer LSTM with a linear head.

>>> import torch
>>> from einjoin.models.sequence import WhisperEncoder, MoE, LSTMModel
>>> WhisperEncoder(frames=32).eval()(torch.randn(2, 80, 32)).shape
torch.Size([2, 16, 64])
>>> MoE().eval()(torch.randn(2, 16, 32)).shape
torch.Size([2, 16, 32])
>>> LSTMModel().eval()(torch.randn(2, 12, 16)).shape
torch.Size([2, 12, 8])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["sinusoids", "AudioBlock", "WhisperEncoder", "MoE", "LSTMModel"]


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table: (length, channels), sin then cos halves."""
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class AudioBlock(nn.Module):
    """Whisper's encoder block: pre-norm multi-head self-attention (no bias on the key projection),
    pre-norm GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_ln = nn.LayerNorm(dim)
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim, bias=False)
        self.value = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.mlp_ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_ln(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.mlp_ln(x))
        return out


class WhisperEncoder(nn.Module):
    """Whisper's audio encoder: log-mel (b, mels, frames) -> two conv1d + GELU (the second with
    stride 2) -> + sinusoidal positions -> blocks -> LayerNorm: (b, frames // 2, dim)."""

    def __init__(self, mels: int = 80, dim: int = 64, heads: int = 4, layers: int = 2, frames: int = 3000):
        super().__init__()
        self.conv1 = nn.Conv1d(mels, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.positional_embedding: torch.Tensor
        self.register_buffer("positional_embedding", sinusoids((frames + 1) // 2, dim))
        self.blocks = nn.ModuleList(AudioBlock(dim, heads) for _ in range(layers))
        self.ln_post = nn.LayerNorm(dim)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = x + self.positional_embedding[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.ln_post(x)
        return out


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (Mixtral's routing): a linear gate, softmax, the top
    ``k`` experts per token with their weights renormalised to sum to 1, SwiGLU experts. Every expert
    runs on every token and the one-hot dispatch mask zeroes the unchosen ones (the static-shape
    form; a sparse dispatch has data-dependent shapes)."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4, k: int = 2):
        super().__init__()
        self.experts, self.k = experts, k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)                          # (b, t, e)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)                 # (b, t, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        dispatch = F.one_hot(top_i, self.experts).to(x.dtype)            # (b, t, k, e)
        weights = (dispatch * top_w.unsqueeze(-1)).sum(dim=2)            # (b, t, e)
        h = F.silu(torch.einsum("btd,edh->bteh", x, self.w1)) * torch.einsum("btd,edh->bteh", x, self.w3)
        y = torch.einsum("bteh,ehd->bted", h, self.w2)                   # every expert's output
        return torch.einsum("bted,bte->btd", y, weights)


class LSTMModel(nn.Module):
    """``nn.LSTM`` (2 layers, batch first) and a linear head on every step's output."""

    def __init__(self, inputs: int = 16, hidden: int = 32, layers: int = 2, outputs: int = 8):
        super().__init__()
        self.lstm = nn.LSTM(inputs, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        out: torch.Tensor = self.head(y)
        return out
