"""Issue 36 (H1): silent wrong answers of imported torch programs, differential against torch.

- a forward that writes a buffer (``self.count += 1``, a training-mode BatchNorm's running
  statistics): each run of the compiled program is one torch call, and the module's buffer moves
  on as torch's would (the program writes the new value back);
- a parameter or buffer replaced by another object (``lin.weight = nn.Parameter(w)``,
  ``load_state_dict(sd, assign=True)``): the program computes with what the module holds now;
- activations at +-inf and nan give torch's values.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej


def _close(got: object, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), want, rtol=tol, atol=tol, equal_nan=True)


# ---------------------------------------------------------------- 1. buffer writes


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return x * self.count


def test_a_buffer_the_forward_writes_moves_on_between_runs() -> None:
    """torch: 2, 3, 4 over three calls (and the buffer is 4); a compiled program gave 2, 2, 2."""
    x = torch.ones(3)
    m, twin = _Counter(), _Counter()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    for _ in range(3):
        _close(prog.run(x), twin(x))
        _close(m.count, twin.count)  # the module's buffer is the program's state


def test_a_buffer_written_by_the_user_between_runs_is_read() -> None:
    x = torch.ones(2)
    m, twin = _Counter(), _Counter()
    prog = ej.compile(ej.from_torch(m, (x,)), devices=2, quiet=True)
    prog.run(x), twin(x)
    with torch.no_grad():
        m.count.fill_(10.0), twin.count.fill_(10.0)
    _close(prog.run(x), twin(x))
    _close(m.count, twin.count)


@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_training_batch_norm_running_stats_follow_torch_over_runs(kind: str) -> None:
    """The common real case: BatchNorm in train mode; outputs, running_mean, running_var and
    num_batches_tracked after each of three runs as torch's, also at a new batch size (another
    compiled shape writes the same buffers)."""
    torch.manual_seed(0)
    if kind == "1d":
        m = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, momentum=0.3)).train()
        xs = [torch.randn(6, 4), torch.randn(6, 4), torch.randn(3, 4)]
    else:
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
        xs = [torch.randn(2, 3, 7, 7), torch.randn(2, 3, 7, 7), torch.randn(3, 3, 7, 7)]
    twin = copy.deepcopy(m)
    prog = ej.compile(ej.from_torch(m, (xs[0],)), devices=2, quiet=True)
    for x in xs:
        got = prog.run(x)
        with torch.no_grad():
            want = twin(x)
        _close(got, want, 1e-4)
        for (name, b), (_, w) in zip(m.named_buffers(), twin.named_buffers()):
            torch.testing.assert_close(b, w, rtol=1e-5, atol=1e-6, msg=name)


def test_buffer_writes_keep_the_forward_structure_and_are_not_returned() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            self.n.add_(x.sum(0))
            return {"y": x + self.n, "n": self.n.clone()}

    x = torch.ones(3, 2)
    m, twin = Two(), Two()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    for _ in range(2):
        got, want = prog.run(x), twin(x)
        assert sorted(got) == ["n", "y"]
        _close(got["y"], want["y"])
        _close(got["n"], want["n"])
    _close(prog.run_reference(x)["y"], twin.n + x.sum(0) + x)  # the reference run reads the buffer
    _close(prog.run_reference(x)["y"], twin.n + x.sum(0) + x)  # ... and does not write it
    _close(m.n, twin.n)


def test_a_pickled_program_with_buffer_writes_carries_its_buffer() -> None:
    """Unpickled, the program is detached from the module: it moves its own copy on."""
    x = torch.ones(2)
    m, twin = _Counter(), _Counter()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    prog.run(x), twin(x)
    again = pickle.loads(pickle.dumps(prog))
    for _ in range(2):
        _close(again.run(x), twin(x))
    _close(m.count, torch.tensor(2.0))  # the original module is not the copy's


def test_saving_a_program_with_buffer_writes_is_refused(tmp_path: object) -> None:
    x = torch.ones(2)
    prog = ej.compile(ej.from_torch(_Counter(), (x,)), quiet=True)
    with pytest.raises(ej.EinjoinError, match="count"):
        prog.save(str(tmp_path) + "/counter.einjoin")  # type: ignore[operator]


def test_concurrent_runs_of_a_buffer_writing_program_each_see_the_last_write() -> None:
    """Runs are serialised (as a program with state): 8 threads, two shapes, 8 increments."""
    import threading
    m = _Counter()
    prog = ej.compile(ej.from_torch(m, (torch.ones(2),)), quiet=True)
    prog.run(torch.ones(3))  # the second shape compiled before the threads start
    seen: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        y = prog.run(torch.ones(2 + i % 2))
        with lock:
            seen.append(float(y[0]))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == [3.0 + i for i in range(8)], seen
    _close(m.count, torch.tensor(10.0))


# ---------------------------------------------------------------- 2. replaced parameter objects


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


@pytest.mark.parametrize("method", ["export", "fx"])
def test_a_parameter_replaced_by_a_new_object_is_followed(method: str) -> None:
    """``lin.weight = nn.Parameter(new)``: torch computes with the new weight; a compiled program
    kept the old one (bound by tensor object)."""
    m, x = _mlp(), torch.randn(5, 3)
    prog = ej.compile(ej.from_torch(m, (x,), method=method), devices=2, quiet=True)
    _close(prog.run(x), m(x))
    m[0].weight = nn.Parameter(torch.randn(4, 3))
    m[2].bias = nn.Parameter(torch.randn(2))
    with torch.no_grad():
        _close(prog.run(x), m(x))
        xx = torch.randn(7, 3)  # another shape, compiled after the replacement
        _close(prog.run(xx), m(xx))


def test_load_state_dict_with_assign_is_followed_at_every_shape() -> None:
    m, x = _mlp(), torch.randn(5, 3)
    prog = ej.compile(ej.from_torch(m, (x,)), devices=2, quiet=True)
    prog.run(torch.randn(2, 3))  # another shape compiled with the old weights bound
    other = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    m.load_state_dict(other.state_dict(), assign=True)
    with torch.no_grad():
        for xx in (x, torch.randn(2, 3)):
            _close(prog.run(xx), other(xx))
            _close(prog.run(xx), m(xx))


def test_a_replaced_submodule_is_followed_and_a_replaced_buffer_too() -> None:
    m, x = _mlp(), torch.randn(5, 3)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    prog.run(x)
    m[2] = nn.Linear(4, 2).eval()  # the same type and mode (a train-mode one is refused: see below)
    with torch.no_grad():
        _close(prog.run(x), m(x))
    c, twin = _Counter(), _Counter()
    prog = ej.compile(ej.from_torch(c, (torch.ones(2),)), quiet=True)
    prog.run(torch.ones(2)), twin(torch.ones(2))
    c.count = torch.tensor(-5.0)  # a new buffer object: read, and written
    twin.count = torch.tensor(-5.0)
    _close(prog.run(torch.ones(2)), twin(torch.ones(2)))
    _close(c.count, twin.count)


def test_a_replaced_parameter_of_another_shape_or_a_removed_one_is_an_error_naming_it() -> None:
    m, x = _mlp(), torch.randn(5, 3)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    m[0].weight = nn.Parameter(torch.randn(4, 5))
    with pytest.raises(ej.EinjoinError, match=r"0\.weight"):
        prog.run(x)
    m[0].weight = nn.Parameter(torch.randn(4, 3))
    prog.run(x)
    del m[0].bias
    m[0].bias = None
    with pytest.raises(ej.EinjoinError, match=r"0\.bias"):
        prog.run(x)


def test_untying_a_tied_weight_is_an_error_not_one_of_the_two() -> None:
    """A tied weight is one graph input; after ``head.weight = nn.Parameter(...)`` the two uses
    differ, which the compiled graph cannot express: refused, naming both."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(4, 4, bias=False)
            self.head = nn.Linear(4, 4, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    m, x = Tied(), torch.randn(2, 4)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    with torch.no_grad():
        _close(prog.run(x), m(x))
        new = nn.Parameter(torch.randn(4, 4))
        m.emb.weight, m.head.weight = new, new  # re-tied to a new tensor: followed
        _close(prog.run(x), m(x))
    m.head.weight = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ej.EinjoinError, match=r"emb\.weight.*head\.weight|head\.weight.*emb\.weight"):
        prog.run(x)


