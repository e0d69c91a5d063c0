"""Fusing elementwise chains (einjoin.ir.fuse, ``ej.compile(..., fuse=True)``, the default):
the fused graph's reference values equal the graph's as written bit for bit; compiled programs
with and without fusion agree with ej.reference on random graphs (tests/graphgen.py) and their
gradient graphs, on 1-3 devices; what must not be fused is not (half-precision producers, values
read twice, outputs, products); state and specs follow the fused graph."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.ir import Graph
from einjoin.ir.fuse import fuse_elementwise
from einjoin.ir.ops import broadcast_node, einsum_node
from budget import examples
from graphgen import graphs

FAST = settings(max_examples=examples(40), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def _tensors(nodes: list[Any]) -> list[ej.Tensor]:
    return [ej.Tensor(n) for n in nodes]


def _equal(a: Any, b: Any) -> None:
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(x, y)


def _close(got: Any, want: Any, rtol: float) -> None:
    for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        y = np.asarray(y)
        scale = max(1.0, float(np.abs(y[np.isfinite(y)]).max())) if y.size and np.isfinite(y).any() else 1.0
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale)


@st.composite
def chains(draw: Any) -> tuple[list[ej.Tensor], dict[str, np.ndarray]]:
    """Elementwise chains with broadcasts, transposes, shared values and a contraction or a
    reduction now and then, in float32 / float64 / bfloat16 (the half chains must stay unfused)."""
    dtype = draw(st.sampled_from(["float32", "float64", "bfloat16", "float32"]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    a, b, c = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    feeds = {"x": rng.uniform(-1, 1, (a, b)), "y": rng.uniform(-1, 1, (b,)), "z": rng.uniform(-1, 1, (b, c))}
    x, y, z = (ej.input(k, v.shape, dtype) for k, v in feeds.items())
    pool = [x, y, x.T.T]
    for _ in range(draw(st.integers(1, 7))):
        u = draw(st.sampled_from(pool))
        v = draw(st.sampled_from([t for t in pool if t.ndim <= u.ndim] or [u]))
        step = draw(st.sampled_from(["exp", "tanh", "sigmoid", "silu", "add", "mul", "sub", "div", "scale",
                                     "max", "where", "transpose", "sum", "matmul"]))
        try:
            if step in ("exp", "tanh", "sigmoid", "silu"):
                t = getattr(ej, step)(u * 0.5)
            elif step == "scale":
                t = u * 0.25 + 1.0
            elif step == "div":
                t = u / (v * v + 1.0)
            elif step == "max":
                t = ej.maximum(u, v)
            elif step == "where":
                t = ej.where(u > v, u, v * 2.0)
            elif step == "transpose":
                t = u.T if u.ndim == 2 else -u
            elif step == "sum":
                t = u.sum(0) if u.ndim == 2 and u.shape[1] == b else u
            elif step == "matmul":
                t = u @ z if u.ndim == 2 and u.shape[1] == b else u
            else:
                t = {"add": u + v, "mul": u * v, "sub": u - v}[step]
        except ej.EinjoinError:  # shapes that do not broadcast (after a transpose)
            continue
        pool.append(t)
    outs = [pool[-1]]
    if draw(st.booleans()) and len(pool) > 4:
        outs.append(pool[draw(st.integers(3, len(pool) - 2))])  # an intermediate is also returned
    return outs, feeds  # float64 values, cast to the inputs' dtypes by _feed


def _feed(outs: list[ej.Tensor], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from einjoin.ir.dtypes import numpy_dtype
    ins = {n.op.name: n for n in Graph(outs).inputs}
    return {k: np.asarray(v).astype(numpy_dtype(ins[k].dtype)) for k, v in feeds.items() if k in ins}


@FAST
@given(chains())
def test_fused_chains_have_the_reference_values_bit_for_bit(case: tuple[list[ej.Tensor], dict[str, Any]]) -> None:
    outs, feeds = case
    feeds = _feed(outs, feeds)
    nodes = [t.node for t in outs]
    fused = fuse_elementwise(nodes)
    assert len(Graph(fused).nodes) <= len(Graph(nodes).nodes)
    assert fuse_elementwise(fused) == fused  # idempotent
    for f, n in zip(fused, nodes):
        assert (f.shape, f.dtype) == (n.shape, n.dtype)
    _equal(ej.reference(_tensors(fused), **feeds), ej.reference(outs, **feeds))
    # a half-precision einsum is never inlined into its reader: as many of them as before
    def halves(ns: list[Any]) -> int:
        return sum(n.kind == "einsum" and n.dtype == "bfloat16" for n in Graph(ns).nodes)
    assert halves(fused) == halves(nodes)


@FAST
@given(graphs(dtype="float64"), st.sampled_from([1, 2, 3]))
def test_random_graphs_compile_the_same_with_and_without_fusion(case: Any, devices: int) -> None:
    outs, feeds = case
    want = ej.reference(outs, **feeds)
    _equal(ej.reference(_tensors(fuse_elementwise([t.node for t in outs])), **feeds), want)
    for fuse in (True, False):
        prog = ej.compile(outs, devices=devices, backend="sync", quiet=True, fuse=fuse)
        got = prog.run(**feeds)
        _close(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), 1e-9)
        assert prog.run_stats.bytes_moved == prog.stats.bytes_moved


@FAST
@given(graphs(dtype="float64"), st.sampled_from([1, 2, 3]), st.integers(0, 2 ** 31))
def test_gradient_graphs_compile_the_same_with_and_without_fusion(case: Any, devices: int, seed: int) -> None:
    outs, feeds = case
    out = outs[0]
    assume(out.dtype == "float64")
    wrt = [x for x in Graph([out.node]).inputs if x.dtype == "float64"]
    assume(wrt)
    r = np.random.default_rng(seed).uniform(-1, 1, out.shape)
    loss = (out * ej.input("r", out.shape, "float64")).sum()
    grads = ej.grad(loss, _tensors(wrt))
    feeds = dict(feeds, r=r)
    used = {n.op.name for n in Graph([loss, *grads]).inputs}
    feeds = {k: v for k, v in feeds.items() if k in used}
    want = ej.reference([loss, *grads], **feeds)
    _equal(ej.reference(_tensors(fuse_elementwise([t.node for t in [loss, *grads]])), **feeds), want)
    got = ej.compile([loss, *grads], devices=devices, backend="threads", quiet=True).run(**feeds)
    _close(got, want, 1e-9)


def test_what_is_fused_and_what_is_not() -> None:
    x = ej.input("x", (8, 16))
    b = ej.input("b", (16,))
    h = ej.tanh(x * 2.0 + b)
    shared = ej.exp(x)
    y = (h + shared) * shared.T.T  # one node: exp(x) is one argument, read twice, computed once
    [f] = fuse_elementwise([y.node])
    assert [str(n.op.join) for n in Graph([f]).ops] == ["(tanh(x0 * 2.0 + x1) + exp(x0)) * exp(x0)"]
    feeds = {"x": np.linspace(-1, 1, 128).reshape(8, 16).astype(np.float32), "b": np.ones(16, np.float32)}
    _equal(ej.reference(ej.Tensor(f), **feeds), ej.reference(y, **feeds))
    # a value two nodes read is kept (inlining it would compute it twice) ...
    xl, bl = ej.input("xl", (64, 128)), ej.input("bl", (128,))
    hl, sl = ej.tanh(xl * 2.0 + bl), ej.exp(xl)
    f1, f2 = fuse_elementwise([(hl + sl).node, (sl * 3.0).node])
    joins = [str(n.op.join) for n in Graph([f1, f2]).ops]
    assert sorted(joins) == ["exp(x0)", "tanh(x0 * 2.0 + x1) + x2", "x0 * 3.0"], joins
    # ... unless it is at most two calls deep on a small block (<= SMALL_RECOMPUTE elements), cheaper than a
    # task of its own, or a relabelling: each elementwise reader recomputes it, with its bits
    f1, f2 = fuse_elementwise([(h + shared).node, (shared * 3.0).node])
    joins = [str(n.op.join) for n in Graph([f1, f2]).ops]
    assert sorted(joins) == ["exp(x0) * 3.0", "tanh(x0 * 2.0 + x1) + exp(x0)"], joins
    _equal(ej.reference(ej.Tensor(f1), **feeds), ej.reference(h + shared, **feeds))
    _equal(ej.reference(ej.Tensor(f2), x=feeds["x"]), ej.reference(shared * 3.0, x=feeds["x"]))
    ms = (x * 0.5 + 1e-6)  # two calls on a small block, read by two elementwise readers: recomputed
    f1, f2 = fuse_elementwise([(x * ej.rsqrt(ms)).node, (ms * ms).node])
    assert len(Graph([f1, f2]).ops) == 2, [str(n.op.join) for n in Graph([f1, f2]).ops]
    _equal(ej.reference(ej.Tensor(f1), x=feeds["x"]), ej.reference(x * ej.rsqrt(ms), x=feeds["x"]))
    deeper = ej.tanh(x * 0.5 + 1e-6)  # three calls: kept
    f1, f2 = fuse_elementwise([(x * deeper).node, (deeper * 2.0).node])
    assert len(Graph([f1, f2]).ops) == 3, [str(n.op.join) for n in Graph([f1, f2]).ops]
    tt = ej.exp(xl).T  # a transpose read twice, once by a product of two: both take it in
    f1, f2 = fuse_elementwise([(tt * tt.T.T).node, (tt + 1.0).node])
    assert [n.kind for n in Graph([f1, f2]).ops] == ["einsum"] * 3, [str(n.op.join) for n in Graph([f1, f2]).ops]
    # a broadcast that only adds dims is a relabelling: elementwise readers read its input
    r = ej.input("r", (16,))
    wide = ej.Tensor(broadcast_node(ej.exp(r).node, (8, 16), (1,)))
    [fb] = fuse_elementwise([(x * wide + wide).node])
    assert [n.kind for n in Graph([fb]).ops] == ["einsum"], [n.kind for n in Graph([fb]).ops]  # exp(r): small
    _equal(ej.reference(ej.Tensor(fb), x=feeds["x"], r=feeds["b"] * 0.5),
           ej.reference(x * wide + wide, x=feeds["x"], r=feeds["b"] * 0.5))
    # reshapes compose: a size-1 dim added then dropped is no reshape; two splits are one
    e = ej.exp(x)
    there_and_back = e.reshape(8, 1, 16).reshape(8, 16) * 2.0
    [fr] = fuse_elementwise([there_and_back.node])
    assert [n.kind for n in Graph([fr]).ops] == ["einsum"]  # exp(x) * 2.0, exp(x) being small
    _equal(ej.reference(ej.Tensor(fr), x=feeds["x"]), ej.reference(there_and_back, x=feeds["x"]))
    f_two = fuse_elementwise([e.reshape(2, 64).reshape(2, 4, 16).node])[0]
    assert f_two.kind == "reshape" and f_two.inputs[0].kind == "einsum"
    _equal(ej.reference(ej.Tensor(f_two), x=feeds["x"]), ej.reference(e.reshape(2, 4, 16), x=feeds["x"]))
    # keepdim statistics: an elementwise op between a reshape adding a size-1 dim and one
    # dropping it runs without the dim, and both reshapes go
    big = ej.input("big", (64, 128))
    stat = ej.exp((big * big).sum(1).reshape(64, 1) * 0.5)
    kept = stat.reshape(64) * 2.0 + stat.reshape(64)
    [fk] = fuse_elementwise([kept.node])
    assert not any(n.kind == "reshape" for n in Graph([fk]).ops), [n.kind for n in Graph([fk]).ops]
    xb = np.linspace(-0.1, 0.1, 64 * 128).reshape(64, 128).astype(np.float32)
    _equal(ej.reference(ej.Tensor(fk), big=xb), ej.reference(kept, big=xb))
    # a copy (an identity einsum) that is no output goes, whoever reads it
    c = ej.input("c", (8, 16))
    copy = ej.Tensor(einsum_node([c.node], ["ij"], "ij", "x0", None))
    [fr] = fuse_elementwise([copy.reshape(128).node])
    assert fr.inputs == (c.node,)
    # an output is kept as it is, even with one reader
    [f2, g2] = fuse_elementwise([h.node, (h * 3.0).node])
    assert f2 is h.node or str(f2.op.join) == "tanh(x0 * 2.0 + x1)"
    # a plain product of three stays two products (the contraction kernels multiply in any order)
    p = (x * x.T.T) * b
    [fp] = fuse_elementwise([p.node])
    assert not any(str(n.op.join) == "x0 * x1 * x2" for n in Graph([fp]).ops if n.kind == "einsum")
    # half precision: a bfloat16 result is rounded before its reader reads it
    xh = ej.input("xh", (8, 16), "bfloat16")
    yh = ej.exp(xh * 3.0) + 1.0
    [fh] = fuse_elementwise([yh.node])
    assert len(Graph([fh]).ops) == len(Graph([yh.node]).ops)


def test_compile_fuses_by_default_and_explain_shows_the_fused_expression() -> None:
    x = ej.input("x", (64, 32))
    w = ej.input("w", (32, 48))
    y = ej.silu(x @ w) * 0.5 + 1.0
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 32)).astype(np.float32),
             "w": rng.standard_normal((32, 48)).astype(np.float32)}
    fused = ej.compile(y, devices=2, backend="threads", quiet=True)
    plain = ej.compile(y, devices=2, backend="threads", quiet=True, fuse=False)
    assert len(fused.graph.ops) < len(plain.graph.ops) and len(fused.taskgraph) < len(plain.taskgraph)
    assert "silu(x0) * 0.5 + 1.0" in fused.explain(file=None)
    np.testing.assert_array_equal(fused.run(**feeds), plain.run(**feeds))  # the same blocks, the same values
    with pytest.raises(ej.EinjoinError, match="fuse"):
        ej.compile(y, devices=2, fuse="yes")  # type: ignore[arg-type]


def test_specs_and_state_follow_the_fused_graph() -> None:
    x = ej.input("x", (16, 8), "float64")
    w = ej.input("w", (8, 8), "float64")
    w_new = ej.tanh(w * 0.5) * 0.5 + w * 0.0  # a fused new value of a state input
    loss = (ej.tanh((x @ w) * 2.0) + 1.0).sum()
    rng = np.random.default_rng(1)
    xs, ws = rng.standard_normal((16, 8)), rng.standard_normal((8, 8))
    prog = ej.compile([loss], devices=2, backend="sync", quiet=True, state={w_new: w})
    ref = ej.compile([loss], devices=2, backend="sync", quiet=True, state={w_new: w}, fuse=False)
    for _ in range(2):
        a, b = prog.run(x=xs, w=ws) if not prog.has_state() else prog.run(x=xs), \
            ref.run(x=xs, w=ws) if not ref.has_state() else ref.run(x=xs)
        np.testing.assert_allclose(a, b, rtol=1e-12)
    np.testing.assert_allclose(prog.read_state()["w"], ref.read_state()["w"], rtol=1e-12)
    # a fused program's specs compile again; specs of the graph as written turn fusion off
    first = ej.compile(loss, devices=2, backend="null", quiet=True)
    again = ej.compile(loss, devices=2, specs=first.specs, backend="null", quiet=True)
    assert len(again.graph.ops) == len(first.graph.ops) < len(Graph([loss]).ops)
    assert again.stats.bytes_moved == first.stats.bytes_moved
    h = ej.exp(x * 2.0)
    y = h + 1.0  # fusing would replace h: the graph is compiled as written
    lab = h.node.op.out_labels[0]
    prog = ej.compile(y, devices=2, specs={h: {lab: 2}}, backend="null", quiet=True)
    assert h.node in prog.graph.nodes and prog.specs[h.node].blocks(lab) == 2 if hasattr(
        prog.specs[h.node], "blocks") else h.node in prog.graph.nodes


def test_silu_of_a_fused_zero_d_value_has_the_unfused_bits() -> None:
    """A 0-d sub-expression inside a fused join comes back from numpy as a numpy scalar, not a
    0-d array: silu computed it as x * expit(x) there and as x / (1 + exp(-x)) on arrays, 1 ulp
    apart on ~1 input in 4 (hypothesis found silu(x0 * 2.0) on a float64[] input)."""
    x = ej.input("x", (), "float64")
    y = ej.silu(x * 2.0) + ej.silu(ej.input("v", (3,), "float64") * 2.0).sum()
    f = ej.Tensor(fuse_elementwise([y.node])[0])
    assert len(Graph([f.node]).ops) < len(Graph([y.node]).ops)
    for v in np.random.default_rng(0).normal(size=(64, 4)):
        feeds = {"x": np.array(v[0]), "v": v[1:]}
        _equal(ej.reference(f, **feeds), ej.reference(y, **feeds))


@FAST
@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.integers(0, 2 ** 31), st.sampled_from([1, 2]))
def test_broadcast_of_an_unsqueezing_reshape_is_one_broadcast(dims: list[int], seed: int, devices: int) -> None:
    """GQA's repeat (``k[:, :, None].expand(b, h, rep, s, d)``): a broadcast of a reshape that only
    inserted size-1 dims is one broadcast of the reshape's input, the inserted dims its new dims;
    the values are the graph's as written, on reference and compiled (1 and 2 devices)."""
    rng = np.random.default_rng(seed)
    shape = tuple(dims)
    where = sorted(rng.choice(len(shape) + 1, size=int(rng.integers(1, 3)), replace=True).tolist())
    wide = list(shape)
    for k, at in enumerate(where):  # insert size-1 dims
        wide.insert(at + k, 1)
    out = tuple(int(rng.integers(2, 4)) if w == 1 else w for w in wide)  # a real broadcast
    x = ej.input("x", shape, "float64")
    b = ej.Tensor(broadcast_node(x.reshape(tuple(wide)).node, out, list(range(len(out)))))
    y = (b * 2.0).reshape((-1,))
    [f] = fuse_elementwise([y.node])
    kinds = [n.kind for n in Graph([f]).nodes]
    assert kinds.count("reshape") == 1  # only the flattening one is left
    xv = rng.standard_normal(shape)
    want = ej.reference(y, x=xv)
    _equal(ej.reference(ej.Tensor(f), x=xv), want)
    _equal(ej.compile(y, devices, backend="threads", quiet=True).run(x=xv), want)
