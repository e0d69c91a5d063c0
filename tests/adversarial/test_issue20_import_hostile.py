"""Issue 20, hostile review (second file, so each stays under a minute): ``ej.from_torch`` of the
nn modules and Hugging Face models a user has, called the way torch calls them: keyword masks,
non-tensor arguments, new batch and sequence sizes, fully padded rows, modules that mutate
buffers, pooling modules that return indices. Differential against torch; a strict xfail marks
a defect (its reason names what is wrong and the owner)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import einjoin as ej


def _check(m: nn.Module, args: tuple, kwargs: dict | None = None, devices: int = 2, tol: float = 1e-5) -> None:
    fn = ej.from_torch(m, args, kwargs)
    got = ej.compile(fn, devices=devices, quiet=True).run(*args, **(kwargs or {}))
    with torch.no_grad():
        want = m(*args, **(kwargs or {}))
    gots, wants = _flat(got), _flat(want)
    assert len(gots) == len(wants), (len(gots), len(wants))
    for g, w in zip(gots, wants):
        torch.testing.assert_close(torch.as_tensor(g), w, rtol=tol, atol=tol, equal_nan=True)


def _flat(v: Any) -> list:
    return [t for x in v for t in _flat(x)] if isinstance(v, (tuple, list)) else [v]


_X = torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name, module, x", [
    ("Conv2d reflect padding", lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect"), _X),
    ("Conv2d replicate padding", lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate"), _X),
    ("Conv2d circular padding", lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="circular"), _X),
    ("AvgPool2d ceil + divisor_override", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, divisor_override=2), _X),
    ("AdaptiveAvgPool2d (4, None)", lambda: nn.AdaptiveAvgPool2d((4, None)), _X),
    ("Unfold", lambda: nn.Unfold(3, 2, 1, 2), _X),
    ("unbatched Conv1d", lambda: nn.Conv1d(3, 4, 3), torch.randn(3, 10)),
    ("unbatched MaxPool1d", lambda: nn.MaxPool1d(2), torch.randn(3, 10)),
    ("AvgPool3d without pad counts", lambda: nn.AvgPool3d(2, 1, 1, count_include_pad=False),
     torch.randn(1, 2, 3, 4, 5)),
    ("Conv3d groups, dilation, mixed strides", lambda: nn.Conv3d(4, 4, 2, groups=2, dilation=2, stride=(1, 2, 1)),
     torch.randn(1, 4, 5, 6, 5)),
    ("GroupNorm with one group", lambda: nn.GroupNorm(1, 3), _X),
    ("InstanceNorm2d with running stats (eval)",
     lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), _X),
    ("LayerNorm over two dims, no affine", lambda: nn.LayerNorm((9, 9), elementwise_affine=False), _X),
    ("RMSNorm", lambda: nn.RMSNorm(9), _X),
])
def test_nn_modules_at_their_edges_equal_torch_on_two_devices(name: str, module: Any, x: torch.Tensor) -> None:
    torch.manual_seed(1)
    _check(module().eval(), (x,))


def test_conv_transpose_with_an_output_size_argument() -> None:
    torch.manual_seed(2)
    up = nn.ConvTranspose2d(3, 2, 3, stride=2).eval()

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = up

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x, output_size=(20, 20))  # output_padding 1 chosen by torch

    _check(M(), (_X,))


def test_max_pool_returning_indices_gives_torchs_indices() -> None:
    """Was a defect (H1: the indices were dropped, 'output getitem_1 is NoneType'; fixed in 9de158a)."""
    m = nn.MaxPool2d(3, 2, 1, ceil_mode=True, return_indices=True)
    x = _X.clone()
    x[0, 0, :3, :3] = 1.0  # a window of ties: torch's index is the first maximum
    values, indices = ej.compile(ej.from_torch(m, (x,)), devices=2, quiet=True).run(x)
    want_v, want_i = m(x)
    torch.testing.assert_close(values, want_v)
    assert torch.equal(torch.as_tensor(indices), want_i)


def test_adaptive_max_pool_returning_indices_gives_torchs_indices_or_names_them() -> None:
    """Was a defect (H1: indices dropped; fixed in d9bb205)."""
    m = nn.AdaptiveMaxPool2d(4, return_indices=True)
    try:
        fn = ej.from_torch(m, (_X,))
    except ej.UnsupportedOpError as e:
        assert "ind" in str(e) and "pool" in str(e), e
        return
    values, indices = ej.compile(fn, devices=2, quiet=True).run(_X)
    want_v, want_i = m(_X)
    torch.testing.assert_close(values, want_v)
    assert torch.equal(torch.as_tensor(indices), want_i)


def test_a_module_mutating_a_buffer_moves_it_on_as_torch_and_says_so() -> None:
    """Each run is one torch call: the buffer's new value (a ``buffer_updates`` entry, named in
    ``notes``) is written back into the module, so the second run reads it (issue 36; before, each
    run was torch's first call, silently)."""
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.n.add_(x.shape[0])
            return x.sum() + self.n

    x = torch.ones(2, 3)
    m, twin = Counter(), Counter()
    fn = ej.from_torch(m, (x,))
    assert any("buffer n" in note for note in fn.notes), fn.notes
    prog = ej.compile(fn, quiet=True)
    torch.testing.assert_close(prog.run(x), twin(x))
    torch.testing.assert_close(prog.run(x), twin(x))
    torch.testing.assert_close(m.n, twin.n)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: float = 1.0, flip: bool = False) -> torch.Tensor:
        y = self.lin(x) * scale
        return -y if flip else y


