"""The DuckDB executor of one sparse einsum step (``engine="duckdb"``): relations as SQL tables,
the join, the per-pair kernel and the aggregation in SQL, so that DuckDB's buffer manager bounds
the memory (``memory_limit``) and spills joins, aggregations and the tables themselves to a temp
directory when they outgrow it.

Each operand at the step's layout (the same relations as the in-memory executor,
:func:`einjoin.sparse.execute.relation_of`) becomes a table ``t<i>``: one ``BIGINT`` key column
per relational label (``c<j>``, j the label's index in the step) and the payload ``v``: a
``DOUBLE`` (``BIGINT`` for integers) when the payload is one element, else a ``DOUBLE[]`` list of
the block in row-major order. One query joins the tables on their shared keys, crosses the join
with the output payload positions ``p`` (``range(P)``, only when the output payload has more
than one element), computes each output element of each joined tuple (plain SQL arithmetic when
every payload is a scalar; else list indexing, and a ``list_sum`` / ``list_max`` over the summed
payload positions ``s``) and aggregates with ``GROUP BY`` keys, p. The grouped rows come back as
numpy columns (no pyarrow) and are scattered into the same (groups × output block) array the
in-memory executor returns; ``max`` applies the same absent-tuple and padding rules.

**Integer overflow** (decided in session 36): DuckDB checks int64 arithmetic and fails the step
("Out of Range Error: Overflow in multiplication of INT64"), raised as an EinjoinError naming the
step, where the in-memory executor wraps around as numpy does. Both are kept: wrapping in SQL
would take HUGEINT products reduced modulo 2**64 at every multiply, on every int query, to
reproduce a result that is itself an overflow; an int64 sum that overflows is refused rather than
returned wrong.

Why SQL arithmetic and not a numpy UDF: DuckDB's vectorised Python UDFs take Arrow batches
(pyarrow, not a dependency here); its row-at-a-time ones are slower than list lambdas (50k dot
products of 64-lists, one thread: a numpy UDF per row 0.79 s CPU, a list_sum of a lambda 0.08 s,
list_dot_product 0.009 s; slices of lists for the latter cost more than they save).

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> a = ej.sparse("A", scipy.sparse.random(50, 40, density=0.05, random_state=0))
>>> h = np.arange(40 * 3.0).reshape(40, 3)
>>> plan = ej.sparse_compile("ij,jk->ik", a, h, engine="duckdb", duckdb_memory="64MB")
>>> np.allclose(plan.run().todense(), a.todense() @ h)
True
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.sparse.execute import Relation, RunCounts, relation_of, zero_padding
from einjoin.sparse.layout import Layout
from einjoin.sparse.tensor import SparseTensor, is_float, unique_rows

__all__ = ["DuckSession", "DuckDevice", "device_settings", "execute_duckdb", "require_duckdb", "step_sql"]

FETCH_ROWS = 1 << 18  # result rows per fetch (~8 MB of numpy columns)
AGG_STATE_BYTES = 48  # DuckDB's memory per aggregate state (a sum / max and its group's share)
COLUMNS_MAX = 256  # output payloads up to this many elements come back as columns (one row a key)


def require_duckdb(what: str) -> Any:
    """The ``duckdb`` module, imported on first use (``import einjoin`` never imports it)."""
    try:
        import duckdb
    except ImportError:
        raise EinjoinError(f"{what}: engine='duckdb' needs the duckdb package: pip install "
                           f"'einjoin[duckdb]' (or pip install duckdb)") from None
    return duckdb


class DuckSession:
    """One DuckDB connection for a plan's run: an in-memory database under ``memory_limit``
    that spills to ``temp_directory`` (a fresh temporary directory, removed on close, when not
    given)."""

    def __init__(self, what: str, memory_limit: str | None, temp_directory: str | None,
                 threads: int | None) -> None:
        duckdb = require_duckdb(what)
        self.what = what
        self._own_tmp = temp_directory is None
        self.temp_directory = tempfile.mkdtemp(prefix="einjoin-duckdb-") if temp_directory is None \
            else temp_directory
        config: dict[str, Any] = {"temp_directory": self.temp_directory,
                                  "preserve_insertion_order": False}
        if memory_limit is not None:
            config["memory_limit"] = str(memory_limit)
        if threads is not None:
            config["threads"] = int(threads)
        try:
            self.con = duckdb.connect(":memory:", config=config)
        except Exception as e:  # a bad memory_limit string, an unwritable directory
            self.close()
            raise EinjoinError(f"{what}: DuckDB refused its settings {config}: {e}") from None
        self.con.execute("SET enable_progress_bar = false")
        self.memory_limit = memory_limit or "DuckDB's default"
        self.threads = int(self.con.execute("SELECT current_setting('threads')").fetchall()[0][0])
        self.ranges = 1  # the most output-key ranges of any step (one query each)
        self.spilled = 0  # temp-directory bytes seen at the end of a step (the most of any step)

    def close(self) -> None:
        con = getattr(self, "con", None)
        if con is not None:
            con.close()
            self.con = None
        if self._own_tmp:
            shutil.rmtree(self.temp_directory, ignore_errors=True)

    def __enter__(self) -> DuckSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def temp_bytes(self) -> int:
        """Bytes DuckDB holds in its temp directory now (its spill)."""
        rows = self.con.execute("SELECT coalesce(sum(size), 0) FROM duckdb_temporary_files()").fetchall()
        return int(rows[0][0])


@dataclass(frozen=True)
class DuckDevice:
    """One device's DuckDB connection settings when a plan runs on several devices: its share of
    the plan's ``memory_limit`` and of the cores, its own temp directory (None: a fresh one)."""

    memory_limit: str
    temp_directory: str | None
    threads: int

    def session(self, what: str) -> DuckSession:
        if self.temp_directory is not None:
            os.makedirs(self.temp_directory, exist_ok=True)
        return DuckSession(what, self.memory_limit, self.temp_directory, self.threads)


