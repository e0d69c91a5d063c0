"""The op coverage table of ``docs/torch_ops.md`` (issue 20): generated from the op table
(``einjoin.frontend.aten.OPS``, ``aten_notes.NOTES``) and its facts
(``einjoin/frontend/op_facts.json``: node kinds, decomposable dims, gradient), each fact checked
here against the code:

- the kinds and dims: every translation's sample (``tests/op_samples.py``) run through
  ``ej.from_torch`` again emits exactly the declared node kinds, whose split facts give the
  declared dims; and the split facts of every kind (``einjoin/decomp/split_facts.py``) agree with
  what its decomposition rule does when a label is cut;
- the forward: each sample against torch, compiled for 1 and 2 devices with every op cut (the
  planner ``split_largest``), and in the slow run also by the default planner;
- the gradient: where the table says ``yes``, ``ej.grad`` of the sample against
  ``torch.autograd`` (the numpy reference here; compiled for 2 devices in the slow run); where it
  says ``—``, that the reason holds (an integer output, no float input, or ``ej.grad`` refusing).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import einjoin as ej
from einjoin.autodiff.rules import GRAD_RULES
from einjoin.decomp.split_facts import CASES, SPLIT_FACTS, claims, observe
from einjoin.frontend.op_facts import OP_FACTS
from einjoin.frontend.op_table import op_groups, ops_markdown, supported_ops
from einjoin.frontend.composites import fused_attention
from einjoin.ir.node import KINDS
from tests import op_samples as O

ROOT = Path(__file__).resolve().parents[1]
GROUPS = op_groups()
SAMPLED = [k for k in GROUPS if not O.unsampled(k)]


# ---------------------------------------------------------------- the page and the data


def test_docs_page_is_the_generated_op_table():
    page = (ROOT / "docs" / "torch_ops.md").read_text()
    assert page == ops_markdown(), "regenerate: einjoin torch-ops > docs/torch_ops.md"
    ops = supported_ops()
    for name in ops["ops"] + ops["modules"] + ops["data_dependent"]:
        assert f"`{name}`" in page


def test_every_translation_has_facts_and_a_sample():
    assert set(OP_FACTS) == set(GROUPS), "regenerate: python -m tests.op_samples > einjoin/frontend/op_facts.json"
    names = {n for ns in GROUPS.values() for n in ns}
    assert set(O.SAMPLES) | set(O.NO_SAMPLE) <= names, "samples of names no longer in the op table"
    assert not set(O.SAMPLES) & set(O.NO_SAMPLE)
    for key in GROUPS:
        assert bool(O.samples_for(key)) != bool(O.unsampled(key)), f"{key}: add a sample to tests/op_samples.py"
    assert len(O.NO_SAMPLE) <= 3  # names no torch call reaches: few, each with its reason
    for key in GROUPS:
        assert bool(OP_FACTS[key].note) == bool(O.unsampled(key))


def test_the_page_has_the_columns():
    page = ops_markdown()
    assert "| names | forward: node kinds | decomposable dims | gradient | limits |" in page
    rows = {line.split(" | ")[0]: line for line in page.splitlines() if line.startswith("| `")}
    conv = next(r for r in rows.values() if r.startswith("| `conv2d` |"))
    assert "conv" in conv and "halo" in conv and "| yes |" in conv
    argmax = next(r for r in rows.values() if r.startswith("| `argmax` |"))
    assert "integer output" in argmax
    topk = next(r for r in rows.values() if r.startswith("| `topk` |"))
    assert "but the sorted one" in topk
    # the issue's window and routing ops lower to their own decomposable kinds, not a host call
    for names, kind in ((("conv1d", "conv2d", "conv3d", "conv_transpose2d", "convolution"), "conv"),
                        (("max_pool2d", "avg_pool2d", "im2col"), "pool"), (("topk", "sort", "argsort"), "topk"),
                        (("gather", "embedding", "index_select"), "gather"),
                        (("index_add", "index_put"), "scatteradd"),
                        (("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"), "attention")):
        for n in names:
            assert kind in OP_FACTS[n].kinds, (n, OP_FACTS[n].kinds)


def test_every_emitted_kind_has_a_vjp_rule():
    names = {k.__name__.lower(): k for k in KINDS}
    used = {k for f in OP_FACTS.values() for k in f.kinds}
    assert used <= set(names), used - set(names)
    assert all(names[k] in GRAD_RULES for k in used)
    assert {"conv", "pool", "topk", "gather", "scatteradd", "einsum"} <= used  # not vacuous


# ---------------------------------------------------------------- the split facts of every kind


def _kind_samples():
    """Nodes of every kind, with the shapes that make each case show (halos, partials, sorted
    dims, reshape groups, broadcast dims)."""
    x = ej.input("x", (4, 6))
    img = ej.input("img", (2, 4, 8, 8))
    out = [
        x, x @ ej.input("w", (6, 4)), x.sum(1), ej.max(x, 1) if not isinstance(ej.max(x, 1), tuple) else x,
        x.reshape((2, 12)), x.reshape((24,)), x.reshape((4, 2, 3)),
        ej.broadcast_to(ej.input("r", (1, 6)), (4, 6)), x[1:3], ej.concat([x, x], 0), ej.fill((4, 6), 1.0),
        ej.cast(x, "float64"), ej.rotate_half(x),
        ej.conv(img, ej.input("k", (6, 4, 3, 3)), padding=1), ej.conv(img, ej.input("k1", (6, 4, 1, 1))),
        ej.conv(img, ej.input("kg", (4, 2, 3, 3)), groups=2, stride=2),
        ej.max_pool(img, 3, stride=2, padding=1), ej.avg_pool(img, 2),
        ej.topk(x, 3, dim=1)[0], ej.sort(x, dim=0)[1],
        ej.embedding(ej.input("ids", (3, 5), "int64"), ej.input("tab", (10, 6))),
        ej.scatter_add(x, 0, ej.input("si", (2, 6), "int64"), ej.input("su", (2, 6))),
        ej.einsum("ij,jk->ik", ej.sparse("S", torch.eye(4).to_sparse()), x),  # a sparse einsum (opaque)
    ]
    # fused attention with an additive mask, and its gradients (q, k, v stacked; the mask's)
    aq, am = ej.input("aq", (2, 3, 4, 6)), ej.input("am", (1, 3, 4, 4))
    att = fused_attention(aq, aq, aq, am, causal=True)
    out += [att] + list(ej.grad(att.sum(), [aq, am]))
    nodes = {}
    for t in out:
        for n in ej.Graph([t.node]).nodes:
            nodes.setdefault(n.kind, []).append(n)
    return nodes


def test_split_facts_agree_with_the_decomposition_rules():
    nodes = _kind_samples()
    names = {k.__name__.lower(): k for k in KINDS}
    assert set(nodes) == set(names), set(names) - set(nodes)
    seen: dict[str, set[str]] = {}
    for kind, ns in nodes.items():
        for n in ns:
            said, did = claims(n), observe(n)
            for lab, case in did.items():
                assert case in said[lab], f"{n}: a cut of {lab!r} is {case}, SPLIT_FACTS says {sorted(said[lab])}"
                seen.setdefault(kind, set()).add(case)
    # every case shows somewhere, on the kinds that claim it
    assert seen["conv"] == {"split", "halo", "partial"}
    assert {"halo", "split"} <= seen["pool"]
    assert seen["topk"] == seen["rotatehalf"] == {"split", "replicated"}
    assert seen["einsum"] >= {"split", "partial"}
    assert "partial" in seen["gather"] and "partial" in seen["scatteradd"]
    assert seen["reshape"] == {"split", "replicated"}
    # (a causal attention's query blocks read overlapping bands of keys: a halo)
    assert seen["attention"] == {"split", "halo", "replicated"} and seen["attentiongrad"] == {"split", "replicated"}
    assert set().union(*seen.values()) == set(CASES)
    assert set(SPLIT_FACTS) == set(KINDS)


# ---------------------------------------------------------------- the samples against the facts


def _check(key: str, devices: tuple[int, ...], grad_devices: int | None, planners: tuple[str, ...]) -> None:
    fact = OP_FACTS.get(key)
    assert fact, "regenerate: python -m tests.op_samples > einjoin/frontend/op_facts.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [O.run_sample(s) for s in O.samples_for(key)]
        calls, kinds = O.kinds_of(key, runs)
        assert calls, f"{key}: its samples never reach its translation"
        assert tuple(k for k in O._ORDER if k in kinds) == fact.kinds, f"{key}: kinds {sorted(kinds)}"
        assert O.dims_text({t for c in calls for t in c.texts}) == fact.dims
        for r in runs:
            for planner in planners:
                O.check_forward(r, devices, what=key, planner=planner)
        if fact.grad.startswith("yes"):
            nonzero = any([O.check_grad(r, devices=grad_devices, what=key) for r in runs])
            assert nonzero == (fact.grad == "yes"), f"{key}: torch's gradient is {'not ' * nonzero}all zero"
        else:
            assert O.grad_verdict(key, runs, devices=grad_devices) == fact.grad


# the default run: every translation, forward on 1 and 2 devices with every op cut (split_largest:
# the quickest compile), gradient by the numpy reference
@pytest.mark.parametrize("key", SAMPLED)
def test_sample_matches_the_table(key):
    _check(key, devices=(1, 2), grad_devices=None, planners=("split_largest",))


# the slow run: the default planner on 1 and 2 devices, the gradient compiled for 2
@pytest.mark.slow
@pytest.mark.parametrize("key", SAMPLED)
def test_sample_matches_the_table_compiled(key):
    _check(key, devices=(1, 2), grad_devices=2, planners=("auto",))


# ---------------------------------------------------------------- what the samples found


def test_fx_adaptive_max_pool_returns_the_values_only():
    class M(nn.Module):
        def forward(self, a):
            return F.adaptive_max_pool2d(a, (4, 3))

    x = torch.randn(2, 4, 8, 8)
    fn = ej.from_torch(M(), (x,), method="fx")
    assert len(fn.outputs) == 1


def test_bitwise_xor_of_ints_is_bitwise_or_refused():
    class M(nn.Module):
        def forward(self, a, b):
            return torch.bitwise_xor(a, b)

    a, b = torch.tensor([[1, 2, 3, 6]]), torch.tensor([[3, 2, 0, 5]])
    try:
        fn = ej.from_torch(M(), (a, b), method="fx")
    except ej.EinjoinError:
        return  # refused, by name: fine
    got = ej.compile(fn, devices=1).run(a, b)
    assert got.dtype == torch.int64 and torch.equal(got, torch.bitwise_xor(a, b))
