"""``ej.Trainer`` against torch: the same initial weights, batches, loss and optimizer in torch
(``torch.optim``'s single-tensor path) and in einjoin; losses, parameters, state dicts, resumes,
accumulation, learning-rate changes, dropout, per-shape programs and errors."""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import einjoin as ej
from einjoin.models.zoo import example

ROOT = pathlib.Path(__file__).resolve().parents[1]

# one layer in the default run (every op and state kind of the step; planning the step is most of a
# test's time), the slow tests two
LLAMA = dict(dim=64, layers=1, vocab=256, heads=4, kv_heads=2, hidden=96, seq=16, batch=2)


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the vocabulary (class-index targets, mean)."""
    return TF.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def llama_task(steps: int, seed: int = 0, layers: int = 1
               ) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The zoo's small LLaMA and ``steps`` batches of a synthetic next-token task: the targets are
    the tokens shifted by one (a learnable rule: next = (token * 7 + 3) mod vocab)."""
    module, _ = example("llama", seed=seed, **{**LLAMA, "layers": layers})
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, LLAMA["vocab"], (LLAMA["batch"], 1), generator=g)
        seq = [start]
        for _ in range(LLAMA["seq"]):
            seq.append((seq[-1] * 7 + 3) % LLAMA["vocab"])
        toks = torch.cat(seq, dim=1)
        batches.append((toks[:, :-1].contiguous(), toks[:, 1:].contiguous()))
    return module, batches


def mlp_task(steps: int, seed: int = 0, batch: int = 16, dim: int = 32
             ) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The zoo's MLP on a regression task: y = sin(x @ A)."""
    module, _ = example("mlp", seed=seed, dim=dim, hidden=64, layers=2, batch=batch)
    g = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(dim, dim, generator=g) / dim ** 0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, dim, generator=g)
        batches.append((x, torch.sin(x @ a)))
    return module, batches


def torch_run(module: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, ...]], loss_fn: Any, make_opt: Any,
              accumulate: int = 1, lrs: list[float] | None = None) -> tuple[list[float], torch.nn.Module]:
    """Train a copy of ``module`` as a torch user would; returns the losses and the module."""
    m = copy.deepcopy(module)
    m.train()
    opt = make_opt(m.parameters())
    losses = []
    opt.zero_grad()
    for i, (*args, target) in enumerate(batches):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        loss = loss_fn(m(*args), target)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return losses, m


def adamw(lr: float = 1e-2) -> tuple[Any, Any]:
    return (ej.optim.AdamW(lr=lr), lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False))


def sgd(lr: float = 0.05) -> tuple[Any, Any]:
    return (ej.optim.SGD(lr=lr, momentum=0.9, weight_decay=1e-3),
            lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=1e-3, foreach=False))


def assert_matches(trainer: ej.Trainer, losses: list[float], want: list[float], ref: torch.nn.Module) -> None:
    got_l, want_l = np.array(losses), np.array(want)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-4)
    sd, want_sd = trainer.state_dict(), ref.state_dict()
    assert list(sd) == list(want_sd)
    for k, w in want_sd.items():
        assert sd[k].dtype == w.dtype and sd[k].shape == w.shape, k
        scale = max(float(w.abs().max()), 1e-30)
        assert float((sd[k] - w).abs().max()) <= 1e-4 * scale, k


# ---------------------------------------------------------------- equivalence with torch


@pytest.mark.parametrize("opt", [adamw, sgd], ids=["adamw", "sgd"])
def test_mlp_matches_torch(opt: Any) -> None:
    module, batches = mlp_task(10)
    ours, theirs = opt()
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=2, leave_idle=False, backend="threads")
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, mse, theirs)
    assert_matches(trainer, losses, want, ref)
    assert trainer.steps == 10


