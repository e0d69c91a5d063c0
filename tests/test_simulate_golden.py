"""The event simulator's results pinned on synthetic task graphs (no planner: fusion or planning
changes do not move them): layered random graphs of kernels and moves of mixed sizes on a
two-node cluster (moves share NVSwitch ports and NICs), and on this machine's model (devices share
the cores and the GIL), in every ready order. The digests were taken with the simulator of
2026-12-07 (commit e1051c4); a change of the event loop for speed must keep every interval the
same, bit for bit (a change of the time model updates them, saying why: the "cpu" rows moved when
concurrent devices' kernels came to share the cores' capacity 1 + (cores - 1) * parallel, 1.8
here, not 2; and when a launch, Python holding the GIL, came to take a core too)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from einjoin.cluster.calibration import Calibration
from einjoin.cluster.model import Hardware
from einjoin.exchange import Kernel, Move, TaskGraphBuilder, TaskKind
from einjoin.ir.ops import input_node
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime.simulate import Simulation, simulate


def _graph(devices: int, layers: int, seed: int) -> TaskGraph:
    """Per layer, three kernels per device, each reading one of its last results and, from a random
    kernel of the last layer, another
    (moved when it lives elsewhere); sizes and flops drawn per task."""
    rng = np.random.default_rng(seed)
    b, node = TaskGraphBuilder(), input_node("toy", (1,))

    def kernel(d: int, reads: tuple[int, ...]) -> int:
        elems = int(rng.choice([1 << 10, 1 << 16, 1 << 20]))
        return b.produce(TaskKind.KERNEL, d, reads, (elems,), "float32", node, Kernel(0),
                         int(rng.choice([10**6, 10**8, 10**10])))

    width = 3  # kernels per device and layer: several ready at once, so the ready order matters
    layer = [kernel(d % devices, ()) for d in range(devices * width)]
    for _ in range(layers):
        nxt = []
        for k in range(devices * width):
            d = k % devices
            src = layer[int(rng.integers(len(layer)))]
            if b.values[src].device != d:
                moved = b.value(d, b.values[src].shape, "float32", node)
                b.add(TaskKind.MOVE, d, (src,), moved, node, Move(b.values[src].device))
                src = moved
            nxt.append(kernel(d, (layer[k], src)))
        layer = nxt
    dependents: list[list[int]] = [[] for _ in b.tasks]
    for t in b.tasks:
        for dep in t.deps:
            dependents[dep].append(t.id)
    return TaskGraph(tuple(b.tasks), tuple(b.values), devices, (), tuple(map(tuple, dependents)))


def _hardware(name: str, devices: int) -> Hardware:
    if name == "cpu":  # a fixed calibration: figures of this kind of machine, not measured here
        cal = Calibration(cores=2, matmul_rate=90e9, half_work=0.5e6, parallel=0.8, mem_bw=30e9, vector_rate=2e9,
                          copy_bw=20e9, launch=3e-6, launch_threads=4e-6, machine="test", overhead=4e-5,
                          overhead_threads=4e-4, fn_rates={"add": 2.5e9, "exp": 1e9}, fn_call=2e-6)
        return cal.hardware(devices)
    from einjoin.cluster import Cluster
    from einjoin.runtime.simulate import hardware_for
    return hardware_for(Cluster.nodes(2, "dgx-a100")) if devices == 16 else hardware_for(
        Cluster.preset("dgx-a100", devices=devices))


def _digest(sim: Simulation) -> tuple[str, str]:
    runs = sorted((d, s, e, tid) for d, iv in sim.intervals.items() for s, e, tid in iv)
    text = repr((runs, sorted(sim.link_bytes.items()), sorted(sim.link_busy.items()), sorted(sim.peak_memory.items())))
    return repr(sim.makespan), hashlib.sha1(text.encode()).hexdigest()[:16]


CASES = [("a100", 16, order, seed, 30) for order in ("fifo", "lifo", "priority", "random") for seed in (0, 1)] + [
    ("a100", 8, "fifo", 2, 40), ("cpu", 4, "fifo", 3, 30), ("cpu", 2, "lifo", 4, 30), ("cpu", 4, "priority", 5, 20)]

GOLDEN: dict[tuple[str, int, str, int, int], tuple[str, str]] = {
    ('a100', 16, 'fifo', 0, 30): ('0.032196925302153824', 'f732e90ccb79b9b0'),
    ('a100', 16, 'fifo', 1, 30): ('0.031951033434256385', 'c44a07a6e9d9b376'),
    ('a100', 16, 'lifo', 0, 30): ('0.03706234877825641', '056d18e3e41d0b63'),
    ('a100', 16, 'lifo', 1, 30): ('0.03487428239589741', '22eae68d388760ac'),
    ('a100', 16, 'priority', 0, 30): ('0.0321475119856996', 'dd6cd1c7fc2aa142'),
    ('a100', 16, 'priority', 1, 30): ('0.032214709083897404', '39db2eab45021dc1'),
    ('a100', 16, 'random', 0, 30): ('0.033076617997948705', '203565f99577f1c8'),
    ('a100', 16, 'random', 1, 30): ('0.033553101590974334', 'dbce13375016f483'),
    ('a100', 8, 'fifo', 2, 40): ('0.0412135640385641', '07950d11ae2b345f'),
    ('cpu', 4, 'fifo', 3, 30): ('7.517059782400009', '569eff645ca3bb8c'),
    ('cpu', 2, 'lifo', 4, 30): ('4.9704605872592635', '9f269d64e6ad3e9b'),
    ('cpu', 4, 'priority', 5, 20): ('4.942495386666668', 'd91134f56ef2b718'),
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_simulation_is_pinned(case: tuple[str, int, str, int, int]) -> None:
    hw, devices, order, seed, layers = case
    sim = simulate(_graph(devices, layers, seed), _hardware(hw, devices), order, seed)
    assert _digest(sim) == GOLDEN[case]
