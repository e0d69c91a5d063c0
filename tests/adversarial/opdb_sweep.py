"""Issue 39 (H7): a conformance sweep of the torch import against torch's own op database.

Every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` whose op einjoin's
table translates is wrapped, sample by sample (torch's own sample inputs), in a tiny module whose
forward calls the op on its tensor arguments; the module is imported with ``ej.from_torch``,
compiled, run, and compared with torch's result: dtype, shape and values (exact for integers and
bools, torch's default tolerances for floats, NaN where torch has NaN). Each case either matches
or is refused with an :class:`einjoin.errors.EinjoinError`; a wrong value, dtype or shape, or any
other exception, is a bug. A sample torch itself refuses is skipped.

Run as a script for the counts (``python tests/adversarial/opdb_sweep.py [--per-op N] [OP ...]``);
``test_issue39_opdb.py`` runs a fixed subset in ``make test`` and the whole sweep in ``make test-all``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

import einjoin as ej
from einjoin.errors import EinjoinError
from einjoin.frontend.aten import OPS

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.int32, torch.bfloat16)


def op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


def aten_name(info: Any) -> str:
    """The name einjoin's table would look the op up by (``nn.functional.relu`` -> ``relu``)."""
    return str(info.aten_name or info.name.rsplit(".", 1)[-1])


# ops whose values torch leaves unspecified (uninitialised memory)
UNSPECIFIED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# ops whose indices may name any of equal elements (an unstable sort): the indices are checked by
# the values they pick
ORDERING = frozenset({"sort", "topk", "argsort", "msort"})


def translated(info: Any) -> bool:
    return aten_name(info) in OPS and info.name not in UNSPECIFIED


@dataclass(frozen=True)
class Case:
    op: str            # the OpInfo's name (with its variant)
    dtype: torch.dtype
    index: int         # the sample's position in sample_inputs
    info: Any
    sample: Any

    @property
    def key(self) -> str:
        return f"{self.op}-{str(self.dtype).removeprefix('torch.')}-{self.index}"


class _Wrap(nn.Module):
    """``op(*args, **kwargs)`` with the sample's tensors as forward arguments (its other values
    fixed): what a user's forward calling the op looks like to the import."""

    def __init__(self, fn: Any, spec: Any, leaves: list[Any], slots: list[int]) -> None:
        super().__init__()
        self.fn, self.spec, self.leaves, self.slots = fn, spec, leaves, slots

    def forward(self, *ts: torch.Tensor) -> Any:
        leaves = list(self.leaves)
        for s, t in zip(self.slots, ts):
            leaves[s] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


def cases(info: Any, dtype: torch.dtype, limit: int | None = None) -> Iterator[Case]:
    if dtype not in info.supported_dtypes("cpu"):
        return
    torch.manual_seed(39)  # torch's sample generators draw from the global generator: fixed cases
    try:
        samples = list(info.sample_inputs("cpu", dtype, requires_grad=False))
    except Exception:  # torch's own generator (a missing optional module)
        return
    name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
    for i, s in enumerate(samples):
        if limit is not None and i >= limit:
            return
        yield Case(name, dtype, i, info, s)


def _leaves(case: Case) -> tuple[Any, list[Any], list[int]]:
    s = case.sample
    leaves, spec = pytree.tree_flatten(((s.input, *s.args), dict(s.kwargs)))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    return spec, leaves, slots


def _tol(w: torch.Tensor) -> dict[str, float]:
    """torch's default tolerances, the absolute one scaled by the result's magnitude (a sum of
    products in another order differs by a few ulps of its largest term); bfloat16 results are
    rounded once from float32 (einjoin) or after each step (some torch kernels): 1 ulp apart."""
    fin = w[torch.isfinite(w)] if w.numel() else w
    scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
    rtol, atol = {torch.bfloat16: (1.6e-2, 8e-3), torch.float16: (1e-3, 1e-3),
                  torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}.get(w.dtype, (0.0, 0.0))
    return {"rtol": rtol, "atol": atol * scale}


def _dim_of(case: Case) -> int:
    s = case.sample
    dim = s.kwargs.get("dim", s.args[1] if case.info.name == "topk" and len(s.args) > 1 else
                       (s.args[0] if case.info.name != "topk" and s.args and isinstance(s.args[0], int)
                        and not isinstance(s.args[0], bool) else -1))
    return int(dim)


