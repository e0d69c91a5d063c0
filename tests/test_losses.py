"""Losses: ``ej.cross_entropy`` / ``ej.nll_loss`` / ``ej.mse_loss`` and their translations in
``ej.from_torch`` (torch.export's ATen ops and torch.fx's functions and ``nn`` loss modules),
forward and ``ej.grad`` against torch and torch.autograd (float64), on ej.reference and compiled
on 2 devices."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from hypothesis import HealthCheck, given, settings, strategies as st
from budget import examples
from torch import nn

import einjoin as ej

RTOL = 1e-9  # float64 throughout: the same formulas, up to the order of a few sums


class Head(nn.Module):
    """A linear layer and a loss of its output: the shape a Trainer captures."""

    def __init__(self, loss, cin: int = 4, cout: int = 5, dims: int = 2):
        super().__init__()
        self.lin = nn.Linear(cin, cout).double()
        self.loss = loss
        self.dims = dims

    def forward(self, x, target):
        y = self.lin(x)
        if self.dims == 3:  # (N, d, C) -> (N, C, d): classes on dim 1, as torch wants them
            y = y.transpose(1, 2)
        return self.loss(y, target)


def _targets(n, c, ignore=(), seed=0, shape=None):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, c, shape or (n,))
    for k, v in ignore:
        t.flat[k] = v
    return torch.from_numpy(t)


def _probs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).softmax(1)


W5 = torch.arange(1.0, 6.0, dtype=torch.float64)
CASES = {
    "ce-mean": (lambda a, b: TF.cross_entropy(a, b), lambda: _targets(6, 5)),
    "ce-mean-default-ignore": (lambda a, b: TF.cross_entropy(a, b),
                               lambda: _targets(6, 5, ignore=[(1, -100), (4, -100)])),
    "ce-sum-ignore-in-range": (lambda a, b: TF.cross_entropy(a, b, ignore_index=2, reduction="sum"),
                               lambda: torch.tensor([0, 2, 4, 2, 1, 3])),
    "ce-none": (lambda a, b: TF.cross_entropy(a, b, reduction="none", ignore_index=-1),
                lambda: _targets(6, 5, ignore=[(0, -1)])),
    "ce-weight": (lambda a, b: TF.cross_entropy(a, b, weight=W5, ignore_index=3),
                  lambda: torch.tensor([0, 3, 4, 1, 1, 3])),
    "ce-smoothing": (lambda a, b: TF.cross_entropy(a, b, label_smoothing=0.1),
                     lambda: _targets(6, 5, ignore=[(2, -100)])),
    "ce-smoothing-weight-sum": (lambda a, b: TF.cross_entropy(a, b, weight=W5, label_smoothing=0.3,
                                                              reduction="sum", ignore_index=0),
                                lambda: torch.tensor([0, 3, 4, 1, 0, 2])),
    "ce-probabilities": (lambda a, b: TF.cross_entropy(a, b, label_smoothing=0.2), lambda: _probs((6, 5))),
    "ce-probabilities-weight-none": (lambda a, b: TF.cross_entropy(a, b, weight=W5, reduction="none"),
                                     lambda: _probs((6, 5), 1)),
    "nll-none": (lambda a, b: TF.nll_loss(TF.log_softmax(a, 1), b, reduction="none"),
                 lambda: _targets(6, 5, ignore=[(3, -100)])),
    "nll-mean-weight": (lambda a, b: TF.nll_loss(TF.log_softmax(a, 1), b, weight=W5, ignore_index=4),
                        lambda: torch.tensor([4, 1, 0, 2, 3, 1])),
    "mse-mean": (lambda a, b: TF.mse_loss(a, b), lambda: torch.randn(6, 5, dtype=torch.float64)),
    "mse-sum": (lambda a, b: TF.mse_loss(a, b, reduction="sum"), lambda: torch.randn(6, 5, dtype=torch.float64)),
    "mse-none": (lambda a, b: TF.mse_loss(a, b, reduction="none"), lambda: torch.randn(6, 5, dtype=torch.float64)),
    "module-ce": (nn.CrossEntropyLoss(ignore_index=1), lambda: torch.tensor([0, 1, 4, 1, 2, 2])),
    "module-ce-weight": (nn.CrossEntropyLoss(weight=W5, reduction="sum", label_smoothing=0.05),
                         lambda: _targets(6, 5)),
    "module-mse": (nn.MSELoss(reduction="sum"), lambda: torch.randn(6, 5, dtype=torch.float64)),
}
CASES_3D = {
    "ce-3d-mean-ignore": (lambda a, b: TF.cross_entropy(a, b), lambda: _targets(0, 5, [(2, -100)], 3, (3, 4))),
    "ce-3d-none": (lambda a, b: TF.cross_entropy(a, b, reduction="none", ignore_index=1),
                   lambda: _targets(0, 5, [], 4, (3, 4))),
    "nll-3d-sum": (lambda a, b: TF.nll_loss(TF.log_softmax(a, 1), b, reduction="sum"),
                   lambda: _targets(0, 5, [(0, -100)], 5, (3, 4))),
}


def _check(module, x, t, how, method):
    """ej's loss and its gradients (w.r.t. the input x and the parameters) against torch."""
    fn = ej.from_torch(module, (x, t), method=method)
    loss = fn.outputs[0]
    scalar = loss if loss.ndim == 0 else loss.sum()
    xin = ej.Graph([loss]).input_by_name[fn.arg_names[0]]
    grads = ej.grad(scalar, [ej.Tensor(xin), *fn.parameters.values()])
    train = fn.with_outputs([loss, *grads])
    if how == "reference":
        got = train.reference(x.numpy(), t.numpy())
    else:
        got = ej.compile(train, devices=how, quiet=True).run(x.numpy(), t.numpy())
    xt = x.clone().requires_grad_(True)
    want = module(xt, t)
    wgrads = torch.autograd.grad(want if want.ndim == 0 else want.sum(), [xt, *module.parameters()])
    assert got[0].shape == tuple(want.shape) and got[0].dtype == np.float64
    np.testing.assert_allclose(got[0], want.detach().numpy(), rtol=RTOL, atol=RTOL)
    for k, (g, w) in enumerate(zip(got[1:], wgrads)):
        np.testing.assert_allclose(g, w.numpy(), rtol=RTOL, atol=RTOL, err_msg=f"gradient {k}")


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_imported_loss_and_gradients_match_torch(case, method):
    fn, target = CASES[case]
    torch.manual_seed(len(case))
    x = torch.randn(6, 4, dtype=torch.float64)
    _check(Head(fn), x, target(), "reference", method)


