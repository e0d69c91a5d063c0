"""The communication lower bound: the fewest words any parallel algorithm must move.

For an (m x k) . (k x n) matmul on P processors, with one copy of the inputs and of the output
distributed at the start and the end (Al Daas, Ballard, Grigori, Kumar, Rouse: "Tight memory-
independent parallel matrix multiplication communication lower bounds", SPAA 2022): sort
d1 >= d2 >= d3 of (m, n, k); the most data one processor must touch is

    D = d2 d3 + (d1 d2 + d1 d3) / P          if P <= d1 / d2
    D = 2 sqrt(d1 d2 d3^2 / P) + d1 d2 / P   if P <= d1 d2 / d3^2
    D = 3 (d1 d2 d3 / P)^(2/3)               otherwise

and the total words moved are at least ``P D - (mn + mk + nk)``. A contraction with b batch
slices is b independent matmuls: ``b * bound(m, n, k, P / b)`` when b < P, and 0 when b >= P
(each processor takes whole slices, as head-parallel attention does).

>>> round(matmul_bound_words(8192, 8192, 8192, 8) / 8192**2, 6)   # 3 matrices: the 2x2x2 split
3.0
>>> contraction_bound_words(1, 8192, 8192, 8192, 8) == matmul_bound_words(8192, 8192, 8192, 8)
True
"""

from __future__ import annotations

import math
from typing import cast
from collections.abc import Callable

from einjoin.ir.dtypes import itemsize
from einjoin.ir.node import Attention, AttentionGrad, SparseEinsum
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Node, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)
from einjoin.ir.node import RotateHalf
from einjoin.ir.scalar import is_product

__all__ = ["matmul_bound_words", "contraction_bound_words", "contraction_dims", "node_bound_bytes",
           "BOUND_RULES"]


def matmul_bound_words(m: int, n: int, k: int, p: float) -> float:
    """Minimum total words moved by an (m x k)(k x n) matmul on ``p`` processors (p may be
    fractional when it comes from p / batch)."""
    if p <= 1 or min(m, n, k) == 0:  # an empty operand moves nothing (and d3 = 0 would divide)
        return 0.0
    d1, d2, d3 = sorted((m, n, k), reverse=True)
    if p <= d1 / d2:
        d = d2 * d3 + (d1 * d2 + d1 * d3) / p
    elif p <= d1 * d2 / (d3 * d3):
        d = 2 * math.sqrt(d1 * d2 * d3 * d3 / p) + d1 * d2 / p
    else:
        d = 3 * (d1 * d2 * d3 / p) ** (2.0 / 3.0)
    return max(0.0, p * d - (m * n + m * k + n * k))


def contraction_bound_words(b: int, m: int, n: int, k: int, p: int) -> float:
    """``b`` independent (m x k)(k x n) products on ``p`` processors."""
    if b >= p:
        return 0.0
    return b * matmul_bound_words(m, n, k, p / b)


def contraction_dims(node: Node) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) sizes of a two-input product-sum einsum, grouping its labels into batch
    (both inputs and the output), M (first input and output), N (second input and output) and
    K (both inputs, aggregated); None for any other op (its bound is "n/a": :data:`BOUND_RULES`)."""
    return rule_for(BOUND_RULES, node.op, "lower-bound rules")(node)


def _no_bound(node: Node) -> None:
    return None  # moves, cuts, casts, gathers: no matmul bound applies


def _no_scatter_bound(node: Node) -> None:
    # no bound: which output rows an update lands in depends on the index values, unknown when
    # planning, so no placement-independent traffic is forced (all updates of a row may already
    # sit on one device); a data-dependent op has no matmul-style bound
    return None


def _einsum_dims(node: Node) -> tuple[int, int, int, int] | None:
    op = cast(Einsum, node.op)  # the table dispatched on the kind
    if len(node.inputs) != 2 or not is_product(op.join, 2):
        return None
    if op.agg.name not in ("sum", "none"):
        return None
    x, y = (set(ls) for ls in op.in_labels)
    out = set(op.out_labels)
    sizes: dict[str, int] = {}
    for inp, ls in zip(node.inputs, op.in_labels):
        sizes.update(zip(ls, inp.shape))
    if (x | y) - (x & y) - out:  # a label summed inside one input only: not a plain contraction
        return None
    groups = {"b": x & y & out, "m": (x & out) - y, "n": (y & out) - x, "k": (x & y) - out}
    if not groups["k"] and not (groups["m"] and groups["n"]):
        return None  # elementwise or a one-sided broadcast: nothing to contract
    b, m, n, k = (math.prod(sizes[lab] for lab in groups[g]) for g in "bmnk")
    return b, m, n, k


def _no_window_bound(node: Node) -> None:
    # no bound: a conv is a contraction, but its input is read through a sliding window (each
    # element by up to kernel-size outputs), so the matmul bound over (batch, m, n, k) does not
    # describe it; a pool contracts nothing
    return None


BOUND_RULES: dict[type, Callable[[Node], tuple[int, int, int, int] | None]] = {
    Input: _no_bound,
    Einsum: _einsum_dims,
    Reshape: _no_bound,
    Broadcast: _no_bound,
    Select: _no_bound,
    Concat: _no_bound,
    Fill: _no_bound,
    Gather: _no_bound,
    ScatterAdd: _no_scatter_bound,
    Cast: _no_bound,
    Conv: _no_window_bound,
    Pool: _no_window_bound,
    TopK: _no_bound,
    RotateHalf: _no_bound,
    # fused attention: its products' (q k^T, p v) batch is the heads, which a plan cuts with
    # nothing moved when there are as many as devices; the bound's matmul form does not fit a
    # softmax between two products, so none is claimed
    Attention: _no_bound,
    AttentionGrad: _no_bound,
    SparseEinsum: _no_bound,
}
"""Per node kind, its (batch, m, n, k) contraction sizes for the lower bound, or None."""


def node_bound_bytes(node: Node, p: int) -> float | None:
    """The lower bound in bytes for ``node`` on ``p`` devices, or None where it does not apply."""
    dims = contraction_dims(node)
    if dims is None:
        return None
    return contraction_bound_words(*dims, p) * itemsize(node.dtype)
