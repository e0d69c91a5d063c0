"""The normalisation, activation and loss translations of the torch importer: batch / group /
instance norm (as ``torch.export`` records them, before and after ``run_decompositions``, and as
``torch.fx`` records ``F.*``), the elementwise activations of :mod:`einjoin.frontend.activations`,
logsumexp / vector norms, and the losses L1, smooth L1, Huber, BCE (with logits), KL:
:data:`NN_OPS`, merged into :data:`einjoin.frontend.aten.OPS`.

ATen ops and ``torch.nn.functional`` often share a name but not an argument order; each
translation tells them apart by the slot where they differ (an int ``reduction`` enum, a
``cudnn_enabled`` flag), as :mod:`einjoin.frontend.losses` does.

>>> import einjoin as ej
>>> NN_OPS["group_norm"](ej.input("x", (2, 4, 3)), 2).shape
(2, 4, 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from einjoin.errors import DTypeError, EinjoinError, UnsupportedOpError
from einjoin.frontend import activations as A
from einjoin.frontend import losses as L
from einjoin.frontend import norms as N
from einjoin.frontend.aten_layout import torch_dtype
from einjoin.frontend.tensor import LETTERS, Tensor, _norm_dims, einsum, elementwise
from einjoin.ir.dtypes import kind
from einjoin.registry import registrar

__all__ = ["NN_OPS", "TRAINING_BN_HELP"]

NN_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(NN_OPS)

TRAINING_BN_HELP = (
    "einjoin graphs are functional and this form updates the running statistics in place, "
    "invisibly to the graph; import the module in eval mode (module.eval()), or build the model "
    "with track_running_stats=False (batch statistics only)")


def _is_enum(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------- norms


@op("batch_norm")
def _batch_norm(x: Tensor, *args: Any, **kw: Any) -> Tensor:
    """aten / torch ``batch_norm(input, weight, bias, running_mean, running_var, training,
    momentum, eps, cudnn_enabled)`` or ``F.batch_norm(input, running_mean, running_var, weight,
    bias, training, momentum, eps)``."""
    if len(args) == 8 or "cudnn_enabled" in kw:
        w, b, rm, rv, training, momentum, eps = (list(args) + [None] * 7)[:7]
    else:
        names = ("running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        vals = dict(zip(names, args), **kw)
        rm, rv, w, b = (vals.get(k) for k in names[:4])
        training, momentum, eps = vals.get("training", False), vals.get("momentum", 0.1), vals.get("eps", 1e-5)
    if training and rm is not None:
        raise UnsupportedOpError(f"batch_norm in training mode with running statistics: {TRAINING_BN_HELP}")
    return N.batch_norm(x, rm, rv, w, b, bool(training), momentum, eps)


@op("_native_batch_norm_legit_no_training")
def _bn_no_training(x: Tensor, weight: Any, bias: Any, running_mean: Tensor, running_var: Tensor,
                    momentum: float, eps: float) -> tuple[Tensor, None, None]:
    return N.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), None, None


@op("_native_batch_norm_legit_functional")
def _bn_functional(x: Tensor, weight: Any, bias: Any, running_mean: Tensor, running_var: Tensor,
                   training: bool, momentum: float, eps: float) -> tuple[Any, ...]:
    """(output, batch mean, rstd, new running mean, new running var): the last two are the
    buffers' new values (the importer's BUFFER_MUTATION outputs)."""
    if not training:
        y = N.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps)
        return y, None, None, running_mean, running_var
    return N.batch_norm_train(x, running_mean, running_var, weight, bias, momentum, eps)


@op("_native_batch_norm_legit", "native_batch_norm")
def _bn_legit(x: Tensor, weight: Any, bias: Any, *rest: Any) -> tuple[Any, ...]:
    """``_native_batch_norm_legit(input, w, b, running_mean, running_var, training, momentum,
    eps)`` (in place on the running stats), its ``no_stats`` overload ``(input, w, b, training,
    momentum, eps)``, and ``native_batch_norm`` (as the first)."""
    if isinstance(rest[0], bool):  # no_stats
        training, momentum, eps = rest
        rm = rv = None
    else:
        rm, rv, training, momentum, eps = rest
    if not training:
        return N.batch_norm(x, rm, rv, weight, bias, False, momentum, eps), None, None
    if rm is not None:
        raise UnsupportedOpError(f"batch_norm in training mode with running statistics: {TRAINING_BN_HELP}")
    y, mean, rstd, _, _ = N.batch_norm_train(x, None, None, weight, bias, momentum, eps)
    return y, mean, rstd


@op("group_norm")
def _group_norm(x: Tensor, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5,
                *_: Any) -> Tensor:  # aten's cudnn_enabled changes no value
    return N.group_norm(x, num_groups, weight, bias, eps)


def norm_stats(x: Tensor, dims: tuple[int, ...], eps: float) -> tuple[Tensor, Tensor]:
    """A norm's saved statistics as torch's native norms return them: the mean and
    ``1 / sqrt(biased variance + eps)`` over ``dims`` (kept), in float32 for half data, then in
    x's dtype."""
    xf = x.to("float32") if x.dtype in ("float16", "bfloat16") else x
    mean = xf.mean(dims, True)
    var = ((xf - mean) * (xf - mean)).mean(dims, True)
    return mean.to(x.dtype), elementwise("rsqrt", var + eps).to(x.dtype)


