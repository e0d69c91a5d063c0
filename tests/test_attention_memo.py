"""The attention forward memo (einjoin.ir.attention.ForwardMemo): a run's attention forwards keep
torch's (output, log-sum-exp) for the gradient kernels of the same blocks. The gradients are the
bits of the recomputing kernel, the memo is hit in a planned run, it lives one run, and an array
written in place between runs, or an id reused by another array, never meets a stale entry."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import einjoin as ej
from einjoin.frontend.composites import fused_attention
from einjoin.ir import attention as A
from einjoin.ir.attention import ForwardMemo, attention_grad_kernel, attention_kernel, forward_memo

RNG = np.random.default_rng(3)


def _arrays(*shape, n=4):
    return [RNG.standard_normal(shape).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_a_kept_forward_gives_the_recomputed_bits(causal, mask):
    q, k, v, g = _arrays(2, 3, 7, 8)
    m = None
    if mask == "bool":
        m = RNG.random((1, 3, 7, 7)) > 0.3
    elif mask == "float":
        m = RNG.standard_normal((1, 3, 7, 7)).astype(np.float32)
    want = attention_grad_kernel(q, k, v, g, m, 0.3, causal, ("q", "k", "v"))
    memo = ForwardMemo()
    with forward_memo(memo):
        out = attention_kernel(q, k, v, m, 0.3, causal)
        got = attention_grad_kernel(q, k, v, g, m, 0.3, causal, ("q", "k", "v"))
    assert memo.hits == 1
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out, attention_kernel(q, k, v, m, 0.3, causal))


def test_other_blocks_miss():
    """Another q (a row block, a copy), another scale or causality, or a row block's forward
    (row0 > 0) find nothing; no memo in scope keeps nothing."""
    q, k, v, g = _arrays(2, 6, 4)
    memo = ForwardMemo()
    attention_kernel(q, k, v, None, 0.5, True)
    assert len(memo) == 0
    with forward_memo(memo):
        attention_kernel(q[:, 3:], k, v, None, 0.5, True, row0=3)
        assert len(memo) == 0
        attention_kernel(q, k, v, None, 0.5, True)
        for args in [(q.copy(), k, v, g, None, 0.5, True), (q, k, v, g, None, 0.25, True),
                     (q, k, v, g, None, 0.5, False)]:
            attention_grad_kernel(*args, ("q", "k", "v"))
    assert memo.hits == 0 and len(memo) == 1


def test_an_entry_goes_with_its_q_and_a_reused_id_misses():
    q, k, v, g = _arrays(1, 5, 4)
    memo = ForwardMemo()
    with forward_memo(memo):
        attention_kernel(q, k, v, None, 0.5, False)
        assert len(memo) == 1
        del q
        gc.collect()
        assert len(memo) == 0
        # an entry whose k died while q lives: a new k of the same id must not find it
        q = _arrays(1, 5, 4, n=1)[0]
        attention_kernel(q, k, v, None, 0.5, False)
        key = next(iter(memo._items))
        refs, saved = memo._items[key]
        memo._items[key] = ((refs[0], lambda: None, *refs[2:]), saved)  # k "died"
        assert attention_grad_kernel(q, k, v, g, None, 0.5, False, ("v",)).shape == (1, 5, 4)
    assert memo.hits == 0


def _grad_program(devices, backend):
    q, k, v = (ej.input(n, (4, 2, 8, 8), "float32") for n in "qkv")
    out = fused_attention(q, k, v, None, True)
    g = ej.input("g", out.shape, "float32")
    grads = ej.grad((out * g).sum(), [q, k, v])
    return ej.compile([out, *grads], devices=ej.local(devices), backend=backend, quiet=True)


@pytest.mark.parametrize("backend,devices", [("threads", 2), ("sync", 1)])
def test_a_planned_gradient_takes_the_forward_and_gives_the_same_bits(monkeypatch, backend, devices):
    """In a run the gradient kernels find their forwards (every one, here), the results are
    those of kernels that recompute, and the memo is empty after the run; inputs written in
    place between runs give the new values (no entry outlives its run)."""
    prog = _grad_program(devices, backend)
    feeds = dict(zip("qkvg", _arrays(4, 2, 8, 8)))
    found = []
    find = ForwardMemo.find

    def counting(self, *a):
        got = find(self, *a)
        found.append(got is not None)
        return got
    memos = []
    init = ForwardMemo.__init__

    def recording(self):
        init(self)
        memos.append(self)
    monkeypatch.setattr(ForwardMemo, "find", counting)
    monkeypatch.setattr(ForwardMemo, "__init__", recording)
    got = prog.run(**feeds)
    assert found and all(found)
    assert memos and all(len(m) == 0 for m in memos)
    monkeypatch.setattr(ForwardMemo, "find", lambda self, *a: None)  # the recomputing kernels
    want = prog.run(**feeds)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(ForwardMemo, "find", find)
    for x in feeds.values():
        x *= 0.5  # in place: the same objects, new values
    again = prog.run(**feeds)
    monkeypatch.setattr(ForwardMemo, "find", lambda self, *a: None)
    for a, b in zip(again, prog.run(**feeds)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(again[1], got[1])


def test_no_scope_outside_a_run():
    prog = _grad_program(2, "threads")
    prog.run(**dict(zip("qkvg", _arrays(4, 2, 8, 8))))
    assert getattr(A._SCOPE, "memo", None) is None
