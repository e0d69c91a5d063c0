"""Routing and indexing ops (issue 20) imported from torch with ``ej.from_torch`` (torch.export's
ATen ops and torch.fx's functions / methods), compiled for 1 and 2 devices, against torch:
gather / take_along_dim, scatter, scatter_add, scatter_reduce, index_add / index_copy /
index_fill / index_select, argmax / argmin, max / min with a dim, cumsum / cumprod, one_hot,
where and masked_fill with broadcast tensor masks, pad in every mode, flip, roll,
broadcast_tensors, stack / flatten / expand / repeat_interleave; gradients against
torch.autograd for the differentiable ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import einjoin as ej
from tests.ops_harness import check_grads, check_import

HYP = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


class Fn(nn.Module):
    """A module whose forward calls ``f`` on (x, i): both capture paths trace it."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x, i):
        return self.f(x, i)


class Fn1(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


def _idx(shape, hi, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, hi, shape))


@settings(HYP)
@given(dim=st.integers(0, 2), seed=st.integers(0, 100))
def test_gather(dim, seed):
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(seed))
    shape = [2, 3, 4]
    shape[dim] = 6  # more picks than the dim holds: repeats
    check_import(Fn(lambda x, i: torch.gather(x, dim, i)), (x, _idx(shape, x.shape[dim], seed)))


def test_take_along_dim_broadcasts():
    x = torch.randn(3, 1, 5)
    i = _idx((1, 4, 2), 5, 0)
    check_import(Fn(lambda x, i: torch.take_along_dim(x, i, dim=2)), (x, i), methods=("export",))
    check_import(Fn(lambda x, i: torch.take_along_dim(x, i)), (x, _idx((7,), 15, 1)), methods=("export",))


def test_gather_out_of_range_is_a_run_time_error():
    fn = ej.from_torch(Fn(lambda x, i: torch.gather(x, 1, i)), (torch.randn(2, 3), _idx((2, 2), 3, 0)))
    prog = ej.compile(fn, devices=2)
    with pytest.raises(Exception, match="out of range|index"):
        prog.run(torch.randn(2, 3), torch.tensor([[0, 3], [1, 1]]))


@settings(HYP)
@given(dim=st.integers(0, 1), seed=st.integers(0, 100))
def test_scatter_add_and_scatter(dim, seed):
    g = torch.Generator().manual_seed(seed)
    x, src = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    shape = [3, 4]
    i = _idx(shape, x.shape[dim], seed)
    check_import(Fn(lambda x, i: x.scatter_add(dim, i, src * 2)), (x, i))
    # scatter writes: unique indices along dim (torch leaves repeats unspecified)
    perm = torch.stack([torch.randperm(x.shape[dim], generator=g)[:shape[dim]] for _ in range(shape[1 - dim])],
                       1 - dim)
    check_import(Fn(lambda x, i: torch.scatter(x, dim, i, src[:3, :4] + 1)), (x, perm))
    check_import(Fn(lambda x, i: x.scatter(dim, i, 2.5)), (x, perm))


def test_scatter_reduce():
    x, src = torch.randn(4, 5), torch.randn(4, 5)
    i = _idx((4, 5), 5, 3)
    for include in (True, False):
        for red in ("sum", "mean", "prod", "amax", "amin"):
            check_import(Fn(lambda x, i, red=red, inc=include: x.scatter_reduce(1, i, src, red, include_self=inc)),
                         (x, i), methods=("export",))
    xi, si = torch.arange(20).reshape(4, 5), torch.arange(12).reshape(3, 4) - 6  # ints; an index smaller than x
    for red in ("amax", "amin", "prod", "sum"):
        check_import(Fn(lambda x, i, red=red: x.scatter_reduce(0, i, si, red)), (xi, _idx((3, 4), 4, 5)),
                     methods=("export",))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_add_copy_fill_select(dim):
    x = torch.randn(4, 5, 3)
    n = x.shape[dim]
    rows = torch.tensor([n - 1, 0, 1])
    shape = list(x.shape)
    shape[dim] = 3
    src = torch.randn(shape)
    check_import(Fn(lambda x, i: x.index_add(dim, i, src, alpha=1.5)), (x, torch.tensor([1, 1, 0])))
    check_import(Fn(lambda x, i: x.index_copy(dim, i, src)), (x, rows))
    check_import(Fn(lambda x, i: x.index_fill(dim, i, -2.0)), (x, rows), methods=("export",))
    check_import(Fn(lambda x, i: torch.index_select(x, dim, i)), (x, rows))


@settings(HYP)
@given(dim=st.sampled_from([None, 0, 1, -1]), keepdim=st.booleans(), seed=st.integers(0, 1000))
def test_argmax_argmin_first_occurrence(dim, keepdim, seed):
    # small integers: many ties, the first must win as in torch
    x = torch.from_numpy(np.random.default_rng(seed).integers(0, 3, (4, 6)).astype(np.float32))
    if dim is None:
        keepdim = False
    check_import(Fn1(lambda x: (x.argmax(dim, keepdim), torch.argmin(x, dim, keepdim))), (x,))