@op("native_group_norm")
def _native_group_norm(x: Tensor, weight: Any, bias: Any, *sizes_group_eps: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)``: the sizes are x's; the
    output, and the mean and rstd of shape (N, group) (they were None, failing where read)."""
    group, eps = sizes_group_eps[3], sizes_group_eps[4]
    mean, rstd = norm_stats(x.reshape((x.shape[0], group, math.prod(x.shape[1:]) // group)), (2,), eps)
    return (N.group_norm(x, group, weight, bias, eps), mean.reshape(mean.shape[:2]),
            rstd.reshape(rstd.shape[:2]))


@op("instance_norm")
def _instance_norm(x: Tensor, *args: Any, **kw: Any) -> Tensor:
    """aten ``instance_norm(input, weight, bias, running_mean, running_var, use_input_stats,
    momentum, eps, cudnn_enabled)`` or ``F.instance_norm(input, running_mean, running_var,
    weight, bias, use_input_stats, momentum, eps)``."""
    if len(args) == 8 or "cudnn_enabled" in kw:
        w, b, rm, rv, use_input_stats, momentum, eps = (list(args) + [None] * 7)[:7]
    else:
        names = ("running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps")
        vals = dict(zip(names, args), **kw)
        rm, rv, w, b = (vals.get(k) for k in names[:4])
        use_input_stats = vals.get("use_input_stats", True)
        momentum, eps = vals.get("momentum", 0.1), vals.get("eps", 1e-5)
    if use_input_stats and rm is not None:
        raise UnsupportedOpError(f"instance_norm with track_running_stats in training mode: {TRAINING_BN_HELP}")
    return N.instance_norm(x, rm, rv, w, b, bool(use_input_stats), momentum, eps)


@op("logsumexp")
def _logsumexp(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    """``max + log(sum(exp(x - max)))`` over ``dim`` (an infinite max gives itself, as torch)."""
    if x.dtype not in ("float16", "bfloat16", "float32", "float64"):
        x = x.to("float32")
    dims = _norm_dims(x, dim if dim not in ((), []) else None)
    ls = LETTERS[:x.ndim]
    red = "".join(ls[d] for d in range(x.ndim) if d not in dims)
    m = einsum(f"{ls}->{red}", x, agg="max")
    s = einsum(f"{ls},{red}->{red}", x, m,
               join="exp(x0 - where(abs(x1) == inf, 0.0, stop_gradient(x1)))")
    y = einsum(f"{red},{red}->{red}", m, s,
               join="log(x1) + where(abs(x0) == inf, 0.0, stop_gradient(x0))")
    if keepdim:
        y = y.reshape(tuple(1 if d in dims else n for d, n in enumerate(x.shape)))
    return y


@op("linalg_vector_norm", "norm")
def _vector_norm(x: Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None,
                 p: Any = None) -> Tensor:
    """``torch.linalg.vector_norm`` / ``Tensor.norm(p, dim, keepdim)``: orders 2, 1, inf, -inf, 0
    and other positive numbers."""
    if p is not None:  # Tensor.norm(p=...)
        ord = p
    if ord is None or ord == "fro":
        ord = 2
    if isinstance(ord, str) or isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise UnsupportedOpError(f"norm with ord={ord!r} (numbers and 'fro' only)")
    o = float(ord)
    if dtype is not None:
        x = x.to(torch_dtype(dtype))
    if x.dtype not in ("float16", "bfloat16", "float32", "float64"):
        x = x.to("float32")
    if x.dtype in ("float16", "bfloat16"):  # torch sums in float32 and rounds once: the squares
        # of half data overflow where the norm fits (|x| > 256)
        return _vector_norm(x.to("float32"), o, dim, keepdim).to(x.dtype)
    dims = dim if dim not in ((), []) else None
    if o == 2:
        return root_at_zero((x * x).sum(dims, keepdim), "sqrt(x0)")
    if o == 1:
        return elementwise("abs", x).sum(dims, keepdim)
    if o == math.inf:
        return elementwise("abs", x).max(dims, keepdim)
    if o == -math.inf:
        return elementwise("abs", x).min(dims, keepdim)
    if o == 0:
        return (x != 0).to(x.dtype).sum(dims, keepdim)
    if o < 1:  # |x| ** o has an infinite derivative at 0: torch's backward masks it there (0, not NaN)
        from einjoin.ir.scalar import parse_join
        powers = elementwise(parse_join(f"where(x0 == 0, {0.0 if o > 0 else 'inf'}, abs(x0) ** {o!r})", 1), x,
                             name="abs_pow")
    else:
        powers = elementwise("pow", elementwise("abs", x), o)
    return root_at_zero(powers.sum(dims, keepdim), f"x0 ** {1.0 / o!r}")


def root_at_zero(s: Tensor, root: str) -> Tensor:
    """``root`` (a join over ``x0``: sqrt, a p-th root) of a sum of powers ``s``, whose gradient is
    0 where ``s`` is 0, as torch's norm and std backward masks it (the root's own derivative is
    infinite there: 0 * inf gave NaN gradients for a zero vector)."""
    from einjoin.ir.scalar import parse_join
    return elementwise(parse_join(f"where(x0 == 0, 0.0, {root})", 1), s, name="norm")


@op("_weight_norm")
def _weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Tensor:
    """``torch._weight_norm`` (nn.utils.parametrizations.weight_norm): ``v * g / ||v||``, the
    norm over every dim but ``dim`` (over all of them for ``dim=-1``), kept for broadcasting."""
    if dim == -1:
        axes: Any = None
    else:
        d = dim % v.ndim
        axes = [i for i in range(v.ndim) if i != d]
    norm = _vector_norm(v, 2, axes, True) if axes != [] else _vector_norm(v, 2, None, True) * 0 + abs(v)
    return v * (g / norm)


@op("baddbmm", "baddbmm_")
def _baddbmm(x: Tensor, b1: Tensor, b2: Tensor, *, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * x + alpha * (b1 @ b2)`` (beta 0: x is not read, as torch)."""
    y = einsum("bij,bjk->bik", b1, b2)
    if alpha != 1:
        y = y * alpha
    if beta == 0:
        return y
    return y + (x if beta == 1 else x * beta)


