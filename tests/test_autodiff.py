"""ej.grad against torch.autograd (float64): random compositions of the public ops, on
ej.reference and compiled for 1, 2 and 3 devices; plus the API's contracts (list in wrt order,
zeros for unreachable tensors, int wrt refused, dtypes), stop_gradient, a Hessian-vector
product, ties, zeros in products and causal -inf masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin as ej
from einjoin.ir import Graph
from einjoin.ir.scalar import is_product

B, S, D, V = 2, 3, 4, 7


def close(got, want, what="", floor=0.0):
    """rtol 1e-6, atol 1e-7 x the largest entry (the issue's float64 acceptance), and at least
    ``floor``: a gradient that is exactly 0 in exact arithmetic (d/d beta of layer_norm then softmax
    over the normalised dim) comes out as rounding noise, ~eps x the terms summed, in both einjoin
    and torch, and a tolerance relative to that noise compares noise."""
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=max(1e-7 * scale, floor, 1e-30), err_msg=what)


def _noise_floor(*arrays) -> float:
    """64 float64 ulps of the largest magnitude involved (inputs, cotangents, gradients): far
    below any wrong gradient's error (a wrong VJP rule is off by O(1) x these magnitudes)."""
    mag = max([1.0] + [float(np.abs(np.asarray(a, dtype=np.float64)).max()) for a in arrays if np.size(a)])
    return 64 * float(np.finfo(np.float64).eps) * mag


# ---------------------------------------------------------------- random compositions

def _ops(dim: int, keep: bool):
    """name -> (einjoin fn, torch fn) of (h, params); every op maps (B, S, D) to (B, S, D)."""
    return {
        "matmul": (lambda h, p: h @ p["w"], lambda h, p: h @ p["w"]),
        "transpose": (lambda h, p: (h.transpose(1, 2) @ p["w2"]).transpose(1, 2),
                      lambda h, p: (h.transpose(1, 2) @ p["w2"]).transpose(1, 2)),
        "tanh": (lambda h, p: h.tanh(), lambda h, p: h.tanh()),
        "sigmoid": (lambda h, p: h.sigmoid(), lambda h, p: h.sigmoid()),
        "silu": (lambda h, p: ej.silu(h), lambda h, p: F.silu(h)),
        "gelu": (lambda h, p: ej.gelu(h), lambda h, p: F.gelu(h)),
        "exp": (lambda h, p: h.tanh().exp(), lambda h, p: h.tanh().exp()),
        "log": (lambda h, p: (h * h + 1.0).log(), lambda h, p: (h * h + 1.0).log()),
        "div": (lambda h, p: h / (h * h + 1.0), lambda h, p: h / (h * h + 1.0)),
        "softmax": (lambda h, p: ej.softmax(h, dim), lambda h, p: torch.softmax(h, dim)),
        "log_softmax": (lambda h, p: ej.log_softmax(h, dim), lambda h, p: torch.log_softmax(h, dim)),
        "rms_norm": (lambda h, p: ej.rms_norm(h, p["gamma"]),
                     lambda h, p: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * p["gamma"]),
        "layer_norm": (lambda h, p: ej.layer_norm(h, None, p["gamma"], p["beta"]),
                       lambda h, p: F.layer_norm(h, (D,), p["gamma"], p["beta"])),
        "max": (lambda h, p: h - _keep(h.max(dim, keepdim=keep), dim, keep),
                lambda h, p: h - _keep(h.amax(dim, keepdim=keep), dim, keep)),
        "min": (lambda h, p: h * _keep(h.min(dim, keepdim=keep), dim, keep),
                lambda h, p: h * _keep(h.amin(dim, keepdim=keep), dim, keep)),
        "sum": (lambda h, p: h + _keep(h.sum(dim, keepdim=keep), dim, keep),
                lambda h, p: h + _keep(h.sum(dim, keepdim=keep), dim, keep)),
        "mean": (lambda h, p: h * _keep(h.mean(dim, keepdim=keep), dim, keep),
                 lambda h, p: h * _keep(h.mean(dim, keepdim=keep), dim, keep)),
        "concat": (lambda h, p: ej.concat([h[..., 1:], h[..., :1] * 2.0], -1),
                   lambda h, p: torch.cat([h[..., 1:], h[..., :1] * 2.0], -1)),
        "reshape": (lambda h, p: (h.reshape(B * S, D) @ p["w"]).reshape(B, S, D),
                    lambda h, p: (h.reshape(B * S, D) @ p["w"]).reshape(B, S, D)),
        "maximum": (lambda h, p: ej.maximum(h, h.tanh() * 0.5 + 0.1),
                    lambda h, p: torch.maximum(h, h.tanh() * 0.5 + 0.1)),
        "bias": (lambda h, p: h + p["b"], lambda h, p: h + p["b"]),
        "embedding": (lambda h, p: h + ej.embedding(p["tokens"], p["table"]),
                      lambda h, p: h + F.embedding(p["tokens"], p["table"])),
        "rope": (lambda h, p: ej.rope(h), lambda h, p: _torch_rope(h)),
        "attention": (lambda h, p: ej.attention(h @ p["wq"], h, h, causal=True),
                      lambda h, p: F.scaled_dot_product_attention(h @ p["wq"], h, h, is_causal=True)),
    }


def _torch_rope(x, base=10000.0):
    s, d = x.shape[-2:]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def _fed(outputs, feeds):
    """The feeds the graph of ``outputs`` reads (a gradient may not read every input)."""
    names = {x.op.name for x in Graph([t.node for t in outputs]).inputs}
    return {k: v for k, v in feeds.items() if k in names}


def _keep(r, dim, keep):
    return r if keep else r.unsqueeze(dim)


OP_NAMES = list(_ops(0, True))
PARAM_SHAPES = {"x": (B, S, D), "w": (D, D), "w2": (S, S), "wq": (D, D), "gamma": (D,), "beta": (D,),
                "b": (D,), "table": (V, D), "r": (B, S, D)}


def _problem(seed: int, steps: list[tuple[str, int, bool]]):
    rng = np.random.default_rng(seed)
    vals = {k: rng.normal(size=s) for k, s in PARAM_SHAPES.items()}
    tokens = rng.integers(0, V, (B, S))
    ejp = {k: ej.input(k, s, "float64") for k, s in PARAM_SHAPES.items()}
    ejp["tokens"] = ej.input("tokens", (B, S), "int64")
    thp = {k: torch.tensor(v, requires_grad=True) for k, v in vals.items()}
    thp["tokens"] = torch.tensor(tokens)
    h, th = ejp["x"], thp["x"]
    for name, dim, keep in steps:
        f, g = _ops(dim, keep)[name]
        h, th = f(h, ejp), g(th, thp)
    loss = (h * ejp["r"]).sum()
    tloss = (th * thp["r"]).sum()
    names = [k for k in PARAM_SHAPES if k != "r"]
    grads = ej.grad(loss, [ejp[k] for k in names])
    tgrads = torch.autograd.grad(tloss, [thp[k] for k in names], allow_unused=True)
    want = [np.zeros(PARAM_SHAPES[k]) if t is None else t.numpy() for k, t in zip(names, tgrads)]
    feeds = dict(vals, tokens=tokens)
    return loss, grads, tloss.item(), want, feeds, names


steps_st = st.lists(st.tuples(st.sampled_from(OP_NAMES), st.integers(0, 2), st.booleans()),
                    min_size=1, max_size=4)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), steps=steps_st)
