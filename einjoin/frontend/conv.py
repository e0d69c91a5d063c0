"""Convolution and pooling, as torch names them, on the IR's window kinds
(:class:`~einjoin.ir.opkinds.Conv`, :class:`~einjoin.ir.opkinds.Pool`): the planner cuts them along
batch, channels and spatial dims (a spatial cut reads a halo), and their gradients are window ops
again. Layouts are torch's: ``(N, C, *spatial)`` with 1-3 spatial dims.

>>> import einjoin as ej
>>> x = ej.input("x", (2, 3, 16, 16)); w = ej.param("w", (8, 3, 3, 3))
>>> conv(x, w, stride=2, padding=1).shape
(2, 8, 8, 8)
>>> max_pool(x, 2).shape, avg_pool(x, 3, stride=2, padding=1).shape, adaptive_avg_pool(x, (5, 1)).shape
((2, 3, 8, 8), (2, 3, 8, 8), (2, 3, 5, 1))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from einjoin.errors import EinjoinError, ShapeError
from einjoin.frontend.tensor import Tensor
from einjoin.ir import ops
from einjoin.ir.node import Node
from einjoin.ir.window import out_size

__all__ = ["conv", "conv_transpose", "max_pool", "max_pool_with_indices", "avg_pool", "adaptive_avg_pool",
           "adaptive_max_pool", "adaptive_max_pool_with_indices", "unfold", "identity_kernel", "flip_kernel",
           "first_max"]

_K, _F = "uvw", "xyz"  # kernel labels, and the same flipped
_HALF = ("float16", "bfloat16")


def _tensor(x: Any, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise EinjoinError(f"{what}: expected an einjoin tensor, got {type(x).__name__}")
    return x


def _nd(x: Tensor, what: str) -> int:
    if not 3 <= x.ndim <= 5:
        raise ShapeError(f"{what}: input of shape {x.shape} must be (N, C, *spatial) with 1-3 spatial dims")
    return x.ndim - 2


def _ints(v: Any, nd: int, what: str, name: str) -> tuple[int, ...]:
    """An int or a sequence of ``nd`` ints (a 1-sequence repeated, as torch's ``_ntuple``)."""
    if isinstance(v, bool):
        raise EinjoinError(f"{what}: {name} must be an int or {nd} ints, got {v!r}")
    if isinstance(v, int):
        return (v,) * nd
    try:
        vals = tuple(int(a) for a in v)
    except (TypeError, ValueError):
        raise EinjoinError(f"{what}: {name} must be an int or {nd} ints, got {v!r}") from None
    if len(vals) == 1:
        vals *= nd
    if len(vals) != nd:
        raise EinjoinError(f"{what}: {name} must be an int or {nd} ints, got {v!r}")
    return vals


def _pads(padding: Any, nd: int, what: str, kernel: Sequence[int] = (), dilation: Sequence[int] = (),
          stride: Sequence[int] = ()) -> tuple[tuple[int, int], ...]:
    """torch's padding forms: an int, one int per dim, (lo, hi) pairs, "valid" or "same"."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * nd
        if padding == "same":
            if any(s != 1 for s in stride):
                raise EinjoinError(f"{what}: padding='same' needs stride 1 (as in torch), got {tuple(stride)}")
            total = [d * (k - 1) for k, d in zip(kernel, dilation)]
            return tuple((t // 2, t - t // 2) for t in total)
        raise EinjoinError(f"{what}: padding {padding!r} is not 'same', 'valid' or numbers")
    if (isinstance(padding, (list, tuple)) and len(padding) == nd
            and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in padding)):
        return tuple((int(a), int(b)) for a, b in padding)
    return tuple((p, p) for p in _ints(padding, nd, what, "padding"))


def _bias(y: Tensor, bias: Any, what: str) -> Tensor:
    if bias is None:
        return y
    b = _tensor(bias, what)
    if b.shape != (y.shape[1],):
        raise ShapeError(f"{what}: bias of shape {b.shape} for {y.shape[1]} output channels")
    return y + b.reshape((y.shape[1],) + (1,) * (y.ndim - 2))


def conv(x: Tensor, w: Tensor, bias: Tensor | None = None, *, stride: Any = 1, padding: Any = 0,
         dilation: Any = 1, groups: int = 1) -> Tensor:
    """torch's ``conv1d/2d/3d``: ``x`` (N, C, *spatial), ``w`` (O, C/groups, *kernel); ``padding``
    an int, a tuple, per-dim (lo, hi) pairs, ``"same"`` or ``"valid"``.

    >>> import einjoin as ej
    >>> conv(ej.input("x", (1, 4, 10)), ej.param("w", (4, 1, 7)), padding="same", groups=4).shape
    (1, 4, 10)
    """
    x, w = _tensor(x, "conv"), _tensor(w, "conv")
    what = f"conv of input {x.shape} by weight {w.shape}"
    nd = _nd(x, what)
    st, dil = _ints(stride, nd, what, "stride"), _ints(dilation, nd, what, "dilation")
    pads = _pads(padding, nd, what, w.shape[2:], dil, st)
    y = Tensor(ops.conv_node(x.node, w.node, st, pads, 1, dil, groups))
    return _bias(y, bias, what)


def flip_kernel(w: Node, groups: int) -> Node:
    """``w`` (G*A, B, *K) as (G*B, A, *K) with every spatial dim reversed: the kernel of the
    transposed convolution (and of a conv's input gradient)."""
    nd = w.ndim - 2
    a, b = w.shape[0] // groups, w.shape[1]
    wr = ops.reshape_node(w, (groups, a, b) + w.shape[2:])
    inputs, labels = [wr], ["gab" + _K[:nd]]
    out = "gba"
    for d, k in enumerate(w.shape[2:]):
        if k == 1:
            out += _K[d]
            continue
        inputs.append(ops.fill_node((k, k), w.dtype, f"x0 + x1 == {k - 1}"))
        labels.append(_K[d] + _F[d])
        out += _F[d]
    flipped = len(inputs) > 1
    t = ops.einsum_node(inputs, [tuple(ls) for ls in labels], tuple(out), "mul" if flipped else "x0",
                        "sum" if flipped else None)
    return ops.reshape_node(t, (groups * b, a) + w.shape[2:])


def conv_transpose(x: Tensor, w: Tensor, bias: Tensor | None = None, *, stride: Any = 1, padding: Any = 0,
                   output_padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Tensor:
    """torch's ``conv_transpose1d/2d/3d``: ``w`` is (C_in, O/groups, *kernel); a conv of the
    input dilated by ``stride`` with the flipped, transposed kernel.

    >>> import einjoin as ej
    >>> conv_transpose(ej.input("x", (1, 4, 5, 5)), ej.param("w", (4, 2, 3, 3)), stride=2, padding=1,
    ...                output_padding=1).shape
    (1, 2, 10, 10)
    """
    x, w = _tensor(x, "conv_transpose"), _tensor(w, "conv_transpose")
    what = f"conv_transpose of input {x.shape} by weight {w.shape}"
    nd = _nd(x, what)
    if w.ndim != x.ndim or w.shape[0] != x.shape[1] or groups < 1 or w.shape[0] % groups:
        raise ShapeError(f"{what}: the weight must be (C_in, O/groups, *kernel) with C_in = {x.shape[1]} "
                         f"divisible by groups={groups}")
    st, dil = _ints(stride, nd, what, "stride"), _ints(dilation, nd, what, "dilation")
    pad, extra = _ints(padding, nd, what, "padding"), _ints(output_padding, nd, what, "output_padding")
    if any(e >= max(s, d) for e, s, d in zip(extra, st, dil)):
        raise ShapeError(f"{what}: output_padding {extra} must be smaller than stride or dilation")
    pads = tuple((d * (k - 1) - p, d * (k - 1) - p + e) for k, d, p, e in zip(w.shape[2:], dil, pad, extra))
    y = Tensor(ops.conv_node(x.node, flip_kernel(w.node, groups), 1, pads, st, dil, groups))
    return _bias(y, bias, what)


def _ceil_pads(x: Tensor, kernel: Sequence[int], st: Sequence[int], pad: Sequence[int], dil: Sequence[int],
               ceil_mode: bool, what: str) -> tuple[tuple[int, int], ...]:
    """(lo, hi) per dim for torch's pooling output size (``ceil_mode``: one more window where it
    starts inside the input or its left padding)."""
    out = []
    for n, k, s, p, d in zip(x.shape[2:], kernel, st, pad, dil):
        if p > k // 2:
            raise ShapeError(f"{what}: padding {p} must be at most half the window {k} (as in torch)")
        m = out_size(n, k, s, p, p, 1, d)
        if ceil_mode:
            span = n + 2 * p - d * (k - 1) - 1
            m = -(-span // s) + 1
            if (m - 1) * s >= n + p:
                m -= 1
        if m < 1:
            raise ShapeError(f"{what}: dim of size {n} with window {k}, stride {s}, padding {p} gives no output")
        out.append((p, (m - 1) * s + d * (k - 1) + 1 - n - p))
    return tuple(out)


def _pool_args(x: Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any, what: str
               ) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    nd = _nd(x, what)
    k = _ints(kernel, nd, what, "kernel")
    empty = stride is None or (isinstance(stride, (list, tuple)) and not stride)  # aten's stride=[]
    st = k if empty else _ints(stride, nd, what, "stride")
    return nd, k, st, _ints(padding, nd, what, "padding"), _ints(dilation, nd, what, "dilation")


def max_pool(x: Tensor, kernel: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
             ceil_mode: bool = False) -> Tensor:
    """torch's ``max_pool1d/2d/3d`` (values only): the padding is -inf.

    >>> import einjoin as ej
    >>> max_pool(ej.input("x", (1, 1, 5, 5)), 2, ceil_mode=True).shape
    (1, 1, 3, 3)
    """
    x = _tensor(x, "max_pool")
    what = f"max_pool of input {x.shape}"
    _, k, st, pad, dil = _pool_args(x, kernel, stride, padding, dilation, what)
    return Tensor(ops.pool_node(x.node, "max", k, st, _ceil_pads(x, k, st, pad, dil, ceil_mode, what), dil))


def first_max(x: Node, values: Node, k: Sequence[int], st: Sequence[int], pads: Sequence[tuple[int, int]],
              dil: Sequence[int]) -> tuple[Node, Node]:
    """(the window position ``j`` of each window's first maximum, int64 (N, C, *out); a fill over
    (j, *out) of the flattened input-plane position each window position reads) for the max pool
    of ``x`` whose values are ``values``: torch's choice (the first maximum in row-major window
    order, or the last NaN), as its indices and its gradient route it."""
    n, c, kt, nd = x.shape[0], x.shape[1], math.prod(k), len(k)
    out = values.shape[2:]
    windows = ops.reshape_node(ops.pool_node(x, "none", tuple(k), tuple(st), tuple(pads), tuple(dil)),
                               (n, c, kt) + out)
    # per (window position j, output o): the input position along each dim, and whether it is one
    pos, inside, step = [], [], kt
    for d, (kk, s, (lo, _), dl, size) in enumerate(zip(k, st, pads, dil, x.shape[2:])):
        step //= kk
        p = f"(x{d + 1} * {s} - {lo} + {dl} * ((x0 // {step}) % {kk}))"
        pos.append(p)
        inside.append(f"({p} >= 0) & ({p} < {size})")
    grid = (kt,) + out
    real = ops.fill_node(grid, "bool", " & ".join(inside))
    flat, stride_flat = [], 1
    for d in reversed(range(nd)):
        flat.append(f"{pos[d]} * {stride_flat}")
        stride_flat *= x.shape[2 + d]
    where_from = ops.fill_node(grid, "int64", " + ".join(flat))
    iota = ops.fill_node((kt,), "int64", "x0")
    sp = "pqr"[:nd]
    nc, ncj, jsp = tuple("nc" + sp), tuple("ncj" + sp), tuple("j" + sp)
    masked = ops.einsum_node([windows, real], [ncj, jsp], ncj, "where(x1, x0, -inf)", None)
    return _torch_pick(masked, values, iota, ncj, nc, ("j",), kt), where_from


def _torch_pick(vals: Node, top: Node, pos: Node, v_labels: tuple[str, ...], out: tuple[str, ...],
                p_labels: tuple[str, ...], none: int, extra: Sequence[Node] = (),
                extra_labels: Sequence[tuple[str, ...]] = (), cond: str = "") -> Node:
    """The position torch's max pools pick in each window of ``vals`` whose maximum is ``top``:
    the first maximum, or in a window with NaN the last NaN (torch's CPU loop takes ``val >
    max or isnan(val)``). ``extra`` inputs (masks, read by ``cond``) limit the window."""
    inside = f"({cond}) & " if cond else ""
    ins, labels = [vals, top, pos, *extra], [v_labels, out, p_labels, *extra_labels]
    first = ops.einsum_node(ins, labels, out, f"where({inside}(x0 == x1), x2, {none})", "min")
    last_nan = ops.einsum_node(ins, labels, out, f"where({inside}(x0 != x0), x2, -1)", "max")
    return ops.einsum_node([top, first, last_nan], [out, out, out], out, "where(x0 != x0, x2, x1)", None)


def max_pool_with_indices(x: Tensor, kernel: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                          ceil_mode: bool = False) -> tuple[Tensor, Tensor]:
    """torch's ``max_pool*d(..., return_indices=True)``: the values and, in int64, the position of
    each window's first maximum in its (flattened) input plane (a NaN window: its last NaN, as
    torch's CPU loop picks).
    The windows are a pool with agg ``none``; the first maximum a min over window positions.

    >>> import einjoin as ej
    >>> v, i = max_pool_with_indices(ej.input("x", (1, 2, 6, 6)), 2)
    >>> v.shape, i.shape, i.dtype
    ((1, 2, 3, 3), (1, 2, 3, 3), 'int64')
    """
    x = _tensor(x, "max_pool")
    what = f"max_pool of input {x.shape}"
    nd, k, st, pad, dil = _pool_args(x, kernel, stride, padding, dilation, what)
    pads = _ceil_pads(x, k, st, pad, dil, ceil_mode, what)
    values = Tensor(ops.pool_node(x.node, "max", k, st, pads, dil))
    first, where_from = first_max(x.node, values.node, k, st, pads, dil)
    nd, kt = len(k), math.prod(k)
    sp = "pqr"[:nd]
    iota = ops.fill_node((kt,), "int64", "x0")
    index = ops.einsum_node([first, iota, where_from], [tuple("nc" + sp), ("j",), tuple("j" + sp)], tuple("nc" + sp),
                            "where(x0 == x1, x2, 0)", "sum")
    return values, Tensor(index)


def avg_pool(x: Tensor, kernel: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
             count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    """torch's ``avg_pool1d/2d/3d``: a sum pool divided by torch's divisor (the window clipped to
    the padded input, or to the input with ``count_include_pad=False``, or ``divisor_override``),
    the divisor a fill over the output positions.

    >>> import einjoin as ej
    >>> avg_pool(ej.input("x", (1, 1, 5, 5)), 3, 2, 1, count_include_pad=False).shape
    (1, 1, 3, 3)
    """
    x = _tensor(x, "avg_pool")
    if x.dtype in _HALF:  # torch sums and divides in float32, then rounds once
        return avg_pool(x.to("float32"), kernel, stride, padding, ceil_mode, count_include_pad,
                        divisor_override).to(x.dtype)
    what = f"avg_pool of input {x.shape}"
    nd, k, st, pad, dil = _pool_args(x, kernel, stride, padding, 1, what)
    pads = _ceil_pads(x, k, st, pad, dil, ceil_mode, what)
    s = Tensor(ops.pool_node(x.node, "sum", k, st, pads, dil))
    if divisor_override is not None:
        if int(divisor_override) == 0:
            raise EinjoinError(f"{what}: divisor_override must not be 0")
        return s / int(divisor_override)
    terms = []
    for d, (n, kk, ss, p) in enumerate(zip(x.shape[2:], k, st, pad)):
        a = f"(x{d} * {ss} - {p})"
        e = f"min({a} + {kk}, {n + p})"
        terms.append(f"({e} - {a})" if count_include_pad else f"(min({e}, {n}) - max({a}, 0))")
    div = ops.fill_node(s.shape[2:], x.dtype, " * ".join(terms))
    return s / Tensor(div)


def _adaptive_sizes(x: Tensor, output_size: Any, what: str) -> tuple[int, ...]:
    nd = _nd(x, what)
    sizes = [output_size] * nd if isinstance(output_size, int) or output_size is None else list(output_size)
    if len(sizes) == 1:
        sizes *= nd
    if len(sizes) != nd:
        raise ShapeError(f"{what}: output_size {output_size!r} for {nd} spatial dim(s)")
    out = tuple(n if m is None else int(m) for m, n in zip(sizes, x.shape[2:]))
    if any(m < 1 for m in out):
        raise ShapeError(f"{what}: output_size {output_size!r} must be positive")
    return out


def _window_masks(x: Tensor, sizes: tuple[int, ...], dtype: str, weighted: bool) -> list[Node]:
    """Per spatial dim, the (n, m) fill of torch's adaptive windows ``[floor(i n / m),
    ceil((i + 1) n / m))``: 1/window size (``weighted``) or true inside each window."""
    masks = []
    for n, m in zip(x.shape[2:], sizes):
        inside = f"(x0 >= (x1 * {n}) // {m}) & (x0 < ((x1 + 1) * {n} + {m - 1}) // {m})"
        size = f"((((x1 + 1) * {n} + {m - 1}) // {m}) - ((x1 * {n}) // {m}))"
        masks.append(ops.fill_node((n, m), dtype if weighted else "bool",
                                   f"where({inside}, 1 / {size}, 0)" if weighted else inside))
    return masks


def _adaptive(x: Tensor, output_size: Any, agg: str, what: str) -> Tensor:
    sizes = _adaptive_sizes(x, output_size, what)
    nd = x.ndim - 2
    if all(n % m == 0 for n, m in zip(x.shape[2:], sizes)):  # even windows: a plain pool
        k = tuple(n // m for n, m in zip(x.shape[2:], sizes))
        y = Tensor(ops.pool_node(x.node, agg, k, k, 0, 1))
        return y / math.prod(k) if agg == "sum" else y
    # uneven windows: one einsum over the spatial dims with a window mask per dim
    sp, win = "pqr"[:nd], "ijk"[:nd]
    masks = _window_masks(x, sizes, x.dtype, True)
    labels = [tuple("nc" + sp)] + [(a, b) for a, b in zip(sp, win)]
    return Tensor(ops.einsum_node([x.node, *masks], labels, tuple("nc" + win), "mul", "sum"))


def _adaptive_max(x: Tensor, output_size: Any, what: str) -> tuple[Tensor, Tensor]:
    """(values, int64 flattened input-plane indices) of torch's adaptive max pool: a max pool
    for even windows; for uneven ones the first maximum of each window (a NaN window: its last
    NaN, as torch) found by einsums over window masks, and the value read there by a ``where``
    sum (no product: an inf elsewhere stays out), so the gradient goes to that one position, as
    torch routes it."""
    sizes = _adaptive_sizes(x, output_size, what)
    nd = x.ndim - 2
    if all(n % m == 0 for n, m in zip(x.shape[2:], sizes)):
        k = tuple(n // m for n, m in zip(x.shape[2:], sizes))
        return max_pool_with_indices(x, k, k)
    sp, win = "pqr"[:nd], "ijk"[:nd]
    nc_sp, nc_win = tuple("nc" + sp), tuple("nc" + win)
    masks = _window_masks(x, sizes, x.dtype, False)
    pairs = [(a, b) for a, b in zip(sp, win)]
    cond = " & ".join(f"x{i + 1}" for i in range(nd))
    top = ops.einsum_node([x.node, *masks], [nc_sp, *pairs], nc_win, f"where({cond}, x0, -inf)", "max")
    plane = math.prod(x.shape[2:])
    flat, step = [], plane
    for d, n in enumerate(x.shape[2:]):
        step //= n
        flat.append(f"x{d} * {step}")
    where_from = ops.fill_node(x.shape[2:], "int64", " + ".join(flat))
    inside = " & ".join(f"x{i + 3}" for i in range(nd))
    first = _torch_pick(x.node, top, where_from, nc_sp, nc_win, tuple(sp), plane, masks, pairs, inside)
    values = ops.einsum_node([x.node, first, where_from], [nc_sp, nc_win, tuple(sp)], nc_win,
                             "where(x1 == x2, x0, 0)", "sum")
    return Tensor(values), Tensor(first)


def adaptive_avg_pool(x: Tensor, output_size: Any) -> Tensor:
    """torch's ``adaptive_avg_pool1d/2d/3d`` (None in ``output_size`` keeps that dim).

    >>> import einjoin as ej
    >>> adaptive_avg_pool(ej.input("x", (2, 3, 7, 8)), (3, None)).shape
    (2, 3, 3, 8)
    """
    x = _tensor(x, "adaptive_avg_pool")
    if x.dtype in _HALF:  # torch sums and divides in float32, then rounds once
        return adaptive_avg_pool(x.to("float32"), output_size).to(x.dtype)
    return _adaptive(x, output_size, "sum", f"adaptive_avg_pool of input {x.shape}")


def adaptive_max_pool(x: Tensor, output_size: Any) -> Tensor:
    """torch's ``adaptive_max_pool1d/2d/3d`` (values; see :func:`adaptive_max_pool_with_indices`).

    >>> import einjoin as ej
    >>> adaptive_max_pool(ej.input("x", (2, 3, 7, 8)), 3).shape
    (2, 3, 3, 3)
    """
    return adaptive_max_pool_with_indices(x, output_size)[0]


def adaptive_max_pool_with_indices(x: Tensor, output_size: Any) -> tuple[Tensor, Tensor]:
    """torch's ``adaptive_max_pool*d(..., return_indices=True)``: the values and the int64
    position of each window's first maximum in its flattened input plane."""
    x = _tensor(x, "adaptive_max_pool")
    return _adaptive_max(x, output_size, f"adaptive_max_pool of input {x.shape}")


def identity_kernel(c: int, window: Sequence[int], dtype: str) -> Node:
    """The (C*K, 1, *window) kernel of a depthwise conv that copies each window position to its
    own channel (``c*K + j``, j the row-major window position, as torch's unfold orders them)."""
    kt = math.prod(window)
    flat, step = [], kt
    for d, k in enumerate(window):
        step //= k
        flat.append(f"x{d + 2} * {step}")
    return ops.fill_node((c * kt, 1) + tuple(window), dtype, f"x0 % {kt} == " + " + ".join(flat))


def unfold(x: Tensor, kernel: Any, dilation: Any = 1, padding: Any = 0, stride: Any = 1) -> Tensor:
    """torch's ``F.unfold`` (im2col): (N, C, *spatial) -> (N, C * prod(kernel), L): the windows
    (a :class:`~einjoin.ir.opkinds.Pool` with agg ``none``: copied, cut with a halo as a pool).

    >>> import einjoin as ej
    >>> unfold(ej.input("x", (2, 3, 6, 6)), 3, padding=1, stride=2).shape
    (2, 27, 9)
    """
    x = _tensor(x, "unfold")
    what = f"unfold of input {x.shape}"
    nd = _nd(x, what)
    k, dil = _ints(kernel, nd, what, "kernel"), _ints(dilation, nd, what, "dilation")
    st, pad = _ints(stride, nd, what, "stride"), _ints(padding, nd, what, "padding")
    y = ops.pool_node(x.node, "none", k, st, pad, dil)
    return Tensor(ops.reshape_node(y, (x.shape[0], y.shape[1], math.prod(y.shape[2:]))))