def test_argmax_nan_is_the_largest():
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [0.0, 2.0, 2.0, -1.0]])
    check_import(Fn1(lambda x: (x.argmax(1), x.argmin(1), x.argmax())), (x,), methods=("export",))


@pytest.mark.parametrize("keepdim", [False, True])
def test_max_min_with_dim(keepdim):
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 3, (3, 5)).astype(np.float32))
    check_import(Fn1(lambda x: torch.max(x, 1, keepdim)), (x,))
    check_import(Fn1(lambda x: x.min(0, keepdim)), (x,), methods=("export",))
    check_import(Fn1(lambda x: (x.max(), torch.max(x, x * 0.5), torch.min(x))), (x,))
    # the named-tuple fields torch.fx code reads
    check_import(Fn1(lambda x: (torch.max(x, 1).values, x.min(1, keepdim).indices)), (x,))


def test_max_dim_gradient_goes_to_the_first_maximum():
    class M(nn.Module):
        def forward(self, x):
            v, i = x.max(1)
            return (v * torch.arange(1.0, 4.0, dtype=torch.float64)).sum()
    x = torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0], [5.0, 4.0, 5.0]], dtype=torch.float64)
    check_grads(M(), (x,))


@settings(HYP)
@given(dim=st.integers(-2, 1), dtype=st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bool]),
       seed=st.integers(0, 100))
def test_cumsum_cumprod(dim, dtype, seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.uniform(-2, 2, (3, 6))).to(dtype) if dtype != torch.bool else \
        torch.from_numpy(rng.random((3, 6)) < 0.5)
    check_import(Fn1(lambda x: (x.cumsum(dim), torch.cumprod(x, dim))), (x,))


def test_cumsum_dtype_and_cumprod_with_zeros():
    x = torch.tensor([[1.0, 0.0, 3.0, 2.0], [0.0, 0.0, 2.0, 1.0]], dtype=torch.float64)
    check_import(Fn1(lambda x: (x.cumprod(1), x.cumsum(0, dtype=torch.float32))), (x,))


def test_cumsum_cumprod_gradients():
    class M(nn.Module):
        def forward(self, x):
            w = torch.arange(1.0, 6.0, dtype=torch.float64)
            return (x.cumsum(1) * w).sum() + (x.cumprod(1) * w).sum()
    x = torch.tensor([[1.5, 0.0, -2.0, 0.5, 3.0], [0.0, 0.0, 1.0, 2.0, -1.0], [0.3, -0.7, 1.1, 0.9, 2.0]],
                     dtype=torch.float64)
    check_grads(M(), (x,))


def test_one_hot():
    i = _idx((3, 4), 6, 0)
    check_import(Fn1(lambda i: F.one_hot(i, 6)), (i,))
    fn_err = Fn1(lambda i: F.one_hot(i))
    with pytest.raises(ej.EinjoinError, match="num_classes"):
        ej.from_torch(fn_err, (i,), method="fx")


def test_where_and_masked_fill_with_broadcast_tensor_masks():
    x = torch.randn(2, 3, 4)
    m = torch.randn(3, 1) > 0
    check_import(Fn(lambda x, m: (torch.where(m, x, -x), torch.where(m, x, 0.5), x.masked_fill(m, -1.0),
                                  x.masked_fill(~m, torch.tensor(2.0, dtype=torch.float64)))), (x, m))
    xi = torch.arange(12).reshape(3, 4)
    check_import(Fn(lambda x, m: x.masked_fill(m, 7)), (xi, m))


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("pad", [(1, 2), (2, 0, 1, 3)])
def test_pad(mode, pad):
    x = torch.randn(2, 3, 4, 5) if len(pad) == 4 else torch.randn(3, 4, 5)  # torch's rank rule
    kw = {"value": 1.5} if mode == "constant" else {}
    check_import(Fn1(lambda x: F.pad(x, pad, mode=mode, **kw)), (x,))


def test_pad_negative_crops_and_modules():
    x = torch.randn(2, 3, 6)
    check_import(Fn1(lambda x: F.pad(x, (-1, 2, 1, -1))), (x,))
    seq = nn.Sequential(nn.ReflectionPad1d(2), nn.ReplicationPad1d((1, 0)), nn.ConstantPad1d(1, -3.0),
                        nn.ZeroPad1d((0, 2)), nn.CircularPad1d(1))
    check_import(seq, (x,))


def test_pad_gradient():
    class M(nn.Module):
        def forward(self, x):
            y = F.pad(x, (2, 1), mode="reflect") + F.pad(x, (1, 2), mode="replicate")
            return (y * torch.arange(7.0, dtype=torch.float64)).sum() + F.pad(x, (1, 1), value=2.0).sum()
    check_grads(M(), (torch.randn(2, 4, dtype=torch.float64),))


def test_flip_roll():
    x = torch.randn(3, 4, 5)
    check_import(Fn1(lambda x: (x.flip(0, 2), torch.roll(x, 2, 1), torch.roll(x, (1, -2), (0, 2)),
                                torch.roll(x, 3))), (x,))