def test_random_compositions_match_torch_on_reference(seed, steps):
    loss, grads, tloss, want, feeds, names = _problem(seed, steps)
    got = ej.reference([loss, *grads], **_fed([loss, *grads], feeds))
    close(got[0], tloss, "loss")
    floor = _noise_floor(*(feeds[k] for k in PARAM_SHAPES), *want)
    for name, g, w, t in zip(names, got[1:], want, grads):
        assert t.dtype == "float64" and t.shape == PARAM_SHAPES[name]
        close(g, w, f"d loss / d {name} after {steps}", floor)


def test_every_public_op_alone_matches_torch():
    """Each op of the list once, with each dim and keepdim (the random compositions may miss one)."""
    for name in OP_NAMES:
        for dim in (0, 1, 2) if name in ("softmax", "log_softmax", "max", "min", "sum", "mean") else (2,):
            for keep in (True, False):
                loss, grads, tloss, want, feeds, names = _problem(dim, [(name, dim, keep)])
                got = ej.reference([loss, *grads], **_fed([loss, *grads], feeds))
                for n, g, w in zip(names, got[1:], want):
                    close(g, w, f"{name} dim={dim} keepdim={keep}: d/d{n}")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), steps=steps_st, devices=st.sampled_from([1, 2, 3]))
