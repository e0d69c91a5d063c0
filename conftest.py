"""Root pytest configuration: it applies to the doctests under einjoin/ as well as to tests/.

torch computes the tests' references on one thread: under ``pytest -n 2`` on two cores its
default (one OpenMP thread per core, in each worker) oversubscribes the cores and its threads
wait for each other, spinning: a small LLaMA's ten torch training steps took 3.7 s instead of
0.2 s, the Trainer tests half the suite's time. einjoin's kernels are numpy's (their BLAS
limits are the runtime's own), so what the tests check is unchanged."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_plan_cache():  # type: ignore[no-untyped-def]
    """Each test plans afresh: einjoin caches plans per process (einjoin.planner.plan_specs),
    and a test that swaps a planner's internals, or counts solver calls, must not be handed a
    plan another test made. Within one test the cache works as it does for a user."""
    from einjoin.planner import clear_plan_cache
    clear_plan_cache()
    yield
