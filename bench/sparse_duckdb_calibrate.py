"""Calibration of the DuckDB cost model (``einjoin/sparse/duckdb_cost.py``): small sparse einsums
run on DuckDB (one thread) at pinned layouts chosen to vary each feature (rows, list elements,
joined tuples, output columns, crossed rows, lambda calls, fetched elements), their CPU times
(``time.process_time``, DuckDB's thread included; min of ``--reps`` after a warm run) fitted by
non-negative least squares to ``duckdb_cost.features``. Prints each query's measured and modelled
time and the ``COSTS`` dict to paste into ``duckdb_cost.py`` (in the layout's unit, ~4 ns).

    .venv/bin/python bench/sparse_duckdb_calibrate.py --reps 2     # ~1-2 min CPU
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np
import scipy.optimize
import scipy.sparse

import einjoin as ej
from einjoin.sparse.duckdb_cost import COSTS, FEATURES, features

UNIT = 4e-9  # seconds per layout cost unit (einjoin/sparse/layout.py)


def step_features(plan: Any) -> dict[str, float]:
    """The features of a one-step plan's last run (actual tuple, joined and output counts)."""
    (step,) = plan.steps
    lay, counts = step.ran, step.counts
    ext = {lab: lay.extent(lab, plan.sizes[lab]) for lab in plan.sizes}
    payloads = [math.prod(ext[lab] for lab in ls) for ls in step.in_labels]
    out_payload = math.prod(ext[lab] for lab in step.out_labels)
    flops = math.prod(ext.values())
    reblocked = sum(v.nnz for v, ls in zip(plan.operands, step.in_labels)
                    if isinstance(v, ej.SparseTensor) and any((lay.blocks[lab] or 2) > 1 for lab in ls))
    return features(counts.tuples, payloads, counts.joined, out_payload, flops, counts.out, reblocked)


def measure(eq: str, ops: list[Any], blocks: dict[str, int], reps: int) -> tuple[float, dict[str, float], str]:
    plan = ej.sparse_compile(eq, *ops, engine="duckdb", duckdb_threads=1, blocks=blocks)
    plan.run()
    best = math.inf
    for _ in range(reps):
        t = time.process_time()
        plan.run()
        best = min(best, time.process_time() - t)
    return best, step_features(plan), plan.notation()


def problems() -> list[tuple[str, list[Any], dict[str, int]]]:
    rng = np.random.default_rng(0)
    out: list[tuple[str, list[Any], dict[str, int]]] = []
    for n, nnz in [(4000, 20000), (20000, 80000)]:
        a = ej.sparse("A", scipy.sparse.random(n, n, density=nnz / n / n, random_state=1))
        for k in (1, 16, 64, 200):
            out.append(("ij,jk->ik", [a, rng.standard_normal((n, k))], {"i": 1, "j": 1}))
    a = ej.sparse("A", scipy.sparse.random(2000, 2000, density=5000 / 2000 ** 2, random_state=2))
    out.append(("ij,jk->ik", [a, rng.standard_normal((2000, 300))], {"i": 1, "j": 1}))  # crossed rows
    a = ej.sparse("A", scipy.sparse.random(4000, 4000, density=20000 / 4000 ** 2, random_state=3))
    for b, k in [(2, 8), (4, 8), (4, 32), (8, 8)]:
        out.append(("ij,jk->ik", [a, rng.standard_normal((4000, k))], {"i": b, "j": b}))  # lambdas
    bd64 = ej.sparse("D", scipy.sparse.block_diag([rng.standard_normal((64, 64)) for _ in range(16)]).tocsr())
    for k in (16, 64, 256):  # lambdas over long captured lists, as columns and as rows
        h = rng.standard_normal((1024, k))
        out += [("ij,jk->ik", [bd64, h], {"i": 1, "j": 64}), ("ij,jk->ik", [bd64, h], {"i": 16, "j": 16})]
    bd = ej.sparse("B", scipy.sparse.block_diag([rng.standard_normal((16, 16)) for _ in range(200)]).tocsr())
    for b in (1, 4, 8, 16):  # Hadamard: output elements without a sum inside the payload
        out.append(("ij,ij->ij", [bd, bd.todense()], {"i": b, "j": b}))
    for b in (1, 16):  # a vector: few output elements, many joined tuples
        out.append(("ij,j->i", [bd, rng.standard_normal(bd.shape[1])], {"i": b, "j": b}))
    s3 = ej.sparse("S", (rng.integers(0, 60, (3, 30000)), rng.standard_normal(30000), (60, 60, 60)))
    out.append(("ijk,jr,kr->ir", [s3, rng.standard_normal((60, 16)), rng.standard_normal((60, 16))],
                {"i": 1, "j": 1, "k": 1}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    rows, times, names = [], [], []
    for eq, ops, blocks in problems():
        t, f, notation = measure(eq, ops, blocks, args.reps)
        rows.append([f[k] for k in FEATURES])
        times.append(t)
        names.append(f"{eq} {notation}")
        print(f"{names[-1]:40s} {t * 1e3:9.1f} ms", flush=True)
    x = np.array(rows)
    y = np.array(times) / UNIT
    # relative error matters (a 10 ms query as much as a 1 s one): rows weighted by 1 / time
    w = 1.0 / np.maximum(y, 1.0)
    fitted, _ = scipy.optimize.nnls(x * w[:, None], y * w)
    fit = {k: float(f"{v:.2g}") for k, v in zip(FEATURES, fitted)}
    fit["reblock"] = COSTS["reblock"]  # numpy's, measured for the memory engine (layout.REBLOCK)
    print(f"{'query':40s} {'CPU ms':>9s} {'model ms':>9s} {'now ms':>9s}")
    for name, r, t in zip(names, rows, times):
        model = sum(fit[k] * v for k, v in zip(FEATURES, r)) * UNIT
        now = sum(COSTS[k] * v for k, v in zip(FEATURES, r)) * UNIT
        print(f"{name:40s} {t * 1e3:9.1f} {model * 1e3:9.1f} {now * 1e3:9.1f}")
    print("COSTS =", fit)


if __name__ == "__main__":
    main()
