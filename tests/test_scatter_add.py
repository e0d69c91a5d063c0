"""scatter_add, the adjoint of gather: numpy's ``np.add.at`` semantics (duplicates accumulate,
half types in float32), construction and run-time errors, its decomposition under random specs,
planning a gradient-like graph with eindecomp, and the adjoint identity with gather."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.decomp.flops import kernel_flops
from einjoin.decomp.spec import label_sizes
from einjoin.ir import ops
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.kernels import partial_dtype
from budget import examples
from graphgen import specs_for

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = ["float16", "bfloat16", "float32", "float64", "int64"]


def scatter_add(updates: ej.Tensor, indices: ej.Tensor, rows: int) -> ej.Tensor:
    return ej.Tensor(ops.scatter_add_node(updates.node, indices.node, rows))


def np_scatter_add(u: np.ndarray, idx: np.ndarray, rows: int) -> np.ndarray:
    """numpy's np.add.at, accumulating half types in float32 (as torch's index_add)."""
    acc = np.float32 if u.dtype in (np.float16, ml_dtypes.bfloat16) else u.dtype
    out = np.zeros((rows,) + u.shape[idx.ndim:], acc)
    np.add.at(out, idx, u.astype(acc))
    return out.astype(u.dtype)


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "int64":
        return rng.integers(-50, 50, shape)
    return rng.standard_normal(shape).astype(numpy_dtype(dtype))


@st.composite
def problems(draw: st.DrawFn, dtypes: list[str] = DTYPES
             ) -> tuple[ej.Tensor, dict[str, np.ndarray], np.ndarray]:
    """(scatter_add tensor, feeds, the np.add.at answer): indices of rank 0-2 with duplicates."""
    dtype = draw(st.sampled_from(dtypes))
    ishape = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
    rest = tuple(draw(st.lists(st.integers(1, 4), max_size=2)))
    rows = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    u = ej.input("u", ishape + rest, dtype)
    i = ej.input("i", ishape, "int64")
    feeds = {"u": _values(rng, ishape + rest, dtype), "i": rng.integers(0, rows, ishape)}
    return scatter_add(u, i, rows), feeds, np_scatter_add(feeds["u"], feeds["i"], rows)


# ---------------------------------------------------------------- semantics


@settings(max_examples=examples(60), **SETTINGS)
@given(problems())
def test_reference_is_np_add_at(p: tuple[ej.Tensor, dict[str, np.ndarray], np.ndarray]) -> None:
    y, feeds, want = p
    got = ej.reference(y, **feeds)
    assert got.dtype == want.dtype and got.shape == want.shape == y.shape
    # the same additions in the same order in the same accumulation type: bitwise equal
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_types_accumulate_in_float32(dtype: str) -> None:
    # 4096 ones into one row: a float16 (bfloat16) running sum stalls at 2048 (256); float32 is
    # exact, and 4096 is a value of both half types
    u = ej.input("u", (4096, 2), dtype)
    i = ej.input("i", (4096,), "int64")
    y = scatter_add(u, i, 3)
    feeds = {"u": np.ones((4096, 2), numpy_dtype(dtype)), "i": np.zeros(4096, np.int64)}
    got = ej.reference(y, **feeds)
    assert got.dtype == numpy_dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), [[4096, 4096], [0, 0], [0, 0]])
    # the same when the tokens are cut: partials stay float32, rounded once at the end
    assert partial_dtype(y.node) == "float32"
    blocked = ej.execute_blocked(y, {y: {"a": 4, "row": 2}}, **feeds)
    np.testing.assert_array_equal(blocked.astype(np.float64), [[4096, 4096], [0, 0], [0, 0]])
    prog = ej.compile(y, devices=2, specs={y: {"a": 4, "row": 2}})
    got = prog.run(**feeds)
    assert got.dtype == numpy_dtype(dtype)
    np.testing.assert_array_equal(got.astype(np.float64), [[4096, 4096], [0, 0], [0, 0]])


def test_printed_form_and_shape() -> None:
    u = ej.input("u", (2, 5, 8))
    i = ej.input("i", (2, 5), "int64")
    y = scatter_add(u, i, 100)
    assert y.shape == (100, 8) and y.dtype == "float32"
    assert "scatter_add(u, i) : float32[100, 8]" in str(ej.Graph(y))
    # hash-consed: the same op on the same inputs is the same node
    assert scatter_add(u, i, 100).node is y.node


# ---------------------------------------------------------------- errors


def test_construction_errors_name_shapes_and_dtypes() -> None:
    u = ej.input("u", (3, 4))
    with pytest.raises(ej.DTypeError, match=r"indices must be int64, got float32 \(shape \(3,\)\)"):
        scatter_add(u, ej.input("f", (3,)), 5)
    with pytest.raises(ej.ShapeError, match=re.escape("updates of shape (3, 4) must start with the "
                                                      "indices' shape (4,)")):
        scatter_add(u, ej.input("i4", (4,), "int64"), 5)
    with pytest.raises(ej.ShapeError, match=re.escape("(3, 4)")):
        scatter_add(u, ej.input("i3", (3, 4, 1), "int64"), 5)  # more index dims than updates
    with pytest.raises(ej.DTypeError, match="bool"):
        scatter_add(ej.input("b", (3, 4), "bool"), ej.input("i", (3,), "int64"), 5)
    with pytest.raises(ej.ShapeError, match="rows must be >= 0"):
        scatter_add(u, ej.input("i", (3,), "int64"), -1)
    with pytest.raises(ej.ShapeError, match="expected an integer"):
        scatter_add(u, ej.input("i", (3,), "int64"), 2.5)  # type: ignore[arg-type]
    with pytest.raises(ej.EinjoinError, match="expected an einjoin tensor"):
        ops.scatter_add_node(np.zeros((3, 4)), ej.input("i", (3,), "int64").node, 5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [7, -1])
def test_out_of_range_index_is_a_clear_run_time_error(bad: int) -> None:
    u = ej.input("u", (4, 3))
    i = ej.input("i", (4,), "int64")
    y = scatter_add(u, i, 7)
    feeds = {"u": np.ones((4, 3), np.float32), "i": np.array([0, 1, bad, 2])}
    pattern = rf"scatter_add: index {bad} out of range for an output of 7 rows"
    with pytest.raises(ej.EinjoinError, match=pattern):
        ej.reference(y, **feeds)
    with pytest.raises(ej.EinjoinError, match=pattern):  # every block checks, whatever its rows
        ej.execute_blocked(y, {y: {"row": 2, "a": 2}}, **feeds)
    prog = ej.compile(y, devices=2, specs={y: {"row": 2}})
    with pytest.raises(ej.EinjoinError, match=pattern):
        prog.run(**feeds)


# ---------------------------------------------------------------- decomposition


@settings(max_examples=examples(80), **SETTINGS)
@given(st.data())
def test_blocked_equals_reference_under_random_specs(data: st.DataObject) -> None:
    y, feeds, want = data.draw(problems(["float32", "float64", "int64"]))
    specs = data.draw(specs_for([y]))
    got = ej.execute_blocked(y, specs, **feeds)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=examples(40), **SETTINGS)
@given(st.data())
def test_compiled_equals_reference_on_1_to_4_devices(data: st.DataObject) -> None:
    y, feeds, _ = data.draw(problems(["float64"]))
    # a consumer, so the output's partition matters downstream too
    z = ej.einsum(f"{'r' + 'abcd'[:y.ndim - 1]}->r", y, join="tanh")
    specs = data.draw(specs_for([z]))
    devices = data.draw(st.integers(1, 4))
    prog = ej.compile([y, z], devices=devices, specs=specs)
    got = prog.run(**feeds)
    want = ej.reference([y, z], **feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    assert prog.run_stats is not None and prog.run_stats.bytes_moved == prog.stats.bytes_moved


def test_decomposition_rule() -> None:
    u = ej.input("u", (4, 6, 8))
    i = ej.input("i", (4, 6), "int64")
    y = scatter_add(u, i, 10)
    # gather's names for the same tensors: the updates' dims a, b, c; the output's rows "row"
    assert label_sizes(y.node) == {"row": 10, "c": 8, "a": 4, "b": 6}
    d = ej.decompose(y.node, {"row": 2, "a": 2, "b": 3, "c": 2})
    # one kernel per (output block, index block); the index blocks are partial sums
    assert len(d.kernels) == (2 * 2) * (2 * 3)
    assert d.n_partials == 6 and d.agg.name == "sum"
    assert [str(p) for p in d.in_partitions] == ["(2, 3, 2)", "(2, 3)"]
    # cutting only row and the row shape: whole blocks, no partials
    d1 = ej.decompose(y.node, {"row": 5, "c": 4})
    assert d1.n_partials == 1 and d1.agg.name == "none"


def test_flops_are_tokens_times_hidden_not_vocab() -> None:
    # an embedding gradient: 50 000 rows, 4 x 16 tokens of 32 values — the modelled work is the
    # updates' 2048 adds, never a one-hot product over the vocabulary
    u = ej.input("u", (4, 16, 32))
    i = ej.input("i", (4, 16), "int64")
    y = scatter_add(u, i, 50_000)
    for spec in ({}, {"a": 2, "b": 2}, {"c": 4}):
        d = ej.decompose(y.node, spec)
        assert sum(kernel_flops(d, k.index) for k in d.kernels) == 4 * 16 * 32


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("ishape, rest, rows, spec", [
    ((64, 32), (128,), 500, {}), ((64, 32), (128,), 500, {"row": 2}), ((64, 32), (128,), 500, {"a": 2}),
    ((2048,), (64,), 50, {"row": 3, "a": 2}), ((2048,), (64,), 50, {"row": 3}), ((), (1000,), 5, {"row": 2})])
def test_the_footprint_bounds_what_a_kernel_allocates(dtype: str, ishape: tuple[int, ...],
                                                      rest: tuple[int, ...], rows: int,
                                                      spec: dict[str, int]) -> None:
    """The scratch the footprint estimates covers what a scatter_add block kernel allocates
    (traced by tracemalloc), as for an einsum's matmul route; a few KiB of slack."""
    import tracemalloc

    from einjoin.decomp.block_kernels import run_kernel
    from einjoin.decomp.footprint import kernel_scratch
    from einjoin.ir.dtypes import itemsize

    y = scatter_add(ej.input("u", ishape + rest, dtype), ej.input("i", ishape, "int64"), rows)
    d = ej.decompose(y.node, spec)
    k = d.kernels[0]
    rng = np.random.default_rng(0)
    arrays = [_values(rng, ishape + rest, dtype), rng.integers(0, rows, ishape)]
    blocks = [np.array(a[tuple(slice(lo, hi) for lo, hi in p.box(key))], order="C")
              for a, p, key in zip(arrays, d.in_partitions, k.in_keys)]
    out_item = itemsize(partial_dtype(y.node) if d.n_partials > 1 else y.dtype)
    out_bytes = int(np.prod(d.out_partition.block_shape(k.out_key))) * out_item
    scratch = kernel_scratch(d, 0, [b.nbytes for b in blocks], out_bytes)
    run_kernel(d, k, blocks)  # warm numpy's caches outside the measurement
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = run_kernel(d, k, blocks)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert result.nbytes == out_bytes
    assert peak <= out_bytes + scratch + 4096, (peak, out_bytes, scratch)


