"""Issue 16: hostile arguments to every public function.

Hypothesis draws argument TYPES and VALUES (None, bools, negative / huge / float ints, NaN and
inf, strings, bytes, nested and ragged lists, wrong-rank shapes, numpy scalars and arrays,
complex numbers, arbitrary objects, tensors of another graph...) and feeds them, one argument at
a time, to every public function and method: ``ej.input`` / ``ej.param``, ``ej.einsum``, the free
functions, the composites, ``Tensor`` methods and operators, ``ej.reference``,
``ej.execute_blocked``, ``ej.decompose``, ``JoinAggSpec``, ``Partition``, ``ej.compile``'s
arguments, ``Program.run``'s feeds, ``ej.local`` and ``ej.Cluster``.

Each call must either raise an :class:`ej.EinjoinError` (any subclass) whose message names the
argument at fault, or give a correct result: where a result comes back it is checked against
numpy or torch (differential, never hard-coded). A raw ``TypeError`` / ``KeyError`` /
``AttributeError`` / ``ValueError`` / ``OverflowError`` from inside einjoin, a hang or a silently
wrong number fails the test.

Defects the property tests found are pinned by one-line reproducers (``test_fixed_defect``,
each failed on the code before its fix); ``_known`` leaves out only value classes that are not
defects (a user's own callable, a backend that starts Ray).
"""

from __future__ import annotations

import math
import warnings
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.ir.scalar import Arg, Call, Const

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---------------------------------------------------------------- hostile values


class _Opaque:
    """An object einjoin has never heard of."""

    def __repr__(self) -> str:
        return "_Opaque()"


def _other_graph_tensor() -> ej.Tensor:
    # a tensor of another graph: same input name as the fixtures' "x" but another shape
    return ej.input("x", (7, 2), "float64") * 2


_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(-3, 8), st.integers(min_value=2 ** 62, max_value=2 ** 70),
    st.integers(max_value=-2 ** 62, min_value=-2 ** 70), st.just(10 ** 400),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, -0.0, 2.0, 1e-300]),
    st.sampled_from([np.int64(2), np.int32(-1), np.float32(0.5), np.float64(np.nan), np.bool_(True),
                     np.uint64(2 ** 64 - 1), np.float16(65504)]),
    st.complex_numbers(max_magnitude=4, allow_nan=False),
)
_TEXT = st.one_of(st.text(max_size=6), st.sampled_from(
    ["", "x", "float32", "f32", "int64", "uint8", "complex64", "ij->i", "...", "nope", "\x00",
     "é", "x0 +", "sum", "none", "threads", "ray", "1GiB", "-1", "nan", "x" * 300]),
    st.binary(max_size=4))
_CONTAINERS = st.one_of(
    st.lists(st.integers(-2, 6), max_size=4), st.lists(st.integers(-2, 6), max_size=4).map(tuple),
    st.just([[1], [2, 3]]), st.just([1.5, 2]), st.just((2, -3)), st.just(("a", 1)),
    st.just({}), st.just({"i": 2}), st.just({"zz": 1}), st.just({1, 2}), st.just(range(3)),
    st.just([None]), st.just([[[]]]),
)
_ARRAYS = st.sampled_from([np.array(3), np.array([1, 2]), np.zeros((3, 4), np.float32),
                           np.zeros((4, 3)), np.array(["a"]), np.array([1 + 2j]),
                           np.zeros((3, 4), dtype=object)])
_OBJECTS = st.one_of(st.sampled_from([Ellipsis, slice(1, 2), slice(None, None, -1), _Opaque(),
                                      object, print, NotImplemented]),
                     st.builds(_other_graph_tensor))
HOSTILE = st.one_of(_SCALARS, _TEXT, _CONTAINERS, _ARRAYS, _OBJECTS)


# ---------------------------------------------------------------- fixtures of the calls


def _x() -> ej.Tensor:
    return ej.input("x", (3, 4))


def _y() -> ej.Tensor:
    return ej.input("y", (4, 5))


def _b() -> ej.Tensor:
    return ej.input("m", (3, 4), "bool")


def _i() -> ej.Tensor:
    return ej.input("i", (3,), "int64")