def test_llama_matches_torch_adamw() -> None:
    module, batches = llama_task(10, layers=2)  # the model: 2 layers, 10 steps, 2 threads devices
    ours, theirs = adamw(1e-3)
    trainer = ej.Trainer(module, batches[0], next_token_loss, optimizer=ours, devices=2,
                         leave_idle=False, backend="threads")
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, next_token_loss, theirs)
    assert_matches(trainer, losses, want, ref)
    assert losses[-1] < losses[0]
    # evaluation: the forward loss with the current parameters, its own program
    ref.eval()
    with torch.no_grad():
        want_eval = next_token_loss(ref(batches[0][0]), batches[0][1]).item()
    assert trainer.evaluate(*batches[0]) == pytest.approx(want_eval, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("model", ["llama", "mlp"])
def test_matches_torch_50_steps(model: str, devices: int) -> None:
    module, batches = llama_task(50, layers=2) if model == "llama" else mlp_task(50)
    loss_fn = next_token_loss if model == "llama" else mse
    ours, theirs = adamw(1e-3)
    trainer = ej.Trainer(module, batches[0], loss_fn, optimizer=ours, devices=devices, leave_idle=False)
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, loss_fn, theirs)
    np.testing.assert_allclose(losses[:10], want[:10], rtol=1e-4)
    assert losses[-1] == pytest.approx(want[-1], rel=1e-3)


@pytest.mark.slow
def test_matches_torch_under_memory_cap() -> None:
    module, batches = llama_task(10, layers=2)
    ours, theirs = adamw(1e-3)
    free = ej.Trainer(module, batches[0], next_token_loss, optimizer=ours, devices=2, leave_idle=False)
    working = max(free.program.stats.peak_bytes_per_device.values())
    cap = working // 2
    trainer = ej.Trainer(module, batches[0], next_token_loss, optimizer=ours, devices=2, leave_idle=False, memory=cap)
    losses = [trainer.step(*b) for b in batches]
    assert max(trainer.program.run_stats.peak_bytes_per_device.values()) <= cap
    want, ref = torch_run(module, batches, next_token_loss, theirs)
    assert_matches(trainer, losses, want, ref)




@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("model", ["llama", "mlp"])
def test_matches_torch_on_ray(model: str, ray_session) -> None:  # type: ignore[no-untyped-def]
    module, batches = llama_task(10, layers=2) if model == "llama" else mlp_task(10)
    loss_fn = next_token_loss if model == "llama" else mse
    ours, theirs = adamw(1e-3)
    trainer = ej.Trainer(module, batches[0], loss_fn, optimizer=ours, devices=2, leave_idle=False, backend="ray")
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, loss_fn, theirs)
    assert_matches(trainer, losses, want, ref)


# ---------------------------------------------------------------- state that stays put


@pytest.mark.parametrize("model", ["llama", "mlp"])
def test_after_the_first_step_only_the_batch_is_loaded(model: str) -> None:
    # parameters, AdamW moments, the step count and the buffers (LLaMA's rope tables) stay on
    # the devices: a step after the first loads the batch and the learning rate
    module, batches = llama_task(3) if model == "llama" else mlp_task(3)
    loss_fn = next_token_loss if model == "llama" else mse
    trainer = ej.Trainer(module, batches[0], loss_fn, optimizer=ej.optim.AdamW(lr=1e-3), devices=2, leave_idle=False)
    first = trainer.step(*batches[0])
    assert trainer.program.run_stats.bytes_loaded > trainer.program.stats.bytes_loaded // 2
    trainer.step(*batches[1])
    batch_bytes = sum(t.numel() * t.element_size() for t in batches[1])
    assert trainer.program.run_stats.bytes_loaded == batch_bytes + 8  # and the learning rate (float64)
    # evaluation: its program holds the parameters until the next step changes them
    ev = [trainer.evaluate(*batches[2]) for _ in range(2)]
    (prog,) = [sp.prog for sp in trainer._evals.values()]
    assert ev[0] == ev[1] != first and prog.run_stats.bytes_loaded == batch_bytes
    trainer.step(*batches[2])
    assert trainer.evaluate(*batches[2]) < ev[0] and prog.run_stats.bytes_loaded > batch_bytes


# ---------------------------------------------------------------- state dicts and files


