"""Gradients of sparse einsums (issue 24): the vector-Jacobian product of a :class:`SparsePlan`.

For ``out = sum over the aggregated labels of prod_k X_k`` (a ``mul`` join, ``sum``
aggregation), the gradient of operand k given the output's gradient ``G`` is again a sparse
einsum: ``G`` joined with every other operand, summed onto k's labels. So it runs on the same
executor, and the sparse operands stay sparse:

- a **dense** operand's gradient is that einsum (``A^T G`` for ``ij,jk->ik``), a dense array of
  the operand's shape, contracted two factors at a time (pairs with a sparse factor as sparse
  einsums, dense pairs by BLAS); a label only that operand has (summed away, e.g. ``k`` in
  ``ij,k->ij``) gets the gradient broadcast along it;
- a **sparse** operand's gradient is restricted to its stored entries: the einsum is joined with
  the operand's *support* (ones on its stored entries), so only those entries are computed (the
  sampled dense-dense product, SDDMM) and the result is a :class:`SparseTensor` with exactly the
  operand's entries, in the operand's block size. ``A`` is never densified. (Entries that are
  not stored are structural zeros: the gradient there is not computed and not returned.) When
  every other factor is dense (a GNN's ``dA = (G·(H·W)ᵀ) on A's entries``), the SDDMM gathers
  their slices at the stored coordinates in numpy, after contracting dense factors that do not
  grow (``H·W``): the planner's pairing could build the n × n ``G·(H·W)ᵀ`` first.

``max`` aggregation with sparse operands: :mod:`einjoin.sparse.grad_max` (each output's
gradient to its maximal terms, ties split as torch's ``amax``). The gradients are computed at
the operands of the plan's last run (the compiled ones before any run); their sparse einsums
are compiled on the first call and rerun (replanned per block histogram,
:mod:`einjoin.sparse.replan`) on later ones, on the plan's engine and devices (the gathered
SDDMM runs in this process).

A GNN layer ``out = A·H·W`` with ``loss = mean((out - Y)^2)``:

>>> import numpy as np, einjoin as ej
>>> rng = np.random.default_rng(0)
>>> A = ej.sparse("A", (np.array([[0, 1, 2, 2], [1, 2, 0, 2]]), np.array([1., 2., 3., 4.]), (3, 3)))
>>> H, W, Y = rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal((3, 2))
>>> plan = ej.sparse_compile("ij,jk,kl->il", A, H, W)
>>> out = plan.run().todense()
>>> dA, dH, dW = plan.vjp(2 * (out - Y) / out.size)   # d loss / d out, then back through A·H·W
>>> G, Ad = 2 * (out - Y) / out.size, A.todense()
>>> np.allclose(dH, Ad.T @ G @ W.T), np.allclose(dW, (Ad @ H).T @ G)
(True, True)
>>> dA.nnz == A.nnz, np.allclose(dA.todense(), (G @ (H @ W).T) * (Ad != 0))  # SDDMM on A's entries
(True, True)
"""

from __future__ import annotations

import math
import string
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.sparse.execute import CHUNK_ELEMENTS
from einjoin.sparse.grad_max import max_vjp
from einjoin.sparse.plan import GRAD, SparsePlan, sparse_compile
from einjoin.sparse.tensor import SparseTensor, dense_operand, from_coo, key_codes, restore_dims

__all__ = ["sparse_vjp"]

# per plan: the compiled gradient einsums, keyed by (operand, equation, the kinds and dtypes of
# their inputs), so that a training loop compiles them once and reruns them
_PLANS: weakref.WeakKeyDictionary[SparsePlan, dict[Any, SparsePlan]] = weakref.WeakKeyDictionary()