def test_random_compositions_match_torch_compiled(seed, steps, devices):
    loss, grads, tloss, want, feeds, names = _problem(seed, steps)
    outs = [loss, *grads]
    # one output per distinct node (two zero gradients of one shape are one fill)
    distinct = list({id(t.node): t for t in outs}.values())
    prog = ej.compile(distinct, devices=devices, quiet=True)
    vals = dict(zip((id(t.node) for t in distinct), prog.run(**_fed(distinct, feeds))))
    close(vals[id(loss.node)], tloss, "loss")
    floor = _noise_floor(*(feeds[k] for k in PARAM_SHAPES), *want)
    for name, g, w in zip(names, grads, want):
        close(vals[id(g.node)], w, f"compiled on {devices}: d/d{name} after {steps}", floor)


@pytest.mark.parametrize("devices", [1, 2, 3])
def test_attention_block_compiled(devices):
    steps = [("rms_norm", 2, True), ("attention", 2, True), ("matmul", 2, True), ("gelu", 2, True),
             ("embedding", 2, True), ("softmax", 1, True)]
    loss, grads, tloss, want, feeds, names = _problem(devices, steps)
    prog = ej.compile([loss, *grads], devices=devices, quiet=True)
    got = prog.run(**_fed([loss, *grads], feeds))
    close(got[0], tloss, "loss")
    for n, g, w in zip(names, got[1:], want):
        close(g, w, f"d/d{n} on {devices} devices")


# ---------------------------------------------------------------- higher order, stop_gradient

def test_hessian_vector_product_matches_torch():
    rng = np.random.default_rng(1)
    A, x0, v0 = rng.normal(size=(5, 4)), rng.normal(size=4), rng.normal(size=4)
    a, x, v = (ej.input(n, s, "float64") for n, s in (("a", (5, 4)), ("x", (4,)), ("v", (4,))))
    f = ej.softmax(a @ x, -1).log().sum() + (a @ x).tanh().sum()
    (gx,) = ej.grad(f, [x])
    (hv,) = ej.grad((gx * v).sum(), [x])
    ta, tx, tv = torch.tensor(A), torch.tensor(x0, requires_grad=True), torch.tensor(v0)
    tf = torch.softmax(ta @ tx, -1).log().sum() + (ta @ tx).tanh().sum()
    (tg,) = torch.autograd.grad(tf, [tx], create_graph=True)
    (thv,) = torch.autograd.grad((tg * tv).sum(), [tx])
    close(ej.reference(hv, a=A, x=x0, v=v0), thv.numpy(), "Hessian-vector product")


def test_stop_gradient_is_detach():
    rng = np.random.default_rng(2)
    x0 = rng.normal(size=(3, 4))
    x = ej.input("x", (3, 4), "float64")
    y = (x.tanh() * ej.stop_gradient(x.exp())).sum() + ej.stop_gradient(x).sum()
    (dx,) = ej.grad(y, [x])
    tx = torch.tensor(x0, requires_grad=True)
    (want,) = torch.autograd.grad((tx.tanh() * tx.exp().detach()).sum() + tx.detach().sum(), [tx])
    close(ej.reference(dx, x=x0), want.numpy(), "through stop_gradient")
    close(ej.reference(ej.stop_gradient(x), x=x0), x0, "stop_gradient's value")
    (dz,) = ej.grad(ej.stop_gradient(x).sum(), [x])
    assert dz.node.facts.free and not ej.reference(dz).any()
    mask = x > 0
    assert ej.stop_gradient(mask) is mask


