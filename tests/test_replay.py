"""A join expression replayed for arguments of fixed shapes and dtypes
(:class:`einjoin.ir.evaluate.Replay`, the prepared elementwise kernels' evaluator) gives
:func:`~einjoin.ir.evaluate.evaluate`'s bits on every call -- the recording one and the replays,
on new values each time -- and leaves its arguments alone; a program whose kernels replay gives
the reference executor's bits on every run."""

from __future__ import annotations

from typing import Any

import numpy as np
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.ir import FUNCTIONS, Arg, Call, Const
from einjoin.ir.evaluate import SlotProgram, evaluate
from einjoin.ir.scalar import Expr
from einjoin.plan.execute import run_reference

_FNS = sorted(n for n, f in FUNCTIONS.items() if f.rule in ("arith", "float") and n not in ("ipow", "floordiv", "mod"))
_leaf = st.one_of(st.integers(0, 2).map(Arg), st.sampled_from([0.5, 1.0, -2.0, 3, 2, 0.0]).map(Const))


def _calls(children: st.SearchStrategy) -> st.SearchStrategy:
    plain = st.sampled_from(_FNS).flatmap(
        lambda n: st.tuples(*[children] * FUNCTIONS[n].arity).map(lambda a: Call(n, a)))
    # a comparison inside where: an implementation the in-place path does not cover
    where = st.tuples(children, children, children).map(
        lambda a: Call("where", (Call("gt", (a[0], Const(0.0))), a[1], a[2])))
    return st.one_of(plain, where)


@settings(max_examples=examples(200), deadline=None)
@given(st.recursive(_leaf, _calls, max_leaves=10).filter(lambda e: isinstance(e, Call)),
       st.sampled_from([np.float32, np.float64]),
       st.sampled_from([[(3, 4), (3, 4), (3, 4)], [(3, 4), (4,), (3, 1)], [(2, 1, 4), (3, 4), (1,)], [(), (), ()],
                        [(5,), (), (5,)]]),
       st.integers(0, 2 ** 31))
def test_a_replay_gives_evaluates_bits_on_every_call(e: Expr, dtype: Any, shapes: list[tuple[int, ...]],
                                                     seed: int) -> None:
    rng = np.random.default_rng(seed)
    replay = SlotProgram(e).replay()
    for _ in range(3):  # the recording call, then replays; new values (special ones too) each time
        args = [np.asarray(rng.choice([-2.0, -0.5, 0.0, 1.0, 3.0, np.inf, np.nan], s), dtype) if rng.random() < 0.3
                else np.asarray(rng.uniform(-2, 2, s), dtype) for s in shapes]
        before = [a.copy() for a in args]
        with np.errstate(all="ignore"):
            want = evaluate(e, args)
            got = replay(args)
        for a, b in zip(args, before):
            np.testing.assert_array_equal(a, b)  # no argument written in place
        assert type(got) is type(want) and np.asarray(got).dtype == np.asarray(want).dtype
        assert np.array_equal(np.asarray(got), np.asarray(want), equal_nan=True)


def test_replays_take_the_fast_form_only_for_arrays() -> None:
    one = SlotProgram(Call("add", (Arg(0), Const(1.0)))).replay()
    x = np.arange(3.0)
    one([x]), one([x])
    assert one.fixed and len(one.steps) == 1
    e = Call("mul", (Call("exp", (Arg(0),)), Const(2.0)))
    scalar = SlotProgram(e).replay()
    z = np.array(1.0)  # 0-d: numpy scalars come back, which evaluate treats as Python numbers
    assert scalar([z]) == evaluate(e, [z]) and scalar([z]) == evaluate(e, [z])
    assert not scalar.fixed and scalar.generic


def test_a_program_replays_its_kernels_to_the_references_bits() -> None:
    rng = np.random.default_rng(3)
    x, b = ej.input("x", (16, 24)), ej.input("b", (24,))
    # fused elementwise chains (several steps, temporaries reused) and unfused single ufuncs
    outs = [ej.tanh(x * 1.5 + b) - x, ej.sigmoid(x) * x + (x * x) * 0.5, ((x - b) ** 2).sum(dim=1)]
    for fuse in (True, False):
        prog = ej.compile(outs, 2, backend="threads", fuse=fuse, quiet=True)
        by_name = prog.graph.input_by_name
        for _ in range(3):
            feeds = dict(x=rng.standard_normal((16, 24)).astype(np.float32),
                         b=rng.standard_normal(24).astype(np.float32))
            ref = run_reference(prog.taskgraph, prog.plan.decomps, {by_name[k]: v for k, v in feeds.items()})
            for a, r in zip(prog.run(**feeds), ref):
                assert a.dtype == r.dtype and np.array_equal(a, r, equal_nan=True)
