"""Per-run CPU cost of binding an imported module's weights (issue 36): a bound tensor follows
its module path at each run (``lin.weight = nn.Parameter(w)`` is seen), against binding by
tensor object only (before issue 36), in one process, on the demo's LLaMA block; and the cost
of the run's module check (``module.eval()`` or a changed setting since the import is refused).

    .venv/bin/python bench/bound_follow.py --reps 2000

Prints the CPU microseconds per run of feeding every bound tensor (``Program._bind`` of one
run's feeds: the binding both ways) and, for scale, one whole run's CPU time on the threads backend.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import einjoin as ej
from einjoin.demo import CONFIG
from einjoin.frontend.bound_tensors import LiveTensor
from einjoin.models.zoo import example


def _cpu_per_call(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm: views taken
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t0) / reps)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    module, args = example("llama-block", **CONFIG)
    prog = ej.compile(ej.from_torch(module, args), devices=4, quiet=True)
    following = dict(prog._bound or {})
    by_object = {k: LiveTensor(v.source, v.tensor) if isinstance(v, LiveTensor) else v for k, v in following.items()}
    followed = sum(isinstance(v, LiveTensor) and v._where is not None for v in following.values())
    print(f"LLaMA block {CONFIG}: {len(following)} bound tensors, {followed} followed by module path")
    prog._bound = by_object
    before = _cpu_per_call(lambda: prog._bind(args, {}), a.reps)
    prog._bound = following
    after = _cpu_per_call(lambda: prog._bind(args, {}), a.reps)
    guard = prog._guard
    checked = _cpu_per_call(guard.check, a.reps) if guard is not None else 0.0
    prog.run(*args)
    t0 = time.process_time()
    for _ in range(3):
        prog.run(*args)
    run = (time.process_time() - t0) / 3 * 1e6
    print(f"binding one run's feeds (CPU us): by tensor object {before:.1f}, following module paths "
          f"{after:.1f} (+{after - before:.1f}); one whole run {run:.0f} us CPU "
          f"(+{(after - before) / run * 100:.3f}%); the module guard's check (types, train/eval flags, "
          f"settings of {len(guard.entries) if guard is not None else 0} modules) {checked:.1f} us "
          f"(+{checked / run * 100:.3f}%)")


if __name__ == "__main__":
    main()