# ---------------------------------------------------------------- the API's contracts

def test_list_in_wrt_order_one_tensor_and_repeats():
    x, w = ej.input("x", (2, 3), "float64"), ej.input("w", (3, 2), "float64")
    loss = (x @ w).tanh().sum()
    dx, dw = ej.grad(loss, [x, w])
    dw2, dx2 = ej.grad(loss, [w, x])
    assert (dx.shape, dw.shape) == ((2, 3), (3, 2))
    assert dx2.node is dx.node and dw2.node is dw.node  # hash-consed: the same graph
    one = ej.grad(loss, x)
    assert isinstance(one, list) and len(one) == 1 and one[0].node is dx.node
    twice = ej.grad(loss, [x, x])
    assert twice[0].node is twice[1].node is dx.node
    value, grads = ej.value_and_grad(loss, [w])
    assert value is loss and grads[0].node is dw.node


def test_unreachable_wrt_is_an_exact_zero():
    x, z = ej.input("x", (2, 3), "float64"), ej.input("z", (4,), "float32")
    tokens = ej.input("tok", (2,), "int64")
    loss = x.exp().sum()
    dx, dz = ej.grad(loss, [x, z])
    assert dz.shape == (4,) and dz.dtype == "float32" and dz.node.facts.free
    assert not ej.reference(dz).any()
    # reached only through an int value (a comparison, a cast to int): the gradient is zero too
    (dx2,) = ej.grad(((x > 0).to("float64") * 2.0).sum() + tokens.to("float64").sum(), [x])
    assert dx2.node.facts.free
    # an intermediate tensor as wrt: torch's retain_grad
    h = x.tanh()
    (dh,) = ej.grad((h * h).sum(), [h])
    x0 = np.random.default_rng(3).normal(size=(2, 3))
    close(ej.reference(dh, x=x0), 2 * np.tanh(x0), "w.r.t. an intermediate")


def test_int_or_bool_wrt_is_an_error_naming_it():
    x = ej.input("x", (3,), "float64")
    tokens = ej.input("tokens", (3,), "int64")
    with pytest.raises(ej.EinjoinError, match="tokens.*int64"):
        ej.grad(x.sum(), [x, tokens])
    with pytest.raises(ej.EinjoinError, match="bool"):
        ej.grad(x.sum(), [x > 0])


def test_non_scalar_y_needs_a_cotangent_of_its_shape():
    x = ej.input("x", (3, 2), "float64")
    y = x.tanh()
    with pytest.raises(ej.ShapeError, match=r"\(3, 2\)"):
        ej.grad(y, [x])
    with pytest.raises(ej.ShapeError, match=r"\(2, 3\)"):
        ej.grad(y, [x], cotangent=ej.input("g", (2, 3), "float64"))
    g = ej.input("g", (3, 2), "float64")
    (dx,) = ej.grad(y, [x], cotangent=g)
    rng = np.random.default_rng(4)
    x0, g0 = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    tx = torch.tensor(x0, requires_grad=True)
    (want,) = torch.autograd.grad(tx.tanh(), [tx], grad_outputs=torch.tensor(g0))
    close(ej.reference(dx, x=x0, g=g0), want.numpy(), "vjp with a cotangent")
    # a one-element y needs none; vjp sums over several outputs
    (d1,) = ej.grad(x.sum().reshape(1, 1), [x])
    assert np.array_equal(ej.reference(d1), np.ones((3, 2)))
    (dv,) = ej.vjp([y, x * 3.0], [g, ej.full((3, 2), 1.0, "float64")], [x])
    close(ej.reference(dv, **_fed([dv], {"x": x0, "g": g0})), want.numpy() + 3.0, "vjp of two outputs")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gradients_keep_the_dtype(dtype):
    rng = np.random.default_rng(5)
    x0, w0 = rng.normal(size=(4, 8)), rng.normal(size=(8, 3)) * 0.3
    x, w = ej.input("x", (4, 8), dtype), ej.input("w", (8, 3), dtype)
    loss = ej.softmax(x @ w, -1).max(-1).sum()
    dx, dw = ej.grad(loss, [x, w])
    assert (dx.dtype, dw.dtype) == (dtype, dtype)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tx, tw = torch.tensor(x0, dtype=tdt, requires_grad=True), torch.tensor(w0, dtype=tdt, requires_grad=True)
    want = torch.autograd.grad(torch.softmax(tx @ tw, -1).amax(-1).sum(), [tx, tw])
    got = ej.reference([dx, dw], x=x0.astype(np.float32).astype(ej.ir.dtypes.numpy_dtype(dtype)),
                       w=w0.astype(np.float32).astype(ej.ir.dtypes.numpy_dtype(dtype)))
    tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for g, t in zip(got, want):
        ref = t.float().numpy()
        np.testing.assert_allclose(np.asarray(g, np.float32), ref, atol=tol * np.abs(ref).max(), rtol=tol)


