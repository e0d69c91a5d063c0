"""Hostile review of issue 19's ``ej.Trainer`` as a torch user drives it: tied weights and a
buffer the forward reads (state_dict strictness against ``module.load_state_dict``), loading
weights and buffers then training on (vs torch), BatchNorm refused clearly, wrong batch arity /
dtype / shape and a failing step that leave the state, learning-rate changes, accumulation with
Nesterov SGD, evaluate changing nothing, a batch of another shape compiled once and cached
(losses still torch's), float64 models, memory caps on 1/2/4 devices, and a save / load in a
fresh process that resumes bit-identically mid-accumulation with dropout. Every comparison is
against torch running the same loop (``torch.optim`` with ``foreach=False``).

Bugs these tests found and since fixed (their tests now guard them): 4e445df (load_state_dict
converting dtypes and taking ``strict=``, a parameter the loss never reads left alone, the null
backend's step saying it computes no loss), cde71b5 (a torch optimizer or an optimizer class as
``optimizer=`` refused naming ej.optim)."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import einjoin as ej


class Tied(nn.Module):
    """An LM-ish head whose output projection is the embedding (tied), with a buffer it reads
    and one it never reads."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("unused", torch.arange(3.0))

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))) * self.scale)


def lm_loss(out, t):
    return TF.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))


def _tokens(n, shape=(2, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, shape, generator=g), torch.randint(0, 11, shape, generator=g)) for _ in range(n)]


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _cls(n, rows=6, seed=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 4, generator=g, dtype=dtype), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(n)]


def _torch_step(model, opt, loss_fn, x, t):
    opt.zero_grad()
    loss = loss_fn(model(x), t)
    loss.backward()
    opt.step()
    return loss.item()


def _max_diff(sd, module):
    return max(float((sd[k].double() - v.double()).abs().max()) for k, v in module.state_dict().items())


# ---------------------------------------------------------------- tied weights, buffers, state_dict


def test_tied_weights_buffers_and_lr_changes_follow_torch():
    model, ref = Tied(), Tied()
    batches = _tokens(6)
    tr = ej.Trainer(model, batches[0], lm_loss, optimizer=ej.optim.AdamW(lr=1e-2), devices=2, leave_idle=False)
    assert tr.parameter_names == ("emb.weight", "mid.weight", "mid.bias")  # tied: one state tensor
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for i, (x, t) in enumerate(batches):
        if i == 3:  # a schedule: set between steps, no replanning
            tr.lr = 3e-2
            for group in opt.param_groups:
                group["lr"] = 3e-2
        want = _torch_step(ref, opt, lm_loss, x, t)
        assert tr.step(x, t) == pytest.approx(want, rel=1e-5)
    assert len(tr._programs) == 1
    sd = tr.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert sd[k].shape == v.shape and sd[k].dtype == v.dtype, k
    assert _max_diff(sd, ref) < 1e-6
    assert torch.equal(sd["emb.weight"], sd["head.weight"])
    fresh = Tied()
    assert not fresh.load_state_dict(sd, strict=True).missing_keys
    assert fresh.head.weight is fresh.emb.weight
    sd["emb.weight"][0, 0] = 123.0  # a copy: the trainer is not changed
    assert float(tr.state_dict()["emb.weight"][0, 0]) != 123.0


def test_load_state_dict_weights_and_buffer_then_train_as_torch():
    donor = Tied()
    with torch.no_grad():
        for p in donor.parameters():
            p.mul_(-1.5).add_(0.1)
        donor.scale.fill_(2.0)
    sd = donor.state_dict()
    batches = _tokens(3, seed=5)
    tr = ej.Trainer(Tied(), batches[0], lm_loss, optimizer=ej.optim.SGD(lr=0.1, momentum=0.9),
                    devices=2, leave_idle=False)
    tr.load_state_dict(sd)
    ref = Tied()
    ref.load_state_dict(sd)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for x, t in batches:
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, lm_loss, x, t), rel=1e-5)
    out = tr.state_dict()
    assert float(out["scale"]) == 2.0 and _max_diff(out, ref) < 1e-5


