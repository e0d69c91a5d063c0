"""The op table of the torch importer: each ATen op (as ``torch.export`` emits it) and each torch
function / tensor method / ``nn`` module (as ``torch.fx.symbolic_trace`` records it) written with
the frontend. Data, not code paths: :data:`OPS` maps a name to a translation; ``einjoin.frontend.torch``
walks the graph and looks names up here.

A translation takes the call's arguments with graph values already replaced by einjoin tensors
(and Python numbers, shapes, dtypes left as they are) and returns einjoin tensors (or tuples).

>>> import numpy as np, einjoin as ej
>>> from einjoin.frontend.aten import OPS
>>> x = ej.input("x", (2, 3))
>>> y = OPS["masked_fill"](x, ej.causal_mask(2, 3), 0.0)
>>> ej.reference(y, x=np.ones((2, 3), np.float32)).tolist()
[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
"""

from __future__ import annotations

import builtins
import math
import operator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import Callable

from einjoin.errors import EinjoinError, ShapeError, UnsupportedOpError
from einjoin.frontend import composites as C
from einjoin.frontend import functions as F
from einjoin.frontend.aten_notes import DATA_DEPENDENT, DATA_DEPENDENT_HELP, NOTES, data_dependent
from einjoin.frontend.aten_index import INDEX_OPS
from einjoin.frontend.aten_nn import NN_OPS, norm_stats, root_at_zero
from einjoin.frontend.recurrent import RECURRENT_OPS
from einjoin.frontend.resize import RESIZE_OPS
from einjoin.frontend.aten_conv import CONV_OPS
from einjoin.frontend.aten_bits import BITS_OPS, floor_div, trunc_div
from einjoin.frontend.aten_math import MATH_OPS
from einjoin.frontend.aten_compose import compose_ops
from einjoin.frontend.aten_layout import LAYOUT_OPS, _dims, _shape, torch_dtype
from einjoin.frontend.losses import LOSS_OPS
from einjoin.frontend.tensor import Tensor, elementwise
from einjoin.ir.dtypes import FLOAT_DTYPES, kind
from einjoin.registry import registrar

__all__ = ["OPS", "NO_OPS", "DATA_DEPENDENT", "DATA_DEPENDENT_HELP", "NOTES", "torch_dtype", "data_dependent",
           "DROPOUT", "DROPOUT_SEED", "DropoutSites"]

Fn = Callable[..., Any]
OPS: dict[str, Fn] = {}
# ops that only check metadata or return nothing: skipped
NO_OPS = frozenset({"_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range",
                    "sym_constrain_range_for_size", "_check_is_size"})
_F = TypeVar("_F", bound=Fn)


op = registrar(OPS)  # @op("name", "alias"): a translation into OPS


def _is_t(v: Any) -> bool:
    return isinstance(v, Tensor)


def _dtype(kw: dict[str, Any], default: str) -> str:
    """A factory's dtype (BLOOM's int32 arange is int32, as torch's)."""
    dt = kw.get("dtype")
    return default if dt is None else torch_dtype(dt)


# ------------------------------------------------------------------ arithmetic


def _arith(py: Fn, fn: str) -> Fn:
    def f(a: Any, b: Any, alpha: Any = 1, **_: Any) -> Any:
        if not _is_t(a) and not _is_t(b):
            return py(a, b)  # shape arithmetic in fx graphs
        if alpha != 1:
            b = b * alpha
        return elementwise(fn, a, b)
    return f


op("add", "iadd")(_arith(operator.add, "add"))
op("sub", "isub")(_arith(operator.sub, "sub"))
op("mul", "imul")(_arith(operator.mul, "mul"))


@op("div", "truediv", "true_divide", "itruediv")
def _div(a: Any, b: Any, rounding_mode: Any = None, **_: Any) -> Any:
    if not _is_t(a) and not _is_t(b):
        return a / b
    if rounding_mode == "floor":
        q = floor_div(a, b)
        # torch's gradient through div(rounding_mode="floor") is 0, through floor_divide (//, the
        # same join) there is none: the stop tells ej.grad which one this is
        return elementwise("stop_gradient", q) if kind(q.dtype) == "float" else q
    if rounding_mode == "trunc":
        return trunc_div(a, b)
    if rounding_mode is not None:
        raise UnsupportedOpError(f"div with rounding_mode={rounding_mode!r}")
    return elementwise("div", a, b)


