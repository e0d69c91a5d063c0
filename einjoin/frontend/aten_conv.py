"""The torch translations of convolution and pooling: :data:`CONV_OPS` by ATen op / torch function
name (merged into :data:`einjoin.frontend.aten.OPS`), and :data:`CONV_MODULES` by ``nn`` module
class name (for torch.fx, which keeps modules whole). Each builds on :mod:`einjoin.frontend.conv`.
Unbatched inputs (``(C, *spatial)``, as torch allows) get a batch dim of 1 and lose it again.

>>> import einjoin as ej
>>> CONV_OPS["conv2d"](ej.input("x", (2, 3, 8, 8)), ej.param("w", (4, 3, 3, 3)), None, 1, 1).shape
(2, 4, 8, 8)
>>> CONV_OPS["max_pool2d_with_indices"](ej.input("x", (3, 8, 8)), [2, 2])[0].shape
(3, 4, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from einjoin.errors import UnsupportedOpError
from einjoin.frontend import conv as C
from einjoin.frontend.sorting import SORT_OPS
from einjoin.frontend.tensor import Tensor
from einjoin.ir import ops
from einjoin.registry import registrar

__all__ = ["CONV_OPS", "CONV_MODULES"]

CONV_OPS: dict[str, Callable[..., Any]] = dict(SORT_OPS)  # and topk / sort / argsort (frontend/sorting.py)
op = registrar(CONV_OPS)


def _batched(x: Tensor, nd: int, fn: Callable[[Tensor], Any]) -> Any:
    """``fn`` on ``x`` with a batch dim: torch takes (C, *spatial) as one unbatched sample."""
    if x.ndim == nd + 1:
        out = fn(x.reshape((1,) + x.shape))
        return tuple(o.reshape(o.shape[1:]) if isinstance(o, Tensor) else o for o in out) \
            if isinstance(out, tuple) else out.reshape(out.shape[1:])
    return fn(x)


def _conv_nd(nd: int | None) -> Callable[..., Any]:
    def translate(x: Tensor, w: Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
                  dilation: Any = 1, groups: int = 1) -> Any:
        n = w.ndim - 2 if nd is None else nd
        return _batched(x, n, lambda b: C.conv(b, w, bias, stride=stride, padding=padding,
                                               dilation=dilation, groups=groups))
    return translate


def _conv_transpose_nd(nd: int | None) -> Callable[..., Any]:
    def translate(x: Tensor, w: Tensor, bias: Any = None, stride: Any = 1, padding: Any = 0,
                  output_padding: Any = 0, groups: int = 1, dilation: Any = 1) -> Any:
        n = w.ndim - 2 if nd is None else nd
        return _batched(x, n, lambda b: C.conv_transpose(b, w, bias, stride=stride, padding=padding,
                                                         output_padding=output_padding, dilation=dilation,
                                                         groups=groups))
    return translate


for _n, _name in ((1, "conv1d"), (2, "conv2d"), (3, "conv3d")):
    CONV_OPS[_name] = _conv_nd(_n)
    CONV_OPS[f"conv_transpose{_n}d"] = _conv_transpose_nd(_n)


@op("convolution", "_convolution")
def _convolution(x: Tensor, w: Tensor, bias: Any, stride: Any, padding: Any, dilation: Any, transposed: bool,
                 output_padding: Any, groups: int, *_: Any) -> Any:
    if transposed:
        return _conv_transpose_nd(None)(x, w, bias, stride, padding, output_padding, groups, dilation)
    return _conv_nd(None)(x, w, bias, stride, padding, dilation, groups)


def _max_pool_nd(nd: int, with_indices: bool) -> Callable[..., Any]:
    def translate(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                  ceil_mode: bool = False, return_indices: bool = False) -> Any:
        if with_indices or return_indices:
            return _batched(x, nd, lambda b: C.max_pool_with_indices(b, kernel_size, stride, padding, dilation,
                                                                     ceil_mode))
        return _batched(x, nd, lambda b: C.max_pool(b, kernel_size, stride, padding, dilation, ceil_mode))
    return translate


def _avg_pool_nd(nd: int) -> Callable[..., Any]:
    def translate(x: Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                  count_include_pad: bool = True, divisor_override: Any = None) -> Any:
        return _batched(x, nd, lambda b: C.avg_pool(b, kernel_size, stride, padding, ceil_mode,
                                                    count_include_pad, divisor_override))
    return translate


def _adaptive_nd(nd: int, fn: Callable[[Tensor, Any], Tensor], with_indices: bool) -> Callable[..., Any]:
    def translate(x: Tensor, output_size: Any, return_indices: bool = False) -> Any:
        if with_indices or return_indices:  # adaptive max pool only
            return _batched(x, nd, lambda b: C.adaptive_max_pool_with_indices(b, output_size))
        return _batched(x, nd, lambda b: fn(b, output_size))
    return translate


for _n in (1, 2, 3):
    CONV_OPS[f"max_pool{_n}d"] = _max_pool_nd(_n, False)
    CONV_OPS[f"max_pool{_n}d_with_indices"] = _max_pool_nd(_n, True)
    CONV_OPS[f"avg_pool{_n}d"] = _avg_pool_nd(_n)
    CONV_OPS[f"adaptive_avg_pool{_n}d"] = _adaptive_nd(_n, C.adaptive_avg_pool, False)
    CONV_OPS[f"_adaptive_avg_pool{_n}d"] = _adaptive_nd(_n, C.adaptive_avg_pool, False)
    CONV_OPS[f"adaptive_max_pool{_n}d"] = _adaptive_nd(_n, C.adaptive_max_pool, True)  # ATen: (values, indices)
    CONV_OPS[f"F.adaptive_max_pool{_n}d"] = _adaptive_nd(_n, C.adaptive_max_pool, False)  # torch.fx: as called


@op("im2col")
def _im2col(x: Tensor, kernel_size: Any, dilation: Any = 1, padding: Any = 0, stride: Any = 1) -> Any:
    return _batched(x, 2, lambda b: C.unfold(b, kernel_size, dilation, padding, stride))


@op("unfold")
def _unfold(x: Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.unfold(dim, size, step)`` (three ints, as ATen's ``unfold``), else ``F.unfold``
    (torch.fx names both ``unfold``)."""
    if kwargs or len(args) != 3 or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        return _im2col(x, *args, **kwargs)
    return _windows(x, *args)


