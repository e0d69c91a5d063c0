"""nn.MultiheadAttention, nn.TransformerEncoderLayer and nn.TransformerEncoder imported with
``ej.from_torch`` against torch for the same call (issue 20): batch_first, norm_first, no mask,
an attention mask, a key padding mask, both, is_causal, and the masks where torch's fast and slow
paths differ (a fully padded row, a fully masked attention row, a float padding mask, padding not
at the end with mask_check on and off), under torch.no_grad() and with grad enabled (torch's
fast path or its slow one: the import follows the grad state where ``from_torch`` is called),
through torch.export and torch.fx, on the numpy reference and compiled for 1 and 2 devices.

One module computes every mask case at once (one import and one compile per configuration);
the full sweep is slow (``make test-all``), a sample of it runs by default."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej
from einjoin.frontend import attention_modules as AM

B, S, E, H = 2, 5, 8, 2


def _mask_cases() -> dict[str, tuple[Any, Any, bool]]:
    """name -> (attention mask, key padding mask, is_causal)."""
    g = torch.Generator().manual_seed(4)
    am = torch.rand(S, S, generator=g) > 0.6
    am.fill_diagonal_(False)  # every query keeps a key
    kpm = torch.tensor([[False] * S, [False, False, True, True, True]])
    row = torch.zeros(S, S, dtype=torch.bool)
    row[1] = True  # query 1 may attend nothing
    return {
        "none": (None, None, False),
        "attn": (am, None, False),
        "kpm": (None, kpm, False),
        "both": (am, kpm, False),
        "causal": (nn.Transformer.generate_square_subsequent_mask(S), None, True),
        "causal+kpm": (torch.triu(torch.ones(S, S, dtype=torch.bool), 1), kpm, True),
        "fully padded row": (None, torch.tensor([[False] * S, [True] * S]), False),
        "fully masked query": (row, None, False),
        "float kpm": (None, kpm.float() * -1e9, False),
        "padding not at the end": (None, torch.tensor([[False, True, False, False, False],
                                                       [True, False, False, True, True]]), False),
    }


CASES = _mask_cases()
NAMES = tuple(CASES)
FIVE = ("none", "attn", "kpm", "both", "causal")


def _module(kind: str, bf: bool, nf: bool, nested: bool, check: bool) -> nn.Module:
    torch.manual_seed(3)
    if kind == "mha":
        return nn.MultiheadAttention(E, H, batch_first=bf).eval()
    layer = nn.TransformerEncoderLayer(E, H, 16, batch_first=bf, norm_first=nf)
    if kind == "layer":
        return layer.eval()
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E), enable_nested_tensor=nested,
                                 mask_check=check).eval()


class _Cases(nn.Module):
    """``m`` called once per mask case (the masks are forward arguments: graph inputs), the
    outputs in turn; MultiheadAttention without weights, and with them for two cases."""

    def __init__(self, m: nn.Module, kind: str, names: tuple[str, ...]) -> None:
        super().__init__()
        self.m, self.kind, self.names = m, kind, names

    def one(self, x: torch.Tensor, am: Any, kpm: Any, causal: bool, weights: bool = False) -> Any:
        if self.kind == "mha":
            out, w = self.m(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=weights, is_causal=causal)
            return (out, w) if weights else out
        if self.kind == "layer":
            return self.m(x, src_mask=am, src_key_padding_mask=kpm, is_causal=causal)
        return self.m(x, mask=am, src_key_padding_mask=kpm, is_causal=causal)

    def cases(self, x: torch.Tensor, masks: list[torch.Tensor]) -> tuple[Any, ...]:
        it = iter(masks)
        outs: list[Any] = []
        for name in self.names:
            am, kpm, causal = CASES[name]
            am = None if am is None else next(it)
            kpm = None if kpm is None else next(it)
            outs.append(self.one(x, am, kpm, causal))
            if self.kind == "mha" and name in ("kpm", "fully padded row"):
                outs.extend(self.one(x, am, kpm, causal, weights=True))
        return tuple(outs)


def _cases(m: nn.Module, kind: str, names: tuple[str, ...]) -> nn.Module:
    """:class:`_Cases` whose forward takes the masks as separate tensors (x, m0, m1, ...): both
    captures take tensors, not lists."""
    n = sum(t is not None for name in names for t in CASES[name][:2])
    args = ", ".join(f"m{i}" for i in range(n))
    scope: dict[str, Any] = {}
    exec(f"def forward(self, x, {args}):\n    return self.cases(x, [{args}])", scope)  # noqa: S102 - a fixed text
    return type("Cases", (_Cases,), {"forward": scope["forward"]})(m, kind, names)


def _inputs(bf: bool, names: tuple[str, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(B, S, E, generator=torch.Generator().manual_seed(5))
    masks = [t for n in names for t in CASES[n][:2] if t is not None]
    return (x if bf else x.transpose(0, 1).contiguous()), masks


def _close(got: Any, want: Any, what: str) -> None:
    got = got if isinstance(got, (tuple, list)) else (got,)
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.as_tensor(np.asarray(g))
        assert torch.equal(g.isnan(), w.isnan()), f"{what}, output {i}: NaN where torch has none (or not)"
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, equal_nan=True,
                                   msg=lambda m, i=i: f"{what}, output {i}: {m}")


def _check(kind: str, bf: bool, nf: bool, nested: bool, check: bool, grad: bool, method: str,
           names: tuple[str, ...], devices: tuple[int, ...]) -> ej.TorchFunction:
    """torch's outputs for every case against the import (made in the same grad mode) on the
    numpy reference and compiled for ``devices``."""
    m = _cases(_module(kind, bf, nf, nested, check), kind, names).eval()
    x, masks = _inputs(bf, names)
    what = f"{kind} batch_first={bf} norm_first={nf} nested={nested} mask_check={check} grad={grad} {method}"
    with torch.set_grad_enabled(grad):
        want = [t.detach() for t in _flat(m(x, *masks))]
        fn = ej.from_torch(m, (x, *masks), method=method)
    if method == "fx":
        assert fn.method == "fx", what
    _close(_flat(fn.reference(x.numpy(), *[t.numpy() for t in masks])), want, f"{what} (reference)")
    for d in devices:
        _close(_flat(ej.compile(fn, devices=d, quiet=True).run(x, *masks)), want, f"{what} on {d} devices")
    return fn


def _flat(v: Any) -> list[Any]:
    return [t for x in v for t in _flat(x)] if isinstance(v, (tuple, list)) else [v]


CONFIGS = [("mha", bf, False, True, True) for bf in (True, False)] + \
          [("layer", bf, nf, True, True) for bf, nf in itertools.product((True, False), (False, True))] + \
          [("enc", bf, nf, nested, check) for bf, nf, (nested, check) in
           itertools.product((True, False), (False, True), ((True, True), (True, False), (False, True)))]


def _id(c: tuple[Any, ...]) -> str:
    kind, bf, nf, nested, check = c
    return f"{kind}-bf{bf:d}-nf{nf:d}" + (f"-nested{nested:d}-check{check:d}" if kind == "enc" else "")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_sweep_every_mask_case_equals_torch(config: tuple[Any, ...], grad: bool, method: str) -> None:
    """The full sweep: every configuration x grad mode x capture, every mask case, on the
    reference and on 1 and 2 devices."""
    _check(*config, grad, method, NAMES, (1, 2))


@pytest.mark.parametrize("config", [
    ("mha", True, False, True, True), ("layer", True, True, True, True), ("enc", True, False, True, True),
    ("enc", True, False, True, False), ("enc", False, True, True, True)], ids=_id)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_every_mask_case_equals_torch_fx(config: tuple[Any, ...], grad: bool) -> None:
    """A sample of the sweep (torch.fx: the module translations) on the numpy reference."""
    _check(*config, grad, "fx", NAMES, ())


@pytest.mark.slow  # make test-all; the encoder with padding runs on one device by default
def test_encoder_with_padding_export_on_two_devices() -> None:
    """torch.export traces the slow path; the import follows torch's no_grad path anyway (nested
    tensor: zeros at the padded positions), compiled for 2 devices (1 device: the adversarial
    test_transformer_encoder_fast_path_padding_equals_torch; both: the slow sweep)."""
    fn = _check("enc", True, False, True, True, False, "export", ("kpm", "fully padded row", "both"), (2,))
    assert fn.method == "export"
    assert any("nested-tensor fast path" in n for n in fn.notes), fn.notes


@pytest.mark.parametrize("kind", ["layer", "enc"])
def test_gradients_through_padding_equal_torch_autograd(kind: str) -> None:
    """With grad enabled torch differentiates its slow path (a fully padded row included: zeros,
    not NaN); ej.grad of the import equals torch.autograd (float64, the numpy reference)."""
    torch.manual_seed(14)
    layer = nn.TransformerEncoderLayer(E, H, 16, batch_first=True, dropout=0.0).double()
    m = layer if kind == "layer" else nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E).double())

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m.eval()

        def forward(self, x: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
            return (self.m(x, src_key_padding_mask=kpm) ** 2).sum()
    loss_m = Loss()
    x = torch.randn(B, S, E, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    kpm = CASES["fully padded row" if kind == "layer" else "kpm"][1]
    want = torch.autograd.grad(loss_m(x, kpm), list(loss_m.parameters()))
    fn = ej.from_torch(loss_m, (x, kpm), method="fx")
    assert list(fn.parameters) == [n for n, _ in loss_m.named_parameters()]
    got = fn.with_outputs(list(ej.grad(fn.outputs[0], list(fn.parameters.values())))).reference(x.numpy(), kpm.numpy())
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-9, atol=1e-10)


class _Enc(nn.Module):
    def __init__(self, enc: nn.Module) -> None:
        super().__init__()
        self.enc = enc

    def forward(self, x: torch.Tensor, kpm: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=kpm)


def _encoder() -> nn.Module:
    torch.manual_seed(9)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 16, batch_first=True), 2).eval()


def test_frozen_parameters_take_the_fast_path_with_grad_enabled() -> None:
    """torch takes the fast path when nothing requires grad, grad mode or not."""
    m = _Enc(_encoder()).requires_grad_(False)
    x, (kpm,) = _inputs(True, ("kpm",))
    want = m(x, kpm)
    assert (want[1, 2:] == 0).all()  # torch's nested tensor: padded positions are 0 (before the norm)
    fn = ej.from_torch(m, (x, kpm), method="fx")
    _close(fn.reference(x.numpy(), kpm.numpy()), [want], "frozen encoder")


def test_recapture_for_a_new_batch_keeps_the_first_imports_path() -> None:
    """A program imported under no_grad and run with a new batch size (a recapture, inside run()
    with grad enabled) still follows torch's no_grad path; the recapture pickles."""
    m = _Enc(_encoder())
    x, (kpm,) = _inputs(True, ("kpm",))
    with torch.no_grad():
        fn = ej.from_torch(m, (x, kpm), method="fx")
    assert pickle.loads(pickle.dumps(fn.recapture)).importer.args == (AM.ImportPaths(False, False),)
    prog = ej.compile(fn, quiet=True)
    x3 = torch.randn(3, S, E)
    kpm3 = torch.tensor([[False] * S, [False, False, False, True, True], [False] + [True] * (S - 1)])
    with torch.no_grad():
        want = m(x3, kpm3)
    _close(prog.run(x3, kpm3), [want], "recaptured for batch 3")


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module, causal: bool) -> None:
        super().__init__()
        self.layer, self.causal = layer, causal

    def forward(self, x: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_mask=am, is_causal=self.causal)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_wrong_is_causal_hint_and_tanh_gelu_as_torch(grad: bool) -> None:
    """torch's slow path replaces a mask hinted causal by the causal mask; its fused path ignores the
    hint, and computes exact GELU for nn.GELU(approximate='tanh'): the import does as the path it
    follows."""
    torch.manual_seed(12)
    layer = nn.TransformerEncoderLayer(E, H, 16, batch_first=True, activation=nn.GELU(approximate="tanh")).eval()
    m = _Layer(layer, True)
    x, _ = _inputs(True, ())
    am = torch.rand(S, S, generator=torch.Generator().manual_seed(13)) > 0.5
    am.fill_diagonal_(False)  # not causal
    with torch.set_grad_enabled(grad):
        want = m(x, am).detach()
        fn = ej.from_torch(m, (x, am), method="fx")
    _close(fn.reference(x.numpy(), am.numpy()), [want], f"wrong hint, grad={grad}")


def test_is_causal_without_a_mask_is_refused_on_the_slow_path() -> None:
    """torch: 'Need attn_mask if specifying the is_causal hint' (the slow path); a named error."""
    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(E, H, batch_first=True)

        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return self.attn(q, k, k, need_weights=False, is_causal=True)[0]
    x, _ = _inputs(True, ())
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        Causal()(x, x + 1)
    with pytest.raises(ej.EinjoinError, match="is_causal=True needs the attn_mask"):
        ej.from_torch(Causal().eval(), (x, x + 1), method="fx")


def test_fast_path_turned_off_in_torch_is_followed() -> None:
    """torch.backends.mha.set_fastpath_enabled(False): torch's slow path under no_grad too."""
    m = _Enc(_encoder())
    x, (kpm,) = _inputs(True, ("kpm",))
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            want = m(x, kpm)
            fn = ej.from_torch(m, (x, kpm), method="fx")
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
    assert not (want[1, 2:] == 0).all()
    _close(fn.reference(x.numpy(), kpm.numpy()), [want], "fast path off")