X = np.arange(12, dtype=np.float32).reshape(3, 4) / 7 - 0.6
Y = np.arange(20, dtype=np.float32).reshape(4, 5) / 11 - 0.8
M = (np.arange(12).reshape(3, 4) % 3 == 0)
I = np.array([0, 2, 1])
FEEDS = {"x": X, "y": Y, "m": M, "i": I}


def _prog() -> ej.Program:
    return ej.compile(_x() * 2 + 1, 2, quiet=True)


# target name -> call of one hostile value; the result (a tensor, arrays, a program...) is
# checked by _check_result
def _call(name: str, *lead: Callable[[], Any]) -> Callable[[Any], Any]:
    """v -> ej.<name>(*(f() for f in lead), v): the hostile value in the argument after ``lead``."""
    return lambda v: getattr(ej, name)(*(f() for f in lead), v)


TARGETS: dict[str, Callable[[Any], Any]] = {
    # graph inputs
    "input.name": lambda v: ej.input(v, (2,)),
    "input.shape": lambda v: ej.input("a", v),
    "input.dtype": lambda v: ej.input("a", (2,), v),
    "param.name": lambda v: ej.param(v, (2,)),
    "param.shape": lambda v: ej.param("p", v),
    "param.dtype": lambda v: ej.param("p", (2,), v),
    # einsum
    "einsum.equation": lambda v: ej.einsum(v, _x(), _y()),
    "einsum.operand": lambda v: ej.einsum("ij,jk->ik", _x(), v),
    "einsum.join": lambda v: ej.einsum("ij,jk->ik", _x(), _y(), join=v),
    "einsum.agg": lambda v: ej.einsum("ij,jk->ik", _x(), _y(), agg=v),
    # free functions
    "matmul": lambda v: ej.matmul(_x(), v),
    "where.cond": lambda v: ej.where(v, _x(), _x()),
    "where.a": lambda v: ej.where(_b(), v, _x()),
    "maximum": lambda v: ej.maximum(_x(), v),
    "minimum": lambda v: ej.minimum(v, _x()),
    **{f"{n}": _call(n)
       for n in ["exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "relu", "tanh", "sigmoid",
                 "erf", "sin", "cos", "neg", "logical_not", "silu", "gelu", "softmax",
                 "log_softmax", "rms_norm", "layer_norm", "rope", "rotate_half"]},
    **{f"{n}.dim": _call(n, _x)
       for n in ["sum", "mean", "max", "min", "prod", "softmax", "log_softmax"]},
    **{f"{n}.keepdim": _call(n, _x, lambda: 0)
       for n in ["sum", "mean", "max", "min", "prod"]},
    "concat.tensors": lambda v: ej.concat(v),
    "concat.item": lambda v: ej.concat([_x(), v]),
    "concat.dim": lambda v: ej.concat([_x(), _x()], v),
    "stack.tensors": lambda v: ej.stack(v),
    "stack.dim": lambda v: ej.stack([_x(), _x()], v),
    "split.size": lambda v: ej.split(_x(), v),
    "split.dim": lambda v: ej.split(_x(), 1, v),
    "chunk.chunks": lambda v: ej.chunk(_x(), v),
    "chunk.dim": lambda v: ej.chunk(_x(), 2, v),
    "reshape": lambda v: ej.reshape(_x(), v),
    "transpose": lambda v: ej.transpose(_x(), v, 1),
    "permute": lambda v: ej.permute(_x(), v),
    "broadcast_to": lambda v: ej.broadcast_to(_x(), v),
    "full.shape": lambda v: ej.full(v, 1.0),
    "full.value": lambda v: ej.full((2,), v),
    "full.dtype": lambda v: ej.full((2,), 1, v),
    "zeros.shape": lambda v: ej.zeros(v),
    "ones.dtype": lambda v: ej.ones((2,), v),
    "arange.n": lambda v: ej.arange(v),
    "arange.dtype": lambda v: ej.arange(3, v),
    "fill.expr": lambda v: ej.fill((2, 3), v),
    "fill.shape": lambda v: ej.fill(v, "x0"),
    "causal_mask.rows": lambda v: ej.causal_mask(v),
    "causal_mask.cols": lambda v: ej.causal_mask(3, v),
    "gather.table": lambda v: ej.gather(v, _i()),
    "gather.indices": lambda v: ej.gather(_x(), v),
    "embedding.weight": lambda v: ej.embedding(_i(), v),
    "cast.dtype": lambda v: ej.cast(_x(), v),
    # composites
    "linear.weight": lambda v: ej.linear(_x(), v),
    "linear.bias": lambda v: ej.linear(_x(), ej.input("w", (2, 4)), v),
    "layer_norm.normalized_shape": lambda v: ej.layer_norm(_x(), v),
    "layer_norm.weight": lambda v: ej.layer_norm(_x(), None, v),
    "layer_norm.eps": lambda v: ej.layer_norm(_x(), eps=v),
    "rms_norm.weight": lambda v: ej.rms_norm(_x(), v),
    "rms_norm.eps": lambda v: ej.rms_norm(_x(), eps=v),
    "gelu.approximate": lambda v: ej.gelu(_x(), v),
    "rope.base": lambda v: ej.rope(_x(), base=v),
    "rope.start": lambda v: ej.rope(_x(), start=v),
    "attention.q": lambda v: ej.attention(v, _x(), _x()),
    "attention.causal": lambda v: ej.attention(_x(), _x(), _x(), causal=v),
    "attention.scale": lambda v: ej.attention(_x(), _x(), _x(), scale=v),
    "attention.mask": lambda v: ej.attention(_x(), _x(), _x(), mask=v),
    # Tensor operators and methods
    "Tensor.__add__": lambda v: _x() + v,
    "Tensor.__radd__": lambda v: v + _x(),
    "Tensor.__rsub__": lambda v: v - _x(),
    "Tensor.__mul__": lambda v: _x() * v,
    "Tensor.__truediv__": lambda v: _x() / v,
    "Tensor.__rtruediv__": lambda v: v / _x(),
    "Tensor.__pow__": lambda v: _x() ** v,
    "Tensor.__rpow__": lambda v: v ** _x(),
    "Tensor.__and__": lambda v: _b() & v,
    "Tensor.__ror__": lambda v: v | _b(),
    "Tensor.__lt__": lambda v: _x() < v,
    "Tensor.__eq__": lambda v: _x() == v,
    "Tensor.__matmul__": lambda v: _x() @ v,
    "Tensor.__rmatmul__": lambda v: v @ _y(),
    "Tensor.__getitem__": lambda v: _x()[v],
    "Tensor.__getitem__.2": lambda v: _x()[0, v],
    "Tensor.reshape": lambda v: _x().reshape(v),
    "Tensor.view": lambda v: _x().view(v, -1),
    "Tensor.permute": lambda v: _x().permute(v),
    "Tensor.transpose": lambda v: _x().transpose(0, v),
    "Tensor.flatten": lambda v: _x().flatten(v),
    "Tensor.unsqueeze": lambda v: _x().unsqueeze(v),
    "Tensor.squeeze": lambda v: _x().squeeze(v),
    "Tensor.expand": lambda v: _x().expand(v),
    "Tensor.expand.2": lambda v: _x().expand(v, 3, 4),
    "Tensor.to": lambda v: _x().to(v),
    "Tensor.size": lambda v: _x().size(v),
    "Tensor.sum": lambda v: _x().sum(v),
    "Tensor.mean": lambda v: _x().mean(v),
    "Tensor.max": lambda v: _x().max(v),
    "Tensor.gelu": lambda v: _x().gelu(v),
    "Tensor.__init__": lambda v: ej.Tensor(v) + 1,
    # evaluation
    "reference.outputs": lambda v: ej.reference(v, x=X),
    "reference.feed": lambda v: ej.reference(_x() + 1, x=v),
    "reference.positional": lambda v: ej.reference(_x() + 1, v),
    "execute_blocked.specs": lambda v: ej.execute_blocked(_x() + 1, v, x=X),
    "execute_blocked.spec": lambda v: ej.execute_blocked(_x() + 1, {_x() + 1: v}, x=X),
    "execute_blocked.workers": lambda v: ej.execute_blocked(_x() + 1, None, workers=v, x=X),
    "decompose.node": lambda v: ej.decompose(v),
    "decompose.spec": lambda v: ej.decompose((_x() @ _y()).node, v),
    "JoinAggSpec.for_node.node": lambda v: ej.JoinAggSpec.for_node(v),
    "JoinAggSpec.for_node.spec": lambda v: ej.JoinAggSpec.for_node((_x() @ _y()).node, v),
    "JoinAggSpec.for_node.blocks": lambda v: ej.JoinAggSpec.for_node((_x() @ _y()).node, {"i": v}),
    "Partition": lambda v: ej.Partition(v),
    "Partition.from_counts.shape": lambda v: ej.Partition.from_counts(v, (1,)),
    "Partition.from_counts.counts": lambda v: ej.Partition.from_counts((4,), v),
    "Partition.of.per_dim": lambda v: ej.Partition.of((4, 4), v),
    "Partition.of.shape": lambda v: ej.Partition.of(v, (1,)),
    "Partition.whole": lambda v: ej.Partition.whole(v),
    # clusters
    "local.n": lambda v: ej.local(v),
    "local.memory": lambda v: ej.local(2, v),
    "Cluster.uniform.n": lambda v: ej.Cluster.uniform(v),
    "Cluster.uniform.bandwidth": lambda v: ej.Cluster.uniform(2, bandwidth=v),
    "Cluster.islands.sizes": lambda v: ej.Cluster.islands(v, 1e9, 1e8),
    "Cluster.devices": lambda v: ej.Cluster(v, ((math.inf,),), ((0.0,),)),
    # compile
    "compile.outputs": lambda v: ej.compile(v, quiet=True),
    "compile.devices": lambda v: ej.compile(_x() + 1, v, quiet=True),
    "compile.planner": lambda v: ej.compile(_x() + 1, 2, planner=v, quiet=True),
    "compile.backend": lambda v: ej.compile(_x() + 1, 2, backend=v, quiet=True),
    "compile.specs": lambda v: ej.compile(_x() + 1, 2, specs=v, quiet=True),
    "compile.spec": lambda v: ej.compile(_x() + 1, 2, specs={_x() + 1: v}, quiet=True),
    "compile.placement": lambda v: ej.compile(_x() + 1, 2, placement=v, quiet=True),
    "compile.order": lambda v: ej.compile(_x() + 1, 2, order=v, quiet=True),
    "compile.seed": lambda v: ej.compile(_x() + 1, 2, seed=v, quiet=True),
    "compile.quiet": lambda v: ej.compile(_x() + 1, 2, quiet=v),
    "compile.memory_limit": lambda v: ej.compile(_x() + 1, 2, memory_limit=v, quiet=True),
    "compile.memory_policy": lambda v: ej.compile(_x() + 1, 2, memory_policy=v, quiet=True),
    # Program.run
    "run.positional": lambda v: _prog().run(v),
    "run.feed": lambda v: _prog().run(x=v),
    "run.order": lambda v: _prog().run(X, order=v),
    "run.seed": lambda v: _prog().run(X, seed=v),
    "run.callbacks": lambda v: _prog().run(X, callbacks=v),
    "run.quiet": lambda v: _prog().run(X, quiet=v),
    "run_reference.feed": lambda v: _prog().run_reference(v),
}


