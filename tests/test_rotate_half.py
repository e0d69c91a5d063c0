"""The RotateHalf kind (rotary embedding's ``rotate_half``): its kernels against torch, bit for
bit; its gradient against torch's autograd; cut blocks; the fusion pass's rewrite of the captured
select / neg / concat chain (and of its gradient's form) into one node, with the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.errors import DTypeError, ShapeError
from einjoin.ir import ops
from einjoin.ir.dtypes import numpy_dtype
from einjoin.ir.fuse import fuse_elementwise
from einjoin.ir.graph import Graph
from einjoin.ir.rotate import as_rotate_half, rotate_half_kernel, rotate_half_node, rotate_half_torch


def _torch_rotate(x: torch.Tensor, axis: int) -> torch.Tensor:
    h = x.shape[axis] // 2
    x1, x2 = x.narrow(axis, 0, h), x.narrow(axis, h, h)
    return torch.cat((-x2, x1), dim=axis)


def _narrow(x: ej.Tensor, axis: int, start: int, size: int) -> ej.Tensor:
    axis %= x.ndim
    return x[(slice(None),) * axis + (slice(start, start + size),)]


def _chain(x: ej.Tensor, axis: int = -1, sign: int = 1) -> ej.Tensor:
    """The general chain a torch capture gives: selects, a negation, a concat."""
    n = x.shape[axis]
    lo, hi = _narrow(x, axis, 0, n // 2), _narrow(x, axis, n // 2, n // 2)
    return ej.concat([-hi, lo] if sign == 1 else [hi, -lo], axis)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)) if a.dtype.is_floating_point
                else torch.equal(a, b))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int64"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_the_kernels_are_torchs_rotate_half_bit_for_bit(dtype: str, axis: int) -> None:
    rng = np.random.default_rng(axis)
    t = torch.from_numpy(rng.standard_normal((4, 6, 8)) * 10).to(getattr(torch, dtype))
    t.view(-1)[3] = float("nan") if t.dtype.is_floating_point else 7
    want = _torch_rotate(t, axis)
    got = rotate_half_torch(t, axis, 1)
    assert _same(got, want) and _same(rotate_half_torch(t, axis, -1), -want)
    if dtype != "bfloat16":
        x = t.numpy()
        assert np.array_equal(rotate_half_kernel(x, axis, 1), want.numpy(), equal_nan=True)
        assert np.array_equal(rotate_half_kernel(x, axis, -1), -want.numpy(), equal_nan=True)
    # the IR's reference evaluates the node the same way
    node = rotate_half_node(ops.input_node("x", t.shape, dtype), axis)
    ref = ej.reference([node], x=t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
                       if dtype == "bfloat16" else t.numpy())[0]
    assert np.array_equal(np.asarray(ref).astype(np.float64), want.double().numpy(), equal_nan=True)


def test_bad_input_is_refused_naming_it() -> None:
    x = ops.input_node("x", (3, 5), "float32")
    with pytest.raises(ShapeError, match="even size"):
        rotate_half_node(x)
    with pytest.raises(ShapeError, match="out of range"):
        rotate_half_node(x, 2)
    with pytest.raises(ShapeError, match="sign"):
        rotate_half_node(ops.input_node("y", (4,), "float32"), sign=2)
    with pytest.raises(DTypeError, match="bool"):
        rotate_half_node(ops.input_node("u", (4,), "bool"))


def test_the_fusion_pass_rewrites_the_chain_and_its_gradient_into_one_node_each() -> None:
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((2, 3, 8)).astype(np.float32)
    cv = rng.standard_normal((3, 8)).astype(np.float32)
    x, c = ej.input("x", (2, 3, 8)), ej.input("c", (3, 8))
    y = (x * c + _chain(x) * (c * 2.0)).sum()
    (dx,) = ej.grad(y, [x])
    outs = [y.node, dx.node]
    kinds = [n.kind for n in Graph(outs).nodes]
    assert kinds.count("concat") == 2 and "rotatehalf" not in kinds  # the capture's chains
    fused = fuse_elementwise(outs)
    got = [n for n in Graph(fused).nodes if n.kind == "rotatehalf"]
    assert sorted(n.op.sign for n in got) == [-1, 1]  # the forward's and its gradient's
    assert not any(n.kind in ("concat", "select") for n in Graph(fused).nodes)
    before = ej.reference(outs, x=xv, c=cv)
    after = ej.reference(fused, x=xv, c=cv)
    for a, b in zip(before, after):
        assert np.array_equal(a, b)
    # torch's autograd of the same function
    tx = torch.from_numpy(xv).requires_grad_()
    tc = torch.from_numpy(cv)
    ty = (tx * tc + _torch_rotate(tx, 2) * (tc * 2.0)).sum()
    ty.backward()
    np.testing.assert_allclose(after[1], tx.grad.numpy(), rtol=1e-6, atol=1e-6)
    # compiled on two devices: the gradient bit for bit (the loss sums partials in another order);
    # the torch backend's joins are torch's arithmetic
    for backend in ("threads", "torch"):
        prog = ej.compile(outs, devices=ej.local(2), backend=backend)
        ran = [np.asarray(a) for a in prog.run(x=xv, c=cv)]
        assert sum(t.node.kind == "rotatehalf" for t in prog.taskgraph.tasks) >= 2
        np.testing.assert_allclose(ran[0], after[0], rtol=1e-5, atol=1e-5)
        if backend == "threads":
            assert np.array_equal(ran[1], after[1])
        np.testing.assert_allclose(ran[1], after[1], rtol=1e-6, atol=1e-6)


def test_only_halves_of_one_tensor_negated_as_rotate_half_are_rewritten() -> None:
    x, z = ej.input("x", (4, 6)), ej.input("z", (4, 6))
    assert as_rotate_half(_chain(x, 1).node).op.sign == 1
    assert as_rotate_half(_chain(x, 1, -1).node).op.sign == -1
    assert as_rotate_half(_chain(x, 0).node).op.axis == 0
    lo, hi = _narrow(x, 1, 0, 3), _narrow(x, 1, 3, 3)
    for other in (ej.concat([hi, lo], 1),                    # no negation
                  ej.concat([-lo, hi], 1),                   # halves swapped
                  ej.concat([-_narrow(z, 1, 3, 3), lo], 1),  # halves of two tensors
                  ej.concat([-hi, _narrow(x[:2], 1, 0, 3)], 0),  # a part of a half, another axis
                  ej.concat([-_narrow(x, 1, 4, 2), _narrow(x, 1, 0, 2)], 1)):  # not halves
        assert as_rotate_half(other.node) is None


@pytest.mark.parametrize("spec", [{"a": 2, "c": 2}, {"b": 3, "c": 4}, {"c": 3}])
def test_blocks_cut_along_the_rotated_dim_read_whole_rows(spec: dict[str, int]) -> None:
    rng = np.random.default_rng(1)
    xv = rng.standard_normal((4, 3, 8)).astype(np.float32)
    x = ej.input("x", (4, 3, 8))
    r = ej.rotate_half(x)
    assert r.node.kind == "rotatehalf"
    (got,) = ej.execute_blocked([r], {r: spec}, x=xv)
    assert np.array_equal(got, _torch_rotate(torch.from_numpy(xv), 2).numpy())


def test_rope_through_a_torch_module_matches_torch_and_uses_one_node() -> None:
    class Rope(torch.nn.Module):
        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            h = x.shape[-1] // 2  # as the zoo's rotate_half: slices, neg, cat
            return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin

    rng = np.random.default_rng(2)
    x, cos, sin = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((2, 5, 8), (5, 8), (5, 8)))
    prog = ej.compile(ej.from_torch(Rope(), (x, cos, sin)), devices=ej.local(2))
    got = np.asarray(prog.run(x, cos, sin))
    assert np.array_equal(got, Rope()(x, cos, sin).numpy())
    assert any(n.kind == "rotatehalf" for n in prog.graph.ops)
    assert not any(n.kind in ("concat", "select") for n in prog.graph.ops)


def test_a_rotation_of_a_transpose_is_done_first_and_the_transpose_read_through() -> None:
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    cv = rng.standard_normal((5, 8)).astype(np.float32)
    x, c = ej.input("x", (2, 5, 3, 8)), ej.input("c", (5, 8))
    t = x.transpose(1, 2)  # (batch, heads, seq, dim), as rotary's q and k
    y = t * c + ej.rotate_half(t) * (c * 0.5)
    unfused = [y.node]
    fused = fuse_elementwise(unfused)
    nodes = Graph(fused).nodes
    assert [n.kind for n in nodes if not n.facts.leaf] == ["rotatehalf", "einsum"]
    assert next(n for n in nodes if n.kind == "rotatehalf").inputs[0] is x.node  # rotated before the transpose
    assert np.array_equal(ej.reference(fused, x=xv, c=cv)[0], ej.reference(unfused, x=xv, c=cv)[0])
    # a rotation read by a non-elementwise op keeps its place (no transpose node would be saved)
    s = ej.rotate_half(t).sum(-1)
    assert fuse_elementwise([s.node])[0].inputs[0].kind == "rotatehalf"