def test_state_dict_round_trip() -> None:
    module, batches = llama_task(3)
    trainer = ej.Trainer(module, batches[0], next_token_loss, optimizer=ej.optim.AdamW(lr=1e-2), devices=2,
                         leave_idle=False)
    for b in batches:
        trainer.step(*b)
    sd = trainer.state_dict()
    assert set(sd) == set(module.state_dict())
    fresh, _ = example("llama", seed=5, **LLAMA)
    assert str(fresh.load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    fresh.eval()
    with torch.no_grad():
        want = next_token_loss(fresh(batches[0][0]), batches[0][1]).item()
    assert trainer.evaluate(*batches[0]) == pytest.approx(want, rel=1e-5)
    # and back: a trainer loading another module's weights continues from them
    other = ej.Trainer(fresh, batches[0], next_token_loss, optimizer=ej.optim.SGD(lr=0.0), devices=2, leave_idle=False)
    other.load_state_dict(module.state_dict())
    with torch.no_grad():
        want0 = next_token_loss(module(batches[1][0]), batches[1][1]).item()
    assert other.step(*batches[1]) == pytest.approx(want0, rel=1e-5)
    with pytest.raises(ej.EinjoinError, match="missing: output.weight"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "output.weight"})
    with pytest.raises(ej.ShapeError, match="norm.weight"):
        other.load_state_dict({**sd, "norm.weight": torch.ones(3)})


class Tied(torch.nn.Module):
    """An embedding whose weight is also the output projection (GPT-2's wte / lm_head), and a
    persistent buffer."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))) * self.scale)


def test_tied_weights_are_one_parameter() -> None:
    torch.manual_seed(0)
    module = Tied()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g))
               for _ in range(5)]
    ours, theirs = adamw(1e-2)
    trainer = ej.Trainer(module, batches[0], next_token_loss, optimizer=ours, devices=2, leave_idle=False)
    assert trainer.parameter_names == ("emb.weight", "mix.weight", "mix.bias")
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, next_token_loss, theirs)
    assert_matches(trainer, losses, want, ref)
    sd = trainer.state_dict()
    assert torch.equal(sd["emb.weight"], sd["head.weight"]) and float(sd["scale"]) == 0.5


def test_save_and_load_in_process(tmp_path: pathlib.Path) -> None:
    module, batches = mlp_task(6)
    opt = ej.optim.AdamW(lr=1e-2, weight_decay=0.05)
    straight = ej.Trainer(module, batches[0], mse, optimizer=opt, devices=2, leave_idle=False)
    want = [straight.step(*b) for b in batches]
    first = ej.Trainer(module, batches[0], mse, optimizer=opt, devices=2, leave_idle=False)
    for b in batches[:3]:
        first.step(*b)
    first.lr = 1e-2  # the saved learning rate comes back
    first.save(tmp_path / "run.safetensors")
    resumed = ej.Trainer.load(tmp_path / "run.safetensors", module, batches[0], mse, devices=2, leave_idle=False)
    assert type(resumed.optimizer).__name__ == "AdamW" and resumed.optimizer.weight_decay == 0.05
    assert resumed.steps == 3
    assert [resumed.step(*b) for b in batches[3:]] == want[3:]
    with pytest.raises(ej.EinjoinError, match="saved with AdamW"):
        ej.Trainer.load(tmp_path / "run.safetensors", module, batches[0], mse, ej.optim.SGD(lr=0.1), devices=2,
                        leave_idle=False)


RESUME = textwrap.dedent("""
    import sys, json, torch
    sys.path.insert(0, {tests!r})
    import einjoin as ej
    from test_trainer import mlp_task, mse
    module, batches = mlp_task(30)
    trainer = ej.Trainer.load({path!r}, module, batches[0], mse, devices=2, leave_idle=False)
    print(json.dumps([trainer.step(*b) for b in batches[20:]]))