# ---------------------------------------------------------------- planning a gradient


@pytest.mark.parametrize("devices", [2, 4])
def test_eindecomp_plans_an_embedding_gradient(devices: int) -> None:
    vocab, batch, seq, hidden = 40, 4, 8, 16
    table = ej.param("table", (vocab, hidden))
    w = ej.param("w", (hidden, hidden))
    tok = ej.input("tok", (batch, seq), "int64")
    h = ej.embedding(tok, table)  # forward: gather
    y = (h @ w).tanh()
    # backward of sum(y) by hand: dy = 1 - y^2, dh = dy @ w^T, dtable = scatter_add(dh, tok)
    dh = (1 - y * y) @ w.T
    dtable = scatter_add(dh, tok, vocab)
    prog = ej.compile([y, dtable], devices=devices, planner="eindecomp")
    rng = np.random.default_rng(devices)
    feeds = {"table": rng.standard_normal((vocab, hidden)).astype(np.float32),
             "w": rng.standard_normal((hidden, hidden)).astype(np.float32) / 4,
             "tok": rng.integers(0, vocab, (batch, seq))}
    got_y, got_dt = prog.run(**feeds)
    hv = feeds["table"][feeds["tok"]]
    yv = np.tanh(hv @ feeds["w"])
    want = np.zeros((vocab, hidden), np.float32)
    np.add.at(want, feeds["tok"], (1 - yv * yv) @ feeds["w"].T)
    np.testing.assert_allclose(got_y, yv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_dt, want, rtol=1e-4, atol=1e-4)
    assert prog.run_stats is not None and prog.run_stats.bytes_moved == prog.stats.bytes_moved


