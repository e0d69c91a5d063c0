"""Hypothesis strategies: random einjoin graphs and random join-agg specs, plus an independent
numpy oracle for them (written apart from einjoin's kernels, so the two can disagree)."""

from __future__ import annotations

import itertools
import math
from typing import Any
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

import einjoin as ej
from einjoin.decomp.spec import label_sizes
from einjoin.ir import Arg, Call, Const
from einjoin.ir import ops
from einjoin.ir.node import (Broadcast, Cast, Concat, Conv, Einsum, Fill, Gather, Input, Pool, Reshape,
                             ScatterAdd, Select, TopK, rule_for)

LABELS = "ijklmnopqrstuvwxyzabcdefgh"

# joins by arity, written so every value stays finite on inputs in [-1, 1]
JOINS = {
    1: ["x0", "exp", "tanh", "relu", "sigmoid", "silu", "gelu", "gelu_tanh", "abs", "neg",
        "x0 * 0.5", "log(abs(x0) + 1)", "sqrt(abs(x0))", "rsqrt(abs(x0) + 1)",
        "reciprocal(abs(x0) + 2)", "where(x0 > 0, x0, 0.25)", "sin(x0) * cos(x0)"],
    2: ["mul", "add", "sub", "max", "min", "x0 / (abs(x1) + 1)", "exp(x0 - x1)",
        "where(x0 >= x1, x0, x1 * 2)", "pow(abs(x0) + 1, x1)", "tanh(x0 * x1 + 0.5)"],
    3: ["mul", "add", "x0 * x1 + x2", "where(x0 < x1, x2, x0)", "max"],
}
AGGS = ["sum", "max", "min", "prod"]
# The most elements an einsum's label grid may have (its kernels evaluate the join over the grid).
# Unbounded, fresh labels compound over six ops: one draw in ~3000 had a 2**26 grid, and a
# tests/test_memplan.py worker was OOM-killed at 22.6 GB running such a draw.
MAX_GRID = 2 ** 20


@st.composite
def shapes(draw: Any, min_rank: int = 0, max_rank: int = 4, max_dim: int = 4) -> tuple[int, ...]:
    rank = draw(st.integers(min_rank, max_rank))
    return tuple(draw(st.integers(1, max_dim)) for _ in range(rank))


@st.composite
def einsum_labels(draw: Any, operands: list[ej.Tensor]) -> tuple[list[str], str]:
    """Labels for each operand (shared only where sizes agree; sometimes a repeated label, i.e. a
    diagonal) and an output (a random subset in random order)."""
    size_of: dict[str, int] = {}
    terms = []
    for x in operands:
        term = ""
        for n in x.shape:
            reuse = [lab for lab, s in size_of.items() if s == n and (lab not in term or draw(st.integers(0, 9)) == 0)]
            if reuse and draw(st.booleans()):
                lab = draw(st.sampled_from(reuse))
            else:
                fresh = [c for c in LABELS if c not in size_of]
                lab = fresh[0]
                size_of[lab] = n
            term += lab
        terms.append(term)
    all_labels = sorted(size_of)
    out = draw(st.permutations(all_labels))
    k = draw(st.integers(0, len(all_labels)))
    return terms, "".join(out[:k])


