"""A trainer's file: ``ej.Trainer.save`` / ``ej.Trainer.load`` as safetensors.

The file holds the program state (parameters, optimizer moments, step count, gradient sums of an
unfinished accumulation) under ``state/``, the fixed inputs (buffers the loss reads but never
writes) under ``fixed/``, and in its metadata the step counters, learning rate, seed,
accumulation and the optimizer's class and hyperparameters, so a resumed run continues
bit-identically. Kept apart from :mod:`einjoin.trainer` (the training loop) as
:mod:`einjoin.program_io` is from :mod:`einjoin.program`.

>>> import torch, tempfile, os, einjoin as ej
>>> model = torch.nn.Linear(3, 1)
>>> x, y = torch.randn(4, 3), torch.randn(4, 1)
>>> mse = lambda out, target: ((out - target) ** 2).mean()
>>> tr = ej.Trainer(model, (x, y), mse, optimizer=ej.optim.SGD(lr=0.1), devices=1)
>>> _ = tr.step(x, y)
>>> path = os.path.join(tempfile.mkdtemp(), "run.safetensors")
>>> tr.save(path)
>>> again = ej.Trainer.load(path, model, (x, y), mse, devices=1)
>>> again.steps, again.step(x, y) == tr.step(x, y)
(1, True)
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.program_io import file_path
from einjoin.train.optim import check_lr

if TYPE_CHECKING:
    from einjoin.trainer import Trainer

__all__ = ["FORMAT", "save_trainer", "load_trainer"]

FORMAT = "einjoin.Trainer/1"   # the safetensors metadata "format" of a saved trainer


def optimizer_config(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class name and its plain hyperparameters (numbers, strings, tuples of numbers)."""
    cfg: dict[str, Any] = {}
    for k, v in vars(optimizer).items():
        if k.startswith("_"):
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            cfg[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(e, (int, float)) for e in v):
            cfg[k] = list(v)
    return {"class": type(optimizer).__name__, "hyper": cfg}


def save_trainer(trainer: Trainer, path: str | os.PathLike[str]) -> None:
    """Write ``trainer``'s state, fixed inputs and counters to ``path`` (see :meth:`Trainer.save`)."""
    from safetensors.numpy import save_file
    where = file_path(path, "Trainer.save")  # None, an int: named before any work
    tensors = {f"state/{n}": np.asarray(v, order="C") for n, v in trainer._current().items()}
    tensors.update({f"fixed/{n}": np.asarray(v, order="C") for n, v in trainer._fixed.items()})
    meta = {"format": FORMAT, "steps": str(trainer.steps), "micro_steps": str(trainer.micro_steps),
            "lr": repr(trainer._lr), "seed": str(trainer.seed), "accumulate": str(trainer.accumulate),
            "optimizer": json.dumps(optimizer_config(trainer.optimizer)),
            "parameters": json.dumps(list(trainer._trainable))}
    try:  # a folder, a missing folder, no permission: named, not a raw SafetensorError
        save_file(tensors, where, metadata=meta)
    except Exception as e:
        raise EinjoinError(f"Trainer.save: cannot write {where!r} ({type(e).__name__}: {e})") from e


def _read(where: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    from safetensors import safe_open
    from safetensors.numpy import load_file
    try:  # a missing, unreadable or non-safetensors file: one error naming the path
        with safe_open(where, "np") as f:
            meta = f.metadata() or {}
        tensors = load_file(where)
    except Exception as e:
        raise EinjoinError(f"Trainer.load: cannot read {where!r} as a safetensors file "
                           f"({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise EinjoinError(f"Trainer.load: {where!r} is not a saved einjoin Trainer "
                           f"(format {meta.get('format')!r})")
    return meta, tensors


def _rebuild_optimizer(saved_class: str, saved_hyper: dict[str, Any]) -> Any:
    """The saved optimizer, from :mod:`einjoin.train.optim`'s class of that name."""
    from einjoin.train import optim
    kind = getattr(optim, saved_class, None)
    if not (inspect.isclass(kind) and hasattr(kind, "update")):  # only optimizer classes
        raise EinjoinError(f"Trainer.load: unknown optimizer {saved_class!r}; pass optimizer=")
    hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in saved_hyper.items()}
    try:
        return kind(**{k: v for k, v in hyper.items() if k in inspect.signature(kind).parameters})
    except TypeError as e:  # a hyperparameter the header lacks
        raise EinjoinError(f"Trainer.load: cannot rebuild {saved_class} from the saved "
                           f"hyperparameters {saved_hyper}: {e}; pass optimizer=") from e