@op("floordiv", "floor_divide")
def _floordiv(a: Any, b: Any) -> Any:
    if _is_t(a) or _is_t(b):
        return floor_div(a, b)
    return a // b


@op("remainder", "mod")
def _remainder(a: Any, b: Any) -> Any:
    if _is_t(a) or _is_t(b):
        return elementwise("mod", a, b)
    return a % b


@op("rsub")
def _rsub(a: Any, b: Any, alpha: Any = 1) -> Any:
    return elementwise("sub", b, a * alpha if alpha != 1 else a)


@op("neg")
def _neg(a: Any) -> Any:
    return -a


@op("pow")
def _pow(a: Any, b: Any) -> Any:
    if _is_t(a) and not _is_t(b) and b == 2:
        return a * a
    return elementwise("pow", a, b)


@op("square")
def _square(a: Tensor) -> Tensor:
    if a.dtype == "bool":  # torch: pow(bool, 2) is int64 (a * a of bools would stay bool)
        a = a.to("int64")
    return a * a


for _name in ("exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "relu", "tanh", "sigmoid", "sin",
              "cos", "silu", "erf"):
    OPS[_name] = (lambda fn: lambda x, *a, **k: elementwise(fn, x))(_name)
OPS["relu_"] = OPS["relu"]
OPS["silu_"] = OPS["silu"]


@op("gelu")
def _gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return C.gelu(x, approximate)


for _name, _fn in (("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge"),
                   ("logical_and", "logical_and"), ("logical_or", "logical_or"),
                   ("bitwise_and", "logical_and"), ("bitwise_or", "logical_or"),
                   ("and_", "logical_and"), ("or_", "logical_or")):
    OPS[_name] = (lambda fn: lambda a, b: elementwise(fn, a, b))(_fn)


@op("logical_not", "bitwise_not", "invert")
def _not(x: Tensor) -> Tensor:
    if x.dtype != "bool":
        raise UnsupportedOpError(f"bitwise not of a {x.dtype} tensor (only bool masks)")
    return elementwise("logical_not", x)


@op("where")
def _where(cond: Tensor, a: Any = None, b: Any = None) -> Tensor:
    if a is None or b is None:
        raise data_dependent("where(cond) with one argument (it returns the indices of the true elements)")
    return F.where(cond, a, b)


@op("maximum", "max.other")
def _maximum(a: Any, b: Any) -> Tensor:
    return F.maximum(a, b)


@op("minimum")
def _minimum(a: Any, b: Any) -> Tensor:
    return F.minimum(a, b)


@op("clamp", "clip")
def _clamp(x: Tensor, min: Any = None, max: Any = None) -> Tensor:
    """torch's clamp: the value ``min(max(x, min), max)`` (NaN anywhere gives NaN); the gradient
    is clamp_backward's, not that of maximum/minimum (whose tie rule halves it at a bound)."""
    lo = x if min is None else F.maximum(x, min)
    out = lo if max is None else F.minimum(lo, max)
    if out.dtype not in FLOAT_DTYPES:
        return out  # no gradient to route (and stop_gradient is for floats only)
    # x gets the whole gradient where min <= x <= max (none at NaN); a tensor bound gets it
    # where x < min < max (min), x > max or max < min (max); torch's masks, NaN bounds included
    keep = x == x
    if min is not None:
        keep = keep & (x >= min)
    if max is not None:
        keep = keep & (x <= max)
    fixed = elementwise("stop_gradient", out)
    if not isinstance(min, Tensor) and not isinstance(max, Tensor):
        return F.where(keep, x, fixed)  # a tie keeps x's signed zero, as torch's scalar clamp

    def carry(t: Tensor) -> Tensor:
        # out's value bitwise (out - +0.0 is out: a tie at a tensor bound gives the bound's
        # signed zero, as torch) with t's gradient; an infinite t (t - t is NaN) is out's
        # value where it equals out (else out is NaN: no gradient there)
        return F.where(t - t == 0, fixed - (elementwise("stop_gradient", t) - t),
                       F.where(t == fixed, t, fixed))

    y = fixed
    if isinstance(max, Tensor):
        y = F.where(x > max if min is None else (x > max) | (max < min), carry(max), y)
    if isinstance(min, Tensor):
        y = F.where(x < min if max is None else (x < min) & (min < max), carry(min), y)
    return F.where(keep, carry(x), y)


