"""The offload path with sparse einsums (issue 24: "the memory planner and the offload path see
the actual tuple sizes"): under a cap that forces blocks out (EVICT / RELOAD tasks), a graph with
a fed sparse input plans within the cap while counting the input's stored entries at its capacity
(keys and values, never the dense size), and runs to numpy's values on two patterns."""

from __future__ import annotations

import numpy as np
import scipy.sparse

import einjoin as ej
from einjoin.exchange import TaskKind

N, K, NNZ = 400, 8, 3200


def test_evictions_around_a_fed_sparse_input_stay_within_the_cap_and_agree() -> None:
    A = ej.sparse_input("Aoffl", (N, N), nnz=NNZ, dtype="float32")
    h = ej.input("hoffl", (N, K), "float32")
    y1 = A @ h
    out = ej.sum(ej.relu(A @ (y1 * 2.0)) + y1)
    cap = 135 * 1024  # one sparse kernel holds ~130 KiB (its entries and blocks): the rest is evicted
    prog = ej.compile(out, memory_limit=cap, quiet=True)
    tasks = prog.taskgraph.tasks
    assert prog.taskgraph.memory is not None
    peak = prog.taskgraph.memory.peak_bytes_per_device[0]
    assert any(t.kind is TaskKind.EVICT for t in tasks) and any(t.kind is TaskKind.RELOAD for t in tasks)
    entries = NNZ * (2 * 8 + 4)  # int64 (i, j) keys and float32 values at the input's capacity
    assert entries <= peak <= cap < N * N * 4  # the dense A alone (640 KB) would not fit
    rng = np.random.default_rng(0)
    hv = rng.normal(size=(N, K)).astype(np.float32)
    for seed in (0, 1):
        m = scipy.sparse.random(N, N, density=0.02, random_state=seed, dtype=np.float32).toarray()
        y1v = m @ hv
        want = (np.maximum(m @ (y1v * 2.0), 0) + y1v).sum()
        np.testing.assert_allclose(prog.run(Aoffl=ej.sparse("Aoffl", m), hoffl=hv), want, rtol=1e-4)