# ---------------------------------------------------------------- 3. activations at +-inf and nan

_F = torch.nn.functional
_SPECIAL = [-float("inf"), float("inf"), float("nan"), -1e30, 1e30, -0.0, 0.0, -3.0, 3.0, -20.0, 20.0, 21.0,
            -88.0, 89.0, 1e-30, -1e-30, 6.0, -1.0, 1.0, 0.5]
_ACTIVATIONS = {
    "hardswish": _F.hardswish, "hardsigmoid": _F.hardsigmoid, "relu6": _F.relu6, "hardtanh": _F.hardtanh,
    "hardtanh(-2, 0.5)": lambda x: _F.hardtanh(x, -2.0, 0.5), "silu": _F.silu, "gelu": _F.gelu,
    "gelu tanh": lambda x: _F.gelu(x, approximate="tanh"), "softplus": _F.softplus,
    "softplus(2, 5)": lambda x: _F.softplus(x, 2.0, 5.0), "mish": _F.mish, "elu": _F.elu,
    "elu(0.5)": lambda x: _F.elu(x, 0.5), "selu": _F.selu, "celu(2)": lambda x: _F.celu(x, 2.0),
    "leaky_relu": _F.leaky_relu, "logsigmoid": _F.logsigmoid, "softsign": _F.softsign,
    "tanhshrink": _F.tanhshrink, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": _F.relu,
    "threshold": lambda x: _F.threshold(x, 0.5, -2.0), "hypot": lambda x: torch.hypot(x, x.flip(0)),
    "hypot tiny": lambda x: torch.hypot(x * 1e-30, x.flip(0) * 1e-30),
}