def device_settings(what: str, memory_limit: str | None, temp_directory: str | None, threads: int | None,
                    devices: int) -> list[DuckDevice]:
    """Per device: ``memory_limit`` (DuckDB's default, 80% of RAM, when None) divided by
    ``devices`` -- read back from a throwaway connection, so DuckDB parses the string itself --,
    ``threads`` each (cores // devices when None: n connections with every core each would fight)
    and ``temp_directory``/device<d> (a fresh temporary directory each when None).

    >>> [(d.memory_limit, d.threads) for d in device_settings("x", "64MiB", None, 1, 2)]
    [('32768KiB', 1), ('32768KiB', 1)]
    """
    total = _limit_of(what, memory_limit)
    share = f"{max(1, int(total // devices // 1024))}KiB"  # KiB: DuckDB reads it exactly
    each = threads if threads is not None else max(1, (os.cpu_count() or 1) // devices)
    return [DuckDevice(share, None if temp_directory is None else os.path.join(temp_directory, f"device{d}"), each)
            for d in range(devices)]


@functools.lru_cache(maxsize=32)
def _limit_of(what: str, memory_limit: str | None) -> float:
    """``memory_limit`` in bytes as DuckDB reads it (a throwaway connection, once per string)."""
    with DuckSession(what, memory_limit, None, 1) as probe:
        return _limit_bytes(probe)


def _load(con: Any, name: str, rel: Relation, col: Mapping[str, int], kind: str) -> int:
    """Create table ``name`` from one relation; returns its payload size (elements)."""
    n = len(rel.keys)
    size = math.prod(rel.data.shape[1:])
    vtype = "DOUBLE" if kind == "f" else "BIGINT"
    key_cols = [f"c{col[lab]}" for lab in rel.rel]
    con.execute(f"DROP TABLE IF EXISTS {name}")
    if n == 0:
        cols = [f"{c} BIGINT" for c in key_cols] + [f"v {vtype}" + ("[]" if size > 1 else "")]
        con.execute(f"CREATE TABLE {name} ({', '.join(cols)})")
        return size
    # DuckDB scans a 2-D numpy array as one column per row of it: keys (k × n), payload (P × n)
    if key_cols:
        con.register("kk", np.ascontiguousarray(rel.keys.T, np.int64))
    con.register("pp", np.ascontiguousarray(rel.data.reshape(n, size).T, np.float64 if kind == "f" else np.int64))
    # DuckDB scans a numpy NaN as NULL (which sum and max skip); a numpy column holds no NULL,
    # so each NULL read back is a NaN
    vals = [f"coalesce(pp.column{e}, 'NaN'::DOUBLE)" if kind == "f" else f"pp.column{e}" for e in range(size)]
    pay = vals[0] if size == 1 else f"list_value({', '.join(vals)})"
    keys = [f"kk.column{p} AS {c}" for p, c in enumerate(key_cols)]
    src = "kk POSITIONAL JOIN pp" if key_cols else "pp"
    con.execute(f"CREATE TABLE {name} AS SELECT {', '.join([*keys, f'{pay} AS v'])} FROM {src}")
    for view in (["kk"] if key_cols else []) + ["pp"]:
        con.unregister(view)
    return size


def _index(var: str, labels: Sequence[str], ext: Mapping[str, int]) -> dict[str, str]:
    """Each label's position inside a flat row-major index ``var`` over ``labels``."""
    out: dict[str, str] = {}
    stride = 1
    for k, lab in reversed(list(enumerate(labels))):
        e = ext[lab]
        if e > 1:
            x = var if stride == 1 else f"({var} // {stride})"
            out[lab] = x if k == 0 or all(ext[m] == 1 for m in labels[:k]) else f"({x} % {e})"
        stride *= e
    return out


def step_sql(rels: Sequence[Relation], in_labels: Sequence[tuple[str, ...]],
             out_labels: tuple[str, ...], sizes: Mapping[str, int], layout: Layout, agg: str,
             kind: str, columns_max: int | None = None, sources: Mapping[int, str] | None = None,
             wrap: tuple[int, int] | None = None) -> tuple[str, list[str], int]:
    """The step's query over tables ``t0..tn``: (sql, its output key columns (the relational
    output labels, in order), payload columns). An output payload of up to ``columns_max``
    elements comes back as that many aggregate columns ``v0..`` per output key (rows: output
    keys); a larger one as rows (keys..., p, v) of one payload position each, the join crossed
    with ``range(P)`` (0 payload columns). Every row also has ``n``, its joined tuples.
    ``wrap``: (modulus, offset) of a narrow integer dtype: each product wrapped into it before a
    max (torch's products wrap in the dtype; a sum wraps the same at the end)."""
    labels = list(dict.fromkeys([*out_labels, *(lab for ls in in_labels for lab in ls)]))
    col = {lab: j for j, lab in enumerate(labels)}
    ext = {lab: layout.extent(lab, sizes[lab]) for lab in labels}
    summed = [lab for lab in labels if lab not in out_labels]
    n_out = math.prod(ext[lab] for lab in out_labels)
    n_sum = math.prod(ext[lab] for lab in summed)
    owner = {lab: next(i for i, r in enumerate(rels) if lab in r.rel) for r in rels for lab in r.rel}
    as_columns = n_out <= (COLUMNS_MAX if columns_max is None else columns_max)

    def element(pos: Mapping[str, str]) -> str:
        factors = []
        for i, ls in enumerate(in_labels):
            if math.prod(ext[lab] for lab in ls) == 1:
                factors.append(f"t{i}.v")
                continue
            flat, stride = [], 1
            for lab in reversed(ls):
                if lab in pos and pos[lab] != "0":
                    flat.append(pos[lab] if stride == 1 else f"{pos[lab]} * {stride}")
                stride *= ext[lab]
            factors.append(f"t{i}.v[{' + '.join(reversed(flat)) or '0'} + 1]")
        prod = " * ".join(factors)
        if wrap is not None:
            prod = f"((({prod}) + {wrap[1]}) % {wrap[0]} + {wrap[0]}) % {wrap[0]} - {wrap[1]}"
        if n_sum > 1:
            # max: payload positions past the shape (padding of an edge block) are not values
            mask = [f"t{owner[lab]}.c{col[lab]} * {ext[lab]} + {pos[lab]} < {sizes[lab]}" for lab in summed
                    if agg == "max" and layout.relational(lab) and sizes[lab] % ext[lab] and lab in pos]
            body = f"CASE WHEN {' AND '.join(mask)} THEN {prod} END" if mask else prod
            prod = f"list_{agg}(list_transform(range({n_sum}), lambda s: {body}))"
        value = f"{agg}({prod})"
        return f"CAST({value} AS BIGINT)" if kind != "f" else value

    inner = _index("s", summed, ext)
    if as_columns:
        values = []
        for q in range(n_out):
            at = np.unravel_index(q, tuple(ext[lab] for lab in out_labels)) if out_labels else ()
            values.append(f"{element({**{lab: str(int(x)) for lab, x in zip(out_labels, at)}, **inner})} AS v{q}")
    else:
        values = ["r.p AS p", f"{element({**_index('r.p', out_labels, ext), **inner})} AS v"]
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    keys = [f"t{owner[lab]}.c{col[lab]} AS o{col[lab]}" for lab in out_rel]
    conds = [f"t{i}.c{col[lab]} = t{owner[lab]}.c{col[lab]}" for i, r in enumerate(rels) for lab in r.rel
             if owner[lab] != i]
    src = sources or {}
    tables = [f"{src[i]} AS t{i}" if i in src else f"t{i}" for i in range(len(rels))] + \
        ([] if as_columns else [f"range({n_out}) r(p)"])
    group = [f"o{col[lab]}" for lab in out_rel] + ([] if as_columns else ["p"])
    sql = (f"SELECT {', '.join([*keys, *values, 'count(*) AS n'])} "
           f"FROM {', '.join(tables)}" + (f" WHERE {' AND '.join(conds)}" if conds else "")
           + (f" GROUP BY {', '.join(group)}" if group else ""))
    return sql, [f"o{col[lab]}" for lab in out_rel], n_out if as_columns else 0


def _limit_bytes(session: DuckSession) -> float:
    """DuckDB's memory_limit in bytes (its setting reads e.g. '17.1 MiB')."""
    try:
        text = str(session.con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0])
    except Exception as e:  # a limit below DuckDB's own buffers fails even this query (Out of Memory)
        raise EinjoinError(f"{session.what}: DuckDB cannot run a query within its memory_limit "
                           f"{session.memory_limit} ({session.threads} thread(s)): set a larger duckdb_memory= "
                           f"(DuckDB's docs advise about 125 MB per thread). DuckDB said: "
                           f"{str(e).splitlines()[0]}") from None
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGTP]?i?B)?\s*", text)
    if not m:
        return math.inf
    unit = (m.group(2) or "B").replace("i", "")
    return float(m.group(1)) * 1024.0 ** "BKMGTP".index(unit[0])


