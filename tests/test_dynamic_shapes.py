"""Shapes that change (issue 20): a program compiled from ``ej.from_torch`` called with other
shapes imports the module again, compiles once per shape signature and caches the program in an
LRU (``shape_cache``); ``dynamic=`` limits which dims may change; ``run_stats`` carries the
cache key and the hit / miss counts; programs that cannot follow new shapes say why."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
import einjoin.program as program_mod


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


class _Attn(torch.nn.Module):
    """Batch, sequence and hidden dims: a softmax over the sequence, a matmul per batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(1, 2) / 8 ** 0.5
        return torch.softmax(s + mask, dim=-1) @ x


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_new_shapes_compile_once_each_and_a_seen_shape_costs_nothing(devices, monkeypatch, caplog):
    m = _mlp()
    prog = ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), devices=devices, quiet=True)
    x4 = torch.randn(4, 8)
    _close(prog.run(x4), m(x4))
    assert prog.run_stats.cache_key is None and (prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (1, 0)
    x6 = torch.randn(6, 8)
    with caplog.at_level(logging.INFO, logger="einjoin"):
        _close(prog.run(x6), m(x6))
    assert prog.run_stats.cache_key == (("input", (6, 8)),)
    assert (prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (1, 1)
    logged = [r.getMessage() for r in caplog.records if r.name == "einjoin.program"]
    assert len(logged) == 1 and "input (6, 8)" in logged[0] and " s " in logged[0]

    # a seen shape: neither a capture nor a compile
    def fail(*a, **k):
        raise AssertionError("compiled again for a shape seen before")
    monkeypatch.setattr(program_mod, "build_plan", fail)
    object.__setattr__(prog.plan, "recapture", fail)  # a frozen dataclass: no capture either
    x6b = torch.randn(6, 8).numpy()
    out = prog.run(x6b)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, m(torch.from_numpy(x6b)).detach().numpy(), rtol=1e-4, atol=1e-5)
    _close(prog.run(input=x4), m(x4))  # by name, the compiled shape again
    assert (prog.run_stats.cache_key, prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (None, 3, 1)
    assert len(prog.shape_cache) == 1


def test_dynamic_dims_may_change_and_the_others_are_refused_by_name():
    m = _Attn()
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 5, 5)
    fn = ej.from_torch(m, (x, mask), dynamic={"x": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq", 2: "seq"}})
    prog = ej.compile(fn, devices=2, quiet=True)
    for b, s in ((2, 5), (3, 7), (1, 7), (3, 7)):
        xb, mb = torch.randn(b, s, 8), torch.randn(b, s, s)
        _close(prog.run(xb, mb), m(xb, mb))
    assert (prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (2, 2)
    with pytest.raises(ej.ShapeError, match=r"input 'x' dim 2 is not dynamic: .*compiled for size 8, got 6"):
        prog.run(torch.randn(2, 5, 6), torch.zeros(2, 5, 5))
    with pytest.raises(ej.ShapeError, match=r"'x' has 2 dims .* compiled for 3"):
        prog.run(torch.randn(10, 8), torch.zeros(2, 5, 5))
    with pytest.raises(ej.ShapeError, match=r"dynamic dim 'seq' has two sizes: input 'x' dim 1 is 6 but input 'mask' "
                                            r"dim 1 is 5"):
        prog.run(torch.randn(2, 6, 8), torch.zeros(2, 5, 5))


def test_the_lru_keeps_shape_cache_programs_and_the_option_is_checked():
    m = _mlp()
    prog = ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), devices=2, quiet=True, shape_cache=2)
    for n in (1, 2, 3, 2, 1):  # 1 and 2 compiled, 3 evicts 1, 2 hits, 1 compiles again (evicting 3)
        x = torch.randn(n, 8)
        _close(prog.run(x), m(x))
    assert (prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (1, 4)
    assert [dict(k)["input"][0] for k in prog.shape_cache.keys()] == [2, 1]
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ej.EinjoinError, match="shape_cache must be an int >= 1"):
            ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), quiet=True, shape_cache=bad)
    unbounded = ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), quiet=True, shape_cache=None)
    for n in range(1, 12):
        unbounded.run(torch.randn(n, 8))
    assert len(unbounded.shape_cache) == 10