def sparse_vjp(plan: SparsePlan, grad_out: Any, wrt: Sequence[int | str] | None = None
               ) -> tuple[SparseTensor | np.ndarray, ...]:
    """The gradient of each operand of ``plan`` (at its last run's operands), given ``grad_out``,
    the gradient of the plan's result: an array (or a SparseTensor) of the result's shape; a
    number for a scalar result. Dense operands get dense arrays, sparse operands SparseTensors on
    their own stored entries. ``wrt`` (positions, or names as ``run`` takes them: a sparse
    tensor's name, ``x<i>`` for dense operand i) computes only those, in that order (a GNN's
    training step needs no ``dA``). ``plan.vjp(grad_out, wrt)`` is the same call.

    >>> import numpy as np, einjoin as ej
    >>> a = ej.sparse("A", np.array([[0., 2.], [3., 0.]]))
    >>> plan = ej.sparse_compile("ij,j->i", a, np.array([1., 10.]))
    >>> da, dx = plan.vjp(np.array([1., -1.]))
    >>> da.todense().tolist(), dx.tolist()          # da only where A has entries
    ([[0.0, 10.0], [-1.0, 0.0]], [-3.0, 2.0])
    >>> [g.tolist() for g in plan.vjp(np.array([1., -1.]), wrt=["x1"])]
    [[-3.0, 2.0]]
    """
    what = f"gradient of sparse einsum {plan.equation!r}"
    if plan.agg not in ("sum", "none", "max"):
        raise UnsupportedOpError(f"{what}: {plan.agg} aggregation; gradients of sparse einsums need a "
                                 f"sum or a max: use agg='sum', or the dense einsum")
    values = plan.last_operands
    out_shape = tuple(plan.sizes[lab] for lab in plan.out_labels)
    scale, g = _cotangent(grad_out, out_shape, plan.dtype, what)
    if plan.agg == "max":  # each output's gradient to its maximal terms (grad_max.py)
        dense_g = np.full(out_shape, scale, plan.dtype) if g is None else (
            g.todense() if isinstance(g, SparseTensor) else np.asarray(g)) * scale
        where = _positions(values, wrt, what)
        found = max_vjp(plan, dense_g, where, what)
        if plan.broadcast is not None:
            shapes, keeps = plan.broadcast
            found = [restore_dims(gr, shapes[k], keeps[k]) for gr, k in zip(found, where)]
        return tuple(found)
    cache = _PLANS.setdefault(plan, {})
    grads: list[SparseTensor | np.ndarray] = []
    for k in _positions(values, wrt, what):
        x, labels = values[k], plan.in_labels[k]
        others = [(v, ls) for j, (v, ls) in enumerate(zip(values, plan.in_labels)) if j != k]
        if g is not None:
            others.insert(0, (g, plan.out_labels))
        seen = {lab for _, ls in others for lab in ls}
        if isinstance(x, SparseTensor) and not any(isinstance(v, SparseTensor) for v, _ in others):
            grads.append(_sddmm(x, labels, others, scale))  # every other factor dense: gathered rows
            continue
        if isinstance(x, SparseTensor):
            others.insert(0, (_support(x), labels))  # SDDMM: only x's stored entries are computed
            target = labels
        else:
            target = tuple(lab for lab in labels if lab in seen)  # the rest is broadcast below
        grads.append(_one(plan, cache, k, x, labels, others, target, scale, what))
    if plan.broadcast is not None:  # computed on squeezed operands: each in its operand's shape as given
        shapes, keeps = plan.broadcast
        grads = [restore_dims(gr, shapes[k], keeps[k]) for gr, k in zip(grads, _positions(values, wrt, what))]
    return tuple(grads)


def _positions(values: Sequence[SparseTensor | np.ndarray], wrt: Sequence[int | str] | None,
               what: str) -> list[int]:
    names = [v.name if isinstance(v, SparseTensor) else f"x{i}" for i, v in enumerate(values)]
    if wrt is None:
        return list(range(len(values)))
    if isinstance(wrt, (str, int, np.integer)):  # one position may be a numpy int
        wrt = [wrt]
    out = []
    for w in wrt:
        hits = [w] if isinstance(w, (int, np.integer)) and not isinstance(w, bool) and 0 <= w < len(values) \
            else [i for i, n in enumerate(names) if isinstance(w, str) and n == w]
        if len(hits) != 1:
            raise EinjoinError(f"{what}: wrt {w!r} is not one operand (operands {', '.join(names)}, "
                               f"or positions 0 to {len(values) - 1})")
        out.append(int(hits[0]))
    return out