def test_embedding_gradient_under_a_memory_cap() -> None:
    """Under a third of its uncapped peak, the planner cuts the scatter_add finer and the memory
    planner keeps every device under the cap; the result is unchanged."""
    vocab, tokens, hidden = 300, 256, 64
    u = ej.input("u", (tokens, hidden), "float64")
    i = ej.input("i", (tokens,), "int64")
    y = scatter_add(u * 2.0, i, vocab)
    rng = np.random.default_rng(3)
    feeds = {"u": rng.standard_normal((tokens, hidden)), "i": rng.integers(0, vocab, tokens)}
    free = ej.compile(y, devices=2, backend="null", quiet=True)
    free.run(**feeds)
    assert free.run_stats is not None
    cap = max(free.run_stats.peak_bytes_per_device.values()) // 3
    prog = ej.compile(y, devices=2, memory_limit=cap, quiet=True)
    got = prog.run(**feeds)
    assert prog.run_stats is not None
    assert all(p <= cap for p in prog.run_stats.peak_bytes_per_device.values())
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    np.testing.assert_allclose(got, np_scatter_add(2.0 * feeds["u"], feeds["i"], vocab), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- adjoint of gather


@settings(max_examples=examples(40), **SETTINGS)
@given(st.data())
def test_adjoint_identity_with_gather(data: st.DataObject) -> None:
    """<gather(T, idx), U> == <T, scatter_add(U, idx, rows)>: scatter_add is gather's transpose."""
    rows = data.draw(st.integers(1, 6))
    ishape = tuple(data.draw(st.lists(st.integers(1, 4), max_size=2)))
    rest = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    t = ej.input("t", (rows,) + rest, "float64")
    u = ej.input("u", ishape + rest, "float64")
    i = ej.input("i", ishape, "int64")
    g = ej.gather(t, i)
    s = scatter_add(u, i, rows)
    lhs = ej.einsum(",".join(["".join("abcd"[:g.ndim])] * 2) + "->", g, u)
    rhs = ej.einsum(",".join(["".join("abcd"[:s.ndim])] * 2) + "->", t, s)
    feeds = {"t": rng.standard_normal((rows,) + rest), "u": rng.standard_normal(ishape + rest),
             "i": rng.integers(0, rows, ishape)}
    a, b = ej.reference([lhs, rhs], **feeds)
    assert math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=1e-12)
