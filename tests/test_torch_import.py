"""``ej.from_torch`` on unmodified torch modules: the zoo, torch.nn layers, and a module that uses
the long tail of ops. Each is traced once per session, compiled for 1, 2 and 4 devices, run, and
compared with torch's own forward on the same random inputs and weights."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import einjoin as ej
from einjoin.ir.node import Fill
from einjoin.models.zoo import ZOO, example


def assert_close(out, expected):
    out, expected = out.detach().numpy(), expected.detach().numpy()
    assert out.shape == expected.shape and out.dtype == expected.dtype
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=2e-5 * scale)


class Attention(nn.Module):
    """Multi-head attention as people write it around ``scaled_dot_product_attention``."""

    def __init__(self, dim=32, heads=4, kv_heads=4, causal=True, use_mask=False):
        super().__init__()
        self.heads, self.kv_heads, self.causal, self.use_mask = heads, kv_heads, causal, use_mask
        hd = dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * hd)
        self.o = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2 * self.kv_heads, hd).transpose(1, 2).chunk(2, dim=1)
        mask = None
        if self.use_mask:  # a bool mask built in forward: it folds to a constant
            mask = torch.ones(t, t, dtype=torch.bool).tril(diagonal=0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o(a.transpose(1, 2).reshape(b, t, d))


class LongTail(nn.Module):
    """Masks, rotary embeddings both ways, the CPU flash-attention op, gathers, and elementwise ops."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(16, 48)
        self.table = nn.Parameter(torch.randn(10, 16))

    def forward(self, x, idx):
        b, t, d = x.shape
        q, k, v = self.p(x).chunk(3, -1)
        q = q.view(b, t, 2, 8).transpose(1, 2)
        k = k.view(b, t, 2, 8).permute(0, 2, 1, 3)
        v = v.unflatten(-1, (2, 8)).transpose(1, 2)
        pos = torch.arange(t, dtype=torch.float32)  # complex-free sin/cos tables, built in forward
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        f = pos[:, None] * inv[None, :]
        emb = torch.cat([f, f], -1)
        q = q * emb.cos() + torch.cat([-q[..., 4:], q[..., :4]], -1) * emb.sin()
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        upper = ~torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask & upper)
        a2 = F.scaled_dot_product_attention(q, k, v, scale=0.3)
        o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        sc = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)
        gelu = x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))  # the erf form, by hand
        y = (torch.where(x > 0, x, 0.1 * x) + torch.index_select(self.table, 0, idx).unsqueeze(0)
             + (a + a2 + o + sc @ v).transpose(1, 2).reshape(b, t, d) + gelu)
        y = torch.sigmoid(y) * torch.tanh(y) - torch.relu(y).neg() / 2 + y.abs().sqrt()
        y = y + F.gelu(y, approximate="tanh") + F.silu(y) - (y - 1) ** 2
        bmm = torch.bmm(q.reshape(4, t, 8), k.reshape(4, t, 8).transpose(1, 2)).sigmoid()
        lo, hi = y.split([6, 10], dim=-1)
        return (F.log_softmax(y, -1), y[:, 1:3].sum(1), torch.einsum("btd,btd->bt", y, x).abs().rsqrt(),
                bmm - bmm.mean(dim=(1, 2), keepdim=True), lo.amax(-1) / hi.var(-1))


def _sequential_mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))


MODULES = {
    **{f"zoo:{name}": functools.partial(example, name) for name in sorted(ZOO)},
    "nn.TransformerEncoderLayer": lambda: (nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                           (torch.randn(2, 6, 32),)),
    "nn.Sequential MLP": lambda: (_sequential_mlp(), (torch.randn(5, 32),)),
    "sdpa causal": lambda: (Attention(), (torch.randn(2, 8, 32),)),
    "sdpa GQA + bool mask": lambda: (Attention(kv_heads=2, causal=False, use_mask=True), (torch.randn(2, 8, 32),)),
    "sdpa not causal": lambda: (Attention(causal=False), (torch.randn(1, 8, 32),)),
    "long tail": lambda: (LongTail(), (torch.randn(2, 5, 16), torch.tensor([1, 3, 3, 0, 9]))),
}


