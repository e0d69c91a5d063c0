"""Issue 35 (session 35): a hostile hunt for wrong answers and raw errors in places the earlier
hunts (issues 33, 34) did not look: the torch backend on empty blocks, run() feeds, saved programs,
``from_torch`` corner cases, the Trainer's state, and the backends against each other. Each test
here failed before its fix (or is an ``xfail(strict=True)`` naming whose module holds the bug)."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej

# ---- finding 1: on the torch backend a max / min over the columns of a tensor with no rows
# (x of shape (0, 4), x.max(1)) failed every run with torch's "cannot reshape tensor of 0
# elements into shape [0, -1]" (the kernel's aggregation flattened the summed dims as -1);
# sync and threads gave the empty result


@pytest.mark.parametrize("agg", ["max", "min", "sum", "prod"])
@pytest.mark.parametrize("devices", [1, 2])
def test_torch_backend_reduces_a_tensor_with_no_rows(agg: str, devices: int) -> None:
    x = ej.input("x", (0, 4))
    y = ej.einsum("ab->a", x, agg=agg)
    out = ej.compile(y, devices=devices, backend="torch").run(x=np.zeros((0, 4), np.float32))
    assert np.asarray(out).shape == (0,) and np.asarray(out).dtype == np.float32


# ---- finding 2: Trainer.load of a missing or non-safetensors file was a raw FileNotFoundError /
# SafetensorError; a header with a key missing or a value that does not parse a raw KeyError,
# ValueError, JSONDecodeError or AttributeError; a saved lr of -1 or nan was taken unchecked (the
# lr setter refuses both), so training went on with nan weights; an optimizer "class" naming any
# attribute of ej.optim (check_lr, math) was called as a constructor (a raw TypeError)


@pytest.fixture(scope="module")
def saved_trainer(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    import torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    tr = ej.Trainer(m, (x, y), torch.nn.functional.mse_loss, optimizer=ej.optim.SGD(lr=0.1), devices=1)
    tr.step(x, y)
    path = tmp_path_factory.mktemp("tr") / "run.safetensors"
    tr.save(path)
    return m, x, y, path


@pytest.mark.parametrize("tamper, match", [
    ({"optimizer": None}, "malformed header.*optimizer"),
    ({"optimizer": "{"}, "malformed header"),
    ({"steps": None}, "malformed header.*steps"),
    ({"steps": "x"}, "malformed header"),
    ({"lr": "abc"}, "malformed header"),
    ({"lr": "-1.0"}, "malformed header.*lr"),
    ({"lr": "nan"}, "malformed header.*nan"),
    ({"optimizer": '{"class": "SGD", "hyper": 3}'}, "malformed header"),
    ({"optimizer": '{"class": "SGD", "hyper": []}'}, "cannot rebuild SGD"),
    ({"optimizer": '{"class": "check_lr", "hyper": {}}'}, "unknown optimizer 'check_lr'"),
])
def test_trainer_load_of_a_tampered_header_is_an_einjoin_error(saved_trainer: tuple, tmp_path, tamper: dict,
                                                                match: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    m, x, y, path = saved_trainer
    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata())
    for k, v in tamper.items():
        meta.pop(k) if v is None else meta.__setitem__(k, v)
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(path)), str(bad), metadata=meta)
    with pytest.raises(ej.EinjoinError, match=match):
        ej.Trainer.load(bad, m, (x, y), torch.nn.functional.mse_loss, devices=1)


def test_trainer_load_of_a_missing_or_foreign_file_is_an_einjoin_error(saved_trainer: tuple, tmp_path) -> None:
    import torch
    m, x, y, path = saved_trainer
    (tmp_path / "junk").write_bytes(b"garbage" * 10)
    for p in (tmp_path / "missing", tmp_path / "junk"):
        with pytest.raises(ej.EinjoinError, match="cannot read .* as a safetensors file"):
            ej.Trainer.load(p, m, (x, y), torch.nn.functional.mse_loss, devices=1)
    good = ej.Trainer.load(path, m, (x, y), torch.nn.functional.mse_loss, devices=1)
    assert good.steps == 1 and good.lr == 0.1


# ---- finding 3: Trainer.load_state_dict took a list of (key, tensor) pairs as a mapping (every
# pair "unexpected"), a non-str key made the strict error itself a raw TypeError (', '.join of an
# int), and a value that is not a dense number array (a str, None, an object array, a meta or a
# sparse tensor) was a raw TypeError / NotImplementedError / RuntimeError from torch or numpy


@pytest.fixture(scope="module")
def small_trainer() -> tuple:
    import torch

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("aa", torch.zeros(2))  # read by nothing: kept as given
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    tr = ej.Trainer(M(), (x, y), torch.nn.functional.mse_loss, optimizer=ej.optim.SGD(lr=0.1), devices=1)
    return tr, x, y


def _bad_values() -> list:
    import torch
    return ["abc", None, np.array([[None] * 4] * 2), torch.empty(2, 4, device="meta"),
            torch.ones(2, 4).to_sparse()]


@pytest.mark.parametrize("k", range(5))
def test_trainer_load_state_dict_refuses_values_that_are_not_dense_numbers_by_key(small_trainer: tuple,
                                                                                    k: int) -> None:
    tr, _, _ = small_trainer
    sd = tr.state_dict()
    with pytest.raises(ej.EinjoinError, match="'lin.weight' is not a dense numeric tensor"):
        tr.load_state_dict({**sd, "lin.weight": _bad_values()[k]})


def test_trainer_load_state_dict_refuses_a_non_mapping_and_names_non_str_keys(small_trainer: tuple) -> None:
    tr, _, _ = small_trainer
    sd = tr.state_dict()
    with pytest.raises(ej.EinjoinError, match="expected a mapping.*got list"):
        tr.load_state_dict(list(sd.items()), strict=False)
    with pytest.raises(ej.EinjoinError, match="unexpected: 3"):
        tr.load_state_dict({**sd, 3: 1})
    assert tr.load_state_dict({3: 1}, strict=False).unexpected_keys == [3]


# ---- finding 4: a refused Trainer.load_state_dict (a wrong shape at a later key) had already
# set the buffers before that key (a buffer the loss never reads, kept as given), while the
# parameters stayed: half a checkpoint loaded. Now a refused call changes nothing


def test_a_refused_load_state_dict_changes_no_key(small_trainer: tuple) -> None:
    import torch
    tr, _, _ = small_trainer
    sd = tr.state_dict()
    with pytest.raises(ej.ShapeError, match="'lin.weight' has shape"):
        tr.load_state_dict({**sd, "aa": torch.ones(2), "lin.weight": torch.ones(5, 5)})
    after = tr.state_dict()
    assert all(torch.equal(after[k], sd[k]) for k in sd)


# ---- finding 5: an imported module's weights were bound as the tensor that ``param.detach()``
# gave at import, so a program kept computing with the old values, silently, after
# ``param.data = new`` or ``module.double()`` (both swap what the Parameter holds), and after an
# in-place write to a non-contiguous parameter (bound through a contiguous copy taken once)


def _run_close(prog: ej.Program, m, x) -> bool:  # type: ignore[no-untyped-def]
    import torch
    with torch.no_grad():
        return bool(torch.allclose(prog.run(x), m(x), atol=1e-5))


@pytest.mark.parametrize("method", ["export", "fx"])
def test_a_program_reads_what_the_modules_parameters_hold_now(method: str) -> None:
    import torch
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    lin = torch.nn.Linear(4, 3)
    prog = ej.compile(ej.from_torch(lin, (x,), method=method), devices=2)
    lin.weight.data = torch.randn(3, 4)
    assert _run_close(prog, lin, x)
    lin.double()  # the program was built for float32 weights: refused by name, not the old values
    with pytest.raises(ej.DTypeError, match="the module's weight is now torch.float64; the program was compiled "
                                            "for torch.float32"):
        prog.run(x)

    class T(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4).T)  # non-contiguous

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    m = T()
    prog = ej.compile(ej.from_torch(m, (x,), method=method), devices=2)
    assert _run_close(prog, m, x)
    with torch.no_grad():
        m.w.mul_(2)
    assert _run_close(prog, m, x)


# ---- finding 6: prog.save / ej.load of something that is no path (None, an int, a BytesIO) was a
# raw TypeError from os.fspath; a bytes path was written as "b'/dir/p.ej'.partial" (the f-string of
# the bytes), so saving to a folder that exists failed with "No such file or directory"


@pytest.mark.parametrize("bad", [None, 5, "io"])
def test_save_and_load_refuse_what_is_no_path_by_name(bad: object) -> None:
    import io
    bad = io.BytesIO() if bad == "io" else bad
    x = ej.input("x", (3, 4))
    prog = ej.compile(x.sum(), devices=1)
    with pytest.raises(ej.EinjoinError, match="prog.save takes a file path"):
        prog.save(bad)  # type: ignore[arg-type]
    with pytest.raises(ej.EinjoinError, match="ej.load takes a file path"):
        ej.load(bad)  # type: ignore[arg-type]


def test_a_bytes_path_saves_and_loads(tmp_path) -> None:
    import os
    x = ej.input("x", (3, 4))
    prog = ej.compile(x.sum(), devices=1)
    path = os.fsencode(str(tmp_path / "p.ej"))
    prog.save(path)  # type: ignore[arg-type]
    assert ej.load(path).run(x=np.ones((3, 4), np.float32)) == 12.0  # type: ignore[arg-type]


# ---- finding 7: Trainer.save / Trainer.load of None was a raw TypeError (Trainer.load's own
# error message called os.fspath(None) again), and Trainer.save into a folder, or into a folder
# that does not exist, a raw SafetensorError


def test_trainer_save_and_load_name_bad_paths(saved_trainer: tuple, tmp_path) -> None:
    import torch
    m, x, y, path = saved_trainer
    tr = ej.Trainer.load(path, m, (x, y), torch.nn.functional.mse_loss, devices=1)
    with pytest.raises(ej.EinjoinError, match="Trainer.save takes a file path"):
        tr.save(None)  # type: ignore[arg-type]
    with pytest.raises(ej.EinjoinError, match="Trainer.load takes a file path"):
        ej.Trainer.load(None, m, (x, y), torch.nn.functional.mse_loss)  # type: ignore[arg-type]
    for bad in (tmp_path, tmp_path / "missing" / "run.safetensors"):
        with pytest.raises(ej.EinjoinError, match="Trainer.save: cannot write"):
            tr.save(bad)


# ---- finding 8: a batch element that is no array of numbers (None, a str), given to
# Trainer.step / evaluate or in the example batch, was a raw TypeError from torch.as_tensor


@pytest.mark.parametrize("bad", [None, "abc", np.array([None, 1])])
def test_trainer_batches_that_are_no_arrays_are_named(saved_trainer: tuple, bad: object) -> None:
    import torch
    m, x, y, path = saved_trainer
    with pytest.raises(ej.EinjoinError, match=r"example_batch\[0\] is not a tensor or array"):
        ej.Trainer(m, (bad, y), torch.nn.functional.mse_loss, optimizer=ej.optim.SGD(lr=0.1))
    tr = ej.Trainer.load(path, m, (x, y), torch.nn.functional.mse_loss, devices=1)
    with pytest.raises(ej.EinjoinError, match=r"Trainer.step: batch\[1\] is not a tensor or array"):
        tr.step(x, bad)
    with pytest.raises(ej.EinjoinError, match=r"Trainer.evaluate: batch\[0\] is not a tensor or array"):
        tr.evaluate(bad, y)


# ---- finding 9: RunHandle.result(timeout="1") was a raw TypeError from the deadline's arithmetic,
# and timeout=nan waited as None does (no deadline ever passes) instead of being refused


@pytest.mark.parametrize("bad", ["1", float("nan"), True])
def test_run_handle_result_refuses_a_timeout_that_is_no_number(bad: object) -> None:
    x = ej.input("x", (8, 8))
    handle = ej.compile(x @ x, devices=2).run_async(x=np.ones((8, 8), np.float32))
    with pytest.raises(ej.EinjoinError, match="takes seconds"):
        handle.result(timeout=bad)  # type: ignore[arg-type]
    assert float(handle.result(timeout=60).sum()) == 512.0


# ---- finding 10: torch.addmm(c, a, b, beta=0) imported as a @ b + c * 0, so a nan or inf in c
# made the result nan, where torch does not read c at all when beta is 0 (baddbmm had the rule)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_addmm_with_beta_zero_does_not_read_its_input(fill: float) -> None:
    import torch

    class M(torch.nn.Module):
        def forward(self, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.addmm(c, a, b, beta=0, alpha=2)

    torch.manual_seed(0)
    args = (torch.full((3, 5), fill), torch.randn(3, 4), torch.randn(4, 5))
    got = ej.compile(ej.from_torch(M(), args), devices=2).run(*args)
    torch.testing.assert_close(got, M()(*args))


# ---- finding 11: a block count that is a numpy int (np.int64(2), as counts computed with numpy
# are) was refused, "blocks must be a count or a boundary list", by specs= and execute_blocked,
# where every other count (devices=, boundary lists) takes numpy ints


@pytest.mark.parametrize("count", [np.int64(2), np.int32(2), np.uint8(2)])
def test_a_numpy_int_block_count_is_a_count(count: object) -> None:
    x, w = ej.input("x", (4, 6)), ej.input("w", (6, 3))
    h = ej.einsum("ij,jk->ik", x, w)
    feeds = dict(x=np.arange(24, dtype=np.float32).reshape(4, 6), w=np.ones((6, 3), np.float32))
    want = feeds["x"] @ feeds["w"]
    np.testing.assert_array_equal(ej.execute_blocked(h, {h: {"i": count, "j": count}}, **feeds), want)
    np.testing.assert_array_equal(ej.compile(h, devices=2, specs={h: {"i": count}}).run(**feeds), want)
    with pytest.raises(ej.PartitionError, match="blocks must be a count"):
        ej.execute_blocked(h, {h: {"i": np.bool_(True)}}, **feeds)


# ---- finding 12: a non-tensor forward argument given by name as a numpy scalar or a 0-d tensor
# (scale=np.float64(2.0), scale=torch.tensor(2.0)) was "unknown input 'scale'; the graph's inputs
# are x", as if the forward had no such argument, even with the import's own value


def test_a_constant_argument_given_as_a_numpy_scalar_or_0d_tensor() -> None:
    import torch

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return x * scale

    x = torch.randn(3, 4)
    prog = ej.compile(ej.from_torch(M(), (x,), {"scale": 2.0}), devices=2)
    for same in (np.float64(2.0), torch.tensor(2.0), np.array(2.0)):
        torch.testing.assert_close(prog.run(x, scale=same), x * 2.0)
    for other in (np.float64(3.0), torch.tensor(3.0), torch.ones(2)):
        with pytest.raises(ej.EinjoinError, match="argument 'scale' is .* specialised on the import's value 2.0"):
            prog.run(x, scale=other)


# ---- finding 13: Trainer.evaluate (or state_dict) on one thread while step ran on another read
# the state as the step replaced it: a raw KeyError ('module.0.weight'), or an evaluation program
# marked current with the parameters from before the step (later evaluations used them, silently).
# The trainer's public calls now take its lock


def test_trainer_evaluate_and_state_dict_racing_step_see_whole_steps() -> None:
    import copy
    import threading
    import torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    x, y = torch.randn(32, 8), torch.randn(32, 2)
    mse = torch.nn.functional.mse_loss
    seq = ej.Trainer(copy.deepcopy(m), (x, y), mse, optimizer=ej.optim.SGD(lr=0.05), devices=2, leave_idle=False)
    for _ in range(12):
        seq.step(x, y)
    tr = ej.Trainer(copy.deepcopy(m), (x, y), mse, optimizer=ej.optim.SGD(lr=0.05), devices=2, leave_idle=False)
    errors: list[BaseException] = []

    def loop(f) -> None:  # type: ignore[no-untyped-def]
        try:
            for _ in range(12):
                f()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(f,)) for f in
               (lambda: tr.step(x, y), lambda: tr.evaluate(x, y), tr.state_dict)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tr.steps == 12 and tr.evaluate(x, y) == seq.evaluate(x, y)


# ---- finding 14: a forward returning a non-tensor beside a tensor ((x * 2, None), x.shape) was,
# captured by torch.export, "from_torch: output  is NoneType" (no name: a constant output has
# none); the fx capture said "output 1". Both name the output's place now


@pytest.mark.parametrize("method", ["export", "fx"])
@pytest.mark.parametrize("extra", [None, 3, "hi"])
def test_a_non_tensor_output_is_named_by_its_place(method: str, extra: object) -> None:
    import torch

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            return x * 2, extra

    with pytest.raises(ej.EinjoinError, match=f"output 1 is {type(extra).__name__}, not a tensor"):
        ej.from_torch(M(), (torch.randn(2, 3),), method=method)
