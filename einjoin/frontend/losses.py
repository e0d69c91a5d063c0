"""Losses as torch defines them — ``cross_entropy``, ``nll_loss``, ``mse_loss`` — written with the
frontend, and their translations for the torch importer (:data:`LOSS_OPS`, merged into
``einjoin.frontend.aten.OPS``; :data:`LOSS_MODULES`, the ``nn`` loss modules for torch.fx).

The target's class is picked without a gather: one EinSum over (log-probabilities, targets, class
indices) with the join ``where(target == class, -logp, 0)`` summed over the class label, so the
pick is decomposed like any op (cut along the batch, the classes, or both) and its gradient is
the same select. Each target's class weight (1 without ``weight``) is read by a gather from a
table of C entries, whose run-time index check makes a class index outside ``[0, C)`` (other
than ``ignore_index``) an error naming it, as torch raises. Ignored targets (``ignore_index``)
count 0 and are left out of the mean's denominator, as in torch (a mean over no target at all
is nan, as torch's).

>>> import numpy as np, einjoin as ej
>>> logits = ej.input("logits", (2, 3), "float64"); target = ej.input("target", (2,), "int64")
>>> loss = ej.cross_entropy(logits, target)
>>> float(ej.reference(loss, logits=np.zeros((2, 3)), target=np.array([0, 2]))) == float(np.log(3))
True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.frontend import composites as C
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import LETTERS, Tensor, _t, broadcast_shapes, einsum, elementwise, gather
from einjoin.ir.dtypes import FLOAT_DTYPES, kind, promote
from einjoin.ir.scalar import parse_join

__all__ = ["cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
           "binary_cross_entropy_with_logits", "binary_cross_entropy", "kl_div", "LOSS_OPS", "LOSS_MODULES"]

_REDUCTIONS = ("none", "mean", "sum")  # torch's enum order: Reduction::None, Mean, Sum


def _reduction(reduction: Any, what: str) -> str:
    """``"none"``, ``"mean"`` or ``"sum"`` from a string or ATen's enum (0, 1, 2)."""
    if isinstance(reduction, int) and not isinstance(reduction, bool) and 0 <= reduction < 3:
        return _REDUCTIONS[reduction]
    if isinstance(reduction, str) and reduction in _REDUCTIONS:
        return reduction
    raise EinjoinError(f"{what}: reduction must be 'none', 'mean' or 'sum', got {reduction!r:.60}")


