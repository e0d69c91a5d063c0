"""The reverse pass merges cotangents that are pieces in zeros (a select's adjoint) along one axis
when the pieces do not overlap (einjoin.autodiff.backward._merge_padded): rotary's rotate_half
reads both halves of a tensor, and its gradient is one concat of the two halves' cotangents, with
no zero fill and one addend fewer. Checked against torch.autograd (float64) on reference and on
2 devices, and on random select ranges (overlapping ones are summed as they are)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej
from einjoin.ir import Graph
from einjoin.ir.node import Concat, Fill


def _rotate_half(x):
    h = x.shape[-1] // 2
    cat = ej.concat if isinstance(x, ej.Tensor) else torch.cat
    return cat([-x[..., h:], x[..., :h]], -1)


def _zero_fills(*outs) -> int:
    return sum(1 for n in Graph([o.node for o in outs]).nodes
               if isinstance(n.op, Fill) and n.op.expr == ej.ir.scalar.Const(0))


def test_rotate_half_gradient_is_one_concat():
    rng = np.random.default_rng(0)
    xv, cv, sv, gv = (rng.standard_normal(s) for s in [(2, 3, 8), (3, 8), (3, 8), (2, 3, 8)])
    x = ej.input("x", (2, 3, 8), "float64")
    cos, sin, g = (ej.input(n, v.shape, "float64") for n, v in [("cos", cv), ("sin", sv), ("g", gv)])
    loss = ((x * cos + _rotate_half(x) * sin) * g).sum()
    (dx,) = ej.grad(loss, [x])
    assert _zero_fills(dx) == 0  # the two halves' pieces meet in one concat
    assert sum(isinstance(n.op, Concat) for n in Graph([dx.node]).nodes) == 1  # (dx does not read the forward)
    tx = torch.tensor(xv, requires_grad=True)
    tc, ts, tg = (torch.tensor(v) for v in (cv, sv, gv))
    ((tx * tc + _rotate_half(tx) * ts) * tg).sum().backward()
    feeds = {"cos": cv, "sin": sv, "g": gv}  # dx does not read x (linear)
    np.testing.assert_allclose(ej.reference(dx, **feeds), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    prog = ej.compile([dx], 2, backend="threads", quiet=True)
    np.testing.assert_allclose(prog.run(**feeds)[0], tx.grad.numpy(), rtol=1e-12, atol=1e-12)


@settings(max_examples=examples(40), deadline=None)
@given(cuts=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 10)), min_size=2, max_size=4),
       seed=st.integers(0, 2 ** 16))
def test_selects_of_one_tensor_against_torch(cuts, seed):
    """Weighted selects of one tensor along its last axis (disjoint, touching, gapped or
    overlapping ranges): its gradient equals torch's; disjoint pieces leave no zero fill between
    two of them."""
    ranges = [(a, a + w) for a, w in cuts if a + w <= 10]
    if len(ranges) < 2:
        ranges = [(0, 3), (5, 10)]
    rng = np.random.default_rng(seed)
    xv = rng.standard_normal((3, 10))
    ws = [rng.standard_normal((3, b - a)) for a, b in ranges]
    x = ej.input("x", (3, 10), "float64")
    loss = sum(((x[:, a:b] * ej.input(f"w{i}", w.shape, "float64")).sum() for i, ((a, b), w)
                in enumerate(zip(ranges, ws))), ej.full((), 0.0, "float64"))
    (dx,) = ej.grad(loss, [x])
    tx = torch.tensor(xv, requires_grad=True)
    sum((tx[:, a:b] * torch.tensor(w)).sum() for (a, b), w in zip(ranges, ws)).backward()
    feeds = {f"w{i}": w for i, w in enumerate(ws)}  # dx does not read x (linear)
    np.testing.assert_allclose(ej.reference(dx, **feeds), tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    spans = sorted(ranges)
    if spans[0][0] == 0 and spans[-1][1] == 10 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        assert _zero_fills(dx) == 0  # the pieces tile the axis: one concat of them, no zeros