# Value classes left out of the property tests on purpose (not defects).
def _known(target: str, v: Any) -> bool:
    if target == "execute_blocked.specs" and callable(v) and not isinstance(v, type(print)):
        return True   # a callable spec is the user's own code: its TypeError is its own
    if target == "compile.backend" and isinstance(v, str) and v == "ray":
        return True   # a real backend that starts a Ray cluster: tests/adversarial/test_ray_adversarial.py
    return False


def _check_result(target: str, v: Any, out: Any) -> None:
    """Whatever came back must be correct: tensors are evaluated and compared with numpy on the
    graph's own feeds where the target's meaning is simple enough to restate."""
    if isinstance(out, ej.Tensor):
        graph = ej.Graph(out)
        feeds = {x.op.name: FEEDS[x.op.name] for x in graph.inputs if x.op.name in FEEDS
                 and FEEDS[x.op.name].shape == x.shape}
        if len(feeds) != len(graph.inputs) or any(n.size > 10 ** 6 for n in graph.nodes):
            return  # an input of the caller's own (a tensor of another graph), or too big: shape only
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no numpy RuntimeWarning may leak to the user
            got = ej.reference(out, **feeds)
        assert got.shape == out.shape and got.dtype == np.dtype(ej.ir.dtypes.numpy_dtype(out.dtype))
        expect = _numpy_meaning(target, v)
        if expect is not None:
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expect, np.float64),
                                       rtol=2e-5, atol=1e-6, equal_nan=True)


