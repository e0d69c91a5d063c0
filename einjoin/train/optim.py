"""Optimizer steps as EinSums (``ej.optim``): :class:`SGD`, :class:`AdamW` and
:func:`clip_grad_norm`, with torch.optim's formulas (its single-tensor CPU path).

An optimizer builds no state of its own: ``opt.update(params, grads)`` returns an :class:`Update`
whose new parameters and new optimizer state are elementwise EinSum nodes over (parameter,
gradient, state), so they are decomposed and placed like any tensor (sharding the moments
across devices, ZeRO-style, is one plan among others). The optimizer state (moments, momentum
buffers, the step count) are graph *inputs* whose new values are outputs of the same graph, and
the learning rate is a scalar input: a schedule changes a number fed at run time, never the
graph. Bias corrections are computed in the graph from the step count (float64).

Input names: an update's learning rate is the input ``"lr.<its first parameter>"``, so two
optimizers in one graph (torch's parameter groups: say, no weight decay on biases) each keep
their own; the step count ``"step"`` is one input for all (every group steps together); the
state is per parameter (``"exp_avg.<param>"``, ...). A state or learning-rate input that would
be the very node of a parameter or of an input the gradients read (same name, shape and dtype:
hash-consed into one) is refused, naming it. Feed ``init_state()`` and ``hyper_values()`` by
name: they use the same names.

>>> import numpy as np, einjoin as ej
>>> w = ej.param("w", (3,), "float64")
>>> loss = (w * w).sum()
>>> opt = ej.optim.SGD(lr=0.1)
>>> up = opt.update({"w": w}, dict(zip(["w"], ej.grad(loss, [w]))))
>>> sorted(up.state_in), sorted(up.hyper)
(['step'], ['lr.w'])
>>> feeds = {"w": np.array([1.0, 2.0, 3.0]), **up.init_state({"w": np.zeros(3)}), **up.hyper_values()}
>>> w1, step1 = ej.reference([up.params["w"], up.state_out["step"]], **feeds)   # w - 0.1 * 2w
>>> w1, float(step1)
(array([0.8, 1.6, 2.4]), 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor, elementwise
from einjoin.ir.dtypes import kind, numpy_dtype, promote
from einjoin.ir.graph import Graph
from einjoin.ir.scalar import parse_join

__all__ = ["Update", "Optimizer", "SGD", "AdamW", "clip_grad_norm"]

STEP = "step"
LR = "lr"


@dataclass(frozen=True)
class Update:
    """One optimizer step as a graph. ``params``: the new parameter values (same names as given);
    ``state_in``: the optimizer-state graph inputs it created (``"exp_avg.<param>"``,
    ``"exp_avg_sq.<param>"``, ``"momentum_buffer.<param>"``, ``"step"``), and ``state_out`` their
    new values (same keys); ``hyper``: the per-step scalar inputs (the learning rate
    ``"lr.<first parameter>"``, float64: one per update, so two optimizers in one graph keep
    their own). Every key is its graph input's name. Feed
    ``init_state(...)`` for the first step and ``hyper_values(lr)`` at every step; feed each
    ``state_out`` back as its ``state_in`` at the next."""

    params: dict[str, Tensor]
    state_in: dict[str, Tensor]
    state_out: dict[str, Tensor]
    hyper: dict[str, Tensor]
    lr: float = field(default=0.0)

    def init_state(self, params: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """The state before the first step, by graph-input name, as torch starts it: zeros and a
        step count of 0 (a momentum buffer's first value is the first gradient: the graph
        takes it when the step count is 0). ``params`` (name -> array), when given, is checked
        against the parameters of this update.

        >>> import einjoin as ej
        >>> w = ej.param("w", (2,))
        >>> up = ej.optim.AdamW(lr=1e-3).update({"w": w}, {"w": w * 2})
        >>> {k: (v.dtype.name, v.shape) for k, v in sorted(up.init_state().items())}
        {'exp_avg.w': ('float32', (2,)), 'exp_avg_sq.w': ('float32', (2,)), 'step': ('float64', ())}
        """
        if params is not None:
            if not isinstance(params, Mapping):
                raise EinjoinError(f"init_state: params must be a mapping name -> array, got "
                                   f"{type(params).__name__}")
            for name, value in params.items():
                if name not in self.params:
                    raise EinjoinError(f"init_state: {name!r} is not a parameter of this update "
                                       f"(its parameters: {sorted(self.params)})")
                shape = tuple(np.shape(value))
                if shape != self.params[name].shape:
                    raise ShapeError(f"init_state: parameter {name!r} has shape {shape}, the update "
                                     f"was built for {self.params[name].shape}")
        return {name: np.zeros(t.shape, numpy_dtype(t.dtype)) for name, t in self.state_in.items()}

    def hyper_values(self, lr: float | None = None) -> dict[str, np.ndarray]:
        """The per-step scalar inputs by name: the learning rate (the optimizer's ``lr`` unless
        given), float64.

        >>> import einjoin as ej
        >>> w = ej.param("w", (2,))
        >>> ej.optim.SGD(lr=0.5).update({"w": w}, {"w": w}).hyper_values(0.25)
        {'lr.w': array(0.25)}
        """
        value = self.lr if lr is None else check_lr(lr)
        return {name: np.asarray(value, np.float64) for name in self.hyper}


def _number(v: Any, what: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise EinjoinError(f"{what} must be a number, got {type(v).__name__} {v!r:.60}")
    f = float(v)
    if math.isnan(f):
        raise EinjoinError(f"{what} must not be nan")
    return f


def check_lr(lr: Any) -> float:
    """A learning rate: a number >= 0 and finite (numpy numbers too), as a float."""
    f = _number(lr, "lr")
    if not 0.0 <= f < math.inf:
        raise EinjoinError(f"Invalid learning rate: lr={lr!r} (must be >= 0 and finite)")
    return f


def _non_negative(v: Any, what: str) -> float:
    f = _number(v, what)
    if f < 0.0:
        raise EinjoinError(f"Invalid {what} value: {what}={v!r} (must be >= 0)")
    return f


def _checked(params: Any, grads: Any) -> list[tuple[str, Tensor, Tensor]]:
    """(name, param, grad) for each parameter, the grad cast to the parameter's dtype; a missing,
    extra or misshapen gradient is an error naming it."""
    for what, d in (("params", params), ("grads", grads)):
        if not isinstance(d, Mapping):
            raise EinjoinError(f"update: {what} must be a dict name -> einjoin tensor, got "
                               f"{type(d).__name__}")
    if not params:
        raise EinjoinError("update: got an empty parameter dict")
    extra = sorted(set(grads) - set(params))
    if extra:
        raise EinjoinError(f"update: gradients {extra} name no parameter (parameters: {sorted(params)})")
    out = []
    for name, p in params.items():
        if not isinstance(name, str) or not name:
            raise EinjoinError(f"update: parameter names must be non-empty strings, got {name!r}")
        if not isinstance(p, Tensor):
            raise EinjoinError(f"update: parameter {name!r} is {type(p).__name__}, not an einjoin tensor")
        if kind(p.dtype) != "float":
            raise DTypeError(f"update: parameter {name!r} is {p.dtype}; only float parameters are trained")
        if name not in grads:
            raise EinjoinError(f"update: no gradient for parameter {name!r} (grads has {sorted(grads)})")
        g = grads[name]
        if not isinstance(g, Tensor):
            raise EinjoinError(f"update: the gradient of {name!r} is {type(g).__name__}, not an einjoin tensor")
        if g.shape != p.shape:
            raise ShapeError(f"update: the gradient of {name!r} has shape {g.shape}, the parameter "
                             f"{p.shape}")
        if kind(g.dtype) != "float":
            raise DTypeError(f"update: the gradient of {name!r} is {g.dtype}; it must be a float tensor")
        out.append((name, p, g if g.dtype == p.dtype else g.to(p.dtype)))
    return out


def _made(items: list[tuple[str, Tensor, Tensor]], grads: Mapping[str, Tensor], new_params: dict[str, Tensor],
          state_in: dict[str, Tensor], state_out: dict[str, Tensor], lr_in: Tensor, lr: float) -> Update:
    """The :class:`Update`, once no input it created is a node the caller's graph already has.

    Inputs are hash-consed by (name, shape, dtype): a parameter named like another's state
    (``"exp_avg.w"`` next to ``"w"``) would silently BE that state input, and its moment would
    start at the parameter's value. Such a name is refused. (A same-named input of another shape
    is a distinct node: the graph refuses the two names when it is built.)"""
    made = {**state_in, _input_name(lr_in): lr_in}
    try:
        seen = Graph([*(p for _, p, _ in items), *(g for g in grads.values() if isinstance(g, Tensor))]
                     ).input_by_name
    except EinjoinError:  # two inputs of one name already: the caller's graph reports it
        seen = {}
    owner = {f"{kind_}.{name}": name for name, _, _ in items
             for kind_ in ("exp_avg", "exp_avg_sq", "momentum_buffer")}
    for name, t in made.items():
        if seen.get(name) is t.node:
            whose = f" (the state of parameter {owner[name]!r})" if name in owner else ""
            raise EinjoinError(f"update: the optimizer input {name!r}{whose} has the name, shape and dtype "
                               f"of an input the parameters or gradients already use, so the two would be "
                               f"one graph input; rename that parameter or input")
    return Update(new_params, state_in, state_out, {_input_name(lr_in): lr_in}, lr)


def _input_name(t: Tensor) -> str:
    return str(getattr(t.node.op, "name", ""))  # an Input (the optimizer made it)


def _ew(expr: str, *args: Tensor, name: str) -> Tensor:
    """One elementwise EinSum node computing ``expr`` over ``x0, x1, ...`` (numpy broadcasting)."""
    return elementwise(parse_join(expr, len(args)), *args, name=name)


class _Casts:
    """A float64 scalar in each parameter dtype, cast once (a float32 parameter sees the
    hyperparameter rounded to float32, as torch's kernels do with a Python scalar)."""

    def __init__(self, value: Tensor) -> None:
        self.value = value
        self.by_dtype: dict[str, Tensor] = {"float64": value}

    def __call__(self, dtype: str) -> Tensor:
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = self.value.to(dtype)
        return self.by_dtype[dtype]


class Optimizer:
    """The optimizers' shared part: the learning rate and the scalar inputs ``lr.<first
    parameter>`` and ``step``."""

    lr: float

    def _scalars(self, first: str) -> tuple[Tensor, Tensor, Tensor]:
        """(lr input, step input, step + 1): float64 scalars. The learning rate is named after
        the update's first parameter (one per update: two optimizers in one graph must not share
        it); the step count is shared (every update in a graph steps together)."""
        lr = F.input(f"{LR}.{first}", (), "float64")
        step = F.input(STEP, (), "float64")
        return lr, step, step + 1.0

    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor]) -> Update:
        raise NotImplementedError


