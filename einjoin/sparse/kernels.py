"""Kernels of the in-memory sparse executor that skip the batched einsum (issue 24).

The executor (`einjoin.sparse.execute`) joins the relations into joined tuples, grouped by output
key (``gid``, sorted), and picks a kernel by the layout's ``kernel`` (chosen by the cost model in
`einjoin.sparse.layout`):

* ``spmm`` — every payload but one is a scalar: a CSR matrix (groups × the big relation's tuples)
  of the scalars' products times the big payloads;
* ``rowprod`` — no label is summed inside a payload (every label with more than one index in a
  payload is an output label), e.g. MTTKRP ``ijk,jr,kr->ir`` keyed on i, j, k with r dense: per
  chunk of joined tuples the payload rows are gathered (``np.take`` into reused buffers), their
  broadcast product taken in place, and a CSR matrix of the scalar operands' products adds the
  rows into their output groups. No per-tuple einsum and no ``J·K × R`` Khatri-Rao matrix.

Both add into the output with scipy's CSR times dense routine writing in place (no temporary of
the output's size); float16 payloads compute in float32 (the executor's ``compute`` dtype).

>>> import numpy as np, einjoin as ej
>>> x = ej.sparse("X", (np.array([[0, 0, 1], [1, 0, 0], [1, 1, 0]]), np.array([1., 2., 3.]), (2, 2, 2)))
>>> b, c = np.arange(4.).reshape(2, 2), np.ones((2, 2))   # X[0,1,1]=1, X[0,0,1]=2, X[1,0,0]=3
>>> plan = ej.sparse_compile("ijk,jr,kr->ir", x, b, c)
>>> plan.steps[-1].layout.kernel, plan.run().todense().tolist()
('rowprod', [[2.0, 5.0], [0.0, 3.0]])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["ROW_CHUNK", "rowprod", "spmm", "csr_add"]

ROW_CHUNK = 1 << 18  # gathered elements per operand per chunk of rowprod (2 MiB of float64): MTTKRP,
# R 32, CPU s by chunk 2**12 / 2**14 / 2**16 / 2**18 / 2**20: 1M non-zeros 0.32 / 0.16 / 0.11 / 0.11 /
# 0.18; 10M 2.24 / 1.67 / 1.24 / 0.91 / 1.39 (smaller chunks pay numpy's per-call cost)

try:  # scipy's CSR x dense kernel, writing into its output (the public `@` returns a new array)
    from scipy.sparse import _sparsetools
    _MATVECS: Any = _sparsetools.csr_matvecs
except (ImportError, AttributeError):  # pragma: no cover - an older or newer scipy: the public path
    _MATVECS = None

_IN_PLACE = {np.dtype(t) for t in (np.float32, np.float64, np.int64, np.complex64, np.complex128)}


class _Relation(Protocol):
    data: np.ndarray


def csr_add(out: np.ndarray, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray,
            x: np.ndarray) -> None:
    """``out += CSR(indptr, indices, data) @ x`` (out: rows × n, x: cols × n, both 2-D)."""
    rows, n = out.shape
    if _MATVECS is not None and out.dtype in _IN_PLACE and out.flags.c_contiguous:
        # the in-place routine needs one index dtype and one value dtype throughout, or it
        # would convert (and write into a copy)
        x = np.ascontiguousarray(x, out.dtype)
        data = np.ascontiguousarray(data, out.dtype)
        indices = np.ascontiguousarray(indices, indptr.dtype)
        _MATVECS(rows, len(x), n, indptr, indices, data, x.reshape(-1), out.reshape(-1))
        return
    import scipy.sparse
    mat = scipy.sparse.csr_array((data, indices, indptr), shape=(rows, len(x)))
    out += np.asarray(mat @ x, out.dtype)


def _indptr(gid: np.ndarray, groups: int) -> np.ndarray:
    """CSR row pointers of tuples whose (sorted) group ids are ``gid``."""
    ptr: np.ndarray = np.r_[0, np.cumsum(np.bincount(gid, minlength=groups))].astype(np.int64)
    return ptr


def spmm(rels: Sequence[_Relation], idx: Sequence[np.ndarray], order: np.ndarray | None,
         gid: np.ndarray, in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
         out: np.ndarray, compute: np.dtype, letters: Any) -> None:
    """Every payload but one is a scalar: the sum is a sparse (groups × tuples of the big one)
    matrix of the scalars' products times the big relation's payloads (summed over their labels
    that are not output first). ``order`` None: the joined tuples are already grouped (no
    gathers of the index columns)."""
    sizes = [math.prod(r.data.shape[1:]) for r in rels]
    big = max(range(len(rels)), key=lambda k: sizes[k])
    w: np.ndarray | None = None
    for k, (r, i) in enumerate(zip(rels, idx)):
        if k != big:
            v = r.data.reshape(-1)[i if order is None else i[order]].astype(compute, copy=False)
            w = v if w is None else w * v
    if w is None:
        w = np.ones(len(gid), compute)
    lb = in_labels[big]
    keep = "".join(lab for lab in out_labels if lab in lb)
    lmap, z = letters(lb)
    pay = rels[big].data.astype(compute, copy=False)
    if keep != "".join(lb):  # labels of the big payload that are not output: summed first
        pay = np.einsum(f"{z}{''.join(lmap[lab] for lab in lb)}->{z}{''.join(lmap[lab] for lab in keep)}", pay)
    nb = len(pay)
    cols = idx[big] if order is None else idx[big][order]
    csr_add(out.reshape(len(out), -1), _indptr(gid, len(out)), cols, w, pay.reshape(nb, -1))


def rowprod(rels: Sequence[_Relation], idx: Sequence[np.ndarray], order: np.ndarray | None,
            gid: np.ndarray, in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
            out: np.ndarray, compute: np.dtype) -> None:
    """The sum over joined tuples of the broadcast product of their payloads, where every label
    with more than one index in a payload is an output label (see the module docstring)."""
    m = len(gid)
    out_ext = out.shape[1:]
    width = max(1, math.prod(out_ext))
    scalars = [k for k, r in enumerate(rels) if math.prod(r.data.shape[1:]) == 1]
    rows = [k for k in range(len(rels)) if k not in scalars]
    # each row payload as (tuples, its labels in output order, 1 for the output labels it lacks)
    views = []
    for k in rows:
        ls, data = in_labels[k], rels[k].data
        mine = [lab for lab in out_labels if lab in ls]
        ax = [1 + ls.index(lab) for lab in mine]  # the labels not output have one index here
        moved = data.transpose([0, *ax, *(a for a in range(1, data.ndim) if a not in ax)])
        flat = moved.reshape(len(data), *(data.shape[a] for a in ax)).astype(compute, copy=False)
        views.append((k, flat, tuple(data.shape[1 + ls.index(lab)] if lab in ls else 1 for lab in out_labels)))
    chunk = max(1, ROW_CHUNK // width)
    acc = np.empty((min(chunk, m), *out_ext), compute)
    bufs = {k: np.empty((min(chunk, m), *v.shape[1:]), compute) for k, v, _ in views}
    out2 = out.reshape(len(out), -1)
    for s in range(0, m, chunk):
        e = min(m, s + chunk)
        c = e - s
        sel = slice(s, e) if order is None else order[s:e]
        w: np.ndarray | None = None
        for k in scalars:
            v = rels[k].data.reshape(-1)[idx[k][sel]].astype(compute, copy=False)
            w = v if w is None else w * v
        a = acc[:c]
        if not views:
            a.fill(1)
        for n, (k, v, shape) in enumerate(views):
            if n == 0 and shape == out_ext:  # gathered straight into the product's buffer
                np.take(v, idx[k][sel], axis=0, out=a.reshape(c, *v.shape[1:]))
                continue
            got = np.take(v, idx[k][sel], axis=0, out=bufs[k][:c]).reshape(c, *shape)
            if n == 0:
                np.copyto(a, np.broadcast_to(got, a.shape))
            else:
                np.multiply(a, got, out=a)
        g = gid[s:e]
        g0 = int(g[0])
        ng = int(g[-1]) - g0 + 1
        csr_add(out2[g0:g0 + ng], _indptr(g - g0, ng), np.arange(c, dtype=np.int64),
                np.ones(c, compute) if w is None else w, a.reshape(c, -1))