""")


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path: pathlib.Path) -> None:
    module, batches = mlp_task(30)
    opt = ej.optim.AdamW(lr=1e-2)
    straight = ej.Trainer(module, batches[0], mse, optimizer=opt, devices=2, leave_idle=False)
    want = [straight.step(*b) for b in batches]
    first = ej.Trainer(module, batches[0], mse, optimizer=opt, devices=2, leave_idle=False)
    for b in batches[:20]:
        first.step(*b)
    path = tmp_path / "run.safetensors"
    first.save(path)
    code = RESUME.format(tests=str(ROOT / "tests"), path=str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want[20:]


# ---------------------------------------------------------------- the loop's knobs


def test_accumulate_updates_with_the_mean_gradient(tmp_path: pathlib.Path) -> None:
    module, batches = mlp_task(8, batch=8)
    ours, theirs = adamw(1e-2)
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=2, leave_idle=False, accumulate=4)
    losses = [trainer.step(*b) for b in batches]
    assert trainer.steps == 2 and trainer.micro_steps == 8
    want, ref = torch_run(module, batches, mse, theirs, accumulate=4)
    assert_matches(trainer, losses, want, ref)
    # saved in the middle of an accumulation (the gradient sums are state too), resumed exactly
    first = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=2, leave_idle=False, accumulate=4)
    for b in batches[:6]:
        first.step(*b)
    first.save(tmp_path / "mid.safetensors")
    resumed = ej.Trainer.load(tmp_path / "mid.safetensors", module, batches[0], mse, devices=2, leave_idle=False)
    assert resumed.accumulate == 4 and (resumed.steps, resumed.micro_steps) == (1, 6)
    assert [resumed.step(*b) for b in batches[6:]] == losses[6:]
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), trainer.state_dict().values()))


def test_lr_changes_without_replanning() -> None:
    module, batches = mlp_task(8)
    ours, theirs = sgd(0.05)
    lrs = [0.05, 0.05, 0.02, 0.02, 0.01, 0.0, 0.1, 0.1]
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=2, leave_idle=False)
    prog = trainer.program
    losses = []
    for lr, b in zip(lrs, batches):
        trainer.lr = lr
        losses.append(trainer.step(*b))
    assert trainer.program is prog
    want, ref = torch_run(module, batches, mse, theirs, lrs=lrs)
    assert_matches(trainer, losses, want, ref)
    with pytest.raises(ej.EinjoinError, match="lr"):
        trainer.lr = -1.0


def test_a_batch_of_another_shape_compiles_once(caplog) -> None:  # type: ignore[no-untyped-def]
    module, batches = mlp_task(3, batch=16)
    _, small = mlp_task(3, batch=4)
    mixed = [batches[0], small[0], batches[1], small[1], small[2], batches[2]]
    ours, theirs = adamw(1e-2)
    with caplog.at_level(logging.INFO, logger="einjoin.trainer"):
        trainer = ej.Trainer(module, mixed[0], mse, optimizer=ours, devices=2, leave_idle=False)
        losses = [trainer.step(*b) for b in mixed]
    compiled = [r for r in caplog.records if "compiling the training step" in r.getMessage()]
    assert len(compiled) == 2 and "[4, 32]" in compiled[1].getMessage()
    assert len(trainer._programs) == 2
    want, ref = torch_run(module, mixed, mse, theirs)
    assert_matches(trainer, losses, want, ref)


def test_dropout_draws_from_a_seeded_generator() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                 torch.nn.Linear(64, 16))
    _, batches = mlp_task(4, dim=16)
    runs = []
    for seed in (0, 0, 1):
        trainer = ej.Trainer(module, batches[0], mse, optimizer=ej.optim.SGD(lr=0.0), devices=2,
                             leave_idle=False, seed=seed)
        runs.append([trainer.step(*b) for b in batches])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    same = ej.Trainer(module, batches[0], mse, optimizer=ej.optim.SGD(lr=0.0), devices=2, leave_idle=False)
    assert len({same.step(*batches[0]) for _ in range(3)}) == 3  # a new mask each step
    module.eval()
    with torch.no_grad():
        want = mse(module(batches[0][0]), batches[0][1]).item()
    assert same.evaluate(*batches[0]) == pytest.approx(want, rel=1e-5)  # evaluation: no dropout


# ---------------------------------------------------------------- errors


def test_errors() -> None:
    module, batches = mlp_task(1)
    x, y = batches[0]
    trainer = ej.Trainer(module, (x, y), mse, optimizer=ej.optim.SGD(lr=0.1), devices=2, leave_idle=False)
    with pytest.raises(ej.EinjoinError, match="the batch has 1 tensor"):
        trainer.step(x)
    with pytest.raises(ej.DTypeError, match="the target is float64 but the example batch's was float32"):
        trainer.step(x, y.double())
    frozen = copy.deepcopy(module).requires_grad_(False)
    with pytest.raises(ej.EinjoinError, match="no trainable parameters"):
        ej.Trainer(frozen, (x, y), mse, optimizer=ej.optim.SGD(lr=0.1))
    with pytest.raises(ej.ShapeError, match="the loss must be a scalar"):
        ej.Trainer(module, (x, y), lambda o, t: (o - t) ** 2, optimizer=ej.optim.SGD(lr=0.1))
    with pytest.raises(ej.EinjoinError, match="accumulate"):
        ej.Trainer(module, (x, y), mse, optimizer=ej.optim.SGD(lr=0.1), accumulate=0)
    with pytest.raises(ej.EinjoinError, match="torch.nn.Module"):
        ej.Trainer(lambda t: t, (x, y), mse)
    with pytest.raises(ej.EinjoinError, match="callable"):
        ej.Trainer(module, (x, y), "mse")
    with pytest.raises(ej.EinjoinError, match=r"\(\*module_args, target\)"):
        ej.Trainer(module, (x,), mse)
    with pytest.raises(ej.EinjoinError, match="seed"):
        ej.Trainer(module, (x, y), mse, seed=1.5)
    with pytest.raises(ej.EinjoinError, match="lr"):
        trainer.lr = "fast"
    sd = trainer.state_dict()
    with pytest.raises(ej.EinjoinError, match="unexpected: extra"):
        trainer.load_state_dict({**sd, "extra": torch.zeros(1)})
    with pytest.raises(ej.EinjoinError, match="computes nothing"):
        ej.Trainer(module, (x, y), mse, optimizer=ej.optim.SGD(lr=0.1), devices=2, backend="null").step(x, y)


def test_load_state_dict_as_torch() -> None:
    # dtypes converted and strict=False as module.load_state_dict does
    module, batches = mlp_task(1)
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ej.optim.SGD(lr=0.1), devices=2, leave_idle=False)
    other, _ = mlp_task(1, seed=7)
    sd64 = {k: v.double() for k, v in other.state_dict().items()}
    assert trainer.load_state_dict(sd64) == ([], [])
    got = trainer.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v) for k, v in other.state_dict().items())
    part = {"ups.0.bias": torch.full((64,), 0.25), "other": torch.zeros(1)}
    assert trainer.load_state_dict(part, strict=False).unexpected_keys == ["other"]
    got2 = trainer.state_dict()
    assert torch.equal(got2["ups.0.bias"], part["ups.0.bias"]) and torch.equal(got2["ups.1.bias"], got["ups.1.bias"])


class Spare(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 2)
        self.spare = torch.nn.Linear(4, 2)  # never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_a_parameter_the_loss_never_reads_is_left_alone() -> None:
    torch.manual_seed(0)
    module = Spare()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ej.optim.AdamW(lr=0.1, weight_decay=0.5), devices=2,
                         leave_idle=False)
    assert trainer.parameter_names == ("used.weight", "used.bias")
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, mse, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5,
                                                                             foreach=False))
    assert_matches(trainer, losses, want, ref)
    assert torch.equal(trainer.state_dict()["spare.weight"], module.spare.weight)


def test_bfloat16_module_trains_like_torch() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g).bfloat16(), torch.randn(8, 4, generator=g).bfloat16())
               for _ in range(3)]
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ej.optim.SGD(lr=0.1), devices=2, leave_idle=False)
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, mse, lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False))
    np.testing.assert_allclose(losses, want, rtol=1e-2)
    sd = trainer.state_dict()
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    for k, w in ref.state_dict().items():  # a bfloat16 ulp or two
        assert float((sd[k].float() - w.float()).abs().max()) <= 2 ** -6 * float(w.float().abs().max()), k
    module.load_state_dict(sd, strict=True)


def test_frozen_parameters_stay_as_they_are(tmp_path: pathlib.Path) -> None:
    module, batches = mlp_task(4)
    module.ups[0].requires_grad_(False)
    ours, theirs = adamw(1e-2)
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=2, leave_idle=False)
    assert "ups.0.weight" not in trainer.parameter_names and "ups.1.weight" in trainer.parameter_names
    losses = [trainer.step(*b) for b in batches]
    want, ref = torch_run(module, batches, mse, lambda ps: theirs(p for p in ps if p.requires_grad))
    assert_matches(trainer, losses, want, ref)
    assert torch.equal(trainer.state_dict()["ups.0.weight"], module.ups[0].weight)
    # a file that is not a saved trainer
    from safetensors.numpy import save_file
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ej.EinjoinError, match="not a saved einjoin Trainer"):
        ej.Trainer.load(tmp_path / "other.safetensors", module, batches[0], mse, devices=2, leave_idle=False)


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).train()


# (2, 2): make test-all
@pytest.mark.parametrize("devices, accumulate", [(1, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_batch_norm_running_statistics_move_as_torchs(devices: int, accumulate: int, tmp_path: pathlib.Path) -> None:
    """A training-mode BatchNorm's running_mean / running_var / num_batches_tracked (the forward's
    buffer writes) are state of the step: after each step they are torch's, on every micro-batch
    of an accumulation too; evaluate() (eval mode) reads them; a batch of another shape, a save /
    load and load_state_dict carry them."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g) + i, torch.tensor([0, 1, 2, 0])) for i in range(3)]
    batches.append((torch.randn(6, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 0, 1, 2])))
    m = _bn_net()
    ref = copy.deepcopy(m)
    tr = ej.Trainer(m, batches[0], TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.1), devices=devices, leave_idle=False,
                    accumulate=accumulate)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, (x, t) in enumerate(batches):
        want = TF.cross_entropy(ref(x), t)
        (want / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
        assert abs(tr.step(x, t) - float(want.detach())) < 1e-5
        sd = tr.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)
    assert int(sd["1.num_batches_tracked"]) == len(batches)
    ref.eval()
    with torch.no_grad():
        x, t = batches[0]
        assert abs(tr.evaluate(x, t) - float(TF.cross_entropy(ref(x), t))) < 1e-5
        if devices == 1:
            return
        tr.save(tmp_path / "bn.safetensors")
        again = ej.Trainer.load(tmp_path / "bn.safetensors", _bn_net(), batches[0], TF.cross_entropy,
                                devices=devices, leave_idle=False, accumulate=accumulate)
        assert all(torch.equal(again.state_dict()[k], v) for k, v in tr.state_dict().items())
        fresh = ej.Trainer(_bn_net(), batches[0], TF.cross_entropy, optimizer=ej.optim.SGD(lr=0.1), devices=devices,
                           leave_idle=False)
        fresh.load_state_dict(ref.state_dict())
        x, t = batches[1]
        assert abs(fresh.evaluate(x, t) - float(TF.cross_entropy(ref(x), t))) < 1e-5