@op("clamp_min", "clamp_min_")
def _clamp_min(x: Tensor, m: Any) -> Tensor:
    return _clamp(x, min=m)  # clamp's gradient: the whole of it to x at x == m (max's split it)


@op("clamp_max", "clamp_max_")
def _clamp_max(x: Tensor, m: Any) -> Tensor:
    return _clamp(x, max=m)


# ------------------------------------------------------------------ contractions


@op("linear")
def _linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return C.linear(x, w, b)


@op("matmul", "mm", "bmm", "matmul_")
def _matmul(a: Tensor, b: Tensor) -> Tensor:
    return F.matmul(a, b)


@op("addmm")
def _addmm(bias: Tensor, a: Tensor, b: Tensor, beta: Any = 1, alpha: Any = 1) -> Tensor:
    """``beta * bias + alpha * (a @ b)`` (beta 0: bias is not read, so its nan / inf do not
    propagate, as torch)."""
    y = F.matmul(a, b)
    if alpha != 1:
        y = y * alpha
    if beta == 0:
        return y
    return y + (bias * beta if beta != 1 else bias)


@op("einsum")
def _einsum(equation: str, *operands: Any, path: Any = None) -> Tensor:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) == 1 and isinstance(operands[0], Tensor) and operands[0].dtype in _NARROW_SUMMED \
            and _sums(equation):
        # torch sums one operand with torch.sum: bools and narrow ints give int64 (two or more
        # operands contract in their own dtype, as einjoin's einsum)
        operands = (operands[0].to("int64"),)
    return F.einsum(equation, *operands)


_NARROW_SUMMED = frozenset({"bool", "int8", "int16", "int32", "uint8"})


def _sums(equation: str) -> bool:
    """Whether a one-operand einsum equation sums a label away (``ij->i``, implicit ``ii``)."""
    lhs, _, rhs = equation.replace(" ", "").partition("->")
    labels = [c for c in lhs if c.isalpha()]
    out = set(rhs) if "->" in equation else {c for c in labels if labels.count(c) == 1}
    return any(c not in out for c in labels)


# ------------------------------------------------------------------ reductions and composites


