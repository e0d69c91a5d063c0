"""Session 40 (H7): the gradient counterpart of ``opdb_sweep.py``: for every translated op of
torch's op database, a loss ``sum_k (out_k * w_k).sum()`` over its float outputs (``w_k`` a fixed
ramp) is imported with ``from_torch`` and differentiated with ``ej.grad`` w.r.t. each float
argument, against ``torch.autograd.grad``. Not a test (minutes); run by hand:

    python tests/adversarial/opdb_grad_sweep.py --per-op 2 [--dtype float32 --rtol 2e-4] [ops ...]

Session 40: float64, 2 samples per op: 365 match, 9 refused; float32, 1 sample: 194 match,
1 wrong (native_layer_norm, fixed in ff89f9f), 2 refused.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).parent))
import opdb_sweep as S  # noqa: E402

import einjoin as ej  # noqa: E402
from einjoin.errors import EinjoinError  # noqa: E402
from einjoin.frontend.tensor import Tensor  # noqa: E402


class _Loss(torch.nn.Module):
    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *ts: Any) -> Any:
        total: Any = 0
        for o in pytree.tree_leaves(self.inner(*ts)):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                total = total + (o * torch.linspace(-1, 2, o.numel(), dtype=o.dtype).reshape(o.shape)).sum()
        return total


def run_case(case: Any, rtol: float) -> tuple[str, str]:
    """("match" | "refused" | "skip" | "wrong" | "raw", detail)."""
    spec, leaves, slots = S._leaves(case)
    ts = [leaves[i] for i in slots]
    fl = [k for k, t in enumerate(ts) if t.is_floating_point()]
    if not fl:
        return "skip", "no float argument"
    loss = _Loss(S._Wrap(case.info.op, spec, leaves, slots))
    tt = [t.clone().requires_grad_(k in fl) for k, t in enumerate(ts)]
    try:
        out = loss(*tt)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return "skip", "no gradient in torch"
        want = torch.autograd.grad(out, [tt[k] for k in fl], allow_unused=True)
    except Exception as e:
        return "skip", f"torch refuses: {type(e).__name__}"
    try:
        fn = ej.from_torch(loss, tuple(t.clone() for t in ts))
        fed = {n.op.name: n for n in ej.Graph(fn.outputs[0]).nodes if n.facts.fed}
        wrt = [Tensor(fed[fn.arg_names[k]]) if fn.arg_names[k] in fed else None for k in fl]
        used = [w for w in wrt if w is not None]
        got: list[Any] = []
        if used:
            grads = ej.grad(fn.outputs[0], used)
            res = ej.compile(fn.with_outputs(list(grads)), quiet=True).run(*[t.clone() for t in ts])
            got = list(res) if isinstance(res, (list, tuple)) else [res]
        it = iter(got)
        full = [next(it) if w is not None else None for w in wrt]
    except EinjoinError as e:
        return "refused", f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return "raw", f"{type(e).__name__}: {str(e)[:200]} @ {tb.filename.rsplit('/', 2)[-1]}:{tb.lineno}"
    for k, (g, w) in enumerate(zip(full, want)):
        w = torch.zeros_like(ts[fl[k]]) if w is None else w
        if g is None:
            if w.abs().max() > 0:
                return "wrong", f"grad {k}: input not read, torch's gradient nonzero"
            continue
        g = g if isinstance(g, torch.Tensor) else torch.as_tensor(np.asarray(g))
        fin = w[torch.isfinite(w)]
        scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
        try:
            torch.testing.assert_close(g, w, equal_nan=True, rtol=rtol, atol=rtol * scale)
        except AssertionError as e:
            return "wrong", f"grad {k}: {str(e).splitlines()[1:4]}"
    return "match", ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*")
    p.add_argument("--per-op", type=int, default=2)
    p.add_argument("--dtype", default="float64")
    p.add_argument("--rtol", type=float, default=1e-6)
    a = p.parse_args(argv)
    counts: collections.Counter[str] = collections.Counter()
    for info in S.op_db():
        if not S.translated(info) or (a.ops and info.name not in a.ops):
            continue
        for c in S.cases(info, getattr(torch, a.dtype), a.per_op):
            status, why = run_case(c, a.rtol)
            counts[status] += 1
            if status in ("wrong", "raw", "refused"):
                print(f"{status:8s} {c.key}: {why}", flush=True)
    print(dict(counts))
    return 1 if counts["wrong"] or counts["raw"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