def test_run_with_the_same_non_tensor_arguments_as_at_import() -> None:
    """Was a defect (H3/H4: refused the import's own arguments; fixed in 82b74b3)."""
    torch.manual_seed(3)
    m, x = _Scaled().eval(), torch.randn(5, 4)
    prog = ej.compile(ej.from_torch(m, (x, 2.0, True)), quiet=True)
    with torch.no_grad():
        want = m(x, 2.0, True)
    torch.testing.assert_close(prog.run(x, 2.0, True), want)
    torch.testing.assert_close(prog.run(x, scale=2.0, flip=True), want)


# ---------------------------------------------------------------- Hugging Face, called as users call it


transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2_program() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=96, n_positions=64,
                                  bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 96, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    dyn = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}}
    fn = ej.from_torch(model, (ids,), {"attention_mask": am}, dynamic=dyn)  # the model itself, mask by keyword
    return model, ej.compile(fn, devices=2, quiet=True)


def _hidden(out: Any) -> torch.Tensor:
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0] if isinstance(out, (tuple, list)) else out


def _gpt2_want(model: nn.Module, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=am, use_cache=False).last_hidden_state


@pytest.mark.slow  # make test-all; a GPT-2 per shape; HF import and dynamic shapes have their tests
def test_hf_gpt2_with_a_keyword_mask_new_batch_and_length_and_a_fully_padded_row(gpt2_program: Any) -> None:
    model, prog = gpt2_program
    g = torch.Generator().manual_seed(5)
    for b, s in ((2, 8), (3, 12), (2, 8)):
        ids = torch.randint(0, 96, (b, s), generator=g)
        am = torch.ones(b, s, dtype=torch.long)
        am[0, : s // 2] = 0   # left padding
        am[-1] = 0            # a row with no token at all (sdpa: zeros where torch gives zeros)
        torch.testing.assert_close(_hidden(prog.run(ids, attention_mask=am)), _gpt2_want(model, ids, am),
                                   rtol=1e-4, atol=1e-4, equal_nan=True)
    assert prog.run_stats.cache_hits >= 1 and prog.run_stats.cache_misses >= 1


@pytest.mark.slow  # make test-all; a GPT-2 per shape; HF import and dynamic shapes have their tests
def test_hf_gpt2_refuses_mismatched_dynamic_sizes_and_too_long_sequences(gpt2_program: Any) -> None:
    _, prog = gpt2_program
    with pytest.raises(ej.ShapeError, match="two sizes"):
        prog.run(torch.zeros(3, 12, dtype=torch.long), attention_mask=torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ej.DTypeError, match="attention_mask"):
        prog.run(torch.zeros(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 8))
    with pytest.raises(ej.EinjoinError, match="out of range"):  # 70 positions, the model holds 64
        prog.run(torch.zeros(1, 70, dtype=torch.long), attention_mask=torch.ones(1, 70, dtype=torch.long))


# ---------------------------------------------------------------- recurrences and attention modules


@pytest.mark.parametrize("name, module, args", [
    ("LSTM, 2 layers, bidirectional", lambda: nn.LSTM(4, 6, 2, bidirectional=True), (torch.randn(5, 2, 4),)),
    ("GRU, 2 layers, dropout (eval)", lambda: nn.GRU(4, 6, 2, dropout=0.5), (torch.randn(5, 2, 4),)),
    ("unbatched GRU", lambda: nn.GRU(4, 6), (torch.randn(5, 4),)),
    ("RNN relu", lambda: nn.RNN(4, 6, nonlinearity="relu"), (torch.randn(5, 2, 4),)),
    ("GRUCell without hx", lambda: nn.GRUCell(4, 6), (torch.randn(3, 4),)),
])
def test_recurrent_modules_equal_torch(name: str, module: Any, args: tuple) -> None:
    torch.manual_seed(4)
    _check(module().eval(), args)


@pytest.mark.parametrize("module, args", [
    (lambda: nn.LSTMCell(4, 6), (torch.randn(3, 4), (torch.randn(3, 6), torch.randn(3, 6)))),
    (lambda: nn.LSTM(4, 6, batch_first=True), (torch.randn(5, 2, 4), (torch.randn(1, 5, 6), torch.randn(1, 5, 6)))),
])
def test_tuple_arguments_run_as_torch_calls_them(module: Any, args: tuple) -> None:
    """Was a defect (H3/H4: run(x, (h, c)) refused; fixed in 82b74b3)."""
    torch.manual_seed(5)
    _check(module().eval(), args)


_Q = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(6))
_KPM = torch.tensor([[False] * 5, [False, False, True, True, True]])