def _numpy_meaning(target: str, v: Any) -> Any:
    """The answer of numpy / torch for targets whose result follows from ``v`` in one line, else
    None. Operators with a Python number compute as torch does: in the tensor's dtype (float32),
    the number rounded to it."""
    x = X.astype(np.float64)
    tx = torch.from_numpy(X)
    real = (int, float, np.integer, np.floating)
    scal = isinstance(v, real) and not isinstance(v, (bool, np.bool_))
    py = v.item() if isinstance(v, np.generic) else v
    with np.errstate(all="ignore"):
        if scal and target in _OPS:
            try:
                return _OPS[target](tx, py).numpy()
            except (RuntimeError, OverflowError):
                return None  # torch refuses the number too: any einjoin answer was an error above
        if target in ("sum.dim", "Tensor.sum") and isinstance(v, int) and not isinstance(v, bool):
            return x.sum(v)
        if target in ("max.dim", "Tensor.max") and isinstance(v, int) and not isinstance(v, bool):
            return x.max(v)
        if target == "Tensor.__getitem__" and isinstance(v, (int, slice)) and not isinstance(v, bool):
            return x[v]
        if target == "Tensor.reshape" and isinstance(v, tuple):
            return x.reshape(v)
        if target == "layer_norm.eps" and scal:
            return torch.nn.functional.layer_norm(tx, (4,), eps=float(v)).numpy()
        if target == "rms_norm.eps" and scal:
            return (tx * torch.rsqrt((tx * tx).mean(-1, keepdim=True) + float(v))).numpy()
        if target == "attention.scale" and scal:
            return _sdpa(tx, float(v))
    return None


