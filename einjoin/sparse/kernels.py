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

CACHE_BYTES = 32 << 20  # rows of a payload relation that stay in the cache (the SpMM's order)
BY_COLUMN_MIN = 1 << 16  # SpMMs with fewer tuples run by rows (all in cache: the order hardly matters)

try:  # scipy's CSR / CSC x dense kernels, writing into their output (`@` returns a new array)
    from scipy.sparse import _sparsetools
    _MATVECS: Any = _sparsetools.csr_matvecs
    _CSC_MATVECS: Any = _sparsetools.csc_matvecs
except (ImportError, AttributeError):  # pragma: no cover - an older or newer scipy: the public path
    _MATVECS = _CSC_MATVECS = None

_IN_PLACE = {np.dtype(t) for t in (np.float32, np.float64, np.int64, np.complex64, np.complex128)}


class _Relation(Protocol):
    data: np.ndarray


def csr_add(out: np.ndarray, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray,
            x: np.ndarray, csc: bool = False) -> None:
    """``out += CSR(indptr, indices, data) @ x`` (out: rows × n, x: cols × n, both 2-D); with
    ``csc`` the matrix is in CSC form (indptr over columns, indices are rows)."""
    rows, n = out.shape
    routine = _CSC_MATVECS if csc else _MATVECS
    if routine is not None and out.dtype in _IN_PLACE and out.flags.c_contiguous:
        # the in-place routine needs one index dtype and one value dtype throughout, or it
        # would convert (and write into a copy)
        x = np.ascontiguousarray(x, out.dtype)
        data = np.ascontiguousarray(data, out.dtype)
        indices = np.ascontiguousarray(indices, indptr.dtype)
        routine(rows, len(x), n, indptr, indices, data, x.reshape(-1), out.reshape(-1))
        return
    import scipy.sparse
    form = scipy.sparse.csc_array if csc else scipy.sparse.csr_array
    mat = form((data, indices, indptr), shape=(rows, len(x)))
    out += np.asarray(mat @ x, out.dtype)


def _indptr(gid: np.ndarray, groups: int) -> np.ndarray:
    """CSR row pointers of tuples whose (sorted) group ids are ``gid``."""
    ptr: np.ndarray = np.r_[0, np.cumsum(np.bincount(gid, minlength=groups))].astype(np.int64)
    return ptr


def spmm(rels: Sequence[_Relation], idx: Sequence[np.ndarray], order: np.ndarray | None,
         gid: np.ndarray, in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
         out: np.ndarray, compute: np.dtype, letters: Any,
         derived: tuple[dict[tuple[object, ...], object], tuple[object, ...]] | None = None) -> None:
    """Every payload but one is a scalar: the sum is a sparse (groups × tuples of the big one)
    matrix of the scalars' products times the big relation's payloads (summed over their labels
    that are not output first). ``order`` None: the joined tuples are already grouped (no
    gathers of the index columns). ``derived`` (a sparse operand's dict and a key, when the join
    depends on its keys alone) keeps the matrix's column order between runs (:func:`_by_column`)."""
    sizes = [math.prod(r.data.shape[1:]) for r in rels]
    big = max(range(len(rels)), key=lambda k: sizes[k])
    lb = in_labels[big]
    keep = "".join(lab for lab in out_labels if lab in lb)
    lmap, z = letters(lb)
    pay = rels[big].data.astype(compute, copy=False)
    wide = [lab for lab in lb if pay.shape[1 + lb.index(lab)] > 1]
    if wide == [lab for lab in keep if lab in wide]:
        pay = pay.reshape(len(pay), -1)  # every label not output has one index, the rest in the
        # output's order: a view, no sum, no transpose
    else:  # labels of the big payload that are not output summed first, the rest in output order
        pay = np.einsum(f"{z}{''.join(lmap[lab] for lab in lb)}->{z}{''.join(lmap[lab] for lab in keep)}", pay)
    nb = len(pay)
    cols = idx[big] if order is None else idx[big][order]
    out2 = out.reshape(len(out), -1)
    pay2 = pay.reshape(nb, -1)
    by_col = _by_column(derived, gid, cols, len(out), nb, pay2.shape[1] * pay2.itemsize)
    scalars = [k for k in range(len(rels)) if k != big]

    def weights(perm: np.ndarray | None) -> np.ndarray:
        """The scalars' products per tuple (in column order under ``perm``)."""
        w: np.ndarray | None = None
        for k in scalars:
            i = idx[k] if order is None else idx[k][order]
            v = rels[k].data.reshape(-1)[i if perm is None else i[perm]].astype(compute, copy=False)
            w = v if w is None else w * v
        return np.ones(len(gid), compute) if w is None else w
    if by_col is None:
        if derived is None:
            rowptr = _indptr(gid, len(out))
        else:  # the row pointers depend on the join alone (kept with it)
            store, key = derived
            kept = store.get(("spmm rows",) + key)
            if isinstance(kept, np.ndarray) and len(kept) == len(out) + 1:
                rowptr = kept
            else:
                rowptr = store[("spmm rows",) + key] = _indptr(gid, len(out))
        csr_add(out2, rowptr, cols, weights(None), pay2)
        return
    perm, colptr, rows = by_col
    if derived is not None and len(scalars) == 1 and getattr(rels[scalars[0]], "derived", None) is derived[0]:
        # the values in column order are the sparse operand's own: kept with its keys' order
        store, key = derived
        w = store.get(("spmm values by column", compute.str) + key)
        if not isinstance(w, np.ndarray):
            w = store[("spmm values by column", compute.str) + key] = weights(perm)
    else:
        w = weights(perm)
    csr_add(out2, colptr, rows, w, pay2, csc=True)


def _by_column(derived: tuple[dict[tuple[object, ...], object], tuple[object, ...]] | None,
               gid: np.ndarray, cols: np.ndarray, groups: int, nb: int, row_bytes: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The SpMM's tuples in column order (permutation, column pointers, rows), or None to run
    it by rows. By rows each tuple reads a payload row and the output row stays; by columns each
    payload row is read once and tuples add into output rows. The side whose most used rows (as
    many as fit the cache) take the larger share of the tuples is the one to access at random:
    a power-law graph's A·H (rows by degree, columns uniform) runs ~1.4x faster by columns.
    Worked out once per sparse operand and step (``derived``; like ``SparseTensor.coo()``, it
    assumes the tensor's arrays are not changed in place); without it, by rows. The first run
    pays a counting sort (~0.1 s for 5M tuples)."""
    if derived is None or _CSC_MATVECS is None or len(gid) < BY_COLUMN_MIN:
        return None
    store, key = derived
    hit = store.get(("spmm by column",) + key)
    if hit is None:
        import scipy.sparse
        fit = max(1, CACHE_BYTES // max(row_bytes, 1))

        def share(counts: np.ndarray) -> float:  # tuples in the `fit` most used rows
            top = counts if len(counts) <= fit else np.partition(counts, len(counts) - fit)[-fit:]
            return float(top.sum())
        rowptr = _indptr(gid, groups)
        # scipy's CSR -> CSC (a counting sort, O(tuples + columns)) of the tuple numbers: the
        # permutation into column order (no argsort)
        csc = scipy.sparse.csr_array((np.arange(len(gid), dtype=np.int64), cols, rowptr),
                                     shape=(groups, nb)).tocsc()
        hit = ()
        if share(np.diff(rowptr)) > share(np.diff(csc.indptr)):
            hit = (np.asarray(csc.data), np.asarray(csc.indptr), np.asarray(csc.indices))
        store[("spmm by column",) + key] = hit
    assert isinstance(hit, tuple)
    return hit if hit else None


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