def _windows(x: Tensor, dim: int, size: int, step: int) -> Tensor:
    """``x.unfold(dim, size, step)``: the windows of ``dim`` as a new last dim (a pool with agg
    ``none`` along that dim: copied, cut and differentiated as a pool)."""
    d = dim % max(x.ndim, 1)
    if x.ndim == 0 or step < 1 or not 0 <= size <= x.shape[d]:
        raise UnsupportedOpError(f"unfold(dim={dim}, size={size}, step={step}) of a tensor of shape {x.shape}")
    rest = tuple(n for i, n in enumerate(x.shape) if i != d)
    moved = x.permute(*[i for i in range(x.ndim) if i != d], d).reshape((-1, 1, x.shape[d]))
    y = ops.pool_node(moved.node, "none", (size,), step)  # the windows: (B, size, L)
    out = Tensor(y).permute(0, 2, 1).reshape(rest + (y.shape[2], size))
    perm = list(range(len(rest)))
    perm.insert(d, len(rest))
    return out.permute(*perm, len(rest) + 1)


# ---------------------------------------------------------------- nn modules (torch.fx keeps them whole)

def _padding_mode(m: Any) -> None:
    mode = getattr(m, "padding_mode", "zeros")
    if mode != "zeros":
        raise UnsupportedOpError(f"{type(m).__name__} with padding_mode={mode!r} (only 'zeros'); "
                                 f"capture with torch.export (the default), which writes the padding "
                                 f"as its own pad op")


def _conv_m(m: Any, p: dict[str, Any], x: Tensor) -> Any:
    _padding_mode(m)
    nd = len(m.kernel_size)
    if getattr(m, "transposed", False):
        return _conv_transpose_nd(nd)(x, p["weight"], p.get("bias"), m.stride, m.padding, m.output_padding,
                                      m.groups, m.dilation)
    return _conv_nd(nd)(x, p["weight"], p.get("bias"), m.stride, m.padding, m.dilation, m.groups)


def _max_pool_m(nd: int) -> Callable[..., Any]:
    def module(m: Any, p: dict[str, Any], x: Tensor) -> Any:
        return _max_pool_nd(nd, False)(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                                       m.return_indices)
    return module


def _avg_pool_m(nd: int) -> Callable[..., Any]:
    def module(m: Any, p: dict[str, Any], x: Tensor) -> Any:
        return _avg_pool_nd(nd)(x, m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                                getattr(m, "divisor_override", None))
    return module


def _adaptive_m(nd: int, fn: Callable[[Tensor, Any], Tensor]) -> Callable[..., Any]:
    def module(m: Any, p: dict[str, Any], x: Tensor) -> Any:
        return _adaptive_nd(nd, fn, False)(x, m.output_size, getattr(m, "return_indices", False))
    return module


CONV_MODULES: dict[str, Callable[..., Any]] = {
    "Unfold": lambda m, p, x: _im2col(x, m.kernel_size, m.dilation, m.padding, m.stride),
}
for _n in (1, 2, 3):
    CONV_MODULES[f"Conv{_n}d"] = _conv_m
    CONV_MODULES[f"ConvTranspose{_n}d"] = _conv_m
    CONV_MODULES[f"MaxPool{_n}d"] = _max_pool_m(_n)
    CONV_MODULES[f"AvgPool{_n}d"] = _avg_pool_m(_n)
    CONV_MODULES[f"AdaptiveAvgPool{_n}d"] = _adaptive_m(_n, C.adaptive_avg_pool)
    CONV_MODULES[f"AdaptiveMaxPool{_n}d"] = _adaptive_m(_n, C.adaptive_max_pool)
