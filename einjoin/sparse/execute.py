"""The in-memory relational executor of one sparse einsum.

Every operand becomes a relation at the chosen layout (keys over its relational labels, payloads
over all its labels). The relations are joined on their shared keys (sorted codes and
``searchsorted``: a sort-merge join done with vectorised numpy), one operand at a time, smallest
first. The joined tuples are sorted by output key and processed in chunks: the payloads of a
chunk are gathered and the einsum's own kernel runs batched over the chunk (one ``np.einsum``
with a batch label), then ``reduceat`` combines the tuples of each output key (hash aggregation
by sort). ``max`` aggregation multiplies out the payloads and masks the zero padding of edge
blocks; an output key that misses some aggregated block (an absent tuple, value 0) also takes 0.

>>> import numpy as np, einjoin as ej
>>> a = ej.sparse("A", np.array([[0., 2.], [0., 0.], [1., 0.]]))
>>> b = np.array([[1., 1.], [3., 4.]])
>>> ej.einsum("ij,jk->ik", a, b).todense().tolist()
[[6.0, 8.0], [0.0, 0.0], [1.0, 1.0]]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from einjoin.errors import UnsupportedOpError
from einjoin.sparse.kernels import rowprod, spmm
from einjoin.sparse.layout import Layout
from einjoin.sparse.tensor import SparseTensor, grid_of, half

__all__ = ["Relation", "relation_of", "execute", "RunCounts", "zero_padding"]

CHUNK_ELEMENTS = 1 << 21  # gathered payload elements per batched kernel call (memory bound)


@dataclass
class Relation:
    """One operand at a layout: keys (n × len(rel)) over ``rel`` labels, payloads over ``labels``."""

    labels: tuple[str, ...]
    rel: tuple[str, ...]
    keys: np.ndarray
    data: np.ndarray
    derived: dict[tuple[object, ...], object] | None = None  # the sparse tensor's (SparseTensor.derived)


@dataclass
class RunCounts:
    """What a run actually met: tuples per operand, joined tuples, output tuples."""

    tuples: tuple[int, ...]
    joined: int
    out: int


def relation_of(value: SparseTensor | np.ndarray, labels: tuple[str, ...], layout: Layout
                ) -> Relation:
    """The relation of one operand at ``layout`` (a dense array becomes every block)."""
    shape = tuple(value.shape)
    block = tuple(layout.extent(lab, n) if layout.relational(lab) else max(n, 1)
                  for lab, n in zip(labels, shape))
    rel_dims = [d for d, lab in enumerate(labels) if layout.relational(lab)]
    rel = tuple(labels[d] for d in rel_dims)
    if isinstance(value, SparseTensor):
        st = value.reblock(block)
        keys = st.keys if len(rel_dims) == len(shape) else st.keys[:, rel_dims]  # no copy when all keyed
        return Relation(labels, rel, keys, st.data, st.derived)
    grid = grid_of(shape, block)
    arr = np.asarray(value)
    padded_shape = tuple(g * b for g, b in zip(grid, block))
    if padded_shape != shape:
        pad = np.zeros(padded_shape, arr.dtype)
        pad[tuple(slice(0, n) for n in shape)] = arr
        arr = pad
    r = len(shape)
    split = arr.reshape(tuple(x for gb in zip(grid, block) for x in gb))
    front = [2 * d for d in rel_dims]
    rest = [2 * d for d in range(r) if d not in rel_dims] + [2 * d + 1 for d in range(r)]
    data = split.transpose(front + rest).reshape((-1, *block))
    keys = (np.indices(tuple(grid[d] for d in rel_dims)).reshape(len(rel_dims), -1).T if rel_dims
            else np.zeros((1, 0), np.int64))
    return Relation(labels, rel, np.ascontiguousarray(keys, np.int64), data)


def _codes(cols: Sequence[np.ndarray], grid: Sequence[int], what: str) -> np.ndarray:
    if math.prod(grid) >= 2 ** 62:
        raise UnsupportedOpError(f"{what}: a key grid of {math.prod(grid)} blocks overflows int64 codes")
    code = np.zeros(len(cols[0]) if cols else 0, np.int64)
    for c, g in zip(cols, grid):
        code = code * g + c
    return code


def _join(rels: Sequence[Relation], grid: Mapping[str, int], out_rel: Sequence[str], what: str
          ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Joined tuples: key columns per relational label and, per operand, the tuple index. The
    join starts from the relation keyed on the leading output labels (its sorted keys leave the
    joined tuples grouped by output key: no sort for the aggregation), else the smallest."""
    n = len(rels)
    lead = [i for i in range(n) if out_rel and rels[i].rel[:len(out_rel)] == tuple(out_rel)]
    first = min(lead or range(n), key=lambda i: len(rels[i].keys))
    cols = {lab: rels[first].keys[:, p] for p, lab in enumerate(rels[first].rel)}
    idx: list[np.ndarray | None] = [None] * n
    idx[first] = np.arange(len(rels[first].keys))
    m = len(rels[first].keys)
    todo = [i for i in range(n) if i != first]
    while todo:
        sharing = [i for i in todo if set(rels[i].rel) & set(cols)]
        nxt = min(sharing or todo, key=lambda i: len(rels[i].keys))
        todo.remove(nxt)
        y = rels[nxt]
        shared = [lab for lab in y.rel if lab in cols]
        if shared:
            g = [grid[lab] for lab in shared]
            ca = _codes([cols[lab] for lab in shared], g, what)
            cb = _codes([y.keys[:, y.rel.index(lab)] for lab in shared], g, what)
            if len(shared) == len(y.rel) and _is_range(cb, math.prod(g)):
                # y holds every key of its grid in row-major order (a dense operand): tuple code
                # is its index, one match each, the joined tuples stay as they are (no search)
                idx[nxt] = ca
                continue
            order = np.argsort(cb, kind="stable")
            cbs = cb[order]
            lo = np.searchsorted(cbs, ca, "left")
            cnt = np.searchsorted(cbs, ca, "right") - lo
        else:
            order = np.arange(len(y.keys))
            lo = np.zeros(m, np.int64)
            cnt = np.full(m, len(y.keys), np.int64)
        total = int(cnt.sum())
        left = np.repeat(np.arange(m), cnt)
        within = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        right = order[np.repeat(lo, cnt) + within]
        cols = {lab: c[left] for lab, c in cols.items()}
        for p, lab in enumerate(y.rel):
            if lab not in cols:
                cols[lab] = y.keys[right, p]
        idx = [None if i is None else i[left] for i in idx]
        idx[nxt] = right
        m = total
    return cols, [i if i is not None else np.zeros(0, np.int64) for i in idx]


