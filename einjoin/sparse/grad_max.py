"""The gradient of a ``max`` sparse einsum with one sparse operand (issue 24): ``plan.vjp`` of
``out = max over the aggregated labels of prod_k X_k``, as torch's ``amax`` of the same product on
the densified operands gives it: each output element's gradient goes to the terms equal to its
maximum, split evenly among ties. The absent entries of the sparse operand are terms too (their
product is 0): where an output's maximum is 0 and some of its terms are absent, they share its
gradient (and pass nothing on: their factor is 0). Computed on the products at the stored entries
(entries x the labels the sparse operand lacks), never on the dense product.

>>> import numpy as np, einjoin as ej
>>> a = ej.sparse("A", np.array([[0., 2.], [3., -1.]]))
>>> h = np.array([[1., -2.], [4., 1.]])
>>> plan = ej.sparse_compile("ij,jk->ik", a, h, agg="max")
>>> plan.run().todense().tolist()             # row 0: max(0 (absent) * h[0], 2 * h[1])
[[8.0, 2.0], [3.0, -1.0]]
>>> da, dh = plan.vjp(np.ones((2, 2)))
>>> dh.tolist()                               # each output's maximal term: A[i, j*] to h[j*]
[[3.0, 0.0], [2.0, 1.0]]
>>> da.todense().tolist()                     # h[j*, k] to A[i, j*], summed over k
[[0.0, 5.0], [1.0, 1.0]]
"""

from __future__ import annotations

import math
from typing import Any
import numpy as np

from einjoin.errors import UnsupportedOpError
from einjoin.sparse.plan import SparsePlan
from einjoin.sparse.tensor import SparseTensor, from_coo

__all__ = ["max_vjp"]

MAX_TERMS = 1 << 26  # the products at the stored entries that one gradient may hold


def max_vjp(plan: SparsePlan, g: np.ndarray, positions: list[int], what: str) -> list[SparseTensor | np.ndarray]:
    """The gradients at ``positions`` of a max plan, given the output's gradient ``g`` (dense, of
    the output's shape): dense arrays for dense operands, a SparseTensor on the sparse operand's
    stored entries for it."""
    values = plan.last_operands
    at = [k for k, v in enumerate(values) if isinstance(v, SparseTensor)]
    labels = [tuple(ls) for ls in plan.in_labels]
    if len(at) != 1 or any(len(set(ls)) != len(ls) for ls in labels):
        raise UnsupportedOpError(f"{what}: max aggregation is differentiated with exactly one sparse operand and "
                                 f"no label repeated within an operand; use agg='sum', or the dense einsum")
    s = at[0]
    x, la = values[s], labels[s]
    assert isinstance(x, SparseTensor)
    coords, vals = x.coo()
    n = len(vals)
    rest = list(dict.fromkeys(lab for ls in labels for lab in ls if lab not in la))
    sizes = plan.sizes
    shape = (n, *(sizes[r] for r in rest))
    if math.prod(shape) > MAX_TERMS:
        raise UnsupportedOpError(f"{what}: the gradient of a max holds every product at the stored entries, "
                                 f"{math.prod(shape)} here (more than {MAX_TERMS}); use agg='sum'")
    wide = np.result_type(plan.dtype, np.float32)

    def gathered(arr: Any, ls: tuple[str, ...]) -> np.ndarray:
        """``arr`` (labels ``ls``) at the entries' coordinates, broadcastable to ``shape``."""
        keyed = [d for d, lab in enumerate(ls) if lab in la]
        free = [d for d, lab in enumerate(ls) if lab not in la]
        t = np.transpose(np.asarray(arr, wide), keyed + free)
        t = t[tuple(coords[:, la.index(ls[d])] for d in keyed)] if keyed else t[None]
        order = sorted(range(len(free)), key=lambda i: rest.index(ls[free[i]]))
        t = np.transpose(t, [0] + [1 + i for i in order])
        return t.reshape([t.shape[0]] + [sizes[r] if r in {ls[d] for d in free} else 1 for r in rest])

    def flat_index(ls: tuple[str, ...], dims: tuple[int, ...]) -> np.ndarray:
        """Each term's flat position in an array of labels ``ls`` and shape ``dims``."""
        idx = np.zeros([1] * len(shape), np.int64)
        for lab, size, stride in zip(ls, dims, _strides(dims)):
            if lab in la:
                part = coords[:, la.index(lab)].reshape([n] + [1] * len(rest))
            else:
                part = np.arange(size).reshape([1] + [size if r == lab else 1 for r in rest])
            idx = idx + part * stride
        return np.broadcast_to(idx, shape)

    factors = {k: (gathered(v, labels[k]) if k != s else np.asarray(vals, wide).reshape([n] + [1] * len(rest)))
               for k, v in enumerate(values)}
    prod = np.ones(shape, wide)
    for f in factors.values():
        prod = prod * f
    out_labels = tuple(plan.out_labels)
    out_dims = tuple(sizes[lab] for lab in out_labels)
    size = math.prod(out_dims)
    where = flat_index(out_labels, out_dims).ravel()
    best = np.full(size, -np.inf, wide)
    np.maximum.at(best, where, prod.ravel())
    stored = np.bincount(where, minlength=size)
    terms = math.prod(sizes[lab] for lab in sizes if lab not in out_labels)
    absent = terms - stored  # terms whose sparse factor is absent: products of 0
    best = np.where(absent > 0, np.maximum(best, 0), best)
    hit = prod.ravel() == best[where]
    ties = np.bincount(where[hit], minlength=size) + np.where(best == 0, absent, 0)
    share = np.where(ties > 0, np.asarray(g, wide).reshape(-1) / np.maximum(ties, 1), 0)
    weight = np.where(hit, share[where], 0).reshape(shape)
    grads: list[SparseTensor | np.ndarray] = []
    for k in positions:
        others = weight
        for j, f in factors.items():
            if j != k:
                others = others * f
        if k == s:  # on the stored entries: the sum over the other labels
            kind = np.dtype(x.dtype) if np.dtype(x.dtype).kind == "f" else wide
            v = others.reshape(n, math.prod(shape[1:])).sum(axis=1).astype(kind, copy=False)
            grads.append(from_coo(f"d{x.name}", coords, v, x.shape, x.block, summed=True))
            continue
        dims = tuple(np.shape(values[k]))
        out = np.zeros(math.prod(dims), wide)
        np.add.at(out, flat_index(labels[k], dims).ravel(), others.ravel())
        grads.append(out.reshape(dims).astype(plan.dtype, copy=False))
    return grads


def _strides(dims: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= d
    return out[::-1]