def _picked(case: Case, idx: torch.Tensor) -> torch.Tensor:
    """The input's values at ``idx`` along the op's dim (an ordering op's indices, checked by
    what they pick)."""
    x = case.sample.input
    if x.ndim == 0:
        return x.reshape(idx.shape)
    return torch.take_along_dim(x, idx.to(torch.int64), _dim_of(case))


def _same(got: Any, want: Any, case: Case | None = None) -> str | None:
    """Why ``got`` differs from torch's ``want`` (None when it matches)."""
    gs, ws = pytree.tree_leaves(got), pytree.tree_leaves(want)
    gs = [g for g in gs if g is not None]
    ws = [w for w in ws if isinstance(w, torch.Tensor)]
    if len(gs) != len(ws):
        return f"{len(gs)} outputs, torch {len(ws)}"
    for k, (g, w) in enumerate(zip(gs, ws)):
        g = g if isinstance(g, torch.Tensor) else torch.as_tensor(np.asarray(g))
        if g.dtype != w.dtype:
            return f"output {k}: dtype {g.dtype}, torch {w.dtype}"
        if tuple(g.shape) != tuple(w.shape):
            return f"output {k}: shape {tuple(g.shape)}, torch {tuple(w.shape)}"
        if case is not None and case.info.name in ORDERING and k == (0 if case.info.name == "argsort" else 1):
            g, w = _picked(case, g), _picked(case, w)  # equal elements in another order
        try:
            torch.testing.assert_close(g, w, equal_nan=True, check_device=False, **(
                _tol(w) if w.is_floating_point() else {}))
        except AssertionError as e:
            return f"output {k}: values differ: {str(e).splitlines()[1:4]}"
    return None


def run_case(case: Case) -> tuple[str, str]:
    """("match" | "refused" | "skip" | "wrong" | "raw", detail)."""
    spec, leaves, slots = _leaves(case)
    ts = [leaves[i] for i in slots]
    if not ts:
        return "skip", "no tensor argument"
    m = _Wrap(case.info.op, spec, leaves, slots)
    try:
        with torch.no_grad():
            want = m(*[t.clone() for t in ts])
    except Exception as e:
        return "skip", f"torch refuses: {type(e).__name__}"
    if not any(isinstance(w, torch.Tensor) for w in pytree.tree_leaves(want)):
        return "skip", "no tensor output"
    if any(isinstance(t, torch.Tensor) and (t.is_sparse or t.layout != torch.strided)
           for t in pytree.tree_leaves((ts, want))):
        return "skip", "sparse layout"
    try:
        fn = ej.from_torch(m, tuple(t.clone() for t in ts))
        got = ej.compile(fn, quiet=True).run(*[t.clone() for t in ts])
    except EinjoinError as e:
        return "refused", f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return "raw", f"{type(e).__name__}: {str(e)[:200]} @ {tb.filename.rsplit('/', 2)[-1]}:{tb.lineno}"
    why = _same(got, want, case)
    return ("match", "") if why is None else ("wrong", why)


def sweep(names: list[str] | None = None, per_op: int | None = None,
          dtypes: tuple[torch.dtype, ...] = DTYPES, shard: tuple[int, int] = (0, 1),
          echo: bool = False) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    infos = [i for i in op_db() if translated(i)
             and not (names and i.name not in names and aten_name(i) not in names)]
    for info in infos[shard[0]::shard[1]]:
        for dt in dtypes:
            for c in cases(info, dt, per_op):
                status, why = run_case(c)
                out[status].append((c.key, why))
                if echo:
                    print(f"{status:8s} {c.key}: {why}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ops", nargs="*")
    p.add_argument("--per-op", type=int, default=None, help="samples per op and dtype")
    p.add_argument("--show", default="wrong,raw", help="statuses to list")
    p.add_argument("--shard", default="0/1", help="k/n: every n-th op from the k-th")
    p.add_argument("--echo", action="store_true", help="print each case as it ends")
    a = p.parse_args(argv)
    import logging
    logging.disable(logging.WARNING)
    k, n = (int(v) for v in a.shard.split("/"))
    res = sweep(a.ops or None, a.per_op, shard=(k, n), echo=a.echo)
    ops = {k.rsplit("-", 2)[0] for v in res.values() for k, _ in v}
    for st in a.show.split(","):
        for k, why in res.get(st, []):
            print(f"{st:8s} {k}: {why}")
    counts = {k: len(v) for k, v in res.items()}
    print(f"ops {len(ops)}; cases {sum(counts.values()) - counts.get('skip', 0)}; " +
          ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
