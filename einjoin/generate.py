"""``ej.generate``: autoregressive decoding of the zoo's LLaMA and GPT-2 with a static KV cache.

Two programs per generation. The **prefill** program runs the prompt (batch, prompt length) once
and returns the last position's logits and, per layer, the keys and values padded with zeros to
the cache's fixed ``capacity``. The **decode** program runs one token: its input is the token
ids (batch, 1); the position (an int64 scalar that each step advances to ``pos + 1``), the
weights, the rope tables and the caches are program *state* (``ej.compile(..., state=...)``),
written once and then kept on their devices.
Each layer writes its new key and value with an elementwise ``where(iota == pos, new, cache)`` (no
shape changes: one plan serves every position) and attends under the mask ``iota <= pos``; rope
rows (LLaMA) and the learned position row (GPT-2) are picked at ``pos`` by a gather. After its
first run a decode step loads from the host only the new ids (a step at another position than
the next writes the position first: 8 bytes more, once).

The prefill's caches reach the decode program through the host once (the prefill's outputs,
then ``write_state``). The next token is chosen on the host from the returned logits (argmax, or top-k
sampling with ``torch.multinomial`` and ``seed``): the logits of one position per sequence are the
only bytes a step fetches.

>>> import torch, einjoin as ej
>>> from einjoin.models.zoo import Llama, LlamaConfig
>>> torch.manual_seed(0) and None
>>> model = Llama(LlamaConfig(dim=16, heads=2, kv_heads=1, hidden=24, layers=1, vocab=32, seq=16)).eval()
>>> ids = ej.generate(model, torch.tensor([[1, 2, 3]]), 4, capacity=8)
>>> ids.shape, ids.dtype, ids[0, :3].tolist()
(torch.Size([1, 7]), torch.int64, [1, 2, 3])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einjoin import frontend as ej
from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend.tensor import Tensor, elementwise
from einjoin.ir.scalar import parse_join
from einjoin.program import Program, compile

__all__ = ["generate", "Decoder"]

IDS, POS = "ids", "pos"  # the decode program's per-step inputs


# ---- what a module is: its sizes and its weights, read as block_with / torch_block read them

@dataclass
class _Model:
    kind: str                       # "llama" or "gpt2"
    vocab: int
    dim: int
    heads: int
    kv_heads: int
    layers: int
    positions: int                  # the most positions the module itself holds (rope / wpe rows)
    eps: float
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # input name -> array (float32)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def dtype(self) -> str:
        """The keys' and values' dtype (the embedding's)."""
        return str(self.weights["tok" if self.kind == "llama" else "wte"].dtype)


def _np(t: Any) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; einjoin's is a raw 2-byte type
        raise DTypeError("generate: a bfloat16 module is not supported yet (float32, float64 or float16 are)")
    return np.ascontiguousarray(t.detach().cpu().numpy())


def _llama(module: Any) -> _Model:
    first = module.layers[0]
    c = first.c
    w = {"tok": _np(module.tok_embeddings.weight), "norm": _np(module.norm.weight),
         "output": _np(module.output.weight), "rope.cos": _np(first.cos), "rope.sin": _np(first.sin)}
    names = {"attn_norm": "attention_norm", "wq": "wq", "wk": "wk", "wv": "wv", "wo": "wo",
             "mlp_norm": "ffn_norm", "w1": "w1", "w3": "w3", "w2": "w2"}
    for i, layer in enumerate(module.layers):
        for ours, theirs in names.items():
            w[f"l{i}.{ours}"] = _np(getattr(layer, theirs).weight)
    return _Model("llama", c.vocab, c.dim, c.heads, c.kv_heads, len(module.layers), first.cos.shape[0],
                  c.eps, w)


def _gpt2(module: Any) -> _Model:
    blocks = list(module.h)
    first = blocks[0]
    vocab, dim = module.wte.weight.shape
    w = {"wte": _np(module.wte.weight), "wpe": _np(module.wpe.weight), "ln_f.w": _np(module.ln_f.weight),
         "ln_f.b": _np(module.ln_f.bias)}
    if module.lm_head.weight is not module.wte.weight:  # untied: a head of its own
        w["lm_head"] = _np(module.lm_head.weight)
    for i, b in enumerate(blocks):
        for part in ("ln_1", "c_attn", "c_proj", "ln_2", "c_fc", "mlp_proj"):
            w[f"h{i}.{part}.w"] = _np(getattr(b, part).weight)
            w[f"h{i}.{part}.b"] = _np(getattr(b, part).bias)
    positions = min(module.wpe.weight.shape[0], first.bias.shape[-1])
    return _Model("gpt2", vocab, dim, first.heads, first.heads, len(blocks), positions, first.ln_1.eps, w)


def _readers() -> dict[type, Callable[[Any], _Model]]:
    """The supported module classes (the zoo's), each with the reader of its weights."""
    from einjoin.models import zoo
    return {zoo.Llama: _llama, zoo.GPT2: _gpt2}


def _read(module: Any) -> _Model:
    readers = _readers()
    reader = readers.get(type(module))
    if reader is None:
        raise EinjoinError(f"generate: unsupported module class {type(module).__module__}."
                           f"{type(module).__qualname__}; supported: "
                           f"{', '.join('einjoin.models.zoo.' + c.__name__ for c in readers)}")
    return reader(module)


# ---- the graphs

def _weight_inputs(m: _Model) -> dict[str, Tensor]:
    """The weights (and rope tables) as graph inputs (``ej.param``), by name."""
    return {name: ej.param(name, a.shape, str(a.dtype)) for name, a in m.weights.items()}


def _heads(t: Tensor, n: int, hd: int) -> Tensor:
    """(b, s, n * hd) -> (b, n, s, hd)."""
    b, s, _ = t.shape
    if s == 1:  # one position (a decode step): the same values without a transposing copy
        return t.reshape(b, n, 1, hd)
    return t.reshape(b, s, n, hd).transpose(1, 2)


def _merge(a: Tensor) -> Tensor:
    """(b, n, s, hd) -> (b, s, n * hd), the inverse of :func:`_heads`."""
    b, n, s, hd = a.shape
    return a.reshape(b, 1, n * hd) if s == 1 else a.transpose(1, 2).reshape(b, s, n * hd)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + rotate_half(x) * sin``, as the zoo's LlamaBlock (cos/sin rows of its tables)."""
    return elementwise(parse_join("x0 * x1 + x2 * x3", 4), x, cos, ej.rotate_half(x), sin, name="rope")


@dataclass
class _Context:
    """How a layer attends: the prefill (positions 0..s-1, causal) or one decode step (position
    ``pos``, the cache of ``capacity`` slots)."""

    capacity: int
    pos: Tensor | None = None       # decode: the int64 scalar position input
    is_pos: Tensor | None = None    # decode: iota == pos (bool, (capacity,))
    seen: Tensor | None = None      # decode: iota <= pos (bool, (1, capacity))
    caches: dict[str, Tensor] = field(default_factory=dict)   # decode: cache inputs by name
    new_caches: dict[str, Tensor] = field(default_factory=dict)  # new cache values by name

    def attend(self, name: str, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Attention of ``q`` (b, H, s, hd) over this context's keys and values (b, KV, s, hd),
        recording the new caches ``{name}.k`` / ``{name}.v``."""
        if self.pos is None:  # prefill: causal over the prompt; the caches padded to capacity
            for which, t in (("k", k), ("v", v)):
                b, n, s, hd = t.shape
                pad = [t] if s == self.capacity else [t, ej.zeros((b, n, self.capacity - s, hd), t.dtype)]
                self.new_caches[f"{name}.{which}"] = ej.concat(pad, 2) if len(pad) > 1 else t
            return ej.attention(q, k, v, causal=True, scale=scale)
        assert self.is_pos is not None and self.seen is not None
        full = []
        for which, t in (("k", k), ("v", v)):
            b, n, _, hd = t.shape
            cache = self.caches[f"{name}.{which}"]
            # the new row written where iota == pos: elementwise, the cache keeps its shape
            new = ej.einsum("bhcd,bhd,c->bhcd", cache, t.reshape(b, n, hd), self.is_pos,
                            join="where(x2, x1, x0)")
            self.new_caches[f"{name}.{which}"] = new
            full.append(new)
        return ej.attention(q, full[0], full[1], causal=False, scale=scale, mask=self.seen)


def _llama_forward(m: _Model, w: dict[str, Tensor], ids: Tensor, ctx: _Context) -> Tensor:
    b, s = ids.shape
    hd, kv = m.head_dim, m.kv_heads
    if ctx.pos is None:
        cos, sin = w["rope.cos"][:s], w["rope.sin"][:s]
    else:
        cos, sin = ej.gather(w["rope.cos"], ctx.pos), ej.gather(w["rope.sin"], ctx.pos)
    x = ej.embedding(ids, w["tok"])
    for i in range(m.layers):
        p = f"l{i}."
        h = ej.rms_norm(x, w[p + "attn_norm"], m.eps)
        q = _rope(_heads(ej.linear(h, w[p + "wq"]), m.heads, hd), cos, sin)
        k = _rope(_heads(ej.linear(h, w[p + "wk"]), kv, hd), cos, sin)
        v = _heads(ej.linear(h, w[p + "wv"]), kv, hd)
        a = ctx.attend(f"l{i}", q, k, v, 1.0 / math.sqrt(hd))
        x = x + ej.linear(_merge(a), w[p + "wo"])
        h = ej.rms_norm(x, w[p + "mlp_norm"], m.eps)
        x = x + ej.linear(ej.silu(ej.linear(h, w[p + "w1"])) * ej.linear(h, w[p + "w3"]), w[p + "w2"])
    last = x[:, s - 1]  # (b, d): only the last position's logits are wanted
    return ej.linear(ej.rms_norm(last, w["norm"], m.eps), w["output"])


def _gpt2_forward(m: _Model, w: dict[str, Tensor], ids: Tensor, ctx: _Context) -> Tensor:
    b, s = ids.shape
    d, hd = m.dim, m.head_dim
    pos_emb = w["wpe"][:s] if ctx.pos is None else ej.gather(w["wpe"], ctx.pos)
    x = ej.embedding(ids, w["wte"]) + pos_emb
    for i in range(m.layers):
        p = f"h{i}."
        h = ej.layer_norm(x, None, w[p + "ln_1.w"], w[p + "ln_1.b"], m.eps)
        q, k, v = ej.split(ej.linear(h, w[p + "c_attn.w"], w[p + "c_attn.b"]), d, 2)
        a = ctx.attend(f"h{i}", _heads(q, m.heads, hd), _heads(k, m.heads, hd), _heads(v, m.heads, hd),
                       1.0 / math.sqrt(hd))
        x = x + ej.linear(_merge(a), w[p + "c_proj.w"], w[p + "c_proj.b"])
        h = ej.layer_norm(x, None, w[p + "ln_2.w"], w[p + "ln_2.b"], m.eps)
        up = ej.gelu(ej.linear(h, w[p + "c_fc.w"], w[p + "c_fc.b"]), "tanh")
        x = x + ej.linear(up, w[p + "mlp_proj.w"], w[p + "mlp_proj.b"])
    last = ej.layer_norm(x[:, s - 1], None, w["ln_f.w"], w["ln_f.b"], m.eps)
    return ej.linear(last, w.get("lm_head", w["wte"]))


_FORWARDS = {"llama": _llama_forward, "gpt2": _gpt2_forward}


def _cache_shape(m: _Model, batch: int, capacity: int) -> tuple[int, int, int, int]:
    return (batch, m.kv_heads, capacity, m.head_dim)


class Decoder:
    """The prefill and decode programs of one module for a batch size and a cache ``capacity``
    on ``devices``: what :func:`generate` builds and runs. Keep one to generate again without
    compiling again (:meth:`generate`; one prefill program per prompt length) or to read its
    programs' statistics (``decoder.decode.run_stats`` is the last step's).

    ``prefill(ids)`` runs a prompt (batch, s) and makes its keys and values the decode program's
    cache state; ``step(ids, pos)`` runs one token per sequence at position ``pos``; both return
    the logits (batch, vocab) of the position they ran last, as a numpy array.

    >>> import numpy as np, torch
    >>> from einjoin.models.zoo import Llama, LlamaConfig
    >>> torch.manual_seed(0) and None
    >>> model = Llama(LlamaConfig(dim=16, heads=2, kv_heads=1, hidden=24, layers=1, vocab=32, seq=16)).eval()
    >>> dec = Decoder(model, batch=1, capacity=8)
    >>> dec.prefill(np.array([[1, 2, 3]])).shape
    (1, 32)
    >>> _ = dec.step(np.array([[4]]), 3); _ = dec.step(np.array([[5]]), 4)
    >>> dec.decode.run_stats.bytes_loaded, dec.step_bytes  # the new ids only
    (8, 8)
    """

    def __init__(self, module: Any, batch: int = 1, capacity: int = 256, *, devices: Any = 1,
                 backend: Any = None, planner: Any = "auto"):
        self.model = _read(module)
        self.batch = _count(batch, "batch", 1)
        self.capacity = _count(capacity, "capacity", 1)
        self.devices, self.planner = devices, planner
        self.backend = "threads" if backend is None else backend
        self._prefills: dict[int, Program] = {}
        self._decode: Program | None = None
        self._weights_written = False
        self._next_pos = 0  # the position the decode state holds (advanced by each step)

    @property
    def step_bytes(self) -> int:
        """The host bytes a decode step loads after the first: the new ids (int64). The position is
        state the step advances (``pos + 1``); a step at another position than the next writes it
        (8 more bytes, once)."""
        return 8 * self.batch

    def _compile(self, outputs: Any, state: Any = None) -> Program:
        return compile(outputs, self.devices, planner=self.planner, backend=self.backend, quiet=True,
                       state=state)

    @property
    def decode(self) -> Program:
        """The decode program (compiled on first use): one token per sequence at an input position."""
        if self._decode is None:
            m, c = self.model, self.capacity
            w = _weight_inputs(m)
            ids = ej.input(IDS, (self.batch, 1), "int64")
            pos = ej.input(POS, (), "int64")
            iota = ej.fill((c,), "x0", "int64")
            ctx = _Context(c, pos, iota == pos, (iota <= pos).reshape(1, c))
            for i in range(m.layers):
                for which in ("k", "v"):
                    name = f"{_prefix(m)}{i}.{which}"
                    ctx.caches[name] = ej.input(name, _cache_shape(m, self.batch, c), m.dtype)
            logits = _FORWARDS[m.kind](m, w, ids, ctx)
            # the caches' new values replace them; the weights are state that maps to itself:
            # written once, then resident on their devices
            state = {ctx.new_caches[n]: t for n, t in ctx.caches.items()}
            state.update({t: t for t in w.values()})
            state[pos + 1] = pos  # the next step's position: advanced on the devices, not loaded
            self._decode = self._compile(logits, state)
        return self._decode

    def prepare(self, prompt_len: int) -> None:
        """Compile the decode program and the prefill program for prompts of ``prompt_len``."""
        _ = self.decode
        self._prefill(_count(prompt_len, "prompt_len", 1))

    def _prefill(self, s: int) -> Program:
        if s not in self._prefills:
            m = self.model
            w = _weight_inputs(m)
            ctx = _Context(self.capacity)
            logits = _FORWARDS[m.kind](m, w, ej.input(IDS, (self.batch, s), "int64"), ctx)
            self._prefills[s] = self._compile([logits, *ctx.new_caches.values()])
        return self._prefills[s]

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Run the prompt ``ids`` (batch, s) int64; its keys and values become the decode state."""
        s = ids.shape[1]
        if s > self.capacity:
            raise EinjoinError(f"generate: a prompt of {s} tokens does not fit a cache of capacity "
                               f"{self.capacity}")
        prog = self._prefill(s)
        feeds: dict[str, Any] = {IDS: ids, **self.model.weights}  # none is named as a run() option
        logits, *caches = prog.run(**feeds)
        names = [f"{_prefix(self.model)}{i}.{w}" for i in range(self.model.layers) for w in ("k", "v")]
        state: dict[str, Any] = dict(zip(names, caches))
        state[POS] = np.int64(s)
        self._next_pos = s
        if not self._weights_written:
            state.update(self.model.weights)
        self.decode.write_state(state)
        self._weights_written = True
        return np.asarray(logits)

    def step(self, ids: np.ndarray, pos: int) -> np.ndarray:
        """One decode step: ``ids`` (batch, 1) int64 at position ``pos`` (after :meth:`prefill`)."""
        if not self._weights_written:
            raise EinjoinError("generate: Decoder.step before Decoder.prefill: the cache holds no prompt yet")
        if not 0 <= pos < self.capacity:
            raise EinjoinError(f"generate: position {pos} is outside the cache (capacity {self.capacity})")
        if pos != self._next_pos:  # not the position the last step advanced to: write it
            self.decode.write_state({POS: np.int64(pos)})
        out = np.asarray(self.decode.run(ids=ids))
        self._next_pos = pos + 1
        return out


    def generate(self, prompt_ids: Any, max_new_tokens: int, *, top_k: int | None = None,
                 temperature: float = 1.0, seed: int | None = None) -> Any:
        """:func:`generate` with this decoder's programs (compiled once, so further generations
        of this batch size pay no compile; the weights were read when the decoder was made)."""
        import torch
        m_new = _count(max_new_tokens, "max_new_tokens", 0)
        ids, one = _ids(prompt_ids, self.model.vocab)
        b, s = ids.shape
        if b != self.batch:
            raise ShapeError(f"generate: this decoder runs batches of {self.batch}, got prompt_ids of shape "
                             f"{tuple(ids.shape)}")
        total = s + m_new
        if total > self.capacity:
            raise EinjoinError(f"generate: prompt ({s} tokens) + max_new_tokens ({m_new}) = {total} exceeds "
                               f"the cache's capacity={self.capacity}")
        if total > self.model.positions:
            raise EinjoinError(f"generate: prompt ({s} tokens) + max_new_tokens ({m_new}) = {total} exceeds "
                               f"the {self.model.positions} positions the module holds")
        pick = _sampler(top_k, temperature, seed, self.model.vocab)
        out = [ids]
        if m_new:
            nxt = pick(self.prefill(ids)).reshape(b, 1).astype(np.int64)
            out.append(nxt)
            for j in range(m_new - 1):
                nxt = pick(self.step(nxt, s + j)).reshape(b, 1).astype(np.int64)
                out.append(nxt)
        res = torch.from_numpy(np.concatenate(out, axis=1))
        return res[0] if one else res

def _prefix(m: _Model) -> str:
    return "l" if m.kind == "llama" else "h"


def _count(v: Any, what: str, least: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < least:
        raise EinjoinError(f"generate: {what} must be an int >= {least}, got {v!r:.60}")
    return int(v)


def _ids(prompt_ids: Any, vocab: int) -> tuple[np.ndarray, bool]:
    """The prompt as an int64 (batch, s) array, and whether it came as one 1-D sequence."""
    arr = prompt_ids.detach().cpu().numpy() if type(prompt_ids).__module__.startswith("torch") else prompt_ids
    if not isinstance(arr, np.ndarray):
        raise EinjoinError(f"generate: prompt_ids must be a torch tensor or numpy array of token ids, "
                           f"got {type(prompt_ids).__name__}")
    if arr.dtype.kind not in "iu":
        raise DTypeError(f"generate: prompt_ids must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0 or (arr.ndim == 2 and arr.shape[0] == 0):
        raise ShapeError(f"generate: prompt_ids must be (seq,) or (batch, seq) with seq, batch >= 1, "
                         f"got shape {tuple(arr.shape)}")
    if arr.min() < 0 or arr.max() >= vocab:
        raise EinjoinError(f"generate: token ids must lie in [0, {vocab}) (the vocabulary), got "
                           f"{int(arr.min())}..{int(arr.max())}")
    one = arr.ndim == 1
    return np.ascontiguousarray(arr.reshape(1, -1) if one else arr, dtype=np.int64), one


def _sampler(top_k: Any, temperature: Any, seed: Any, vocab: int) -> Callable[[np.ndarray], np.ndarray]:
    """The next tokens (batch,) from logits (batch, vocab), on the host: torch's argmax (greedy,
    ``top_k=None``) or a draw from the softmax of the ``top_k`` largest logits / ``temperature``
    with ``torch.multinomial`` on a generator seeded with ``seed`` (torch's global one if None)."""
    import torch
    if top_k is None:
        return lambda logits: torch.from_numpy(logits).argmax(-1).numpy()
    k = _count(top_k, "top_k", 1)
    if k > vocab:
        raise EinjoinError(f"generate: top_k={k} exceeds the vocabulary ({vocab})")
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, (int, float, np.integer,
                                                                                 np.floating)) \
            or not 0 < float(temperature) < math.inf:
        raise EinjoinError(f"generate: temperature must be a positive finite number, got {temperature!r:.60}")
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(_count(seed, "seed", 0))
    temp = float(temperature)

    def sample(logits: np.ndarray) -> np.ndarray:
        vals, idx = torch.topk(torch.from_numpy(logits).double() / temp, k, dim=-1)
        choice = torch.multinomial(torch.softmax(vals, -1), 1, generator=gen)
        return idx.gather(-1, choice)[:, 0].numpy()

    return sample


def generate(module: Any, prompt_ids: Any, max_new_tokens: int, *, devices: Any = 1, capacity: int = 256,
             top_k: int | None = None, temperature: float = 1.0, seed: int | None = None,
             backend: Any = None, planner: Any = "auto") -> Any:
    """Continue ``prompt_ids`` ((batch, seq) or (seq,) integer token ids) by ``max_new_tokens``
    tokens with ``module`` (the zoo's :class:`~einjoin.models.zoo.Llama` or ``GPT2``, in its
    eval-mode semantics: dropout is not applied) on ``devices``, with a static KV cache of
    ``capacity`` positions kept on the devices as program state (see the module docstring).
    ``top_k=None`` decodes greedily (torch's argmax of the logits: the tokens of torch's greedy
    decoding with the module); ``top_k=k`` samples from the ``k`` most likely tokens at
    ``temperature``, reproducibly for a given ``seed`` (drawn on the host with torch from the
    logits the program returns). Returns the prompt followed by the new tokens, int64, as a torch
    tensor of the prompt's rank.

    >>> import torch
    >>> from einjoin.models.zoo import Llama, LlamaConfig
    >>> torch.manual_seed(0) and None
    >>> model = Llama(LlamaConfig(dim=16, heads=2, kv_heads=1, hidden=24, layers=1, vocab=32, seq=16)).eval()
    >>> prompt = torch.tensor([[3, 1, 4, 1]])
    >>> ours = generate(model, prompt, 5, capacity=16)
    >>> ids = prompt
    >>> for _ in range(5):  # torch's greedy decoding: full recompute, argmax
    ...     ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    >>> bool((ours == ids).all())
    True
    """
    ids, _ = _ids(prompt_ids, _read(module).vocab)
    dec = Decoder(module, ids.shape[0], capacity, devices=devices, backend=backend, planner=planner)
    return dec.generate(prompt_ids, max_new_tokens, top_k=top_k, temperature=temperature, seed=seed)