class _All(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(f(x) for f in _ACTIVATIONS.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activations_at_inf_and_nan_are_torchs(dtype: torch.dtype) -> None:
    """hardswish(-inf) was 0 (torch: -inf * relu6(-inf + 3) / 6 = nan). gelu(+inf) is compared in
    float64 only: torch's vectorised float32 erf kernel gives nan there (its scalar path, and
    einjoin, inf)."""
    x = torch.tensor(_SPECIAL, dtype=dtype)
    got = ej.compile(ej.from_torch(_All(), (x,)), quiet=True).run(x)
    for name, g, w in zip(_ACTIVATIONS, got, _All()(x)):
        g = torch.as_tensor(np.asarray(g))
        if name == "gelu" and dtype == torch.float32:
            w = _F.gelu(x.double()).float()
        bad = ~torch.isclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert not bad.any(), (name, [(_SPECIAL[i], w[i].item(), g[i].item()) for i in bad.nonzero().flatten()])


# ---------------------------------------------------------------- 4. common patterns, hostile


@pytest.mark.parametrize("method", ["export", "fx"])
def test_an_integer_embedding_table_is_the_table(method: str) -> None:
    """``F.embedding(ids, table)`` with an int64 table (a lookup of ids): the translation told
    indices from weight by dtype, so the table's values were taken as indices (silently wrong
    when they are in range, an out-of-range error otherwise)."""
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.tensor([[0, 1], [1, 0], [5, 6], [2, 2]]))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return _F.embedding(ids, self.table) + torch.embedding(self.table, ids.flip(0))

    ids = torch.tensor([2, 0, 3])
    got = ej.compile(ej.from_torch(Lookup(), (ids,), method=method), devices=2, quiet=True).run(ids)
    assert torch.equal(torch.as_tensor(np.asarray(got)), Lookup()(ids))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2.0
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) * self.scale


