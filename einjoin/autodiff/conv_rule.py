"""The adjoints of the window kinds, as window ops again (so the backward pass decomposes, halo
and all, as the forward does):

- a conv's input gradient is a conv of the cotangent with the flipped, transposed weight, the
  cotangent dilated by the forward's stride (a transposed convolution);
- its weight gradient is a conv of the input with the cotangent as the kernel (stride and
  kernel dilation swapped), batch and channels exchanged by einsum transposes;
- a sum pool's input gradient is the transposed conv of the cotangent by a kernel of ones;
- a max pool's routes each window's cotangent to its first maximum (the last NaN of a NaN
  window), as torch does: that position found from the windows (a pool with agg ``none``), the
  cotangent placed there, and the transposed conv by an identity kernel back;
- the windows' (``none``) is that transposed conv alone (im2col's adjoint, col2im).

>>> from einjoin.ir import ops
>>> x = ops.input_node("x", (2, 3, 8, 8), "float64"); w = ops.input_node("w", (4, 3, 3, 3), "float64")
>>> y = ops.conv_node(x, w, stride=2, padding=1)
>>> g = ops.input_node("g", y.shape, "float64")
>>> dx, dw = conv_adjoints(y, g, (True, True))
>>> dx.shape, dw.shape
((2, 3, 8, 8), (4, 3, 3, 3))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from einjoin.frontend.conv import first_max, flip_kernel, identity_kernel
from einjoin.ir import ops
from einjoin.ir.node import Conv, Node, Pool
from einjoin.ir.window import dilated

__all__ = ["conv_adjoints", "pool_adjoints", "conv_input_grad"]

def conv_input_grad(g: Node, w: Node, op: Conv, x_shape: tuple[int, ...]) -> Node:
    """The gradient w.r.t. the input of ``conv(x, w)`` (``op``, input shape ``x_shape``) given
    the cotangent ``g`` of its output: ``conv_transpose`` of ``g`` by ``w``."""
    pads = []
    for n, p, k, s, (lo, _), ld, rd in zip(x_shape[2:], g.shape[2:], w.shape[2:], op.stride, op.padding,
                                           op.lhs_dilation, op.rhs_dilation):
        lo_t = rd * (k - 1) - lo
        pads.append((lo_t, (n - 1) * ld + rd * (k - 1) + 1 - dilated(p, s) - lo_t))
    return ops.conv_node(g, flip_kernel(w, op.groups), op.lhs_dilation, pads, op.stride, op.rhs_dilation,
                         op.groups)


def _weight_grad(x: Node, g: Node, w_shape: tuple[int, ...], op: Conv) -> Node:
    nd = x.ndim - 2
    gr = op.groups
    cg = w_shape[1]
    sp = "pqr"[:nd]
    # x (N, G*Cg, S) -> (Cg, G*N, S): the input channels become the batch, the batch summed
    xr = ops.reshape_node(x, (x.shape[0], gr, cg) + x.shape[2:])
    xt = ops.einsum_node([xr], [tuple("ngc" + sp)], tuple("cgn" + sp), "x0", None)
    xt = ops.reshape_node(xt, (cg, gr * x.shape[0]) + x.shape[2:])
    gt = ops.einsum_node([g], [tuple("no" + sp)], tuple("on" + sp), "x0", None)  # (O, N, P)
    pads = []
    for n, p, k, s, (lo, _), ld, rd in zip(x.shape[2:], g.shape[2:], w_shape[2:], op.stride, op.padding,
                                           op.lhs_dilation, op.rhs_dilation):
        pads.append((lo, (k - 1) * rd + s * (p - 1) + 1 - dilated(n, ld) - lo))
    dw = ops.conv_node(xt, gt, op.rhs_dilation, pads, op.lhs_dilation, op.stride, gr)  # (Cg, O, *K)
    return ops.einsum_node([dw], [tuple("co" + sp)], tuple("oc" + sp), "x0", None)


def conv_adjoints(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """(d input, d weight) of a conv, each a conv again."""
    x, w = node.inputs
    op = cast(Conv, node.op)
    dx = conv_input_grad(g, w, op, x.shape) if wanted[0] else None
    dw = _weight_grad(x, g, w.shape, op) if wanted[1] else None
    return dx, dw


def pool_adjoints(node: Node, g: Node, wanted: Sequence[bool]) -> tuple[Node | None, ...]:
    """The input's cotangent of a sum or max pool (see the module docstring)."""
    x = node.inputs[0]
    op = cast(Pool, node.op)
    nd, c = x.ndim - 2, x.shape[1]
    as_conv = Conv(op.stride, op.padding, (1,) * nd, op.dilation, c)
    if op.agg.name == "sum":
        ones = ops.fill_node((c, 1) + op.window, x.dtype, 1)
        return (conv_input_grad(g, ones, as_conv, x.shape),)
    kt = math.prod(op.window)
    eye = identity_kernel(c, op.window, x.dtype)                      # (C*Kt, 1, *K)
    if op.agg.name == "none":  # the windows: each cotangent back to where it was copied from
        return (conv_input_grad(g, eye, as_conv, x.shape),)
    # torch's routing: each window's cotangent to its first maximum (the last NaN in a NaN window)
    first, _ = first_max(x, node, op.window, op.stride, op.padding, op.dilation)
    sp = "pqr"[:nd]
    iota = ops.fill_node((kt,), "int64", "x0")
    routed = ops.einsum_node([first, iota, g], [tuple("nc" + sp), ("j",), tuple("nc" + sp)], tuple("ncj" + sp),
                             "where(x0 == x1, x2, 0)", None)
    flat = ops.reshape_node(routed, (x.shape[0], c * kt) + node.shape[2:])
    return (conv_input_grad(flat, eye, as_conv, x.shape),)
