"""Sparse einsums whose join is not the product: ``join="add"``, ``"relu"``, ``"exp"``, ...

A product join keeps only co-present tuples (`einjoin.sparse.plan`). Any other join ``f`` is
computed here as two steps, equal to the same einsum on the densified operands (a missing entry
is 0):

- the elementwise join over the union of the operands' labels. When ``f(0, ..., 0) == 0`` (``add``,
  ``relu``, ``abs``, ``neg``, ``sqrt``, ``x0 * 2``; decided by evaluating the join's scalar
  expression at zeros of the operands' dtypes) and every operand is sparse over all of those
  labels, ``f`` is 0 wherever no operand stores an entry, so the result is sparse: ``f`` of the
  union of the stored entries (the relational "union all, then group by the key"; a missing
  operand's value is 0). Otherwise (``exp``, ``cos``, ``x0 + 1``, a dense operand, an operand
  missing a label) the result is dense and ``f`` runs on the densified operands, refused with an
  EinjoinError naming the shape and bytes above :data:`DENSE_JOIN_LIMIT`;
- the aggregation to the output labels (``sum`` / ``max``): of a sparse result, a one-operand
  sparse einsum of the plan's engine and devices (`einjoin.sparse.plan`); of a dense one, numpy.

With ``engine="duckdb"`` the union is one SQL query (a table per operand, UNION ALL, GROUP BY the
key) on a connection of the plan's DuckDB settings, and DuckDB runs the aggregation step too; on
several devices the union runs on one connection and the aggregation is split.

>>> import numpy as np, einjoin as ej
>>> a = ej.sparse("A", np.array([[1., 0.], [0., 2.]]))
>>> b = ej.sparse("B", np.array([[0., 3.], [0., -2.]]))
>>> r = ej.einsum("ij,ij->ij", a, b, join="add")
>>> r.nnz, r.todense().tolist()
(3, [[1.0, 3.0], [0.0, 0.0]])
>>> ej.einsum("ij->i", a, join="exp").tolist() == np.exp(a.todense()).sum(1).tolist()
True
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from einjoin.cluster.sizes import parse_bytes
from einjoin.errors import EinjoinError, UnsupportedOpError
from einjoin.ir.evaluate import evaluate
from einjoin.ir.scalar import Expr
from einjoin.sparse.duckdb_exec import DuckSession
from einjoin.sparse.tensor import SparseTensor, drop_dims, unique_rows

__all__ = ["DENSE_JOIN_LIMIT", "JoinPlan", "zero_at_zero"]

DENSE_JOIN_LIMIT = 1 << 30  # bytes: the largest dense join result computed (before aggregation)


def zero_at_zero(expr: Expr, dtypes: Sequence[np.dtype]) -> bool:
    """``f(0, ..., 0) == 0`` at zeros of these dtypes (nan is not 0): then ``f`` keeps sparsity.

    >>> from einjoin.ir.scalar import parse_join
    >>> [zero_at_zero(parse_join(j, 1), [np.dtype("float64")]) for j in ("relu", "exp", "x0 * 2")]
    [True, False, True]
    """
    with np.errstate(all="ignore"):
        v = evaluate(expr, [np.zeros(1, dt) for dt in dtypes])
    return bool(np.all(np.asarray(v) == 0))


class JoinPlan:
    """A compiled sparse einsum with a non-product join (built by ``ej.sparse_compile(...,
    join=...)``): ``run()`` on the compiled operands, ``run(*operands)`` on others of the same
    shapes. ``sparse_result`` says whether the join's result is kept sparse."""

    def __init__(self, equation: str, values: Sequence[SparseTensor | np.ndarray],
                 in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...], expr: Expr, agg: str,
                 compile_kw: dict[str, Any], what: str, keeps: Sequence[tuple[int, ...]] | None = None,
                 compile: Callable[..., Any] | None = None, operand: Callable[..., Any] | None = None) -> None:
        self.equation, self.expr, self.agg, self.what = equation, expr, agg, what
        self.in_labels, self.out_labels = tuple(in_labels), out_labels
        self.labels: tuple[str, ...] = tuple(dict.fromkeys(lab for ls in in_labels for lab in ls))
        sizes = {lab: n for ls, v in zip(in_labels, values) for lab, n in zip(ls, v.shape)}
        self.shape = tuple(sizes[lab] for lab in self.labels)
        self.values = tuple(values)
        self.compile_kw = compile_kw
        # einjoin.sparse.plan's sparse_compile and operand check, passed in (plan imports this module)
        self.compile, self.operand = compile, operand
        self.keeps = keeps  # numpy's size-1 broadcasting: each operand's kept dims (plan.size1_squeeze)
        dtypes = [np.dtype(v.dtype) for v in values]
        self.sparse_result = zero_at_zero(expr, dtypes) and all(
            isinstance(v, SparseTensor) and set(ls) == set(self.labels) for v, ls in zip(values, in_labels))
        if not self.sparse_result:
            with np.errstate(all="ignore"):
                dt = np.asarray(evaluate(expr, [np.zeros(1, d) for d in dtypes])).dtype
            need = math.prod(self.shape) * dt.itemsize
            # the stated limit, and the plan's memory_limit= (engine memory) when that is lower
            cap = parse_bytes(compile_kw.get("memory_limit"))
            limit, name = (cap, "memory_limit=") if cap is not None and cap < DENSE_JOIN_LIMIT else \
                (DENSE_JOIN_LIMIT, "einjoin.sparse.joins.DENSE_JOIN_LIMIT")
            if need > limit:
                raise EinjoinError(
                    f"{what}: join {expr} is dense (it is not 0 where operands are 0, or an operand is dense "
                    f"or lacks a label): its result of shape {self.shape} ({dt.name}) takes {need} bytes, over "
                    f"{name} ({limit} bytes)")

    def vjp(self, grad_out: Any, wrt: Any = None) -> Any:
        """Refused: gradients of sparse einsums are those of products (`einjoin.sparse.grad`)."""
        raise UnsupportedOpError(f"{self.what}: gradients of the join {self.expr} (not a product) are not "
                                 f"supported on sparse operands; densify them (.todense()) for ej.grad")

    def notation(self) -> str:
        kind = "union of stored entries" if self.sparse_result else "dense"
        ins = ",".join("".join(ls) for ls in self.in_labels)
        return f"{ins}->{''.join(self.labels)} join {self.expr} ({kind}); {self.agg} -> {''.join(self.out_labels)}"

    def explain(self) -> str:
        return f"sparse einsum {self.equation!r}: {self.notation()}"

    def run(self, *operands: Any) -> SparseTensor | np.ndarray:
        """The result; ``operands`` (all of them, the compiled shapes) replace the compiled ones."""
        values = self.values
        if operands:
            assert self.operand is not None
            if len(operands) != len(values):
                raise EinjoinError(f"{self.what}: run() takes {len(values)} operands, got {len(operands)}")
            values = tuple(self.operand(x, i, self.what) for i, x in enumerate(operands))
            if self.keeps is not None:
                values = tuple(drop_dims(v, k) for v, k in zip(values, self.keeps))
            for i, (v, old) in enumerate(zip(values, self.values)):
                if tuple(v.shape) != tuple(old.shape) or isinstance(v, SparseTensor) != isinstance(old, SparseTensor) \
                        or np.dtype(v.dtype) != np.dtype(old.dtype):
                    raise EinjoinError(f"{self.what}: operand {i} of shape {tuple(v.shape)} "
                                       f"({type(v).__name__}, {np.dtype(v.dtype).name}); compiled for "
                                       f"{tuple(old.shape)} ({type(old).__name__}, {np.dtype(old.dtype).name})")
        if self.sparse_result:
            return self._aggregate_sparse(self._union(values))
        return self._aggregate_dense(self._dense(values))

    def _perm(self, ls: tuple[str, ...]) -> list[int]:
        return [ls.index(lab) for lab in self.labels]

    def _union(self, values: Sequence[SparseTensor | np.ndarray]) -> SparseTensor:
        """``f`` over the union of the stored entries (each operand's value 0 where it stores none)."""
        coos = []
        for v, ls in zip(values, self.in_labels):
            assert isinstance(v, SparseTensor)
            coords, vals = v.coo()
            coos.append((coords[:, self._perm(ls)], vals))
        sql = self.compile_kw.get("engine") == "duckdb" and len(self.shape) > 0 and \
            any(len(c) for c, _ in coos) and all(_sql_kind(v.dtype) for _, v in coos)
        uniq, args = self._union_sql(coos) if sql else _union_memory(coos, self.shape)
        with np.errstate(all="ignore"):
            out = np.asarray(evaluate(self.expr, args))
        out = np.broadcast_to(out, (len(uniq),)).copy()
        # unique_rows (and the SQL's ORDER BY) give the keys sorted row-major and unique: no re-sort
        ones = (1,) * len(self.shape)
        return SparseTensor("out", self.shape, ones, uniq, out.reshape((-1,) + ones), trusted=True)

    def _union_sql(self, coos: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The union on DuckDB (``engine="duckdb"``, under its settings): each operand a table of
        (key columns, value), UNION ALL with one value column per operand, GROUP BY the keys."""
        kw = self.compile_kw
        keys = [f"c{d}" for d in range(len(self.shape))]
        with DuckSession(self.what, kw.get("duckdb_memory"), kw.get("duckdb_temp"), kw.get("duckdb_threads")) as ses:
            con, selects = ses.con, []
            for k, (c, vals) in enumerate(coos):
                kind = _sql_kind(vals.dtype)
                con.register("kk", np.ascontiguousarray(c.T, np.int64))
                flat = vals.astype(np.float64 if kind == "DOUBLE" else np.int64)
                con.register("pp", np.ascontiguousarray(flat[None]))
                # DuckDB scans a numpy NaN as NULL (which sum skips): read back as NaN
                v = "coalesce(pp.column0, 'NaN'::DOUBLE)" if kind == "DOUBLE" else "pp.column0"
                cols = ", ".join(f"kk.column{d} AS {key}" for d, key in enumerate(keys))
                con.execute(f"CREATE TABLE t{k} AS SELECT {cols}, {v} AS v FROM kk POSITIONAL JOIN pp")
                con.unregister("kk")
                con.unregister("pp")
                vs = ", ".join(f"{'v' if j == k else f'NULL::{_sql_kind(coos[j][1].dtype)}'} AS v{j}"
                               for j in range(len(coos)))
                selects.append(f"SELECT {', '.join(keys)}, {vs} FROM t{k}")
            sums = ", ".join(f"coalesce(sum(v{j}), 0)::{_sql_kind(v.dtype)} AS v{j}" for j, (_, v) in enumerate(coos))
            got = con.execute(f"SELECT {', '.join(keys)}, {sums} FROM ({' UNION ALL '.join(selects)}) "
                              f"GROUP BY {', '.join(keys)} ORDER BY {', '.join(keys)}").fetchnumpy()
        uniq = np.stack([np.asarray(got[key], np.int64) for key in keys], axis=1)
        return uniq, [np.asarray(got[f"v{j}"]).astype(v.dtype) for j, (_, v) in enumerate(coos)]

    def _dense(self, values: Sequence[SparseTensor | np.ndarray]) -> np.ndarray:
        args = []
        for v, ls in zip(values, self.in_labels):
            d = v.todense() if isinstance(v, SparseTensor) else np.asarray(v)
            order = [lab for lab in self.labels if lab in ls]
            d = np.transpose(d, [ls.index(lab) for lab in order])
            args.append(d.reshape([self.shape[k] if lab in ls else 1 for k, lab in enumerate(self.labels)]))
        with np.errstate(all="ignore"):
            out = np.asarray(evaluate(self.expr, args))
        return np.broadcast_to(out, self.shape)

    def _aggregate_dense(self, full: np.ndarray) -> np.ndarray:
        axes = tuple(k for k, lab in enumerate(self.labels) if lab not in self.out_labels)
        if axes:
            # float16 / bfloat16 accumulate in float32 and round once, as every einjoin sum
            acc = np.float32 if full.dtype.kind == "f" and full.dtype.itemsize < 4 or full.dtype.name == "bfloat16" \
                else None
            full = full.max(axis=axes) if self.agg == "max" else \
                full.sum(axis=axes, dtype=acc).astype(full.dtype, copy=False)
        kept = [lab for lab in self.labels if lab in self.out_labels]
        return np.array(np.transpose(full, [kept.index(lab) for lab in self.out_labels]), order="C")

    def _aggregate_sparse(self, joined: SparseTensor) -> SparseTensor | np.ndarray:
        if self.labels == self.out_labels:
            return joined
        assert self.compile is not None
        letter = dict(zip(self.labels, string.ascii_letters))
        eq = "".join(letter[lab] for lab in self.labels) + "->" + "".join(letter[lab] for lab in self.out_labels)
        kw = dict(self.compile_kw)
        # the joined entries are COO: every label keyed at block 1 unless the user pinned it (a
        # layout search over the candidate block sizes cost more than the aggregation)
        pinned = set(kw.get("blocks") or ()) | set(kw.get("relational") or ())
        kw["blocks"] = {letter[lab]: 1 for lab in self.labels if lab not in pinned} | \
            {letter[lab]: b for lab, b in (kw.get("blocks") or {}).items() if lab in letter}
        if kw.get("relational"):
            kw["relational"] = {letter[lab] for lab in kw["relational"] if lab in letter}
        agg = "sum" if self.agg == "none" else self.agg
        out: SparseTensor | np.ndarray = self.compile(eq, joined, agg=agg, **kw).run()
        return out


def _sql_kind(dt: np.dtype) -> str | None:
    """The DuckDB column type that holds a dtype's values exactly, or None (the union runs in memory)."""
    dt = np.dtype(dt)
    if dt.kind in "fb" or dt.name == "bfloat16":
        return "DOUBLE" if dt.itemsize <= 8 else None
    return "BIGINT" if dt.kind in "iu" and (dt.kind == "i" or dt.itemsize < 8) else None


def _union_memory(coos: list[tuple[np.ndarray, np.ndarray]], shape: tuple[int, ...]
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The union in numpy: the unique coordinates and each operand's value there (0 where it stores none)."""
    allc = np.concatenate([c for c, _ in coos]) if coos else np.zeros((0, len(shape)), np.int64)
    uniq, inv = unique_rows(allc.astype(np.int64, copy=False), shape)
    args, start = [], 0
    for c, vals in coos:
        col = np.zeros(len(uniq), vals.dtype)
        col[inv[start:start + len(c)]] = vals
        args.append(col)
        start += len(c)
    return uniq, args
