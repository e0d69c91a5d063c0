"""Reviewer R1's checks of session 40's changes: differential against torch / numpy at the points
the session's commits touched (norm gradients at zero, sparse max gradients on fed tensors with
explicit zeros, duplicates and blocks, the block pool's results across runs)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.runtime import blockpool

# ------------------------------------------------- vector norms of order < 1 at zero (c4a44d4)


class _Loss(torch.nn.Module):
    def __init__(self, f: Callable[..., Any], x: Any) -> None:
        super().__init__()
        self.f = f
        self.p = torch.nn.Parameter(x.clone())

    def forward(self, c: Any) -> Any:
        return (self.f(self.p) * c).sum()


def _value_and_grad(f: Callable[..., Any], x: Any) -> None:
    """einjoin's f(x) and d/dx (f(x) * c).sum() of an imported module equal torch's (NaN where torch's)."""
    with torch.no_grad():
        out = f(x)
    c = torch.linspace(-1, 2, out.numel(), dtype=torch.float64).reshape(out.shape)
    m = _Loss(f, x)
    fn = ej.from_torch(m, (c,))
    (g,) = ej.grad(fn.outputs[0], list(fn.parameters.values()))
    got_loss, got = ej.compile(fn.with_outputs([fn.outputs[0], g]), quiet=True, backend="sync").run(c)
    loss = m(c)
    loss.backward()
    torch.testing.assert_close(torch.as_tensor(np.asarray(got_loss)), loss.detach(), equal_nan=True)
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), m.p.grad, rtol=1e-9, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("ord", [0.5, 0.3, -1.0, -2.0])
def test_vector_norm_of_order_below_one_has_torchs_gradient_at_zero_entries(ord: float) -> None:
    # c4a44d4 made the norm's gradient 0 at a zero vector for orders 2 and p, but for p < 1 (and
    # negative p) |x| ** p itself has an infinite derivative at 0: a zero entry's gradient was NaN
    # (0 * inf), a zero row's too; torch's backward masks |x| ** (p - 1) where x == 0
    x = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.5, -2.0], [1.0, -2.0, 3.0]], dtype=torch.float64)
    _value_and_grad(lambda a: torch.linalg.vector_norm(a, ord=ord, dim=1), x)


# ------------------------------------------------- a graph's sparse max gradient (05b3790, 6d0bb05)


def _amax_grads(dense_a: np.ndarray, h: np.ndarray, eq: str, cot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ins, out = eq.split("->")
    every = "".join(dict.fromkeys(ins.replace(",", "")))
    ta, th = torch.tensor(dense_a, requires_grad=True), torch.tensor(h, requires_grad=True)
    prod = torch.einsum(f"{ins}->{every}", ta, th)
    res = prod.amax(dim=tuple(d for d, lab in enumerate(every) if lab not in out))
    kept = "".join(lab for lab in every if lab in out)
    (res.permute([kept.index(lab) for lab in out]) * torch.tensor(cot)).sum().backward()
    return ta.grad.numpy(), th.grad.numpy()


@pytest.mark.parametrize("case", ["explicit_zero", "duplicates", "block2", "all_negative_row"])
def test_sparse_max_gradient_of_a_fed_tensor_is_torchs_amax_gradient(case: str) -> None:
    # the property test feeds tensors built from dense arrays (no stored zeros, no duplicate keys,
    # blocks of 1); a stored zero ties the absent products, duplicates are summed before the max,
    # a stored block holds zeros that are entries of the pattern
    rng = np.random.default_rng(11)
    eq = "ij,jk->ik"
    if case == "explicit_zero":
        idx, vals = np.array([[0, 0, 1, 1, 2], [0, 1, 0, 1, 2]]), np.array([0.0, 2.0, 3.0, -1.0, 0.0])
        fed = ej.sparse("Ar40", (idx, vals, (3, 3)))
    elif case == "duplicates":
        idx, vals = np.array([[0, 0, 1, 1, 1, 2], [1, 1, 0, 1, 0, 2]]), np.array([1.0, 1.0, 1.0, -1.0, 2.0, -3.0])
        fed = ej.sparse("Ar40", (idx, vals, (3, 3)))
    elif case == "block2":
        d = np.where(rng.random((3, 3)) < 0.4, rng.integers(-2, 3, (3, 3)).astype(float), 0.0)
        fed = ej.sparse("Ar40", d, block=2)
    else:  # a row whose stored products are all negative: its max is an absent entry's 0
        fed = ej.sparse("Ar40", np.array([[-1.0, 0.0, -2.0], [-1.0, -3.0, -2.0], [0.0, 0.0, 0.0]]))
    dense_a = fed.todense()
    hv = rng.integers(-2, 3, (3, 2)).astype(float)  # small integers: ties
    cot = rng.normal(size=(3, 2))
    A = ej.sparse_input("Ar40", (3, 3), nnz=9, dtype="float64")
    h = ej.param("hr40", (3, 2), "float64")
    y = ej.einsum(eq, A, h, agg="max")
    da, dh = ej.grad((y * ej.input("cr40", (3, 2), "float64")).sum(), [A, h])
    want_a, want_h = _amax_grads(dense_a, hv, eq, cot)
    stored = A.on_pattern(fed, np.ones(9)).todense() != 0
    feeds = {"Ar40": fed, "hr40": hv, "cr40": cot}
    for got in (ej.reference([da, dh], **feeds), ej.compile([da, dh], devices=2, quiet=True).run(**feeds)):
        np.testing.assert_allclose(np.where(stored, A.on_pattern(fed, got[0]).todense(), 0.0),
                                   np.where(stored, want_a, 0.0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], want_h, rtol=1e-12, atol=1e-12)


# ------------------------------------------------- the block pool (fa09e94, bb27b5e)


@pytest.fixture
def pool_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blockpool, "POOL_MIN_BYTES", 0)
    monkeypatch.setattr(blockpool, "POOL_BLOCKS", True)


