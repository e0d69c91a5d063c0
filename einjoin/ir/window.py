"""Window geometry of the convolution and pooling kinds: where an output position reads its input.

Along one spatial dim of a :class:`~einjoin.ir.opkinds.Conv` (or a pool), output position ``o``
and window (kernel) position ``k`` read the input position ``i`` with

    ld * i = stride * o + rd * k - lo          (zero, or the pool's identity, where no i exists)

— the input dilated by ``ld`` (``ld - 1`` zeros between elements), padded by ``lo`` before and
``hi`` after (negative: cropped), then read at ``stride`` steps by a window dilated by ``rd``:
XLA's ConvGeneralDilated along one dim. Transposed convolutions and both convolution gradients
are this same map with other numbers.

>>> out_size(8, 3, stride=2, lo=1, hi=1)
4
>>> input_range(0, 2, 8, 3, stride=2, lo=1)      # output rows 0, 1 read input rows [0, 4)
(0, 4)
"""

from __future__ import annotations

__all__ = ["out_size", "input_range", "local_padding", "dilated"]


def dilated(n: int, ld: int) -> int:
    """The size of ``n`` elements with ``ld - 1`` zeros between neighbours."""
    return ld * (n - 1) + 1 if n > 0 else 0


def out_size(n: int, k: int, stride: int = 1, lo: int = 0, hi: int = 0, ld: int = 1, rd: int = 1) -> int:
    """The output size along one dim (may be < 1: the caller refuses it)."""
    span = dilated(n, ld) + lo + hi - (rd * (k - 1) + 1)
    return span // stride + 1 if span >= 0 else 0


def input_range(o0: int, o1: int, n: int, k: int, stride: int = 1, lo: int = 0, ld: int = 1,
                rd: int = 1) -> tuple[int, int]:
    """The input positions ``[i0, i1)`` (within ``[0, n)``; possibly empty) that output positions
    ``[o0, o1)`` read: the halo of a spatial block."""
    q0 = stride * o0 - lo                        # first dilated position read
    q1 = stride * (o1 - 1) + rd * (k - 1) - lo   # last one
    i0 = max(0, -(-q0 // ld))
    i1 = min(n, q1 // ld + 1) if q1 >= 0 else 0
    return (i0, max(i0, i1)) if i0 < n else (n, n)


def local_padding(a: int, nb: int, o0: int, o1: int, k: int, stride: int, lo: int, ld: int,
                  rd: int) -> tuple[int, int]:
    """The (lo, hi) padding that makes the op on the input block ``[a, a + nb)`` compute exactly
    output positions ``[o0, o1)``: the block kernel is the op itself with this padding."""
    lo_b = lo + ld * a - stride * o0
    hi_b = (o1 - o0 - 1) * stride + rd * (k - 1) + 1 - dilated(nb, ld) - lo_b
    return lo_b, hi_b