def _derived(rels: Sequence[Relation], key: tuple[object, ...]
             ) -> tuple[dict[tuple[object, ...], object], tuple[object, ...]] | None:
    """Where to keep structures of this step's join that depend on one sparse operand's keys
    alone (every other operand dense: all its keys present), and under which key."""
    sparse = [r for r in rels if r.derived is not None]
    if len(sparse) != 1:
        return None
    assert sparse[0].derived is not None
    return sparse[0].derived, key + tuple(len(r.keys) for r in rels)


def _is_range(code: np.ndarray, n: int) -> bool:
    """Whether ``code`` is 0, 1, ..., n-1 (a relation with every key of its grid, in order)."""
    return len(code) == n and (n == 0 or (int(code[0]) == 0 and bool(np.all(np.diff(code) == 1))))


@dataclass(frozen=True)
class Joined:
    """A step's joined tuples grouped by output key: key columns and per-operand tuple indices
    (:func:`_join`), their count ``m``, the order that groups them (``grouped``: already grouped,
    ``order`` is then 0..m-1), each group's first tuple ``starts``, the output keys (None when no
    output label is relational), the group count and each tuple's group ``gid``."""

    cols: dict[str, np.ndarray]
    idx: list[np.ndarray]
    m: int
    order: np.ndarray
    grouped: bool
    starts: np.ndarray
    keys: np.ndarray | None
    ngroups: int
    gid: np.ndarray


def _joined(rels: Sequence[Relation], grid: Mapping[str, int], out_rel: list[str], what: str,
            derived: tuple[dict[tuple[object, ...], object], tuple[object, ...]] | None) -> Joined:
    """The join and its grouping by output key; kept in ``derived`` (the one sparse operand's
    dict: every other operand is dense, a complete grid, so the join depends on that operand's
    keys alone) for the next run with the same tensor. Why: A·H on 5M edges built ~10 arrays of
    5M elements a run (codes, tuple indices, group ids), ~0.1 s CPU against a ~1 s kernel. The
    kept arrays are read-only (a result's keys are copied out of them by the callers)."""
    if derived is not None:
        hit = derived[0].get(("join",) + derived[1])
        if isinstance(hit, Joined):
            return hit
    cols, idx = _join(rels, grid, out_rel, what)
    m = len(idx[0])
    if out_rel:
        gcode = _codes([cols[lab] for lab in out_rel], [grid[lab] for lab in out_rel], what)
        grouped = m < 2 or bool(np.all(gcode[1:] >= gcode[:-1]))  # already grouped (see _join)
        if grouped:
            order, gsorted = np.arange(m), gcode
        else:
            order = np.argsort(gcode, kind="stable")
            gsorted = gcode[order]
        starts = np.flatnonzero(np.r_[True, gsorted[1:] != gsorted[:-1]]) if m else np.zeros(0, np.int64)
        ucode = gsorted[starts]
        keys: np.ndarray | None = (np.stack(np.unravel_index(ucode, tuple(grid[lab] for lab in out_rel)),
                                            axis=1).astype(np.int64) if m else
                                   np.zeros((0, len(out_rel)), np.int64))
        ngroups = len(starts)
    else:
        order, grouped = np.arange(m), True
        starts = np.zeros(min(m, 1), np.int64)
        keys, ngroups = None, 1
    gid = np.zeros(m, np.int64)
    if m:
        gid[starts[1:]] = 1
        gid = np.cumsum(gid)
    j = Joined(cols, idx, m, order, grouped, starts, keys, ngroups, gid)
    if derived is not None:
        for a in (*cols.values(), *idx, order, starts, gid, *(() if keys is None else (keys,))):
            if a.base is None or a.flags.owndata:  # views of the tensor's keys stay as they are
                a.flags.writeable = False
        derived[0][("join",) + derived[1]] = j
    return j


