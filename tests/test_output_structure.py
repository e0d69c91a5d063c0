"""An imported forward's output structure comes back from its program: a dict, a nested tuple or
list, a NamedTuple, a Hugging Face ``ModelOutput`` (torch in, torch out: ``prog.run(ids).logits``),
rebuilt with ``torch.utils._pytree`` from the captured spec (torch.export's ``out_spec``, the fx
trace's output), also for run_async, run_reference, programs recaptured for new shapes, pickles
and saved files (treespec JSON, no pickle; a structure that does not serialise, or names a type
not registered at load, gives a flat tuple and a StructureWarning)."""

from __future__ import annotations

import json
import pickle
import zipfile
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej
from einjoin.program_io import StructureWarning


def _close(a: Any, b: Any) -> None:
    """``a`` and ``b`` have one structure (types included) and close leaves."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(b, torch.Tensor):
        np.testing.assert_allclose(a.numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)
    elif isinstance(b, dict):
        assert list(a) == list(b)
        for k in b:
            _close(a[k], b[k])
    else:
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _close(u, v)


class Nested(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"a": x * 2, "b": (x + 1, [x - 1, x.sum(0)])}


class Pair(NamedTuple):
    y: torch.Tensor
    z: torch.Tensor


class Named(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(x * 2, x.sum(0))


@pytest.mark.parametrize("method", ["export", "fx"])
def test_a_dict_of_nested_tuples_and_lists_comes_back_as_torch_returns_it(method: str) -> None:
    x = torch.randn(2, 3)
    fn = ej.from_torch(Nested(), (x,), method=method)
    prog = ej.compile(fn, devices=2, quiet=True)
    want = Nested()(x)
    _close(prog.run(x), want)
    _close(prog.run_async(x).result(), want)
    ref = prog.run_reference(x)
    assert isinstance(ref, dict) and isinstance(ref["b"][1], list)
    np.testing.assert_allclose(ref["b"][1][0], want["b"][1][0].numpy(), rtol=1e-5)
    ref = fn.reference(x.numpy())  # numpy in, numpy leaves out: the same structure
    assert isinstance(ref, dict) and isinstance(ref["b"], tuple) and isinstance(ref["b"][1], list)
    np.testing.assert_allclose(ref["b"][1][1], want["b"][1][1].numpy(), rtol=1e-5)
    out = prog.run(x.numpy())
    assert isinstance(out["a"], np.ndarray)


def test_a_new_shape_is_recaptured_with_the_structure() -> None:
    prog = ej.compile(ej.from_torch(Nested(), (torch.randn(2, 3),)), quiet=True)
    x = torch.randn(5, 3)
    _close(prog.run(x), Nested()(x))
    assert prog.run_stats is not None and prog.run_stats.cache_misses == 1


def test_a_named_tuple_keeps_its_class_and_pickles() -> None:
    x = torch.randn(2, 3)
    prog = ej.compile(ej.from_torch(Named(), (x,)), quiet=True)
    out = prog.run(x)
    _close(out, Named()(x))
    assert torch.equal(out.z, out[1])
    _close(pickle.loads(pickle.dumps(prog)).run(x), out)


def test_a_named_tuple_that_does_not_serialise_saves_flat_with_a_warning(tmp_path: Any) -> None:
    x = torch.randn(2, 3)
    prog = ej.compile(ej.from_torch(Named(), (x,)), quiet=True)
    with pytest.warns(StructureWarning, match="Pair.*does not serialise|does not serialise.*Pair"):
        prog.save(tmp_path / "p.ej")
    with pytest.warns(StructureWarning, match="flat tuple"):
        again = ej.load(tmp_path / "p.ej")
    _close(again.run(x), tuple(Named()(x)))


def test_save_load_keeps_a_dict_and_an_unknown_type_at_load_gives_a_flat_tuple(tmp_path: Any) -> None:
    x = torch.randn(2, 3)
    prog = ej.compile(ej.from_torch(Nested(), (x,)), devices=2, quiet=True)
    path = tmp_path / "p.ej"
    prog.save(path)
    again = ej.load(path)
    _close(again.run(x), Nested()(x))
    assert again.plan.structure == prog.plan.structure
    # the same file naming a type this process never registered (its module not imported)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    body = json.loads(members["program.json"])
    body["structure"] = body["structure"].replace('"builtins.dict"', '"nowhere.Missing"')
    members["program.json"] = json.dumps(body).encode()
    odd = tmp_path / "odd.ej"
    with zipfile.ZipFile(odd, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    with pytest.warns(StructureWarning, match="nowhere.Missing"):
        flat = ej.load(odd)
    _close(flat.run(x), tuple(torch.utils._pytree.tree_leaves(Nested()(x))))
    # a file of an einjoin that saved no structure: the flat tuple, silently as then
    del body["structure"], body["structure_lost"]
    members["program.json"] = json.dumps(body).encode()
    with zipfile.ZipFile(odd, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    assert isinstance(ej.load(odd).run(x), tuple)


def test_plain_programs_and_flat_tuples_keep_their_convention() -> None:
    x = torch.randn(2, 3)

    class Flat(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + 1, x * 3

    fn = ej.from_torch(Flat(), (x,))
    assert fn.structure is None and fn.many
    _close(ej.compile(fn, quiet=True).run(x), Flat()(x))
    a = ej.input("a", (2, 3))
    assert isinstance(ej.compile([a + 1, a * 2], quiet=True).run(x.numpy()), tuple)
    assert isinstance(ej.compile([a + 1], quiet=True).run(x.numpy()), tuple)
    assert isinstance(ej.compile(a + 1, quiet=True).run(x.numpy()), np.ndarray)


def test_a_hugging_face_model_output_has_its_fields(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=32,
                                  bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 32, (2, 8))
    prog = ej.compile(ej.from_torch(model, (ids,), {"use_cache": False}), quiet=True)
    with torch.no_grad():
        want = model(ids, use_cache=False)
    out = prog.run(ids, use_cache=False)
    assert type(out) is type(want) and list(out.keys()) == list(want.keys())
    np.testing.assert_allclose(out.logits.numpy(), want.logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["logits"].numpy(), out[0].numpy())
    prog.save(tmp_path / "gpt2.ej")
    again = ej.load(tmp_path / "gpt2.ej")  # transformers is imported: its output class is registered
    assert type(again.run(ids, use_cache=False)) is type(want)
    assert type(pickle.loads(pickle.dumps(prog)).run(ids, use_cache=False)) is type(want)