def _sdpa(t: Any, scale: float) -> Any:
    # torch's math attention, in float32 like the einjoin graph: softmax(q k^T * scale + mask) v
    s = (t @ t.T) * scale
    s = s.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), -math.inf)
    return (torch.softmax(s, -1) @ t).numpy()


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "Tensor.__add__": lambda t, v: t + v, "Tensor.__radd__": lambda t, v: v + t,
    "Tensor.__rsub__": lambda t, v: v - t, "Tensor.__mul__": lambda t, v: t * v,
    "Tensor.__truediv__": lambda t, v: t / v, "Tensor.__rtruediv__": lambda t, v: v / t,
    "maximum": lambda t, v: torch.maximum(t, torch.tensor(v, dtype=t.dtype)),
    "minimum": lambda t, v: torch.minimum(torch.tensor(v, dtype=t.dtype), t),
}


_FEED_TARGETS = {"run.positional", "run.feed", "run_reference.feed", "reference.feed",
                 "reference.positional"}


def _tuple(v: Any) -> tuple[Any, ...]:
    return v if isinstance(v, tuple) else (v,)


def _call(target: str, v: Any) -> None:
    fn = TARGETS[target]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = fn(v)
    except ej.EinjoinError as e:
        assert str(e).strip(), f"{target}({v!r}): an empty message"
        return
    if isinstance(out, ej.Program):  # runs as its graph's reference says
        feeds = {x.op.name: np.ones(x.shape, ej.ir.dtypes.numpy_dtype(x.dtype))
                 for x in out.graph.inputs}
        for got, expect in zip(_tuple(out.run(**feeds)), _tuple(ej.reference(
                list(out.graph.outputs), **feeds))):
            np.testing.assert_allclose(got, expect, rtol=1e-6)
        return
    if target.startswith("run") or target.startswith("reference.") or target.startswith(
            "execute_blocked"):
        # the value fed is v itself for the feed targets (accepted: it must hold x's values)
        fed = X if target not in _FEED_TARGETS else np.asarray(v, np.float64)
        expect = fed * 2 + 1 if target.startswith("run") else fed + 1
        np.testing.assert_allclose(np.asarray(out, np.float64), expect, rtol=1e-6)
        return
    _check_result(target, v, out)


@pytest.mark.parametrize("target", sorted(TARGETS))
@SETTINGS
@given(v=HOSTILE)
def test_hostile_argument(target: str, v: Any) -> None:
    """Any value in any argument: a typed EinjoinError, or a right answer."""
    assume(not _known(target, v))
    _call(target, v)


