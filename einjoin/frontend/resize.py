"""Resizing (``F.interpolate``, ``nn.Upsample``) as einjoin ops: nearest modes gather each output
row from a fill of source positions; linear, bilinear, trilinear and bicubic are one EinSum of
the input with one interpolation-weight fill per resized dim (``out[a] = sum_i W[a, i] x[i]``),
torch's source-index rules included (``align_corners``, a given ``scale_factor``), so the
planner splits batch, channels and output positions like any contraction and ``ej.grad``
differentiates it as one. :data:`RESIZE_OPS` holds the ATen translations, :data:`RESIZE_MODULES`
the ``nn`` modules.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (1, 1, 2))
>>> ej.reference(interpolate(x, scale_factor=2, mode="linear"), x=np.array([[[0, 1]]], np.float32)).tolist()
[[[0.0, 0.25, 0.75, 1.0]]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from einjoin.errors import EinjoinError, ShapeError, UnsupportedOpError
from einjoin.frontend import functions as F
from einjoin.frontend.routing import index_select
from einjoin.frontend.tensor import LETTERS, Tensor, _t, einsum

__all__ = ["interpolate", "RESIZE_OPS", "RESIZE_MODULES"]

_CUBIC_A = -0.75  # torch's bicubic coefficient


def _per_dim(v: Any, nd: int, what: str) -> list[Any]:
    if v is None:
        return [None] * nd
    vals = list(v) if isinstance(v, (list, tuple)) else [v] * nd
    if len(vals) != nd:
        raise ShapeError(f"interpolate: {what} {v!r} for {nd} spatial dims")
    return vals


def _source(mode: str, n: int, m: int, scale: float | None, align_corners: bool) -> str:
    """torch's source coordinate (a fill expression over the output position ``x0``)."""
    if align_corners:
        return f"x0 * {(n - 1) / (m - 1) if m > 1 else 0.0!r}"
    s = 1.0 / scale if scale else n / m
    if mode == "nearest":
        return f"x0 * {s!r}"
    if mode == "nearest-exact":
        return f"(x0 + 0.5) * {s!r}"
    src = f"((x0 + 0.5) * {s!r} - 0.5)"
    return src if mode == "cubic" else f"max({src}, 0.0)"  # linear clamps below at 0


def _weights(mode: str, n: int, m: int, scale: float | None, align_corners: bool, dtype: str) -> Tensor:
    """The (m, n) interpolation matrix of one dim: ``x0`` the output, ``x1`` the source position."""
    src = _source("cubic" if mode == "cubic" else "linear", n, m, scale, align_corners)
    i0 = f"({src} // 1)"
    t = f"({src} - {i0})"
    if mode == "linear":
        expr = (f"where(x1 == {i0}, 1.0 - {t}, 0.0) + where(x1 == min({i0} + 1, {n - 1}), {t}, 0.0)")
    else:  # cubic convolution over the taps i0-1 .. i0+2, each clamped into [0, n)
        a = _CUBIC_A
        taps = {
            -1: f"(({a} * ({t} + 1) - {5 * a}) * ({t} + 1) + {8 * a}) * ({t} + 1) - {4 * a}",
            0: f"(({a + 2} * {t} - {a + 3}) * {t} * {t} + 1)",
            1: f"(({a + 2} * (1 - {t}) - {a + 3}) * (1 - {t}) * (1 - {t}) + 1)",
            2: f"(({a} * (2 - {t}) - {5 * a}) * (2 - {t}) + {8 * a}) * (2 - {t}) - {4 * a}",
        }
        expr = " + ".join(f"where(x1 == min(max({i0} + {k}, 0), {n - 1}), {w}, 0.0)" for k, w in taps.items())
    return F.fill((m, n), expr, "float64").to(dtype)


