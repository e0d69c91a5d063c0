"""Gradients of imported torch modules: ``ej.grad`` through ``ej.from_torch`` (``fn.parameters``)
against ``torch.autograd`` in float32 on the zoo models (MLP, GPT-2 block, LLaMA block), on the
reference and compiled for 2 devices; and dropout in training mode (an in-graph keep-mask seeded
by the ``dropout_seed`` input), whose gradient is the same mask."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej
from einjoin.models.zoo import example

MODELS = ["mlp", "gpt2-block", "llama-block"]


def close(got, want, rel=1e-4, what=""):
    """Within ``rel`` of torch's gradient, the tolerance scaled by its largest entry."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max()) / scale
    assert err <= rel, f"{what}: max |ej - torch| / max |torch| = {err:.2e} > {rel}"


@functools.cache
def training_graph(name: str):
    """The zoo model in eval mode imported, a scalar loss ``sum(out * R)`` with fixed random
    weights ``R`` (a graph input), and its gradients w.r.t. every parameter; torch's own."""
    module, args = example(name, seed=1)
    fn = ej.from_torch(module, args)
    out = fn.outputs[0]
    r = ej.input("loss_weights", out.shape)
    loss = (out * r).sum()
    grads = ej.grad(loss, list(fn.parameters.values()))
    weights = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    module.zero_grad()
    torch_loss = (module(*args) * torch.from_numpy(weights)).sum()
    torch_loss.backward()
    want = {n: p.grad.detach().numpy().copy() for n, p in module.named_parameters()}
    return module, args, fn.with_outputs([loss, *grads]), weights, float(torch_loss.detach()), want


@pytest.mark.parametrize("name", MODELS)
def test_parameters_are_the_graph_inputs_in_module_order(name):
    module, args, train, *_ = training_graph(name)
    assert list(train.parameters) == [n for n, _ in module.named_parameters()]
    inputs = ej.Graph(list(train.outputs)).input_by_name
    for qual, t in train.parameters.items():
        assert inputs[qual] is t.node and t.node.op.param
        assert t.shape == tuple(dict(module.named_parameters())[qual].shape)
    assert not set(train.buffers) & set(train.parameters)
    assert set(train.buffers) == {n for n, _ in module.named_buffers()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("where", ["reference", "compiled on 2 devices"])
def test_gradients_match_torch_autograd(name, where):
    module, args, train, weights, torch_loss, want = training_graph(name)
    if where == "reference":
        got = train.reference(*args, loss_weights=weights)
    else:
        prog = ej.compile(train, devices=2)
        got = [np.asarray(g) for g in prog.run(*args, loss_weights=weights)]
        assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    loss, grads = got[0], got[1:]
    assert abs(float(loss) - torch_loss) <= 1e-4 * max(1.0, abs(torch_loss))
    assert len(grads) == len(want)
    for (qual, w), g in zip(want.items(), grads):
        close(g, w, what=f"{name} d loss / d {qual} ({where})")


# ---------------------------------------------------------------- dropout in training mode


def test_dropout_mask_is_seeded_deterministic_and_of_rate_p():
    seed = ej.input("dropout_seed", (), "int64")
    keep = ej.dropout_mask((64, 128), 0.3, seed)
    a = ej.reference(keep, dropout_seed=np.int64(1))
    assert a.dtype == np.bool_ and abs(a.mean() - 0.7) < 0.02
    prog = ej.compile(keep, devices=2)
    assert np.array_equal(prog.run(dropout_seed=np.int64(1)), a)   # same blocks on any plan
    b = ej.reference(keep, dropout_seed=np.int64(2))
    assert 0.35 < (a != b).mean() < 0.5                              # 2 p (1 - p) = 0.42
    other = ej.reference(ej.dropout_mask((64, 128), 0.3, seed, stream=1), dropout_seed=np.int64(1))
    assert 0.35 < (a != other).mean() < 0.5                          # streams are independent
    assert ej.reference(ej.dropout_mask((1000,), 0.0, 5)).all()
    assert not ej.reference(ej.dropout_mask((1000,), 1.0, 5)).any()
    with pytest.raises(ej.EinjoinError, match="probability"):
        ej.dropout_mask((4,), 1.5, 0)
    with pytest.raises(ej.EinjoinError, match="int64 scalar"):
        ej.dropout_mask((4,), 0.5, ej.input("s", (2,), "int64"))


def test_training_mode_dropout_and_its_gradient_is_the_mask():
    p = 0.25
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Dropout(p)).train()
    x = torch.randn(8, 16)
    fn = ej.from_torch(module, (x,), dropout_seed=11)
    assert fn.bound["dropout_seed"] == 11
    out = fn.outputs[0]
    r = ej.input("loss_weights", out.shape)
    loss = (out * r).sum()
    xin = ej.Graph(out).input_by_name["input"]
    grads = ej.grad(loss, [ej.Tensor(xin), *fn.parameters.values()])
    train = fn.with_outputs([out, *grads])
    weights = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    seed = ej.Graph(out).input_by_name["dropout_seed"]
    keep_t = ej.dropout_mask(out.shape, p, ej.Tensor(seed), stream=0)
    for s in (11, 12):
        keep = ej.reference(keep_t, dropout_seed=np.int64(s))
        assert 0.6 < keep.mean() < 0.9
        feeds = {"loss_weights": weights} if s == 11 else {"loss_weights": weights, "dropout_seed": np.int64(s)}
        ref = train.reference(x, **feeds)
        comp = ej.compile(train, devices=2).run(x, **feeds)
        # torch with the same mask: out = linear(x) * keep / (1 - p)
        xt = x.clone().requires_grad_(True)
        module.zero_grad()
        mask = torch.from_numpy(keep.astype(np.float32)) / (1 - p)
        y = module[0](xt) * mask
        (y * torch.from_numpy(weights)).sum().backward()
        want = [y.detach().numpy(), xt.grad.numpy(), module[0].weight.grad.numpy(), module[0].bias.grad.numpy()]
        for got in (ref, [np.asarray(c) for c in comp]):
            for g, w, what in zip(got, want, ["out", "d/dx", "d/dweight", "d/dbias"]):
                close(g, w, 1e-5, f"seed {s}: {what}")
            assert np.all(got[0][~keep] == 0) and np.all(got[0][keep] != 0)