_TORCH_TARGETS: dict[str, Callable[[Any], Any]] = {
    "from_torch.module": lambda v: ej.from_torch(v, (torch.ones(2, 4),)),
    "from_torch.example_args": lambda v: ej.from_torch(torch.nn.Linear(4, 3), v),
    "from_torch.method": lambda v: ej.from_torch(torch.nn.Linear(4, 3), (torch.ones(2, 4),), method=v),
}


@pytest.mark.parametrize("target", sorted(_TORCH_TARGETS))
@settings(SETTINGS, max_examples=8)  # each call traces a module: slow
@given(v=HOSTILE)
def test_hostile_argument_to_from_torch(target: str, v: Any) -> None:
    try:
        fn = _TORCH_TARGETS[target](v)
    except ej.EinjoinError as e:
        assert str(e).strip()
        return
    # accepted: then it computes what the module computes
    got = ej.compile(fn, 1, quiet=True).run(torch.ones(2, 4))
    assert tuple(got.shape) == (2, 3)


# ---------------------------------------------------------------- messages name the argument


@pytest.mark.parametrize("call, fragments", [
    (lambda: ej.input(None, (2,)), ["name"]),
    (lambda: ej.input("a", (2, "x")), ["'a'", "shape"]),
    (lambda: ej.input("a", (2,), "complex64"), ["complex64"]),
    (lambda: ej.einsum(3, _x()), ["equation"]),
    (lambda: ej.einsum("ij,jk->ik", _x(), _y(), join="x0 +"), ["join", "x0 +"]),
    (lambda: ej.einsum("ij->i", _x(), agg="mean"), ["'mean'"]),
    (lambda: ej.layer_norm(_x(), eps="1e-5"), ["eps"]),
    (lambda: ej.rms_norm(_x(), eps=None), ["eps"]),
    (lambda: ej.layer_norm(_x(), 4.0), ["normalized_shape"]),
    (lambda: ej.rope(_x(), base="10000"), ["base"]),
    (lambda: ej.rope(_x(), base=-1.0), ["base"]),
    (lambda: ej.rope(_x(), start=1.5), ["start"]),
    (lambda: ej.rope(_x(), start=10 ** 30), ["start"]),
    (lambda: ej.attention(_x(), _x(), _x(), causal=np.array([1, 0])), ["causal"]),
    (lambda: ej.attention(_x(), _x(), _x(), causal="yes"), ["causal"]),
    (lambda: ej.attention(_x(), _x(), _x(), scale=10 ** 400), ["scale"]),
    (lambda: ej.gelu(_x(), np.array([1, 2])), ["approximate"]),
    (lambda: _i() + 2 ** 63, ["2**63", str(2 ** 63)]),
    (lambda: _x() + 10 ** 400, ["too large"]),
    (lambda: ej.einsum("i->i", _i(), join="x0 + 99999999999999999999"), ["99999999999999999999"]),
    (lambda: ej.einsum("ij->ij", _x(), join=Arg(-1)), ["Arg", "-1"]),
    (lambda: ej.einsum("ij->ij", _x(), join=Call("nope", (Arg(0),))), ["'nope'"]),
    (lambda: ej.einsum("ij->ij", _x(), join=Call("exp", (Arg(0), Arg(0)))), ["exp", "1 argument"]),
    (lambda: ej.einsum("ij->ij", _x(), join=Const("a")), ["Const", "'a'"]),
    (lambda: ej.einsum("ij->ij", _x(), join="-" * 200_000 + "x0"), ["nests too deeply"]),
    (lambda: ej.einsum("ij->ij", _x(), join="x0 +\x00 1"), ["join"]),
])
def test_message_names_the_argument(call: Callable[[], Any], fragments: list[str]) -> None:
    with pytest.raises(ej.EinjoinError) as info:
        call()
    msg = str(info.value)
    assert any(f in msg for f in fragments), msg


# ---------------------------------------------------------------- defects the suite found (fixed)