def interpolate(x: Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> Tensor:
    """``torch.nn.functional.interpolate`` of ``x`` (N, C, *spatial), 1 to 3 spatial dims:
    modes ``nearest``, ``nearest-exact``, ``linear`` / ``bilinear`` / ``trilinear``, ``bicubic``
    (no ``antialias``)."""
    x = _t(x, "interpolate")
    if antialias:
        raise UnsupportedOpError("interpolate with antialias=True")
    nd = x.ndim - 2
    if nd < 1 or x.ndim + nd > len(LETTERS):
        raise ShapeError(f"interpolate: input must be (N, C, *spatial), got shape {x.shape}")
    if (size is None) == (scale_factor is None):
        raise EinjoinError("interpolate: give exactly one of size and scale_factor")
    spatial = x.shape[2:]
    scales = _per_dim(scale_factor, nd, "scale_factor")
    if size is not None:
        out = [int(s) for s in _per_dim(size, nd, "size")]
    else:
        out = [int(math.floor(n * float(s))) for n, s in zip(spatial, scales)]
    if recompute_scale_factor:
        scales = [None] * nd
    return _resize(x, out, scales, mode, bool(align_corners))


def _resize(x: Tensor, out: Sequence[int], scales: Sequence[Any], mode: str, align_corners: bool) -> Tensor:
    """``x`` resized to the spatial sizes ``out``, source coordinates by ``scales`` (a given
    scale factor per dim, or None: the size ratio), as torch maps them."""
    nd = x.ndim - 2
    spatial = x.shape[2:]
    if mode in ("nearest", "nearest-exact"):
        y = x
        for k, (n, m, s) in enumerate(zip(spatial, out, scales)):
            src = f"min(({_source(mode, n, m, s, False)}) // 1, {n - 1})"
            # positions computed in float64 (the fill's index variables take its dtype), then cast
            y = index_select(y, 2 + k, F.fill((m,), src, "float64").to("int64"))
        return y
    kinds = {"linear": ("linear", 1), "bilinear": ("linear", 2), "trilinear": ("linear", 3), "bicubic": ("cubic", 2)}
    if mode not in kinds:
        raise UnsupportedOpError(f"interpolate with mode={mode!r} (nearest, nearest-exact, linear, bilinear, "
                                 f"trilinear, bicubic)")
    kind, want = kinds[mode]
    if want != nd:
        raise ShapeError(f"interpolate: mode {mode!r} needs {want} spatial dims, got shape {x.shape}")
    wide = x.dtype in ("float16", "bfloat16")
    xs = x.to("float32") if wide else x
    ls = LETTERS[:x.ndim]
    outs = LETTERS[x.ndim:x.ndim + nd]
    mats = [_weights(kind, n, m, None if s is None else float(s), align_corners, xs.dtype)
            for n, m, s in zip(spatial, out, scales)]
    eq = ",".join([ls] + [o + i for o, i in zip(outs, ls[2:])]) + f"->{ls[:2]}{outs}"
    y = einsum(eq, xs, *mats)
    return y.to(x.dtype) if wide else y


def _aten(mode: str) -> Callable[..., Tensor]:
    """``upsample_*.vec(input, output_size, [align_corners,] scale_factors)`` and the ``.default``
    forms ``(input, output_size, [align_corners,] scales...)``."""
    def f(x: Tensor, output_size: Any, *rest: Any, **kw: Any) -> Tensor:
        rest_l = list(rest)
        align = bool(rest_l.pop(0)) if mode not in ("nearest", "nearest-exact") and rest_l else False
        align = bool(kw.get("align_corners", align))
        scales: Any = None
        if rest_l and isinstance(rest_l[0], (list, tuple)):
            scales = rest_l[0]
        elif any(v is not None for v in rest_l):
            scales = rest_l
        if scales is None:
            scales = kw.get("scale_factors")
        nd = x.ndim - 2
        per = _per_dim(scales, nd, "scales")
        if output_size is not None:
            out = [int(v) for v in output_size]
        else:
            out = [int(math.floor(n * float(sv))) for n, sv in zip(x.shape[2:], per)]
        return _resize(x, out, per, mode, align)
    return f


RESIZE_OPS: dict[str, Callable[..., Any]] = {
    **{f"upsample_nearest{k}d": _aten("nearest") for k in (1, 2, 3)},
    **{f"_upsample_nearest_exact{k}d": _aten("nearest-exact") for k in (1, 2, 3)},
    "upsample_linear1d": _aten("linear"), "upsample_bilinear2d": _aten("bilinear"),
    "upsample_trilinear3d": _aten("trilinear"), "upsample_bicubic2d": _aten("bicubic"),
    "interpolate": interpolate, "upsample": interpolate,
}
"""The resize translations by ATen op / torch function name (merged into ``aten.OPS``)."""


RESIZE_MODULES: dict[str, Callable[..., Any]] = {
    "Upsample": lambda m, p, x: interpolate(x, m.size, m.scale_factor, m.mode, m.align_corners,
                                            getattr(m, "recompute_scale_factor", None)),
    "UpsamplingNearest2d": lambda m, p, x: interpolate(x, m.size, m.scale_factor, "nearest"),
    "UpsamplingBilinear2d": lambda m, p, x: interpolate(x, m.size, m.scale_factor, "bilinear", True),
}
"""The resize ``nn`` modules torch.fx keeps whole (merged into ``nn_modules.MODULES``)."""
