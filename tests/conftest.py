"""Shared fixtures. ``ray_session``: one two-node Ray cluster on loopback for every Ray test of
the session (a head with 2 CPUs and a second node with 1 CPU, small object stores). Tests that
use it are grouped on one xdist worker (``xdist_group("ray")``, run with ``--dist loadgroup``).
``ray_backend``: one Ray backend on it for every test that leaves its actors alive and its
settings as it found them (starting actors is most of a Ray test's time: a pool per cluster
shape, local shapes sharing actors, so the session starts each device's actor once).
torch's one thread per worker is set in the root ``conftest.py`` (it covers the doctests too)."""

from __future__ import annotations

import pytest

OBJECT_STORE = 80 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 2, "object_store_memory": OBJECT_STORE,
                                      "include_dashboard": False,
                                      # Ray's default worker niceness (15) starves the device
                                      # actors on a busy machine: the Ray tests 253 -> 226 s at 0
                                      "_system_config": {"worker_niceness": 0}})
    cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE, resources={"second": 1})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster
    from einjoin.runtime.backends import ray as ej_ray
    ej_ray.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_backend(ray_session):
    """The session's shared :class:`~einjoin.runtime.backends.ray.RayBackend` (closed at the end).
    A test may kill an actor or close it (the next run starts fresh ones) but restores any
    setting it changes (``kernel_delay``, ``retries``)."""
    from einjoin.runtime.backends.ray import RayBackend
    backend = RayBackend(quiet=True)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def split_small_sparse_steps():  # type: ignore[no-untyped-def]
    """Small sparse problems split over the devices anyway: since 1f4e2eb MIN_SPLIT_WORK keeps a
    step below 1e7 multiply-adds on device 0, and a test's devices= would check one device only
    (``pytestmark = pytest.mark.usefixtures("split_small_sparse_steps")``)."""
    from einjoin.sparse import distribute
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(distribute, "MIN_SPLIT_WORK", 0.0)
        yield