FIXED = [
    # (id, one-line reproducer, a fragment the message must hold: the argument at fault)
    ("keepdim-array", lambda: ej.sum(_x(), 0, np.array([1, 2])), "keepdim"),
    ("mean-keepdim-str", lambda: _x().mean(0, "yes"), "keepdim"),
    ("getitem-array", lambda: _x()[np.array([0, 1])], "ndarray"),
    ("getitem-float-slice", lambda: _x()[0:1.5], "slice"),
    ("tensor-gelu-array", lambda: _x().gelu(np.array([1, 2])), "approximate"),
    ("Tensor-of-junk", lambda: ej.Tensor(None) + 1, "Tensor(node)"),
    ("expand-array", lambda: _x().expand(np.array([1, 2]), 3, 4), "expand"),
    ("concat-none", lambda: ej.concat(None), "concat"),
    ("stack-int", lambda: ej.stack(3), "stack"),
    ("permute-none", lambda: ej.permute(_x(), None), "permute"),
    ("permute-of-junk", lambda: ej.permute(None, (1, 0)), "permute"),
    ("causal-mask-str", lambda: ej.causal_mask("3"), "rows"),
    ("causal-mask-cols-float", lambda: ej.causal_mask(3, 2.5), "cols"),
    ("arange-float", lambda: ej.arange(2.5), "arange"),
    ("full-string-value", lambda: ej.full((3,), "x0"), "value"),
    ("full-int-nan", lambda: ej.full((2,), math.nan, "int64"), "nan"),
    ("full-int-huge", lambda: ej.full((2,), 2 ** 70, "int64"), "int64"),
    ("full-half-overflow", lambda: ej.full((2,), 1e6, "float16"), "float16"),
    ("full-float-beyond-float", lambda: ej.full((2,), 10 ** 400), "too large"),
    ("shape-beyond-numpy", lambda: ej.input("a", (2 ** 62, 2 ** 62)), "'a'"),
    ("empty-shape-beyond-numpy", lambda: ej.zeros((0, 2 ** 62, 2 ** 62)), "shape"),
    ("outer-product-beyond-numpy", lambda: ej.einsum("i,j->ij", ej.input("u", (2 ** 40,)),
                                                     ej.input("w", (2 ** 40,))), "einsum"),
    ("dtype-of-tensor", lambda: ej.input("a", (2,), _x()), "dtype"),
    ("dtype-of-numpy-value", lambda: ej.input("a", (2,), np.float32(0.5)), "dtype"),
    ("einsum-capital-diagonal", lambda: ej.einsum("AA->A", ej.input("q", (2, 1))), "'A'"),
    ("partition-none", lambda: ej.Partition(None), "Partition"),
    ("partition-0d-array", lambda: ej.Partition(np.array(3)), "Partition"),
    ("partition-whole-int", lambda: ej.Partition.whole(3), "shape"),
    ("partition-of-str-shape", lambda: ej.Partition.of("ab", (1, 1)), "shape"),
    ("partition-from-counts-junk-shape", lambda: ej.Partition.from_counts([None], (1,)), "shape"),
    ("from-torch-method-array", lambda: ej.from_torch(torch.nn.Linear(4, 3), (torch.ones(2, 4),),
                                                      method=np.array([1, 2])), "method"),
    ("explain-file-int", lambda: _prog().explain(3), "file"),
    ("explain-file-array", lambda: _prog().explain(np.array([1, 2])), "file"),
    ("run-callbacks-0d", lambda: _prog().run(X, callbacks=np.array(3)), "callbacks"),
]


@pytest.mark.parametrize("call, fragment", [pytest.param(c, f, id=i) for i, c, f in FIXED])
def test_fixed_defect(call: Callable[[], Any], fragment: str) -> None:
    """Each raised a raw TypeError / ValueError / AttributeError, or accepted the value (a fill of
    nan wrapped to an int, a shape numpy cannot hold, a (2, 1) diagonal); now a typed EinjoinError
    naming the argument."""
    with pytest.raises(ej.EinjoinError) as info:
        call()
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("op", ["or", "and"])
@pytest.mark.parametrize("value", [True, False])
def test_python_bool_on_the_left_of_a_mask(op: str, value: bool) -> None:
    """``True | mask`` raised a raw TypeError (no ``__ror__`` / ``__rand__``); torch computes it."""
    tm = torch.from_numpy(M)
    got = ej.reference((value | _b()) if op == "or" else (value & _b()), m=M)
    expect = (value | tm) if op == "or" else (value & tm)
    np.testing.assert_array_equal(got, expect.numpy())