def _partitions(session: DuckSession, rels: Sequence[Relation], labels: list[str],
                out_labels: tuple[str, ...], layout: Layout, sizes: Mapping[str, int], ncols: int
                ) -> list[tuple[int, str]]:
    """(table, condition) pairs splitting the output keys into ranges of the first relational
    output label whose aggregation states fit in a quarter of ``memory_limit`` (``[(0, "")]``:
    one query)."""
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    if not out_rel:
        return [(0, "")]
    lab = out_rel[0]
    owner = next(i for i, r in enumerate(rels) if lab in r.rel)
    keys = rels[owner].keys[:, rels[owner].rel.index(lab)]
    groups = min(len(rels[owner].keys), math.prod(-(-sizes[x] // (layout.blocks[x] or 1)) for x in out_rel))
    per_group = AGG_STATE_BYTES * max(ncols, 1) if ncols else AGG_STATE_BYTES * \
        math.prod(layout.extent(x, sizes[x]) for x in out_labels)
    n = int(-(-groups * per_group // (_limit_bytes(session) / 4)))
    if n > 1:  # no more ranges than distinct keys (a sort: only where ranges are wanted at all)
        n = min(n, len(np.unique(keys)))
    if n <= 1:
        return [(0, "")]
    cuts = np.unique(np.quantile(keys, np.linspace(0, 1, n + 1)[1:-1], method="lower").astype(np.int64))
    bounds = [None, *cuts[cuts > keys.min()].tolist(), None]
    column = f"c{labels.index(lab)}"
    return [(owner, " AND ".join(([f"{column} >= {lo}"] if lo is not None else []) +
                         ([f"{column} < {hi}"] if hi is not None else []))) for lo, hi in zip(bounds, bounds[1:])]


def execute_duckdb(session: DuckSession, values: Sequence[SparseTensor | np.ndarray],
                   in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
                   sizes: Mapping[str, int], layout: Layout, agg: str, dtype: np.dtype, what: str
                   ) -> tuple[np.ndarray, np.ndarray | None, RunCounts]:
    """:func:`einjoin.sparse.execute.execute`'s contract, run as one SQL query in ``session``."""
    kind = "f" if is_float(dtype) else "i"  # halves in DOUBLE, rounded once at the end
    rels = [relation_of(v, ls, layout) for v, ls in zip(values, in_labels)]
    labels = list(dict.fromkeys([*out_labels, *(lab for ls in in_labels for lab in ls)]))
    col = {lab: j for j, lab in enumerate(labels)}
    con = session.con
    # a max of narrow ints is of the products wrapped in their dtype (torch's, the memory engine's)
    bits = 8 * dtype.itemsize
    wrap = (2 ** bits, 0 if dtype.kind == "u" else 2 ** (bits - 1)) \
        if agg == "max" and dtype.kind in "iu" and bits < 64 else None
    sql, key_cols, ncols = step_sql(rels, in_labels, out_labels, sizes, layout, agg, kind, wrap=wrap)
    ranges = _partitions(session, rels, labels, out_labels, layout, sizes, ncols)
    session.ranges = max(session.ranges, len(ranges))
    stage = "loading the relations"
    try:
        for i, r in enumerate(rels):
            _load(con, f"t{i}", r, col, kind)
        parts = []
        # the ranges cut one relation (the owner of the first relational output label): its
        # per-range query reads table "part" instead, the same for every range
        part_sql = sql if ranges[0][1] == "" else step_sql(rels, in_labels, out_labels, sizes, layout, agg,
                                                            kind, sources={ranges[0][0]: "part"}, wrap=wrap)[0]
        for owner, where in ranges:
            # one range of output keys at a time (DuckDB's aggregation does not spill well), its
            # tuples a table of their own (exact sizes: DuckDB then builds the join's hash table on
            # them, not on the other side). The grouped rows go to a table (spillable, unlike a
            # materialised query result) and come back in slices of rowids
            stage = "the join-aggregation" + (f" (t{owner}: {where})" if where else "")
            if where:
                con.execute(f"CREATE OR REPLACE TABLE part AS SELECT * FROM t{owner} WHERE {where}")
            con.execute(f"CREATE OR REPLACE TABLE res AS {part_sql}")
            session.spilled = max(session.spilled, session.temp_bytes())
            stage = "fetching the result"
            total = int(con.execute("SELECT count(*) FROM res").fetchall()[0][0])
            parts += [con.execute(f"SELECT * FROM res WHERE rowid >= {lo} AND rowid < {lo + FETCH_ROWS}"
                                  ).fetchnumpy() for lo in range(0, max(total, 1), FETCH_ROWS)]
            con.execute("DROP TABLE res")
        for i in range(len(rels)):
            con.execute(f"DROP TABLE t{i}")
        con.execute("DROP TABLE IF EXISTS part")
    except Exception as e:
        step = f"{','.join(''.join(ls) for ls in in_labels)}->{''.join(out_labels)}"
        said = str(e).split("\n")[0]
        if "Out of Memory" in said:  # a limit too small for DuckDB's per-thread buffers: say what to set
            held = sum(r.keys.nbytes + r.data.size * 8 for r in rels)
            raise EinjoinError(
                f"{what}: DuckDB ran out of its memory_limit {session.memory_limit} ({session.threads} "
                f"thread{'s' if session.threads > 1 else ''}) in {stage} of the step {step}, whose relations "
                f"hold {held / 2 ** 20:.1f} MiB: set a larger duckdb_memory= (DuckDB's docs advise about 125 MB "
                f"per thread; it spills what does not fit) or fewer duckdb_threads=. DuckDB said: {said}") from None
        raise EinjoinError(f"{what}: DuckDB failed in {stage} of the step {step} "
                           f"(memory_limit {session.memory_limit}): {e}") from None
    res = {k: np.concatenate([np.ma.filled(part[k], 0) for part in parts]) for k in parts[0]}
    out_ext = tuple(layout.extent(lab, sizes[lab]) for lab in out_labels)
    n_out = math.prod(out_ext)
    hit = np.asarray(res["n"], np.int64) > 0  # no GROUP BY: one row (NULL, 0) on an empty join
    res = {k: np.asarray(c)[hit] for k, c in res.items()}
    cnt = np.asarray(res["n"], np.int64)
    if ncols:  # one row per output key, its payload in columns
        v = np.stack([res[f"v{q}"] for q in range(ncols)], axis=1) if len(cnt) else np.zeros((0, ncols))
        p = np.zeros(len(cnt), np.int64)
    else:  # one row per output key and payload position
        v, p = res["v"], np.asarray(res["p"], np.int64)
    first = p == 0  # the keys' joined counts, once per key
    out_rel = [lab for lab in out_labels if layout.relational(lab)]
    grid = {lab: -(-sizes[lab] // b) for lab, b in layout.blocks.items() if b}
    keys: np.ndarray | None
    if out_rel:
        kcols = np.stack([np.asarray(res[c], np.int64) for c in key_cols], axis=1) if len(cnt) else \
            np.zeros((0, len(out_rel)), np.int64)
        keys, gid = unique_rows(kcols, [grid[lab] for lab in out_rel])
        ngroups = len(keys)
    else:
        keys, ngroups, gid = None, 1, np.zeros(len(cnt), np.int64)
    compute = np.dtype(np.float64) if kind == "f" else np.dtype(np.int64)
    lowest: float = -np.inf if kind == "f" else int(np.iinfo(np.int64).min)
    flat = np.zeros((ngroups, n_out), compute) if agg == "sum" else np.full((ngroups, n_out), lowest, compute)
    if ncols:
        flat[gid] = v
    else:
        flat[gid, p] = v
    per_group = np.zeros(ngroups, np.int64)
    np.add.at(per_group, gid[first], cnt[first])
    m = int(per_group.sum())
    out = flat.reshape((ngroups, *out_ext))
    if agg == "max":
        # as in memory: an output key that misses some aggregated block meets a 0
        full = math.prod(grid[lab] for lab in labels if lab not in out_labels and lab in grid)
        short = per_group < full
        out[short] = np.maximum(out[short], 0)
        zero_padding(out, keys, out_labels, out_rel, layout, sizes)
    counts = RunCounts(tuple(len(r.keys) for r in rels), m, ngroups if out_rel else int(m > 0))
    return out.astype(dtype, copy=False), keys, counts
