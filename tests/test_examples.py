"""The README example, the tour and the demo run and say what they claim."""

from __future__ import annotations

import pathlib
import re
import runpy
import textwrap

import pytest

import einjoin as ej
from einjoin.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_runs() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.lstrip().startswith("# einjoin") and "make demo" in text[:400] and "make test" in text[:400]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    exec(compile(code, "README.md", "exec"), {})


def test_readme_gradient_examples_run() -> None:
    # the gradient examples, in order (the second uses the first's imports), against torch.autograd
    text = (ROOT / "README.md").read_text()
    # (the sparse section's GNN also calls ej.grad: tests/test_sparse.py runs the sparse blocks)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "ej.grad(" in b and "ej.sparse(" not in b]
    assert len(blocks) == 2
    exec(compile("\n".join(textwrap.dedent(b) for b in blocks), "README.md", "exec"), {})


@pytest.mark.slow  # make test-all; the Trainer's API, resume and state_dict are tests/test_trainer.py's
def test_readme_training_example_runs() -> None:
    # the Trainer example (it asserts a resumed run continues bit-identically)
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "ej.Trainer(" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md", "exec"), {})


def test_tour_runs(capsys) -> None:  # type: ignore[no-untyped-def]
    runpy.run_path(str(ROOT / "examples" / "tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "== graph" in out and "kernels" in out and "max |diff|" in out
    assert "== plan for 2 devices" in out and "memory plan (belady)" in out and "evictions" in out


def test_demo_verifies(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verification" in out and "OK" in out and "from_torch" in out
    assert "data_parallel" in out and "megatron" in out and "bound" in out
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "trace.json").stat().st_size > 0 and str(tmp_path / "trace.json") in out.replace("\n", "")


def test_demo_block_matches_torch_block() -> None:
    import numpy as np
    from einjoin.models.graphs import transformer_block
    from einjoin.models.zoo import torch_block
    out, shapes = transformer_block(seq=16, d=32, heads=4, hidden=48)
    rng = np.random.default_rng(3)
    feeds = {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in shapes.items()}
    np.testing.assert_allclose(ej.reference(out, **feeds), torch_block(feeds, 4), rtol=1e-4, atol=1e-4)


def test_plan_cli_prints_a_table(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", "matmul", "--devices", "8", "--planner", "eindecomp",
                 "--planner", "split_largest"]) == 0
    out = capsys.readouterr().out
    assert "eindecomp" in out and "split_largest" in out and "/ bound" in out
    assert "1.00" in out  # eindecomp meets the bound on the square matmul


@pytest.mark.slow  # make test-all; examples/train.py; the Trainer vs torch is tests/test_trainer.py's
def test_train_example_runs(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # examples/train.py, shortened: the Trainer and torch on the same bytes, a PNG of both curves
    ns = runpy.run_path(str(ROOT / "examples" / "train.py"))
    assert ns["main"](["--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "einjoin" in out and "torch" in out and "tokens/s" in out
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # make test-all; import, shapes, save/load, decoding each have their tests
def test_readme_torch_models_example_runs() -> None:
    # ResNet-18 on 2 devices at two batch sizes, save / load bit-identical, KV-cache decoding
    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "ej.generate(" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md", "exec"), {})