def test_legitimate_neighbours_of_the_fixed_values_still_work() -> None:
    """The checks refuse junk only: numpy ints and 0-d int arrays as sizes and indices, 0/1 as
    keepdim, a float fill truncated into int64 (as torch.full), inf in a half fill, an explicit
    file for explain(), a '...' dim of size 1 that broadcasts."""
    x = torch.from_numpy(X)
    np.testing.assert_array_equal(ej.reference(_x()[np.array(1)], x=X), X[1])
    np.testing.assert_array_equal(ej.reference(ej.sum(_x(), 0, 1), x=X), x.sum(0, keepdim=True).numpy())
    np.testing.assert_array_equal(ej.reference(ej.causal_mask(np.int64(3), 4)),
                                  np.tril(np.ones((3, 4), bool), 1))
    np.testing.assert_array_equal(ej.reference(ej.full((2,), -2.5, "int64")),
                                  torch.full((2,), -2.5, dtype=torch.int64).numpy())
    np.testing.assert_array_equal(ej.reference(ej.full((2,), math.inf, "float16")),
                                  torch.full((2,), math.inf, dtype=torch.float16).numpy())
    np.testing.assert_array_equal(ej.reference(ej.full((2,), np.float32(0.5))), np.full(2, 0.5, np.float32))
    np.testing.assert_array_equal(ej.reference(ej.permute(_x(), [1, 0]), x=X), X.T)
    assert ej.Partition([[0, 2], np.array([0, 1, 3])]).bounds == ((0, 2), (0, 1, 3))
    import io
    buf = io.StringIO()
    assert _prog().explain(buf) == buf.getvalue().rstrip("\n")
    e = ej.input("e", (2, 1, 4), "float64")
    es = np.arange(8.0).reshape(2, 1, 4)
    ys = np.arange(12.0).reshape(3, 4)
    f = ej.input("f", (3, 4), "float64")
    np.testing.assert_array_equal(ej.reference(ej.einsum("...k,...k->...", e, f), e=es, f=ys),
                                  np.einsum("...k,...k->...", es, ys))


# ---------------------------------------------------------------- positional feeds and re-declared inputs


def test_positional_feeds_are_refused_when_declaration_order_is_ambiguous() -> None:
    """A silent wrong answer before: once another live graph declared ``b`` before ``a``, a new
    graph that declares ``a`` then ``b`` bound its positional feeds the other way round (inputs are
    hash-consed; the first declaration fixed the order). Now positional feeds on such a graph are
    an EinjoinError naming both inputs, and feeding by name gives the right answer."""
    older = ej.input("pb", (2,)) - ej.input("pa", (2,))  # noqa: F841  (kept alive)
    a = ej.input("pa", (2,))
    b = ej.input("pb", (2,))
    one, zero = np.ones(2, np.float32), np.zeros(2, np.float32)
    with pytest.raises(ej.EinjoinError, match="by name") as info:
        ej.reference(a - b, one, zero)
    assert "'pa'" in str(info.value) and "'pb'" in str(info.value)
    np.testing.assert_array_equal(ej.reference(a - b, pa=one, pb=zero), one - zero)
    with pytest.raises(ej.EinjoinError, match="by name"):
        ej.compile(a - b, 2, quiet=True).run(one, zero)
    np.testing.assert_array_equal(ej.compile(a - b, 2, quiet=True).run(pa=one, pb=zero), one - zero)


def test_redeclaring_inputs_in_the_same_order_still_binds_positionally() -> None:
    older = ej.input("qa", (2,)) * ej.input("qb", (2,))  # noqa: F841  (kept alive)
    a = ej.input("qa", (2,))
    b = ej.input("qb", (2,))
    xs, ys = np.array([3.0, 1.0], np.float32), np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(ej.reference(a - b, xs, ys), xs - ys)


def test_a_compiled_program_keeps_its_positional_order() -> None:
    """The Program's graph is its compile time's: declaring its inputs again in the other order
    later neither changes how it binds positional feeds nor makes them ambiguous."""
    a = ej.input("ra", (2,))
    b = ej.input("rb", (2,))
    prog = ej.compile(a - b, 2, quiet=True)
    later = ej.input("rb", (2,)) - ej.input("ra", (2,))  # noqa: F841  (kept alive)
    xs, ys = np.array([3.0, 1.0], np.float32), np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(prog.run(xs, ys), xs - ys)