@st.composite
def graphs(draw: Any, dtype: str = "float64", max_dim: int = 4, max_rank: int = 4
           ) -> tuple[list[ej.Tensor], dict[str, np.ndarray]]:
    """A random graph of 1-6 ops over 1-3 inputs (of up to ``max_rank`` dims of up to
    ``max_dim``); returns (outputs, feeds)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n_inputs = draw(st.integers(1, 3))
    pool: list[ej.Tensor] = []
    feeds: dict[str, np.ndarray] = {}
    for i in range(n_inputs):
        shape = draw(shapes(0, max_rank, max_dim))
        pool.append(ej.input(f"in{i}", shape, dtype))
        feeds[f"in{i}"] = rng.uniform(-1, 1, shape).astype(ej.ir.dtypes.numpy_dtype(dtype))
    n_ops = draw(st.integers(1, 6))
    made: list[ej.Tensor] = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(["einsum"] * 6 + ["reshape", "select", "concat", "broadcast",
                                                      "elementwise", "gather", "scatter_add",
                                                      "fill", "window", "topk"]))
        y = draw(_op(kind, pool, feeds, rng, dtype))
        if y is not None:
            pool.append(y)
            made.append(y)
    if not made:
        made.append(ej.einsum("->" if pool[0].ndim == 0 else f"{LABELS[:pool[0].ndim]}->",
                              pool[0], join="tanh"))
    # outputs: the last op, and sometimes an earlier one too (a DAG with two outputs)
    outs = [made[-1]]
    if len(made) > 1 and draw(st.booleans()):
        outs.append(made[draw(st.integers(0, len(made) - 2))])
    used = {x.op.name for x in ej.Graph(outs).inputs}
    return outs, {k: v for k, v in feeds.items() if k in used}


@st.composite
def _op(draw: Any, kind: str, pool: list[ej.Tensor], feeds: dict[str, np.ndarray],
        rng: np.random.Generator, dtype: str) -> ej.Tensor | None:
    pick = st.sampled_from(pool)
    if kind == "einsum":
        n = draw(st.integers(1, 3))
        operands = [draw(pick) for _ in range(n)]
        terms, out = draw(einsum_labels(operands))
        grid: dict[str, int] = {}
        for term, x in zip(terms, operands):
            grid.update(zip(term, x.shape))
        if math.prod(grid.values()) > MAX_GRID:
            return None  # a rare outer product of outer products: GBs in every kernel, no new case
        agg = draw(st.sampled_from(AGGS))
        join = draw(st.sampled_from(JOINS[n]))
        eq = ",".join(terms) + "->" + out
        if agg == "prod":  # keep products bounded: join into (0, 1]
            join = {1: "sigmoid", 2: "exp(-abs(x0 - x1))", 3: "exp(-abs(x0 * x1 * x2))"}[n]
        return ej.einsum(eq, *operands, join=join, agg=agg)
    x = draw(pick)
    if kind == "reshape":
        if x.ndim == 0:
            return x.reshape((1, 1))
        # split a dim into factors, or merge neighbours
        dims = list(x.shape)
        if draw(st.booleans()) and len(dims) >= 2:
            d = draw(st.integers(0, len(dims) - 2))
            new = dims[:d] + [dims[d] * dims[d + 1]] + dims[d + 2:]
        else:
            d = draw(st.integers(0, len(dims) - 1))
            f = [k for k in (1, 2, 3) if dims[d] % k == 0]
            k = draw(st.sampled_from(f))
            new = dims[:d] + [k, dims[d] // k] + dims[d + 1:]
        if len(new) > 5:
            return None
        return x.reshape(tuple(new))
    if kind == "select":
        if x.ndim == 0:
            return None
        idx = []
        for n in x.shape:
            a = draw(st.integers(0, n - 1))
            b = draw(st.integers(a + 1, n))
            idx.append(slice(a, b))
        return x[tuple(idx)]
    if kind == "concat":
        if x.ndim == 0:
            return None
        ax = draw(st.integers(0, x.ndim - 1))
        others = [y for y in pool if y.ndim == x.ndim and y.dtype == x.dtype and all(
            a == b for d, (a, b) in enumerate(zip(x.shape, y.shape)) if d != ax)]
        parts = [x] + [draw(st.sampled_from(others)) for _ in range(draw(st.integers(1, 2)))]
        return ej.concat(parts, ax)
    if kind == "broadcast":
        if x.ndim >= 4:
            return None
        ones = [d for d in range(x.ndim) if x.shape[d] == 1]
        target = list(x.shape)
        for d in ones:
            target[d] = draw(st.integers(1, 3))
        lead = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 4 - x.ndim)))]
        return x.expand(tuple(lead + target))
    if kind == "elementwise":
        y = draw(pick)
        fn = draw(st.sampled_from(["add", "mul", "sub", "max"]))
        try:
            return _binary(fn, x, y)
        except ej.ShapeError:  # shapes that do not broadcast: skip
            return None
    if kind == "gather":
        if x.ndim == 0 or x.ndim > 3:
            return None
        name = f"idx{len(feeds)}"
        ishape = draw(shapes(1, 2))
        idx = ej.input(name, ishape, "int64")
        feeds[name] = rng.integers(0, x.shape[0], ishape)
        return ej.gather(x, idx)
    if kind == "scatter_add":
        # x is the updates: its first k dims are the indices' shape (k = 0: one index for all)
        if x.ndim == 0:
            return None
        k = draw(st.integers(0, min(2, x.ndim)))
        if x.ndim - k + 1 > 4:
            return None
        rows = draw(st.integers(1, 5))
        name = f"idx{len(feeds)}"
        idx = ej.input(name, x.shape[:k], "int64")
        feeds[name] = rng.integers(0, rows, x.shape[:k])  # duplicates accumulate
        return ej.Tensor(ops.scatter_add_node(x.node, idx.node, rows))
    if kind == "fill":
        shape = draw(shapes(1, 3))
        fill = ej.fill(shape, draw(st.sampled_from(["x0 * 0.25", "0.5", f"where(x0 >= x{len(shape) - 1}, 1.0, -1.0)"])),
                       dtype)
        other = [y for y in pool if y.shape == shape]
        if other:
            return fill * draw(st.sampled_from(other))
        return ej.einsum(f"{LABELS[:len(shape)]}->", fill)  # a reduction over a fill
    if kind == "window":
        # a conv (weight a new input) or a max/sum pool over x's trailing dims as (N, C, *spatial):
        # random stride, (lo, hi) padding (negative: cropped), input and window dilation, groups
        if not 3 <= x.ndim <= 4 or ej.ir.dtypes.kind(x.dtype) != "float" or 0 in x.shape:
            return None
        nd = x.ndim - 2
        win = tuple(draw(st.integers(1, 3)) for _ in range(nd))
        stride = tuple(draw(st.integers(1, 2)) for _ in range(nd))
        dil = tuple(draw(st.integers(1, 2)) for _ in range(nd))
        pads = tuple((draw(st.integers(-1, 2)), draw(st.integers(-1, 2))) for _ in range(nd))
        try:
            if draw(st.booleans()):
                # padding of at most half the window (as torch's): no window is padding alone
                pool_pads = tuple((min(max(0, lo), (k - 1) // 2), min(max(0, hi), (k - 1) // 2))
                                  for (lo, hi), k in zip(pads, win))
                return ej.Tensor(ops.pool_node(x.node, draw(st.sampled_from(["max", "sum", "none"])), win, stride,
                                               pool_pads, dil))
            groups = draw(st.sampled_from([g for g in (1, 2, 3) if x.shape[1] % g == 0]))
            name = f"w{len(feeds)}"
            wshape = (groups * draw(st.integers(1, 2)), x.shape[1] // groups) + win
            w = ej.input(name, wshape, x.dtype)
            feeds[name] = rng.uniform(-1, 1, wshape).astype(x.dtype)
            ld = tuple(draw(st.integers(1, 2)) for _ in range(nd))
            return ej.Tensor(ops.conv_node(x.node, w.node, stride, pads, ld, dil, groups))
        except ej.ShapeError:  # no output position: skip
            return None
    if kind == "topk":
        if x.ndim == 0 or ej.ir.dtypes.kind(x.dtype) == "bool":
            return None
        # the values (later ops join float tensors; the indices are tested in test_topk.py), k >= 1
        # (later max/min aggregations need non-empty dims)
        axis = draw(st.integers(0, x.ndim - 1))
        if x.shape[axis] == 0:
            return None
        return ej.Tensor(ops.topk_node(x.node, draw(st.integers(1, x.shape[axis])), axis, draw(st.booleans())))
    raise AssertionError(kind)


def _binary(fn: str, x: ej.Tensor, y: ej.Tensor) -> ej.Tensor:
    return {"add": lambda: x + y, "mul": lambda: x * y, "sub": lambda: x - y,
            "max": lambda: ej.maximum(x, y)}[fn]()


@st.composite
def specs_for(draw: Any, outputs: list[ej.Tensor]) -> dict[Any, dict[str, Any]]:
    """A random join-agg spec for every node: 1-3 blocks per label, even or uneven."""
    out: dict[Any, dict[str, Any]] = {}
    for node in _stable_order(outputs):
        spec: dict[str, Any] = {}
        for lab, n in label_sizes(node).items():
            k = draw(st.integers(1, min(n, 3)))
            if k > 1 and draw(st.booleans()):
                cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1)))
                spec[lab] = [0, *cuts, n]
            else:
                spec[lab] = k
        out[node] = spec
    return out


def _stable_order(outputs: list[ej.Tensor]) -> list[ej.Node]:
    # a post-order by input position only: hash-consed nodes keep the serial of their first
    # creation, so ordering by serial would make hypothesis' draws depend on earlier examples
    seen: dict[ej.Node, None] = {}

    def visit(n: ej.Node) -> None:
        if n in seen:
            return
        for i in n.inputs:
            visit(i)
        seen[n] = None

    for o in outputs:
        visit(o.node)
    return list(seen)


# ---------------------------------------------------------------- independent oracle

_NP = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": lambda a, b: a / b,
    "pow": np.power, "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs,
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda a: 1 / np.sqrt(a),
    "reciprocal": lambda a: 1 / a, "relu": lambda a: np.where(a > 0, a, 0 * a),
    "silu": lambda a: a / (1 + np.exp(-a)), "tanh": np.tanh, "sigmoid": lambda a: 1 / (1 + np.exp(-a)),
    "gelu": lambda a: 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2))) if np.size(a) else a,
    "gelu_tanh": lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3))),
    "sin": np.sin, "cos": np.cos, "where": np.where, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
    "logical_not": np.logical_not, "logical_and": np.logical_and, "logical_or": np.logical_or,
}
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def _expr(e: Any, args: list[np.ndarray]) -> Any:
    if isinstance(e, Arg):
        return args[e.index]
    if isinstance(e, Const):
        return e.value
    assert isinstance(e, Call)
    return _NP[e.fn](*(_expr(a, args) for a in e.args))


def _einsum_oracle(node: ej.Node, xs: list[np.ndarray]) -> np.ndarray:
    op: Einsum = node.op  # type: ignore[assignment]
    sizes = label_sizes(node)
    labels = list(sizes)
    eq = ",".join("".join(ls) for ls in op.in_labels) + "->" + "".join(op.out_labels)
    if op.join == Arg(0) and len(xs) == 1 and op.agg.name in ("sum", "none"):
        return np.einsum(eq, xs[0])
    prod = Arg(0)
    for i in range(1, len(xs)):
        prod = Call("mul", (prod, Arg(i)))
    if op.join == prod and op.agg.name in ("sum", "none"):
        return np.einsum(eq, *xs)
    # general case: index every input with the full label grid (diagonals and broadcasting fall out)
    grid = np.meshgrid(*[np.arange(sizes[lab]) for lab in labels], indexing="ij") if labels else []
    vals = [x[tuple(grid[labels.index(lab)] for lab in ls)] if ls else np.broadcast_to(x, tuple(sizes.values()))
            for x, ls in zip(xs, op.in_labels)]
    v = np.broadcast_to(np.asarray(_expr(op.join, vals)), tuple(sizes[lab] for lab in labels))
    agg_axes = tuple(i for i, lab in enumerate(labels) if lab not in op.out_labels)
    if agg_axes:
        v = _REDUCE[op.agg.name](v, axis=agg_axes)
    kept = [lab for lab in labels if lab in op.out_labels]
    return np.transpose(v, [kept.index(lab) for lab in op.out_labels]) if kept else v


def _broadcast(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    shape = [1] * node.ndim
    for i, d in enumerate(node.op.dims):
        shape[d] = xs[0].shape[i]
    return np.broadcast_to(xs[0].reshape(shape), node.shape)


def _scatter_add(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    out = np.zeros(node.shape, xs[0].dtype)
    np.add.at(out, xs[1], xs[0])  # the index array of shape I picks rows for updates I + rest
    return out


def _fill(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    grid = np.meshgrid(*[np.arange(n, dtype=np.float64) for n in node.shape], indexing="ij")
    return np.broadcast_to(np.asarray(_expr(node.op.expr, grid)), node.shape)


def _einsum(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    return _einsum_oracle(node, [x.astype(np.float64) if x.dtype.kind == "f" else x for x in xs])


def _windows(x: np.ndarray, kernel: tuple[int, ...], stride: Any, pads: Any, ld: Any, rd: Any,
             fill: float) -> np.ndarray:
    """x (N, C, *S) as (N, C, *out, *kernel): the value each (output, window) position reads,
    ``fill`` where it reads none, by index arithmetic alone (no einjoin or torch kernel)."""
    nd = len(kernel)
    idx, ok = [], []
    for n, k, s, (lo, hi), a, b in zip(x.shape[2:], kernel, stride, pads, ld, rd):
        span = (a * (n - 1) + 1) + lo + hi - (b * (k - 1) + 1)
        m = span // s + 1
        q = s * np.arange(m)[:, None] + b * np.arange(k)[None, :] - lo
        valid = (q % a == 0) & (q >= 0) & (q // a < n)
        idx.append(np.where(valid, q // a, 0))
        ok.append(valid)
    out = x
    for d in range(nd):  # gather dim 2 + d (out, window) -> moved to the end
        out = np.take(out, idx[d], axis=2 + d)  # (.., m, k, ..)
        out = np.moveaxis(out, 2 + d + 1, -1)
    mask = np.ones(out.shape[2:], bool)
    for d in range(nd):
        shape = [1] * (2 * nd)
        shape[d], shape[nd + d] = ok[d].shape
        mask = mask & ok[d].reshape(shape)
    return np.where(mask, out, fill)


def _conv(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    op = node.op
    x, w = (a.astype(np.float64) for a in xs)
    nd, g = x.ndim - 2, op.groups
    win = _windows(x, w.shape[2:], op.stride, op.padding, op.lhs_dilation, op.rhs_dilation, 0.0)
    n, c = x.shape[:2]
    win = win.reshape((n, g, c // g) + win.shape[2:])           # n g c out... k...
    wr = w.reshape((g, w.shape[0] // g) + w.shape[1:])           # g o c k...
    sp, ks = "pqr"[:nd], "uvw"[:nd]
    out = np.einsum(f"ngc{sp}{ks},goc{ks}->ngo{sp}", win, wr)
    return out.reshape((n, w.shape[0]) + out.shape[3:])


def _pool(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    op = node.op
    nd = len(op.window)
    win = _windows(xs[0].astype(np.float64), op.window, op.stride, op.padding, (1,) * nd, op.dilation,
                   -np.inf if op.agg.name == "max" else 0.0)
    axes = tuple(range(2 + nd, 2 + 2 * nd))
    if op.agg.name == "none":  # (N, C, *out, *window) -> (N, C * window, *out)
        perm = (0, 1) + axes + tuple(range(2, 2 + nd))
        return np.transpose(win, perm).reshape(node.shape)
    return win.max(axis=axes) if op.agg.name == "max" else win.sum(axis=axes)


def _topk(node: Any, xs: list[np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
    op = node.op
    x = xs[0]
    order = np.argsort(-x if op.largest else x, axis=op.axis, kind="stable")  # ties: first first
    order = np.take(order, np.arange(op.k), axis=op.axis)
    return order if op.indices else np.take_along_axis(x, order, axis=op.axis)


# the oracle's rule per node kind: (node, its inputs' values, the feeds by name) -> its value
ORACLE_RULES: dict[type, Callable[[Any, list[np.ndarray], dict[str, np.ndarray]], Any]] = {
    Input: lambda node, xs, feeds: feeds[node.op.name],
    Einsum: _einsum,
    Reshape: lambda node, xs, feeds: xs[0].reshape(node.shape),
    Select: lambda node, xs, feeds: xs[0][tuple(slice(a, b) for a, b in zip(node.op.starts, node.op.stops))],
    Concat: lambda node, xs, feeds: np.concatenate(xs, axis=node.op.axis),
    Broadcast: _broadcast,
    Gather: lambda node, xs, feeds: xs[0][xs[1]],
    ScatterAdd: _scatter_add,
    Cast: lambda node, xs, feeds: xs[0].astype(ej.ir.dtypes.numpy_dtype(node.dtype)),
    Fill: _fill,
    Conv: _conv,
    Pool: _pool,
    TopK: _topk,
}


def oracle(outputs: list[ej.Tensor], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Evaluate with plain numpy (np.einsum, fancy indexing), independently of einjoin's kernels."""
    vals: dict[ej.Node, np.ndarray] = {}
    for node in ej.Graph(outputs).nodes:
        rule = rule_for(ORACLE_RULES, node.op, "the test oracle's rules")
        vals[node] = np.asarray(rule(node, [vals[i] for i in node.inputs], feeds))
    return [vals[o.node] for o in outputs]


def all_cuts(n: int) -> list[list[int]]:
    """Every boundary list of a dimension of size n (for exhaustive small checks)."""
    out = []
    for k in range(0, n):
        for cuts in itertools.combinations(range(1, n), k):
            out.append([0, *cuts, n])
    return out
