"""``ej.Trainer``: train a ``torch.nn.Module`` with einjoin — forward, backward and the optimizer's
update as one planned graph whose parameters and optimizer state stay on their devices.

The trainer captures ``loss_fn(module(*args), target)`` with :func:`einjoin.from_torch` (through a
small wrapper module, whose parameter names are the module's own), differentiates it with
:func:`einjoin.grad` with respect to the trainable parameters, appends the optimizer's update
(:mod:`einjoin.optim`: elementwise EinSums) and compiles ``[loss]`` once per batch shape with the
parameters and the optimizer state as *program state* (``ej.compile(..., state={new: old},
deterministic=True)``): after the first step only the batch is loaded from the host.

>>> import torch, einjoin as ej
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
>>> x, y = torch.randn(16, 4), torch.randn(16, 1)
>>> mse = lambda out, target: ((out - target) ** 2).mean()
>>> trainer = ej.Trainer(model, (x, y), mse,
...                      optimizer=ej.optim.SGD(lr=0.1), devices=2)
>>> losses = [trainer.step(x, y) for _ in range(5)]
>>> losses[-1] < losses[0]
True
>>> model.load_state_dict(trainer.state_dict(), strict=True)
<All keys matched successfully>

Semantics, as a torch user writes the loop:

- ``trainer.step(*batch)`` is ``opt.zero_grad(); loss_fn(module(*args), target).backward();
  opt.step()`` and returns the loss (a float). The module is captured in training mode
  (``module.train()``): a dropout draws its mask from a hash of the element index and a per-step
  seed (``seed`` and the number of steps taken), so a run is reproducible and a resumed run
  continues with the same masks. ``trainer.evaluate(*batch)`` captures the module in eval mode.
- ``accumulate=k``: each ``step`` call is one micro-batch; gradients are summed over k calls and
  every k-th call updates with their mean — torch's ``(loss / k).backward()`` over k micro-batches
  and then ``opt.step()``. ``step`` returns each micro-batch's own (unscaled) loss;
  :attr:`Trainer.steps` counts updates, :attr:`Trainer.micro_steps` calls.
- A batch of another shape than the example is captured and compiled once more (logged by the
  ``einjoin.trainer`` logger) and its program cached; switching programs moves the state through
  the host once.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from einjoin.autodiff import grad
from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor
from einjoin.frontend.aten import torch_dtype
from einjoin.frontend.torch import TorchFunction, _canonical_names, from_torch
from einjoin.ir.graph import Graph
from einjoin.runtime.engine import check_seed
from einjoin.sparse.node import sparse_inputs
from einjoin.sparse.tensor import is_sparse_format
from einjoin.train.optim import check_lr
from einjoin.program import Program
from einjoin.program import compile as ej_compile
from einjoin.trainer_io import load_trainer, save_trainer
from einjoin.variants import ShapeCache

__all__ = ["Trainer"]

log = logging.getLogger(__name__)

PREFIX = "module."      # the wrapper's attribute holding the user's module: stripped from names
DROPOUT_SEED = "dropout_seed"  # from_torch's dropout seed input (einjoin.frontend.aten.DROPOUT_SEED)
APPLY = "accumulate_apply"     # the bool input that says "this micro-batch ends an accumulation"


# ---------------------------------------------------------------- capture


def _with_loss(module: Any, loss_fn: Callable[..., Any]) -> Any:
    """A module whose forward is ``loss_fn(module(*args), target)``; the user's module is its
    only child (``module.``), the loss function is not a child (its tensors, if any, become
    constants), so every parameter's name is ``"module." + `` the module's own name."""
    import torch

    class WithLoss(torch.nn.Module):
        loss_fn: Callable[..., Any]

        def __init__(self) -> None:
            super().__init__()
            self.module = module
            object.__setattr__(self, "loss_fn", loss_fn)  # not a submodule: its names stay out

        def forward(self, *batch: Any) -> Any:
            *args, target = batch
            model: Any = self._modules["module"]
            return self.loss_fn(model(*args), target)

    return WithLoss()


def _as_torch(x: Any, what: str) -> Any:
    """A batch tensor as torch: None, a str or an object array is an EinjoinError naming ``what``."""
    import torch
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple, int, float, bool)):  # Python numbers as torch reads them (floats: float32)
        try:
            return torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError):
            pass  # e.g. a list of tensors: stacked by numpy below
    try:
        return torch.as_tensor(np.asarray(x))
    except (TypeError, ValueError, RuntimeError) as e:
        raise EinjoinError(f"{what} is not a tensor or array of numbers ({type(x).__name__}: {e})") from None


def _input_name(t: Tensor) -> str:
    op = t.node.op
    name = getattr(op, "name", None)
    if not t.node.facts.fed or not isinstance(name, str):
        raise EinjoinError(f"the optimizer's state and hyperparameters must be graph inputs; got {t!r}")
    return name


def _method(update: Any, optimizer: Any, name: str) -> Callable[..., Any]:
    """``update.name`` (the interface), else ``optimizer.name``."""
    fn = getattr(update, name, None) or getattr(optimizer, name, None)
    if fn is None:
        raise EinjoinError(f"the optimizer {type(optimizer).__name__} has no {name}()")
    return fn  # type: ignore[no-any-return]


def _check_optimizer(optimizer: Any) -> None:
    """An ``ej.optim`` instance (anything with ``update``); a torch optimizer or an optimizer class
    is refused with the ``ej.optim`` call that means the same."""
    if isinstance(optimizer, type):
        raise EinjoinError(f"Trainer: optimizer= takes an optimizer instance, got the class "
                           f"{optimizer.__name__}: pass e.g. ej.optim.{optimizer.__name__}(lr=3e-4)")
    if callable(getattr(optimizer, "update", None)):
        return
    groups = getattr(optimizer, "param_groups", None)
    name = type(optimizer).__name__
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        # a torch optimizer holds the module's tensors and steps them in place: einjoin keeps its
        # own copies on the devices, so it needs its own optimizer with the same hyperparameters
        keys = {"SGD": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
                "AdamW": ("lr", "betas", "eps", "weight_decay")}.get(name)
        same = "" if keys is None else ", ".join(f"{k}={groups[0][k]!r}" for k in keys if k in groups[0])
        hint = (f"pass ej.optim.{name}({same}) (the same hyperparameters)" if keys is not None else
                "pass ej.optim.AdamW(...) or ej.optim.SGD(...) (the optimizers einjoin runs as EinSums)")
        raise EinjoinError(f"Trainer: optimizer= is a torch optimizer ({name}); einjoin updates the "
                           f"parameters on its devices with its own: {hint}")
    raise EinjoinError(f"Trainer: optimizer= must be an ej.optim optimizer (ej.optim.AdamW(lr=...), "
                       f"ej.optim.SGD(lr=...)), got {name} {optimizer!r:.60}")


def _loss(out: Any, prog: Program, what: str) -> float:
    """The loss a run returned, as a float."""
    if out is None:
        raise EinjoinError(f"Trainer.{what}: the {prog.backend.name!r} backend computes nothing (it schedules "
                           f"and counts only), so there is no loss; use 'threads' or 'ray'")
    return float(out[0] if isinstance(out, (tuple, list)) else out)


class Keys(NamedTuple):
    """What :meth:`Trainer.load_state_dict` did not match (torch's ``_IncompatibleKeys``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class _StepProgram:
    """One compiled program for one batch shape: ``batch`` names the batch's graph inputs in
    order (None: not read), ``state`` the program's state inputs (kept resident on the devices
    between runs; for an evaluation program, the parameters it is fed)."""

    prog: Program
    batch: tuple[str | None, ...]
    state: tuple[str, ...]
    fixed: tuple[str, ...]          # buffers, frozen parameters, constants: state that maps to itself
    hyper: dict[str, str] = field(default_factory=dict)  # hyper key -> input name
    seeded: bool = False            # reads dropout_seed
    apply: bool = False             # reads accumulate_apply
    version: int = -1               # an evaluation's: the Trainer.version its parameters are from
    guard: Any = None               # the module's settings the capture read (its mode aside)


# ---------------------------------------------------------------- the trainer


_M = TypeVar("_M", bound=Callable[..., Any])


def _settings_guard(fn: TorchFunction) -> Any:
    """The capture's module guard without the modes (the trainer sets them for its captures)."""
    return fn.guard.without({"training"}) if fn.guard is not None else None


def _check_guard(sp: _StepProgram, what: str) -> None:
    """A setting the capture read (a dropout's ``p``, ``m.scale``) changed since: torch's next
    step would compute with the new value, the program with the old one. Refused, naming it."""
    if sp.guard is None:
        return
    try:
        sp.guard.check()
    except EinjoinError as e:
        msg = str(e).split("; ")[0].replace("the module's module.", "the module's ")
        raise EinjoinError(f"Trainer.{what}: {msg}; the step was captured for the old value: set it "
                           f"back, or continue in a new trainer (trainer.save(path), then "
                           f"ej.Trainer.load(path, module, ...) keeps the optimizer state)") from None


def _serialised(method: _M) -> _M:
    """``method`` under the trainer's lock: a step, an evaluation, a state dict, a load or a save
    from another thread waits for the one in progress (an evaluation racing a step read the state
    while the step replaced it: a raw KeyError, or an evaluation program marked current with the
    parameters before the step)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(_M, run)


class Trainer:
    """Train ``module`` on batches ``(*module_args, target)`` with ``loss_fn(module(*args),
    target)`` and ``optimizer`` (default ``ej.optim.AdamW(lr=3e-4)``) on ``devices`` (an int or
    an :class:`ej.Cluster`), planned by ``planner`` and run by ``backend``; ``memory`` caps each
    device (``ej.compile``'s ``memory_limit``). ``leave_idle``: on local devices without caps,
    each step is planned on only as many of them as pay (``ej.compile``'s ``leave_idle``; the
    parameters and optimizer state live on those, ``trainer.program.explain()`` names the idle
    ones); off by default: every device given is used (a one-device step's BLAS threads wait for
    each other on cores that other processes keep busy: a small LLaMA step took ~1 s against
    0.12 s on two single-threaded lanes). ``example_batch`` fixes the first
    program's shapes and the batch's dtypes. The module itself is not changed: read the trained
    weights with :meth:`state_dict`. See the module docstring for the semantics and an example."""

    def __init__(self, module: Any, example_batch: Sequence[Any], loss_fn: Callable[..., Any],
                 optimizer: Any = None, devices: Any = 4, memory: Any = None, planner: Any = "auto",
                 backend: Any = "threads", *, accumulate: int = 1, seed: int = 0, quiet: bool = True,
                 leave_idle: bool = False):
        import torch
        if not isinstance(module, torch.nn.Module):
            raise EinjoinError(f"Trainer: expected a torch.nn.Module, got {type(module).__name__}")
        if not callable(loss_fn):
            raise EinjoinError(f"Trainer: loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(example_batch, (tuple, list)) or len(example_batch) < 2:
            raise EinjoinError("Trainer: example_batch must be a tuple (*module_args, target) with at least "
                               "one module argument and the target")
        if isinstance(accumulate, (bool, np.bool_)) or not isinstance(accumulate, (int, np.integer)) \
                or accumulate < 1:
            raise EinjoinError(f"Trainer: accumulate must be an int >= 1, got {accumulate!r:.40}")
        if not -2 ** 63 <= check_seed(seed, "Trainer: seed") < 2 ** 64:
            raise EinjoinError(f"Trainer: seed must be an int in [-2**63, 2**64) as torch.manual_seed's, "
                               f"got {seed!r:.40}")
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        if not trainable:
            raise EinjoinError(f"Trainer: {type(module).__name__} has no trainable parameters (none with "
                               f"requires_grad=True): nothing to train")
        if optimizer is None:
            from einjoin.train import optim
            optimizer = optim.AdamW(lr=3e-4)
        _check_optimizer(optimizer)
        self.module = module
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.accumulate = int(accumulate)
        self.seed = int(seed)
        self.steps = 0          # optimizer updates taken
        self.version = 0        # bumped whenever the parameters or buffers change
        self._lock = threading.RLock()  # step / evaluate / state dicts / save from several threads
        self.micro_steps = 0    # step() calls (micro-batches)
        self._lr = float(getattr(optimizer, "lr", 0.0))
        if not isinstance(leave_idle, (bool, np.bool_)):
            raise EinjoinError(f"Trainer: leave_idle must be True or False, got {leave_idle!r:.40}")
        # leave_idle: a small model's step on only as many local devices as pay (ej.compile's
        # leave_idle; the state lives on those). Off by default, as ej.compile's: the one-device
        # plan of the small LLaMA's step was no faster on a quiet 2-core box (session 40, alternating
        # fresh processes: 33.3 / 46.3 / 34.6 ms against 31.7 / 31.1 / 34.8 on both lanes) at 1.3x
        # the CPU, and its two BLAS threads collapse when another process takes a core (~1 s a step
        # against 0.12 s on two lanes); the devices given are the devices used
        self._options = dict(devices=devices, memory_limit=memory, planner=planner, backend=backend, quiet=quiet,
                             leave_idle=bool(leave_idle))
        self._wrapper = _with_loss(module, loss_fn)
        self._trainable = tuple(trainable)
        example = tuple(_as_torch(x, f"Trainer: example_batch[{i}]") for i, x in enumerate(example_batch))
        self._dtypes = tuple(torch_dtype(x.dtype) for x in example)
        self._programs: ShapeCache[_StepProgram] = ShapeCache(None)  # per batch shape; the first: the example's
        self._evals: ShapeCache[_StepProgram] = ShapeCache(None)
        self._owner: _StepProgram | None = None   # the program whose resident state is current
        self._host: dict[str, np.ndarray] = {}    # state values on the host, where current
        self._fixed: dict[str, np.ndarray] = {}   # buffers, frozen parameters, constants
        # buffers the training-mode forward writes (BatchNorm's running statistics): state of the
        # step program (new value: buffer input), by input name, with their first values
        self._moving: dict[str, np.ndarray] = {}
        first = self._compile(example, key=self._key(example))
        self._init_state(first)
        self._keys = self._state_dict_keys()

    # ---- names

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The trained parameters, as ``module.named_parameters()`` names them (tied ones once)."""
        return self._trainable

    @property
    def program(self) -> Program:
        """The training step's compiled program for the example batch's shapes (its ``stats``,
        ``run_stats``, ``explain()``)."""
        return next(iter(self._programs.values())).prog

    @property
    def lr(self) -> float:
        """The learning rate of the next update: an input of the step, so setting it (a schedule)
        never replans."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = check_lr(value)  # the optimizers' rule: refused here, not at the next step()

    # ---- building one program

    def _key(self, batch: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple((tuple(x.shape), torch_dtype(x.dtype)) for x in batch)

    def _capture(self, batch: tuple[Any, ...], training: bool) -> tuple[TorchFunction, Tensor]:
        was = self.module.training
        self.module.train(training)
        try:
            fn = from_torch(self._wrapper, batch)
        finally:
            self.module.train(was)
        if len(fn.outputs) != 1 or fn.many:
            raise EinjoinError(f"Trainer: loss_fn returned {len(fn.outputs)} tensors; it must return one "
                               f"scalar loss")
        loss = fn.outputs[0]
        if loss.node.size != 1 or loss.shape != ():
            raise ShapeError(f"Trainer: the loss must be a scalar, but loss_fn returned shape {loss.shape} "
                             f"(reduce it, e.g. reduction='mean')")
        if not loss.dtype.startswith(("float", "bfloat")):
            raise DTypeError(f"Trainer: the loss is {loss.dtype}; it must be a float scalar")
        return fn, loss

    def _fixed_inputs(self, fn: TorchFunction, used: Mapping[str, Any]) -> tuple[str, ...]:
        """Bound tensors that are not trained (buffers, frozen parameters, constants): fed by
        name from :attr:`_fixed`, filled from the first capture that meets them."""
        trained = {PREFIX + n for n in self._trainable}
        out: list[str] = []
        for name, value in fn.bound.items():
            if name in trained or name in self._moving or name == DROPOUT_SEED or name not in used:
                continue
            if is_sparse_format(value):  # a sparse buffer (a GNN's adjacency): its values and keys inputs
                inputs = sparse_inputs(name, value, used)
                if name not in self._fixed:
                    self._fixed.update(inputs)
                out.extend(inputs)
                continue
            if name not in self._fixed:
                # a tensor only this capture reads (the eval-mode forward's): its value is the one
                # a load_state_dict gave, if any, else the module's
                kept = getattr(self, "_kept", {}).get(name.removeprefix(PREFIX))  # none before the keys
                if kept is not None:
                    from einjoin.ir.reference import to_numpy
                    value = to_numpy(kept.contiguous(), name)
                self._fixed[name] = np.array(value, copy=True)
            out.append(name)
        return tuple(out)

    def _compile(self, batch: tuple[Any, ...], key: tuple[Any, ...]) -> _StepProgram:
        fn, loss = self._capture(batch, training=True)
        reached = Graph([loss]).input_by_name
        if not self._programs:
            # torch leaves a parameter the loss never reads alone (its .grad stays None, the
            # optimizer skips it, no weight decay): so does the trainer, keeping it as it is
            unread = [n for n in self._trainable if PREFIX + n not in reached]
            if unread:
                log.info("Trainer: the loss never reads %s; left as it is, as torch.optim leaves a "
                         "parameter without a gradient", ", ".join(unread))
                self._trainable = tuple(n for n in self._trainable if n not in unread)
            if not self._trainable:
                raise EinjoinError(f"Trainer: the loss reads none of {type(self.module).__name__}'s trainable "
                                   f"parameters ({', '.join(unread)}): nothing to train")
        missing = [n for n in self._trainable if PREFIX + n not in reached]
        if missing:
            raise EinjoinError(f"Trainer: for batch shapes {[list(s) for s, _ in key]} the loss does not read "
                               f"the parameter(s) {', '.join(missing)}, which the first batch trained")
        params = {n: fn.parameters[PREFIX + n] for n in self._trainable}
        grads = dict(zip(params, grad(loss, list(params.values()))))
        new_of: dict[str, Tensor] = {}   # state input name -> its new value
        old_of: dict[str, Tensor] = {}   # state input name -> the input itself
        hyper: dict[str, str] = {}
        apply = None
        if self.accumulate > 1:
            # sum the micro-batches' gradients in a state buffer; the k-th call updates with their
            # mean and empties the buffer; otherwise parameters and optimizer state pass unchanged
            apply = F.input(APPLY, (), "bool")
            acc_new = {}
            for n, p in params.items():
                acc = F.input(f"grad_acc.{n}", p.shape, p.dtype)
                acc_new[n] = acc + grads[n]
                old_of[_input_name(acc)] = acc
                new_of[_input_name(acc)] = F.where(apply, 0.0, acc_new[n])
            grads = {n: a / float(self.accumulate) for n, a in acc_new.items()}
        upd = self.optimizer.update(params, grads)
        for n, p in params.items():
            old_of[_input_name(p)] = p
            new_of[_input_name(p)] = upd.params[n] if apply is None else F.where(apply, upd.params[n], p)
        for k, old in upd.state_in.items():
            new = upd.state_out[k]
            old_of[_input_name(old)] = old
            new_of[_input_name(old)] = new if apply is None else F.where(apply, new, old)
        for k, h in upd.hyper.items():
            hyper[k] = _input_name(h)
        self._buffer_updates(fn, new_of, old_of, first=not self._programs)
        self._update = upd
        names = tuple(new_of)
        log.info("Trainer: compiling the training step for batch shapes %s (%d program(s) cached before)",
                 [list(s) for s, _ in key], len(self._programs))
        used = Graph([loss, *new_of.values()]).input_by_name
        fixed = self._fixed_inputs(fn, used)
        state = {new_of[n]: old_of[n] for n in names}
        for n in fixed:  # buffers are state that a step leaves as it is: loaded once, then resident
            t = Tensor(used[n])
            state[t] = t
        # deterministic: partials meet in a fixed order, so a resumed run is bit-identical
        prog = ej_compile([loss], state=state, deterministic=True, **self._options)
        sp = _StepProgram(prog, tuple(a if a in used else None for a in fn.arg_names), names, fixed,
                          {k: v for k, v in hyper.items() if v in used}, DROPOUT_SEED in used,
                          APPLY in used, guard=_settings_guard(fn))
        self._programs[key] = sp
        return sp

    def _buffer_updates(self, fn: TorchFunction, new_of: dict[str, Tensor], old_of: dict[str, Tensor],
                        first: bool) -> None:
        """The buffers the forward writes (``fn.buffer_updates``: a training-mode BatchNorm's
        running_mean, running_var, num_batches_tracked) as state of the step: each step leaves
        the value torch's forward leaves, on every micro-batch (torch updates them at each
        forward, whatever the optimizer does). The first capture says which buffers move."""
        updates = dict(getattr(fn, "buffer_updates", {}) or {})
        reads = Graph(list(updates.values())).input_by_name if updates else {}
        for name, new in updates.items():
            if name in reads:
                old = Tensor(reads[name])
            elif name in fn.buffers:  # overwritten without being read: its input is still the state's
                old = fn.buffers[name]
            else:  # pragma: no cover - from_torch names buffers it binds
                continue
            if first:
                self._moving[name] = np.array(fn.bound[name], copy=True)
            elif name not in self._moving:
                raise EinjoinError(f"Trainer: for this batch shape the forward writes buffer "
                                   f"{name.removeprefix(PREFIX)!r}, which the first batch's did not")
            old_of[name], new_of[name] = old, new

    def _compile_eval(self, batch: tuple[Any, ...], key: tuple[Any, ...]) -> _StepProgram:
        fn, loss = self._capture(batch, training=False)
        log.info("Trainer: compiling the evaluation for batch shapes %s", [list(s) for s, _ in key])
        used = Graph([loss]).input_by_name
        params = tuple(PREFIX + n for n in self._trainable if PREFIX + n in used)
        params += tuple(n for n in self._moving if n in used)  # running statistics as trained so far
        fixed = self._fixed_inputs(fn, used)
        # the parameters and buffers as state that the evaluation leaves as it is: written when
        # the training has changed them, resident across evaluations in between
        kept = [Tensor(used[n]) for n in (*params, *fixed)]
        prog = ej_compile([loss], state={t: t for t in kept}, deterministic=True, **self._options)
        sp = _StepProgram(prog, tuple(a if a in used else None for a in fn.arg_names), params, fixed,
                          seeded=DROPOUT_SEED in used, guard=_settings_guard(fn))
        self._evals[key] = sp
        return sp

    def _init_state(self, sp: _StepProgram) -> None:
        """The state's first values: the module's parameters, the optimizer's initial state
        (``init_state``, as torch starts), empty gradient sums."""
        from einjoin.ir.reference import to_numpy  # bfloat16 too (numpy has no such dtype)
        named = dict(self.module.named_parameters())
        params = {n: np.array(to_numpy(named[n].detach().cpu().contiguous(), n), copy=True)
                  for n in self._trainable}
        host = {PREFIX + n: a for n, a in params.items()}
        init = _method(self._update, self.optimizer, "init_state")(params)
        for k, old in self._update.state_in.items():
            host[_input_name(old)] = np.asarray(init[k] if k in init else init[_input_name(old)])
        for n in sp.state:
            if n.startswith("grad_acc."):
                host[n] = np.zeros_like(params[n.removeprefix("grad_acc.")])
        host.update({n: v.copy() for n, v in self._moving.items()})
        missing = [n for n in sp.state if n not in host]
        if missing:  # pragma: no cover - an optimizer breaking its own interface
            raise EinjoinError(f"Trainer: no initial value for state {', '.join(missing)}")
        self._host = host

    # ---- state: where the current values are

    def _current(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Current state values by input name (all, or ``names``), read back from the owning
        program's devices where they are not on the host yet."""
        want = list(self._state_names() if names is None else names)
        stale = [n for n in want if n not in self._host]
        if stale:
            if self._owner is None:  # pragma: no cover - invariant: values are on the host or there
                raise EinjoinError(f"Trainer: state {stale[0]!r} has no current value")
            self._host.update({k: np.asarray(v) for k, v in self._owner.prog.read_state(stale).items()})
        return {n: self._host[n] for n in want}

    def _state_names(self) -> tuple[str, ...]:
        return next(iter(self._programs.values())).state

    def _take(self, sp: _StepProgram) -> None:
        """Make ``sp`` hold the current state (its devices keep it between runs)."""
        if self._owner is sp:
            return
        self._write(sp)
        self._owner = sp

    def _write(self, sp: _StepProgram) -> None:
        """Write the current state and fixed inputs (buffers, frozen parameters) into ``sp``."""
        sp.prog.write_state({**self._current(sp.state), **{n: self._fixed[n] for n in sp.fixed}})

    # ---- checking a batch

    def _check(self, batch: tuple[Any, ...], what: str) -> tuple[Any, ...]:
        if len(batch) != len(self._dtypes):
            raise EinjoinError(f"Trainer.{what}: the batch has {len(batch)} tensor(s) but the example batch "
                               f"had {len(self._dtypes)} (*module_args, target)")
        out = tuple(_as_torch(x, f"Trainer.{what}: batch[{i}]") for i, x in enumerate(batch))
        for i, (x, want) in enumerate(zip(out, self._dtypes)):
            got = torch_dtype(x.dtype)
            if got != want:
                which = "the target" if i == len(out) - 1 else f"module argument {i}"
                raise DTypeError(f"Trainer.{what}: {which} is {got} but the example batch's was {want}")
        return out

    def _feeds(self, sp: _StepProgram, batch: tuple[Any, ...]) -> dict[str, Any]:
        feeds: dict[str, Any] = {n: x for n, x in zip(sp.batch, batch) if n is not None}
        if sp.hyper:
            values = _method(self._update, self.optimizer, "hyper_values")(lr=self._lr)
            feeds.update({name: values[k] for k, name in sp.hyper.items()})
        if sp.seeded:  # a new dropout mask each micro-batch, reproducible from (seed, step)
            # wrapped into int64 as torch wraps a seed (-1 is 2**64 - 1); small seeds feed as before
            mixed = (self.seed * 1_000_003 + self.micro_steps + 2 ** 63) % 2 ** 64 - 2 ** 63
            feeds[DROPOUT_SEED] = np.asarray(mixed, np.int64)
        if sp.apply:
            feeds[APPLY] = np.asarray((self.micro_steps + 1) % self.accumulate == 0)
        return feeds

    # ---- training and evaluation

    @_serialised
    def step(self, *batch: Any) -> float:
        """One training step on ``batch`` = ``(*module_args, target)``; returns the loss."""
        batch = self._check(batch, "step")
        key = self._key(batch)
        sp = self._programs.get(key) or self._compile(batch, key)
        _check_guard(sp, "step")
        feeds = self._feeds(sp, batch)
        self._take(sp)
        loss = _loss(sp.prog.run(**feeds), sp.prog, "step")
        self._host = {}  # the new values stay on the devices
        self.version += 1
        self.micro_steps += 1
        if self.micro_steps % self.accumulate == 0:
            self.steps += 1
        return loss

    @_serialised
    def evaluate(self, *batch: Any) -> float:
        """The loss on ``batch`` with the current parameters, the module in eval mode (no
        dropout); no gradient, no update. Its own program (one per batch shape) holds the
        parameters as state: the first evaluation after a step (or a load) costs the parameters'
        bytes twice (read back from the training program's devices to the host, loaded into the
        evaluation's), later ones until the next step only the batch."""
        batch = self._check(batch, "evaluate")
        key = self._key(batch)
        sp = self._evals.get(key) or self._compile_eval(batch, key)
        _check_guard(sp, "evaluate")
        if sp.version != self.version:
            self._write(sp)
            sp.version = self.version
        return _loss(sp.prog.run(**self._feeds(sp, batch)), sp.prog, "evaluate")

    # ---- torch state dicts

    def _state_dict_keys(self) -> dict[str, tuple[str, Any]]:
        """``module.state_dict()`` key -> (where its value lives: a state input name, a fixed
        input name, or '' for a value kept as given), and the module's tensor (dtype, shape)."""
        canon = _canonical_names(self.module)  # a tied weight's names -> the one it is trained under
        trained = set(self._trainable)
        self._kept: dict[str, Any] = {}
        out: dict[str, tuple[str, Any]] = {}
        for key, t in self.module.state_dict().items():
            name = canon.get(key, key)
            if name in trained:
                out[key] = (PREFIX + name, t)
            elif (PREFIX + name in self._fixed or PREFIX + name in self._moving) and not is_sparse_format(t):
                out[key] = (PREFIX + name, t)
            else:  # a buffer the loss never reads, or a sparse one (never trained): kept as it was
                self._kept[key] = t.detach().clone()
                out[key] = ("", t)
        return out

    @_serialised
    def state_dict(self) -> dict[str, Any]:
        """The module's state dict with the trained values: every key of
        ``module.state_dict()`` (buffers included, tied weights under each name), the same
        shapes and dtypes, as torch tensors (copies), so ``module.load_state_dict(sd,
        strict=True)`` works."""
        import torch
        names = [n for n, _ in self._keys.values() if n and n not in self._fixed]
        values = {**self._current(sorted(set(names))), **self._fixed}
        out = {}
        for key, (name, t) in self._keys.items():
            if not name:
                out[key] = self._kept[key].clone()
                continue
            a = np.asarray(values[name], order="C")
            if t.dtype == torch.bfloat16:
                out[key] = torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
            else:
                out[key] = torch.from_numpy(a.copy()).to(t.dtype)
        return out

    @_serialised
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Keys:
        """Set parameters and buffers from a state dict named like ``module.state_dict()``, as
        ``module.load_state_dict`` does: with ``strict`` the keys must be exactly the module's
        (else an EinjoinError naming the missing and unexpected ones), without it the keys given
        are loaded and the rest kept; shapes must match; values are converted to the module's
        dtypes (a float64 checkpoint into a float32 model). The optimizer state is kept. Returns
        ``(missing_keys, unexpected_keys)``."""
        import torch
        from einjoin.ir.reference import to_numpy
        if not isinstance(state_dict, Mapping):  # a list of pairs would read as keys
            raise EinjoinError(f"Trainer.load_state_dict: expected a mapping of key -> tensor, got "
                               f"{type(state_dict).__name__}")
        missing = sorted(set(self._keys) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._keys), key=repr)  # keys of any type
        if strict and (missing or unexpected):
            raise EinjoinError("Trainer.load_state_dict: keys do not match the module's state dict"
                               + (f"; missing: {', '.join(missing)}" if missing else "")
                               + (f"; unexpected: {', '.join(map(str, unexpected))}" if unexpected else ""))
        current = self._current()
        kept: dict[str, Any] = {}
        fixed: dict[str, np.ndarray] = {}
        for key, (name, t) in self._keys.items():
            if key not in state_dict:
                continue
            v = state_dict[key]
            if is_sparse_format(t):  # a sparse buffer (a GNN's adjacency): never trained, fed as its inputs
                fixed.update(self._sparse_buffer(key, t, v))
                kept[key] = v.detach().clone()
                continue
            try:  # str, None, object arrays, meta or sparse tensors: named, not a raw torch error
                v = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
                if v.is_meta or v.layout != torch.strided:
                    raise TypeError(f"a {'meta' if v.is_meta else str(v.layout)} tensor holds no dense values")
            except (TypeError, ValueError, RuntimeError) as e:
                raise EinjoinError(f"Trainer.load_state_dict: {key!r} is not a dense numeric tensor "
                                   f"({type(state_dict[key]).__name__}: {e})") from e
            if tuple(v.shape) != tuple(t.shape):
                raise ShapeError(f"Trainer.load_state_dict: {key!r} has shape {tuple(v.shape)}, the module's "
                                 f"has {tuple(t.shape)}")
            v = v.detach().to(device="cpu", dtype=t.dtype)  # torch's copy_ converts the dtype too
            arr = np.array(to_numpy(v.contiguous(), key), copy=True)
            if not name:
                kept[key] = v.clone()
                if PREFIX + key in self._fixed:  # read by the evaluation program only
                    fixed[PREFIX + key] = arr
                continue
            if name in self._fixed:
                fixed[name] = arr
            else:
                current[name] = arr
        self._kept.update(kept)  # only now: a refused value leaves every key as it was
        self._fixed.update(fixed)
        self._host = current
        self._owner = None  # the next run writes the state to its program
        self.version += 1
        return Keys(missing, unexpected)

    def _sparse_buffer(self, key: str, t: Any, v: Any) -> dict[str, np.ndarray]:
        """The arrays of the sparse buffer ``key``'s inputs (values, keys) for ``v``, a sparse tensor
        of the module's buffer's shape (fitting the capacity the import gave it)."""
        if not is_sparse_format(v) or tuple(v.shape) != tuple(t.shape):
            raise ShapeError(f"Trainer.load_state_dict: {key!r} is the module's sparse buffer of shape "
                             f"{tuple(t.shape)}; got {type(v).__name__} of shape {tuple(getattr(v, 'shape', ()))}")
        if PREFIX + key not in self._fixed:  # no program reads it
            return {}
        inputs = {n: x for sp in (*self._programs.values(), *self._evals.values())
                  for n, x in sp.prog.graph.input_by_name.items()}
        return sparse_inputs(PREFIX + key, v, inputs)

    # ---- safetensors (einjoin/trainer_io.py)

    @_serialised
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the parameters, the optimizer state (moments, step count, gradient sums of an
        unfinished accumulation), the buffers, the step counters, the learning rate and the
        optimizer's hyperparameters to a safetensors file; :meth:`load` resumes from it
        bit-identically."""
        save_trainer(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], module: Any, example_batch: Sequence[Any],
             loss_fn: Callable[..., Any], optimizer: Any = None, **options: Any) -> Trainer:
        """A trainer for ``module`` (built as for the saved run) that continues the run saved by
        :meth:`save` at ``path``. ``optimizer`` defaults to the saved one (class and
        hyperparameters); ``options`` are the constructor's (``devices``, ``accumulate``, ...).
        Another ``accumulate`` than the saved run's continues from an accumulation boundary."""
        return load_trainer(cls, path, module, example_batch, loss_fn, optimizer, **options)

    def __repr__(self) -> str:
        return (f"Trainer({type(self.module).__name__}, {len(self._trainable)} parameters, "
                f"{type(self.optimizer).__name__}, step {self.steps}, {len(self._programs)} program(s))")