def test_mixed_dtypes_cast_back():
    x, w = ej.input("x", (3, 4), "float64"), ej.input("w", (4,), "float32")
    loss = (x * w.to("float64")).sum()
    dx, dw = ej.grad(loss, [x, w])
    assert (dx.dtype, dw.dtype) == ("float64", "float32")
    x0 = np.random.default_rng(6).normal(size=(3, 4))
    close(ej.reference(dw, x=x0), x0.sum(0).astype(np.float32), "through a cast")


# ---------------------------------------------------------------- rules' edge cases

def test_contraction_adjoint_is_a_plain_contraction():
    a, b = ej.input("a", (5, 3), "float64"), ej.input("b", (3, 4), "float64")
    g = ej.input("g", (5, 4), "float64")
    da, db = ej.grad(a @ b, [a, b], cotangent=g)
    for d in (da, db):
        assert d.node.kind == "einsum" and is_product(d.node.op.join, 2) and d.node.op.agg.name == "sum"
    assert set(da.node.inputs) == {g.node, b.node} and set(db.node.inputs) == {g.node, a.node}


def test_backward_reuses_forward_nodes():
    x = ej.input("x", (4, 6), "float64")
    y = ej.softmax(x, -1)
    loss = (y * y).sum()
    (dx,) = ej.grad(loss, [x])
    fwd = set(Graph([loss.node]).ops)
    both = Graph([loss.node, dx.node]).ops
    # one max, one exp and one sum reduction in the whole graph: the backward reads the forward's
    assert sum(1 for n in both if n.kind == "einsum" and n.op.agg.name == "max") == 1
    assert y.node in set(both) and fwd <= set(both)
    # an elementwise op's derivative reads its output: exp' = exp is the plain product g * y
    e = x.exp()
    g = ej.input("g", (4, 6), "float64")
    (de,) = ej.grad(e, [x], cotangent=g)
    assert set(de.node.inputs) == {g.node, e.node} and is_product(de.node.op.join, 2)