def test_gather_scatter_gradients():
    class M(nn.Module):
        def forward(self, x, i):
            y = torch.gather(x, 1, i) * 2 + x.scatter_add(1, i, x[:, :3] * 3)[:, :3]
            z = x.index_add(0, torch.tensor([1, 1]), x[:2] * x[:2])
            return (y * y).sum() + (z * torch.arange(5.0, dtype=torch.float64)).sum()
    x = torch.randn(3, 5, dtype=torch.float64)
    check_grads(M(), (x, _idx((3, 3), 5, 4)))


def test_shape_ops_stack_flatten_expand_repeat_interleave_broadcast_tensors():
    x = torch.randn(2, 3, 4)
    check_import(Fn1(lambda x: (torch.stack([x, 2 * x], 1).flatten(1), x[:, :1].expand(2, 5, 4),
                                x.repeat_interleave(2, dim=1), torch.repeat_interleave(x, 2),
                                torch.broadcast_tensors(x, x[0, :, :1])[1])), (x,))


def test_advanced_indexing_with_several_index_tensors():
    x = torch.randn(4, 5, 6)
    i, j = torch.tensor([[0, 3], [-1, 2]]), torch.tensor([1, -2])
    # adjacent index tensors keep their place; separated ones go first (numpy's rule)
    check_import(Fn(lambda x, i: (x[i, j], x[:, i, j], x[i, :, j], x[1:3, i], x[..., j], x[2, :, j])), (x, i))


def test_index_put_and_masked_put():
    x = torch.randn(4, 5)
    i, j = torch.tensor([0, 3, 1]), torch.tensor([4, 0, 1])
    v = torch.randn(3)

    class Put(nn.Module):
        def forward(self, x, i):
            y = x.clone()
            y[i, j] = v
            z = x.clone()
            z[i] = 2.0
            w = torch.index_put(x, (i, j), v * 2, accumulate=True)
            m = x.clone()
            m[x > 0] = -1.0  # a bool mask with one value: where(mask, value, x)
            return y, z, w, m
    check_import(Put(), (x, i), methods=("export",))


def test_diff_and_narrow_int_casts():
    x = torch.randn(3, 6)
    check_import(Fn1(lambda x: (torch.diff(x), torch.diff(x, n=2, dim=0), torch.diff(x, prepend=x[:, :1]),
                                (x > 0).int().cumsum(1).long())), (x,), methods=("export",))


def test_sdpa_fully_masked_rows_give_zeros_as_torch():
    q, k = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8)
    mask = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    mask[0, :, 0] = False  # a query that may attend nothing (a left-padded row)
    fmask = torch.zeros(2, 1, 4, 5).masked_fill(~mask, float("-inf"))
    check_import(Fn(lambda q, k: (F.scaled_dot_product_attention(q, k, k, attn_mask=mask),
                                  F.scaled_dot_product_attention(q, k, k, attn_mask=fmask))), (q, k))


def test_repeated_indices_keep_the_last_write_as_torchs_cpu_kernel():
    x = torch.zeros(2, 4)
    i = torch.tensor([[1, 1, 3], [0, 2, 0]])
    src = torch.arange(1.0, 7.0).reshape(2, 3)
    check_import(Fn(lambda x, i: (x.scatter(1, i, src), x.scatter(1, i, 9.0))), (x, i))
    rows = torch.tensor([2, 0, 2])
    check_import(Fn(lambda x, i: x.index_copy(1, i, src)), (x, rows))


@pytest.mark.parametrize("what", ["one_hot", "scatter", "index_copy"])
def test_out_of_range_indices_are_run_time_errors(what):
    f = {"one_hot": lambda x, i: F.one_hot(i, 4),
         "scatter": lambda x, i: x.scatter(1, i[None, :2], 1.0),
         "index_copy": lambda x, i: x.index_copy(1, i, x[:, :3])}[what]
    x = torch.zeros(2, 4)
    prog = ej.compile(ej.from_torch(Fn(f), (x, torch.tensor([0, 1, 2]))), devices=2)
    with pytest.raises(ej.EinjoinError, match="out of range|index"):
        prog.run(x, torch.tensor([0, 4, 2]))


def test_scatter_gradient():
    class M(nn.Module):
        def forward(self, x, src):
            i = torch.tensor([[3, 0], [1, 2], [0, 3]])
            return (x.scatter(1, i, src * src) * torch.arange(12.0, dtype=torch.float64).reshape(3, 4)).sum()
    check_grads(M(), (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)))


def test_advanced_index_and_index_put_gradients():
    class M(nn.Module):
        def forward(self, x, v):
            i, j = torch.tensor([0, 2, 2]), torch.tensor([-1, 1, 1])
            y = x[i, j] * v + x[:, j].sum(0)
            z = torch.index_put(x, (i, j), v * v, accumulate=True)
            return (y * y).sum() + (z * torch.arange(12.0, dtype=torch.float64).reshape(3, 4)).sum()
    check_grads(M(), (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)))
