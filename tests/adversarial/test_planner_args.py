"""Issue 16, planner part: device counts at scale, hostile clusters, junk from planners.

- A cluster's memory grows linearly in its devices (a uniform one no longer stores two n x n
  tuples of tuples), and so does a whole compile's (tracemalloc peaks at two device counts).
- Device counts beyond ``einjoin.cluster.MAX_DEVICES`` are refused up front, naming the count
  and the maximum; 0, negatives, floats, strings, bools, None -> an EinjoinError naming the
  argument; numpy ints are counts.
- A planner that returns junk (None, a list, specs for nodes not in the graph, specs of the wrong
  type or invalid for the node) or raises -> an EinjoinError naming the planner and what is wrong.
- The greedy placer's fast path (a heap of loads, scores only for devices holding something)
  and nums' (maxima from short top lists, not copies of three P-long lists per device) place
  every kernel where the straightforward rules do.
"""

from __future__ import annotations

import math
import tracemalloc
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.cluster import MAX_DEVICES, LinkMatrix
from einjoin.decomp.decompose import decompose
from einjoin.decomp.spec import JoinAggSpec
from einjoin.ir.dtypes import itemsize
from einjoin.planner import PLANNERS, plan_specs
from einjoin.placement import PLACERS, affinity
from budget import examples
from graphgen import graphs, specs_for