class SGD(Optimizer):
    """torch.optim.SGD: ``g += weight_decay * p``; with momentum, ``buf = g`` at the first step,
    then ``buf = momentum * buf + (1 - dampening) * g``, and ``g = g + momentum * buf``
    (nesterov) or ``g = buf``; ``p -= lr * g``. State: ``"momentum_buffer.<param>"`` (with
    momentum) and ``"step"``.

    >>> import numpy as np, einjoin as ej
    >>> w = ej.param("w", (2,), "float64")
    >>> up = ej.optim.SGD(lr=0.1, momentum=0.9).update({"w": w}, {"w": ej.full((2,), 1.0, "float64")})
    >>> feeds = {"w": np.zeros(2), **up.init_state(), **up.hyper_values()}
    >>> w1, buf1, step1 = ej.reference([up.params["w"], up.state_out["momentum_buffer.w"],
    ...                                 up.state_out["step"]], **feeds)
    >>> w1.tolist(), buf1.tolist(), float(step1)
    ([-0.1, -0.1], [1.0, 1.0], 1.0)
    """

    def __init__(self, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        self.lr = check_lr(lr)
        self.momentum = _non_negative(momentum, "momentum")
        self.dampening = _number(dampening, "dampening")
        self.weight_decay = _non_negative(weight_decay, "weight_decay")
        if not isinstance(nesterov, (bool, np.bool_)):
            raise EinjoinError(f"nesterov must be True or False, got {nesterov!r:.60}")
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise EinjoinError(f"Nesterov momentum requires a momentum and zero dampening (got "
                               f"momentum={momentum!r}, dampening={dampening!r})")

    def __repr__(self) -> str:
        return (f"SGD(lr={self.lr!r}, momentum={self.momentum!r}, dampening={self.dampening!r}, "
                f"weight_decay={self.weight_decay!r}, nesterov={self.nesterov!r})")

    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor]) -> Update:
        """The step's graph: new parameters and state (see :class:`Update`)."""
        items = _checked(params, grads)
        lr_in, step_in, step_out = self._scalars(items[0][0])
        lr = _Casts(lr_in)
        first = step_in == 0.0  # the momentum buffer starts as the first gradient (torch)
        new_params: dict[str, Tensor] = {}
        state_in: dict[str, Tensor] = {STEP: step_in}
        state_out: dict[str, Tensor] = {STEP: step_out}
        mom, damp, wd = self.momentum, self.dampening, self.weight_decay
        for name, p, g in items:
            if wd != 0:
                g = _ew(f"x0 + x1 * {wd!r}", g, p, name="sgd weight decay")
            if mom != 0:
                key = f"momentum_buffer.{name}"
                buf = F.param(key, p.shape, p.dtype)
                buf1 = _ew(f"where(x2, x1, x0 * {mom!r} + x1 * {1.0 - damp!r})", buf, g, first,
                           name="sgd momentum")
                state_in[key], state_out[key] = buf, buf1
                if self.nesterov:
                    g = _ew(f"x0 + x1 * {mom!r}", g, buf1, name="sgd nesterov")
                else:
                    g = buf1
            new_params[name] = _ew("x0 - x2 * x1", p, g, lr(p.dtype), name="sgd step")
        return _made(items, grads, new_params, state_in, state_out, lr_in, self.lr)