def _legacy(size_average: Any, reduce: Any, reduction: Any) -> Any:
    """torch's deprecated ``size_average`` / ``reduce`` flags, as torch maps them to a reduction."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return "none" if not reduce else ("mean" if size_average else "sum")


def _float_input(value: Any, what: str) -> Tensor:
    x = _t(value, what)
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{what}: the input is {x.dtype}; it must be a float tensor")
    if x.ndim == 0:
        raise ShapeError(f"{what}: the input must have a class dim (shape (C,), (N, C) or "
                         f"(N, C, d1, ...)), got a scalar")
    return x


def _class_targets(x: Tensor, target: Tensor, what: str) -> tuple[int, str, str]:
    """Check int class-index targets against input ``x``: (class dim, input labels, target labels)."""
    if kind(target.dtype) != "int":
        raise DTypeError(f"{what}: class-index targets must be int64, got {target.dtype}")
    cdim = 0 if x.ndim == 1 else 1
    want = x.shape[:cdim] + x.shape[cdim + 1:]
    if target.shape != want:
        raise ShapeError(f"{what}: input of shape {x.shape} (classes on dim {cdim}) needs targets of "
                         f"shape {want}, got {target.shape}")
    ls = LETTERS[:x.ndim]
    return cdim, ls, ls[:cdim] + ls[cdim + 1:]


def _weight(weight: Any, n_classes: int, dtype: str, what: str) -> Tensor | None:
    if weight is None:
        return None
    w = _t(weight, f"{what}: weight")
    if w.shape != (n_classes,):
        raise ShapeError(f"{what}: weight must have one entry per class, shape ({n_classes},), got {w.shape}")
    if kind(w.dtype) != "float":
        raise DTypeError(f"{what}: weight must be a float tensor, got {w.dtype}")
    return w if w.dtype == dtype else w.to(dtype)


def _ignore(ignore_index: Any, what: str) -> int:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise EinjoinError(f"{what}: ignore_index must be an int, got {ignore_index!r:.60}")
    return ignore_index


def _targets(x: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, what: str
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, str, str, str]:
    """What picking each target's class of ``x`` (log-probabilities or logits) needs: (the
    targets as the pick compares them, the class indices, the ignored mask, per-target weights
    ``w[t]`` (0 where ignored), ``x``'s labels, the targets' labels, the class label)."""
    cdim, ls, tl = _class_targets(x, target, what)
    c = ls[cdim]
    n_classes = x.shape[cdim]
    if target.dtype != "int64":
        target = target.to("int64")
    classes = F.arange(n_classes)
    # an ignored target of a valid class must match no class: it becomes -1 (any other ignored
    # value, -100 by default, matches none already)
    ignored = target == ignore_index
    picked = target if not 0 <= ignore_index < n_classes else elementwise(
        "where", ignored, -1, target, name=f"{what} ignore_index")
    # each target's weight w[t] (1 without a weight), 0 where ignored, read by a gather: the
    # gather checks its indices at run time, so a class outside [0, C) that is not ignore_index
    # is an error naming it ("index 3 out of range"), as torch raises, not a silent loss of 0
    table = weight if weight is not None else F.full((n_classes,), 1.0, x.dtype)
    rows = elementwise("where", ignored, 0, target, name=f"{what} ignored to row 0")
    wt = F.where(ignored, 0.0, gather(table, rows))
    return picked, classes, ignored, wt, ls, tl, c


def _nll(logp: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, what: str
         ) -> tuple[Tensor, Tensor, str]:
    """(per-target losses ``-w[t] * logp[t]``, 0 where ignored; per-target weights ``w[t]``, 0 where
    ignored; the class label of ``logp``)."""
    picked, classes, _, wt, ls, tl, c = _targets(logp, target, weight, ignore_index, what)
    # -logp[t] by one EinSum over the classes (decomposed like any op), times w[t]: the same
    # bits as -(logp[t] * w[t]) (negation is exact), and 0 where ignored (the pick matches none)
    pick = einsum(f"{ls},{tl},{c}->{tl}", logp, picked, classes, join="where(x1 == x2, -x0, 0)")
    return pick * wt, wt, c


def _cross_entropy_classes(x: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, what: str
                           ) -> tuple[Tensor, Tensor]:
    """cross_entropy with class-index targets (no label smoothing): (per-target losses, weights).
    The log-probabilities are never materialised: the logit of each target's class is picked
    (one pass over the logits, beside the max and the sum of exponentials), and only that one
    is shifted, ``-((x[t] - max) - log(sum))`` per target: the same operations, so the same
    bits, as torch's ``log_softmax`` then ``nll_loss`` (and as ``_nll`` of ``log_softmax``), but
    the step's logit-sized passes go from seven (forward and gradient) to four: the gradient is
    ``exp(x - max) * (g / sum)`` minus ``g`` at the target, one fused pass."""
    picked, classes, ignored, wt, ls, tl, c = _targets(x, target, weight, ignore_index, what)
    m = einsum(f"{ls}->{tl}", x, agg="max")
    # shift invariant as softmax: no derivative through the max
    s = einsum(f"{ls},{tl}->{tl}", x, m, join="exp(x0 - stop_gradient(x1))")
    xt = einsum(f"{ls},{tl},{c}->{tl}", x, picked, classes, join="where(x1 == x2, x0, 0)")
    nll = einsum(f"{tl},{tl},{tl},{tl}->{tl}", xt, m, s, ignored,
                 join="where(x3, 0, -(x0 - stop_gradient(x1) - log(x2)))")
    return nll * wt, wt


def _reduce(loss: Tensor, wt: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / wt.sum()  # 0 / 0 = nan when every target is ignored, as torch


def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """torch.nn.functional.nll_loss: ``-weight[t] * input[t]`` per target ``t`` (class indices,
    int64), input ``(C,)``, ``(N, C)`` or ``(N, C, d1, ...)`` of log-probabilities; ``mean``
    divides by the summed weights of the targets that are not ``ignore_index``.

    >>> import numpy as np, einjoin as ej
    >>> logp = ej.input("logp", (3, 2), "float64"); t = ej.input("t", (3,), "int64")
    >>> ej.reference(ej.nll_loss(logp, t, reduction="none"), logp=-np.arange(6.0).reshape(3, 2),
    ...              t=np.array([1, -100, 0]))
    array([1., 0., 4.])
    """
    what = "nll_loss"
    logp = _float_input(input, what)
    red = _reduction(reduction, what)
    ii = _ignore(ignore_index, what)
    n_classes = logp.shape[0 if logp.ndim == 1 else 1]
    loss, wt, _ = _nll(logp, _t(target, f"{what}: target"), _weight(weight, n_classes, logp.dtype, what),
                       ii, what)
    return _reduce(loss, wt, red)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """torch.nn.functional.cross_entropy of logits ``input`` (``(C,)``, ``(N, C)`` or ``(N, C, d1,
    ...)``, classes on dim 1) and ``target``: class indices (int64, ``ignore_index`` left out) or
    class probabilities (a float tensor of the input's shape); ``weight`` per class;
    ``label_smoothing`` as torch mixes it in.

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (2, 4), "float64"); t = ej.input("t", (2,), "int64")
    >>> loss = ej.cross_entropy(x, t, reduction="sum")
    >>> round(float(ej.reference(loss, x=np.eye(2, 4) * 10, t=np.array([0, 1]))), 6)
    0.000272
    """
    what = "cross_entropy"
    x = _float_input(input, what)
    red = _reduction(reduction, what)
    ii = _ignore(ignore_index, what)
    eps = label_smoothing
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps <= 1.0:
        raise EinjoinError(f"{what}: label_smoothing must be a number in [0, 1], got {label_smoothing!r:.60}")
    cdim = 0 if x.ndim == 1 else 1
    n_classes = x.shape[cdim]
    w = _weight(weight, n_classes, x.dtype, what)
    target = _t(target, f"{what}: target")
    if kind(target.dtype) != "float" and eps == 0:
        return _reduce(*_cross_entropy_classes(x, target, w, ii, what), red)
    logp = C.log_softmax(x, cdim)
    ls = LETTERS[:x.ndim]
    if kind(target.dtype) == "float":
        return _probabilities(logp, target, w, red, float(eps), ls, cdim, what)
    loss, wt, c = _nll(logp, target, w, ii, what)
    nll = _reduce(loss, wt, red)
    if eps == 0:
        return nll
    # torch: (1 - eps) * nll + eps / C * (the sum over classes of -w[c] logp[c]), ignored ones 0
    tl = ls[:cdim] + ls[cdim + 1:]
    if w is None:
        smooth = einsum(f"{ls},{tl}->{tl}", logp, target, join=f"where(x1 == {ii}, 0, -x0)")
    else:
        smooth = einsum(f"{ls},{tl},{c}->{tl}", logp, target, w, join=f"where(x1 == {ii}, 0, -(x0 * x2))")
    return (1.0 - eps) * nll + _reduce(smooth, wt, red) * (eps / n_classes)


def _probabilities(logp: Tensor, target: Tensor, w: Tensor | None, red: str, eps: float, ls: str,
                   cdim: int, what: str) -> Tensor:
    """cross_entropy with class-probability targets: ``-sum_c w[c] t[c] logp[c]``; ``mean``
    divides by the number of targets (not by the weights), as torch."""
    if target.shape != logp.shape:
        raise ShapeError(f"{what}: class-probability targets must have the input's shape {logp.shape}, "
                         f"got {target.shape}")
    if target.dtype != logp.dtype:
        raise DTypeError(f"{what}: class-probability targets must have the input's dtype {logp.dtype}, "
                         f"got {target.dtype}")
    n_classes = logp.shape[cdim]
    if eps > 0:
        target = target * (1.0 - eps) + eps / n_classes
    tl = ls[:cdim] + ls[cdim + 1:]
    out = tl if red == "none" else ""
    c = ls[cdim]
    if w is None:
        loss = einsum(f"{ls},{ls}->{out}", logp, target, join="-(x0 * x1)")
    else:
        loss = einsum(f"{ls},{ls},{c}->{out}", logp, target, w, join="-(x0 * x1 * x2)")
    if red != "mean":
        return loss
    n = math.prod(logp.shape) // n_classes if n_classes else 0
    return loss / n if n else loss * math.nan


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.mse_loss: ``(input - target) ** 2`` (broadcasting), its mean, sum or
    every element.

    >>> import numpy as np, einjoin as ej
    >>> a = ej.input("a", (3,), "float64"); b = ej.input("b", (3,), "float64")
    >>> float(ej.reference(ej.mse_loss(a, b), a=np.array([1.0, 2.0, 3.0]), b=np.zeros(3)))
    4.666666666666667
    """
    what = "mse_loss"
    a, b = _pair(input, target, what)
    red = _reduction(reduction, what)
    sq = elementwise(parse_join("(x0 - x1) * (x0 - x1)", 2), a, b, name=what)
    if red == "none":
        return sq
    if red == "sum" or sq.dtype in ("float16", "bfloat16"):
        return sq.sum() if red == "sum" else sq.mean()  # a half mean scales before summing
    n = math.prod(sq.shape)
    return sq.sum() / n if n else sq.sum() * math.nan  # sum / n as torch's mean (not sum * (1/n))


