"""A runnable tour of einjoin's stages: program -> graph -> join-agg specs -> blocks -> results,
then the distributed path: optimizer -> placement and exchanges (a task graph) -> the engine on
two devices -> the same under a memory cap (evictions to host RAM).

    python examples/tour.py        (or: make tour)
"""

import numpy as np

import einjoin as ej
from einjoin.ir.printing import describe

# 1. A program, written the way people write it: a softmax over a matmul, and a max-plus product.
x = ej.input("x", (6, 8))
w = ej.input("w", (8, 4))
scores = x @ w
probs = ej.softmax(scores, dim=-1)
tropical = ej.einsum("ik,kj->ij", x, w, join="x0 + x1", agg="max")

# 2. The graph: every op is an extended einsum (join expression | aggregation), or a
#    reshape / select / concat / broadcast / fill / gather / cast node.
graph = ej.Graph([probs, tropical])
print("== graph\n" + str(graph))

# 3. Join-agg specs: how many blocks each label gets. Splitting the contracted label k of the
#    matmul makes partial sums; splitting m is data parallelism; n is model parallelism.
spec = {"m": 2, "n": 2, "k": 2}
d = ej.decompose(scores.node, spec)
print("\n== matmul under", d.spec)
print(f"output partition {d.out_partition}, input partitions {[str(p) for p in d.in_partitions]}")
print(f"{len(d.kernels)} kernels, {d.n_partials} partial results per output block, agg {d.agg}")
for k in d.kernels[:4]:
    print(f"  kernel {k.index}: reads x{k.in_keys[0]} and w{k.in_keys[1]} -> adds into out{k.out_key}")
print("  ...")

# 4. Blocks: a tensor relation is {block key: ndarray}; repartitioning moves data by overlap.
xv = np.arange(48, dtype=np.float32).reshape(6, 8)
rows = ej.TensorRelation.from_dense(xv, ej.Partition.from_counts((6, 8), (3, 1)))
cols = rows.repartition(ej.Partition.of((6, 8), [1, [0, 3, 8]]))
print("\n== relation: rows", {k: v.shape for k, v in rows.blocks.items()},
      "-> uneven columns", {k: v.shape for k, v in cols.blocks.items()})

# 5. Execution: the blocked executor runs every op as a relational join + aggregation and
#    agrees with the dense numpy reference.
feeds = {"x": np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32),
         "w": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)}
specs = {scores: spec, tropical: {"i": 3, "k": [0, 5, 8]}}
blocked = ej.execute_blocked([probs, tropical], specs, **feeds)
dense = ej.reference([probs, tropical], **feeds)
for name, b, r in zip(("softmax", "max-plus"), blocked, dense):
    print(f"\n== {name}: blocked vs reference, max |diff| = {np.abs(b - r).max():.2e}")

# 6. The optimizer picks a spec per op for 2 devices (EinDecomp: least bytes moved), placement puts
#    every block on a device, and exchange synthesis adds the selects / moves / touches between
#    them: one task graph, plain data, built from shapes alone.
prog = ej.compile([probs, tropical], devices=2, quiet=True)
print("\n== plan for 2 devices")
for n, s in prog.specs.items():
    if n.facts.contracts:  # the extended einsums
        print(f"  {describe(n):45s} {s}")
print(f"  {prog.stats}")

# 7. The engine runs the task graph: a worker thread per device, any ready order, frees after the
#    last reader; the measured bytes are the planned ones.
got = prog.run(**feeds)
print(f"\n== run on 2 devices: max |diff| = {max(np.abs(g - r).max() for g, r in zip(got, dense)):.2e}, "
      f"moved {prog.run_stats.bytes_moved} B (planned {prog.stats.bytes_moved} B)")

# 8. Under a memory cap the optimizer picks cuts that fit, and the memory planner adds evictions to
#    host RAM and reloads (Belady: the furthest next use goes first) so that any run stays within it.
capped = ej.compile([probs, tropical], devices=2, memory_limit="160B", quiet=True)
got = capped.run(**feeds)
print(f"\n== {capped.taskgraph.memory}")
print(f"   measured peak {capped.run_stats.peak_bytes_per_device} B, max |diff| = "
      f"{max(np.abs(g - r).max() for g, r in zip(got, dense)):.2e}")