# zoo models that stop at an op not built yet (owner): a strict xfail until it lands
BLOCKED: dict[str, str] = {}
NEW_ZOO = ["zoo:resnet18", "zoo:vit-tiny", "zoo:whisper-encoder", "zoo:moe", "zoo:lstm"]
LARGE = {"zoo:resnet18", "zoo:vit-tiny"}  # their capped runs are slow


def _module(name: str, slow: bool = False):
    marks = [pytest.mark.xfail(reason=BLOCKED[name], strict=True)] if name in BLOCKED else []
    if slow:
        marks.append(pytest.mark.slow)
    return pytest.param(name, marks=marks)


@functools.cache
def traced(name: str, method: str = "auto"):
    """One trace per module per test session (export is the slow part)."""
    torch.manual_seed(0)
    module, args = MODULES[name]()
    module.eval()
    return module, args, ej.from_torch(module, args, method=method)


@pytest.mark.parametrize("name", [_module(n) for n in sorted(MODULES)])
# 4 devices: make test-all (the conformance suite runs random programs on 4 by default)
@pytest.mark.parametrize("devices", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_torch(name, devices):
    module, args, fn = traced(name)
    with torch.no_grad():
        expected = module(*args)
    out = ej.compile(fn, devices=devices).run(*args)
    if isinstance(expected, tuple):
        assert isinstance(out, tuple) and len(out) == len(expected)
        for o, e in zip(out, expected):
            assert_close(o, e)
    else:
        assert isinstance(out, torch.Tensor)
        assert_close(out, expected)


@pytest.mark.parametrize("name", [_module(n, slow=n in LARGE) for n in NEW_ZOO])
def test_zoo_model_under_half_its_working_set(name):
    # the memory cap: half the uncapped run's peak on every device; the capped run stays
    # under it (evicting and reloading blocks) and still equals torch
    module, args, fn = traced(name)
    with torch.no_grad():
        expected = module(*args)
    free = ej.compile(fn, devices=2)
    assert_close(free.run(*args), expected)
    cap = max(free.run_stats.peak_bytes_per_device.values()) // 2
    capped = ej.compile(fn, devices=2, memory_limit=cap)
    assert_close(capped.run(*args), expected)
    assert max(capped.run_stats.peak_bytes_per_device.values()) <= cap


@pytest.mark.parametrize("name", ["nn.Sequential MLP", "zoo:mlp", "zoo:chain", "zoo:resnet18", "zoo:moe", "zoo:lstm"])
def test_fx_fallback_matches_torch(name):
    module, args, fn = traced(name, "fx")
    assert fn.method == "fx"
    with torch.no_grad():
        expected = module(*args)
    assert_close(ej.compile(fn, devices=2).run(*args), expected)


def test_parameters_are_bound_inputs_and_numpy_in_numpy_out():
    module, args, fn = traced("zoo:llama-block")
    assert fn.arg_names == ("x",)
    assert set(fn.bound) >= {"wq.weight", "w2.weight", "attention_norm.weight"}
    np.testing.assert_array_equal(fn.bound["wq.weight"], module.wq.weight.detach().numpy())
    prog = ej.compile(fn, devices=2)
    out = prog.run(args[0].numpy())
    assert isinstance(out, np.ndarray)
    with torch.no_grad():
        np.testing.assert_allclose(out, module(*args).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fn.reference(args[0].numpy()), out, rtol=1e-5, atol=1e-6)


def test_input_free_subgraphs_fold_to_constants():
    # masks and position tables built in forward become fills: no graph input, nothing to move
    _, _, fn = traced("long tail")
    graph = ej.Graph(list(fn.outputs))
    names = {x.op.name for x in graph.inputs}
    assert names == {"x", "idx", "p.weight", "p.bias", "table"}
    fills = [n for n in graph.nodes if isinstance(n.op, Fill)]
    assert any(n.dtype == "bool" for n in fills) and any(n.dtype.startswith("float") for n in fills)
    # exact (bool / int / layout) ops on fills fold away; float32 arithmetic on fills stays an op
    # (folding would evaluate it in float64 and lose torch's rounding), computed where needed
    for n in graph.ops:
        on_fills = n.inputs and all(isinstance(i.op, Fill) for i in n.inputs)
        assert not (on_fills and n.dtype in ("bool", "int64")), n


class Unsupported(nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.linalg.inv(y)  # the line the error must name


def test_unsupported_op_names_op_and_source_line():
    with pytest.raises(ej.UnsupportedOpError) as e:
        ej.from_torch(Unsupported(), (torch.randn(3, 3),))
    msg = str(e.value)
    assert "'linalg_inv'" in msg and "aten.linalg_inv" in msg
    assert "test_torch_import.py" in msg and "torch.linalg.inv(y)" in msg
    # points to the page that lists the supported ops instead of repeating the 169 names
    assert "docs/torch_ops.md" in msg and "masked_fill" not in msg


def test_bad_modules_and_arguments():
    with pytest.raises(ej.EinjoinError, match="expected a torch.nn.Module"):
        ej.from_torch(lambda x: x, (torch.randn(2),))
    with pytest.raises(ej.EinjoinError, match="method"):
        ej.from_torch(nn.Linear(2, 2), (torch.randn(2),), method="jit")
    # plain dropout is translated in training mode (tests/test_grad_torch.py); alpha dropout is not
    drop = nn.Sequential(nn.Linear(4, 4), nn.AlphaDropout(0.5)).train()
    with pytest.raises(ej.UnsupportedOpError, match="eval"):
        ej.from_torch(drop, (torch.randn(2, 4),))
    with pytest.raises(ej.EinjoinError, match="dropout_seed"):
        ej.from_torch(nn.Linear(2, 2), (torch.randn(2),), dropout_seed=0.5)
    _, args, fn = traced("zoo:mlp")
    prog = ej.compile(fn, devices=2)
    with pytest.raises(ej.EinjoinError, match="missing forward argument"):
        prog.run()
    with pytest.raises(ej.EinjoinError, match="positional inputs"):
        prog.run(args[0], args[0])
    # other shapes import the module again (H4's shape cache): one it cannot take is an error
    with pytest.raises(ej.EinjoinError, match="MLP"):
        prog.run(torch.randn(3, 3))
    module, _ = example("mlp")
    fixed = ej.compile(ej.from_torch(module, args, dynamic={"x": {0: "batch"}}), devices=2)
    with pytest.raises(ej.ShapeError):  # a dim dynamic= does not name
        fixed.run(torch.randn(16, 3))


def test_llama_7b_on_the_meta_device_plans_without_weights():
    from einjoin.models.zoo import LLAMA_7B, LlamaBlock
    with torch.device("meta"):
        block = LlamaBlock(LLAMA_7B).eval()
        x = torch.empty(LLAMA_7B.batch, LLAMA_7B.seq, LLAMA_7B.dim)
    fn = ej.from_torch(block, (x,))
    assert fn.bound == {} and fn.outputs[0].shape == (1, 2048, 4096)
    prog = ej.compile(fn, devices=8, backend="null")
    assert prog.stats.bytes_moved > 0 and prog.stats.flops > 2 * 2048 * 4096 * 4096 * 7
    # every weight (4 of 4096 x 4096, 3 of 4096 x 11008, float32) is loaded exactly once
    weights = (4 * 4096 * 4096 + 3 * 4096 * 11008) * 4
    assert weights < prog.stats.bytes_loaded < weights + 2 * 2048 * 4096 * 4 + 3 * 2048 * 128 * 4 * 2


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("shape", [(3,), (2, 5), (2, 3, 4), (2, 3, 4, 5)])
def test_softmax_without_a_dim_takes_torchs_legacy_dim(method, shape):
    # F.softmax(x) / F.log_softmax(x) with no dim: torch's legacy rule (dim 0 for 0-, 1-, 3-d
    # inputs, else 1), as nn.Softmax() with dim None
    import warnings

    class NoDim(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sm = torch.nn.LogSoftmax()

        def forward(self, x):
            return torch.nn.functional.softmax(x) + torch.nn.functional.log_softmax(x) + self.sm(x)

    x = torch.randn(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "implicit dimension choice" deprecation warning
        want = NoDim()(x).numpy()
        got = ej.from_torch(NoDim(), (x,), method=method).reference(x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


class TwoArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, y):
        return self.lin(x) * 2.0 + y.sum(-1, keepdim=True)


@pytest.mark.parametrize("method", ["export", "fx"])
def test_dynamic_is_checked_and_kept_and_recapture_imports_other_shapes(method):
    torch.manual_seed(0)
    m = TwoArgs().eval()
    x, y = torch.randn(2, 8), torch.randn(2, 3)
    fn = ej.from_torch(m, (x, y), method=method, dynamic={"x": {0: "batch"}, "y": {-2: "batch", 1: "n"}})
    assert fn.dynamic == {"x": {0: "batch"}, "y": {0: "batch", 1: "n"}}
    assert fn.method == method and fn.recapture is not None
    x2, y2 = torch.randn(5, 8), torch.randn(5, 7)
    again = fn.recapture((x2, y2), {})
    assert again.method == method and again.dynamic == fn.dynamic and again.recapture is not None
    assert again.outputs[0].shape == (5, 4) and fn.outputs[0].shape == (2, 4)
    with torch.no_grad():
        assert_close(ej.compile(again, devices=2).run(x2, y2), m(x2, y2))
    assert ej.from_torch(m, (x, y), method=method).dynamic == {}
    # a derived function's outputs are no longer the forward's: nothing to recapture
    assert fn.with_outputs(fn.outputs[0].sum()).recapture is None
    for bad, match in [({"z": {0: "b"}}, "'z', which is not a tensor argument"),
                       ({"x": {2: "b"}}, "names dim 2, but x has 2 dims"),
                       ({"x": {-3: "b"}}, "names dim -3"),
                       ({"x": {True: "b"}}, "names dim True"),
                       ({"x": {0: ""}}, "symbol name"), ({"x": {0: 3}}, "symbol name"),
                       ({"x": [0]}, "mapping dim -> symbol"), ([("x", {0: "b"})], "must be a mapping")]:
        with pytest.raises(ej.EinjoinError, match=match):
            ej.from_torch(m, (x, y), method=method, dynamic=bad)


def test_recapture_pickles_with_its_module():
    import pickle
    fn = ej.from_torch(nn.Linear(3, 2), (torch.randn(4, 3),), dynamic={"input": {0: "batch"}})
    rec = pickle.loads(pickle.dumps(fn.recapture))
    assert rec((torch.randn(6, 3),), {}).outputs[0].shape == (6, 2)


class InPlace(nn.Module):
    """In-place ops whose tensors are read again afterwards: translated as written they would be
    read unwritten; functionalised they are not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        z = y * 1
        z.add_(1.0)
        z.relu_()
        w = x.clone()
        w.mul_(z)
        z /= z.sum(-1, keepdim=True) + 1.0
        return z * 2 + y + w


class DeadConstant(nn.Module):
    """An empty constant torch.export lifts and only ``detach_`` reads (what HF attention code makes),
    beside a constant that is used."""

    def forward(self, x):
        t = torch.tensor([])
        t.detach_()
        return x * 2 + torch.tensor([1.0, 2.0, 3.0])


class ZeroSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x, e):
        return torch.cat([self.empty, x, e], 0).sum(0) + e.sum() + self.empty.sum(0)


@pytest.mark.parametrize("devices", [1, 2])
def test_in_place_ops_are_functionalised(devices):
    torch.manual_seed(0)
    m, x = InPlace().eval(), torch.randn(4, 6)
    fn = ej.from_torch(m, (x,))
    with torch.no_grad():
        assert_close(ej.compile(fn, devices=devices).run(x), m(x))


def test_dead_lifted_constants_are_dropped_and_zero_size_tensors_import():
    x = torch.randn(2, 3)
    fn = ej.from_torch(DeadConstant(), (x,))
    assert list(fn.bound) == ["lifted_tensor_1"] and list(fn.buffers) == ["lifted_tensor_1"]
    assert_close(ej.compile(fn, devices=2).run(x), DeadConstant()(x))
    m, e = ZeroSize(), torch.randn(0, 3)
    for method in ("export", "fx"):
        fn = ej.from_torch(m, (x, e), method=method)
        assert fn.bound["empty"].shape == (0, 3)
        with torch.no_grad():
            for devices in (1, 2):
                assert_close(ej.compile(fn, devices=devices).run(x, e), m(x, e))


class CacheLike(nn.Module):
    """What a Hugging Face model looks like to from_torch: ``config.use_cache`` on, a cache object
    returned unless ``use_cache=False``, non-tensor keyword arguments beside tensor ones."""

    def __init__(self):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(use_cache=True)
        self.lin = nn.Linear(6, 6)

    def forward(self, x, mask=None, use_cache=None, scale=2.0):
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        return (y, object()) if use_cache else y


def test_non_tensor_arguments_are_constants_and_use_cache_is_turned_off():
    torch.manual_seed(0)
    m = CacheLike().eval()
    x, mask = torch.randn(2, 6), torch.rand(2, 6)
    fn = ej.from_torch(m, (x,), {"mask": mask, "scale": 3.0})
    assert fn.arg_names == ("x", "mask") and any("use_cache=False" in n for n in fn.notes)
    with torch.no_grad():
        prog = ej.compile(fn, devices=2)
        assert_close(prog.run(x, mask=mask, scale=3.0), m(x, mask, use_cache=False, scale=3.0))
        with pytest.raises(ej.EinjoinError, match="'scale' is left out.*default 2.0.*import's value 3.0"):
            prog.run(x, mask=mask)  # torch's m(x, mask) would scale by 2.0
        # a recapture keeps the non-tensor arguments; keyword tensors come positionally or by name
        x2, mask2 = torch.randn(5, 6), torch.rand(5, 6)
        want = m(x2, mask2, use_cache=False, scale=3.0)
        for args, kwargs in [((x2, mask2), {}), ((x2,), {"mask": mask2})]:
            again = fn.recapture(args, kwargs)
            assert again.arg_names == ("x", "mask")
            assert_close(torch.from_numpy(again.reference(x2, mask2)), want)
    assert fn.constants == {"scale": 3.0, "use_cache": False} and fn.call_args == ("x", "mask", "scale", "use_cache")
    # what leaving them out means in torch (use_cache=False was the import's own setting: none)
    assert fn.defaults == {"scale": 2.0}
    assert ej.from_torch(m, (x,), {"use_cache": False}).notes == ()
    with pytest.raises(ej.EinjoinError, match="object"):  # asked for the cache: export cannot return it
        ej.from_torch(m, (x,), {"use_cache": True}, method="export")


class Experts(nn.Module):
    """A Hugging Face MoE's switch: ``config._experts_implementation`` other than 'batched_mm'
    dispatches with a data-dependent shape (here ``nonzero``); transformers' experts classes have
    ``_apply_gate``."""

    _apply_gate = None

    def __init__(self, impl: str):
        super().__init__()
        from types import SimpleNamespace
        self.config = SimpleNamespace(_experts_implementation=impl)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.config._experts_implementation != "batched_mm":
            return y[torch.nonzero(y[:, 0] > 0)[:, 0]]
        return y * (y[:, :1] > 0)


def test_hf_experts_are_captured_with_static_shapes_and_the_setting_is_restored():
    m, x = Experts("grouped_mm").eval(), torch.randn(6, 4)
    fn = ej.from_torch(m, (x,))
    assert m.config._experts_implementation == "grouped_mm"
    assert any("batched_mm" in n for n in fn.notes)
    m.config._experts_implementation = "batched_mm"
    with torch.no_grad():
        assert_close(ej.compile(fn, devices=2).run(x), m(x))
    assert ej.from_torch(m, (x,)).notes == ()
    m.config._experts_implementation = "eager"  # inside a user's wrapper too
    wrapped = nn.Sequential(m, nn.ReLU())
    assert any("'eager'" in n for n in ej.from_torch(wrapped, (x,)).notes)
    assert m.config._experts_implementation == "eager"
    # a config that says 'eager' on a model without experts classes is left alone, and no note
    plain = nn.Linear(4, 4)
    plain.config = m.config
    assert ej.from_torch(plain, (x,)).notes == ()


def test_training_batch_norm_running_stats_are_buffer_updates():
    import copy
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
    x = torch.randn(2, 3, 8, 8)
    fn = ej.from_torch(m, (x,))
    assert sorted(fn.buffer_updates) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert any("buffer_updates" in n for n in fn.notes)
    after = copy.deepcopy(m)
    with torch.no_grad():
        want = after(x)  # one training step's forward: updates the deep copy's buffers
    full = fn.with_outputs([fn.outputs[0], *fn.buffer_updates.values()])
    got = ej.compile(full, devices=2).run(x)
    assert_close(got[0], want)
    buffers = dict(after.named_buffers())
    for name, new in zip(fn.buffer_updates, got[1:]):
        assert_close(new, buffers[name])
    assert_close(ej.compile(fn, devices=2).run(x), want)  # the forward alone: outputs unchanged


class NamedResults(nn.Module):
    def forward(self, x):
        return torch.max(x, 1).values + torch.min(x, 1).indices


def test_fx_reads_fields_of_named_tuple_results():
    x = torch.randn(3, 5)
    fn = ej.from_torch(NamedResults(), (x,), method="fx")
    assert_close(ej.compile(fn, devices=2).run(x), NamedResults()(x))


class SliceAssign(nn.Module):
    def forward(self, x, y):
        w = x.clone()
        w[:, 0] = 0.0  # functionalised: fill + select_scatter
        w[:, 2:4] = y[:, :2]  # copy + slice_scatter
        return w * 2


def test_slice_assignment_is_functionalised():
    x, y = torch.randn(3, 6), torch.randn(3, 6)
    fn = ej.from_torch(SliceAssign(), (x, y))
    assert_close(ej.compile(fn, devices=2).run(x, y), SliceAssign()(x, y))


def test_recapture_fills_tuple_arguments_and_keeps_the_import_time_modes():
    torch.manual_seed(0)
    cell = nn.LSTMCell(4, 6).eval()
    x, h, c = torch.randn(3, 4), torch.randn(3, 6), torch.randn(3, 6)
    fn = ej.from_torch(cell, (x, (h, c)))
    assert len(fn.arg_names) == 3  # x and hx flattened
    x5, h5, c5 = torch.randn(5, 4), torch.randn(5, 6), torch.randn(5, 6)
    with torch.no_grad():
        want = cell(x5, (h5, c5))
    for again in (fn.recapture((x5, h5, c5), {}), fn.recapture((x5,), {"hx": (h5, c5)})):
        got = again.reference(x5, h5, c5)
        for g, w in zip(got, want):
            assert_close(torch.from_numpy(g), w)
    # imported in eval mode; the user then trains the module in torch: a recapture stays in eval mode,
    # captures a copy (the live module is left alone) and computes with the module's current weights
    m = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    fn = ej.from_torch(m, (torch.randn(3, 4),))
    m.train()
    with torch.no_grad():
        m[0].weight.mul_(2.0)
    again = fn.recapture((torch.randn(6, 4),), {})
    assert m.training and again.method == "export" and again.recapture.module is not m
    assert again.recapture.module[0].weight is m[0].weight
    x6 = torch.randn(6, 4)
    with torch.no_grad():
        assert_close(torch.from_numpy(again.reference(x6)), m.eval()(x6))


@pytest.mark.parametrize("hook", ["forward", "pre"])
def test_fx_refuses_module_hooks_export_runs_them(hook):
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    if hook == "forward":
        m[0].register_forward_hook(lambda mod, inp, out: out * 10)
    else:
        m[2].register_forward_pre_hook(lambda mod, inp: (inp[0] + 1,))
    x = torch.randn(3, 4)
    with pytest.raises(ej.UnsupportedOpError, match=f"{'pre-' if hook == 'pre' else 'forward'} hook on "
                                                    f"{'0' if hook == 'forward' else '2'} \\(Linear\\)"):
        ej.from_torch(m, (x,), method="fx")
    with torch.no_grad():
        assert_close(ej.compile(ej.from_torch(m, (x,)), devices=2).run(x), m(x))