def test_load_state_dict_is_strict_about_keys_and_shapes():
    batches = _tokens(1)
    tr = ej.Trainer(Tied(), batches[0], lm_loss, devices=1)
    sd = tr.state_dict()
    before = tr.state_dict()
    for bad, err, match in (
            ({k: v for k, v in sd.items() if k != "mid.bias"}, ej.EinjoinError, "missing: mid.bias"),
            ({**sd, "extra": torch.zeros(1)}, ej.EinjoinError, "unexpected: extra"),
            ({**sd, "mid.bias": torch.zeros(7)}, ej.ShapeError, r"'mid.bias'.*\(7,\)"),
            ({**sd, "unused": torch.zeros(4)}, ej.ShapeError, "'unused'")):
        with pytest.raises(err, match=match):
            tr.load_state_dict(bad)
        after = tr.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
    # tied keys given different values: the last one wins, as module.load_state_dict
    sd2 = {**sd, "head.weight": torch.zeros(11, 6)}
    tr.load_state_dict(sd2)
    torch_module = Tied()
    torch_module.load_state_dict(sd2)
    assert torch.equal(tr.state_dict()["emb.weight"], torch_module.emb.weight.detach())


def test_load_state_dict_converts_dtypes_as_torch():
    batches = _tokens(1)
    tr = ej.Trainer(Tied(), batches[0], lm_loss, devices=1)
    sd = {k: v.double() if v.is_floating_point() else v for k, v in Tied().state_dict().items()}
    sd["mid.bias"] = torch.full((6,), 0.25, dtype=torch.float64)
    module = Tied()
    module.load_state_dict(sd, strict=True)  # torch: fine
    tr.load_state_dict(sd)
    assert tr.state_dict()["mid.bias"].dtype == torch.float32
    assert torch.equal(tr.state_dict()["mid.bias"], module.mid.bias.detach())


def test_load_state_dict_strict_false_loads_the_keys_given():
    batches = _tokens(1)
    tr = ej.Trainer(Tied(), batches[0], lm_loss, devices=1)
    before = tr.state_dict()
    part = {"mid.bias": torch.full((6,), 0.25, dtype=torch.bfloat16), "new_head.weight": torch.zeros(2)}
    want = Tied().load_state_dict(part, strict=False)
    got = tr.load_state_dict(part, strict=False)
    assert sorted(got[0]) == sorted(want.missing_keys) and list(got[1]) == list(want.unexpected_keys)
    after = tr.state_dict()
    assert torch.equal(after["mid.bias"], torch.full((6,), 0.25))
    assert all(torch.equal(after[k], before[k]) for k in before if k != "mid.bias")


def test_batchnorm_trains_as_torch():  # refused before issue 20; now its running stats are state
    class BN(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 8)
            self.bn = nn.BatchNorm1d(8)
            self.out = nn.Linear(8, 1)

        def forward(self, x):
            return self.out(torch.relu(self.bn(self.lin(x))))

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model = BN()
    ref = copy.deepcopy(model)
    tr = ej.Trainer(model, (x, y), TF.mse_loss, optimizer=ej.optim.SGD(lr=0.1), devices=2, leave_idle=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        got = tr.step(x, y)
        opt.zero_grad()
        want = TF.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        assert got == pytest.approx(want.item(), rel=1e-5)
    sd = tr.state_dict()
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(sd[k], ref.state_dict()[k], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- batches: errors, shapes, evaluate


def test_bad_batches_and_a_failing_step_leave_the_state():
    batches = _tokens(2)
    tr = ej.Trainer(Tied(), batches[0], lm_loss, optimizer=ej.optim.AdamW(lr=1e-2), devices=2, leave_idle=False)
    tr.step(*batches[0])
    before = tr.state_dict()
    x, t = batches[1]
    bad = [
        (lambda: tr.step(x), ej.EinjoinError, "1 tensor.*had 2"),
        (lambda: tr.step(x, t, t), ej.EinjoinError, "3 tensor.*had 2"),
        (lambda: tr.step(x.int(), t), ej.DTypeError, "module argument 0 is int32.*int64"),
        (lambda: tr.step(x, t.float()), ej.DTypeError, "the target is float32"),
        (lambda: tr.step(x, t[:, :3]), ej.EinjoinError, "batch_size"),    # the loss's own shape check
        (lambda: tr.step(torch.full((2, 5), 50), t), ej.EinjoinError, "index 50 out of range"),
        (lambda: tr.step(x, torch.full((2, 5), 11)), ej.EinjoinError, "index 11 out of range"),  # a target
        (lambda: tr.step(x, torch.full((2, 5), -3)), ej.EinjoinError, "-3"),
        (lambda: setattr(tr, "lr", float("nan")), ej.EinjoinError, "lr"),
        (lambda: tr.evaluate(x), ej.EinjoinError, "1 tensor"),
    ]
    for make, err, match in bad:
        with pytest.raises(err, match=match):
            make()
    with pytest.raises(ej.EinjoinError, match="lr.*inf"):  # refused where it is set (ca8553d)
        tr.lr = float("inf")
    after = tr.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (tr.steps, tr.micro_steps) == (1, 1)
    # and training goes on as torch from there
    tr.lr = 1e-2
    ref = Tied()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    _torch_step(ref, opt, lm_loss, *batches[0])
    assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, lm_loss, x, t), rel=1e-5)