def _letters(labels: Sequence[str]) -> tuple[dict[str, str], str]:
    """(label -> the letter np.einsum sees, a free letter): a label that is an ASCII letter keeps
    it, others (``α``: einjoin takes any letter, np.einsum only ASCII ones) get free ones."""
    pool = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in labels]
    letters = {lab: lab if lab.isascii() and lab.isalpha() else pool.pop()
               for lab in dict.fromkeys(labels)}
    return letters, pool[0]


def execute(values: Sequence[SparseTensor | np.ndarray], in_labels: Sequence[tuple[str, ...]],
            out_labels: tuple[str, ...], sizes: Mapping[str, int], layout: Layout, agg: str,
            dtype: np.dtype, what: str, into: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray | None, RunCounts]:
    """Run the einsum: (output payloads, output keys over the relational output labels or None
    when no output label is relational, counts). Payloads are over ``out_labels`` at the layout's
    extents, edge padding zero. ``into``: a buffer for the payloads of a sum, used (zeroed first)
    when it has their shape and the compute dtype (a device's rows of the whole result:
    `einjoin.sparse.distribute` then needs no concatenation)."""
    rels = [relation_of(v, ls, layout) for v, ls in zip(values, in_labels)]
    grid = {lab: -(-sizes[lab] // b) for lab, b in layout.blocks.items() if b}
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    derived = _derived(rels, (tuple(in_labels), out_labels, tuple(layout.blocks.items()),
                              tuple(sorted(grid.items()))))
    j = _joined(rels, grid, out_rel, what, derived)
    cols, idx, m, order, grouped, starts, keys, ngroups, gid = (
        j.cols, j.idx, j.m, j.order, j.grouped, j.starts, j.keys, j.ngroups, j.gid)
    out_ext = tuple(layout.extent(lab, sizes[lab]) for lab in out_labels)
    compute = np.dtype(np.float32) if half(dtype) else dtype  # torch's accumulation of halves
    lowest: float = -np.inf if compute.kind == "f" else int(np.iinfo(compute.type).min)
    if agg == "sum" and into is not None and into.shape == (ngroups, *out_ext) and into.dtype == compute:
        out = into
        out.fill(0)
    else:
        out = np.zeros((ngroups, *out_ext), compute) if agg == "sum" else \
            np.full((ngroups, *out_ext), lowest, compute)
    letters, z = _letters([lab for ls in in_labels for lab in ls])
    all_labels = list(out_labels) + [lab for ls in in_labels for lab in ls if lab not in out_labels]
    all_labels = list(dict.fromkeys(all_labels))
    eq = ",".join(z + "".join(letters[lab] for lab in ls) for ls in in_labels) + "->" + z + \
        "".join(letters[lab] for lab in out_labels)
    per_tuple = sum(math.prod(r.data.shape[1:]) for r in rels) + math.prod(out_ext)
    if agg == "max":
        per_tuple += math.prod(layout.extent(lab, sizes[lab]) for lab in all_labels)
    chunk = max(1, CHUNK_ELEMENTS // max(per_tuple, 1))
    ufunc = np.add if agg == "sum" else np.maximum
    m_done = 0
    if layout.kernel == "spmm" and agg == "sum" and m:
        spmm(rels, idx, None if grouped else order, gid, in_labels, out_labels, out, compute, _letters, derived)
        m_done = m
    elif layout.kernel == "rowprod" and agg == "sum" and m:
        rowprod(rels, idx, None if grouped else order, gid, in_labels, out_labels, out, compute)
        m_done = m
    elif layout.kernel == "looped" and agg == "sum" and m:
        # few large payloads: one BLAS-backed einsum per joined tuple, on views (no gathers)
        eq1 = eq.replace(z, "")
        path: Any = None
        for t in range(m):
            k = order[t]
            args = [r.data[i[k]].astype(compute, copy=False) for r, i in zip(rels, idx)]
            if path is None:  # the contraction order (BLAS pairs) worked out once
                path = np.einsum_path(eq1, *args, optimize="greedy")[0]
            out[gid[t]] += np.einsum(eq1, *args, optimize=path)
        m_done = m
    for s in range(m_done, m, chunk):
        sel = order[s:s + chunk]
        payloads = [r.data[i[sel]].astype(compute, copy=False) for r, i in zip(rels, idx)]
        g = gid[s:s + chunk]
        seg = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        if agg == "sum":
            res = np.einsum(eq, *payloads, optimize=len(payloads) > 2)
            out[g[seg]] += _segment_sum(res, seg)
        else:
            res = _max_kernel(payloads, in_labels, all_labels, out_labels, cols, sel, layout, sizes,
                              lowest)
            out[g[seg]] = ufunc(out[g[seg]], ufunc.reduceat(res, seg, axis=0))
    if agg == "max":
        # an output key missing some aggregated block meets an absent tuple: a 0 in the max
        full = math.prod(grid[lab] for lab in all_labels if lab not in out_labels and lab in grid)
        count = np.diff(np.r_[starts, m]) if m else np.zeros(ngroups, np.int64)
        short = count < full
        if ngroups and not m:
            short = np.ones(ngroups, bool)
        out[short] = np.maximum(out[short], 0)
        zero_padding(out, keys, out_labels, out_rel, layout, sizes)
    counts = RunCounts(tuple(len(r.keys) for r in rels), m, ngroups if out_rel else int(m > 0))
    return out.astype(dtype, copy=False), keys, counts


def _segment_sum(res: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of rows (runs start at ``seg``): one sparse indicator matrix
    times the rows (``np.add.reduceat`` along axis 0 is several times slower)."""
    import scipy.sparse
    c = len(res)
    if c == 0:
        return res
    indicator = scipy.sparse.csr_array((np.ones(c, res.dtype), np.arange(c), np.r_[seg, c]),
                                       shape=(len(seg), c))
    return np.asarray(indicator @ res.reshape(c, -1)).reshape((len(seg),) + res.shape[1:])


def _max_kernel(payloads: Sequence[np.ndarray], in_labels: Sequence[tuple[str, ...]],
                all_labels: list[str], out_labels: tuple[str, ...], cols: Mapping[str, np.ndarray],
                sel: np.ndarray, layout: Layout, sizes: Mapping[str, int], lowest: float) -> np.ndarray:
    """max over the aggregated payload axes of the product (padding of edge blocks masked)."""
    prod: np.ndarray | None = None
    for p, ls in zip(payloads, in_labels):
        perm = [ls.index(lab) + 1 for lab in all_labels if lab in ls]
        view = p.transpose([0, *perm])
        shape = [p.shape[0]] + [p.shape[ls.index(lab) + 1] if lab in ls else 1 for lab in all_labels]
        view = view.reshape(shape)
        prod = view if prod is None else prod * view
    assert prod is not None
    prod = np.broadcast_to(prod, (prod.shape[0], *(layout.extent(lab, sizes[lab]) for lab in all_labels)))
    nout = len(out_labels)
    for ax, lab in enumerate(all_labels[nout:], start=nout + 1):
        b = layout.blocks[lab]
        if b is not None and sizes[lab] % b:
            pos = cols[lab][sel][:, None] * b + np.arange(b)[None, :]
            shape = [len(sel)] + [1] * len(all_labels)
            shape[ax] = b
            prod = np.where((pos < sizes[lab]).reshape(shape), prod, lowest)
    return prod.max(axis=tuple(range(nout + 1, len(all_labels) + 1))) if len(all_labels) > nout else \
        np.array(prod)


def zero_padding(out: np.ndarray, keys: np.ndarray | None, out_labels: tuple[str, ...],
                  out_rel: list[str], layout: Layout, sizes: Mapping[str, int]) -> None:
    """Keep the relation's invariant: payload positions past the shape hold 0."""
    if keys is None:
        return
    for p, lab in enumerate(out_rel):
        b = layout.blocks[lab]
        assert b is not None
        if sizes[lab] % b:
            ax = out_labels.index(lab) + 1
            pos = keys[:, p][:, None] * b + np.arange(b)[None, :]
            shape = [len(keys)] + [1] * len(out_labels)
            shape[ax] = b
            np.copyto(out, 0, where=np.broadcast_to((pos >= sizes[lab]).reshape(shape), out.shape))
