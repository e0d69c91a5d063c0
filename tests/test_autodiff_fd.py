"""Every gradient rule against central finite differences in float64, on the random graphs of
tests/graphgen.py reduced to a scalar by a random-weight contraction; a hit counter checks at
the end that every node kind and every join and aggregation graphgen draws was differentiated."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.autodiff import GRAD_RULES, RULE_HITS
from einjoin.autodiff.einsum_rule import JOIN_HITS
from einjoin.ir import Graph, ops
from einjoin.ir.node import KINDS, rule_for
from einjoin.ir.scalar import parse_join

from budget import examples
from graphgen import AGGS, JOINS, LABELS, graphs

HITS: Counter[str] = Counter()  # what the examples of this file reached (kinds, joins, aggs)
EPS = 1e-5


def _scalar(outs, rng):
    """sum_k <out_k, r_k> with random weights r_k fed as inputs: every output element matters."""
    loss = None
    feeds = {}
    for k, y in enumerate(outs):
        if y.dtype != "float64":
            continue
        r = ej.input(f"fd_r{k}", y.shape, "float64")
        feeds[f"fd_r{k}"] = rng.normal(size=y.shape)
        ls = LABELS[:y.ndim]
        term = ej.einsum(f"{ls},{ls}->", y, r)
        loss = term if loss is None else loss + term
    return loss, feeds


def _value(loss, feeds):
    return float(ej.reference(loss, **feeds))


@settings(max_examples=examples(600), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
@given(g=graphs(dtype="float64"), seed=st.integers(0, 2**31 - 1))
def _random_graphs_match_central_differences(g, seed):
    outs, feeds = g
    rng = np.random.default_rng(seed)
    loss, rfeeds = _scalar(outs, rng)
    assume(loss is not None)
    feeds = dict(feeds, **rfeeds)
    wrt = [x for x in Graph([loss.node]).inputs if x.dtype == "float64" and not x.op.name.startswith("fd_r")]
    assume(wrt)
    before_kinds, before_joins = Counter(RULE_HITS), dict(JOIN_HITS)
    grads = ej.grad(loss, [ej.Tensor(x) for x in wrt])
    for k, v in RULE_HITS.items():
        HITS[f"kind:{k}"] += v - before_kinds.get(k, 0)
    for k, v in JOIN_HITS.items():
        HITS[k] += v - before_joins.get(k, 0)
    for x, d in zip(wrt, grads):
        assert d.shape == x.shape and d.dtype == "float64"
    used = {i.op.name for i in Graph([t.node for t in grads]).inputs}
    values = ej.reference(grads, **{k: v for k, v in feeds.items() if k in used})
    assert all(np.isfinite(v).all() for v in values)
    for _ in range(2):  # two random directions: the directional derivative both ways
        # a kink within reach (max, abs, where, relu): the two step sizes disagree; not a test of
        # the rules there (their one-sided choices follow torch and are tested in test_autodiff)
        assume(_directional(loss, feeds, wrt, values, rng))


def _directional(loss, feeds, wrt, values, rng):
    """Check <grad, v> against central differences along a random v; False (no check) when
    two step sizes disagree, i.e. a kink lies within reach."""
    dirs = {x.op.name: rng.normal(size=x.shape) for x in wrt}
    analytic = sum(float(np.sum(v * dirs[x.op.name])) for x, v in zip(wrt, values))

    def fd(eps):
        plus = dict(feeds, **{n: feeds[n] + eps * d for n, d in dirs.items()})
        minus = dict(feeds, **{n: feeds[n] - eps * d for n, d in dirs.items()})
        return (_value(loss, plus) - _value(loss, minus)) / (2 * eps)

    f1, f2 = fd(EPS), fd(EPS / 4)
    scale = 1.0 + abs(analytic) + sum(float(np.sum(np.abs(v * dirs[x.op.name])))
                                     for x, v in zip(wrt, values))
    if abs(f1 - f2) > 1e-6 * scale:
        return False
    assert abs(analytic - f2) <= 1e-6 * scale, (analytic, f1, f2, str(loss))
    return True


def _check_fd(loss, feeds, wrt, rng):
    grads = ej.grad(loss, [ej.Tensor(x) for x in wrt])
    used = {i.op.name for i in Graph([t.node for t in grads]).inputs}
    values = ej.reference(grads, **{k: v for k, v in feeds.items() if k in used})
    return _directional(loss, feeds, wrt, values, rng)


EQUATIONS = {1: ["ij->i", "ii->i", "ij->ji"], 2: ["ij,jk->ik", "ij,ij->j", "ij,kj->ijk"],
             3: ["ij,jk,ik->i", "ij,ij,kj->j", "ij,jk,k->ik"]}


def _sweep_joins_and_aggs(n):
    """Each join of graphgen.JOINS under each aggregation, on einsums with contracted,
    repeated and summed-away labels: a deterministic sweep (the random graphs may miss one)."""
    rng = np.random.default_rng(n)
    sizes = {"i": 3, "j": 3, "k": 2}
    checked = 0
    for join in JOINS[n]:
        for agg in AGGS:
            for eq in EQUATIONS[n]:
                terms = eq.split("->")[0]
                xs, feeds = [], {}
                for t, term in enumerate(terms.split(",")):
                    shape = tuple(sizes[c] for c in term)
                    xs.append(ej.input(f"sw{n}_{t}", shape, "float64"))
                    feeds[f"sw{n}_{t}"] = rng.uniform(-1, 1, shape)
                y = ej.einsum(eq, *xs, join=join, agg=agg)  # an output of every label: agg none
                loss, rfeeds = _scalar([y], rng)
                before = dict(JOIN_HITS)
                checked += _check_fd(loss, dict(feeds, **rfeeds), [x.node for x in xs], rng)
                for k, v in JOIN_HITS.items():
                    HITS[k] += v - before.get(k, 0)
    assert checked > 0.8 * len(JOINS[n]) * len(AGGS) * len(EQUATIONS[n])


def test_leaf_rules_have_no_inputs():
    fill = ops.fill_node((2, 3), "float64", "x0 * 0.5")
    x = ops.input_node("x", (2, 3), "float64")
    g = ops.fill_node((2, 3), "float64", 1.0)
    for node in (fill, x):
        assert rule_for(GRAD_RULES, node.op, "GRAD_RULES")(node, g, ()) == ()
    assert set(GRAD_RULES) == set(KINDS)


def test_every_rule_matches_central_differences_and_every_kind_join_and_agg_is_reached():
    """The property test on graphgen's random graphs, then the deterministic sweep of every join
    under every aggregation, in one test (so that the reach check below never depends on which
    xdist worker ran what): every node kind graphgen draws that carries a gradient (a fill is a
    constant: it never receives one), every join of graphgen.JOINS (and the bounded joins it
    swaps in under prod) and every aggregation must have been differentiated."""
    HITS.clear()
    _random_graphs_match_central_differences()
    for n in (1, 2, 3):
        _sweep_joins_and_aggs(n)
    kinds = {"Input", "Einsum", "Reshape", "Select", "Concat", "Broadcast", "Gather", "ScatterAdd"}
    joins = {str(parse_join(j, n)) for n, js in JOINS.items() for j in js}
    joins |= {"sigmoid(x0)", "exp(-abs(x0 - x1))", "exp(-abs(x0 * x1 * x2))"}
    wanted = {f"kind:{k}" for k in kinds} | {f"join:{j}" for j in joins} | {f"agg:{a}" for a in AGGS}
    missing = sorted(wanted - {k for k, v in HITS.items() if v > 0})
    assert not missing, f"never differentiated: {missing}"
