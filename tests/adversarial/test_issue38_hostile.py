"""Issue 38 (H2): the hostile findings left open last session, differential against torch / numpy.

Each test failed before its fix (the commit that added it says what einjoin did instead):

- the module guard keeps a plain settings object the forward read (a ``SimpleNamespace``,
  dataclass or dict held by the module: ``m.cfg.mult = 5`` ran with the import's 2) and the
  attributes of a module whose forward reads them through ``object.__getattribute__``;
- a saved program reading only a sparse input's keys takes its feed in a fresh process;
- an int32 sparse feed is checked as int32 (it was refused as 'got int64');
- ``index_fill`` names an index below ``-n`` as given (-5 on a dim of 4 was 'index -1');
- ``aten.narrow`` is translated (negative start, length), and refused as torch refuses it;
- a graph's sparse einsum broadcasts a dense operand's size-1 dims, as ``ej.einsum`` does;
- ``A.T`` / ``A.sum()`` / ``A[0]`` on a sparse input are an EinjoinError naming the einsum to write;
- ``ej.Trainer.load`` with another ``accumulate`` continues from a boundary as torch does (refused
  inside an accumulation); ``trainer.step`` reads Python lists as ``torch.as_tensor`` does;
- torch.compile never compiles the module guard's recorder (another thread's compiled module
  met it during an import).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej


def _close(got: object, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), want, rtol=tol, atol=tol, equal_nan=True)


# ---------------------------------------------------------------- 1. settings held in a plain object (C)


@dataclasses.dataclass
class _Cfg:
    mult: float = 2.0
    inner: dict = dataclasses.field(default_factory=lambda: {"bias": 1.0})


class _Held(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.lin, self.cfg = nn.Linear(4, 4), cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if isinstance(c, dict):
            return self.lin(x) * c["mult"] + c["inner"]["bias"]
        return self.lin(x) * c.mult + c.inner["bias"]


def _namespace() -> object:
    return types.SimpleNamespace(mult=2.0, inner={"bias": 1.0})


@pytest.mark.parametrize("make", [_namespace, _Cfg, lambda: {"mult": 2.0, "inner": {"bias": 1.0}}],
                         ids=["SimpleNamespace", "dataclass", "dict"])
def test_a_setting_in_a_plain_object_the_forward_read_is_guarded(make: object) -> None:
    """The guard notes reads through ``nn.Module.__getattribute__`` (and Hugging Face's config's);
    a ``SimpleNamespace``, dataclass or dict of settings held by the module is read past it, so
    ``m.cfg.mult = 5`` after the import ran silently with 2.0. The object's state is now kept
    whole and compared: a change is refused naming it; set back, it runs; an attribute of the
    module the forward never read still changes nothing."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    cfg = make()  # type: ignore[operator]
    m = _Held(cfg)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    cfg = m.cfg  # torch.export puts a copy of a dict attribute back
    m.epoch = 1  # type: ignore[assignment]  # never read: runs
    set_ = (lambda k, v: cfg.__setitem__(k, v)) if isinstance(cfg, dict) else (lambda k, v: setattr(cfg, k, v))
    inner = cfg["inner"] if isinstance(cfg, dict) else cfg.inner  # type: ignore[attr-defined]
    with torch.no_grad():
        _close(prog.run(x), m(x))
        set_("mult", 5.0)
        with pytest.raises(ej.EinjoinError, match=r"cfg\.mult is 5\.0 now, 2\.0 when it was imported"):
            prog.run(x)
        set_("mult", 2.0)
        inner["bias"] = 3.0
        with pytest.raises(ej.EinjoinError, match=r"cfg\.inner\.bias is 3\.0 now, 1\.0"):
            prog.run(x)
        inner["bias"] = 1.0
        _close(prog.run(x), m(x))
        m.cfg = make()  # type: ignore[operator]  # an equal object: same graph
        _close(prog.run(x), m(x))


def test_a_setting_read_through_object_getattribute_is_guarded() -> None:
    """``object.__getattribute__(self, "scale")`` in a forward reads past the recorder: the
    module's attributes are guarded whole (m.scale = 5.0 ran with 2.0)."""
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * object.__getattribute__(self, "scale")

    torch.manual_seed(0)
    x, m = torch.randn(3, 4), Raw()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    with torch.no_grad():
        m.scale = 5.0
        with pytest.raises(ej.EinjoinError, match=r"scale is 5\.0 now, 2\.0 when it was imported"):
            prog.run(x)
        m.scale = 2.0
        _close(prog.run(x), m(x))


# ---------------------------------------------------------------- 2. a saved program reading sparse keys alone (B)