def _reduction(name: str) -> Fn:
    def f(x: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
        dt = None if dtype is None else torch_dtype(dtype)
        if dt is not None:
            x = x.to(dt)
        y: Tensor = getattr(x, name)(_dims(dim), keepdim)
        # sum(dtype=torch.int32): einjoin sums narrow ints in int64 (torch's default); the
        # int32 sum is that one wrapped (sums and products commute with wrapping)
        return y.to(dt) if dt is not None and y.dtype != dt else y
    return f


OPS["sum"] = _reduction("sum")


@op("mean")
def _mean(x: Tensor, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Tensor:
    if dtype is None and isinstance(x, Tensor) and x.dtype not in FLOAT_DTYPES:
        # torch refuses (the fx capture does not run the op, so it reaches here): einjoin's own
        # mean of ints is float32, which torch never gives
        raise UnsupportedOpError(f"mean of a {x.dtype} tensor: torch refuses it too (\"could not infer "
                                 f"output dtype\"); pass dtype=torch.float32 or cast the input to a float")
    y: Tensor = _MEAN(x, dim, keepdim, dtype=dtype)
    return y


_MEAN = _reduction("mean")


OPS["prod"] = _reduction("prod")
OPS["amax"] = _reduction("max")
OPS["amin"] = _reduction("min")


def _truth_dtype(x: Tensor, y: Tensor) -> Tensor:
    return y.to("uint8") if x.dtype == "uint8" else y  # torch's any/all of uint8 are uint8 0/1


@op("any")
def _any(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _truth_dtype(x, x.to("bool").max(_dims(dim), keepdim))


@op("all")
def _all(x: Tensor, dim: Any = None, keepdim: bool = False) -> Tensor:
    return _truth_dtype(x, x.to("bool").min(_dims(dim), keepdim))


@op("var")
def _var(x: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,
         correction: Any = None) -> Tensor:
    if isinstance(dim, bool):  # var(x, unbiased) (aten.var.default): the flag in dim's place
        dim, unbiased = None, dim
    if x.dtype in ("float16", "bfloat16"):  # torch computes in float32 and rounds once: the
        # mean of half data in half loses x - mean where the mean is large against the spread
        return _var(x.to("float32"), dim, unbiased, keepdim, correction=correction).to(x.dtype)
    dims = _dims(dim)
    n = math.prod(x.shape) if dims is None else math.prod(
        x.shape[d] for d in ((dims,) if isinstance(dims, int) else dims))
    corr = 1 if correction is None and unbiased in (None, True) else (0 if correction is None else correction)
    mu = x.mean(dims, True)
    # torch divides by max(0, n - correction): no degrees of freedom give nan (0/0) or inf
    dof = builtins.max(n - corr, 0)
    return ((x - mu) * (x - mu)).sum(dims, keepdim) * (1.0 / dof if dof else math.inf)


@op("std")
def _std(x: Tensor, dim: Any = None, unbiased: Any = None, keepdim: bool = False, *,
         correction: Any = None) -> Tensor:
    """torch.std: the square root of :func:`_var`, in float32 for half data (its variance can
    pass 65504 where the std fits: [-300, 300, 0] has std 300)."""
    if x.dtype in ("float16", "bfloat16"):
        return _std(x.to("float32"), dim, unbiased, keepdim, correction=correction).to(x.dtype)
    return root_at_zero(_var(x, dim, unbiased, keepdim, correction=correction), "sqrt(x0)")


def softmax_dim(x: Tensor, dim: Any) -> int:
    """A softmax's dim; ``None`` (``F.softmax(x)``, ``nn.Softmax()``) is torch's legacy rule: dim 0
    for a 0-, 1- or 3-d input, else 1."""
    return int(dim) if dim is not None else (0 if x.ndim in (0, 1, 3) else 1)


def _softmax_input(x: Tensor, third: Any, dtype: Any) -> Tensor:
    """A softmax's input in the dtype it computes in. The third positional argument is
    ``aten.softmax.int``'s dtype (``torch.softmax(x, -1, dtype=torch.float32)`` exports it there)
    or ``aten._softmax``'s ``half_to_float`` flag (a half input gives float32)."""
    if dtype is None and third is not None and not isinstance(third, bool):
        dtype = third
    if dtype is not None:
        return x.to(torch_dtype(dtype))
    if third is True and x.dtype in ("float16", "bfloat16"):
        return x.to("float32")
    return x


@op("softmax", "_softmax")
def _softmax(x: Tensor, dim: Any = None, third: Any = None, *, dtype: Any = None, **_: Any) -> Tensor:
    x = _softmax_input(x, third, dtype)
    return C.softmax(x, softmax_dim(x, dim))


@op("log_softmax", "_log_softmax")
def _log_softmax(x: Tensor, dim: Any = None, third: Any = None, *, dtype: Any = None,
                 **_: Any) -> Tensor:
    x = _softmax_input(x, third, dtype)
    return C.log_softmax(x, softmax_dim(x, dim))


@op("layer_norm")
def _layer_norm(x: Tensor, normalized_shape: Any, weight: Any = None, bias: Any = None,
                eps: float = 1e-5, *_: Any) -> Tensor:
    return C.layer_norm(x, normalized_shape, weight, bias, eps)


@op("native_layer_norm")
def _native_layer_norm(x: Tensor, normalized_shape: Any, weight: Any, bias: Any, eps: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rstd)``; the statistics over the normalized dims kept as 1s (they were None:
    a forward reading them failed with 'cannot combine an einjoin tensor with NoneType')."""
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    mean, rstd = norm_stats(x, tuple(range(x.ndim - len(ns), x.ndim)), eps)
    # torch's mean and rstd of a layer norm carry no gradient (its group norm's do)
    return (C.layer_norm(x, normalized_shape, weight, bias, eps), elementwise("stop_gradient", mean),
            elementwise("stop_gradient", rstd))



@op("rms_norm")
def _rms_norm(x: Tensor, normalized_shape: Any, weight: Any = None, eps: Any = None) -> Tensor:
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if eps is None:
        eps = float(_finfo_eps(x.dtype))  # torch's default: the dtype's machine epsilon
    if len(ns) == 1:
        return C.rms_norm(x, weight, eps)
    lead = x.shape[:x.ndim - len(ns)]
    y = C.rms_norm(x.reshape(lead + (math.prod(ns),)), None, eps).reshape(x.shape)
    return y if weight is None else y * weight


def _finfo_eps(dtype: str) -> float:
    import numpy as np
    import ml_dtypes
    return float(ml_dtypes.finfo(dtype).eps) if dtype == "bfloat16" else float(np.finfo(dtype).eps)


@op("embedding")
def _embedding(a: Tensor, b: Tensor, *rest: Any, functional: bool = False, **kw: Any) -> Tensor:
    """aten ``embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False)``
    (torch.export, ``torch.embedding``) or, with ``functional`` (torch.fx's call of the function
    ``F.embedding``), ``F.embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
    scale_grad_by_freq=False, sparse=False)``. Told by how it was called, not by dtypes: an
    integer table (a lookup of ids) read its values as the indices, silently."""
    if functional:
        return _f_embedding(a, b, *rest, **kw)
    return embedding(a, b, *rest, **kw)


def _f_embedding(indices: Tensor, weight: Tensor, padding_idx: int | None = None, max_norm: Any = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, *_: Any, **__: Any) -> Tensor:
    if max_norm is not None:
        raise UnsupportedOpError("embedding with max_norm= (torch renormalises the weight rows in place "
                                 "during the forward) is not supported")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]  # as F.embedding
    return embedding(weight, indices, -1 if padding_idx is None else padding_idx, scale_grad_by_freq)


def embedding(weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              *_: Any, **__: Any) -> Tensor:
    """Rows of ``weight`` picked by ``indices`` (aten's arguments); the row ``padding_idx`` (if
    not -1) gets no gradient, as torch's embedding_backward (its value is read as is).
    ``sparse`` (the gradient's storage format in torch) changes no value: it is ignored."""
    if scale_grad_by_freq:
        raise UnsupportedOpError("embedding with scale_grad_by_freq=True (each row's gradient divided by "
                                 "its count in the batch) is not supported")
    y = F.gather(weight, indices)
    if padding_idx == -1 or weight.dtype not in FLOAT_DTYPES:
        return y
    # the same value either way; where the index is the padding row, the gradient is stopped
    pad = (indices == padding_idx).reshape(indices.shape + (1,) * (weight.ndim - 1))
    return F.where(pad, elementwise("stop_gradient", y), y)


DROPOUT_SEED = "dropout_seed"
"""The name of the int64 scalar graph input that seeds an imported module's training-mode dropouts."""


@dataclass
class DropoutSites:
    """The training-mode dropouts met while importing one module: the seed input they share and
    how many there were (each gets its own mask stream, in graph order)."""

    seed: Tensor | None = None
    count: int = 0

    def mask_stream(self) -> tuple[Tensor, int]:
        if self.seed is None:
            self.seed = F.input(DROPOUT_SEED, (), "int64")
        self.count += 1
        return self.seed, self.count - 1


DROPOUT: ContextVar[DropoutSites | None] = ContextVar("einjoin_dropout_sites", default=None)
"""Set by ``from_torch`` around a translation; outside one, each training-mode dropout starts a
fresh :class:`DropoutSites` (stream 0)."""


@op("dropout", "dropout_")
def _dropout(x: Tensor, p: float = 0.5, train: bool = False, inplace: bool = False) -> Tensor:
    if not train or p == 0:
        return x
    sites = DROPOUT.get() or DropoutSites()
    seed, stream = sites.mask_stream()
    return F.dropout(x, p, seed, True, stream)


@op("native_dropout")
def _native_dropout(x: Tensor, p: float = 0.5, train: Any = None) -> tuple[Tensor, Tensor]:
    """ATen's dropout returning (output, keep mask): what torch.export's functionalisation turns a
    training-mode ``dropout`` into (a forward that also writes buffers: BatchNorm beside a
    Dropout). ``train=None`` means training, as ATen's."""
    if train is False or p == 0:
        return x, F.full(x.shape, True, "bool")
    sites = DROPOUT.get() or DropoutSites()
    seed, stream = sites.mask_stream()
    keep = F.dropout_mask(x.shape, p, seed, stream) if p < 1 else F.full(x.shape, False, "bool")
    return F.dropout(x, p, seed, True, stream), keep


@op("feature_dropout", "alpha_dropout")
def _other_dropout(x: Tensor, p: float = 0.5, train: bool = False, inplace: bool = False) -> Tensor:
    if train and p > 0:
        raise UnsupportedOpError(f"feature/alpha dropout with p={p} in training mode; call module.eval() "
                                 f"first (plain dropout is translated in training mode)")
    return x


def _sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Tensor:
    if dropout_p:
        raise UnsupportedOpError(f"scaled_dot_product_attention with dropout_p={dropout_p}")
    mask = attn_mask
    if mask is not None and mask.dtype not in ("bool", q.dtype):
        # torch's contract: "attn_mask dtype to be bool or to match query dtype". torch 2.13's
        # CPU kernel does not check it and returns wrong values for some mask shapes (a float32
        # (s, t) causal mask with float64 queries: off by more than 1); refuse rather than differ
        raise UnsupportedOpError(
            f"scaled_dot_product_attention: attn_mask is {mask.dtype} but the queries are {q.dtype}; "
            f"torch requires a bool mask or one of the queries' dtype (build the mask with "
            f"dtype=query.dtype, or convert the model and its masks together)")
    # one fused node (torch's kernels in its blocks): top-left causal, bool or additive masks, and
    # a query with no allowed key gets zeros, all as torch's sdpa
    return C.fused_attention(q, k, v, mask, bool(is_causal), scale)


OPS["scaled_dot_product_attention"] = _sdpa


@op("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention")
def _sdpa_flash(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
                *_: Any, attn_mask: Any = None, scale: Any = None, **__: Any) -> tuple[Any, ...]:
    # (output, logsumexp): the second is only read by the backward pass
    return (_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale), None)


# ------------------------------------------------------------------ dtype


@op("to", "_to_copy", "type", "to_copy")
def _to(x: Tensor, *args: Any, dtype: Any = None, **_: Any) -> Tensor:
    for a in args:  # to(device), to(dtype), to(device, dtype), to(other)
        if _is_t(a):
            dtype = a.dtype
        elif "dtype" in type(a).__name__:
            dtype = a
    if dtype is None:
        return x
    return _cast(x, torch_dtype(dtype) if not isinstance(dtype, str) else dtype)


def _cast(x: Tensor, dtype: str) -> Tensor:
    """A cast into the real dtype (RoBERTa's int32 position ids stay int32, so later arithmetic
    wraps as torch's); the IR's cast wraps as torch's (200 -> int8 is -56, -1 -> uint8 255)."""
    return x.to(dtype)


@op("type_as")
def _type_as(x: Tensor, other: Tensor) -> Tensor:
    return x.to(other.dtype)


for _name, _dt in (("float", "float32"), ("double", "float64"), ("half", "float16"),
                   ("bfloat16", "bfloat16"), ("long", "int64"), ("int", "int32"), ("short", "int16"),
                   ("char", "int8"), ("byte", "uint8"), ("bool", "bool")):
    OPS[_name] = (lambda dt: lambda x, *a, **k: _cast(x, dt))(_dt)


# ------------------------------------------------------------------ factories (fold to constants)


@op("ones", "new_ones")
def _ones(*args: Any, **kw: Any) -> Tensor:
    if args and _is_t(args[0]):
        kw.setdefault("dtype", None)
        return F.ones(_shape(args[1:]), _dtype(kw, args[0].dtype))
    return F.ones(_shape(args), _dtype(kw, "float32"))


@op("zeros", "new_zeros")
def _zeros(*args: Any, **kw: Any) -> Tensor:
    if args and _is_t(args[0]):
        return F.zeros(_shape(args[1:]), _dtype(kw, args[0].dtype))
    return F.zeros(_shape(args), _dtype(kw, "float32"))


@op("empty", "new_empty")
def _empty(*args: Any, **kw: Any) -> Tensor:
    """torch.empty: values torch leaves unspecified (read only after a copy_ / fill_ / slice
    assignment, which functionalisation turns into ops on this tensor): zeros here."""
    return _zeros(*args, **kw)


def _value_dtype(v: Any) -> str:
    return "bool" if isinstance(v, bool) else ("int64" if isinstance(v, int) else "float32")


@op("full", "new_full")
def _full(*args: Any, **kw: Any) -> Tensor:
    if args and _is_t(args[0]):
        x, size, value = args[0], args[1], args[2] if len(args) > 2 else kw.pop("fill_value")
        return F.full(_shape((size,)), value, _dtype(kw, x.dtype))
    size, value = args[0], args[1] if len(args) > 1 else kw.pop("fill_value")
    return F.full(_shape((size,)), value, _dtype(kw, _value_dtype(value)))


def _like_of(v: Any) -> Fn:
    def f(x: Tensor, *args: Any, **kw: Any) -> Tensor:
        value = v if v is not None else (args[0] if args else kw.pop("fill_value"))
        return F.full(x.shape, value, _dtype(kw, x.dtype))
    return f


OPS["ones_like"] = _like_of(1)
OPS["zeros_like"] = _like_of(0)
OPS["full_like"] = _like_of(None)
OPS["empty_like"] = _like_of(0)


@op("scalar_tensor")
def _scalar_tensor(value: Any, **kw: Any) -> Tensor:
    return F.full((), value, _dtype(kw, "float32"))


@op("eye")
def _eye(n: int, m: Any = None, **kw: Any) -> Tensor:
    """torch.eye(n[, m]): ones on the diagonal (XLNet's attention mask)."""
    return F.fill((int(n), int(n if m is None else m)), "x0 == x1", _dtype(kw, "float32"))


@op("arange")
def _arange(*args: Any, **kw: Any) -> Tensor:
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    if "end" in kw:
        end = kw.pop("end")
    if "step" in kw:
        step = kw.pop("step")
    ints = builtins.all(isinstance(v, int) for v in (start, end, step))
    dt = _dtype(kw, "int64" if ints else "float32")
    if kind(dt) == "int" and not ints:
        # an integer arange with float bounds (XLNet's arange(0, d, 2.0, dtype=torch.int64)):
        # torch truncates start, end and step to integers first
        start, end, step = int(start), int(end), int(step)
        if step == 0:
            raise ShapeError("arange: the step, cast to the integer dtype, is 0 (torch: step must be nonzero)")
    n = builtins.max(0, math.ceil((end - start) / step))
    if n == 0:
        raise ShapeError(f"arange({start}, {end}, {step}) is empty")
    return F.fill((n,), f"x0 * {step!r} + {start!r}" if (start, step) != (0, 1) else "x0", dt)


def lookup(name: str) -> Fn:
    """The translation of ``name``, or an :class:`UnsupportedOpError` listing what is supported."""
    fn = OPS.get(name)
    if fn is None:
        raise UnsupportedOpError(f"{name!r} has no einjoin translation; supported: "
                                 f"{', '.join(sorted(OPS))}")
    return fn


def call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Apply the translation, turning shape/dtype mistakes into errors that name the op."""
    fn = lookup(name)
    try:
        return fn(*args, **kwargs)
    except EinjoinError:
        raise
    except TypeError as e:
        raise UnsupportedOpError(f"{name!r} called in a form einjoin does not translate: {e}") from None


# the layout ops (views, permutes, cat, slices, indexing) live in their own module
OPS.update(LAYOUT_OPS)

# dunder spellings (aten.__and__, fx call_method __getitem__ ...)
for _alias, _name in (("__and__", "logical_and"), ("__or__", "logical_or"), ("__invert__", "logical_not"),
                      ("__getitem__", "getitem"), ("__add__", "add"), ("__mul__", "mul"),
                      ("__sub__", "sub"), ("__truediv__", "div"), ("__matmul__", "matmul"),
                      ("__neg__", "neg"), ("__pow__", "pow"), ("__floordiv__", "floordiv"),
                      ("__mod__", "remainder")):
    OPS[_alias] = OPS[_name]


# the losses live in their own module
OPS.update(LOSS_OPS)

# routing / indexing (gather, scatter, argmax, max(x, dim), cumsum, pad, ...) and the norms,
# activations and further losses: their own modules (after the above: they replace the old
# refusal of max/min with a dim and masked_fill)
OPS.update(INDEX_OPS)
OPS.update(NN_OPS)
OPS.update(RECURRENT_OPS)
OPS.update(RESIZE_OPS)
OPS.update(CONV_OPS)  # convolution and pooling (H1's frontend/aten_conv.py)
# bitwise ops, shifts, fmod, logical ops of any dtype, cummax / cummin (replacing the bool-only
# bitwise_and / __and__ / bitwise_not spellings above)
OPS.update(BITS_OPS)
OPS.update(MATH_OPS)  # hyperbolic / inverse trig, atan2, copysign, xlogy, logaddexp, logit


@op("outer", "ger")
def _outer(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype == b.dtype == "bool":  # the join's mul takes no bools; torch's outer is a & b
        return elementwise("logical_and", a.reshape((a.shape[0], 1)), b)
    return F.einsum("i,j->ij", a, b)


# trace, diag, var_mean, std_mean, dist: compositions of the translations above
OPS.update(compose_ops(OPS))
