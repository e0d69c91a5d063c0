"""The gradient of a ``max`` sparse einsum with sparse operands (issue 24): ``plan.vjp`` of
``out = max over the aggregated labels of prod_k X_k``, as torch's ``amax`` of the same product on
the densified operands gives it: each output element's gradient goes to the terms equal to its
maximum, split evenly among ties. The absent entries of the sparse operand are terms too (their
product is 0): where an output's maximum is 0 and some of its terms are absent, they share its
gradient (and pass nothing on: their factor is 0). Computed on the products at the stored entries
(entries x the labels the sparse operand lacks), never on the dense product. With two or more
sparse operands the stored terms are their entries joined on their shared labels (every pair
where they share none): a term where any of them is absent is an absent term.

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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.errors import UnsupportedOpError
from einjoin.sparse.plan import SparsePlan
from einjoin.sparse.tensor import SparseTensor, from_coo

__all__ = ["max_vjp"]

MAX_TERMS = 1 << 26  # the products at the stored entries that one gradient may hold


def max_vjp(plan: SparsePlan, g: np.ndarray, positions: list[int], what: str) -> list[SparseTensor | np.ndarray]:
    """The gradients at ``positions`` of a max plan, given the output's gradient ``g`` (dense, of
    the output's shape): dense arrays for dense operands, a SparseTensor on each sparse operand's
    stored entries for it. With several sparse operands the terms that can be nonzero are their
    entries joined on their shared labels (:func:`_join`); every other term is an absent one."""
    return max_grads(plan.last_operands, plan.in_labels, plan.out_labels, plan.sizes, plan.dtype, g, positions,
                     what)


def max_grads(values: Sequence[Any], in_labels: Sequence[Sequence[str]], out_labels: Sequence[str],
              sizes: Mapping[str, int], dtype: Any, g: np.ndarray, positions: list[int],
              what: str) -> list[SparseTensor | np.ndarray]:
    """:func:`max_vjp` on its pieces: the operands ``values`` (SparseTensors and arrays) with
    labels ``in_labels``, the output's labels, every label's size and the result's dtype. A
    graph's max node differentiates through it (a ``maxgrad`` kernel: ``graph_plans.PlanCache``)."""
    at = [k for k, v in enumerate(values) if isinstance(v, SparseTensor)]
    labels = [tuple(ls) for ls in in_labels]
    if not at or any(len(set(ls)) != len(ls) for ls in labels):
        raise UnsupportedOpError(f"{what}: max aggregation is differentiated with sparse operands and no label "
                                 f"repeated within an operand; use agg='sum', or the dense einsum")
    la, coords, entry = _join(values, labels, at, sizes, what)  # the co-present entries' terms
    n = len(coords)
    rest = list(dict.fromkeys(lab for ls in labels for lab in ls if lab not in la))
    shape = (n, *(sizes[r] for r in rest))
    if math.prod(shape) > MAX_TERMS:
        raise UnsupportedOpError(f"{what}: the gradient of a max holds every product at the stored entries, "
                                 f"{math.prod(shape)} here (more than {MAX_TERMS}); use agg='sum'")
    wide = np.result_type(dtype, np.float32)

    def gathered(arr: Any, ls: tuple[str, ...]) -> np.ndarray:
        """``arr`` (labels ``ls``) at the terms' coordinates, broadcastable to ``shape``."""
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

    def stored(k: int) -> np.ndarray:  # sparse operand k's value at each term's entry
        x = values[k]
        assert isinstance(x, SparseTensor)
        out: np.ndarray = np.asarray(x.coo()[1], wide)[entry[k]].reshape([n] + [1] * len(rest))
        return out

    factors = {k: (stored(k) if k in entry else gathered(v, labels[k])) for k, v in enumerate(values)}
    prod = np.ones(shape, wide)
    for f in factors.values():
        prod = prod * f
    out_labels = tuple(out_labels)
    out_dims = tuple(sizes[lab] for lab in out_labels)
    size = math.prod(out_dims)
    where = flat_index(out_labels, out_dims).ravel()
    best = np.full(size, -np.inf, wide)
    np.maximum.at(best, where, prod.ravel())
    present = np.bincount(where, minlength=size)
    terms = math.prod(sizes[lab] for lab in sizes if lab not in out_labels)
    absent = terms - present  # terms where some sparse factor is absent: products of 0
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
        if k in entry:  # on its stored entries: each term's share summed onto the entry it read
            x = values[k]
            assert isinstance(x, SparseTensor)
            xc = x.coo()[0]
            kind = np.dtype(x.dtype) if np.dtype(x.dtype).kind == "f" else wide
            per_term = others.reshape(n, math.prod(shape[1:])).sum(axis=1)
            v = np.bincount(entry[k], weights=per_term, minlength=len(xc)).astype(kind, copy=False)
            grads.append(from_coo(f"d{x.name}", xc, v, x.shape, x.block, summed=True))
            continue
        dims = tuple(np.shape(values[k]))
        out = np.zeros(math.prod(dims), wide)
        np.add.at(out, flat_index(labels[k], dims).ravel(), others.ravel())
        grads.append(out.reshape(dims).astype(dtype, copy=False))
    return grads