def _cotangent(grad_out: Any, shape: tuple[int, ...], dtype: np.dtype, what: str
               ) -> tuple[Any, SparseTensor | np.ndarray | None]:
    """(a factor, the gradient operand): a scalar result's gradient is a factor, not an operand."""
    if isinstance(grad_out, SparseTensor):
        g: SparseTensor | np.ndarray = grad_out
        if np.dtype(grad_out.dtype).kind != dtype.kind:
            g = SparseTensor(grad_out.name, grad_out.shape, grad_out.block, grad_out.keys,
                             _exact(grad_out.data, dtype, what), trusted=True)
    else:
        g = _exact(dense_operand(grad_out, 0, f"{what}: grad_out"), dtype, what)
        if not shape and g.size == 1:
            return g.reshape(()).item(), None
    if tuple(g.shape) != shape:
        raise ShapeError(f"{what}: grad_out of shape {tuple(g.shape)} where the result has shape {shape}")
    data = g.data if isinstance(g, SparseTensor) else g
    if shape and data.dtype.kind == "f" and data.size and not np.isfinite(data).all():
        # refused here, by its own name (the gradient einsums would name an internal operand)
        raise EinjoinError(f"{what}: grad_out holds inf or nan; a sparse product's gradient meets "
                           f"absent entries (zeros) with it, and 0 * inf is nan on the densified "
                           f"inputs: replace the non-finite values (np.nan_to_num)")
    if not shape:  # a 0-d SparseTensor: its one value, or none
        return (float(g.coo()[1].sum()) if isinstance(g, SparseTensor) else g.item()), None
    return 1, g


def _exact(g: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``g`` in the plan's dtype where its kind differs (an int or bool gradient of a float
    result: the gradient einsums refuse to mix kinds), when every value is kept; else refused."""
    if g.dtype.kind == dtype.kind:
        return g
    with np.errstate(invalid="ignore", over="ignore"):
        out = g.astype(dtype)
        same = g.size == 0 or bool(np.array_equal(out.astype(g.dtype), g))
    if not same:
        raise DTypeError(f"{what}: grad_out of dtype {g.dtype} has values that {dtype} (the plan's "
                         f"dtype) does not hold exactly; convert it first")
    return out


def _support(x: SparseTensor) -> SparseTensor:
    """Ones on ``x``'s stored entries (coordinate-wise, block size 1: the join keeps exactly them)."""
    s = x.derived.get(("grad_support",))  # kept with x's keys, as the executor's own structures
    if not isinstance(s, SparseTensor):
        coords, vals = x.coo()
        s = from_coo(x.name, coords, np.ones(len(vals), vals.dtype), x.shape, (1,) * x.ndim, summed=True)
        x.derived[("grad_support",)] = s
    return s


def _one(plan: SparsePlan, cache: dict[Any, SparsePlan], k: int, x: SparseTensor | np.ndarray,
         labels: tuple[str, ...], operands: list[tuple[Any, tuple[str, ...]]], target: tuple[str, ...],
         scale: Any, what: str) -> SparseTensor | np.ndarray:
    if isinstance(x, SparseTensor):
        eq = ",".join("".join(ls) for _, ls in operands) + "->" + "".join(target)
        res = _sparse_step(plan, cache, (k, eq), [v for v, _ in operands], eq)
    else:
        res = _pairwise(plan, cache, k, operands, target)
    dtype = np.result_type(x.dtype, res.dtype) if np.dtype(x.dtype).kind != "f" else np.dtype(x.dtype)
    if isinstance(x, SparseTensor):
        coords, _ = x.coo()
        vals = _gather(res, coords, x.shape) * scale
        return from_coo(f"d{x.name}", coords, vals.astype(dtype, copy=False), x.shape, x.block, summed=True)
    dense = res.todense() if isinstance(res, SparseTensor) else np.asarray(res)
    dense = dense * scale if scale != 1 else dense
    if target != labels:  # labels only x has: the gradient is the same along them
        src = [target.index(lab) if lab in target else None for lab in labels]
        dense = dense.transpose([d for d in src if d is not None]) if target else dense
        dense = dense.reshape(tuple(1 if d is None else x.shape[i] for i, d in enumerate(src)))
        dense = np.broadcast_to(dense, x.shape)
    return np.array(dense, dtype=dtype)


def _sparse_step(plan: SparsePlan, cache: dict[Any, SparsePlan], key: tuple[Any, ...], args: list[Any],
                 eq: str) -> SparseTensor | np.ndarray:
    """One sparse einsum on the plan's engine and devices: compiled on the first call, rerun after."""
    key = key + tuple((isinstance(v, SparseTensor), np.dtype(v.dtype).str) for v in args)
    sub = cache.get(key)
    if sub is not None:
        return sub.run(*args)
    dist, eng = plan.distribution, plan.engine
    sub = sparse_compile(eq, *args, engine=eng.name, duckdb_memory=eng.memory,
                         duckdb_temp=eng.temp_directory, duckdb_threads=eng.threads,
                         devices=dist.devices, backend=dist.backend)
    cache[key] = sub
    return sub.run()