@pytest.mark.parametrize("eq,shapes", [("ii->i", [(4, 4)]), ("ii->", [(3, 3)]), ("iij->j", [(3, 3, 2)]),
                                       ("ij->", [(3, 4)]), ("ij,jk->i", [(2, 3), (3, 4)]),
                                       ("ij,kl->ik", [(2, 3), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
                                       ("ii,ij->j", [(3, 3), (3, 2)])])
def test_einsum_labels_diagonal_and_summed_away(eq, shapes):
    rng = np.random.default_rng(7)
    vals = [rng.normal(size=s) for s in shapes]
    xs = [ej.input(f"x{k}", s, "float64") for k, s in enumerate(shapes)]
    y = ej.einsum(eq, *xs)
    r = rng.normal(size=y.shape)
    loss = (y * ej.input("r", y.shape, "float64")).sum() if y.ndim else y * 1.5
    grads = ej.grad(loss, xs)
    ts = [torch.tensor(v, requires_grad=True) for v in vals]
    ty = torch.einsum(eq, *ts)
    tl = (ty * torch.tensor(r)).sum() if ty.ndim else ty * 1.5
    want = torch.autograd.grad(tl, ts)
    feeds = {f"x{k}": v for k, v in enumerate(vals)}
    if y.ndim:
        feeds["r"] = r
    for g, w in zip(ej.reference(grads, **_fed(grads, feeds)), want):
        close(g, w.numpy(), eq)


def test_max_ties_split_evenly_as_torch_amax():
    x0 = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    x = ej.input("x", (2, 4), "float64")
    for op in ("max", "min"):
        (dx,) = ej.grad(getattr(x, op)(-1).sum() + getattr(x, op)().sum() * 2.0, [x])
        tx = torch.tensor(x0, requires_grad=True)
        t = getattr(tx, "a" + op)
        (want,) = torch.autograd.grad(t(-1).sum() + t() * 2.0, [tx])
        close(ej.reference(dx, x=x0), want.numpy(), f"{op} ties")
    (dm,) = ej.grad(ej.maximum(x, 2.0).sum(), [x])
    (want,) = torch.autograd.grad(torch.maximum(tx, torch.tensor(2.0, dtype=torch.float64)).sum(), [tx])
    close(ej.reference(dm, x=x0), want.numpy(), "maximum ties")


def test_prod_with_zeros_has_no_nan():
    x0 = np.array([[1.5, 0.0, 2.0], [0.0, 3.0, 0.0], [0.5, 2.0, -1.0], [0.0, 0.0, 0.0]])
    x = ej.input("x", (4, 3), "float64")
    (dx,) = ej.grad(x.prod(-1).sum() + x.prod(0).sum(), [x])
    tx = torch.tensor(x0, requires_grad=True)
    (want,) = torch.autograd.grad(tx.prod(-1).sum() + tx.prod(0).sum(), [tx])
    got = ej.reference(dx, x=x0)
    assert np.isfinite(got).all()
    close(got, want.numpy(), "prod with zeros")


@pytest.mark.parametrize("variant", ["gqa", "mask", "plain", "scale"])
def test_attention_variants_match_torch(variant):
    rng = np.random.default_rng(10)
    hq = 4 if variant == "gqa" else 2
    shapes = {"q": (2, hq, 5, 4), "k": (2, 2, 5, 4), "v": (2, 2, 5, 3)}
    vals = {k: rng.normal(size=s) for k, s in shapes.items()}
    mask0 = rng.random((5, 5)) < 0.7
    np.fill_diagonal(mask0, True)  # every query may attend somewhere
    t = {k: ej.input(k, s, "float64") for k, s in shapes.items()}
    th = {k: torch.tensor(v, requires_grad=True) for k, v in vals.items()}
    kw = {"gqa": {}, "mask": {"mask": ej.input("m", (5, 5), "bool"), "causal": False},
          "plain": {"causal": False}, "scale": {"scale": 0.3}}[variant]
    out = ej.attention(t["q"], t["k"], t["v"], **kw)
    tk, tv = th["k"], th["v"]
    if variant == "gqa":
        tk, tv = tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1)
    tkw = {"gqa": {"is_causal": True}, "mask": {"attn_mask": torch.tensor(mask0)}, "plain": {},
           "scale": {"is_causal": True, "scale": 0.3}}[variant]
    tout = F.scaled_dot_product_attention(th["q"], tk, tv, **tkw)
    r0 = rng.normal(size=out.shape)
    loss = (out * ej.input("r", out.shape, "float64")).sum()
    grads = ej.grad(loss, [t["q"], t["k"], t["v"]])
    want = torch.autograd.grad((tout * torch.tensor(r0)).sum(), [th["q"], th["k"], th["v"]])
    got = ej.reference(grads, **_fed(grads, dict(vals, r=r0, m=mask0)))
    for g, w, n in zip(got, want, "qkv"):
        close(g, w.numpy(), f"{variant} attention d/d{n}")


def test_causal_masks_get_exact_zero_not_nan():
    rng = np.random.default_rng(8)
    q0, k0, v0 = (rng.normal(size=(2, 2, 5, 4)) for _ in range(3))
    q, k, v = (ej.input(n, (2, 2, 5, 4), "float64") for n in "qkv")
    out = ej.attention(q, k, v, causal=True)
    r0 = rng.normal(size=out.shape)
    loss = (out * ej.input("r", out.shape, "float64")).sum()
    grads = ej.grad(loss, [q, k, v])
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q0, k0, v0))
    tl = (F.scaled_dot_product_attention(tq, tk, tv, is_causal=True) * torch.tensor(r0)).sum()
    want = torch.autograd.grad(tl, [tq, tk, tv])
    got = ej.reference(grads, q=q0, k=k0, v=v0, r=r0)
    for g, w, n in zip(got, want, "qkv"):
        assert np.isfinite(g).all(), n
        close(g, w.numpy(), f"causal attention d/d{n}")
    # the scores themselves: a masked position's cotangent is exactly 0
    s = ej.input("s", (5, 5), "float64")
    masked = ej.where(ej.causal_mask(5), s, float("-inf"))
    (ds,) = ej.grad((ej.softmax(masked, -1) * ej.input("r2", (5, 5), "float64")).sum()
                    + ej.log_softmax(masked, -1).max(-1).sum(), [s])
    got = ej.reference(ds, s=rng.normal(size=(5, 5)), r2=rng.normal(size=(5, 5)))
    assert np.isfinite(got).all() and (got[np.triu_indices(5, 1)] == 0).all()