def _peak(fn: Callable[[], Any]) -> int:
    """Peak bytes traced while ``fn`` runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------- memory at scale


@pytest.mark.parametrize("make", [
    pytest.param(lambda n: ej.local(n), id="local"),
    pytest.param(lambda n: ej.Cluster.islands([n // 2, n // 2], 300e9, 25e9), id="islands"),
    pytest.param(lambda n: ej.local(n).with_memory("1GiB"), id="with_memory"),
])
def test_cluster_memory_grows_linearly_in_devices(make: Callable[[int], ej.Cluster]) -> None:
    """4x the devices may take at most 4x the memory (x1.5 slack); two dense n x n matrices of
    floats took 16x (8 MB per matrix at 1024 devices, 1.3 GB at 10_000)."""
    small, big = _peak(lambda: make(512)), _peak(lambda: make(2048))
    assert big <= 4 * 1.5 * small, (small, big)


def test_compile_memory_grows_linearly_in_devices() -> None:
    """The whole compile (cluster, planner, placement, exchange, task graph) at 128 and 512
    devices: a plan of the same shape (every op cut into P blocks) takes at most ~4x the memory."""
    x, w = ej.input("x", (4096, 64)), ej.input("w", (64, 64))
    z = ej.relu(x @ w)
    ej.compile(z, devices=4, backend="null", quiet=True, planner="split_largest")  # imports, caches

    def run(n: int) -> None:
        prog = ej.compile(z, devices=n, backend="null", quiet=True, planner="split_largest")
        assert prog.decomps[z.node].spec.num_kernels == n  # the same shape of plan at both counts

    small, big = _peak(lambda: run(128)), _peak(lambda: run(512))
    assert big <= 4 * 1.5 * small, (small, big)


def test_link_matrix_reads_like_the_dense_matrix() -> None:
    c = ej.Cluster.islands([2, 3], intra=300e9, inter=25e9, intra_latency=1e-6, inter_latency=3e-5)
    group = [0, 0, 1, 1, 1]
    dense_bw = tuple(tuple(math.inf if i == j else 300e9 if group[i] == group[j] else 25e9
                           for j in range(5)) for i in range(5))
    assert isinstance(c.bandwidth, LinkMatrix)
    assert [tuple(r) for r in c.bandwidth] == list(dense_bw)
    assert c.bandwidth == dense_bw and c.bandwidth[-1][1:3] == dense_bw[-1][1:3]
    assert c.bandwidth[4][0] == c.bandwidth[-1][-5] == 25e9
    with pytest.raises(IndexError):
        c.bandwidth[5]
    # a cluster given the same matrices densely is equal, and prices transfers alike
    dense = ej.Cluster(c.devices, [list(r) for r in dense_bw], [list(r) for r in c.latency])
    assert dense == c and hash(dense) == hash(c)
    assert all(dense.transfer_time(i, j, 1 << 20) == c.transfer_time(i, j, 1 << 20)
               for i in range(5) for j in range(5))


# ---------------------------------------------------------------- device counts


def test_device_counts_beyond_the_maximum_are_refused_up_front() -> None:
    x = ej.input("x", (8, 4))
    huge = [MAX_DEVICES + 1, 10_000, 10**6, 10**12]
    calls: list[Callable[[int], Any]] = [
        ej.local, ej.Cluster.uniform,
        lambda n: ej.compile(x + 1, devices=n, backend="null", quiet=True),
        lambda n: ej.Cluster.islands([n - 1, 1], 1e9, 1e8),
    ]
    for call in calls:
        for n in huge:
            with pytest.raises(ej.EinjoinError, match=rf"{n}.*at most {MAX_DEVICES} devices"):
                call(n)
    devs = tuple(ej.Device(i) for i in range(MAX_DEVICES + 1))
    with pytest.raises(ej.EinjoinError, match=rf"{MAX_DEVICES + 1}.*at most {MAX_DEVICES}"):
        ej.Cluster(devs, LinkMatrix((0,) * len(devs), math.inf, 1e9, 1e9),
                   LinkMatrix((0,) * len(devs), 0.0, 0.0, 0.0))
    assert ej.local(MAX_DEVICES).size == MAX_DEVICES  # the maximum itself is a cluster


HOSTILE_COUNTS = [0, -1, -(10**30), 2.0, 1.5, math.nan, math.inf, "4", b"4", True, False, None,
                  [2], (2,), {"n": 2}, 2 + 0j, np.float64(2.0), np.array([2, 3]), object()]


# stable ids: xdist workers compare them
@pytest.mark.parametrize("n", HOSTILE_COUNTS, ids=lambda v: "object" if type(v) is object else repr(v))
@pytest.mark.parametrize("call", [
    pytest.param(lambda n: ej.local(n), id="local"),
    pytest.param(lambda n: ej.Cluster.uniform(n), id="uniform"),
    pytest.param(lambda n: ej.compile(ej.input("x", (8,)) + 1, devices=n, backend="null", quiet=True),
                 id="compile"),
])
def test_hostile_device_counts_get_a_clear_error(call: Callable[[Any], Any], n: Any) -> None:
    with pytest.raises(ej.EinjoinError, match="devices"):
        call(n)


def test_numpy_ints_are_device_counts_and_sizes() -> None:
    assert ej.local(np.int64(3)).size == 3
    assert ej.local(2, np.int32(1 << 20)).devices[0].memory == 1 << 20
    prog = ej.compile(ej.input("x", (8,)) + 1, devices=np.int16(2), backend="null", quiet=True)
    assert prog.cluster.size == 2


def test_whole_float_memory_sizes_are_bytes() -> None:
    assert ej.local(2, 2.5e9).devices[0].memory == 2_500_000_000  # as people write sizes
    assert ej.local(2, np.float32(2**20)).devices[1].memory == 2**20


@pytest.mark.parametrize("make, what", [
    (lambda: ej.Cluster([None], ((math.inf,),), ((0.0,),)), "ej.Device"),
    (lambda: ej.Cluster(None, ((math.inf,),), ((0.0,),)), "devices"),
    (lambda: ej.Cluster((ej.Device(0),), "fast", ((0.0,),)), "bandwidth"),
    (lambda: ej.Cluster((ej.Device(0),), ((math.inf,),), None), "latency"),
    (lambda: ej.Cluster((ej.Device(0), ej.Device(1)), ((0, "x"), (1, 0)), ((0, 0), (0, 0))), "bandwidth"),
    (lambda: ej.Cluster((ej.Device(0), ej.Device(1)), ((0, 1), (1, 0)), ((0, 0), (-1, 0))), "latency"),
    (lambda: ej.Cluster((ej.Device(1),), ((math.inf,),), ((0.0,),)), "device ids"),
    (lambda: ej.Cluster.uniform(2, bandwidth=10**400), "bandwidth"),
    (lambda: ej.Cluster.uniform(2, bandwidth="fast"), "bandwidth"),
    (lambda: ej.Cluster.uniform(2, bandwidth=-1.0), "bandwidth"),
    (lambda: ej.Cluster.uniform(2, bandwidth=math.nan), "bandwidth"),
    (lambda: ej.Cluster.uniform(2, latency=-1e-6), "latency"),
    (lambda: LinkMatrix(3, 0.0, 1e9, 1e9), "groups"),
    (lambda: LinkMatrix((0, 0), "x", 1e9, 1e9), "link value"),
    (lambda: ej.Cluster.islands(3, 1e9, 1e8), "islands sizes"),
    (lambda: ej.Cluster.islands([2, 0], 1e9, 1e8), "islands sizes"),
    (lambda: ej.Cluster.islands([2, 2.5], 1e9, 1e8), "islands sizes"),
    (lambda: ej.Cluster.islands([2, 2], "fast", 1e8), "bandwidth"),
    (lambda: ej.local(2, 10**400), "memory size"),
    (lambda: ej.local(2, "1e400GB"), "memory size"),
    (lambda: ej.local(2, 2.5), "memory size"),          # a fraction of a byte (2.5e9 is 2.5 GB)
    (lambda: ej.local(2, float("inf")), "memory size"),
    (lambda: ej.local(2, -1e9), "memory size"),
    (lambda: ej.Device("a"), "Device id"),
    (lambda: ej.Device(-1), "Device id"),
    (lambda: ej.Device(0, kind=3), "Device kind"),
    (lambda: ej.Device(0, memory=-5), "memory size"),
    (lambda: ej.Device(0, node=7), "Device node"),
    (lambda: ej.compile(ej.input("x", (8,)) + 1, 2, memory_limit=10**400, backend="null", quiet=True),
     "memory size"),
])
def test_hostile_clusters_get_a_clear_error(make: Callable[[], Any], what: str) -> None:
    with pytest.raises(ej.EinjoinError, match=what):
        make()


def test_device_memory_strings_are_bytes() -> None:
    assert ej.Device(0, memory="1KiB").memory == 1024
    assert ej.Cluster.uniform(2, memory="2 MB").devices[1].memory == 2 * 10**6


# ---------------------------------------------------------------- junk from planners


def _graph() -> tuple[ej.Tensor, ej.Tensor, ej.Graph]:
    x, w = ej.input("x", (8, 4), "float64"), ej.input("w", (4, 6), "float64")
    mm = x @ w
    z = ej.relu(mm)
    return mm, z, ej.Graph(z)


def _junk_planners() -> list[tuple[str, Callable[..., Any], str]]:
    mm, z, _ = _graph()
    stranger = ej.input("q", (3,)) + 1
    return [
        ("none", lambda g, c: None, "returned NoneType, not a mapping"),
        ("list", lambda g, c: [JoinAggSpec.for_node(z.node, None)], "returned list, not a mapping"),
        ("int", lambda g, c: 3, "returned int, not a mapping"),
        ("stranger-node", lambda g, c: {stranger.node: None}, "not in the graph"),
        ("name-key", lambda g, c: {"x": None}, "keyed by str 'x'"),
        ("str-spec", lambda g, c: {z.node: "ab"}, r"invalid spec for .*relu.*mapping label"),
        ("int-spec", lambda g, c: {z.node: 4}, r"invalid spec for .*relu"),
        ("unknown-label", lambda g, c: {z.node: {"zz": 2}}, r"invalid spec for .*label 'zz'"),
        ("too-many-blocks", lambda g, c: {z.node: {"a": 100}}, r"invalid spec for .*100 blocks"),
        ("other-node's-spec", lambda g, c: {z.node: JoinAggSpec.for_node(mm.node, {"m": 2})},
         r"invalid spec for .*relu"),
        ("bad-bounds", lambda g, c: {z.node: JoinAggSpec(("a", "b"), ((0, 9, 8), (0, 6)))},
         r"invalid spec for .*label 'a'.*\[0, 9, 8\]"),
        ("short-bounds", lambda g, c: {z.node: JoinAggSpec(("a", "b"), ((0, 8),))},
         r"invalid spec for .*relu"),
        ("junk-bounds", lambda g, c: {z.node: JoinAggSpec(("a", "b"), (None, (0, 6)))},
         r"invalid spec for .*label 'a'"),
        ("raises", lambda g, c: {}["missing"], r"failed: KeyError"),
    ]


@pytest.mark.parametrize("case", _junk_planners(), ids=lambda c: c[0])
def test_planner_returning_junk_is_named(case: tuple[str, Callable[..., Any], str]) -> None:
    _, planner, wrong = case

    def my_planner(graph: ej.Graph, cluster: ej.Cluster) -> Any:
        return planner(graph, cluster)

    _, z, g = _graph()
    with pytest.raises(ej.EinjoinError, match=rf"planner .*my_planner.* {wrong}"):
        plan_specs(my_planner, g, ej.local(2))
    with pytest.raises(ej.EinjoinError, match=rf"planner .*my_planner.* {wrong}"):
        ej.compile(z, devices=2, planner=my_planner, backend="null", quiet=True)


def test_registered_planner_returning_junk_is_named() -> None:
    _, z, g = _graph()
    PLANNERS["junk_for_test"] = lambda graph, cluster: None
    try:
        with pytest.raises(ej.EinjoinError, match="planner 'junk_for_test' returned NoneType"):
            ej.compile(z, devices=2, planner="junk_for_test", backend="null", quiet=True)
    finally:
        del PLANNERS["junk_for_test"]


@pytest.mark.parametrize("planner", [[1], {"a": 1}, np.array([1, 2]), 3, None, "nope"], ids=repr)
def test_unknown_planner_or_placement_is_named(planner: Any) -> None:
    _, z, g = _graph()
    with pytest.raises(ej.EinjoinError, match="unknown planner"):
        plan_specs(planner, g, ej.local(2))
    with pytest.raises(ej.EinjoinError, match="unknown planner"):
        ej.compile(z, devices=2, planner=planner, backend="null", quiet=True)
    with pytest.raises(ej.EinjoinError, match="unknown placement"):
        ej.compile(z, devices=2, placement=planner, backend="null", quiet=True)


def test_good_planner_results_are_kept() -> None:
    """Tensors as keys, counts in label order, None and ops left out are all fine, and what the
    planner chose is what compiles."""
    mm, z, g = _graph()
    x = next(n for n in g.inputs if n.op.name == "x")

    def planner(graph: ej.Graph, cluster: ej.Cluster) -> dict:
        return {mm: {"m": 2, "k": [0, 1, 4]}, z.node: [4, 1], x: None}

    prog = ej.compile(z, devices=2, planner=planner, backend="null", quiet=True)
    assert prog.decomps[mm.node].spec == JoinAggSpec.for_node(mm.node, {"m": 2, "k": [0, 1, 4]})
    assert prog.decomps[z.node].spec.counts() == {"a": 4, "b": 1}
    feeds = {"x": np.arange(32.0).reshape(8, 4), "w": np.ones((4, 6))}
    out = ej.compile(z, devices=2, planner=planner, quiet=True).run(**feeds)
    np.testing.assert_allclose(out, np.maximum(feeds["x"] @ feeds["w"], 0))


_JUNK = st.deferred(lambda: st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=3),
    st.lists(_JUNK, max_size=3), st.tuples(_JUNK, _JUNK),
    st.dictionaries(st.sampled_from(["a", "b", "m", "k", "n", "zz"]), _JUNK, max_size=3)))


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_planner_result_is_a_plan_or_a_named_error(data: st.DataObject) -> None:
    """Hypothesis: a planner returning anything (junk keys, junk specs, real nodes with junk
    specs) either compiles to the right numbers or raises an EinjoinError naming it."""
    mm, z, g = _graph()
    hashable = st.one_of(st.booleans(), st.integers(), st.floats(), st.text(max_size=3),
                         st.tuples(st.integers(), st.text(max_size=2)))
    keys = st.one_of(st.sampled_from(list(g.nodes) + [mm, z]), hashable)
    result = data.draw(st.one_of(_JUNK, st.dictionaries(keys, _JUNK, max_size=3), st.dictionaries(
        st.sampled_from(list(g.nodes)), st.dictionaries(st.sampled_from(["a", "b", "m", "k", "n"]),
                                                        st.integers(-1, 9), max_size=3), max_size=3)))

    def hostile_planner(graph: ej.Graph, cluster: ej.Cluster) -> Any:
        return result

    try:
        prog = ej.compile(z, devices=2, planner=hostile_planner, quiet=True)
    except ej.EinjoinError as e:
        assert "hostile_planner" in str(e)
        return
    feeds = {"x": np.linspace(-1, 1, 32).reshape(8, 4), "w": np.linspace(-2, 2, 24).reshape(4, 6)}
    np.testing.assert_allclose(prog.run(**feeds), np.maximum(feeds["x"] @ feeds["w"], 0), rtol=1e-6)


# ---------------------------------------------------------------- the placers' fast paths


def _greedy_by_the_rule(decomps: Any, cluster: ej.Cluster, seed: int = 0) -> Any:
    """The greedy placer's rule restated the straightforward way: list the devices below the
    op's cap (all if none), drop those holding a partial of the same output block (unless none
    is left), score every one by the bytes it holds, pick (-score, load, id)."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        ok = [dv for dv in range(cl.size) if st.load[dv] < allowed.cap] or list(range(cl.size))
        fresh = [dv for dv in ok if dv not in allowed.taken] or ok
        score = {dv: sum(b for _, _, b, held in pieces if dv in held) for dv in fresh}
        return min(fresh, key=lambda dv: (-score[dv], st.load[dv], dv))
    return affinity._place(decomps, cluster, choose)