def test_training_mode_dropout_is_the_same_through_export_and_fx():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8), nn.Dropout(0.1)).train()
    x = torch.randn(8, 16)
    a, b = (ej.from_torch(module, (x,), method=m) for m in ("export", "fx"))
    assert (a.method, b.method) == ("export", "fx")
    assert list(a.parameters) == list(b.parameters) == [n for n, _ in module.named_parameters()]
    for s in (0, 3):
        ya, yb = a.reference(x, dropout_seed=np.int64(s)), b.reference(x, dropout_seed=np.int64(s))
        np.testing.assert_allclose(ya, yb, rtol=1e-6, atol=1e-6)
    assert not np.allclose(a.reference(x, dropout_seed=np.int64(0)), a.reference(x, dropout_seed=np.int64(3)))


def test_gpt2_block_in_training_mode_has_one_stream_per_dropout():
    module, args = example("gpt2-block", seed=0)
    module.train()
    fn = ej.from_torch(module, args)
    graph = ej.Graph(fn.outputs[0])
    masks = [n for n in graph.nodes if n.facts.contracts and "2147483647" in str(n.op.join)]
    assert len(masks) == 3  # attention probabilities and both residual branches, three streams
    seed = graph.input_by_name["dropout_seed"]
    assert seed.dtype == "int64" and seed.shape == () and not seed.op.param
    out = fn.outputs[0]
    loss = out.sum()
    grads = ej.grad(loss, list(fn.parameters.values()))
    train = fn.with_outputs([loss, *grads])
    a = train.reference(*args)
    b = ej.compile(train, devices=2).run(*args)
    for g, h in zip(a, b):
        assert np.all(np.isfinite(g))
        close(h, g, 1e-4, "gpt2 training-mode gradients, compiled vs reference")
    c = train.reference(*args, dropout_seed=np.int64(5))
    assert abs(float(c[0]) - float(a[0])) > 1e-6  # another seed, other masks


def test_detach_cuts_the_gradient_as_in_torch():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            return (h * h.detach()).sum(-1)   # the detached factor carries no gradient

    torch.manual_seed(1)
    m = M().double().eval()
    x = torch.randn(5, 6, dtype=torch.float64)
    fn = ej.from_torch(m, (x,))
    loss = fn.outputs[0].sum()
    grads = ej.grad(loss, list(fn.parameters.values()))
    got = fn.with_outputs(grads).reference(x.numpy())
    want = torch.autograd.grad(m(x).sum(), list(m.parameters()))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-12)
    # and the gradient is not the one without detach (twice as large in the first factor)
    plain = torch.autograd.grad((torch.tanh(m.lin(x)) ** 2).sum(), list(m.parameters()))
    assert not np.allclose(got[0], plain[0].numpy())


def test_attention_mask_of_another_dtype_than_the_queries_is_refused():
    # torch requires a bool mask or the queries' dtype; its CPU kernel silently gives wrong values
    # for a float32 causal mask on float64 queries, so einjoin refuses rather than differ
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])  # float32
            return self.att(x, x, x, attn_mask=mask.to(x.dtype) if self.same else mask,
                            need_weights=False)[0]

    torch.manual_seed(2)
    m = M().double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    m.same = False
    with pytest.raises(ej.EinjoinError, match=r"attn_mask is float32 but the queries are float64"):
        ej.from_torch(m, (x,))
    m.same = True
    fn = ej.from_torch(m, (x,))
    np.testing.assert_allclose(fn.reference(x.numpy()), m(x).detach().numpy(), rtol=1e-10, atol=1e-12)
