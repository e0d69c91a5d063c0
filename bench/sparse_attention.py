"""Block-sparse attention (issue 24): causal and sliding-window attention as block sparsity, against
dense masked attention, in ``bench/sparse.py``'s table (CPU ms, median of ``--reps``; ``/ peer``:
the ratio to torch's sdpa with the materialised boolean mask; the notes: the block-sparse rows'
time over the dense einjoin plan's with the issue's goal verdict, ok / MISS at <= 0.55x, then the
modelled GFLOP and their ratio to the dense masked plan's).

The issue's case: seq 8192, batch 1, 8 heads of 64, 128-blocks (``--seq 2048`` for a quick run).

* torch ``scaled_dot_product_attention`` with the dense boolean mask (causal; causal + window);
* einjoin, the dense plan: ``ej.attention`` with that mask as an input (every pair computed);
* einjoin, block-sparse: ``ej.attention(causal=True[, window=W])`` whole (causal: one flash call,
  torch skipping the tiles above the diagonal; a window: by 128-row blocks, each over its band of
  keys), and its query rows cut into 128-row blocks (each block over only the key blocks its mask
  allows, as a plan that cuts the rows runs it).

Run alone: ``.venv/bin/python bench/sparse_attention.py --seq 2048 --reps 3``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

import einjoin as ej
from cpu_timing import cpu_median as _cpu
from einjoin.decomp.flops import kernel_flops

Row = Callable[..., None]  # bench/sparse.py's row(name, what, t, peer, note)


def _allowed(n: int, window: int | None) -> np.ndarray:
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) if window is None else (j <= i) & (i - j < window)


def _blocked_flops(node: Any, spec: dict[str, int]) -> int:
    d = ej.decompose(node, spec)
    return sum(kernel_flops(d, k.index) for k in d.kernels)


def attention_case(row: Row, seq: int = 8192, reps: int = 3, heads: int = 8, e: int = 64,
                   windows: tuple[int | None, ...] = (None, 1024), block: int = 128) -> None:
    """The rows of the issue's case: for each mask (causal; causal + sliding window), torch's sdpa
    with the dense bool mask, the dense einjoin node with that mask, and the block-sparse node,
    whole and in 128-row blocks. Every column on one torch thread, einjoin's kernels inline
    (``ej.execute_blocked``, the decomposition executor: the plan's kernels without the threads
    backend's thread share); the flops are the plans' (``ej.compile(...).stats.flops``)."""
    import torch
    import torch.nn.functional as tf

    from einjoin.ir import attention as attn
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time on one core for every column
    try:
        rng = np.random.default_rng(0)
        shape = (1, heads, seq, e)
        q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        xs = [ej.input(n, shape) for n in "qkv"]
        assert attn.BLOCK == block, "the kernel's block is ir.attention.BLOCK"
        for window in windows:
            what = "causal" if window is None else f"causal, window {window}"
            name = f"attention {what} (seq {seq})"
            allowed = _allowed(seq, window)
            tm = torch.from_numpy(allowed)
            t_torch, want = _cpu(lambda tm=tm: tf.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm).numpy(), reps)
            dense = ej.attention(*xs, causal=False, mask=ej.input("m", allowed.shape, "bool"))
            full = ej.compile(dense, devices=ej.local(1)).stats.flops
            t_dense, got = _cpu(lambda dense=dense, m=allowed: ej.execute_blocked(dense, q=q, k=k, v=v, m=m), reps)
            assert np.allclose(got, want, atol=1e-4)
            row(name, "torch sdpa, bool mask", t_torch, t_torch, f"{full / 1e9:.1f} GFLOP (every pair)")
            row(name, "einjoin dense, bool mask", t_dense, t_torch, f"{full / 1e9:.1f} GFLOP")
            out = ej.attention(*xs, causal=True, window=window)
            for spec in ({}, {"c": -(-seq // block)}):
                t, got = _cpu(lambda out=out, spec=spec: ej.execute_blocked(out, {out.node: spec}, q=q, k=k, v=v),
                              reps)
                assert np.allclose(got, want, atol=1e-4)
                f = _blocked_flops(out.node, spec) if spec else ej.compile(out, devices=ej.local(1)).stats.flops
                how = f"einjoin, {spec['c']} row blocks" if spec else "einjoin block-sparse"
                row(name, how, t, t_torch, f"{t / t_dense:.2f}x dense einjoin time: "
                    f"{'ok' if t <= 0.55 * t_dense else 'MISS'} (goal <= 0.55x); "
                    f"{f / 1e9:.1f} GFLOP = {f / full:.3f}x dense")
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    def row(name: str, what: str, t: float, peer: float, note: str = "") -> None:  # bench/sparse.py's
        print(f"{name:28s} {what:26s} {t * 1e3:10.1f} {t / peer:8.2f}  {note}")

    print(f"{'case':28s} {'method':26s} {'CPU ms':>10s} {'/ peer':>8s}  notes")
    attention_case(row, args.seq, args.reps)


if __name__ == "__main__":
    main()