def test_other_batch_shape_compiles_once_and_evaluate_changes_nothing(caplog):
    ref = Tied()
    a, b = _tokens(1)[0], _tokens(1, shape=(3, 4), seed=9)[0]
    tr = ej.Trainer(Tied(), a, lm_loss, optimizer=ej.optim.AdamW(lr=1e-2), devices=2, leave_idle=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    with caplog.at_level(logging.INFO, logger="einjoin.trainer"):
        for _ in range(3):
            for batch in (b, a):
                assert tr.step(*batch) == pytest.approx(_torch_step(ref, opt, lm_loss, *batch), rel=1e-5)
    compiles = [r for r in caplog.records if "compiling the training step" in r.getMessage()]
    assert len(compiles) == 1 and "[3, 4]" in compiles[0].getMessage()
    assert len(tr._programs) == 2
    before, counters = tr.state_dict(), (tr.steps, tr.micro_steps)
    ref.eval()
    for batch in (a, b, a):
        assert tr.evaluate(*batch) == pytest.approx(lm_loss(ref(batch[0]), batch[1]).item(), rel=1e-5)
    after = tr.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (tr.steps, tr.micro_steps) == counters
    ref.train()
    assert tr.step(*a) == pytest.approx(_torch_step(ref, opt, lm_loss, *a), rel=1e-5)


def test_loss_and_module_misuse_is_refused_clearly():
    (x, t), = _cls(1)
    with pytest.raises(ej.ShapeError, match="scalar"):
        ej.Trainer(_mlp(), (x, t), lambda o, y: TF.cross_entropy(o, y, reduction="none"), devices=1)
    with pytest.raises(ej.EinjoinError, match="example_batch"):
        ej.Trainer(_mlp(), (x,), TF.cross_entropy, devices=1)
    frozen = _mlp().requires_grad_(False)
    with pytest.raises(ej.EinjoinError, match="no trainable parameters"):
        ej.Trainer(frozen, (x, t), TF.cross_entropy, devices=1)


class _Spare(nn.Module):
    """A model with a layer its forward never uses (an unused pooler, a head for another task)."""

    def __init__(self):
        super().__init__()
        self.body = _mlp()
        torch.manual_seed(1)
        self.spare = nn.Linear(2, 2)

    def forward(self, v):
        return self.body(v)


def test_parameter_the_loss_never_reads_is_left_alone_as_torch():
    (x, t), = _cls(1)
    tr = ej.Trainer(_Spare(), (x, t), TF.cross_entropy, optimizer=ej.optim.AdamW(lr=0.1, weight_decay=0.5),
                    devices=1)
    ref = _Spare()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5, foreach=False)
    for _ in range(3):
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, TF.cross_entropy, x, t), rel=1e-5)
    sd = tr.state_dict()
    assert torch.equal(sd["spare.weight"], ref.spare.weight.detach())
    assert torch.equal(sd["spare.weight"], _Spare().spare.weight.detach())


def test_null_backend_step_says_it_computes_nothing():
    (x, t), = _cls(1)
    tr = ej.Trainer(_mlp(), (x, t), TF.cross_entropy, devices=2, backend="null")
    with pytest.raises(ej.EinjoinError, match="null"):
        tr.step(x, t)


# ---------------------------------------------------------------- optimizers, accumulation, caps


