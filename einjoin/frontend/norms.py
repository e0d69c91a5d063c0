"""Batch, group and instance normalisation as EinSums (layer_norm and rms_norm live in
:mod:`einjoin.frontend.composites`): statistics are sum-aggregations over the normalised labels,
the normalisation one join ``(x - mean) * rsqrt(var + eps) * weight + bias``; so the planner may
split the batch, the channels (groups) or the normalised dims (partial sums), and ``ej.grad``
differentiates them with the ordinary einsum rules. float16/bfloat16 data computes in float32 and
rounds once, as torch.

Training-mode batch norm returns the running statistics it would write as extra outputs
(:func:`batch_norm_train`): einjoin graphs are functional, so the caller (the importer) makes them
outputs, or state.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 4, 3))
>>> y = ej.group_norm(x, 2)
>>> out = ej.reference(y, x=np.arange(24, dtype=np.float32).reshape(2, 4, 3))
>>> bool(abs(out.mean()) < 1e-6), out.shape
(True, (2, 4, 3))
"""

from __future__ import annotations

import math
from typing import Any

from einjoin.errors import EinjoinError, ShapeError
from einjoin.frontend.tensor import LETTERS, Tensor, _t, einsum

__all__ = ["batch_norm", "batch_norm_train", "group_norm", "instance_norm"]