def test_new_shapes_bind_the_same_parameters_as_the_compiled_shape():
    """The compiled program binds the module's tensors (views: an in-place update is seen); a
    program for other shapes binds the very same ones, and every shape follows a parameter
    replaced by a new object (issue 36: before, the program kept the replaced one, silently)."""
    m = _mlp()
    prog = ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), devices=2, quiet=True)
    with torch.no_grad():
        m[0].weight.add_(1.0)  # in place: both shapes see it
    for n in (4, 5):
        x = torch.randn(n, 8)
        _close(prog.run(x), m(x))
    m[0].weight = torch.nn.Parameter(torch.zeros(16, 8))  # replaced: every shape follows it
    for n in (4, 5, 7):
        x = torch.randn(n, 8)
        _close(prog.run(x), m(x))


def test_programs_that_cannot_follow_new_shapes_say_why():
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    fn = ej.from_torch(Scale(), (torch.randn(4, 3),))
    w = fn.parameters["w"]
    stateful = ej.compile(fn, devices=2, quiet=True, state={w * 0.5: w})
    stateful.run(torch.ones(4, 3))
    with pytest.raises(ej.EinjoinError, match=r"has state \('w'\).*x \(4, 3\).*got x \(5, 3\)"):
        stateful.run(torch.ones(5, 3))
    np.testing.assert_allclose(stateful.read_state()["w"], np.full(3, 0.5, np.float32))

    # a graph built on the import (with_outputs) is no longer the forward: no recapture
    loss = fn.with_outputs(fn.outputs[0].sum())
    prog = ej.compile(loss, quiet=True)
    assert prog.shape_cache is None
    with pytest.raises(ej.EinjoinError, match=r"shape \(5, 3\)|\(4, 3\)"):
        prog.run(torch.ones(5, 3))

    # a program built from tensors keeps its feed error
    plain = ej.compile(ej.input("x", (4, 3)) * 2.0, quiet=True)
    with pytest.raises(ej.ShapeError, match=r"'x'"):
        plain.run(np.ones((5, 3), np.float32))
    assert plain.shape_cache is None
    plain.run(np.ones((4, 3), np.float32))
    assert plain.run_stats.cache_key is None and plain.run_stats.cache_hits == 0


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 6), devices=st.sampled_from([1, 2]))
def test_any_batch_equals_torch(batch, devices):
    m = _mlp()
    prog = ej.compile(ej.from_torch(m, (torch.randn(3, 8),), dynamic={"input": {0: "batch"}}),
                      devices=devices, quiet=True)
    x = torch.randn(batch, 8)
    _close(prog.run(x), m(x))
    assert prog.run_stats.cache_key == (None if batch == 3 else (("input", (batch, 8)),))


def test_threads_meeting_a_new_shape_compile_it_once():
    import threading
    m = _mlp()
    prog = ej.compile(ej.from_torch(m, (torch.randn(4, 8),)), devices=2, quiet=True)
    x = torch.randn(9, 8)
    outs, errors = [], []

    def run() -> None:
        try:
            outs.append(prog.run(x))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(outs) == 4
    for o in outs:
        _close(o, m(x))
    assert (prog.shape_cache.hits, prog.shape_cache.misses) == (3, 1) and len(prog.shape_cache) == 1


def test_an_argument_given_by_keyword_past_an_optional_one_is_recaptured_by_keyword():
    """As Hugging Face forwards are called (input_ids, then attention_mask=... past others)."""
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, past=None, mask=None):
            return self.lin(x) + (mask if past is None else past)

    m = M()
    fn = ej.from_torch(m, (torch.randn(2, 4),), {"mask": torch.randn(2, 4)}, dynamic={"x": {0: "b"}, "mask": {0: "b"}})
    prog = ej.compile(fn, devices=2, quiet=True)
    x, mask = torch.randn(3, 4), torch.randn(3, 4)
    _close(prog.run(x, mask), m(x, mask=mask))
    _close(prog.run(x=x, mask=mask), m(x, mask=mask))
    assert prog.run_stats.cache_key == (("x", (3, 4)), ("mask", (3, 4)))