def _pair(input: Any, target: Any, what: str) -> tuple[Tensor, Tensor]:
    """Float input and target of one dtype (promoted as torch), broadcast together."""
    a, b = _t(input, what), _t(target, f"{what}: target")
    for t in (a, b):
        if kind(t.dtype) != "float":
            raise DTypeError(f"{what}: input and target must be float tensors, got {a.dtype} and {b.dtype}")
    if a.dtype != b.dtype:
        dt = promote(a.dtype, b.dtype)
        a, b = a.to(dt), b.to(dt)
    return a, b


def _mean_or_sum(loss: Tensor, red: str) -> Tensor:
    if red == "none":
        return loss
    if red == "sum" or loss.dtype in ("float16", "bfloat16"):
        return loss.sum() if red == "sum" else loss.mean()
    n = math.prod(loss.shape)
    return loss.sum() / n if n else loss.sum() * math.nan


def _pointwise(expr: str, input: Any, target: Any, reduction: Any, what: str) -> Tensor:
    a, b = _pair(input, target, what)
    red = _reduction(reduction, what)
    return _mean_or_sum(elementwise(parse_join(expr, 2), a, b, name=what), red)


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """torch.nn.functional.l1_loss: ``|input - target|`` (broadcasting), its mean, sum or every
    element (no gradient where they are equal, as torch's sign)."""
    return _pointwise("abs(x0 - x1)", input, target, reduction, "l1_loss")


