"""An imported module's parameters and buffers are bound to the program as the module's own
tensors (no copy), viewed as numpy arrays when fed (einjoin.frontend.bound_tensors.LiveTensor).
torch's ``share_memory_()`` (``module.share_memory()``; multiprocessing's pickler sending a
module to a process pool) moves a tensor's storage and frees the old block: a view taken at
import read freed memory (silently wrong numbers). Each test differs against torch."""

from __future__ import annotations

import concurrent.futures as cf
import io
import multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej


def _reuse_freed_memory() -> list[torch.Tensor]:
    return [torch.randn(64, 64) for _ in range(50)]


def _linear() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(64, 64).eval(), torch.randn(4, 64)


def _expect(m: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return m(x).numpy()


def test_bound_values_are_views_of_the_module_tensors_that_follow_share_memory() -> None:
    m, x = _linear()
    fn = ej.from_torch(m, (x,))
    assert np.shares_memory(fn.bound["weight"], m.weight.detach().numpy())  # no copy of the weights
    prog = ej.compile(fn, devices=2)
    x7 = torch.randn(7, 64)
    np.testing.assert_allclose(prog.run(x), _expect(m, x), atol=1e-5)
    m.share_memory()  # new storage in shared memory; the old one is freed
    _junk = _reuse_freed_memory()
    assert np.shares_memory(fn.bound["weight"], m.weight.detach().numpy())
    np.testing.assert_allclose(prog.run(x), _expect(m, x), atol=1e-5)
    np.testing.assert_allclose(fn.reference(x), _expect(m, x), atol=1e-5)
    np.testing.assert_allclose(prog.run(x7), _expect(m, x7), atol=1e-5)  # recaptured for a new shape
    np.testing.assert_allclose(ej.compile(fn).run(x), _expect(m, x), atol=1e-5)  # compiled after
    with torch.no_grad():  # an in-place update of the module is seen, as before
        m.weight.mul_(2)
    np.testing.assert_allclose(prog.run(x), _expect(m, x), atol=1e-5)


def test_weights_as_program_state_and_saved_files_survive_share_memory(tmp_path) -> None:
    m, x = _linear()
    fn = ej.from_torch(m, (x,))
    w = fn.parameters["weight"]
    prog = ej.compile(fn, state={w * 1.0: w})  # the weight kept on the devices between runs
    plain = ej.compile(fn)
    m.share_memory()
    _junk = _reuse_freed_memory()
    np.testing.assert_allclose(prog.run(x), _expect(m, x), atol=1e-5)
    np.testing.assert_array_equal(prog.read_state()["weight"], m.weight.detach().numpy())
    plain.save(tmp_path / "p.ej")
    np.testing.assert_allclose(ej.load(tmp_path / "p.ej").run(x), _expect(m, x), atol=1e-5)


def test_bfloat16_module_follows_share_memory() -> None:
    torch.manual_seed(0)
    m, x = nn.Linear(16, 8).to(torch.bfloat16).eval(), torch.randn(3, 16).to(torch.bfloat16)
    prog = ej.compile(ej.from_torch(m, (x,)))
    before = np.asarray(prog.run(x).float())
    m.share_memory()
    _junk = _reuse_freed_memory()
    np.testing.assert_array_equal(np.asarray(prog.run(x).float()), before)


def test_pickling_for_a_process_pool_leaves_the_module_where_it_is() -> None:
    # multiprocessing's pickler (torch's reductions) would move each tensor it meets to shared
    # memory in place, under a run of the program in progress in another thread: the program
    # (bound tensors as arrays, its recapture's module as standard-pickle bytes) hands it none
    m, x = _linear()
    fn = ej.from_torch(m, (x,))
    prog = ej.compile(fn)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(prog)
    ForkingPickler(io.BytesIO()).dump(fn)
    assert not any(t.is_shared() for t in [*m.parameters(), *m.buffers()])
    again = ForkingPickler.loads(buf.getvalue())
    np.testing.assert_allclose(again.run(x), _expect(m, x), atol=1e-5)


@pytest.mark.parametrize("start", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_program_sent_to_a_process_pool_runs_in_parent_and_child(start: str) -> None:
    if start not in mp.get_all_start_methods():
        pytest.skip(f"no {start} start method here")
    m, x = _linear()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    xs, x7 = x.numpy(), torch.randn(7, 64).numpy()
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context(start)) as pool:
        first = pool.submit(prog.run, xs)
        np.testing.assert_allclose(prog.run(xs), _expect(m, x), atol=1e-5)  # while it is being sent
        np.testing.assert_allclose(first.result(), _expect(m, x), atol=1e-5)
        _junk = _reuse_freed_memory()
        np.testing.assert_allclose(prog.run(xs), _expect(m, x), atol=1e-5)
        np.testing.assert_allclose(pool.submit(prog.run, xs).result(), _expect(m, x), atol=1e-5)
        np.testing.assert_allclose(pool.submit(prog.run, x7).result(), _expect(m, torch.from_numpy(x7)), atol=1e-5)
    assert not m.weight.is_shared()
