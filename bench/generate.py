"""Decoding with ``ej.generate``'s static KV cache: tokens per second of greedy decoding against
torch on the same cores, and the host bytes a decode step loads. One table:

* measured here, for the zoo's LLaMA (``Llama``: 4 layers, hidden 512, 8 heads / 4 kv heads, vocab
  4096) and the zoo's GPT-2 (``GPT2``: 4 layers, hidden 512, 8 heads, vocab 4096), batch 1, a
  32-token prompt, 64 new tokens, a 256-position cache:
  - einjoin: the decode program (``einjoin.generate.Decoder``: the weights and the caches are
    program state on the devices, the position too; a step loads the new token ids only) on
    ``ej.local(1)`` and ``ej.local(2)``, threads backend; compile and prefill times beside;
  - torch, full recompute: the module's forward on the whole sequence for every token (what the
    zoo modules offer: they have no KV cache), argmax;
  - torch, KV cache: a cached decoding loop written here with the module's own weights and
    submodules (caches preallocated to the same capacity, written in place at the position,
    ``scaled_dot_product_attention`` over the filled prefix) — the fair peer of einjoin's decode.
  Every row decodes greedily and its tokens are checked against torch's full recompute. torch
  runs with ``torch.set_num_threads(2)`` (the cores einjoin's ``local(2)`` uses); the methods
  alternate for ``--reps`` rounds and each row reports the median decode step (tokens after the
  first; the first comes from the prefill).

Run it with ``make bench`` (or ``.venv/bin/python bench/generate.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

T_START = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

import einjoin as ej  # noqa: E402
from einjoin.generate import Decoder  # noqa: E402
from einjoin.models.zoo import GPT2, Llama, LlamaConfig  # noqa: E402
from einjoin.plan.stats import human_bytes  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from grad import _cpu, others_load, print_header  # noqa: E402  (the same BLAS and load reports)

THREADS = 2
CAPACITY = 256


# --------------------------------------------------------------------------------------------
# the models

def llama(dim: int, layers: int, vocab: int) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    c = LlamaConfig(dim=dim, heads=8, kv_heads=4, hidden=dim * 11 // 4, layers=layers, vocab=vocab, seq=CAPACITY)
    return (f"LLaMA ({layers} layers, hidden {dim}, 8 heads / 4 kv, vocab {vocab})", Llama(c).eval())


def gpt2(dim: int, layers: int, vocab: int) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    return (f"GPT-2 ({layers} layers, hidden {dim}, 8 heads, vocab {vocab})",
            GPT2(vocab=vocab, dim=dim, heads=8, seq=CAPACITY, layers=layers).eval())


# --------------------------------------------------------------------------------------------
# torch with a KV cache, written here (the zoo modules have none): the module's own submodules


def _llama_cached(model: Any, ids: torch.Tensor, pos: int, caches: list[list[torch.Tensor]]) -> torch.Tensor:
    """Run ``ids`` (b, t) at positions pos..pos+t-1, writing the caches in place; last logits."""
    b, t = ids.shape
    x = model.tok_embeddings(ids)
    for layer, (kc, vc) in zip(model.layers, caches):
        c = layer.c
        hd = c.dim // c.heads
        h = layer.attention_norm(x)
        q = layer.wq(h).view(b, t, c.heads, hd).transpose(1, 2)
        k = layer.wk(h).view(b, t, c.kv_heads, hd).transpose(1, 2)
        v = layer.wv(h).view(b, t, c.kv_heads, hd).transpose(1, 2)
        cos, sin = layer.cos[pos:pos + t], layer.sin[pos:pos + t]
        q = q * cos + torch.cat((-q[..., hd // 2:], q[..., : hd // 2]), -1) * sin
        k = k * cos + torch.cat((-k[..., hd // 2:], k[..., : hd // 2]), -1) * sin
        kc[:, :, pos:pos + t] = k
        vc[:, :, pos:pos + t] = v
        rep = c.heads // c.kv_heads
        keys = kc[:, :, :pos + t].repeat_interleave(rep, 1)
        vals = vc[:, :, :pos + t].repeat_interleave(rep, 1)
        a = TF.scaled_dot_product_attention(q, keys, vals, is_causal=t > 1)
        x = x + layer.wo(a.transpose(1, 2).reshape(b, t, c.dim))
        h = layer.ffn_norm(x)
        x = x + layer.w2(TF.silu(layer.w1(h)) * layer.w3(h))
    out: torch.Tensor = model.output(model.norm(x[:, -1]))
    return out


def _gpt2_cached(model: Any, ids: torch.Tensor, pos: int, caches: list[list[torch.Tensor]]) -> torch.Tensor:
    b, t = ids.shape
    x = model.wte(ids) + model.wpe(torch.arange(pos, pos + t))
    for block, (kc, vc) in zip(model.h, caches):
        d = x.shape[-1]
        hd = d // block.heads
        q, k, v = block.c_attn(block.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, block.heads, hd).transpose(1, 2) for z in (q, k, v))
        kc[:, :, pos:pos + t] = k
        vc[:, :, pos:pos + t] = v
        a = TF.scaled_dot_product_attention(q, kc[:, :, :pos + t], vc[:, :, :pos + t], is_causal=t > 1)
        x = x + block.c_proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + block.mlp_proj(TF.gelu(block.c_fc(block.ln_2(x)), approximate="tanh"))
    out: torch.Tensor = model.lm_head(model.ln_f(x[:, -1]))
    return out


def _caches(model: Any, batch: int) -> list[list[torch.Tensor]]:
    if isinstance(model, Llama):
        c: Any = model.layers[0].c
        shape = (batch, c.kv_heads, CAPACITY, c.dim // c.heads)
        n = len(model.layers)
    else:
        first = model.h[0]
        shape = (batch, first.heads, CAPACITY, model.wte.weight.shape[1] // first.heads)
        n = len(model.h)
    return [[torch.zeros(shape), torch.zeros(shape)] for _ in range(n)]


# --------------------------------------------------------------------------------------------
# one greedy generation per method: (tokens, prefill seconds, decode step seconds)


@dataclass
class Run:
    tokens: torch.Tensor
    prefill_s: float
    steps_s: list[float]


@dataclass
class Row:
    method: str
    runs: list[Run] = field(default_factory=list)
    build_s: float = 0.0
    loaded: int = -1            # host bytes a decode step loads after the first (einjoin)
    step_bytes: int = -1        # the new ids


def torch_full(model: Any, prompt: torch.Tensor, n: int) -> Run:
    ids, steps = prompt, []
    with torch.no_grad():
        t0 = time.perf_counter()
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
        prefill = time.perf_counter() - t0
        for _ in range(n - 1):
            t0 = time.perf_counter()
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
            steps.append(time.perf_counter() - t0)
    return Run(ids, prefill, steps)


def torch_cached(model: Any, prompt: torch.Tensor, n: int) -> Run:
    step = _llama_cached if isinstance(model, Llama) else _gpt2_cached
    caches = _caches(model, prompt.shape[0])
    steps: list[float] = []
    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = step(model, prompt, 0, caches).argmax(-1, keepdim=True)
        prefill = time.perf_counter() - t0
        out = [prompt, nxt]
        for j in range(n - 1):
            t0 = time.perf_counter()
            nxt = step(model, nxt, prompt.shape[1] + j, caches).argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
            out.append(nxt)
    return Run(torch.cat(out, 1), prefill, steps)


def einjoin_run(dec: Decoder, prompt: torch.Tensor, n: int) -> Run:
    t0 = time.perf_counter()
    nxt = dec.prefill(prompt.numpy()).argmax(-1).reshape(-1, 1)
    prefill = time.perf_counter() - t0
    out, steps = [prompt.numpy(), nxt], []
    for j in range(n - 1):
        t0 = time.perf_counter()
        nxt = dec.step(nxt, prompt.shape[1] + j).argmax(-1).reshape(-1, 1)
        steps.append(time.perf_counter() - t0)
        out.append(nxt)
    return Run(torch.from_numpy(np.concatenate(out, 1)), prefill, steps)


def bench_model(model: Any, prompt: torch.Tensor, n: int, reps: int, log: Callable[[str], None]) -> list[Row]:
    decoders: dict[int, Decoder] = {}
    rows = {"torch full": Row("torch, full recompute (the module's forward per token)"),
            "torch cached": Row("torch, KV cache written here (module's weights, SDPA on the prefix)")}
    for p in (1, 2):
        t0 = time.perf_counter()
        dec = Decoder(model, prompt.shape[0], CAPACITY, devices=ej.local(p), backend="threads")
        dec.prepare(prompt.shape[1])  # compile both programs now: their time is the compile column
        decoders[p] = dec
        rows[f"ej {p}"] = Row(f"einjoin decode program, local({p}) threads, cache as state",
                              build_s=time.perf_counter() - t0)
    for r in range(reps):  # alternate, so background load hits every row alike
        log(f"round {r + 1}/{reps}")
        rows["torch full"].runs.append(torch_full(model, prompt, n))
        rows["torch cached"].runs.append(torch_cached(model, prompt, n))
        for p, dec in decoders.items():
            rows[f"ej {p}"].runs.append(einjoin_run(dec, prompt, n))
            st = dec.decode.run_stats
            rows[f"ej {p}"].loaded = st.bytes_loaded if st is not None else -1
            rows[f"ej {p}"].step_bytes = dec.step_bytes
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="rounds of every method, alternating")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--prompt", type=int, default=32, help="prompt length")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 190, log_path=False)

    def log(msg: str) -> None:
        console.log(escape(msg))
    torch.set_num_threads(THREADS)
    print_header(console, "einjoin decoding benchmark")

    load0 = _cpu()
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    results = []
    for name, model in (llama(args.dim, args.layers, args.vocab), gpt2(args.dim, args.layers, args.vocab)):
        log(f"{name}: compiling and decoding")
        results.append((name, bench_model(model, prompt, args.tokens, args.reps, log)))
    load = others_load(load0)

    table = Table(title=f"greedy decoding, batch 1, prompt {args.prompt}, {args.tokens} new tokens, cache capacity "
                        f"{CAPACITY} (measured on this machine, {THREADS} threads / devices)")
    for col in ("model", "method", "decode tokens/s", "step (median)", "prefill", "compile",
                "host bytes per step", "tokens = torch greedy"):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    bad = []
    for name, rows in results:
        ref = rows[0].runs[0].tokens
        for row in rows:
            steps = [s for run in row.runs for s in run.steps_s]
            med = statistics.median(steps)
            same = all(torch.equal(run.tokens, ref) for run in row.runs)
            if not same:
                bad.append(f"{name}: {row.method}")
            loaded = "-" if row.loaded < 0 else (f"{human_bytes(row.loaded)} (the new ids: "
                                                 f"{human_bytes(row.step_bytes)})")
            table.add_row(name, row.method, f"{1 / med:.1f}", f"{med * 1e3:.1f} ms",
                          f"{statistics.median(r.prefill_s for r in row.runs) * 1e3:.0f} ms",
                          f"{row.build_s:.1f} s" if row.build_s else "-", loaded, "yes" if same else "NO")
    console.print(table)
    console.print(f"other processes while the timings ran: {load}")
    console.print("einjoin's prefill includes loading every weight (the prefill program's inputs) and the "
                  "caches' trip through the host into the decode program's state; the first decode step "
                  "loads that state once (weights + caches); the host bytes column is a later step's "
                  "run_stats.bytes_loaded. einjoin's next token is chosen on the host (argmax of the "
                  "returned logits), as torch's rows do.")
    console.print(f"total benchmark time: {time.perf_counter() - T_START:.0f} s")
    if bad:
        console.print(f"[red]tokens differ from torch's greedy decoding[/]: {'; '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