def test_accumulate_with_nesterov_sgd_matches_torch():
    batches = _cls(8)
    ref = _mlp()
    tr = ej.Trainer(_mlp(), batches[0], TF.cross_entropy,
                    optimizer=ej.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
                    devices=2, accumulate=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                          foreach=False)
    for i, (x, t) in enumerate(batches):
        loss = TF.cross_entropy(ref(x), t)
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
        assert tr.step(x, t) == pytest.approx(loss.item(), rel=1e-5)
        assert (tr.steps, tr.micro_steps) == ((i + 1) // 2, i + 1)
    assert _max_diff(tr.state_dict(), ref) < 1e-6


def test_accumulation_across_batch_shapes_matches_torch():
    # micro-batches of 6 and 5 rows alternate: the gradient sums move between the two programs
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(r, 4, generator=g), torch.randint(0, 3, (r,), generator=g)) for r in (6, 5, 6, 5, 5, 6)]
    tr = ej.Trainer(_mlp(), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2), devices=2,
                    accumulate=2)
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for i, (x, t) in enumerate(batches):
        loss = TF.cross_entropy(ref(x), t)
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
        assert tr.step(x, t) == pytest.approx(loss.item(), rel=1e-5)
    assert len(tr._programs) == 2
    assert _max_diff(tr.state_dict(), ref) < 1e-6


class _TwoArgs(nn.Module):
    """Two module arguments, a 0-d and a 1-element parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)
        self.temp = nn.Parameter(torch.tensor(1.5))
        self.one = nn.Parameter(torch.ones(1))

    def forward(self, x, z):
        return (self.a(x) + self.b(z)) / self.temp * self.one


def test_two_module_arguments_and_scalar_parameters_on_three_devices():
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g), torch.randint(0, 3, (6,), generator=g))
               for _ in range(4)]
    tr = ej.Trainer(_TwoArgs(), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=0.05), devices=3)
    ref = _TwoArgs()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=False)
    for x, z, t in batches:
        opt.zero_grad()
        loss = TF.cross_entropy(ref(x, z), t)
        loss.backward()
        opt.step()
        assert tr.step(x, z, t) == pytest.approx(loss.item(), rel=1e-5)
    sd = tr.state_dict()
    assert sd["temp"].shape == () and sd["one"].shape == (1,)
    assert _max_diff(sd, ref) < 1e-6


def test_dropout_is_seeded_reproducible_and_scaled_as_torch():
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))

    (x, t), = _cls(1, rows=12)
    module = net().eval()
    runs = []
    for seed in (0, 0, 1):
        tr = ej.Trainer(module, (x, t), TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.0), devices=2, seed=seed)
        runs.append([tr.step(x, t) for _ in range(3)])
    assert not module.training  # the user's module keeps its mode
    assert runs[0] == runs[1] and runs[0] != runs[2] and len(set(runs[0])) == 3
    # lr = 0: the masks' effect on the loss has torch's mean (60 draws each; 5 standard errors)
    tr = ej.Trainer(net(), (x, t), TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.0), devices=1)
    ours = np.array([tr.step(x, t) for _ in range(60)])
    ref = net().train()
    torch.manual_seed(5)
    theirs = np.array([TF.cross_entropy(ref(x), t).item() for _ in range(60)])
    se = np.sqrt((ours.var() + theirs.var()) / 60)
    assert abs(ours.mean() - theirs.mean()) < 5 * se
    ref.eval()
    assert tr.evaluate(x, t) == pytest.approx(TF.cross_entropy(ref(x), t).item(), rel=1e-5)  # no dropout


def test_every_planner_trains_a_layernorm_gelu_mlp_as_torch():
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))

    batches = _cls(3, rows=8)
    ref = net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    want = [_torch_step(ref, opt, TF.cross_entropy, x, t) for x, t in batches]
    for planner in ("auto", "zero", "data_parallel", "split_largest", "single"):
        tr = ej.Trainer(net(), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2), devices=4,
                        planner=planner)
        np.testing.assert_allclose([tr.step(x, t) for x, t in batches], want, rtol=1e-5, err_msg=planner)
        assert _max_diff(tr.state_dict(), ref) < 1e-6, planner
        x, t = batches[-1]
        assert tr.program.run_stats.bytes_loaded == x.numpy().nbytes + t.numpy().nbytes + 8, planner


def test_float64_module_stays_float64_and_matches_torch_closely():
    batches = _cls(4, dtype=torch.float64)
    ref = _mlp(torch.float64)
    tr = ej.Trainer(_mlp(torch.float64), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2),
                    devices=3)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for x, t in batches:
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, TF.cross_entropy, x, t), rel=1e-12)
    sd = tr.state_dict()
    assert all(v.dtype == torch.float64 for v in sd.values())
    assert _max_diff(sd, ref) < 1e-12


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_memory_caps_and_loss_modules_match_torch(devices):
    batches = _cls(4)
    weight = torch.tensor([1.0, 2.0, 0.5])
    crit = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    want = [_torch_step(ref, opt, crit, x, t) for x, t in batches]
    tr = ej.Trainer(_mlp(), batches[0], nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1),
                    optimizer=ej.optim.AdamW(lr=1e-2), devices=devices, memory=600)
    np.testing.assert_allclose([tr.step(x, t) for x, t in batches], want, rtol=1e-5)
    assert _max_diff(tr.state_dict(), ref) < 1e-6
    x, t = batches[-1]
    assert tr.program.run_stats.bytes_loaded == x.numpy().nbytes + t.numpy().nbytes + 8  # + the lr


# ---------------------------------------------------------------- save / load in a fresh process

_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.nn.functional as TF
    from torch import nn
    import einjoin as ej

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.drop, self.l2 = nn.Linear(4, 16), nn.Dropout(0.25), nn.Linear(16, 3)

        def forward(self, x):
            return self.l2(self.drop(torch.relu(self.l1(x))))

    g = torch.Generator().manual_seed(2)
    bs = [(torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(9)]
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "full":
        tr = ej.Trainer(Net(), bs[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2, weight_decay=0.1),
                        devices=2, accumulate=2, seed=7)
        losses = []
        for i, b in enumerate(bs):
            if i == 5:  # mid-accumulation (an odd micro-step), then a new lr
                tr.save(path)
                tr.lr = 5e-3
            losses.append(tr.step(*b))
        losses = losses[5:]
    else:
        tr = ej.Trainer.load(path, Net(), bs[0], TF.cross_entropy, devices=2)
        assert (tr.steps, tr.micro_steps, tr.lr) == (2, 5, 1e-2), (tr.steps, tr.micro_steps, tr.lr)
        tr.lr = 5e-3
        losses = [tr.step(*b) for b in bs[5:]]
    sd = tr.state_dict()
    print(repr(losses), repr(float(sum(v.double().sum() for v in sd.values()))))
""")


