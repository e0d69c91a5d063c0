"""bench/sparse.py's rows for sparse MTTKRP (issue 24): ``ijk,jr,kr->ir`` with X a sparse
I × J × K tensor (uniform coordinates, duplicates summed), B (J × R) and C (K × R) dense.

Peers, on the same data: scipy — X unfolded to an I × (J·K) CSR (built outside the timing, as the
A·H peers' CSR is) times the Khatri-Rao product ``C ⊙ B`` (J·K × R, built inside the timing, it is
part of the MTTKRP) — and torch.sparse (the same unfolding as a torch CSR, ``torch.sparse.mm``,
1 thread). pydata ``sparse`` is not in the environment, so it is not a peer here.

CPU seconds (``time.process_time``), median of ``reps`` runs of the compiled plan; the ratio
column is over the faster peer; the einjoin row's verdict (ok / MISS) is the issue's goal, at most
1.0x it. ``--nodes 200000 --edges 5000000`` of bench/sparse.py gives the
issue's 10M non-zeros (nnz = 2 · edges).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse

import einjoin as ej
from cpu_timing import cpu_median

Row = Callable[..., None]
SHAPE = (10000, 1000, 500)  # I, J, K: J·K × R of the Khatri-Rao product is 128 MB at R = 32
RANK = 32


def mttkrp_case(row: Row, nnz: int, reps: int) -> None:
    """Rows for MTTKRP on an ``nnz``-entry tensor: the peers, then einjoin (its chosen plan)."""
    i_n, j_n, k_n = SHAPE
    rng = np.random.default_rng(0)
    coords = np.stack([rng.integers(0, n, nnz) for n in SHAPE])
    x = ej.sparse("X", (coords, rng.standard_normal(nnz), SHAPE))
    b, c = rng.standard_normal((j_n, RANK)), rng.standard_normal((k_n, RANK))
    (ci, cj, ck), vals = x.coo()[0].T, x.coo()[1]
    unfolded = scipy.sparse.csr_array((vals, (ci, cj * k_n + ck)), shape=(i_n, j_n * k_n))

    def khatri_rao() -> np.ndarray:  # row j·K + k is B[j] * C[k]
        return (b[:, None, :] * c[None, :, :]).reshape(j_n * k_n, RANK)

    peers: dict[str, Callable[[], Any]] = {"scipy unfold @ KR": lambda: unfolded @ khatri_rao()}
    try:
        import torch
        torch.set_num_threads(1)
        t_unf = torch.sparse_csr_tensor(torch.from_numpy(unfolded.indptr.astype(np.int64)),
                                        torch.from_numpy(unfolded.indices.astype(np.int64)),
                                        torch.from_numpy(unfolded.data), unfolded.shape)
        peers["torch.sparse unfold @ KR"] = lambda: torch.sparse.mm(t_unf, torch.from_numpy(khatri_rao()))
    except ImportError:
        pass
    name = f"MTTKRP ({x.nnz / 1e6:.1f}M nnz, R {RANK})"
    times = {k: cpu_median(f, reps)[0] for k, f in peers.items()}
    best = min(times.values())
    for k, t in times.items():
        row(name, k, t, best)
    want = unfolded @ khatri_rao()
    t_compile, plan = cpu_median(lambda: ej.sparse_compile("ijk,jr,kr->ir", x, b, c), 1)
    t_run, out = cpu_median(plan.run, reps)
    same = bool(np.allclose(out.todense(), want))
    kernel = ", ".join(sorted({st.layout.kernel for st in plan.steps if st.layout is not None}))
    row(name, "einjoin (chosen)", t_run, best,
        f"{'ok' if t_run <= best else 'MISS'} (goal <= 1.0); {plan.notation()} ({kernel}); "
        f"compile {t_compile * 1e3:.0f} ms; {'equal' if same else 'DIFFERENT'}")
