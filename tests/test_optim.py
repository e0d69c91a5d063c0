"""ej.optim: optimizer steps and gradient clipping as EinSum graphs, against torch.optim and
torch.nn.utils.clip_grad_norm_ on the same parameters and gradients, several steps in a row
(the state is fed back by hand), with ej.reference and compiled on 2 and 3 devices."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from budget import examples

import einjoin as ej

SHAPES = {"w": (6, 5), "b": (5,), "s": ()}


def _data(dtype: str, steps: int, seed: int = 0, shapes: dict = SHAPES):
    rng = np.random.default_rng(seed)
    p0 = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()} for _ in range(steps)]
    return p0, grads


def _ours(opt, p0, grads, how, lrs=None):
    """Parameters and state after each step, run with ej.reference or compiled on `how` devices."""
    params = {n: ej.param(n, v.shape, v.dtype.name) for n, v in p0.items()}
    gins = {n: ej.input(f"grad.{n}", v.shape, v.dtype.name) for n, v in p0.items()}
    up = opt.update(params, gins)
    names, snames = list(up.params), list(up.state_out)
    assert sorted(up.state_in) == sorted(snames)
    outs = [*up.params.values(), *up.state_out.values()]
    if how == "reference":
        def run(feeds):
            return ej.reference(outs, **feeds)
    else:
        prog = ej.compile(outs, devices=how, quiet=True)

        def run(feeds):
            return prog.run(**feeds)
    ps, state = dict(p0), up.init_state(p0)
    history = []
    for k, g in enumerate(grads):
        hyper = up.hyper_values(None if lrs is None else lrs[k])
        res = run({**ps, **{f"grad.{n}": v for n, v in g.items()}, **state, **hyper})
        ps = dict(zip(names, res[:len(names)]))
        state = dict(zip(snames, res[len(names):]))
        history.append((ps, state))
    return history


def _torch(make, p0, grads, lrs=None):
    ts = {n: torch.tensor(v.copy(), requires_grad=True) for n, v in p0.items()}
    opt = make(list(ts.values()))
    history = []
    for k, g in enumerate(grads):
        for n, t in ts.items():
            t.grad = torch.from_numpy(g[n].copy())
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[k]
        opt.step()
        state = {}
        for n, t in ts.items():
            for key, v in opt.state[t].items():
                state[f"{key}.{n}" if key != "step" else "step"] = v.detach().numpy().copy()
        history.append(({n: t.detach().numpy().copy() for n, t in ts.items()}, state))
    return history


def _close(ours, theirs, dtype):
    rtol = 1e-12 if dtype == "float64" else 2e-6
    for k, ((p, s), (tp, ts)) in enumerate(zip(ours, theirs)):
        for n in tp:
            assert p[n].dtype == tp[n].dtype, (k, n)
            # per step ~1 ulp; errors compound over steps (a param near 0 gets an absolute bound)
            np.testing.assert_allclose(p[n], tp[n], rtol=rtol * (k + 1), atol=rtol * (k + 1),
                                       err_msg=f"param {n} after step {k + 1}")
        for key, v in ts.items():
            if key == "step":
                assert float(s["step"]) == float(v), k
                continue
            np.testing.assert_allclose(s[key], v, rtol=rtol * (k + 1), atol=rtol * (k + 1),
                                       err_msg=f"state {key} after step {k + 1}")


OPTIMIZERS = {
    "sgd": (lambda: ej.optim.SGD(lr=0.1),
            lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False)),
    "sgd-momentum-wd": (lambda: ej.optim.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
                        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01,
                                                   foreach=False)),
    "sgd-dampening": (lambda: ej.optim.SGD(lr=0.05, momentum=0.5, dampening=0.3),
                      lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, foreach=False)),
    "sgd-nesterov": (lambda: ej.optim.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1,
                                                foreach=False)),
    "adamw": (lambda: ej.optim.AdamW(lr=1e-2),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    "adamw-no-wd": (lambda: ej.optim.AdamW(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0),
                    lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0,
                                                 foreach=False)),
    "adamw-big-beta1": (lambda: ej.optim.AdamW(lr=0.1, betas=(0.3, 0.5), weight_decay=0.5),
                        lambda ps: torch.optim.AdamW(ps, lr=0.1, betas=(0.3, 0.5), weight_decay=0.5,
                                                     foreach=False)),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_reference_matches_torch(which, dtype):
    ours, theirs = OPTIMIZERS[which]
    p0, grads = _data(dtype, 5, seed=len(which))
    _close(_ours(ours(), p0, grads, "reference"), _torch(theirs, p0, grads), dtype)


@pytest.mark.parametrize("which,devices,dtype", [
    ("adamw", 2, "float32"), ("adamw", 3, "float64"), ("sgd-momentum-wd", 2, "float64"),
    ("sgd-nesterov", 3, "float32"), ("adamw-no-wd", 2, "float64")])
def test_compiled_matches_torch(which, devices, dtype):
    ours, theirs = OPTIMIZERS[which]
    p0, grads = _data(dtype, 4, seed=7, shapes={"w": (12, 10), "b": (10,), "s": ()})
    _close(_ours(ours(), p0, grads, devices), _torch(theirs, p0, grads), dtype)


def test_learning_rate_schedule_is_an_input():
    # one graph, a new lr each step (as a scheduler sets group["lr"])
    lrs = [0.1, 0.05, 0.0, 0.2]
    p0, grads = _data("float32", 4, seed=3)
    for which in ("adamw", "sgd-momentum-wd"):
        ours, theirs = OPTIMIZERS[which]
        _close(_ours(ours(), p0, grads, "reference", lrs), _torch(theirs, p0, grads, lrs), "float32")


def test_update_interface():
    w = ej.param("w", (3, 2))
    b = ej.param("b", (2,), "float64")
    grads = {"w": ej.input("gw", (3, 2)), "b": ej.input("gb", (2,), "float32")}
    up = ej.optim.AdamW(lr=1e-3).update({"w": w, "b": b}, grads)
    assert set(up.state_in) == {"exp_avg.w", "exp_avg_sq.w", "exp_avg.b", "exp_avg_sq.b", "step"}
    # the learning rate is named after the first parameter: one per update (see the groups test)
    assert set(up.state_out) == set(up.state_in) and set(up.hyper) == {"lr.w"}
    for k, t in up.state_in.items():
        assert t.shape == up.state_out[k].shape and t.dtype == up.state_out[k].dtype, k
    assert up.state_in["step"].dtype == "float64" and up.state_in["step"].shape == ()
    assert up.hyper["lr.w"].dtype == "float64" and up.hyper["lr.w"].shape == ()
    # a float64 param stays float64 (its float32 gradient is cast), a float32 one float32
    assert up.params["b"].dtype == "float64" and up.params["w"].dtype == "float32"
    init = up.init_state({"w": np.ones((3, 2), np.float32)})
    assert init["exp_avg_sq.b"].dtype == np.float64 and not init["exp_avg.w"].any()
    assert float(init["step"]) == 0.0
    assert up.hyper_values() == {"lr.w": 1e-3} and up.hyper_values(0.5) == {"lr.w": 0.5}
    with pytest.raises(ej.ShapeError, match="'w'.*\\(4,\\)"):
        up.init_state({"w": np.ones(4)})
    with pytest.raises(ej.EinjoinError, match="'zz'"):
        up.init_state({"zz": np.ones(4)})
    with pytest.raises(ej.EinjoinError, match="-1"):
        up.hyper_values(-1.0)
    sgd = ej.optim.SGD(lr=0.1).update({"w": w}, {"w": grads["w"]})
    assert set(sgd.state_in) == {"step"}
    assert set(ej.optim.SGD(lr=0.1, momentum=0.9).update({"w": w}, {"w": grads["w"]}).state_in) == {
        "step", "momentum_buffer.w"}


@pytest.mark.parametrize("devices", ["reference", 2])
def test_two_optimizers_in_one_graph_are_torchs_param_groups(devices):
    # AdamW with weight decay on the matrix, without on the bias, each group on its own lr
    # schedule, in one graph: as torch's one optimizer with two param groups
    p0, grads = _data("float64", 4, seed=7)
    lr_w, lr_b = [1e-2, 5e-3, 2e-3, 1e-3], [0.1, 0.05, 0.05, 0.02]
    params = {n: ej.param(n, v.shape, v.dtype.name) for n, v in p0.items()}
    gins = {n: ej.input(f"grad.{n}", v.shape, v.dtype.name) for n, v in p0.items()}
    u1 = ej.optim.AdamW(lr=1.0, weight_decay=0.1).update({"w": params["w"]}, {"w": gins["w"]})
    u2 = ej.optim.AdamW(lr=1.0, weight_decay=0.0).update({"b": params["b"], "s": params["s"]},
                                                          {"b": gins["b"], "s": gins["s"]})
    assert set(u1.hyper) == {"lr.w"} and set(u2.hyper) == {"lr.b"}
    assert u1.state_in["step"].node is u2.state_in["step"].node  # one step count: the groups step together
    outs = {**u1.params, **u2.params}
    state_in = {**u1.state_in, **u2.state_in}
    state_out = {**u1.state_out, **u2.state_out}
    every = [*outs.values(), *state_out.values()]
    prog = None if devices == "reference" else ej.compile(every, devices=devices, quiet=True)

    def run(feeds):
        return ej.reference(every, **feeds) if prog is None else prog.run(**feeds)

    ps, state = dict(p0), {**u1.init_state(), **u2.init_state()}
    ts = {n: torch.tensor(v.copy(), requires_grad=True) for n, v in p0.items()}
    topt = torch.optim.AdamW([{"params": [ts["w"]], "weight_decay": 0.1},
                              {"params": [ts["b"], ts["s"]], "weight_decay": 0.0}], lr=1.0, foreach=False)
    for k, g in enumerate(grads):
        feeds = {**ps, **{f"grad.{n}": v for n, v in g.items()}, **state, **u1.hyper_values(lr_w[k]),
                 **u2.hyper_values(lr_b[k])}
        res = run(feeds)
        ps = dict(zip(outs, res[:len(outs)]))
        state = dict(zip(state_out, res[len(outs):]))
        assert set(state) == set(state_in)
        for n, t in ts.items():
            t.grad = torch.from_numpy(g[n].copy())
        topt.param_groups[0]["lr"], topt.param_groups[1]["lr"] = lr_w[k], lr_b[k]
        topt.step()
        for n, t in ts.items():
            np.testing.assert_allclose(ps[n], t.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=f"{n} {k}")


def test_state_and_lr_inputs_never_alias_a_parameter_or_an_input():
    # an input that would be the very node of a state or learning-rate input is refused, naming it
    w = ej.param("w", (2,), "float64")
    for other, name in ((ej.param("exp_avg_sq.w", (2,), "float64"), "exp_avg_sq.w"),
                        (ej.input("lr.w", (), "float64"), "lr.w"),
                        (ej.input("step", (), "float64"), "step")):
        with pytest.raises(ej.EinjoinError, match=f"'{name}'"):
            ej.optim.AdamW(lr=0.1).update({"w": w, "o": other}, {"w": w * 2, "o": other * 1})
    buf = ej.param("momentum_buffer.w", (2,), "float64")  # an input only the gradient reads
    with pytest.raises(ej.EinjoinError, match="'momentum_buffer.w' \\(the state of parameter 'w'\\)"):
        ej.optim.SGD(lr=0.1, momentum=0.9).update({"w": w}, {"w": w * buf})
    # another shape (or a param next to an input of the name) is another node: accepted here,
    # refused by the graph once both are in it
    up = ej.optim.AdamW(lr=0.1).update({"w": w, "exp_avg.w": ej.param("exp_avg.w", (3,), "float64")},
                                       {"w": w * 2, "exp_avg.w": ej.param("exp_avg.w", (3,), "float64")})
    with pytest.raises(ej.EinjoinError, match="two different inputs are named 'exp_avg.w'"):
        ej.reference(list(up.params.values()), **{**up.init_state(), "w": np.ones(2), "exp_avg.w": np.ones(3)})


@pytest.mark.parametrize("make,match", [
    (lambda: ej.optim.SGD(lr=-0.1), "lr=-0.1"),
    (lambda: ej.optim.SGD(lr=0.1, momentum=-1), "momentum=-1"),
    (lambda: ej.optim.SGD(lr=0.1, weight_decay=-1e-3), "weight_decay=-0.001"),
    (lambda: ej.optim.SGD(lr=0.1, nesterov=True), "Nesterov.*momentum=0"),
    (lambda: ej.optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "dampening=0.1"),
    (lambda: ej.optim.SGD(lr="0.1"), "lr must be a number"),
    (lambda: ej.optim.AdamW(lr=-1), "lr=-1"),
    (lambda: ej.optim.AdamW(lr=1e-3, betas=(1.0, 0.9)), "index 0: 1.0"),
    (lambda: ej.optim.AdamW(lr=1e-3, betas=(0.9, -0.1)), "index 1: -0.1"),
    (lambda: ej.optim.AdamW(lr=1e-3, betas=(0.9,)), "pair"),
    (lambda: ej.optim.AdamW(lr=1e-3, eps=-1e-8), "eps=-1e-08"),
    (lambda: ej.optim.AdamW(lr=1e-3, weight_decay=-0.1), "weight_decay=-0.1"),
    (lambda: ej.optim.AdamW(lr=float("nan")), "nan"),
])
def test_bad_hyperparameters(make, match):
    with pytest.raises(ej.EinjoinError, match=match):
        make()


def test_bad_params_and_grads():
    w, b = ej.param("w", (3, 2)), ej.param("b", (2,))
    opt = ej.optim.AdamW(lr=1e-3)
    with pytest.raises(ej.EinjoinError, match="no gradient for parameter 'b'"):
        opt.update({"w": w, "b": b}, {"w": w * 2})
    with pytest.raises(ej.ShapeError, match="gradient of 'b' has shape \\(3,\\)"):
        opt.update({"b": b}, {"b": ej.input("g", (3,))})
    with pytest.raises(ej.EinjoinError, match="\\['c'\\] name no parameter"):
        opt.update({"b": b}, {"b": b, "c": b})
    with pytest.raises(ej.DTypeError, match="'i' is int64"):
        opt.update({"i": ej.param("i", (2,), "int64")}, {"i": b})
    with pytest.raises(ej.EinjoinError, match="empty"):
        opt.update({}, {})
    with pytest.raises(ej.EinjoinError, match="not an einjoin tensor"):
        opt.update({"b": b}, {"b": np.ones(2)})


# ---------------------------------------------------------------- clip_grad_norm


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, dtype):
    rng = np.random.default_rng(int(max_norm) + int(norm_type if norm_type != math.inf else 9))
    gs = {"a": rng.standard_normal((4, 3)).astype(dtype), "b": rng.standard_normal(5).astype(dtype),
          "c": np.asarray(rng.standard_normal(), dtype)}
    ins = {n: ej.input(n, v.shape, dtype) for n, v in gs.items()}
    clipped, total = ej.optim.clip_grad_norm(ins, max_norm, norm_type)
    out = ej.reference([total, *clipped.values()], **gs)
    ts = [torch.tensor(v.copy(), requires_grad=True) for v in gs.values()]
    for t, v in zip(ts, gs.values()):
        t.grad = torch.from_numpy(v.copy())
    want = torch.nn.utils.clip_grad_norm_(ts, max_norm, norm_type, foreach=False)
    rtol = 1e-12 if dtype == "float64" else 2e-6
    np.testing.assert_allclose(out[0], want.numpy(), rtol=rtol)
    assert out[0].dtype == want.numpy().dtype
    for got, t in zip(out[1:], ts):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=rtol, atol=rtol)
    clipped_any = float(want) > max_norm
    assert clipped_any == (max_norm == 0.5)  # both branches are exercised


def test_clip_grad_norm_compiled_then_adamw():
    # clipping feeding an optimizer, compiled on 2 devices, vs torch
    rng = np.random.default_rng(5)
    p0 = {"w": rng.standard_normal((8, 6)).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32)}
    g0 = {n: 3 * rng.standard_normal(v.shape).astype(np.float32) for n, v in p0.items()}
    params = {n: ej.param(n, v.shape) for n, v in p0.items()}
    gins = {n: ej.input(f"g.{n}", v.shape) for n, v in p0.items()}
    clipped, total = ej.optim.clip_grad_norm(gins, 1.0)
    up = ej.optim.AdamW(lr=0.01).update(params, clipped)
    prog = ej.compile([total, *up.params.values(), *up.state_out.values()], devices=2, quiet=True)
    out = prog.run(**p0, **{f"g.{n}": v for n, v in g0.items()}, **up.init_state(p0), **up.hyper_values())
    ts = {n: torch.tensor(v.copy(), requires_grad=True) for n, v in p0.items()}
    for n, t in ts.items():
        t.grad = torch.from_numpy(g0[n].copy())
    want = torch.nn.utils.clip_grad_norm_(list(ts.values()), 1.0, foreach=False)
    torch.optim.AdamW(list(ts.values()), lr=0.01, foreach=False).step()
    np.testing.assert_allclose(out[0], want.numpy(), rtol=2e-6)
    for got, n in zip(out[1:3], up.params):
        np.testing.assert_allclose(got, ts[n].detach().numpy(), rtol=2e-6, atol=2e-6)


def test_clip_grad_norm_errors():
    g = {"g": ej.input("g", (3,))}
    with pytest.raises(ej.EinjoinError, match="norm_type=0"):
        ej.optim.clip_grad_norm(g, 1.0, 0)
    with pytest.raises(ej.EinjoinError, match="max_norm must be a number"):
        ej.optim.clip_grad_norm(g, "1")
    with pytest.raises(ej.DTypeError, match="'i' is int64"):
        ej.optim.clip_grad_norm({"i": ej.input("i", (3,), "int64")}, 1.0)
    clipped, total = ej.optim.clip_grad_norm({}, 1.0)
    assert clipped == {} and float(ej.reference(total)) == 0.0


# ---------------------------------------------------------------- hyperparameters at random


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["sgd", "adamw"]), lr=st.floats(0.0, 0.5), b1=st.floats(0.0, 0.99),
       b2=st.floats(0.0, 0.999), eps=st.sampled_from([0.0, 1e-8, 1e-3]), wd=st.floats(0.0, 0.5),
       momentum=st.sampled_from([0.0, 0.5, 0.9]), dampening=st.sampled_from([0.0, 0.25]),
       nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_hyperparameters_match_torch(kind, lr, b1, b2, eps, wd, momentum, dampening, nesterov, seed):
    p0, grads = _data("float64", 3, seed=seed, shapes={"w": (3, 4), "b": (4,)})
    if kind == "adamw":
        ours = ej.optim.AdamW(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)

        def theirs(ps):
            return torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    else:
        nesterov = nesterov and momentum > 0
        dampening = 0.0 if nesterov else dampening
        ours = ej.optim.SGD(lr=lr, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)

        def theirs(ps):
            return torch.optim.SGD(ps, lr=lr, momentum=momentum, dampening=dampening, weight_decay=wd,
                                   nesterov=nesterov, foreach=False)
    ours_h, theirs_h = _ours(ours, p0, grads, "reference"), _torch(theirs, p0, grads)
    # eps = 0 with a tiny second moment can amplify 1-ulp differences: relative 1e-9 is still exact
    # arithmetic for float64 where 1e-12 per step is the rule
    for (p, _), (tp, _) in zip(ours_h, theirs_h):
        for n in tp:
            np.testing.assert_allclose(p[n], tp[n], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("planner", ["auto", "data_parallel", "zero"])
def test_training_step_under_each_planner(planner):
    # forward + backward + clipping + AdamW in one graph: every planner places the optimizer's
    # elementwise nodes like any others (zero cuts the moments with their parameters)
    x, y = ej.input("x", (16, 8)), ej.input("y", (16, 4))
    ps = {"w1": ej.param("w1", (8, 32)), "w2": ej.param("w2", (32, 4))}
    loss = ej.mse_loss((x @ ps["w1"]).relu() @ ps["w2"], y)
    clipped, norm = ej.optim.clip_grad_norm(dict(zip(ps, ej.grad(loss, list(ps.values())))), 0.5)
    up = ej.optim.AdamW(lr=1e-2).update(ps, clipped)
    outs = [loss, norm, *up.params.values(), *up.state_out.values()]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((16, 8)), "y": rng.standard_normal((16, 4)),
             "w1": rng.standard_normal((8, 32)) * 0.3, "w2": rng.standard_normal((32, 4)) * 0.3}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    prog = ej.compile(outs, devices=2, planner=planner, quiet=True)
    state = up.init_state()
    for _ in range(3):
        want = ej.reference(outs, **feeds, **state, **up.hyper_values())
        got = prog.run(**feeds, **state, **up.hyper_values())
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        n = len(up.params)
        feeds.update(zip(up.params, want[2:2 + n]))
        state = dict(zip(up.state_out, want[2 + n:]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("which", ["adamw", "sgd-momentum-wd"])
def test_half_parameters_stay_half_and_follow_torch(which, dtype):
    # torch rounds after every op of its half step, einjoin once per fused elementwise node:
    # a few units in the last place apart after 5 steps, not more
    import ml_dtypes
    npdt = np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    p0, grads = _data("float32", 5, seed=1)
    p0 = {k: v.astype(npdt) for k, v in p0.items()}
    grads = [{k: v.astype(npdt) for k, v in g.items()} for g in grads]
    ours, theirs = OPTIMIZERS[which]
    got = _ours(ours(), p0, grads, "reference")[-1][0]
    tdt = getattr(torch, dtype)
    ts = {n: torch.tensor(v.astype(np.float32)).to(tdt).requires_grad_(True) for n, v in p0.items()}
    opt = theirs(list(ts.values()))
    for g in grads:
        for n, t in ts.items():
            t.grad = torch.tensor(g[n].astype(np.float32)).to(tdt)
        opt.step()
    for n, t in ts.items():
        assert got[n].dtype == npdt
        want = t.detach().float().numpy()
        ulp = float(ml_dtypes.finfo(npdt).eps) * max(1.0, float(np.abs(want).max()))
        assert float(np.abs(got[n].astype(np.float32) - want).max()) <= 4 * ulp, n