def _nums_by_the_rule(decomps: Any, cluster: ej.Cluster, seed: int = 0) -> Any:
    """NumS' objective restated the straightforward way: for every allowed device, copy the
    per-device bytes, add what placing the kernel there moves and holds, take the maxima."""
    def choose(node, d, k, pieces, allowed, st, cl):  # type: ignore[no-untyped-def]
        out_bytes = math.prod(b - a for a, b in d.out_partition.box(k.out_key)) * itemsize(node.dtype)
        best, best_dev = None, None
        for dv in allowed.devices():
            moves = [(min(held), b) for _, _, b, held in pieces if held and dv not in held]
            mem, nin, nout = list(st.mem), list(st.net_in), list(st.net_out)
            mem[dv] += out_bytes + sum(b for _, b in moves)
            for src, b in moves:
                nin[dv] += b
                nout[src] += b
            obj = (max(mem) + max(nin) + max(nout), st.load[dv], dv)
            if best is None or obj < best:
                best, best_dev = obj, dv
        for _, _, b, held in pieces:
            if held and best_dev not in held:
                st.net_in[best_dev] += b
                st.net_out[min(held)] += b
                st.mem[best_dev] += b
        st.mem[best_dev] += out_bytes
        return best_dev
    return affinity._place(decomps, cluster, choose)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fast_placers_place_as_their_rules_say(data: st.DataObject) -> None:
    outs, _ = data.draw(graphs(max_dim=6))
    specs = data.draw(specs_for(outs))
    g = ej.Graph(outs)
    decomps = {n: decompose(n, specs.get(n)) for n in g.nodes}
    p = data.draw(st.sampled_from([1, 2, 3, 5, 8]))
    cluster = ej.local(p) if p < 3 or data.draw(st.booleans()) else ej.Cluster.islands([p - 2, 2], 1e10, 1e9)
    for name, rule in (("greedy", _greedy_by_the_rule), ("nums", _nums_by_the_rule)):
        fast, slow = PLACERS[name](decomps, cluster), rule(decomps, cluster)
        assert {n: (v.kernel_devices, v.homes) for n, v in fast.items()} == \
            {n: (v.kernel_devices, v.homes) for n, v in slow.items()}, name


def test_fast_placers_on_many_devices() -> None:
    """The eindecomp plan of a matmul chain on 24 and 64 devices (many partials per block,
    replicated operands) and a sum cut into 4P partials: the same placement as the rules."""
    for p in (24, 64):
        x, w, v = ej.input("x", (512, 256)), ej.input("w", (256, 128)), ej.input("v", (128, 64))
        z = ej.softmax(ej.relu(x @ w) @ v)
        g = ej.Graph(z)
        specs = plan_specs("auto", g, ej.local(p))
        decomps = {n: decompose(n, specs.get(n)) for n in g.nodes}
        # and a sum cut into 4P partials of one block (more partials than devices)
        total = ej.einsum("ij->", ej.input("y", (8 * p, 3)))
        decomps.update((n, decompose(n, {"i": 4 * p, "j": 3} if n is total.node else None))
                       for n in ej.Graph(total).nodes)
        for name, rule in (("greedy", _greedy_by_the_rule), ("nums", _nums_by_the_rule)):
            fast, slow = PLACERS[name](decomps, ej.local(p)), rule(decomps, ej.local(p))
            assert {n: v.kernel_devices for n, v in fast.items()} == \
                {n: v.kernel_devices for n, v in slow.items()}, (name, p)