def test_results_survive_later_and_async_runs_of_a_pooled_program(pool_all: None) -> None:
    # relu writes into its pooled matmul block (plan/fuse_inplace's donation); results held, a
    # view of one, and runs in flight at once (run_async) against runs before and after
    x, w, w2 = ej.input("r40x", (512, 32)), ej.input("r40w", (32, 256)), ej.input("r40w2", (256, 16))
    h = ej.relu(x @ w)
    outs = [h @ w2, (h @ w2) * 2.0]
    prog = ej.compile(outs, devices=1, backend="threads", quiet=True)
    assert blockpool.engine_pool(prog._engine).kernels  # else this could not fail
    rng = np.random.default_rng(40)
    feeds = [dict(r40x=rng.standard_normal((512, 32)).astype(np.float32),
                  r40w=rng.standard_normal((32, 256)).astype(np.float32),
                  r40w2=rng.standard_normal((256, 16)).astype(np.float32)) for _ in range(3)]
    wants = [ej.reference(outs, **f) for f in feeds]
    held = [prog.run(**f) for f in feeds]
    view = prog.run(**feeds[0])[0][:7]  # only a view keeps this one's array
    handles = [prog.run_async(**f) for f in feeds]
    asynced = [hd.result() for hd in handles]
    again = [prog.run(**f) for f in reversed(feeds)]
    for got, want in zip(held + asynced + again[::-1], wants * 3):
        for g, w_ in zip(got, want):
            np.testing.assert_array_equal(g, w_)
    np.testing.assert_array_equal(view, wants[0][0][:7])


def test_a_result_written_by_a_donation_into_a_pooled_block_is_never_the_pools(pool_all: None) -> None:
    # the pool's rule: no pooled block is a graph output's (a result is the caller's own array).
    # relu wrote into its pooled matmul block (a donation) and relu's block was an output: every
    # result was the pool's array, kept by the pool (up to 1 GiB per program) after the caller
    # dropped it, and safe from later runs only by its reference count
    x, w, w2 = ej.input("r40dx", (512, 32)), ej.input("r40dw", (32, 256)), ej.input("r40dw2", (256, 16))
    h = ej.relu(x @ w)
    rng = np.random.default_rng(41)
    f = dict(r40dx=rng.standard_normal((512, 32)).astype(np.float32),
             r40dw=rng.standard_normal((32, 256)).astype(np.float32),
             r40dw2=rng.standard_normal((256, 16)).astype(np.float32))
    for outs, fuse in (([h, h @ w2], True), ([h, h @ w2], False), ([h * 2.0, h @ w2], False)):
        prog = ej.compile(outs, devices=1, backend="threads", quiet=True, fuse=fuse)
        got = [prog.run(**f) for _ in range(3)]
        pool = blockpool.engine_pool(prog._engine).pool
        for g in got:
            wants = ej.reference(outs, **f)
            for a, want in zip(g if isinstance(g, (list, tuple)) else [g],
                               wants if isinstance(wants, (list, tuple)) else [wants]):
                assert not pool.holds(a)
                np.testing.assert_array_equal(a, want)
    mlp = ej.compile(h @ w2, devices=1, backend="threads", quiet=True)  # relu's block is no output: pooled
    for _ in range(3):
        np.testing.assert_array_equal(mlp.run(**f), ej.reference(h @ w2, **f))
    assert blockpool.engine_pool(mlp._engine).pool.reused > 0


