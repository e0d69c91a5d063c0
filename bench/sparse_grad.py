"""bench/sparse.py's row for sparse gradients (issue 24): one training step's einsums of a GNN layer,
``out = A·H·W`` and the gradients of ``mean((out - Y)^2)`` w.r.t. A (on its entries), H and W.

einjoin: ``plan.run()`` then ``plan.vjp(G)`` (einjoin.sparse.grad; the gradient einsums compiled
outside the timing, on a first step, as a training loop would). Peers on the same data: torch
autograd through ``torch.sparse.mm`` (A a COO tensor with ``requires_grad``, 1 thread), and scipy
by hand (``A @ (H @ W)``, ``Aᵀ·(G·Wᵀ)``, ``(A·H)ᵀ·G``, dA gathered at A's entries). CPU seconds
(``time.process_time``), median of ``reps``; the ratio is over the faster peer.

>>> import io, contextlib, numpy as np, scipy.sparse
>>> a = scipy.sparse.random(50, 50, density=0.1, format="csr", random_state=0)
>>> rng = np.random.default_rng(0)
>>> rows = []
>>> grad_case(lambda *r: rows.append(r), a, rng.standard_normal((50, 8)), rng.standard_normal((8, 4)), 1)
>>> [r[1] for r in rows]
['einjoin run + vjp']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import os

import numpy as np
import scipy.sparse

import einjoin as ej
from cpu_timing import cpu_median as _cpu

Row = Callable[..., None]


def _scipy_step(mat: scipy.sparse.csr_array, h: np.ndarray, w: np.ndarray, y: np.ndarray
                ) -> tuple[np.ndarray, ...]:
    hw = h @ w
    out = mat @ hw
    g = 2 * (out - y) / y.size
    coo = mat.tocoo()
    da = np.einsum("nl,nl->n", g[coo.row], hw[coo.col])
    return da, mat.T @ (g @ w.T), (mat @ h).T @ g


def _torch_step(ta: Any, h: np.ndarray, w: np.ndarray, y: np.ndarray) -> tuple[Any, ...]:
    import torch
    a = ta.detach().requires_grad_(True)
    th, tw = torch.from_numpy(h).requires_grad_(True), torch.from_numpy(w).requires_grad_(True)
    loss = ((torch.sparse.mm(a, th @ tw) - torch.from_numpy(y)) ** 2).mean()
    loss.backward()
    return a.grad, th.grad, tw.grad


def grad_case(row: Row, mat: scipy.sparse.csr_array, h: np.ndarray, w: np.ndarray, reps: int) -> None:
    """One row: einjoin's forward + gradients against the faster of torch autograd and scipy."""
    y = np.random.default_rng(1).standard_normal((mat.shape[0], w.shape[1]))
    a = ej.sparse("A", mat)
    plan = ej.sparse_compile("ij,jk,kl->il", a, h, w)

    def step() -> tuple[Any, ...]:
        out = plan.run(x1=h, x2=w)
        dense = out.todense() if isinstance(out, ej.SparseTensor) else out
        return plan.vjp(2 * (dense - y) / y.size)

    step()  # the first step compiles the gradient einsums
    t, (da, dh, dw) = _cpu(step, reps)
    t_sp, (sda, sdh, sdw) = _cpu(lambda: _scipy_step(mat, h, w, y), reps)
    assert np.allclose(dh, sdh) and np.allclose(dw, sdw)
    # compared as sparse matrices (densified, the 200k-node graph's would be 298 GiB)
    theirs = scipy.sparse.csr_array((sda, mat.tocoo().coords), shape=mat.shape)
    diff = (da.to_scipy() - theirs).data
    assert np.allclose(diff, 0, atol=1e-8 * max(float(np.abs(theirs.data).max(initial=0)), 1.0))
    peers = {"scipy": t_sp}
    notes = ""
    dense_a = mat.shape[0] * mat.shape[1] * 8
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if dense_a > memory // 4:  # torch.sparse.mm's backward gives A a dense gradient (320 GB at 200k nodes)
        notes = f"; torch autograd not run: its sparse.mm backward densifies dA ({dense_a / 2 ** 30:.0f} GiB)"
    else:
        _torch_peer(peers, mat, h, w, y, reps)
    best = min(peers, key=lambda k: peers[k])
    row(f"GNN grad A·H·W ({mat.shape[0]} nodes)", "einjoin run + vjp", t, peers[best],
        "vs " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in peers.items()) + " (fwd + dA, dH, dW)" + notes)


def _torch_peer(peers: dict[str, float], mat: scipy.sparse.csr_array, h: np.ndarray, w: np.ndarray,
                y: np.ndarray, reps: int) -> None:
    try:
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            coo = mat.tocoo()
            ta = torch.sparse_coo_tensor(np.stack([coo.row, coo.col]), coo.data, mat.shape).coalesce()
            peers["torch"], _ = _cpu(lambda: _torch_step(ta, h, w, y), reps)
        finally:
            torch.set_num_threads(threads)
    except ImportError:
        pass