def smooth_l1_loss(input: Tensor, target: Tensor, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """torch.nn.functional.smooth_l1_loss: ``0.5 d² / beta`` where ``|d| < beta``, else
    ``|d| - 0.5 beta`` (``beta = 0``: the L1 loss)."""
    b = float(beta)
    if b < 0:
        raise EinjoinError(f"smooth_l1_loss: beta must be >= 0, got {beta!r}")
    if b == 0:
        return l1_loss(input, target, reduction)
    expr = (f"where(abs(x0 - x1) < {b!r}, (x0 - x1) * (x0 - x1) * {0.5 / b!r}, abs(x0 - x1) - {0.5 * b!r})")
    return _pointwise(expr, input, target, reduction, "smooth_l1_loss")


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    """torch.nn.functional.huber_loss: ``0.5 d²`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)``."""
    dl = float(delta)
    if dl <= 0:
        raise EinjoinError(f"huber_loss: delta must be > 0, got {delta!r}")
    expr = f"where(abs(x0 - x1) < {dl!r}, (x0 - x1) * (x0 - x1) * 0.5, (abs(x0 - x1) - {0.5 * dl!r}) * {dl!r})"
    return _pointwise(expr, input, target, reduction, "huber_loss")


def _optional_weight(w: Any, dtype: str, what: str) -> Tensor | None:
    if w is None:
        return None
    t = _t(w, what)
    if kind(t.dtype) != "float":
        raise DTypeError(f"{what} must be a float tensor, got {t.dtype}")
    return t if t.dtype == dtype else t.to(dtype)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """torch.nn.functional.binary_cross_entropy_with_logits, in torch's stable form:
    ``(1 - t) x + (1 + (pos_weight - 1) t) (log1p(exp(-|x|)) + max(-x, 0))``, times ``weight``
    (both broadcast against the input; ``pos_weight`` along the last dim, the classes).

    >>> import numpy as np, einjoin as ej
    >>> x = ej.input("x", (2,), "float64"); t = ej.input("t", (2,), "float64")
    >>> round(float(ej.reference(ej.binary_cross_entropy_with_logits(x, t), x=np.zeros(2), t=np.ones(2))), 6)
    0.693147
    """
    what = "binary_cross_entropy_with_logits"
    x, t = _pair(input, target, what)
    if x.shape != t.shape:
        raise ShapeError(f"{what}: target of shape {t.shape} must have the input's shape {x.shape}")
    red = _reduction(reduction, what)
    soft = "(log1p(exp(-abs(x0))) + max(-x0, 0))"
    pw = _optional_weight(pos_weight, x.dtype, f"{what}: pos_weight")
    if pw is None:
        loss = elementwise(parse_join(f"(1 - x1) * x0 + {soft}", 2), x, t, name=what)
    else:
        loss = elementwise(parse_join(f"(1 - x1) * x0 + ((x2 - 1) * x1 + 1) * {soft}", 3), x, t, pw, name=what)
    w = _optional_weight(weight, x.dtype, f"{what}: weight")
    if w is not None:
        loss = loss * w
    return _mean_or_sum(loss, red)


def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                         reduction: str = "mean") -> Tensor:
    """torch.nn.functional.binary_cross_entropy of probabilities: ``-(t log x + (1 - t) log(1 - x))``
    with each log clamped at -100, as torch, times ``weight``."""
    what = "binary_cross_entropy"
    x, t = _pair(input, target, what)
    if x.shape != t.shape:
        raise ShapeError(f"{what}: target of shape {t.shape} must have the input's shape {x.shape}")
    red = _reduction(reduction, what)
    loss = elementwise(parse_join("-(x1 * max(log(x0), -100.0) + (1 - x1) * max(log(1 - x0), -100.0))", 2),
                       x, t, name=what)
    w = _optional_weight(weight, x.dtype, f"{what}: weight")
    if w is not None:
        loss = loss * w
    return _mean_or_sum(loss, red)


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """torch.nn.functional.kl_div of log-probabilities ``input``: ``t (log t - input)`` (0 where
    ``t = 0``), or ``exp(t) (t - input)`` with ``log_target``; ``batchmean`` divides the sum by the
    first dim."""
    what = "kl_div"
    x, t = _pair(input, target, what)
    if log_target:
        loss = elementwise(parse_join("exp(x1) * (x1 - x0)", 2), x, t, name=what)
    else:
        loss = elementwise(parse_join("where(x1 > 0, x1 * (log(x1) - x0), where(x1 == 0, 0.0, x1 * 0.0 / 0.0))", 2),
                           x, t, name=what)
    if reduction == "batchmean":
        return loss.sum() / (loss.shape[0] if loss.ndim else 1)
    return _mean_or_sum(loss, _reduction(reduction, what))