# ------------------------------------------------- DuckDB on several devices (4f29df8)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_duckdb_memory_limit_below_its_buffers_is_an_einjoin_error(devices: int) -> None:
    # DuckDB fails even reading its own memory_limit back under a tiny limit: on several devices
    # that read is at compile (device_settings divides the limit), on one at the step's ranges;
    # both were a raw duckdb.OutOfMemoryException
    pytest.importorskip("duckdb")
    a = ej.sparse("Aduck40", np.eye(4))
    with pytest.raises(ej.EinjoinError, match="duckdb_memory"):
        ej.sparse_compile("ij,jk->ik", a, np.ones((4, 2)), engine="duckdb", devices=devices, backend="sync",
                          duckdb_memory="1KB").run()


# ------------------------------------------------- memory_limit= and MIN_SPLIT_WORK (3bc6368, 1f4e2eb)


@pytest.mark.parametrize("devices", [2, 4])
def test_a_small_step_over_one_devices_cap_is_split_not_refused(devices: int) -> None:
    # MIN_SPLIT_WORK keeps a step of little work on device 0; under a memory_limit= that device 0's
    # tuples exceed but each device's part fits, the step was refused ("compile with more
    # devices=", which did not help: 4 devices were refused as 2), where split it fits
    rng = np.random.default_rng(0)
    d = np.where(rng.random((200, 200)) < 0.05, rng.normal(size=(200, 200)), 0.0)
    x = rng.normal(size=(200, 8))
    a = ej.sparse("Acap40", d)
    one = ej.sparse_compile("ij,jk->ik", a, x, backend="sync")
    one.run()
    cap = int(one.run_stats.peak_bytes[0] * 0.6)
    plan = ej.sparse_compile("ij,jk->ik", a, x, devices=devices, backend="sync", memory_limit=cap)
    got = plan.run()
    np.testing.assert_allclose(got.todense(), d @ x, rtol=1e-12, atol=1e-12)
    assert max(plan.run_stats.peak_bytes) <= cap
    small = ej.sparse_compile("ij,jk->ik", a, x, devices=devices, backend="sync", memory_limit=10 ** 9)
    small.run()  # within one device's cap: still on device 0 (MIN_SPLIT_WORK)
    assert "below MIN_SPLIT_WORK" in small.explain()


# ------------------------------------------------- leave_idle, now the Trainer's default (06af8bb)


def test_leave_idle_keeps_every_ray_device() -> None:
    # leave_idle is for devices of this process (ej.compile's docstring, _fewer_devices'): the
    # overhead model is the threads backend's. It also cut a Ray plan to 1 of 2 actors, which the
    # Trainer's new default made silent for Trainer(backend="ray"). Compiling starts no Ray.
    from einjoin.runtime.backends.ray import RayBackend
    x, w = ej.input("r40rx", (16, 8)), ej.param("r40rw", (8, 4))
    out = ej.relu(x @ w)
    assert ej.compile(out, devices=2, backend="threads", leave_idle=True, quiet=True).taskgraph.n_devices == 1
    assert ej.compile(out, devices=2, backend=RayBackend(), leave_idle=True, quiet=True).taskgraph.n_devices == 2


# ------------------------------------------------- the Tensor API of a SparseTensor (d3def94)


def test_an_integer_sparse_tensor_to_a_negative_power_is_an_einjoin_error() -> None:
    # numpy (and torch) refuse integers to negative integer powers: it was numpy's raw ValueError
    t = ej.sparse("Tpow40", np.array([[1, 0], [2, -3]]))
    with pytest.raises(ej.EinjoinError, match="Tpow40"):
        t ** -1
    with pytest.raises(ej.EinjoinError, match="Tpow40"):
        2 ** t  # a negative stored entry
    np.testing.assert_array_equal((t ** 2).todense(), np.array([[1, 0], [2, -3]]) ** 2)