def test_a_loaded_program_reading_only_a_sparse_inputs_keys_takes_its_feed(tmp_path: object) -> None:
    """The gradient of ``(A @ x).sum()`` w.r.t. ``A``'s values reads ``A``'s keys and ``x``, not
    its values: no node of it declares ``A``, so a fresh process that loaded it did not know the
    feed ``A=`` ("unknown input 'A'; the graph's inputs are A.keys[5,4], x"). The file now holds
    its sparse inputs' declarations; loaded in a fresh process it runs as saved (and as numpy)."""
    import subprocess
    import sys

    import scipy.sparse

    A = ej.sparse_input("A_i38", (5, 4), nnz=10, dtype="float64")
    x = ej.input("x_i38", (4,), "float64")
    (dA,) = ej.grad((A @ x).sum(), [A])
    prog = ej.compile(dA)
    a = scipy.sparse.random(5, 4, density=0.3, random_state=1, format="coo")
    got = A.on_pattern(a, prog.run(A_i38=a, x_i38=np.arange(4.0))).todense()
    np.testing.assert_array_equal(got, np.where(a.toarray() != 0, np.arange(4.0), 0.0))  # d/dA[i,j] = x[j]
    path = f"{tmp_path}/keys_only.ej"
    prog.save(path)
    code = ("import numpy as np, scipy.sparse, einjoin as ej\n"
            f"p = ej.load({path!r})\n"
            "a = scipy.sparse.random(5, 4, density=0.3, random_state=1, format='coo')\n"
            "print(p.run(A_i38=a, x_i38=np.arange(4.0)).tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert eval(done.stdout) == np.asarray(prog.run(A_i38=a, x_i38=np.arange(4.0))).tolist()


# ---------------------------------------------------------------- 3. an int32 sparse feed (E)


def _int32_adjacency() -> object:
    import scipy.sparse
    rng = np.random.default_rng(0)
    a = scipy.sparse.random(5, 4, density=0.4, random_state=1, format="coo")
    a.data = rng.integers(-9, 9, a.nnz).astype(np.float64)
    return a.astype(np.int32)


@pytest.mark.parametrize("kind", ["scipy", "torch"])
def test_an_int32_sparse_feed_is_checked_as_int32(kind: str) -> None:
    """``ej.sparse`` widens int32 values to int64, and the feed's exact-cast check read the
    widened dtype: an int32 scipy / torch adjacency fed to a float64 sparse input (exact) was
    refused as 'got int64', and to a float32 one (not exact) was refused naming int64. Now the
    fed dtype is checked: float64 runs as numpy computes; float32 is refused naming int32."""
    a = _int32_adjacency()
    fed = a if kind == "scipy" else torch.sparse_coo_tensor(np.vstack([a.row, a.col]), a.data, a.shape)  # type: ignore[attr-defined]
    assert str(fed.dtype).endswith("int32")
    A = ej.sparse_input("A_i32", (5, 4), nnz=10, dtype="float64")
    x = ej.input("x_i32", (4,), "float64")
    xv = np.arange(1.0, 5.0)
    got = ej.compile(ej.einsum("ij,j->i", A, x)).run(A_i32=fed, x_i32=xv)
    np.testing.assert_array_equal(got, a.toarray() @ xv)  # type: ignore[attr-defined]
    A32 = ej.sparse_input("A_i32", (5, 4), nnz=10, dtype="float32")
    x32 = ej.input("x_i32f", (4,), "float32")
    prog = ej.compile(ej.einsum("ij,j->i", A32, x32))
    with pytest.raises(ej.EinjoinError, match=r"expected float32 values, got int32"):
        prog.run(A_i32=fed, x_i32f=xv.astype(np.float32))


# ---------------------------------------------------------------- 4. index_fill's out-of-range index named as given (E)


class _IndexFill(nn.Module):
    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x.index_fill(1, i, 7.0)


def test_index_fill_names_an_out_of_range_negative_index_as_given() -> None:
    """A negative index is read from the end (``n + i``); one below ``-n`` was shifted too, so
    -5 on a dim of size 4 was reported as 'index -1'. It stays as given now; in-range negative
    indices still run as torch's."""
    x = torch.arange(12.0).reshape(3, 4)
    prog = ej.compile(ej.from_torch(_IndexFill(), (x, torch.tensor([0, -1]))), quiet=True)
    for ok in ([0, -1], [-4, 2], [3, -2]):
        i = torch.tensor(ok)
        _close(prog.run(x, i), _IndexFill()(x, i))
    with pytest.raises(IndexError, match="index -5"):
        _IndexFill()(x, torch.tensor([0, -5]))
    with pytest.raises(ej.EinjoinError, match=r"index -5 out of range for a table of 4 rows"):
        prog.run(x, torch.tensor([0, -5]))


# ---------------------------------------------------------------- 5. narrow (E)


class _Narrow(nn.Module):
    def __init__(self, dim: int, start: int, length: int) -> None:
        super().__init__()
        self.dim, self.start, self.length = dim, start, length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.narrow(self.dim, self.start, self.length) * 2 + torch.narrow(x, self.dim, self.start, self.length)


@pytest.mark.parametrize("dim, start, length", [(1, -3, 2), (0, 1, 2), (-1, -5, 5), (1, 5, 0), (0, -4, 1)])
def test_narrow_is_translated_as_torch_computes_it(dim: int, start: int, length: int) -> None:
    """``aten.narrow`` had no translation ('no einjoin translation of this op'): every module
    using ``x.narrow`` was refused. Negative starts count from the end, as torch's."""
    x = torch.arange(20.0).reshape(4, 5)
    m = _Narrow(dim, start, length)
    _close(ej.compile(ej.from_torch(m, (x,)), quiet=True).run(x), m(x))


@pytest.mark.parametrize("start, length, what", [(-6, 1, r"start out of range .*\[-5, 5\], but got -6"),
                                                  (-3, 4, r"start \(2\) \+ length \(4\) exceeds dimension size \(5\)"),
                                                  (2, -1, r"length must be non-negative")])
def test_narrow_out_of_range_is_refused_as_torch_refuses_it(start: int, length: int, what: str) -> None:
    from einjoin.frontend.aten_layout import LAYOUT_OPS
    with pytest.raises((RuntimeError, IndexError), match=what):
        torch.zeros(4, 5).narrow(1, start, length)
    with pytest.raises(ej.ShapeError, match=what):
        LAYOUT_OPS["narrow"](ej.input("x_n38", (4, 5)), 1, start, length)


# ---------------------------------------------------------------- 6. a graph sparse einsum broadcasts size-1 dims (E)


@pytest.mark.parametrize("fed", [True, False], ids=["sparse_input", "constant"])
@pytest.mark.parametrize("eq, xshape", [("ij,jk->ik", (1, 3)), ("ij,ij->ij", (1, 4)), ("ij,ij->j", (5, 1))])
def test_a_graph_sparse_einsum_broadcasts_size_one_dense_dims(fed: bool, eq: str, xshape: tuple) -> None:
    """``ej.einsum`` and ``ej.sparse_compile`` broadcast a size-1 dim as numpy does; the graph's
    sparse einsum refused it ("label 'j' has size 4 in operand 0 ... but size 1 in operand 1").
    Forward and the dense operand's gradient now match numpy's."""
    import scipy.sparse
    a = scipy.sparse.random(5, 4, density=0.4, random_state=2, format="coo")
    xv = np.random.default_rng(3).normal(size=xshape)
    A: object = ej.sparse_input("A_b38", (5, 4), nnz=12, dtype="float64") if fed else ej.sparse("A_c38", a)
    x = ej.input(f"x_b38_{xshape[0]}", xshape, "float64")
    y = ej.einsum(eq, A, x)
    (dx,) = ej.grad(y.sum(), [x])
    feeds = {"A_b38": a} if fed else {}
    got, gx = ej.compile([y, dx]).run(**feeds, **{x.node.op.name: xv})  # type: ignore[attr-defined]
    want = np.einsum(eq, a.toarray(), np.broadcast_to(xv, (5, 4) if eq != "ij,jk->ik" else (4, 3)))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    ones = np.ones_like(want)
    full = np.einsum(f"{eq.split('->')[1]},{eq.split(',')[0]}->{eq.split(',')[1].split('->')[0]}", ones, a.toarray())
    np.testing.assert_allclose(gx, full.sum(axis=tuple(d for d, n in enumerate(xshape) if n == 1), keepdims=True),
                               rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- 7. the dense tensor API on a sparse input (E)


@pytest.mark.parametrize("use", ["T", "sum", "reshape", "index"])
def test_the_dense_tensor_api_on_a_sparse_input_is_an_einjoin_error_naming_the_einsum(use: str) -> None:
    """``A.T`` and ``A.sum()`` on an ``ej.sparse_input`` raised a raw AttributeError ('SparseInput'
    object has no attribute 'T'), ``A[0]`` a TypeError. Now an EinjoinError naming the input and
    the einsums that compute them, which give scipy's values."""
    import scipy.sparse
    A = ej.sparse_input("A_api38", (5, 4), nnz=12, dtype="float64")
    f = {"T": lambda: A.T, "sum": lambda: A.sum(), "reshape": lambda: A.reshape(20),  # type: ignore[attr-defined]
         "index": lambda: A[0]}[use]  # type: ignore[index]
    with pytest.raises(ej.EinjoinError, match=r"sparse input 'A_api38' \[5, 4\]"):
        f()
    assert not hasattr(A, "no_such_thing")  # other names: still a plain AttributeError
    a = scipy.sparse.random(5, 4, density=0.4, random_state=4, format="coo")
    x = ej.input("x_api38", (5, 3), "float64")
    xv = np.random.default_rng(5).normal(size=(5, 3))
    total, rows, at_x = ej.compile([ej.einsum("ij->", A), ej.einsum("ij->i", A), ej.einsum("ji,jk->ik", A, x)]).run(
        A_api38=a, x_api38=xv)
    np.testing.assert_allclose(total, a.sum(), rtol=1e-12)
    np.testing.assert_allclose(rows, np.asarray(a.sum(1)).ravel(), rtol=1e-12)
    np.testing.assert_allclose(at_x, a.T @ xv, rtol=1e-12)


# ---------------------------------------------------------------- 8. Trainer: another accumulate at load, lists (F)


def _torch_schedule(module: nn.Module, batches: list, schedule: list[int]) -> tuple[list[float], nn.Module]:
    """torch's SGD (momentum) with accumulate ``schedule[i]`` at micro-batch ``i`` (mean gradients)."""
    import copy
    m = copy.deepcopy(module)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False)
    losses, done = [], 0
    for (x, t), k in zip(batches, schedule):
        loss = nn.functional.cross_entropy(m(x), t)
        (loss / k).backward()
        losses.append(loss.item())
        done += 1
        if done % k == 0:
            opt.step()
            opt.zero_grad()
            done = 0
    return losses, m


@pytest.mark.parametrize("then", [1, 3])
def test_a_trainer_saved_at_a_boundary_loads_with_another_accumulate(tmp_path: object, then: int) -> None:
    """At an accumulation boundary the gradient sums are zero, yet ``Trainer.load(...,
    accumulate=1)`` of a run saved with 2 was refused ('unexpected grad_acc.bias, ...'), and
    with 3 it loaded the old micro-batch count: the next update came after 2 micro-batches with
    their sum divided by 3. Now it continues as torch does with the new accumulation; a run
    saved inside an accumulation is refused naming both."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(10)]
    sgd = ej.optim.SGD(lr=0.1, momentum=0.9)
    first = ej.Trainer(m, batches[0], nn.functional.cross_entropy, sgd, accumulate=2)
    losses = [first.step(*b) for b in batches[:4]]
    first.save(f"{tmp_path}/boundary.safetensors")
    later = ej.Trainer.load(f"{tmp_path}/boundary.safetensors", m, batches[0], nn.functional.cross_entropy,
                            accumulate=then)
    assert later.accumulate == then and later.steps == 2
    rest = 6 if then == 3 else 5
    losses += [later.step(*b) for b in batches[4:4 + rest]]
    want, ref = _torch_schedule(m, batches[:4 + rest], [2] * 4 + [then] * rest)
    np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-6)
    for k, v in later.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-5, atol=1e-6)
    first.step(*batches[4])  # inside an accumulation now
    first.save(f"{tmp_path}/inside.safetensors")
    with pytest.raises(ej.EinjoinError, match=r"inside an accumulation \(micro-batch 1 of accumulate=2\)"):
        ej.Trainer.load(f"{tmp_path}/inside.safetensors", m, batches[0], nn.functional.cross_entropy,
                        accumulate=then)


def test_a_trainer_takes_python_lists_as_torch_as_tensor_reads_them() -> None:
    """``trainer.step(x.tolist(), t.tolist())`` was refused ('module argument 0 is float64 but the
    example batch's was float32'): a list of floats went through numpy (float64), where torch
    reads it as float32. Lists are read as torch.as_tensor reads them: the same loss as the
    tensors' (and int targets as int64)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x, t = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    tr = ej.Trainer(m, (x, t), nn.functional.cross_entropy, ej.optim.SGD(lr=0.0))
    assert tr.step(x.tolist(), t.tolist()) == tr.step(x, t)
    with pytest.raises(ej.EinjoinError, match=r"batch\[1\] is not a tensor or array of numbers"):
        tr.step(x, [0, 1, "two"])


# ---------------------------------------------------------------- 9. torch.compile meeting the guard's recorder (D)


def test_torch_compile_never_compiles_the_guards_recorder() -> None:
    """While an import runs, ``nn.Module.__getattribute__`` is the guard's recorder; a module run
    with ``torch.compile`` meanwhile (another thread's) had dynamo compile the recorder as a frame
    of its own, once per module type and guard (8 cache entries for a Linear + ReLU here; with
    several imports its recompile limit, and that thread's calls crawled). Its frame is skipped by
    dynamo now: no entry, and the compiled module's values are torch's."""
    import torch._dynamo  # noqa: F401 - the frame cache the check reads
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from einjoin.frontend.module_guard import recording
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8)
    with recording():
        recorder = nn.Module.__getattribute__
        out = torch.compile(m, backend="eager")(x)
    assert recorder.__code__.co_filename.endswith("module_guard.py")
    assert len(_debug_get_cache_entry_list(recorder.__code__)) == 0
    torch.testing.assert_close(out, m(x))