def load_trainer(cls: type[Trainer], path: str | os.PathLike[str], module: Any, example_batch: Sequence[Any],
                 loss_fn: Callable[..., Any], optimizer: Any = None, **options: Any) -> Trainer:
    """A trainer of class ``cls`` continuing the run saved at ``path`` (see :meth:`Trainer.load`)."""
    where = file_path(path, "Trainer.load")
    meta, tensors = _read(where)
    try:  # a tampered or truncated header: named, never a KeyError / ValueError from parsing it
        cfg = json.loads(meta["optimizer"])
        counts = {k: int(meta[k]) for k in ("steps", "micro_steps")}
        saved_lr = check_lr(float(meta["lr"]))
        accumulate, seed = int(meta.get("accumulate", "1")), int(meta.get("seed", "0"))
        saved_class, saved_hyper = str(cfg["class"]), dict(cfg["hyper"])
    except (KeyError, ValueError, TypeError, AttributeError, EinjoinError) as e:
        raise EinjoinError(f"Trainer.load: {where!r} has a malformed header "
                           f"({type(e).__name__}: {e})") from e
    if optimizer is None:
        optimizer = _rebuild_optimizer(saved_class, saved_hyper)
    elif type(optimizer).__name__ != saved_class:
        raise EinjoinError(f"Trainer.load: the run was saved with {saved_class}, not "
                           f"{type(optimizer).__name__}")
    options.setdefault("accumulate", accumulate)
    options.setdefault("seed", seed)
    trainer = cls(module, example_batch, loss_fn, optimizer, **options)
    state = {k.removeprefix("state/"): v for k, v in tensors.items() if k.startswith("state/")}
    want = set(trainer._state_names())
    if trainer.accumulate != accumulate:  # another accumulation: only from a boundary
        if counts["micro_steps"] % accumulate:
            raise EinjoinError(f"Trainer.load: {where!r} was saved inside an accumulation (micro-batch "
                               f"{counts['micro_steps'] % accumulate} of accumulate={accumulate}): load it "
                               f"with accumulate={accumulate}, or save at an accumulation boundary")
        # at a boundary the saved gradient sums are zero: this trainer's own (zeros) replace them,
        # and its micro-batch count restarts its accumulation at the saved step
        state = {n: v for n, v in state.items() if not n.startswith("grad_acc.")}
        state.update({n: np.zeros_like(trainer._host[n]) for n in want if n.startswith("grad_acc.")})
        counts["micro_steps"] = counts["steps"] * trainer.accumulate
    for n in want - set(state):  # a moving buffer saved as a fixed input (before they were state)
        if n in trainer._moving and f"fixed/{n}" in tensors:
            state[n] = tensors[f"fixed/{n}"]
    if set(state) != want:
        raise EinjoinError(f"Trainer.load: the saved state does not fit this module and optimizer; "
                           f"missing {sorted(want - set(state))[:5]}, unexpected "
                           f"{sorted(set(state) - want)[:5]}")
    for n, v in state.items():
        old = trainer._host[n]
        if v.shape != old.shape or v.dtype != old.dtype:
            raise EinjoinError(f"Trainer.load: saved {n!r} is {v.dtype}{list(v.shape)}, this module's is "
                               f"{old.dtype}{list(old.shape)}")
    trainer._host = dict(state)
    trainer._owner = None
    trainer.version += 1
    trainer._fixed.update({k.removeprefix("fixed/"): v for k, v in tensors.items()
                           if k.startswith("fixed/") and k.removeprefix("fixed/") not in trainer._moving})
    trainer.steps = counts["steps"]
    trainer.micro_steps = counts["micro_steps"]
    trainer._lr = saved_lr
    return trainer
