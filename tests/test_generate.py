"""ej.generate: greedy tokens equal torch's greedy decoding (full recompute + argmax) with the zoo's
LLaMA and GPT-2 on 1 and 2 devices; decode logits equal torch's; top-k sampling reproducible with
a seed and drawn from the top k; a decode step loads only the new ids and the position; errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.generate import Decoder
from einjoin.models import zoo
from einjoin.models.zoo import Llama, LlamaConfig

VOCAB = 64


def tiny_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(dim=32, heads=4, kv_heads=2, hidden=48, layers=2, vocab=VOCAB, seq=64)).eval()


def tiny_gpt2(seed: int = 1) -> torch.nn.Module:
    """The zoo's GPT-2 with its weights spread wider than the default init (whose tied head makes
    a tiny model repeat one token forever: a test of that would pass with a broken cache)."""
    torch.manual_seed(seed)
    model = zoo.GPT2(vocab=VOCAB, dim=32, heads=4, seq=64, layers=2).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_gain = name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.2) + (1.0 if norm_gain else 0.0))
    return model


def torch_greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def prompt_of(batch: int, seq: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# 2 devices: make test-all (GPT-2 decodes on 2 by default)
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_llama_32_greedy_tokens_equal_torch(devices):
    model, prompt = tiny_llama(), prompt_of(1, 8)
    ours = ej.generate(model, prompt, 32, devices=devices, capacity=256)
    ref = torch_greedy(model, prompt, 32)
    assert ours.dtype == torch.int64 and ours.shape == (1, 40)
    assert len(set(ref[0, 8:].tolist())) > 4  # the model does not just repeat a token
    assert torch.equal(ours, ref)


@pytest.mark.slow  # make test-all; greedy decoding vs torch runs by default
def test_llama_batch_of_two_on_two_devices_and_a_1d_prompt():
    model = tiny_llama(2)
    prompt = prompt_of(2, 5, seed=9)
    assert torch.equal(ej.generate(model, prompt, 12, devices=2, capacity=32), torch_greedy(model, prompt, 12))
    one = ej.generate(model, prompt[1], 6, capacity=16)
    assert one.shape == (11,) and torch.equal(one, torch_greedy(model, prompt[1:], 6)[0])


@pytest.mark.parametrize("devices", [1, 2])
def test_gpt2_greedy_tokens_equal_torch(devices):
    model, prompt = tiny_gpt2(), prompt_of(2, 6)
    ours = ej.generate(model, prompt, 16, devices=devices, capacity=64)
    ref = torch_greedy(model, prompt, 16)
    assert len(set(ref[0, 6:].tolist())) > 4
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_decode_logits_equal_torch_and_a_step_loads_only_the_new_ids(make):
    model, prompt = make(), prompt_of(2, 7)
    dec = Decoder(model, batch=2, capacity=32, devices=2)
    ids = prompt
    logits = dec.prefill(prompt.numpy())
    for step in range(6):
        with torch.no_grad():
            ref = model(ids)[:, -1].numpy()
        np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
        nxt = torch.from_numpy(ref).argmax(-1, keepdim=True)
        logits = dec.step(nxt.numpy(), ids.shape[1])
        stats = dec.decode.run_stats
        if step:  # after the first step the state (weights, caches) is on the devices
            assert stats.bytes_loaded == nxt.numpy().nbytes == dec.step_bytes  # the new ids only
            # nothing else crosses the host link: the logits come back, the caches stay
            assert stats.bytes_fetched == logits.nbytes and stats.bytes_reloaded == stats.bytes_evicted == 0
        else:     # the first loads the written state too: the weights and the prefill's caches
            assert stats.bytes_loaded == dec.decode.stats.bytes_loaded
        ids = torch.cat([ids, nxt], 1)


@pytest.mark.slow  # make test-all; greedy decoding vs torch runs by default
def test_top_k_sampling_is_reproducible_and_draws_from_the_top_k():
    model, prompt = tiny_llama(3), prompt_of(1, 4)
    a = ej.generate(model, prompt, 12, top_k=5, temperature=0.8, seed=11, capacity=32)
    b = ej.generate(model, prompt, 12, top_k=5, temperature=0.8, seed=11, capacity=32, devices=2)
    c = ej.generate(model, prompt, 12, top_k=5, temperature=0.8, seed=12, capacity=32)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # another seed, another draw (fixed seeds: checked once)
    with torch.no_grad():
        for t in range(4, 16):
            top = set(model(a[:, :t])[0, -1].topk(5).indices.tolist())
            assert a[0, t].item() in top
    # top_k=1 is greedy whatever the seed
    assert torch.equal(ej.generate(model, prompt, 6, top_k=1, seed=3, capacity=16), torch_greedy(model, prompt, 6))


def test_errors_name_the_argument():
    model, prompt = tiny_llama(), prompt_of(1, 8)
    with pytest.raises(ej.EinjoinError, match="exceeds the cache's capacity=16"):
        ej.generate(model, prompt, 9, capacity=16)
    with pytest.raises(ej.EinjoinError, match="64 positions the module holds"):
        ej.generate(model, prompt, 57, capacity=256)
    with pytest.raises(ej.EinjoinError, match="unsupported module class .*GPT2Block.*zoo.Llama"):
        ej.generate(zoo.GPT2Block(), prompt, 2)
    with pytest.raises(ej.DTypeError, match="integer token ids, got dtype float32"):
        ej.generate(model, prompt.float(), 2)
    with pytest.raises(ej.ShapeError, match=r"\(batch, seq\).*shape \(1, 1, 8\)"):
        ej.generate(model, prompt[None], 2)
    with pytest.raises(ej.ShapeError, match=r"shape \(1, 0\)"):
        ej.generate(model, prompt[:, :0], 2)
    with pytest.raises(ej.EinjoinError, match=r"\[0, 64\)"):
        ej.generate(model, prompt + VOCAB, 2)
    with pytest.raises(ej.EinjoinError, match="prompt_ids must be a torch tensor or numpy array"):
        ej.generate(model, [[1, 2]], 2)
    with pytest.raises(ej.EinjoinError, match="max_new_tokens must be an int >= 0"):
        ej.generate(model, prompt, -1)
    with pytest.raises(ej.EinjoinError, match="top_k=65 exceeds the vocabulary"):
        ej.generate(model, prompt, 2, top_k=65)
    with pytest.raises(ej.EinjoinError, match="temperature must be a positive finite number"):
        ej.generate(model, prompt, 2, top_k=3, temperature=0.0)
    assert torch.equal(ej.generate(model, prompt, 0), prompt)  # nothing to generate: the prompt
    dec = Decoder(model, batch=1, capacity=16)
    with pytest.raises(ej.EinjoinError, match="step before Decoder.prefill"):
        dec.step(np.array([[1]]), 0)
    dec.prefill(prompt.numpy())
    with pytest.raises(ej.EinjoinError, match="position 16 is outside the cache"):
        dec.step(np.array([[1]]), 16)


def test_a_float64_module_decodes_in_float64():
    model, prompt = tiny_llama(4).double(), prompt_of(1, 6)
    dec = Decoder(model, batch=1, capacity=16)
    logits = dec.prefill(prompt.numpy())
    assert logits.dtype == np.float64 and dec.decode.graph.input_by_name["l0.k"].dtype == "float64"
    assert torch.equal(ej.generate(model, prompt, 8, capacity=16), torch_greedy(model, prompt, 8))
    with pytest.raises(ej.DTypeError, match="bfloat16 module is not supported"):
        ej.generate(tiny_llama().bfloat16(), prompt, 2)


def test_a_decoder_generates_again_without_compiling_the_decode_step_again():
    model = tiny_llama(6)
    dec = Decoder(model, batch=1, capacity=32, devices=2)
    first = dec.generate(prompt_of(1, 5, seed=1), 6)
    prog = dec.decode
    second = dec.generate(prompt_of(1, 9, seed=2), 6)  # another prompt length: another prefill only
    assert dec.decode is prog
    assert torch.equal(first, torch_greedy(model, prompt_of(1, 5, seed=1), 6))
    assert torch.equal(second, torch_greedy(model, prompt_of(1, 9, seed=2), 6))
    with pytest.raises(ej.ShapeError, match="batches of 1, got prompt_ids of shape \\(2, 5\\)"):
        dec.generate(prompt_of(2, 5), 2)


def test_a_step_at_another_position_writes_it_and_equals_torch():
    # the position is state each step advances; stepping back (or jumping) writes it once
    model, prompt = tiny_llama(), prompt_of(1, 5)
    dec = Decoder(model, batch=1, capacity=16)
    dec.prefill(prompt.numpy())
    tok = np.array([[7]])
    first = dec.step(tok, 5)
    again = dec.step(tok, 5)  # the same token at the same position: the cache row is rewritten
    assert dec.decode.run_stats.bytes_loaded == tok.nbytes + np.int64(0).nbytes
    np.testing.assert_array_equal(first, again)
    with torch.no_grad():
        ref = model(torch.cat([prompt, torch.from_numpy(tok)], 1))[:, -1].numpy()
    np.testing.assert_allclose(again, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    nxt = dec.step(np.array([[3]]), 6)  # the next position again: only the ids
    assert dec.decode.run_stats.bytes_loaded == 8
    with torch.no_grad():
        ref = model(torch.cat([prompt, torch.from_numpy(tok), torch.tensor([[3]])], 1))[:, -1].numpy()
    np.testing.assert_allclose(nxt, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
