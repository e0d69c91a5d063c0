"""The tunables object (einjoin.settings): every field documented, frozen, checked, and the one
place the planner and the memory fitting read their limits from."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest

import einjoin as ej
from einjoin.settings import SETTINGS, Settings


def _field_docs() -> dict[str, str]:
    """Each field's docstring: the string literal right after its annotated assignment."""
    body = ast.parse(inspect.getsource(Settings)).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[stmt.target.id] = after.value.value
    return docs


def test_every_field_has_a_docstring() -> None:
    docs = _field_docs()
    names = [f.name for f in dataclasses.fields(Settings)]
    assert names, "Settings has fields"
    missing = [n for n in names if len(docs.get(n, "").split()) < 5]
    assert not missing, f"fields without a docstring: {missing}"


def test_settings_are_frozen_and_replace_checks() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SETTINGS.max_kernels = 1  # type: ignore[misc]
    smaller = SETTINGS.replace(max_kernels=8)
    assert smaller.max_kernels == 8 and SETTINGS.max_kernels == Settings().max_kernels
    with pytest.raises(ej.EinjoinError, match="no field 'max_kernel'"):
        SETTINGS.replace(max_kernel=8)
    for bad in ({"max_kernels": 0}, {"kernel_share": 1.5}, {"kernel_share": True},
                {"candidate_over": ()}, {"ilp_time_limit": -1.0}, {"fit_beam": 2.5},
                {"ilp_node_limit": 0}, {"mesh_ilp_node_limit": 1.5}):
        with pytest.raises(ej.EinjoinError, match=next(iter(bad))):
            Settings(**bad)  # type: ignore[arg-type]


def test_the_settings_module_sits_at_the_base_floor() -> None:
    import einjoin.settings as mod
    tree = ast.parse(inspect.getsource(mod))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m.startswith("einjoin")} <= {"einjoin.errors"}


def test_the_fitting_reads_its_limits_from_the_settings() -> None:
    """A smaller kernel limit is obeyed by both finer-cut searches (the optimizer's fitting and
    the memory planner's finer_spec), and the default reproduces the default search."""
    from einjoin.decomp.spec import JoinAggSpec
    from einjoin.planner.candidates import candidate_specs
    from einjoin.planner.fit import element_spec, finer_spec, fitting_specs
    z = ej.input("a", (256, 256)) @ ej.input("b", (256, 256))
    cands = candidate_specs(z.node, 2)
    assert fitting_specs(z.node, cands, 300_000) == fitting_specs(z.node, cands, 300_000, SETTINGS)
    tight = SETTINGS.replace(max_kernels=8)
    assert max(s.num_kernels for s in fitting_specs(z.node, cands, 300_000)) > 8
    assert all(s.num_kernels <= 8 for s in fitting_specs(z.node, cands, 300_000, tight)
               if s not in cands)
    spec = JoinAggSpec.for_node(z.node, {"m": 2, "n": 2, "k": 2})
    assert finer_spec(z.node, spec) is not None
    assert finer_spec(z.node, spec, tight) is None  # every doubling would make 16 kernels
    small = ej.input("c", (2, 3)) * 2.0
    assert element_spec(small.node, JoinAggSpec.for_node(small.node, None)) is not None
    assert element_spec(small.node, JoinAggSpec.for_node(small.node, None), SETTINGS.replace(max_kernels=4)) is None