@pytest.mark.slow
def test_save_then_load_in_a_fresh_process_resumes_bit_identically(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    path = str(tmp_path / "ckpt.safetensors")
    outs = []
    for mode in ("full", "resume"):
        proc = subprocess.run([sys.executable, str(script), mode, path], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(proc.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("options", [dict(devices=3, memory=600), dict(devices=2, planner="zero", backend="sync")],
                         ids=["cap-3-devices", "zero-sync"])
def test_resume_is_bit_identical_under_a_cap_and_with_zero_sync(tmp_path, options):
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 3))

    batches = _cls(8, rows=8)
    tr = ej.Trainer(net(), batches[0], TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.1, momentum=0.9), **options)
    for b in batches[:4]:
        tr.step(*b)
    tr.save(tmp_path / "c.safetensors")
    full = [tr.step(*b) for b in batches[4:]]
    back = ej.Trainer.load(tmp_path / "c.safetensors", net(), batches[0], TF.cross_entropy, **options)
    assert [back.step(*b) for b in batches[4:]] == full
    assert all(torch.equal(a, b) for a, b in zip(tr.state_dict().values(), back.state_dict().values()))


def test_load_refuses_another_module_and_another_optimizer(tmp_path):
    batches = _cls(2)
    tr = ej.Trainer(_mlp(), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2), devices=1)
    tr.step(*batches[0])
    path = tmp_path / "t.safetensors"
    tr.save(path)
    wider = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 3))
    with pytest.raises(ej.EinjoinError, match=r"saved .*0\.(weight|bias).*float32\[8.*float32\[9"):
        ej.Trainer.load(path, wider, batches[0], TF.cross_entropy, devices=1)
    with pytest.raises(ej.EinjoinError, match="AdamW, not SGD"):
        ej.Trainer.load(path, _mlp(), batches[0], TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.1), devices=1)
    back = ej.Trainer.load(path, _mlp(), batches[0], TF.cross_entropy, devices=1)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), tr.state_dict().values()))
    assert back.step(*batches[1]) == tr.step(*batches[1])  # the same devices: bit-identical
    ref = copy.deepcopy(_mlp())
    assert _max_diff(back.state_dict(), ref) > 0  # it did train


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_ray_backend_trains_as_torch_and_resumes(ray_session, tmp_path):
    pytest.importorskip("ray")
    batches = _cls(5)
    ref = _mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    want = [_torch_step(ref, opt, TF.cross_entropy, x, t) for x, t in batches]
    tr = ej.Trainer(_mlp(), batches[0], TF.cross_entropy, optimizer=ej.optim.AdamW(lr=1e-2), devices=2,
                    backend="ray")
    got = [tr.step(x, t) for x, t in batches[:3]]
    tr.save(tmp_path / "r.safetensors")
    got += [tr.step(x, t) for x, t in batches[3:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert _max_diff(tr.state_dict(), ref) < 1e-6
    back = ej.Trainer.load(tmp_path / "r.safetensors", _mlp(), batches[0], TF.cross_entropy, devices=2,
                           backend="ray")
    assert [back.step(x, t) for x, t in batches[3:]] == got[3:]  # bit-identical resume on Ray


def test_a_torch_optimizer_is_refused_naming_ej_optim():
    (x, t), = _cls(1)
    model = _mlp()
    with pytest.raises(ej.EinjoinError, match="ej.optim"):
        ej.Trainer(model, (x, t), TF.cross_entropy, optimizer=torch.optim.AdamW(model.parameters()), devices=1)
    with pytest.raises(ej.EinjoinError, match="ej.optim"):
        ej.Trainer(model, (x, t), TF.cross_entropy, optimizer=ej.optim.AdamW, devices=1)


def test_reading_the_state_never_makes_the_next_step_reload_it(tmp_path):
    # state_dict / evaluate / save / a new lr read or feed around the resident state: the next step
    # still loads only the batch and the lr; load_state_dict and a switch of batch shape reload once
    (x, t), = _cls(1, rows=8)
    x2, t2 = _cls(1, rows=5, seed=9)[0]
    tr = ej.Trainer(_mlp(), (x, t), TF.cross_entropy, devices=2, leave_idle=False)
    batch = x.numpy().nbytes + t.numpy().nbytes + 8

    def loaded():
        tr.step(x, t)
        return tr.program.run_stats.bytes_loaded

    tr.step(x, t)
    assert loaded() == batch
    for poke in (tr.state_dict, lambda: tr.evaluate(x, t), lambda: tr.save(tmp_path / "s.safetensors"),
                 lambda: setattr(tr, "lr", 1e-2)):
        poke()
        assert loaded() == batch
    for poke in (lambda: tr.load_state_dict(tr.state_dict()), lambda: tr.step(x2, t2)):
        poke()
        assert loaded() > batch  # the state goes back to the devices once
        assert loaded() == batch


@pytest.mark.slow  # make test-all; tied weights, masks and padded labels have smaller tests here
def test_zoo_llama_with_padded_labels_and_two_sequence_lengths_matches_torch():
    # GQA, RoPE tables sliced to the batch's length (non-persistent buffers), causal SDPA, labels
    # padded with -100; a (3, 6) batch recompiles once between (2, 8) ones
    from einjoin.models.zoo import Llama, LlamaConfig

    cfg = LlamaConfig(dim=32, heads=4, kv_heads=2, hidden=48, layers=1, vocab=40, seq=16)

    def make():
        torch.manual_seed(0)
        return Llama(cfg)

    def lm(out, t):
        return TF.cross_entropy(out.reshape(-1, cfg.vocab), t.reshape(-1), ignore_index=-100)

    g = torch.Generator().manual_seed(1)

    def batch(b, s, pad=0):
        x = torch.randint(0, cfg.vocab, (b, s), generator=g)
        t = torch.roll(x, -1, 1).clone()
        t[:, -1] = -100
        if pad:
            t[0, -pad:] = -100
        return x, t

    batches = [batch(2, 8, 2), batch(2, 8), batch(3, 6, 1), batch(2, 8, 3), batch(3, 6)]
    tr = ej.Trainer(make(), batches[0], lm, optimizer=ej.optim.AdamW(lr=3e-3), devices=2, leave_idle=False)
    ref = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    for x, t in batches:
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, lm, x, t), rel=1e-5)
    assert len(tr._programs) == 2
    sd = tr.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert _max_diff(sd, ref) < 1e-6