def _pair_cost(va: Any, la: tuple[str, ...], vb: Any, lb: tuple[str, ...]) -> float:
    """Multiply-adds of one product: a sparse factor's entries times the other's labels it lacks."""
    sizes = dict(zip(la, va.shape)) | dict(zip(lb, vb.shape))
    sa, sb = isinstance(va, SparseTensor), isinstance(vb, SparseTensor)
    if not sa and not sb:
        return float(math.prod(sizes.values()))
    if sa and sb:
        shared = math.prod(sizes[lab] for lab in set(la) & set(lb))
        return float(va.nnz * vb.nnz / max(shared, 1))
    (sv, sl), (_, dl) = ((va, la), (vb, lb)) if sa else ((vb, lb), (va, la))
    return float(sv.nnz * math.prod(sizes[lab] for lab in dl if lab not in sl))


def _pairwise(plan: SparsePlan, cache: dict[Any, SparsePlan], k: int,
              operands: list[tuple[Any, tuple[str, ...]]], target: tuple[str, ...]) -> np.ndarray:
    """A dense operand's gradient: the factors contracted two at a time, the cheapest pair that
    shares a label first; a pair with a sparse factor is a sparse einsum (on the plan's engine and
    devices), a sparse result more than a quarter full is densified, two dense factors go to
    numpy (BLAS). Why not one n-ary sparse einsum: its later steps multiply an intermediate that
    is in effect dense (``Gᵀ·A``, n × 32 in a GNN's ``dH``) tuple by tuple, several times slower."""
    ops = list(operands)
    step = 0
    while len(ops) > 1:
        best: tuple[Any, ...] | None = None
        for a in range(len(ops)):
            for b in range(a + 1, len(ops)):
                (va, la), (vb, lb) = ops[a], ops[b]
                cand = (not set(la) & set(lb), _pair_cost(va, la, vb, lb), a, b)
                best = cand if best is None or cand[:2] < best[:2] else best
        assert best is not None
        _, _, a, b = best
        (va, la), (vb, lb) = ops[a], ops[b]
        rest = set(target) | {lab for c, (_, ls) in enumerate(ops) if c not in (a, b) for lab in ls}
        keep = tuple(dict.fromkeys(lab for lab in la + lb if lab in rest))
        eq = f"{''.join(la)},{''.join(lb)}->{''.join(keep)}"
        if isinstance(va, SparseTensor) or isinstance(vb, SparseTensor):
            r = _sparse_step(plan, cache, (k, step, eq), [va, vb], eq)
            if isinstance(r, SparseTensor) and r.nnz > 0.25 * math.prod(r.shape):
                r = r.todense()
        else:
            wa, wb = _wide(va, vb)
            r = _dense_pair(wa, wb, la, lb, keep)
        ops = [o for c, o in enumerate(ops) if c not in (a, b)] + [(r, keep)]
        step += 1
    v, ls = ops[0]
    dense = v.todense() if isinstance(v, SparseTensor) else np.asarray(v)
    return np.asarray(np.einsum(f"{''.join(ls)}->{''.join(target)}", dense))


def _dense_pair(va: np.ndarray, vb: np.ndarray, la: tuple[str, ...], lb: tuple[str, ...],
                keep: tuple[str, ...]) -> np.ndarray:
    """Two dense factors by ``tensordot`` (BLAS), when every label is kept or summed between
    them; else ``np.einsum`` (whose path for ``jk,lj->kl`` took 0.4 s against 0.015 s here)."""
    summed = [lab for lab in la if lab in lb and lab not in keep]
    if any(lab in lb and lab in keep for lab in la) or not set(la) ^ set(lb) <= set(keep):
        return np.asarray(np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(keep)}", va, vb, optimize=True))
    r = np.tensordot(va, vb, ([la.index(lab) for lab in summed], [lb.index(lab) for lab in summed]))
    labs = [lab for lab in la + lb if lab not in summed]
    return np.asarray(r.transpose([labs.index(lab) for lab in keep]))


def _wide(*arrays: np.ndarray) -> list[np.ndarray]:
    """float16 factors as float32 for numpy's products (float16 accumulates in float32)."""
    return [a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays]


