"""Root pytest configuration: it applies to the doctests under einjoin/ as well as to tests/.

torch computes the tests' references on one thread: under ``pytest -n 2`` on two cores its
default (one OpenMP thread per core, in each worker) oversubscribes the cores and its threads
wait for each other, spinning: a small LLaMA's ten torch training steps took 3.7 s instead of
0.2 s, the Trainer tests half the suite's time. einjoin's kernels are numpy's (their BLAS
limits are the runtime's own), so what the tests check is unchanged."""

import torch

torch.set_num_threads(1)