def _eps(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise EinjoinError(f"{what}: eps must be a number, got {v!r:.60}")
    return float(v)


def _wide(x: Tensor) -> tuple[Tensor, str]:
    """float16/bfloat16 data widened to float32 (statistics in half overflow); the dtype to round to."""
    return (x.to("float32"), x.dtype) if x.dtype in ("float16", "bfloat16") else (x, x.dtype)


def _per_channel(p: Any, c: int, dtype: str, what: str) -> Tensor | None:
    if p is None:
        return None
    t = _t(p, what)
    if t.shape != (c,):
        raise ShapeError(f"{what} must have one entry per channel, shape ({c},), got {t.shape}")
    return t if t.dtype == dtype else t.to(dtype)


def _normalise(x: Tensor, ls: str, stat: str, mean: Tensor, var: Tensor, eps: float, weight: Tensor | None,
               bias: Tensor | None, wl: str) -> Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` as one EinSum (mean, var on ``stat``,
    weight and bias on ``wl``)."""
    ins, labels, join = [x, mean, var], [ls, stat, stat], f"(x0 - x1) * rsqrt(x2 + {eps!r})"
    if weight is not None:
        ins.append(weight)
        labels.append(wl)
        join = f"{join} * x{len(ins) - 1}"
    if bias is not None:
        ins.append(bias)
        labels.append(wl)
        join = f"{join} + x{len(ins) - 1}"
    return einsum(f"{','.join(labels)}->{ls}", *ins, join=join)


def _moments(x: Tensor, ls: str, stat: str, n: int) -> tuple[Tensor, Tensor]:
    """The mean and the biased variance of ``x`` over the labels not in ``stat`` (two passes)."""
    inv = 1.0 / n if n else math.nan
    mean = einsum(f"{ls}->{stat}", x, join=f"x0 * {inv!r}")
    var = einsum(f"{ls},{stat}->{stat}", x, mean, join=f"(x0 - x1) * (x0 - x1) * {inv!r}")
    return mean, var


def _channels(x: Tensor, what: str) -> tuple[str, str, int]:
    if x.ndim < 2:
        raise ShapeError(f"{what}: input must be (N, C, ...), got shape {x.shape}")
    if x.ndim > len(LETTERS):
        raise ShapeError(f"{what}: rank {x.ndim} is above the supported 26")
    ls = LETTERS[:x.ndim]
    return ls, ls[1], x.shape[1]


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.batch_norm`` over the channel dim 1 of ``x`` (N, C, ...): with the
    running statistics in eval mode, with the batch's (biased variance) in training mode. The
    running-statistics update of training mode is :func:`batch_norm_train`'s.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (2, 3)); m = ej.input("m", (3,)); v = ej.input("v", (3,))
    >>> ej.reference(ej.batch_norm(x, m, v, eps=0.0), x=np.ones((2, 3), np.float32),
    ...              m=np.zeros(3, np.float32), v=np.full(3, 4.0, np.float32)).tolist()
    [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]
    """
    if training:
        return batch_norm_train(x, None, None, weight, bias, momentum, eps)[0]
    x = _t(x, "batch_norm")
    ls, c, n_c = _channels(x, "batch_norm")
    if running_mean is None or running_var is None:
        raise EinjoinError("batch_norm: eval mode (training=False) needs running_mean and running_var")
    x, dt = _wide(x)
    mean = _per_channel(running_mean, n_c, x.dtype, "batch_norm: running_mean")
    var = _per_channel(running_var, n_c, x.dtype, "batch_norm: running_var")
    assert mean is not None and var is not None
    y = _normalise(x, ls, c, mean, var, _eps(eps, "batch_norm"),
                   _per_channel(weight, n_c, x.dtype, "batch_norm: weight"),
                   _per_channel(bias, n_c, x.dtype, "batch_norm: bias"), c)
    return y if y.dtype == dt else y.to(dt)


def batch_norm_train(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                     weight: Tensor | None = None, bias: Tensor | None = None, momentum: float = 0.1,
                     eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Training-mode batch norm: (the output normalised with the batch statistics, the batch mean,
    ``1 / sqrt(var + eps)``, and the new running mean and variance — ``(1 - momentum) * old +
    momentum * batch``, the variance unbiased, as torch writes them — or None without running
    statistics)."""
    x = _t(x, "batch_norm")
    ls, c, n_c = _channels(x, "batch_norm")
    x, dt = _wide(x)
    n = math.prod(x.shape) // n_c if n_c else 0
    e = _eps(eps, "batch_norm")
    mean, var = _moments(x, ls, c, n)
    y = _normalise(x, ls, c, mean, var, e, _per_channel(weight, n_c, x.dtype, "batch_norm: weight"),
                   _per_channel(bias, n_c, x.dtype, "batch_norm: bias"), c)
    rstd = einsum(f"{c}->{c}", var, join=f"rsqrt(x0 + {e!r})")
    new_mean = new_var = None
    if running_mean is not None and running_var is not None:
        if momentum is None:
            raise EinjoinError("batch_norm: momentum=None (a cumulative average over the number of batches "
                               "seen) is not supported; give a number")
        m = float(momentum)
        rm = _per_channel(running_mean, n_c, running_mean.dtype, "batch_norm: running_mean")
        rv = _per_channel(running_var, n_c, running_var.dtype, "batch_norm: running_var")
        assert rm is not None and rv is not None
        unbias = n / (n - 1) if n > 1 else math.inf
        new_mean = einsum(f"{c},{c}->{c}", rm, mean.to(rm.dtype), join=f"x0 * {1.0 - m!r} + x1 * {m!r}")
        new_var = einsum(f"{c},{c}->{c}", rv, var.to(rv.dtype), join=f"x0 * {1.0 - m!r} + x1 * {m * unbias!r}")
    return (y if y.dtype == dt else y.to(dt)), mean, rstd, new_mean, new_var


def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.group_norm``: the channels of ``x`` (N, C, ...) in ``num_groups``
    groups, each normalised over its channels and the spatial dims; ``weight`` / ``bias`` per
    channel."""
    x = _t(x, "group_norm")
    ls, _, n_c = _channels(x, "group_norm")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0 or n_c % num_groups:
        raise ShapeError(f"group_norm: {n_c} channels do not split into num_groups={num_groups!r} groups")
    if x.ndim + 1 > len(LETTERS):
        raise ShapeError(f"group_norm: rank {x.ndim} is above the supported 25")
    x, dt = _wide(x)
    g = num_groups
    w = _per_channel(weight, n_c, x.dtype, "group_norm: weight")
    b = _per_channel(bias, n_c, x.dtype, "group_norm: bias")
    xg = x.reshape((x.shape[0], g, n_c // g) + x.shape[2:])
    lg = LETTERS[:xg.ndim]  # n, group, channel-in-group, spatial...
    stat = lg[:2]
    n = math.prod(xg.shape[2:])
    mean, var = _moments(xg, lg, stat, n)
    wg = None if w is None else w.reshape((g, n_c // g))
    bg = None if b is None else b.reshape((g, n_c // g))
    y = _normalise(xg, lg, stat, mean, var, _eps(eps, "group_norm"), wg, bg, lg[1:3]).reshape(x.shape)
    return y if y.dtype == dt else y.to(dt)


def instance_norm(x: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None,
                  weight: Tensor | None = None, bias: Tensor | None = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``torch.nn.functional.instance_norm``: each (sample, channel) normalised over its spatial
    dims (``use_input_stats``), or with the running statistics as batch norm's eval mode."""
    x = _t(x, "instance_norm")
    if not use_input_stats:
        return batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
    ls, c, n_c = _channels(x, "instance_norm")
    x, dt = _wide(x)
    n = math.prod(x.shape[2:])
    mean, var = _moments(x, ls, ls[:2], n)
    y = _normalise(x, ls, ls[:2], mean, var, _eps(eps, "instance_norm"),
                   _per_channel(weight, n_c, x.dtype, "instance_norm: weight"),
                   _per_channel(bias, n_c, x.dtype, "instance_norm: bias"), c)
    return y if y.dtype == dt else y.to(dt)