class AdamW(Optimizer):
    """torch.optim.AdamW: ``p *= 1 - lr * weight_decay``; ``m = lerp(m, g, 1 - beta1)``;
    ``v = beta2 * v + (1 - beta2) * g * g``; with ``t`` the new step count,
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``. The bias
    corrections are computed in float64 in the graph and cast to the parameter's dtype. State:
    ``"exp_avg.<param>"``, ``"exp_avg_sq.<param>"`` and ``"step"``.

    >>> import numpy as np, einjoin as ej
    >>> w = ej.param("w", (2,), "float64")
    >>> up = ej.optim.AdamW(lr=0.1, weight_decay=0.0).update({"w": w}, {"w": w})
    >>> feeds = {"w": np.array([1.0, -2.0]), **up.init_state(), **up.hyper_values()}
    >>> out = ej.reference([up.params["w"], *up.state_out.values()], **feeds)
    >>> np.round(out[0], 6).tolist()   # the first step moves by lr * sign(g)
    [0.9, -1.9]
    """

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        self.lr = check_lr(lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise EinjoinError(f"betas must be a pair of numbers, got {betas!r:.60}")
        b = [_number(v, f"betas[{i}]") for i, v in enumerate(betas)]
        for i, v in enumerate(b):
            if not 0.0 <= v < 1.0:
                raise EinjoinError(f"Invalid beta parameter at index {i}: {betas[i]!r} (must be in [0, 1))")
        self.betas = (b[0], b[1])
        self.eps = _non_negative(eps, "eps")
        self.weight_decay = _non_negative(weight_decay, "weight_decay")

    def __repr__(self) -> str:
        return (f"AdamW(lr={self.lr!r}, betas={self.betas!r}, eps={self.eps!r}, "
                f"weight_decay={self.weight_decay!r})")

    def update(self, params: dict[str, Tensor], grads: dict[str, Tensor]) -> Update:
        """The step's graph: new parameters and state (see :class:`Update`)."""
        items = _checked(params, grads)
        lr_in, step_in, step_out = self._scalars(items[0][0])
        b1, b2 = self.betas
        # float64 scalars, as torch computes them in Python: bias corrections from the new step
        bc1 = _ew(f"1.0 - {b1!r} ** x0", step_out, name="adam bias correction 1")
        bc2 = _ew(f"1.0 - {b2!r} ** x0", step_out, name="adam bias correction 2")
        step_size = _Casts(lr_in / bc1)
        bc2_sqrt = _Casts(bc2.sqrt())
        decay = _Casts(_ew(f"1.0 - x0 * {self.weight_decay!r}", lr_in, name="adamw decay"))
        new_params: dict[str, Tensor] = {}
        state_in: dict[str, Tensor] = {STEP: step_in}
        state_out: dict[str, Tensor] = {STEP: step_out}
        w1 = 1.0 - b1
        # torch's lerp: the form that is exact at its nearer end
        lerp = f"x0 + {w1!r} * (x1 - x0)" if w1 < 0.5 else f"x1 - (x1 - x0) * {1.0 - w1!r}"
        for name, p, g in items:
            km, kv = f"exp_avg.{name}", f"exp_avg_sq.{name}"
            m, v = F.param(km, p.shape, p.dtype), F.param(kv, p.shape, p.dtype)
            m1 = _ew(lerp, m, g, name="adam exp_avg")
            v1 = _ew(f"x0 * {b2!r} + {1.0 - b2!r} * x1 * x1", v, g, name="adam exp_avg_sq")
            p0 = p if self.weight_decay == 0 else _ew("x0 * x1", p, decay(p.dtype), name="adamw decay")
            new_params[name] = _ew(f"x0 - x1 * (x2 / (sqrt(x3) / x4 + {self.eps!r}))", p0,
                                   step_size(p.dtype), m1, v1, bc2_sqrt(p.dtype), name="adam step")
            state_in[km], state_out[km] = m, m1
            state_in[kv], state_out[kv] = v, v1
        return _made(items, grads, new_params, state_in, state_out, lr_in, self.lr)


def clip_grad_norm(grads: dict[str, Tensor], max_norm: float, norm_type: float = 2.0
                   ) -> tuple[dict[str, Tensor], Tensor]:
    """torch.nn.utils.clip_grad_norm_ as EinSums: the total norm of all gradients together (the
    ``norm_type``-norm of their norms; ``inf``: the largest magnitude), and each gradient scaled
    by ``min(1, max_norm / (total + 1e-6))``. Returns (the clipped gradients, the total norm).

    >>> import numpy as np, einjoin as ej
    >>> g = ej.input("g", (2,), "float64")
    >>> (clipped, total) = ej.optim.clip_grad_norm({"g": g}, max_norm=1.0)
    >>> out, n = ej.reference([clipped["g"], total], g=np.array([3.0, 4.0]))
    >>> np.round(out, 6).tolist(), float(n)
    ([0.6, 0.8], 5.0)
    """
    if not isinstance(grads, Mapping):
        raise EinjoinError(f"clip_grad_norm: grads must be a dict name -> einjoin tensor, got "
                           f"{type(grads).__name__}")
    max_norm = _number(max_norm, "clip_grad_norm: max_norm")
    p = _number(norm_type, "clip_grad_norm: norm_type")
    if not (p == math.inf or 0.0 < p < math.inf):
        raise EinjoinError(f"clip_grad_norm: norm_type={norm_type!r} is not supported (a positive "
                           f"number or inf)")
    for name, g in grads.items():
        if not isinstance(g, Tensor):
            raise EinjoinError(f"clip_grad_norm: the gradient {name!r} is {type(g).__name__}, not an "
                               f"einjoin tensor")
        if kind(g.dtype) != "float":
            raise DTypeError(f"clip_grad_norm: the gradient {name!r} is {g.dtype}; it must be a float tensor")
    if not grads:
        return {}, F.full((), 0.0)
    norms = [_norm(g, p) for g in grads.values()]
    dtype = norms[0].dtype
    for n in norms[1:]:
        dtype = promote(dtype, n.dtype)
    stacked = F.stack([n.to(dtype) for n in norms])
    total = _norm(stacked, p)
    coef = _ew("min(x0 / (x1 + 1e-6), 1.0)", F.full((), max_norm, dtype), total, name="clip coefficient")
    clipped = {name: g * coef.to(g.dtype) for name, g in grads.items()}
    return clipped, total


def _norm(x: Tensor, p: float) -> Tensor:
    """torch.linalg.vector_norm(x, p) over all elements, in ``x``'s dtype; a half ``x`` is
    raised to float32 first and the norm rounded once at the end, as torch accumulates (the
    squares of fp16 gradients of a few hundred would overflow fp16, their norm does not)."""
    if x.dtype in ("float16", "bfloat16"):
        return _norm(x.to("float32"), p).to(x.dtype)
    if p == math.inf:
        return x.abs().max() if x.node.size else F.full((), 0.0, x.dtype)
    if p == 2.0:
        return (x * x).sum().sqrt()
    if p == 1.0:
        return x.abs().sum()
    return _ew(f"x0 ** {1.0 / p!r}", _ew(f"abs(x0) ** {p!r}", x, name="norm power").sum(), name="norm root")