def _mha() -> nn.MultiheadAttention:
    torch.manual_seed(7)
    return nn.MultiheadAttention(8, 2, batch_first=True).eval()


class _Call(nn.Module):
    def __init__(self, f: Any, mod: nn.Module) -> None:
        super().__init__()
        self.f, self.mod = f, mod

    def forward(self, *a: Any) -> Any:
        return self.f(self.mod, *a)


@pytest.mark.parametrize("name, f, args", [
    ("bool key padding mask", lambda m, q, k: m(q, q, q, key_padding_mask=k), (_Q, _KPM)),
    ("float key padding mask", lambda m, q, k: m(q, q, q, key_padding_mask=k), (_Q, _KPM.float() * -1e9)),
    ("3-D bool attn_mask, per-head weights", lambda m, q, a: m(q, q, q, attn_mask=a, average_attn_weights=False),
     (_Q, torch.randn(4, 5, 5, generator=torch.Generator().manual_seed(8)) > 0.5)),
    ("a sequence with every key masked", lambda m, q, k: m(q, q, q, key_padding_mask=k),
     (_Q, torch.tensor([[False] * 5, [True] * 5]))),
])
def test_multihead_attention_masks_equal_torch(name: str, f: Any, args: tuple) -> None:
    _check(_Call(f, _mha()), args)


def test_transformer_encoder_fast_path_padding_equals_torch() -> None:
    """Was a defect (H2): nn.TransformerEncoder in eval mode with src_key_padding_mask, called under
    torch.no_grad(), takes torch's nested-tensor fast path (0 at padded positions); the import gave
    the slow path's values there. The import follows the path torch takes for the call made where
    from_torch is called (under no_grad here: the fast path), and its notes say which and why."""
    torch.manual_seed(9)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    m = _Call(lambda m, q, k: m(q, src_key_padding_mask=k), enc)
    with torch.no_grad():
        _check(m, (_Q, _KPM), devices=1)
    # imported with grad enabled (torch's slow path for that call), the notes point at no_grad
    notes = ej.from_torch(m, (_Q, _KPM)).notes
    assert any("slow path" in n and "torch.no_grad()" in n for n in notes), notes


def test_imported_program_takes_transposed_expanded_and_grad_requiring_tensors() -> None:
    torch.manual_seed(10)
    lin = nn.Linear(4, 3).eval()
    prog = ej.compile(ej.from_torch(lin, (torch.randn(5, 4),)), devices=2, quiet=True)
    for x in (torch.randn(4, 5).t(), torch.randn(1, 4).expand(5, 4), torch.randn(5, 4, requires_grad=True)):
        torch.testing.assert_close(prog.run(x), lin(x).detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ej.EinjoinError, match="meta"):
        prog.run(torch.empty(5, 4, device="meta"))