@pytest.mark.parametrize("case", sorted(CASES_3D))
def test_imported_loss_with_extra_dims(case):
    fn, target = CASES_3D[case]
    torch.manual_seed(1)
    x = torch.randn(3, 4, 4, dtype=torch.float64)  # (N, d, features) -> logits (N, C, d)
    _check(Head(fn, dims=3), x, target(), "reference", "export")


@pytest.mark.parametrize("case", ["ce-mean-default-ignore", "ce-smoothing-weight-sum", "nll-none", "mse-mean"])
def test_imported_loss_compiled_on_two_devices(case):
    fn, target = CASES[case]
    torch.manual_seed(3)
    _check(Head(fn, cin=8, cout=5), torch.randn(6, 8, dtype=torch.float64), target(), 2, "export")


def test_compiled_3d_cross_entropy():
    fn, target = CASES_3D["ce-3d-mean-ignore"]
    torch.manual_seed(4)
    _check(Head(fn, dims=3), torch.randn(3, 4, 4, dtype=torch.float64), target(), 2, "export")


class LogSoftmaxNLL(nn.Module):
    """The classic head: nn.LogSoftmax (a leaf module under torch.fx) then nn.NLLLoss."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(4, 5).double()
        self.ls = nn.LogSoftmax(dim=dim)
        self.loss = nn.NLLLoss(ignore_index=2)

    def forward(self, x, target):
        return self.loss(self.ls(self.lin(x)), target)


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
@pytest.mark.parametrize("dim", [1, -1, None])
@pytest.mark.parametrize("method", ["export", "fx"])
def test_logsoftmax_module_then_nll_loss_module(dim, method):
    torch.manual_seed(5)
    _check(LogSoftmaxNLL(dim), torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 2, 4, 1, 2, 3]),
           "reference", method)


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
@pytest.mark.parametrize("module", [nn.Softmax(), nn.LogSoftmax(), nn.Softmax(dim=0), nn.LogSoftmax(dim=-2)])
@pytest.mark.parametrize("shape", [(5,), (2, 5), (2, 3, 4)])
def test_softmax_modules_under_fx_pick_torchs_dim(module, shape):
    # dim=None: torch's legacy rule (dim 0 of a 0-, 1- or 3-d input, else dim 1)
    x = torch.randn(shape, dtype=torch.float64)
    holder = nn.Sequential(module)  # a leaf module inside the traced one
    try:
        want = holder(x)
    except IndexError:
        return  # dim -2 of a 1-d input: torch refuses (einjoin too, tested elsewhere)
    got = ej.from_torch(holder, (x,), method="fx").reference(x.numpy())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("case", ["ce-weight", "ce-smoothing", "nll-none", "module-ce"])
def test_imported_out_of_range_class_is_an_error_at_run_time(case):
    # torch raises IndexError; einjoin's gather of the class weights raises naming the index, on
    # the reference and on a compiled program, and a valid batch then runs as before
    fn, target = CASES[case]
    x, good = torch.randn(6, 4, dtype=torch.float64), target()
    bad = good.clone()
    bad[3] = 5
    with pytest.raises(IndexError):
        Head(fn)(x, bad)
    imported = ej.from_torch(Head(fn), (x, good))
    prog = ej.compile(imported, devices=2, quiet=True)
    for run in (imported.reference, prog.run):
        with pytest.raises(ej.EinjoinError, match="index 5 out of range"):
            run(x.numpy(), bad.numpy())
    np.testing.assert_allclose(prog.run(x.numpy(), good.numpy()), imported.reference(x.numpy(), good.numpy()),
                               rtol=RTOL)


class EmbeddingLM(nn.Module):
    """Tokens -> embedding (as nn.Embedding or F.embedding) -> logits -> cross_entropy."""

    def __init__(self, functional, **kw):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(9, 4, **kw).double()
        self.head = nn.Linear(4, 9).double()
        self.functional, self.kw = functional, kw

    def forward(self, x, t):
        e = TF.embedding(x, self.emb.weight, **self.kw) if self.functional else self.emb(x)
        return TF.cross_entropy(self.head(e).reshape(-1, 9), t.reshape(-1), reduction="sum") / t.numel()


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("kw", [{}, {"padding_idx": 0}, {"padding_idx": -2}])
def test_embedding_lm_loss_and_gradients_match_torch(kw, method, functional):
    # F.embedding under fx takes (input, weight); the padding row gets no gradient (torch's
    # embedding_backward); numel() under fx is the static count
    x, t = torch.tensor([[0, 3, 7, 5], [7, 0, 2, 2]]), torch.tensor([[3, 0, 4, 1], [-100, 2, 0, 8]])
    module = EmbeddingLM(functional, **kw)
    fn = ej.from_torch(module, (x, t), method=method)
    grads = ej.grad(fn.outputs[0], list(fn.parameters.values()))
    got = fn.with_outputs([fn.outputs[0], *grads]).reference(x.numpy(), t.numpy())
    want = module(x, t)
    wgrads = torch.autograd.grad(want, list(module.parameters()))
    if "padding_idx" in kw:
        assert not wgrads[0][kw["padding_idx"]].any()
    for k, (g, w) in enumerate(zip(got, [want, *wgrads])):
        np.testing.assert_allclose(g, w.detach().numpy(), rtol=RTOL, atol=1e-15, err_msg=f"output {k}")


@pytest.mark.parametrize("kw,name", [({"max_norm": 1.0}, "max_norm"), ({"scale_grad_by_freq": True},
                                                                     "scale_grad_by_freq")])
@pytest.mark.parametrize("functional", [False, True])
def test_embedding_flags_that_change_training_are_refused(kw, name, functional):
    x = torch.tensor([[0, 3], [7, 0]])
    for method in ("export", "fx"):
        with pytest.raises(ej.UnsupportedOpError, match=name if method == "fx" or name != "max_norm"
                           else "embedding_renorm"):  # functionalised by from_torch: no trailing _
            ej.from_torch(EmbeddingLM(functional, **kw), (x, x), method=method)


def test_all_targets_ignored_is_nan_as_torch():
    x = torch.randn(3, 5, dtype=torch.float64)
    t = torch.full((3,), -100)
    want = TF.cross_entropy(x, t)
    got = ej.reference(ej.cross_entropy(ej.input("x", (3, 5), "float64"), ej.input("t", (3,), "int64")),
                       x=x.numpy(), t=t.numpy())
    assert math.isnan(float(want)) and math.isnan(float(got))
    s = ej.reference(ej.cross_entropy(ej.input("x", (3, 5), "float64"), ej.input("t", (3,), "int64"),
                                      reduction="sum"), x=x.numpy(), t=t.numpy())
    assert float(s) == float(TF.cross_entropy(x, t, reduction="sum")) == 0.0


def test_float32_loss_and_one_dim_input():
    x = torch.randn(7, dtype=torch.float32)
    t = torch.tensor(3)
    got = ej.reference(ej.cross_entropy(ej.input("x", (7,)), ej.input("t", (), "int64")), x=x.numpy(), t=t.numpy())
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, TF.cross_entropy(x, t).numpy(), rtol=1e-6)


def test_errors_name_the_argument():
    x, t = ej.input("x", (4, 3)), ej.input("t", (4,), "int64")
    with pytest.raises(ej.EinjoinError, match="reduction.*'avg'"):
        ej.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ej.ShapeError, match="targets of shape \\(4,\\), got \\(3,\\)"):
        ej.cross_entropy(x, ej.input("t3", (3,), "int64"))
    with pytest.raises(ej.DTypeError, match="int64, got bool"):
        ej.nll_loss(x, ej.input("tb", (4,), "bool"))
    with pytest.raises(ej.ShapeError, match="weight.*\\(3,\\), got \\(4,\\)"):
        ej.cross_entropy(x, t, weight=ej.input("w", (4,)))
    with pytest.raises(ej.EinjoinError, match="label_smoothing.*1.5"):
        ej.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ej.ShapeError, match="probability targets must have the input's shape"):
        ej.cross_entropy(x, ej.input("p", (4, 2)))
    with pytest.raises(ej.DTypeError, match="float tensor"):
        ej.mse_loss(t, t)
    with pytest.raises(ej.UnsupportedOpError, match="weight"):
        ej.from_torch(Head(lambda a, b: TF.mse_loss(a, b, weight=torch.ones(5, dtype=torch.float64))),
                      (torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)),
                      method="fx")


# ---------------------------------------------------------------- shapes and options at random


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), c=st.integers(1, 5), d=st.sampled_from([None, 1, 3]),
       reduction=st.sampled_from(["mean", "sum", "none"]), ignore=st.sampled_from([-100, 0, 2]),
       n_ignored=st.integers(0, 3), weighted=st.booleans(), smoothing=st.sampled_from([0.0, 0.25]),
       seed=st.integers(0, 2**16))
def test_cross_entropy_matches_torch(n, c, d, reduction, ignore, n_ignored, weighted, smoothing, seed):
    rng = np.random.default_rng(seed)
    shape = (n, c) if d is None else (n, c, d)
    tshape = (n,) if d is None else (n, d)
    x = rng.standard_normal(shape)
    t = rng.integers(0, c, tshape)
    for k in rng.choice(t.size, min(n_ignored, t.size), replace=False):
        t.flat[k] = ignore
    w = rng.uniform(0.5, 2.0, c) if weighted else None
    xin, tin = ej.input("x", shape, "float64"), ej.input("t", tshape, "int64")
    win = ej.input("w", (c,), "float64") if weighted else None
    loss = ej.cross_entropy(xin, tin, win, ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
    (dx,) = ej.grad(loss if loss.ndim == 0 else loss.sum(), [xin])
    feeds = {"x": x, "t": t, **({"w": w} if weighted else {})}
    got, gdx = ej.reference([loss, dx], **feeds)
    xt = torch.from_numpy(x).requires_grad_(True)
    want = TF.cross_entropy(xt, torch.from_numpy(t), None if w is None else torch.from_numpy(w),
                            ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL, atol=RTOL)
    if not np.isnan(want.detach().numpy()).any():
        (wdx,) = torch.autograd.grad(want if want.ndim == 0 else want.sum(), [xt])
        np.testing.assert_allclose(gdx, wdx.numpy(), rtol=RTOL, atol=RTOL)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(3,), (2, 4), (2, 1, 3)]), reduction=st.sampled_from(["mean", "sum", "none"]),
       broadcast=st.booleans(), seed=st.integers(0, 2**16))
def test_mse_loss_matches_torch(shape, reduction, broadcast, seed):
    rng = np.random.default_rng(seed)
    tshape = shape[-1:] if broadcast else shape
    a, b = rng.standard_normal(shape), rng.standard_normal(tshape)
    ain, bin_ = ej.input("a", shape, "float64"), ej.input("b", tshape, "float64")
    loss = ej.mse_loss(ain, bin_, reduction)
    (da,) = ej.grad(loss if loss.ndim == 0 else loss.sum(), [ain])
    got, gda = ej.reference([loss, da], a=a, b=b)
    at = torch.from_numpy(a).requires_grad_(True)
    with pytest.warns(UserWarning) if broadcast and tshape != shape else _nothing():
        want = TF.mse_loss(at, torch.from_numpy(b), reduction=reduction)
    (wda,) = torch.autograd.grad(want if want.ndim == 0 else want.sum(), [at])
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL)
    np.testing.assert_allclose(gda, wda.numpy(), rtol=RTOL, atol=RTOL)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cross_entropy_of_class_targets_picks_the_logit_without_log_probabilities():
    """Class-index targets: the same bits as nll_loss(log_softmax(x)) (the picked logit shifted
    by the same operations), and the loss with its gradient reads the logits in four passes
    (max, sum of exponentials, the pick, the fused gradient), not seven."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5)).astype(np.float32) * 4
    t = np.array([0, 4, 2, -100, 1, 3])
    xin, tin = ej.input("x", (6, 5)), ej.input("t", (6,), "int64")
    for red in ("none", "mean"):
        got = ej.reference(ej.cross_entropy(xin, tin, reduction=red), x=x, t=t)
        want = ej.reference(ej.nll_loss(ej.log_softmax(xin, 1), tin, reduction=red), x=x, t=t)
        np.testing.assert_array_equal(got, want)
    loss = ej.cross_entropy(xin, tin)
    (dx,) = ej.grad(loss, [xin])
    prog = ej.compile([loss, dx], backend="null", quiet=True)
    passes = [n for n in prog.graph.ops if any(i.shape == (6, 5) for i in n.inputs)]
    assert len(passes) == 4, [str(n.op) for n in passes]