def _join(values: Sequence[Any], labels: list[tuple[str, ...]], at: list[int], sizes: Mapping[str, int],
          what: str) -> tuple[tuple[str, ...], np.ndarray, dict[int, np.ndarray]]:
    """The terms at which every sparse operand (positions ``at``) has a stored entry: their
    labels (the sparse operands' together), each term's coordinates on them, and per sparse
    operand the entry each term reads. One operand: its entries. More: joined one at a time on
    the labels shared with those before (sort-merge on their key codes); none shared is every
    pair. Capped at :data:`MAX_TERMS` joined terms."""
    first = at[0]
    xc, _ = values[first].coo()
    la = labels[first]
    coords = np.asarray(xc, np.int64).reshape(-1, len(la))
    entry = {first: np.arange(len(coords))}
    for k in at[1:]:
        kc = np.asarray(values[k].coo()[0], np.int64).reshape(-1, len(labels[k]))
        shared = [lab for lab in labels[k] if lab in la]
        left = _codes(coords, [la.index(lab) for lab in shared], [sizes[lab] for lab in shared])
        right = _codes(kc, [labels[k].index(lab) for lab in shared], [sizes[lab] for lab in shared])
        order = np.argsort(right, kind="stable")
        lo = np.searchsorted(right[order], left, "left")
        hi = np.searchsorted(right[order], left, "right")
        count = hi - lo
        if int(count.sum()) > MAX_TERMS:
            raise UnsupportedOpError(f"{what}: the gradient of a max joins the sparse operands' stored entries, "
                                     f"{int(count.sum())} terms here (more than {MAX_TERMS}); use agg='sum'")
        li = np.repeat(np.arange(len(coords)), count)  # each left term once per matching entry of k
        ri = order[np.repeat(lo - np.cumsum(count) + count, count) + np.arange(len(li))]
        new = [lab for lab in labels[k] if lab not in la]
        coords = np.concatenate([coords[li], kc[ri][:, [labels[k].index(lab) for lab in new]]], axis=1)
        entry = {j: e[li] for j, e in entry.items()}
        entry[k] = ri
        la = la + tuple(new)
    return la, coords, entry


def _codes(coords: np.ndarray, cols: list[int], dims: list[int]) -> np.ndarray:
    """Each row's key code on the columns ``cols`` (mixed radix ``dims``); all 0 for no column."""
    code = np.zeros(len(coords), np.int64)
    for c, d in zip(cols, dims):
        code = code * d + coords[:, c]
    return code


def _strides(dims: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= d
    return out[::-1]