class _GPT(nn.Module):
    """Two zoo GPT-2 blocks (registered tril mask buffers, masked_fill), learned positions from
    torch.arange, the head tied to the token embedding."""

    def __init__(self, vocab=50, dim=32, seq=16, layers=2):
        super().__init__()
        from einjoin.models.zoo import GPT2Block

        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPT2Block(dim, 4, seq, dropout=0.0) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


@pytest.mark.slow  # make test-all; tied weights, masks and padded labels have smaller tests here
def test_gpt_with_tied_head_and_mask_buffers_matches_torch():
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 50, (2, 12), generator=g), torch.randint(0, 50, (2, 12), generator=g))
               for _ in range(4)]
    tr = ej.Trainer(_GPT(), batches[0], lm_loss, optimizer=ej.optim.AdamW(lr=1e-3), devices=2, leave_idle=False)
    ref = _GPT()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    for x, t in batches:
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, lm_loss, x, t), rel=1e-5)
    sd = tr.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        if k.endswith("c_attn.bias"):
            # the key bias's true gradient is exactly 0 (softmax ignores a per-row shift): both
            # sides hold rounding noise there, which AdamW turns into +-lr steps; only q and v
            # parts are comparable
            v, got = torch.cat([v[:32], v[64:]]), torch.cat([sd[k][:32], sd[k][64:]])
        else:
            got = sd[k]
        scale = max(1.0, float(v.abs().max()))
        assert float((got - v).abs().max()) / scale < 1e-5, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_modules_train_as_torch_and_resume_bit_identically(tmp_path, dtype):
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)

    (x, t), = _cls(1)
    x = x.to(dtype)
    tr = ej.Trainer(net(), (x, t), TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.1, momentum=0.9),
                    devices=2, leave_idle=False)
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    for _ in range(3):
        want = _torch_step(ref, opt, TF.cross_entropy, x, t)
        assert tr.step(x, t) == pytest.approx(want, rel=4 * float(torch.finfo(dtype).eps))
    tr.save(tmp_path / "h.safetensors")
    full = [tr.step(x, t) for _ in range(2)]
    back = ej.Trainer.load(tmp_path / "h.safetensors", net(), (x, t), TF.cross_entropy, devices=2)
    assert [back.step(x, t) for _ in range(2)] == full
    assert all(v.dtype == dtype for v in back.state_dict().values())