@op("addcmul", "addcmul_")
def _addcmul(x: Tensor, a: Tensor, b: Tensor, *, value: Any = 1) -> Tensor:
    return x + a * b * value if value != 1 else x + a * b


@op("addcdiv", "addcdiv_")
def _addcdiv(x: Tensor, a: Tensor, b: Tensor, *, value: Any = 1) -> Tensor:
    return x + a / b * value if value != 1 else x + a / b


@op("softmin")
def _softmin(x: Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> Tensor:
    from einjoin.frontend.composites import softmax
    return softmax(-x, dim if dim is not None else (0 if x.ndim in (0, 1, 3) else 1))


# ---------------------------------------------------------------- more elementwise functions


def _float_of(x: Tensor) -> Tensor:
    return x if x.dtype in ("float16", "bfloat16", "float32", "float64") else x.to("float32")


def _join(expr: str, name: str, floats: bool = True) -> Callable[..., Tensor]:
    """An elementwise translation written as one join over ``x0`` (the input in a float dtype
    when ``floats``); integer inputs of rounding functions are returned as they are."""
    def f(x: Tensor, *, decimals: int = 0) -> Tensor:
        if decimals and name == "round" and kind(x.dtype) == "float":
            return _round_decimals(x, int(decimals), f)
        if decimals:
            raise UnsupportedOpError(f"{name} with decimals={decimals}")
        if name in ("floor", "ceil", "round", "trunc") and kind(x.dtype) != "float":
            return x
        from einjoin.ir.scalar import parse_join
        return elementwise(parse_join(expr, 1), _float_of(x) if floats else x, name=name)
    return f


def _round_decimals(x: Tensor, decimals: int, round0: Callable[..., Tensor]) -> Tensor:
    """torch's ``round(x, decimals=k)``: ``round(x * 10**k) / 10**k`` (``round(x / 10**-k) *
    10**-k`` for k < 0), each step in x's dtype, half to even."""
    if x.dtype in ("float16", "bfloat16"):  # torch computes these in float32, one final rounding
        return _round_decimals(x.to("float32"), decimals, round0).to(x.dtype)
    p = float(10 ** abs(decimals))
    return round0(x * p) / p if decimals > 0 else round0(x / p) * p


# rounding has no gradient (torch: zero), so the value is a stop_gradient of the floor division
# (inf stays inf: inf // 1 is NaN)
_FLOOR = "stop_gradient(where(abs(x0) == inf, x0, x0 // 1))"
_TRUNC = "stop_gradient(where(abs(x0) == inf, x0, where(x0 < 0, -((-x0) // 1), x0 // 1)))"
_R = (f"where(x0 - {_FLOOR} > 0.5, {_FLOOR} + 1, where(x0 - {_FLOOR} < 0.5, "
      f"{_FLOOR}, where({_FLOOR} % 2 == 0, {_FLOOR}, {_FLOOR} + 1)))")
_ROUND = f"where({_R} == 0, x0 * 0, {_R})"  # a zero takes x's sign, as torch: round(-0.3) is -0.0
for _names, _expr in (
        (("floor", "floor_"), _FLOOR),
        (("ceil", "ceil_"), "stop_gradient(where(abs(x0) == inf, x0, -((-x0) // 1)))"),
        (("trunc", "trunc_", "fix"), _TRUNC),
        (("frac", "frac_"), f"x0 - {_TRUNC}"),
        # half to even, as torch.round
        (("round", "round_"), _ROUND),
        (("log1p", "log1p_"), "log1p(x0)"), (("expm1", "expm1_"), "expm1(x0)"),
        (("log2", "log2_"), f"log(x0) * {1 / math.log(2)!r}"), (("log10", "log10_"), f"log(x0) * {1 / math.log(10)!r}"),
        (("exp2", "exp2_"), "pow(2.0, x0)"), (("erfc", "erfc_", "special_erfc"), "1 - erf(x0)")):
    for _n in _names:
        NN_OPS[_n] = _join(_expr, _names[0])


@op("sign", "sgn", "sign_")
def _sign(x: Tensor) -> Tensor:
    if x.dtype == "bool":
        return x
    from einjoin.ir.scalar import parse_join  # NaN and -0.0 give 0, as torch
    y = elementwise(parse_join("where(x0 > 0, 1, where(x0 < 0, -1, 0))", 1), x, name="sign")  # int64
    return y if y.dtype == x.dtype else y.to(x.dtype)  # no gradient: a where of constants


@op("isnan")
def _isnan(x: Tensor) -> Tensor:
    return x != x


@op("isinf")
def _isinf(x: Tensor) -> Tensor:
    return elementwise("abs", x) == math.inf if x.dtype in ("float16", "bfloat16", "float32", "float64") \
        else F_full_like_bool(x, False)


@op("isfinite")
def _isfinite(x: Tensor) -> Tensor:
    if x.dtype not in ("float16", "bfloat16", "float32", "float64"):
        return F_full_like_bool(x, True)
    return (x == x) & (elementwise("abs", x) != math.inf)


def F_full_like_bool(x: Tensor, v: bool) -> Tensor:  # noqa: N802 (reads as the torch call it is)
    from einjoin.frontend.functions import full
    return full(x.shape, v, "bool")


@op("nan_to_num", "nan_to_num_")
def _nan_to_num(x: Tensor, nan: Any = 0.0, posinf: Any = None, neginf: Any = None) -> Tensor:
    """NaN to ``nan``, +-inf to ``posinf`` / ``neginf`` (default: the dtype's largest / smallest)."""
    if x.dtype not in ("float16", "bfloat16", "float32", "float64"):
        return x
    import ml_dtypes
    import numpy as np
    info = ml_dtypes.finfo(x.dtype) if x.dtype == "bfloat16" else np.finfo(x.dtype)
    hi = float(info.max) if posinf is None else float(posinf)
    lo = float(info.min) if neginf is None else float(neginf)
    from einjoin.ir.scalar import parse_join
    expr = f"where(x0 != x0, {float(nan or 0.0)!r}, where(x0 == inf, {hi!r}, where(x0 == -inf, {lo!r}, x0)))"
    return elementwise(parse_join(expr, 1), x, name="nan_to_num")


@op("logical_xor")
def _xor(a: Any, b: Any) -> Tensor:
    if not isinstance(a, Tensor) or a.dtype != "bool" or not isinstance(b, Tensor) or b.dtype != "bool":
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            return a.to("bool") != b.to("bool")
        raise UnsupportedOpError("logical_xor of a tensor and a number")
    return a != b


@op("bitwise_xor", "__xor__")
def _bitwise_xor(a: Any, b: Any) -> Tensor:
    # bool tensors only, as bitwise_and / bitwise_or: the bits of integers are not a join
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype == "bool":
        return a != b
    kinds = [x.dtype if isinstance(x, Tensor) else type(x).__name__ for x in (a, b)]
    raise DTypeError(f"bitwise_xor of {kinds[0]} and {kinds[1]}: bool tensors only (integer bits are not "
                     f"translated)")


@op("lerp", "lerp_")
def _lerp(a: Tensor, b: Tensor, w: Any) -> Tensor:
    out: Tensor = a + (b - a) * w
    return out


@op("hypot")
def _hypot(a: Tensor, b: Tensor) -> Tensor:
    """``sqrt(a**2 + b**2)`` without overflow or underflow, as torch's (C's ``hypot``): scaled by
    ``m = max(|a|, |b|)`` (squares of float32 values beyond ~1e19 overflow to inf), inf where
    either is infinite (even with a NaN), 0 where both are 0 (written as ``sqrt(x0 * x0 + x1 * x1)``,
    whose gradient there is NaN, torch's ``grad * a / result``)."""
    from einjoin.ir.scalar import parse_join
    m = "max(abs(x0), abs(x1))"
    expr = (f"where(abs(x0) == inf, inf, where(abs(x1) == inf, inf, where({m} == 0, sqrt(x0 * x0 + x1 * x1), "
            f"{m} * sqrt((x0 / {m}) * (x0 / {m}) + (x1 / {m}) * (x1 / {m})))))")
    return elementwise(parse_join(expr, 2), a, b, name="hypot")


@op("fmax")
def _fmax(a: Tensor, b: Tensor) -> Tensor:
    """The maximum ignoring NaN (NaN only where both are)."""
    from einjoin.ir.scalar import parse_join
    if a.dtype == b.dtype == "bool":  # no NaN; max does not take bools, torch gives a | b
        return elementwise(parse_join("where(x0, x0, x1)", 2), a, b, name="fmax")
    # a where, not max: torch's gradient goes wholly to a at a tie (max's splits it), and a tie
    # of signed zeros gives a's, as torch's value
    return elementwise(parse_join("where((x0 >= x1) | (x1 != x1), x0, x1)", 2), a, b, name="fmax")


@op("fmin")
def _fmin(a: Tensor, b: Tensor) -> Tensor:
    from einjoin.ir.scalar import parse_join
    if a.dtype == b.dtype == "bool":  # torch gives a & b
        return elementwise(parse_join("where(x0, x1, x0)", 2), a, b, name="fmin")
    return elementwise(parse_join("where((x0 <= x1) | (x1 != x1), x0, x1)", 2), a, b, name="fmin")


# ---------------------------------------------------------------- activations


def _no_inplace(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """F.relu6(x, inplace) etc.: a trailing bool ``inplace`` changes no value."""
    def f(x: Tensor, *args: Any, inplace: bool = False, **kw: Any) -> Tensor:
        if args and isinstance(args[-1], bool):
            args = args[:-1]
        return fn(x, *args, **kw)
    return f


_ACTS: tuple[tuple[tuple[str, ...], Callable[..., Tensor]], ...] = (
    (("softplus",), A.softplus), (("mish", "mish_"), A.mish),
    (("hardswish", "hardswish_"), A.hardswish), (("hardsigmoid", "hardsigmoid_"), A.hardsigmoid),
    (("selu", "selu_"), A.selu), (("celu", "celu_"), A.celu),
    (("leaky_relu", "leaky_relu_"), A.leaky_relu), (("relu6", "relu6_"), A.relu6),
    (("hardtanh", "hardtanh_"), A.hardtanh), (("log_sigmoid", "logsigmoid"), A.log_sigmoid),
    (("softsign",), A.softsign), (("threshold", "threshold_", "_threshold"), A.threshold),
    (("prelu", "_prelu_kernel"), A.prelu), (("glu",), A.glu))
for _act_names, _fn in _ACTS:
    for _n in _act_names:
        NN_OPS[_n] = _no_inplace(_fn)


@op("elu", "elu_")
def _elu(x: Tensor, alpha: float = 1.0, scale: Any = 1.0, input_scale: Any = 1.0, *, inplace: bool = False) -> Tensor:
    """aten ``elu(self, alpha, scale, input_scale)`` or ``F.elu(input, alpha, inplace)``."""
    if isinstance(scale, bool):  # F.elu's inplace
        scale = 1.0
    if scale == 1.0 and input_scale == 1.0:
        return A.elu(x, alpha)
    s, i, a = float(scale), float(input_scale), float(alpha)
    from einjoin.ir.scalar import parse_join
    return elementwise(parse_join(f"where(x0 > 0, x0 * {s!r}, {a * s!r} * expm1(x0 * {i!r}))", 1), x, name="elu")


@op("log_sigmoid_forward")
def _log_sigmoid_forward(x: Tensor) -> tuple[Tensor, None]:
    return A.log_sigmoid(x), None


# ---------------------------------------------------------------- losses


def _loss(fn: Callable[..., Tensor], extra: str | None) -> Callable[..., Tensor]:
    """aten ``loss(self, target, reduction: int, extra)`` or ``F.loss(input, target, size_average,
    reduce, reduction, extra)`` (smooth_l1's ``beta``; l1's F form has ``weight`` there)."""
    def f(x: Tensor, target: Tensor, third: Any = None, fourth: Any = None, fifth: Any = None, sixth: Any = None,
          **kw: Any) -> Tensor:
        if kw.get("weight") is not None:
            raise UnsupportedOpError(f"{fn.__name__} with weight=")
        ex = {} if extra is None else {extra: kw.get(extra, 1.0)}
        if _is_enum(third):  # the ATen form
            if extra is not None and fourth is not None:
                ex[extra] = fourth
            return fn(x, target, L._reduction(third, fn.__name__), **ex)
        size_average = third if third is not None else kw.get("size_average")
        reduce = fourth if fourth is not None else kw.get("reduce")
        reduction = fifth if fifth is not None else kw.get("reduction", "mean")
        if extra is not None and sixth is not None:
            ex[extra] = sixth
        return fn(x, target, L._reduction(L._legacy(size_average, reduce, reduction), fn.__name__), **ex)
    return f


NN_OPS["l1_loss"] = _loss(L.l1_loss, None)
NN_OPS["smooth_l1_loss"] = _loss(L.smooth_l1_loss, "beta")


@op("huber_loss")
def _huber(x: Tensor, target: Tensor, reduction: Any = "mean", delta: float = 1.0, weight: Any = None) -> Tensor:
    # the ATen form and F.huber_loss share the order (an int or a str reduction)
    if weight is not None:
        raise UnsupportedOpError("huber_loss with weight=")
    return L.huber_loss(x, target, L._reduction(reduction, "huber_loss"), delta)


@op("binary_cross_entropy_with_logits")
def _bce_logits(x: Tensor, target: Tensor, weight: Any = None, a3: Any = None, a4: Any = None, a5: Any = None,
                a6: Any = None, *, size_average: Any = None, reduce: Any = None, reduction: Any = "mean",
                pos_weight: Any = None) -> Tensor:
    """aten ``(self, target, weight, pos_weight, reduction: int)`` or ``F.(input, target, weight,
    size_average, reduce, reduction, pos_weight)``."""
    if isinstance(a3, Tensor) or _is_enum(a4):
        pos_weight = a3
        reduction = a4 if a4 is not None else 1
    else:
        size_average = a3 if a3 is not None else size_average
        reduce = a4 if a4 is not None else reduce
        reduction = a5 if a5 is not None else reduction
        pos_weight = a6 if a6 is not None else pos_weight
        reduction = L._legacy(size_average, reduce, reduction)
    return L.binary_cross_entropy_with_logits(x, target, weight, L._reduction(reduction, "bce_with_logits"),
                                              pos_weight)


@op("binary_cross_entropy")
def _bce(x: Tensor, target: Tensor, weight: Any = None, a3: Any = None, a4: Any = None, a5: Any = None, *,
         size_average: Any = None, reduce: Any = None, reduction: Any = "mean") -> Tensor:
    """aten ``(self, target, weight, reduction: int)`` or ``F.(input, target, weight,
    size_average, reduce, reduction)``."""
    if _is_enum(a3):
        reduction = a3
    else:
        size_average = a3 if a3 is not None else size_average
        reduce = a4 if a4 is not None else reduce
        reduction = L._legacy(size_average, reduce, a5 if a5 is not None else reduction)
    return L.binary_cross_entropy(x, target, weight, L._reduction(reduction, "binary_cross_entropy"))


@op("kl_div")
def _kl_div(x: Tensor, target: Tensor, a2: Any = None, a3: Any = None, a4: Any = None, a5: Any = None, *,
            size_average: Any = None, reduce: Any = None, reduction: Any = "mean", log_target: bool = False) -> Tensor:
    """aten ``(self, target, reduction: int, *, log_target)`` or ``F.(input, target,
    size_average, reduce, reduction, log_target)``."""
    if _is_enum(a2):
        return L.kl_div(x, target, L._reduction(a2, "kl_div"), log_target)
    size_average = a2 if a2 is not None else size_average
    reduce = a3 if a3 is not None else reduce
    reduction = a4 if a4 is not None else reduction
    log_target = a5 if a5 is not None else log_target
    if reduction != "batchmean":
        reduction = L._legacy(size_average, reduce, reduction)
    if reduction == "batchmean" and (size_average is not None or reduce is not None):
        raise EinjoinError("kl_div: reduction='batchmean' with the legacy size_average / reduce flags")
    return L.kl_div(x, target, reduction, bool(log_target))
