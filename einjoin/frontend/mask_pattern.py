"""A constant attention mask that is a causal or sliding-window pattern, found so that an imported
model's attention gets block sparsity (issue 24).

A torch model builds such masks itself (Mistral's sliding window: ``ones.tril() & ones.triu(-w +
1)``) and passes them to ``scaled_dot_product_attention``; the import makes that mask a fill node
(an expression of the indices, no data). When the fill holds exactly top-left causal or
sliding-window values, :func:`band_of` says which, and the attention drops the mask for
``causal=True[, window=w]``: its query blocks then read and compute only their band of keys.

>>> import einjoin as ej
>>> n = 6
>>> i, j = ej.arange(n).reshape((n, 1)), ej.arange(n).reshape((1, n))
>>> band_of(((j <= i) & (i - j < 3)).reshape((1, 1, n, n)).node, (n, n))
(True, 3)
>>> band_of((j <= i).reshape((1, n, n)).node, (n, n)), band_of((j < i).reshape((1, n, n)).node, (n, n))
((True, None), None)
"""

from __future__ import annotations

import functools

import numpy as np

from einjoin.ir.kernels import fill_kernel
from einjoin.ir.node import Node

__all__ = ["band_of", "MAX_CHECKED"]

MAX_CHECKED = 1 << 27  # mask elements checked at most (8192 x 8192 is 2**26); larger masks stay masks
_ROWS = 1024  # rows evaluated at a time (bounded memory)


def band_of(mask: Node, scores: tuple[int, int]) -> tuple[bool, int | None] | None:
    """``(True, window)`` (``window`` None: plain causal) where ``mask`` is a bool fill whose
    dims are 1 but its last two, which are the scores' own ``(L, S)``, holding exactly "key ``j``
    for query ``i`` where ``j <= i`` (and ``i - j < window``)"; else None (any other mask, one
    that broadcasts over the queries or keys, or one too large to check)."""
    if mask.kind != "fill" or mask.dtype != "bool" or mask.ndim < 2 or any(n != 1 for n in mask.shape[:-2]) \
            or tuple(mask.shape[-2:]) != tuple(scores):
        return None
    return _band(mask)


@functools.lru_cache(maxsize=64)
def _band(mask: Node) -> tuple[bool, int | None] | None:
    # kept per mask: a model's layers share one mask, and checking 8192 x 8192 costs ~0.3 s
    rows, cols = mask.shape[-2:]
    if rows == 0 or cols == 0 or rows * cols > MAX_CHECKED:
        return None
    lead = (0,) * (mask.ndim - 2)
    # the window from the last row: its allowed keys end at the diagonal (or the last key)
    last = _rows(mask, lead, rows - 1, rows, cols)[0]
    end = min(rows - 1, cols - 1)
    if not last[:end + 1].any():
        return None
    first = int(np.argmax(last[:end + 1]))  # its first allowed key: the window reaches back to it
    window = rows if first == 0 else rows - first  # from key 0: plain causal
    i0 = np.arange(_ROWS)[:, None]
    j = np.arange(cols)[None, :]
    for r0 in range(0, rows, _ROWS):
        r1 = min(rows, r0 + _ROWS)
        i = i0[:r1 - r0] + r0
        if not np.array_equal(_rows(mask, lead, r0, r1, cols), (j <= i) & (i - j < window)):
            return None
    return True, (None if window >= rows else window)


def _rows(mask: Node, lead: tuple[int, ...], r0: int, r1: int, cols: int) -> np.ndarray:
    return fill_kernel(mask.op.expr, lead + (r0, 0), (1,) * len(lead) + (r1 - r0, cols),  # type: ignore[union-attr]
                       "bool").reshape(r1 - r0, cols)