def _sddmm(x: SparseTensor, labels: tuple[str, ...], operands: list[tuple[Any, tuple[str, ...]]],
           scale: Any) -> SparseTensor:
    """A sparse operand's gradient when every other factor is dense: at each stored entry, the
    other factors' slices at its coordinates multiplied and summed (numpy, in chunks of entries).
    Why not the planner's path: a sum of dense factors may pair two of them into an intermediate
    as large as ``x``'s dense shape (``G·Wᵀ`` with ``H`` is n × n in a GNN's ``dA``); here dense
    factors are only contracted first where that is no larger than either (``H·W``)."""
    coords, stored = x.coo()
    ct = np.result_type(x.dtype, *[v.dtype for v, _ in operands])
    ct = np.promote_types(ct, np.float32) if ct.kind == "f" else ct  # float16 adds in float32
    ops = _precontract([(np.asarray(v, ct), ls) for v, ls in operands], set(labels))
    used = {lab for _, ls in ops for lab in ls} | set(labels)
    batch = next(c for c in string.ascii_letters if c not in used)
    per = max(1, sum(math.prod(v.shape[d] for d, lab in enumerate(ls) if lab not in labels) for v, ls in ops))
    step = max(1, CHUNK_ELEMENTS // per)
    vals = np.zeros(len(coords), ct)
    for s in range(0, len(coords), step):
        c = coords[s:s + step]
        args, terms = [], []
        for v, ls in ops:
            keyed = [d for d, lab in enumerate(ls) if lab in labels]
            rest = [d for d in range(len(ls)) if d not in keyed]
            if keyed:  # the slices at the entries' coordinates: (entries, the other labels)
                v = v.transpose(keyed + rest)[tuple(c[:, labels.index(ls[d])] for d in keyed)]
            args.append(v)
            terms.append((batch if keyed else "") + "".join(ls[d] for d in rest))
        # no factor with one of x's labels: the gradient is the same number at every entry
        out = batch if any(batch in t for t in terms) else ""
        vals[s:s + step] = np.einsum(",".join(terms) + "->" + out, *args, optimize=True) if args else 1
    vals = vals * scale
    dtype = np.dtype(x.dtype) if np.dtype(x.dtype).kind == "f" else ct
    return from_coo(f"d{x.name}", coords, vals.astype(dtype, copy=False), x.shape, x.block, summed=True)


def _precontract(ops: list[tuple[np.ndarray, tuple[str, ...]]], target: set[str]
                 ) -> list[tuple[np.ndarray, tuple[str, ...]]]:
    """Dense factors sharing a label that is not ``target``'s, contracted pairwise while the
    result is no larger than either factor (labels no other factor has are summed)."""
    while True:
        for a in range(len(ops)):
            for b in range(a + 1, len(ops)):
                (va, la), (vb, lb) = ops[a], ops[b]
                if not (set(la) & set(lb)) - target:
                    continue
                rest = target | {lab for k, (_, ls) in enumerate(ops) if k not in (a, b) for lab in ls}
                keep = tuple(dict.fromkeys(lab for lab in la + lb if lab in rest))
                sizes = dict(zip(la, va.shape)) | dict(zip(lb, vb.shape))
                if math.prod(sizes[lab] for lab in keep) > max(va.size, vb.size):
                    continue
                merged = np.einsum(f"{''.join(la)},{''.join(lb)}->{''.join(keep)}", va, vb, optimize=True)
                ops = [o for k, o in enumerate(ops) if k not in (a, b)] + [(merged, keep)]
                break
            else:
                continue
            break
        else:
            return ops


def _gather(res: SparseTensor | np.ndarray, coords: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The values of ``res`` at ``coords`` (0 where ``res`` has no entry), without densifying."""
    if not isinstance(res, SparseTensor):
        return np.asarray(np.asarray(res)[tuple(coords.T)])
    rc, rv = res.coo()
    out = np.zeros(len(coords), rv.dtype)
    if not len(coords) or not len(rc):
        return out
    grid = tuple(max(n, 1) for n in shape)
    a, b = key_codes(rc, grid), key_codes(coords, grid)
    if a is None or b is None:  # a grid too large for int64 codes: rank the rows together instead
        _, inv = np.unique(np.concatenate([rc, coords]), axis=0, return_inverse=True)
        a, b = inv.reshape(-1)[:len(rc)], inv.reshape(-1)[len(rc):]
    order = np.argsort(a, kind="stable")
    pos = np.searchsorted(a[order], b).clip(0, len(a) - 1)
    hit = a[order][pos] == b
    out[hit] = rv[order][pos[hit]]
    return out


GRAD["vjp"] = sparse_vjp
