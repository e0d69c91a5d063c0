"""The ``h200`` preset against one real H200 (``../shared/measured/h200.md``, torch 2.11 eager, bf16,
median of 20 CUDA-event timings): the LLaMA-7B block (seq 2048) and its Megatron tensor-parallel
shards (heads / tp, ffn / tp, one shard alone, no all-reduce), batch 1 and 8. The simulated times
must be within 20% median and 35% worst (issue 23). The shards' loss of efficiency has to come out
of the kernel model (the GEMM efficiency curve of the preset, fitted to that file's GEMM rates,
not to these blocks), not from a figure per case. The weights are resident on the GPU, as in the
measurement (``resident=True``)."""

from __future__ import annotations

import statistics

import pytest

import einjoin as ej

# (batch, tp) -> eager ms, copied from ../shared/measured/h200.md
MEASURED_MS = {(1, 1): 1.612, (1, 2): 0.909, (1, 4): 0.685, (1, 8): 0.542,
               (8, 1): 12.774, (8, 2): 6.250, (8, 4): 3.448, (8, 8): 1.957}


def llama7b_shard(batch: int, tp: int, seq: int = 2048, d: int = 4096, heads: int = 32, head_dim: int = 128,
                  hidden: int = 11008) -> ej.Tensor:
    """One Megatron shard of a LLaMA-7B block: RMSNorm, q/k/v of heads / tp heads, rotary, causal
    attention, the output projection's rows of those heads, RMSNorm, SwiGLU of hidden / tp."""
    h_, f = heads // tp, hidden // tp
    x = ej.input("x", (batch, seq, d), "bfloat16")

    def p(name: str, shape: tuple[int, ...]) -> ej.Tensor:
        return ej.param(name, shape, "bfloat16")

    def heads_of(t: ej.Tensor) -> ej.Tensor:
        return t.reshape(batch, seq, h_, head_dim).transpose(-3, -2)

    h = ej.rms_norm(x, p("attn_norm", (d,)))
    q, k, v = (heads_of(ej.linear(h, p(n, (h_ * head_dim, d)))) for n in ("wq", "wk", "wv"))
    a = ej.attention(ej.rope(q), ej.rope(k), v, causal=True)
    x = x + ej.linear(a.transpose(-3, -2).reshape(batch, seq, h_ * head_dim), p("wo", (d, h_ * head_dim)))
    h = ej.rms_norm(x, p("mlp_norm", (d,)))
    up = ej.silu(ej.linear(h, p("w1", (f, d)))) * ej.linear(h, p("w3", (f, d)))
    return x + ej.linear(up, p("w2", (d, f)))


@pytest.mark.slow  # eight compiles of a 7B block: ~5-10 s on two busy cores
def test_the_h200_preset_matches_a_measured_h200():
    cluster = ej.Cluster.preset("h200")
    errors = {}
    for (batch, tp), ms in MEASURED_MS.items():
        prog = ej.compile(llama7b_shard(batch, tp), devices=cluster, backend="null", quiet=True)
        errors[(batch, tp)] = abs(prog.simulate(resident=True).makespan * 1e3 - ms) / ms
    assert statistics.median(errors.values()) <= 0.20, errors
    assert max(errors.values()) <= 0.35, errors
    # the shards lose efficiency in the model too: 8 shards of batch 1 take far more than 1/8
    one = ej.compile(llama7b_shard(1, 8), devices=cluster, backend="null", quiet=True).simulate(resident=True)
    whole = ej.compile(llama7b_shard(1, 1), devices=cluster, backend="null", quiet=True).simulate(resident=True)
    assert one.makespan > 0.3 * whole.makespan