# ---------------------------------------------------------------- gradient programs run anywhere

def _mlp_grads():
    rng = np.random.default_rng(9)
    shapes = {"x": (32, 16), "w1": (16, 48), "w2": (48, 8), "b1": (48,)}
    vals = {k: rng.normal(size=s) for k, s in shapes.items()}
    t = {k: ej.input(k, s, "float64") for k, s in shapes.items()}
    loss = ej.log_softmax(ej.silu(t["x"] @ t["w1"] + t["b1"]) @ t["w2"], -1).max(-1).mean()
    return [loss, *ej.grad(loss, [t["w1"], t["w2"], t["b1"]])], vals


@pytest.mark.parametrize("backend", ["sync", "threads", "null"])
def test_gradient_programs_run_on_every_backend(backend):
    outs, feeds = _mlp_grads()
    want = ej.reference(outs, **feeds)
    prog = ej.compile(outs, devices=2, backend=backend, quiet=True)
    got = prog.run(**feeds)
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    if backend == "null":
        assert got is None
        return
    for g, w in zip(got, want):
        close(g, w, backend)


def test_gradient_program_under_a_memory_cap():
    outs, feeds = _mlp_grads()
    want = ej.reference(outs, **feeds)
    free = ej.compile(outs, devices=2, backend="null", quiet=True)
    free.run(**feeds)
    cap = max(free.run_stats.peak_bytes_per_device.values()) // 2
    prog = ej.compile(outs, devices=2, memory_limit=cap, quiet=True)
    got = prog.run(**feeds)
    assert max(prog.run_stats.peak_bytes_per_device.values()) <= cap
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    for g, w in zip(got, want):
        close(g, w, "under a memory cap")


@pytest.mark.xdist_group("ray")
def test_gradient_program_on_ray(ray_backend):
    outs, feeds = _mlp_grads()
    want = ej.reference(outs, **feeds)
    cluster = ej.ray_cluster(devices_per_node=1)
    # the session's backend (tests/conftest.py): its actors for this shape serve test_ray's too
    prog = ej.compile(outs, devices=cluster, backend=ray_backend, quiet=True)
    got = prog.run(**feeds)
    assert prog.run_stats.bytes_moved == prog.stats.bytes_moved
    for g, w in zip(got, want):
        close(g, w, "on ray")