def test_non_tensor_arguments_stay_as_imported_for_new_shapes():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, scale, mask=None):
            return self.lin(x) * scale + mask

    m = M()
    prog = ej.compile(ej.from_torch(m, (torch.randn(2, 4), 3.0), {"mask": torch.randn(2, 4)}), quiet=True)
    x, mask = torch.randn(5, 4), torch.randn(5, 4)
    _close(prog.run(x, mask), m(x, 3.0, mask=mask))
    assert prog.run_stats.cache_misses == 1


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, scale: float = 1.0, flip: bool = False):
        y = self.lin(x) * scale
        return -y if flip else y


@pytest.mark.parametrize("devices", [1, 2])
def test_a_program_is_called_as_torch_calls_its_module(devices, tmp_path):
    """Non-tensor arguments equal to the import's, positionally or by name, at the compiled shape
    and at another; a different value is refused by name with both values, and so is leaving out
    one whose default (what torch would use) is not the import's; the binding survives save /
    load and pickle."""
    torch.manual_seed(0)
    m, x = _Scaled().eval(), torch.randn(5, 4)
    prog = ej.compile(ej.from_torch(m, (x, 2.0, True)), devices=devices, quiet=True)
    want = m(x, 2.0, True).detach()
    for got in (prog.run(x, 2.0, True), prog.run(x, scale=2.0, flip=True), prog.run(x, flip=True, scale=2.0),
                prog.run(x=x, scale=2.0, flip=True), prog.run_reference(x, 2.0, flip=True)):
        _close(torch.as_tensor(got), want)
    with pytest.raises(ej.EinjoinError, match=r"'flip' is left out.*default False.*import's value True"):
        prog.run(x, 2.0)  # torch's m(x, 2.0) would use flip=False
    with pytest.raises(ej.EinjoinError, match=r"'scale' is left out.*default 1.0.*import's value 2.0"):
        prog.run(x)
    x8 = torch.randn(8, 4)
    _close(prog.run(x8, 2.0, True), m(x8, 2.0, True).detach())
    with pytest.raises(ej.EinjoinError, match=r"'scale' is 3.0.*import's value 2.0"):
        prog.run(x, 3.0, True)
    with pytest.raises(ej.EinjoinError, match=r"'flip' is False.*import's value True"):
        prog.run(x, flip=False)
    with pytest.raises(ej.EinjoinError, match="'scale' is given both by position and by name"):
        prog.run(x, 2.0, scale=2.0)
    prog.save(tmp_path / "p.einjoin")
    for again in (ej.load(tmp_path / "p.einjoin"), pickle.loads(pickle.dumps(prog))):
        _close(again.run(x, 2.0, flip=True), want)
        with pytest.raises(ej.EinjoinError, match="'scale' is 3.0"):
            again.run(x, scale=3.0)


@pytest.mark.parametrize("devices", [1, 2])
def test_tuple_arguments_are_flattened_as_at_the_import(devices):
    """LSTMCell(x, (h, c)) runs as run(x, (h, c)), run(x, hx=[h, c]) and flattened run(x, h, c)."""
    torch.manual_seed(1)
    cell = torch.nn.LSTMCell(4, 6)
    x, h, c = torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)
    prog = ej.compile(ej.from_torch(cell, (x, (h, c))), devices=devices, quiet=True)
    want = cell(x, (h, c))
    for got in (prog.run(x, (h, c)), prog.run(x, hx=[h, c]), prog.run(x, h, c), prog.run(x, hx_0=h, hx_1=c)):
        for g, w in zip(got, want):
            _close(g, w.detach())
    with pytest.raises(ej.EinjoinError, match="'hx' must be a tuple of 2"):
        prog.run(x, (h,))
    x5, h5, c5 = torch.randn(5, 4), torch.randn(5, 6), torch.randn(5, 6)  # another batch: recaptured
    for g, w in zip(prog.run(x5, (h5, c5)), cell(x5, (h5, c5))):
        _close(g, w.detach())
    assert prog.run_stats.cache_key == (("input", (5, 4)), ("hx_0", (5, 6)), ("hx_1", (5, 6)))