def test_generate_takes_a_strided_int32_prompt() -> None:
    from einjoin.models.zoo import Llama, LlamaConfig
    torch.manual_seed(11)
    m = Llama(LlamaConfig(dim=16, heads=2, kv_heads=1, hidden=24, layers=1, vocab=32, seq=16)).eval()
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]], dtype=torch.int32)[:, ::2]
    ids = prompt.long()
    with torch.no_grad():
        for _ in range(3):
            ids = torch.cat([ids, m(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    got = ej.generate(m, prompt, 3, capacity=8)
    assert got.dtype == torch.int64 and torch.equal(got, ids)


def test_recapture_for_new_shapes_leaves_torch_in_other_threads_alone() -> None:
    """Was a defect (H3: the recapture exported the live module; fixed in a8e68e3 (a copy sharing its weights))."""
    import threading

    import numpy as np
    torch.manual_seed(12)
    m = nn.Linear(4, 3).eval()
    prog = ej.compile(ej.from_torch(m, (torch.randn(2, 4),)), quiet=True, devices=2)
    done = threading.Event()
    errors: dict[str, list[str]] = {"einjoin": [], "torch": []}

    def einjoin_thread() -> None:
        for b in range(3, 9):  # six new shapes: six recaptures
            try:
                prog.run(np.random.default_rng(b).standard_normal((b, 4)).astype("float32"))
            except Exception as e:  # noqa: BLE001 - collected
                errors["einjoin"].append(repr(e)[:120])
        done.set()

    def torch_thread() -> None:
        while not done.is_set():
            try:
                with torch.no_grad():
                    m(torch.randn(5, 4))
            except Exception as e:  # noqa: BLE001 - collected
                errors["torch"].append(repr(e)[:120])
    ts = [threading.Thread(target=einjoin_thread), threading.Thread(target=torch_thread)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "hang"
    assert errors == {"einjoin": [], "torch": []}, {k: v[:2] for k, v in errors.items()}


def test_recapture_keeps_the_import_time_eval_mode() -> None:
    """Was a defect (H3: the recapture took the current training mode; fixed in a8e68e3). Since
    issue 36 a run while the module is in another mode than at the import is refused (torch's
    call would compute the other mode: the import's graph would differ silently); back in the
    import's mode, a new shape's recapture computes it."""
    torch.manual_seed(13)
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    prog = ej.compile(ej.from_torch(m, (torch.randn(3, 4),)), quiet=True)
    xa, xb = torch.randn(3, 4), torch.randn(6, 4)
    torch.testing.assert_close(prog.run(xa), m(xa).detach())
    m.train()
    try:
        with pytest.raises(ej.EinjoinError, match="training is True now, False when it was imported"):
            prog.run(xb)
    finally:
        m.eval()
    torch.testing.assert_close(prog.run(xb), m(xb).detach())


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_fx_import_keeps_forward_hooks_or_refuses(hook: str) -> None:
    """Was a defect (H3: fx ignored hooks silently; fixed in d642291 (refused, naming the hook))."""
    torch.manual_seed(14)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    if hook == "forward":
        m[0].register_forward_hook(lambda mod, inp, out: out * 10)
    else:
        m[2].register_forward_pre_hook(lambda mod, inp: (inp[0] + 1,))
    x = torch.randn(3, 4)
    try:
        fn = ej.from_torch(m, (x,), method="fx")
    except ej.EinjoinError as e:
        assert "hook" in str(e), e
        return
    torch.testing.assert_close(ej.compile(fn, quiet=True).run(x), m(x).detach())


# fixed by the integrator: left out where the forward's default differs from the import's value, it is refused
def test_omitting_a_non_tensor_argument_means_its_default_as_in_torch() -> None:
    torch.manual_seed(15)
    m, x = _Scaled().eval(), torch.randn(5, 4)
    prog = ej.compile(ej.from_torch(m, (x, 2.0)), quiet=True)
    try:
        got = prog.run(x)
    except ej.EinjoinError as e:
        assert "scale" in str(e), e
        return
    torch.testing.assert_close(got, m(x).detach())
