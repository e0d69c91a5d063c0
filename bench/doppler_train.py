"""Train the ``doppler`` placement policy (issue 23) and write ``einjoin/placement/doppler_policy.json``.

Seeded and reproducible: the same seed gives the same graphs, the same decisions and the same
weights. The training graphs are generated: small transformer blocks (forward, or forward +
backward) and MLP training steps of random sizes, in bfloat16, each planned with
``objective="bytes"`` for one of a few simulated clusters (4 GPUs of a DGX A100, two islands of
two joined by 1 GB/s, 2 x DGX A100). Phase 1 imitates the critical-path teacher
(:func:`einjoin.placement.doppler.imitate`: the agreement is printed); phase 2 improves on it by a
cross-entropy search over the weights (:func:`einjoin.placement.doppler.improve`), each policy
scored by the simulator's makespan (weights resident) over CP's, averaged over the graphs. Every
makespan is SIMULATED; the CPU seconds are this machine's.

    .venv/bin/python bench/doppler_train.py [--seed 0] [--graphs 8] [--rounds 8] [--population 10]
                                            [--sigma 1.0]
                                            [--out einjoin/placement/doppler_policy.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import sys
import time
from typing import Any

import einjoin as ej
from einjoin.cluster.model import Fabric
from einjoin.cluster.presets import preset_hardware
from einjoin.placement import place
from einjoin.placement.doppler import POLICY, Policy, Rollout, _POLICY_FILE, imitate, improve
from einjoin.plan import build_taskgraph
from einjoin.runtime.simulate import simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from simulate import decoder_bf16  # noqa: E402  (bench/simulate.py: the LLaMA block builder)


def islands() -> ej.Cluster:
    """Two islands of two A100s, NVSwitch inside, 1 GB/s between them."""
    hw = dataclasses.replace(preset_hardware("dgx-a100", devices=4), groups=(0, 0, 1, 1), inter=Fabric(1e9, 2e-5))
    return ej.Cluster.of_hardware(hw)


def training_graph(rng: random.Random) -> tuple[str, list[ej.Tensor]]:
    """One generated graph: a small decoder block (forward, or its loss and weight gradients) or
    an MLP's training step, sizes drawn from ``rng``."""
    if rng.random() < 0.6:
        seq, d = rng.choice((128, 256, 512)), rng.choice((256, 512))
        heads = rng.choice((4, 8))
        out = decoder_bf16(ej.input("x", (1, seq, d), "bfloat16"), "", heads, None, rng.choice((2, 3)) * d)
        if rng.random() < 0.5:
            return f"block s{seq} d{d} h{heads} fwd", [out]
        weights = [ej.Tensor(n) for n in ej.Graph([out]).inputs if n.op.name != "x"]  # type: ignore[union-attr]
        loss = out.sum()
        return f"block s{seq} d{d} h{heads} fwd+bwd", [loss, *ej.grad(loss, weights)]
    b, d, h = rng.choice((256, 1024, 2048)), rng.choice((256, 512, 1024)), rng.choice((1024, 2048))
    x = ej.input("x", (b, d), "bfloat16")
    ws = [ej.param(f"w{i}", (d, h) if i % 2 == 0 else (h, d), "bfloat16") for i in range(2 * rng.choice((1, 2)))]
    y = x
    for i, w in enumerate(ws):
        y = ej.silu(y @ w) if i % 2 == 0 else y @ w
    loss = y.sum()
    return f"mlp {len(ws)}x b{b} d{d} h{h} fwd+bwd", [loss, *ej.grad(loss, ws)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--graphs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--population", type=int, default=10)
    ap.add_argument("--sigma", type=float, default=1.0, help="the search's first spread of each weight")
    ap.add_argument("--out", default=str(_POLICY_FILE))
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    clusters = [("dgx-a100 x4", ej.Cluster.preset("dgx-a100", devices=4)), ("islands 2x2", islands()),
                ("2 x dgx-a100", ej.Cluster.nodes(2, "dgx-a100"))]
    rollouts, scores = [], []
    t0 = time.process_time()
    print(f"{'graph':<36}{'cluster':<15}{'tasks':>6}{'greedy/CP':>10}  (simulated)")
    for i in range(args.graphs):
        cname, cluster = clusters[i % len(clusters)]
        name, outs = training_graph(rng)
        plan = ej.compile(outs, cluster, backend="null", quiet=True, objective="bytes").plan

        def makespan(pl: Any, plan: Any = plan, cluster: ej.Cluster = cluster) -> float:
            tg = build_taskgraph(plan.graph, plan.decomps, pl, cluster.size)
            return simulate(tg, cluster.hardware, plan.options.order, plan.options.seed, resident=True).makespan
        r = Rollout(plan.decomps, cluster)
        rollouts.append(r)
        scores.append(makespan)
        cp = makespan(place("critical_path", plan.decomps, cluster))
        gr = makespan(place("greedy", plan.decomps, cluster))
        print(f"{name:<36}{cname:<15}{len(r.tasks):>6}{gr / cp:>10.3f}")
        sys.stdout.flush()
    t1 = time.process_time()
    imitated, (a_sel, a_plc, agree) = imitate(rollouts)
    t2 = time.process_time()
    print(f"phase 1, imitation of CP: agreement with the teacher's decisions (teacher-forced) SEL {a_sel:.3f}, "
          f"PLC {a_plc:.3f}, all {agree:.3f}; {t2 - t1:.1f} s CPU")
    best, value = improve(rollouts, scores, imitated, rounds=args.rounds, population=args.population,
                          sigma=args.sigma, seed=args.seed)
    t3 = time.process_time()
    _, imit_value = improve(rollouts, scores, imitated, rounds=0)
    _, old_value = improve(rollouts, scores, POLICY, rounds=0)
    print(f"phase 2, cross-entropy search: mean makespan / CP's {imit_value:.3f} (imitation) -> {value:.3f} "
          f"(best of {args.rounds} rounds x {args.population}; the committed policy: {old_value:.3f}); "
          f"{t3 - t2:.1f} s CPU; graphs planned in {t1 - t0:.1f} s CPU")
    data = best.to_json()
    pathlib.Path(args.out).write_text(json.dumps(data) + "\n")
    print(f"wrote {args.out}: {json.dumps(data)}")
    return {"agreement": agree, "imitation": imit_value, "trained": value, "policy": Policy.of(best.flat())}


if __name__ == "__main__":
    main()