# ---------------------------------------------------------------- the importer's translations
# torch.export gives ATen ops (reduction an int enum); torch.fx gives the torch.nn.functional
# calls (reduction a string, and the deprecated size_average / reduce flags). Both spell
# nll_loss and mse_loss alike: the argument in the slot where they differ tells them apart.


def _t_cross_entropy_loss(x: Tensor, target: Tensor, weight: Any = None, reduction: Any = 1,
                          ignore_index: int = -100, label_smoothing: float = 0.0) -> Tensor:
    return cross_entropy(x, target, weight, ignore_index, _reduction(reduction, "cross_entropy"),
                         label_smoothing)


def _f_cross_entropy(x: Tensor, target: Tensor, weight: Any = None, size_average: Any = None,
                     ignore_index: int = -100, reduce: Any = None, reduction: Any = "mean",
                     label_smoothing: float = 0.0) -> Tensor:
    return cross_entropy(x, target, weight, ignore_index, _legacy(size_average, reduce, reduction),
                         label_smoothing)


def _nll_any(x: Tensor, target: Tensor, weight: Any = None, third: Any = None, ignore_index: int = -100,
             reduce: Any = None, reduction: Any = "mean", *, size_average: Any = None) -> Tensor:
    """aten ``nll_loss(self, target, weight, reduction: int, ignore_index)`` or torch's
    ``F.nll_loss(input, target, weight, size_average, ignore_index, reduce, reduction)``."""
    if isinstance(third, int) and not isinstance(third, bool):  # the ATen form: an enum
        reduction = third
    else:
        size_average = third if third is not None else size_average
        reduction = _legacy(size_average, reduce, reduction)
    return nll_loss(x, target, weight, ignore_index, _reduction(reduction, "nll_loss"))