def test_a_mode_or_setting_changed_after_the_import_is_refused_not_computed_stale() -> None:
    """torch.export specialises on train/eval mode and on plain attributes the forward reads.
    After ``m.train()`` (an eval-mode BatchNorm import) the program computed eval mode (max
    difference 1.47 from torch); after ``s.scale = 3.0`` it computed with 2.0. Now refused,
    naming the attribute; set back, the program runs again."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)).eval()
    x = torch.randn(6, 4)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    m.train()
    with pytest.raises(ej.EinjoinError, match=r"training is True now, False when"):
        prog.run(x)
    with pytest.raises(ej.EinjoinError, match=r"training"):
        prog.run_async(x)
    m.eval()
    with torch.no_grad():
        _close(prog.run(x), m(x))

    s = _Scaled()
    fn = ej.from_torch(s, (x,))
    prog = ej.compile(fn, quiet=True)
    s.scale = 3.0
    with pytest.raises(ej.EinjoinError, match=r"scale is 3\.0 now, 2\.0"):
        prog.run(x)
    with pytest.raises(ej.EinjoinError, match=r"scale"):
        fn.reference(x)
    s.scale = 2.0
    s.act = nn.GELU()  # another module type: another graph
    with pytest.raises(ej.EinjoinError, match=r"act is GELU now, ReLU"):
        prog.run(x)
    s.act = nn.ReLU()  # the same type and settings: the import's graph holds
    _close(prog.run(x), s(x))
    _close(pickle.loads(pickle.dumps(prog)).run(x), s(x))  # detached copies run unguarded


def test_a_non_contiguous_parameter_written_through_data_is_followed() -> None:
    """``p.data.mul_(2)`` does not bump ``p._version`` (``.data`` has its own counter), and a
    non-contiguous parameter was bound through a contiguous copy re-taken only on a version
    change: the program kept the old values (max difference 0.88 from torch). CPU tensors are
    now viewed with their strides, never copied."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    lin.weight = nn.Parameter(lin.weight.detach().t().contiguous().t())  # a transposed layout
    assert not lin.weight.is_contiguous()
    x = torch.randn(5, 4)
    prog = ej.compile(ej.from_torch(lin, (x,)), devices=2, quiet=True)
    with torch.no_grad():
        _close(prog.run(x), lin(x))
        lin.weight.data.mul_(2)
        lin.bias.data.add_(1)
        _close(prog.run(x), lin(x))


def test_queued_runs_see_the_previous_runs_buffer_write_when_bound_through_a_copy() -> None:
    # a buffer einjoin binds through a copy (here a negative-bit view; a CUDA module's buffers
    # too) was read when each run was prepared: two queued run_async calls both read the initial
    # value (1, 1 and the buffer at 1; torch: 1, 2 and 2). It is read again when the run starts.
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(2, 3)._neg_view())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.n += 1
            return x * self.n

    x = torch.ones(2, 3)
    mod, ref = Counter(), Counter()
    prog = ej.compile(ej.from_torch(mod, (x,)), devices=2, backend="threads", quiet=True)
    handles = [prog.run_async(x) for _ in range(3)]
    got = [float(h.result()[0, 0]) for h in handles]
    want = [float(ref(x)[0, 0]) for _ in range(3)]
    assert got == want and float(mod.n[0, 0]) == float(ref.n[0, 0]) == 3.0


def test_registering_a_hook_after_the_import_is_no_module_change() -> None:
    # registering a full backward hook sets nn.Module's own _is_full_backward_hook: the guard of
    # b12f976 refused every later run although nothing the graph computes changed
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    prog = ej.compile(ej.from_torch(lin, (x,)), devices=1, quiet=True)
    lin.register_full_backward_hook(lambda *a: None)
    np.testing.assert_allclose(prog.run(x), lin(x).detach().numpy(), rtol=1e-6, atol=1e-6)
    drop = torch.nn.Sequential(lin, torch.nn.Dropout(0.5)).eval()
    prog = ej.compile(ej.from_torch(drop, (x,)), devices=1, quiet=True)
    drop.train()  # a mode change the forward reads (dropout) is still refused
    with pytest.raises(ej.EinjoinError, match="training"):
        prog.run(x)