def test_leave_idle_matches_torch_and_resumes_bit_identically(tmp_path: pathlib.Path) -> None:
    # a step with state (weights, AdamW moments) planned on as many of the 4 devices as pay: the
    # state lives on the devices kept; save / load go by names, and a resumed Trainer plans the same
    module, batches = mlp_task(6)
    ours, theirs = adamw()
    trainer = ej.Trainer(module, batches[0], mse, optimizer=ours, devices=4, leave_idle=True)
    prog = trainer.program
    assert prog.cluster.size < 4 and prog.plan.given is not None and prog.plan.given.size == 4
    idle = 4 - prog.cluster.size
    assert f"of the 4 devices given (leave_idle=True; the other {idle} stay idle)" in prog.explain(file=None)
    losses = [trainer.step(*b) for b in batches[:3]]
    trainer.save(tmp_path / "idle.safetensors")
    resumed = ej.Trainer.load(tmp_path / "idle.safetensors", module, batches[0], mse, devices=4, leave_idle=True)
    assert resumed.program.cluster.size == prog.cluster.size and resumed.program.specs == prog.specs
    losses += [trainer.step(*b) for b in batches[3:]]
    assert [resumed.step(*b) for b in batches[3:]] == losses[3:]
    want, ref = torch_run(module, batches, mse, theirs)
    assert_matches(trainer, losses, want, ref)
    with pytest.raises(ej.EinjoinError, match="leave_idle"):
        ej.Trainer(module, batches[0], mse, devices=4, leave_idle="yes")
    # by default every device given is used (a one-device step collapses when another process
    # takes a core, and measured no faster on two quiet cores)
    assert ej.Trainer(module, batches[0], mse, devices=4).program.cluster.size == 4
