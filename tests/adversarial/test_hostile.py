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
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const, evaluate, infer_dtype, parse_join

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
    **{f"{n}": (lambda n: lambda v: getattr(ej, n)(v))(n)
       for n in ["exp", "log", "sqrt", "rsqrt", "reciprocal", "abs", "relu", "tanh", "sigmoid",
                 "erf", "sin", "cos", "neg", "logical_not", "silu", "gelu", "softmax",
                 "log_softmax", "rms_norm", "layer_norm", "rope", "rotate_half"]},
    **{f"{n}.dim": (lambda n: lambda v: getattr(ej, n)(_x(), v))(n)
       for n in ["sum", "mean", "max", "min", "prod", "softmax", "log_softmax"]},
    **{f"{n}.keepdim": (lambda n: lambda v: getattr(ej, n)(_x(), 0, v))(n)
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


# ---------------------------------------------------------------- join constants (ir/scalar.py)


@pytest.mark.parametrize("join", ["x0 * 2 ** -1", "x0 * 2 ** 64", "x0 + -True", "x0 * (2 - 5) ** 3",
                                  "x0 + 3 / 0", "x0 * max(2, 2 ** 70) / 2 ** 70", "x0 - abs(-7)",
                                  "where(1 < 2, x0, 0.0)", "x0 * (10 ** 20 - 10 ** 20 + 1)"])
def test_constant_subexpressions_follow_python_numbers(join: str) -> None:
    """A join's constant-only subexpression is worth what Python says (numpy's int64 power
    raised on ``2 ** -1`` and wrapped ``2 ** 64`` to 0; ``-True`` raised a numpy TypeError)."""
    x = ej.input("v", (4,), "float64")
    xs = np.array([1.0, -2.0, 0.5, 3.0])
    got = ej.reference(ej.einsum("i->i", x, join=join), v=xs)
    py = eval(join.replace("x0", "XS").replace("max(", "_max(").replace("where(", "_where(")  # noqa: S307
              .replace("3 / 0", "INF"),
              {"XS": xs, "_max": max, "_where": lambda c, a, b: a if c else b, "INF": math.inf, "abs": abs})
    np.testing.assert_array_equal(got, py)


@pytest.mark.parametrize("value", [2 ** 63, -2 ** 63 - 1, 10 ** 30])
def test_int_constant_outside_int64_is_refused(value: int) -> None:
    """``int64 + 2**63`` raised a raw OverflowError at run time; now a DTypeError names it."""
    with pytest.raises(ej.DTypeError, match=str(value)):
        _i() + value


def test_where_of_constants_outside_int64_is_refused() -> None:
    """``where(c, 2**70, 0)`` is int64 (its branches are ints): it overflowed inside the kernel;
    ``where(c, 1, 0)`` (no dtype of its own, reading the condition) still works."""
    c = ej.input("c", (3,), "bool")
    with pytest.raises(ej.DTypeError, match=str(2 ** 70)):
        ej.where(c, 2 ** 70, 0)
    cs = np.array([True, False, True])
    np.testing.assert_array_equal(ej.reference(ej.where(c, 1, 0), c=cs),
                                  torch.where(torch.from_numpy(cs), 1, 0).numpy())


@pytest.mark.parametrize("expr", [Call("logical_and", (Call("eq", (Arg(0), Arg(1))), Call("lt", (Arg(0), Arg(1))))),
                                  Call("lt", (Call("lt", (Arg(0), Arg(1))), Arg(0))),
                                  Call("logical_or", (Const(False), Call("ne", (Arg(0), Arg(1))))),
                                  Call("pow", (Call("neg", (Arg(0),)), Arg(1)))])
def test_printed_join_parses_back_to_itself(expr: Any) -> None:
    """``(x0 == x1) & (x0 < x1)`` printed without its parentheses (Python's & binds tighter than
    ==, so the text meant something else, or did not parse); ``(-x0) ** x1`` likewise."""
    assert parse_join(str(expr), 2) == expr


def test_int_constant_inside_int64_wraps_as_torch() -> None:
    out = ej.reference(_i() * (-2 ** 63), i=I)
    expect = (torch.from_numpy(I) * (-2 ** 63)).numpy()
    np.testing.assert_array_equal(out, expect)


_leaf = st.one_of(st.integers(0, 1).map(Arg),
                  st.one_of(st.integers(-3, 3), st.floats(-4, 4, allow_nan=False), st.booleans(),
                            st.sampled_from([0.0, -0.0, math.inf, -math.inf])).map(Const))


def _calls(children: st.SearchStrategy) -> st.SearchStrategy:
    names = sorted(FUNCTIONS)
    return st.sampled_from(names).flatmap(
        lambda n: st.tuples(*[children] * FUNCTIONS[n].arity).map(lambda a: Call(n, a)))


@settings(max_examples=150, deadline=None)
@given(st.recursive(_leaf, _calls, max_leaves=6),
       st.sampled_from(["float32", "float64", "int64", "bool"]))
def test_any_join_expression_types_or_refuses(e: Any, dtype: str) -> None:
    """Random expression trees over every function: parse_join + infer_dtype either raise an
    EinjoinError, or the expression prints, parses back to itself and evaluates without a raw
    error to an array of the inferred dtype's kind."""
    try:
        expr = parse_join(e, 2)
        dt = infer_dtype(expr, (dtype, dtype))
    except ej.EinjoinError:
        return
    assert parse_join(str(expr), 2) == expr
    a = np.array([0, 1, 2, 3]).astype(ej.ir.dtypes.numpy_dtype(dtype))
    b = np.array([3, 0, 1, 2]).astype(ej.ir.dtypes.numpy_dtype(dtype))
    with np.errstate(all="ignore"):
        val = np.asarray(evaluate(expr, [a, b]))
    assert val.dtype.kind in {"bool": "b", "int": "iu", "float": "f"}[ej.ir.dtypes.kind(dt)] or \
        val.dtype == object or val.ndim == 0


# ---------------------------------------------------------------- einsum equations vs np.einsum


_LABELS = "abcijkAB"


@st.composite
def _equations(draw: Any) -> tuple[str, list[tuple[int, ...]]]:
    n = draw(st.integers(1, 3))
    terms, shapes = [], []
    # capital labels may be size 1 too: only '...' dims broadcast, a written capital does not
    sizes = {c: draw(st.integers(1, 3)) for c in _LABELS}
    ell = draw(st.lists(st.integers(1, 3), max_size=2))
    for _ in range(n):
        labels = draw(st.lists(st.sampled_from(_LABELS), max_size=3))
        use_ell = draw(st.booleans()) and bool(ell)
        k = draw(st.integers(0, len(ell))) if use_ell else 0
        shape = [sizes[c] for c in labels]
        # a wrong size now and then: the equation must then be refused
        if shape and draw(st.integers(0, 6)) == 0:
            shape[0] += 1  # (never makes a size 1)
        eshape = [draw(st.sampled_from([1, d])) for d in ell[len(ell) - k:]]
        pos = draw(st.integers(0, len(labels)))
        term = "".join(labels[:pos]) + ("..." if use_ell else "") + "".join(labels[pos:])
        terms.append(term)
        shapes.append(tuple(shape[:pos]) + tuple(eshape) + tuple(shape[pos:]))
    eq = ",".join(terms)
    mode = draw(st.sampled_from(["implicit", "explicit", "explicit", "junk"]))
    if mode == "explicit":
        seen = sorted({c for t in terms for c in t if c.isalpha()})
        out = draw(st.lists(st.sampled_from(seen), unique=True)) if seen else []
        if any("..." in t for t in terms) and draw(st.booleans()):
            out.insert(draw(st.integers(0, len(out))), "...")
        eq += "->" + "".join(out)
    elif mode == "junk":
        eq += draw(st.sampled_from(["->->", "-", ">", "->..", "->a.", ",", "->aa", "->z", " -> ",
                                    "->1", "->é"]))
    return eq, shapes


@settings(SETTINGS, max_examples=150)
@given(_equations())
def test_einsum_equation_matches_numpy(case: tuple[str, list[tuple[int, ...]]]) -> None:
    """Random equations (implicit and explicit outputs, ``...`` anywhere, size-1 broadcast dims,
    wrong sizes, junk): einjoin agrees with np.einsum, or raises an EinjoinError."""
    eq, shapes = case
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s) for s in shapes]
    ts = [ej.input(f"t{k}", s, "float64") for k, s in enumerate(shapes)]
    try:
        expect = np.einsum(eq, *arrays)
    except Exception:  # numpy refuses: einjoin must refuse too, unless torch takes it
        try:  # (torch sums '...' dims missing from the output, which numpy refuses)
            expect = torch.einsum(eq, *map(torch.from_numpy, arrays)).numpy()
        except Exception:
            expect = None
    try:
        out = ej.einsum(eq, *ts)
    except ej.EinjoinError:
        return  # refusing is allowed (einjoin is stricter about some broadcasts)
    assert expect is not None, f"einjoin accepted {eq!r} {shapes}, which numpy and torch refuse"
    got = ej.reference(out, *arrays)
    np.testing.assert_allclose(got, expect, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- composites vs torch


@SETTINGS
@given(eps=st.one_of(st.floats(-1e-3, 1e3), st.sampled_from([0.0, math.inf, math.nan, 1e-30])),
       dim=st.integers(-2, 1))
def test_norms_and_softmax_match_torch(eps: float, dim: int) -> None:
    x, t = _x(), torch.from_numpy(X.astype(np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = ej.reference([ej.layer_norm(x, eps=eps), ej.rms_norm(x, eps=eps), ej.softmax(x, dim),
                            ej.log_softmax(x, dim)], x=X)
    F = torch.nn.functional
    expect = [F.layer_norm(t, (4,), eps=eps), t * torch.rsqrt((t * t).mean(-1, keepdim=True) + eps),
              F.softmax(t, dim), F.log_softmax(t, dim)]
    for g, e in zip(got, expect):
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-4, atol=1e-5, equal_nan=True)


@SETTINGS
@given(base=st.floats(1.0001, 1e6), start=st.integers(-1000, 10 ** 6))
def test_rope_matches_torch(base: float, start: int) -> None:
    x = ej.input("r", (2, 5, 6), "float64")
    xs = np.random.default_rng(1).standard_normal((2, 5, 6))
    got = ej.reference(ej.rope(x, base=base, start=start), r=xs)
    t = torch.from_numpy(xs)
    inv = 1.0 / (base ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    ang = torch.outer(torch.arange(start, start + 5, dtype=torch.float64), inv)
    emb = torch.cat([ang, ang], -1)
    rot = torch.cat([-t[..., 3:], t[..., :3]], -1)
    np.testing.assert_allclose(got, (t * emb.cos() + rot * emb.sin()).numpy(), rtol=1e-6, atol=1e-6)


@SETTINGS
@given(scale=st.one_of(st.none(), st.floats(-4, 4), st.sampled_from([np.float32(0.25), 2])),
       causal=st.sampled_from([True, False, np.bool_(True)]))
def test_attention_matches_torch(scale: Any, causal: Any) -> None:
    q = ej.input("q", (2, 3, 4), "float64")
    qs = np.random.default_rng(2).standard_normal((2, 3, 4))
    got = ej.reference(ej.attention(q, q, q, causal=causal, scale=scale), q=qs)
    t = torch.from_numpy(qs)
    expect = torch.nn.functional.scaled_dot_product_attention(
        t, t, t, is_causal=bool(causal), scale=None if scale is None else float(scale))
    np.testing.assert_allclose(got, expect.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- constant folding (ir/fold.py)


_FOLD_OPS: dict[str, Callable[[Any], Any]] = {
    "neg": lambda t: ~t if t.dtype == "bool" else -t,
    "plus_one": lambda t: t & True if t.dtype == "bool" else t + 1,
    "square": lambda t: t & t if t.dtype == "bool" else t * t,
    "select": lambda t: t[1:, 2:],
    "expand": lambda t: t.unsqueeze(0).expand(2, 3, 4),
    "transpose": lambda t: t.T,
    "reshape": lambda t: t.reshape(3, 1, 4),
    **{f"to_{d}": (lambda d: lambda t: t.to(d))(d) for d in ("float64", "float32", "float16", "int64", "bool")},
}


@settings(SETTINGS, max_examples=60)
@given(expr=st.sampled_from(["x0", "x1", "x0 - x1", "x0 * 0.1", "x0 >= x1", "sin(x0 * 0.3)",
                             "x0 * x1 + 3", "where(x0 > x1, x0, -x1)", "7", "-0.0", "1e30"]),
       dtype=st.sampled_from(["float64", "float32", "float16", "bfloat16", "int64", "bool"]),
       op=st.sampled_from(sorted(_FOLD_OPS)))
def test_folding_never_changes_values(expr: str, dtype: str, op: str) -> None:
    """An op on a fill folds into one fill: its values and dtype must be those of the same op on
    an input fed the fill's values (which does not fold)."""
    try:
        f = ej.fill((3, 4), expr, dtype)
        folded = _FOLD_OPS[op](f)
    except ej.EinjoinError:
        return
    fed = ej.input("fold_in", (3, 4), dtype)
    plain = _FOLD_OPS[op](fed)
    a = ej.reference(folded)
    b = ej.reference(plain, fold_in=ej.reference(f))
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- aggregations, printing, models


@pytest.mark.parametrize("agg", [ej.ir.Agg("sum", np.multiply, 0.0, True, True),
                                 ej.ir.Agg("logaddexp", np.logaddexp, -math.inf, True, True),
                                 ej.ir.Agg("max", np.maximum, 0.0, True, True)])
def test_home_made_agg_is_refused(agg: Any) -> None:
    """An Agg instance that is not einjoin's was taken as is: ``Agg("sum", np.multiply, ...)``
    summed in the kernel and would multiply partials across blocks."""
    with pytest.raises(ej.ExpressionError, match="aggregation"):
        ej.einsum("ij->i", _x(), agg=agg)


def test_registered_agg_instances_still_work() -> None:
    for name in ("sum", "max", "min", "prod"):
        got = ej.reference(ej.einsum("ij->i", _x(), agg=ej.ir.AGGS[name]), x=X)
        np.testing.assert_allclose(got, getattr(np, name)(X, axis=1), rtol=1e-6)


@pytest.mark.parametrize("name", ["%0", "a b", "a\nb", "x)", ""])
def test_printed_graph_quotes_odd_input_names(name: str) -> None:
    """An input named "%0" printed as the op %0; "a\nb" broke the line."""
    if not name:
        with pytest.raises(ej.EinjoinError):
            ej.input(name, (2,))
        return
    text = str(ej.Graph(ej.input(name, (2,)) * 2))
    assert repr(name) in text and len(text.splitlines()) == 4


@pytest.mark.parametrize("call, fragment", [
    (lambda: build("matmul", foo=1), "'foo'"),
    (lambda: build(["matmul"]), "unknown model"),
    (lambda: build("chain", n=4, length=0), "length"),
    (lambda: build("chain", n=4, length=1.5), "length"),
    (lambda: build("llama-block", d=64, heads=0, hidden=8, seq=4), "heads"),
    (lambda: build("llama-block", d=64, heads=4, kv_heads=0, hidden=8, seq=4), "kv_heads"),
    (lambda: build("llama-7b-layers", layers=-1, d=64, heads=4, hidden=8, seq=4), "layers"),
    (lambda: llama_block(ej.input("x2", (4, 8))), "(batch, seq, d)"),
    (lambda: llama_block(None), "(batch, seq, d)"),
    (lambda: zoo_example("nope"), "unknown zoo model"),
    (lambda: zoo_example("mlp", foo=1), "'foo'"),
    (lambda: zoo_example("llama", foo=1), "'foo'"),
])
def test_models_refuse_bad_arguments(call: Callable[[], Any], fragment: str) -> None:
    """ZeroDivisionError (heads=0), TypeError (unknown keyword, float length), KeyError (zoo
    name), ValueError (a 2-D x) before; kv_heads=0 and layers <= 0 were silently accepted."""
    with pytest.raises(ej.EinjoinError) as info:
        call()
    assert fragment in str(info.value)


def test_models_still_build_and_match_torch() -> None:
    from einjoin.models.zoo import example
    module, args = example("mlp", dim=8, hidden=16, layers=2, batch=4)
    fn = ej.from_torch(module, args)
    got = ej.compile(fn, 2, quiet=True).run(*args)
    np.testing.assert_allclose(np.asarray(got), module(*args).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert build("chain", n=4, length=1).shape == (4, 4)


def build(*a: Any, **kw: Any) -> Any:
    from einjoin.models.graphs import build as b
    return b(*a, **kw)


def llama_block(*a: Any, **kw: Any) -> Any:
    from einjoin.models.graphs import llama_block as f
    return f(*a, **kw)


def zoo_example(*a: Any, **kw: Any) -> Any:
    from einjoin.models.zoo import example
    return example(*a, **kw)


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