def _nll_forward(x: Tensor, target: Tensor, weight: Any, reduction: Any, ignore_index: int
                 ) -> tuple[Tensor, Tensor]:
    """aten ``nll_loss_forward``: (the loss, the total weight of the counted targets)."""
    what = "nll_loss"
    logp = _float_input(x, what)
    red = _reduction(reduction, what)
    n_classes = logp.shape[0 if logp.ndim == 1 else 1]
    loss, wt, _ = _nll(logp, target, _weight(weight, n_classes, logp.dtype, what), _ignore(ignore_index, what),
                       what)
    return _reduce(loss, wt, red), wt.sum()


def _mse_any(x: Tensor, target: Tensor, third: Any = None, reduce: Any = None, reduction: Any = "mean",
             weight: Any = None, *, size_average: Any = None) -> Tensor:
    """aten ``mse_loss(self, target, reduction: int)`` or ``F.mse_loss(input, target,
    size_average, reduce, reduction, weight)``."""
    if weight is not None:
        raise UnsupportedOpError("mse_loss with weight= is not supported")
    if isinstance(third, int) and not isinstance(third, bool):
        reduction = third
    else:
        size_average = third if third is not None else size_average
        reduction = _legacy(size_average, reduce, reduction)
    return mse_loss(x, target, _reduction(reduction, "mse_loss"))


def _broadcast_tensors(*tensors: Any) -> tuple[Tensor, ...]:
    """``torch.broadcast_tensors`` (torch.export puts it before ``mse_loss``)."""
    ts = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    shape = broadcast_shapes(*(_t(t, "broadcast_tensors").shape for t in ts), what="broadcast_tensors")
    return tuple(t if t.shape == shape else t.expand(shape) for t in ts)


LOSS_OPS: dict[str, Callable[..., Any]] = {
    "cross_entropy_loss": _t_cross_entropy_loss,
    "cross_entropy": _f_cross_entropy,
    "nll_loss": _nll_any, "nll_loss_nd": _nll_any, "nll_loss2d": _nll_any,
    "nll_loss_forward": _nll_forward, "nll_loss2d_forward": _nll_forward,
    "mse_loss": _mse_any,
    "broadcast_tensors": _broadcast_tensors,
}
"""The losses' translations by ATen op / torch function name (merged into ``aten.OPS``)."""


def _module_reduction(m: Any) -> str:
    return str(m.reduction)


LOSS_MODULES: dict[str, Callable[..., Tensor]] = {
    "CrossEntropyLoss": lambda m, p, x, t: cross_entropy(x, t, p.get("weight"), m.ignore_index,
                                                         _module_reduction(m), m.label_smoothing),
    "NLLLoss": lambda m, p, x, t: nll_loss(x, t, p.get("weight"), m.ignore_index, _module_reduction(m)),
    "MSELoss": lambda m, p, x, t: mse_loss(x, t, _module_reduction(m)),
}
"""The ``nn`` loss modules, as torch.fx records them (leaf modules), by class name."""
