"""The cost of one sparse einsum step on DuckDB (``engine="duckdb"``), so that the layout
(:func:`einjoin.sparse.layout.choose_layout`) chooses relational / dense labels and block sizes
for DuckDB as it does for the in-memory engine.

The query of a step (:func:`einjoin.sparse.duckdb_exec.step_sql`) loads each relation as a
table, joins them on their keys, computes each output payload element of each joined tuple (a
column expression per element up to ``COLUMNS_MAX`` of them, else a row of the join crossed with
``range(P)``; a summed payload label is a ``list_sum`` of a lambda over its positions) and groups
by the output keys. Its cost is linear in these features (``features``), each a count of rows
or elements through one part of the query:

    step     1                                    (a query, its tables created and dropped)
    rows     Σ_X tuples(X)                         (rows loaded and scanned by the join)
    elems    Σ_X tuples(X) · payload(X)            (payload list elements loaded)
    joined   joined tuples                          (hash-join probes, aggregate rows)
    outs     joined · payload(out)   as columns     (one aggregate expression per element)
    cross    joined · payload(out)   as rows        (the join crossed with range(P), grouped)
    lambda   joined · flops          a label summed inside the payload, output as columns
    lambda_rows   the same, output as crossed rows    (lambda calls over list elements)
    fetched  output groups · payload(out)          (fetched, scattered into the result)
    reblock  stored entries of a sparse operand cut into blocks > 1 (numpy, as in memory)

``COSTS`` holds their constants, in the layout's unit (about 4 ns of CPU time), measured on the
development box (2 cores, AMD EPYC) by ``bench/sparse_duckdb_calibrate.py`` (one DuckDB thread,
CPU time, a non-negative least-squares fit over 26 queries weighted by 1 / time; its printed dict
is pasted here: modelled within ~20% of measured on 19 of them; 2-5x under where a lambda over
a summed label reads long lists in few joined tuples (a 64-wide block of A against a 64 x k
block of H: 175 ms measured vs 85 modelled at k 16, 4.1 s vs 0.8 s at k 256), so blocks are
still somewhat favoured there). A step costs ~30 ms of its own (connection, tables created
and dropped). List arithmetic is what makes blocks dear on DuckDB: a lambda call over a list
element costs ~35 ns against ~0.5 ns for a multiply-add of numpy's batched einsum, so DuckDB
keys a sparse operand per entry unless its blocks are nearly full and little is summed in them.

>>> from einjoin.sparse.duckdb_cost import duckdb_cost
>>> per_entry = duckdb_cost([20000, 2000], [1, 64], 20000.0, 64, 64, 2000.0, 0)
>>> blocked = duckdb_cost([15000, 500], [16, 256], 15000.0, 256, 1024, 500.0, 20000)
>>> per_entry < blocked
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["COSTS", "FEATURES", "duckdb_cost", "features"]

FEATURES = ("step", "rows", "elems", "joined", "outs", "cross", "lambda", "lambda_rows", "fetched", "reblock")

# bench/sparse_duckdb_calibrate.py on the development box (see the module docstring)
COSTS: dict[str, float] = {
    "step": 8.2e6, "rows": 17.0, "elems": 7.6, "joined": 0.0, "outs": 6.7, "cross": 33.0,
    "lambda": 11.0, "lambda_rows": 14.0, "fetched": 6.6, "reblock": 11.0,
}
COLUMNS_MAX = 256  # duckdb_exec.COLUMNS_MAX (that module imports duckdb lazily; kept equal by a test)


def features(tuples: Sequence[int], payloads: Sequence[int], joined: float, out_payload: int,
             flops: int, groups: float, reblocked: int) -> dict[str, float]:
    """The step's counts that its DuckDB query's cost is linear in (module docstring)."""
    summed = flops > out_payload  # a label summed inside the payload: a lambda per output element
    as_columns = out_payload <= COLUMNS_MAX
    return {
        "step": 1.0,
        "rows": float(sum(tuples)),
        "elems": float(sum(t * p for t, p in zip(tuples, payloads) if p > 1)),
        "joined": joined,
        "outs": joined * out_payload if as_columns else 0.0,
        "cross": 0.0 if as_columns else joined * out_payload,
        # a lambda per output column costs several times one over the crossed rows (each column's
        # lambda re-reads its captured lists; measured, not modelled further)
        "lambda": joined * flops if summed and as_columns else 0.0,
        "lambda_rows": joined * flops if summed and not as_columns else 0.0,
        "fetched": groups * out_payload,
        "reblock": float(reblocked),
    }


def duckdb_cost(tuples: Sequence[int], payloads: Sequence[int], joined: float, out_payload: int,
                flops: int, groups: float, reblocked: int) -> float:
    """The modelled cost (layout units) of one step's query: ``COSTS`` · ``features``."""
    f = features(tuples, payloads, joined, out_payload, flops, groups, reblocked)
    return math.fsum(COSTS[k] * v for k, v in f.items())