class _EvalOnly(nn.Module):
    """A parameter only the eval-mode forward reads (a calibration scale)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.calib = nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x):
        y = self.lin(x)
        return y if self.training else y * self.calib


def test_load_state_dict_reaches_a_parameter_only_evaluate_reads():
    (x, t), = _cls(1)
    tr = ej.Trainer(_EvalOnly(), (x, t), TF.cross_entropy, optimizer=ej.optim.AdamW(lr=0.1),
                    devices=2, leave_idle=False)
    tr.step(x, t)
    sd = tr.state_dict()
    sd["calib"] = torch.full((3,), 2.0)
    tr.load_state_dict(sd)
    assert torch.equal(tr.state_dict()["calib"], sd["calib"])
    ref = _EvalOnly()
    ref.load_state_dict(sd)
    ref.eval()
    assert tr.evaluate(x, t) == pytest.approx(TF.cross_entropy(ref(x), t).item(), rel=1e-5)


def test_a_parameter_only_evaluate_reads_is_used_and_left_alone_by_training():
    (x, t), = _cls(1)
    tr = ej.Trainer(_EvalOnly(), (x, t), TF.cross_entropy, optimizer=ej.optim.AdamW(lr=0.1),
                    devices=2, leave_idle=False)
    ref = _EvalOnly()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=False)
    for _ in range(2):
        assert tr.step(x, t) == pytest.approx(_torch_step(ref, opt, TF.cross_entropy, x, t), rel=1e-5)
    ref.eval()
    assert tr.evaluate(x, t) == pytest.approx(TF.cross_entropy(ref(x), t).item(), rel=1e-5)
    assert torch.equal(tr.state_dict()["calib"], ref.calib.detach())
