"""Root pytest configuration: it applies to the doctests under einjoin/ as well as to tests/.

torch computes the tests' references on one thread: under ``pytest -n 2`` on two cores its
default (one OpenMP thread per core, in each worker) oversubscribes the cores and its threads
wait for each other, spinning: a small LLaMA's ten torch training steps took 3.7 s instead of
0.2 s, the Trainer tests half the suite's time. einjoin's kernels are numpy's (their BLAS
limits are the runtime's own), so what the tests check is unchanged."""

import os
import resource
import time

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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup``: the ``@group`` suffix that sends every test of an ``xdist_group`` (the
    Ray tests: one Ray cluster, tests/conftest.py) to one worker. pytest-xdist 3.8 sets it as
    ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``item._id``): without this
    the Ray tests were spread over both workers and each started its own cluster."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under loadgroup
        return
    from _pytest.nodeid import NodeId
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        nodeid = item.nodeid
        if names and nodeid.rfind("@") <= nodeid.rfind("]"):  # not suffixed by xdist already
            item._id = NodeId.parse(f"{nodeid}@{'_'.join(names)}")


# ---- EINJOIN_TEST_CPU=PREFIX: each test's CPU seconds, one file per process (PREFIX.gw0.tsv, ...)
# On a shared machine wall durations (--durations) measure the neighbours' load as much as the
# test: a 0.6 s-CPU test took 170 s of wall time in one loaded run. This writes, per test (setup,
# call and teardown), the process's CPU seconds (every thread), those of the child processes it
# waited for (a fresh-process test's interpreter) and the wall seconds, tab-separated:
#   EINJOIN_TEST_CPU=/tmp/cpu .venv/bin/python -m pytest -n 2 -q
#   sort -t$'\t' -k2 -nr /tmp/cpu.*.tsv | head
_CPU_PREFIX = os.environ.get("EINJOIN_TEST_CPU")
_cpu_rows: list[str] = []
_cpu_start: dict[str, tuple[float, float, float]] = {}


def _cpu_now() -> tuple[float, float, float]:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, time.perf_counter()


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _CPU_PREFIX:
        _cpu_start[nodeid] = _cpu_now()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    start = _cpu_start.pop(nodeid, None)
    if start is not None:
        end = _cpu_now()
        _cpu_rows.append(f"{nodeid}\t{end[0] - start[0]:.3f}\t{end[1] - start[1]:.3f}\t{end[2] - start[2]:.3f}\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _CPU_PREFIX and _cpu_rows:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{_CPU_PREFIX}.{worker}.tsv", "w") as f:
            f.writelines(_cpu_rows)
