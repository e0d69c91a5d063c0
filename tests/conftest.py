"""Shared fixtures. ``ray_session``: one two-node Ray cluster on loopback for every Ray test of
the session (a head with 2 CPUs and a second node with 1 CPU, small object stores). Tests that
use it are grouped on one xdist worker (``xdist_group("ray")``, run with ``--dist loadgroup``).

torch computes the tests' references on one thread: under ``pytest -n 2`` on two cores its
default (one OpenMP thread per core, in each worker) oversubscribes the cores and its threads
wait for each other, spinning: a small LLaMA's ten torch training steps took 3.7 s instead of
0.2 s, the Trainer tests half the suite's time. einjoin's kernels are numpy's (their BLAS
limits are the runtime's own), so what the tests check is unchanged."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

OBJECT_STORE = 80 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE,
                                      "include_dashboard": False})
    cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, resources={"second": 1})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster
    from einjoin.runtime.backends import ray as ej_ray
    ej_ray.shutdown()
    ray.shutdown()
    cluster.shutdown()
