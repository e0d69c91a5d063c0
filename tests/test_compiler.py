"""``ej.compile``'s signature and the compile pipeline (einjoin/compiler.py): options after the
devices are keyword-only and checked once (CompileOptions), Program is built from the plan object
(CompiledPlan), and the pieces compose to what ``ej.compile`` returns."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.compiler import CompiledPlan, CompileOptions, Source, build_plan
from einjoin.program import Program


def _mm() -> ej.Tensor:
    return ej.input("a", (16, 8)) @ ej.input("b", (8, 4))


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((16, 8)).astype(np.float32),
            "b": rng.standard_normal((8, 4)).astype(np.float32)}


def test_every_option_after_devices_is_keyword_only_and_a_field_of_compile_options() -> None:
    params = inspect.signature(ej.compile).parameters
    assert list(params)[:2] == ["outputs", "devices"]
    assert params["devices"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = [n for n in params if n not in ("outputs", "devices")]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in options)
    fields = {f.name: f.default for f in dataclasses.fields(CompileOptions)}
    assert fields == {n: params[n].default for n in options}  # one place for the options


def test_options_cannot_be_passed_by_position() -> None:
    with pytest.raises(TypeError):
        ej.compile(_mm(), 2, "split_largest")  # type: ignore[misc]


def test_devices_by_position_or_by_name_compile_the_same_plan() -> None:
    a = ej.compile(_mm(), 2, quiet=True)
    b = ej.compile(_mm(), devices=2, quiet=True)
    assert a.specs == b.specs and a.stats == b.stats


def test_program_is_built_from_the_plan_object() -> None:
    prog = ej.compile(_mm(), devices=2, planner="split_largest", seed=np.int64(3), order="lifo",
                      host_link=1e12, quiet=True)
    plan = prog.plan
    assert isinstance(plan, CompiledPlan)
    assert (prog.graph, prog.cluster, prog.decomps, prog.placement, prog.taskgraph, prog.stats) == (
        plan.graph, plan.cluster, plan.decomps, plan.placement, plan.taskgraph, plan.stats)
    assert plan.options.seed == 3 and type(plan.options.seed) is int  # checked and normalised once
    assert (prog.order, prog.seed, prog.host_link, prog.quiet) == ("lifo", 3, 1e12, True)
    assert prog.backend is plan.options.backend and prog.backend.name == "threads"
    assert plan.specs == prog.specs
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.options.seed = 4  # type: ignore[misc]


def test_the_pipeline_pieces_make_what_compile_makes() -> None:
    feeds = _feeds()
    options = CompileOptions(planner="split_largest", quiet=True)
    prog = Program(build_plan(Source.of(_mm()), ej.local(4), options))
    ref = ej.compile(_mm(), devices=4, planner="split_largest", quiet=True)
    assert prog.specs == ref.specs and prog.stats == ref.stats
    np.testing.assert_allclose(prog.run(**feeds), ref.run(**feeds))
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(_mm(), **feeds), rtol=1e-5, atol=1e-5)


def test_source_of_a_list_runs_to_a_tuple() -> None:
    z = _mm()
    assert Source.of([z]).many and not Source.of(z).many
    out = ej.compile([z], devices=2, quiet=True).run(**_feeds())
    assert isinstance(out, tuple) and len(out) == 1


@pytest.mark.parametrize("kw, fragment", [
    ({"planner": "nope"}, "unknown planner 'nope'"),
    ({"planner": ["auto"]}, "unknown planner"),
    ({"backend": "gpu"}, "unknown backend 'gpu'"),
    ({"placement": "nearest"}, "unknown placement 'nearest'"),
    ({"order": "lifo!"}, "order must name a ready-queue order"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"quiet": "yes"}, "quiet must be True or False"),
    ({"memory_policy": "lru"}, "unknown memory policy 'lru'"),
    ({"host_link": -1}, "host_link must be a positive rate"),
])
def test_a_bad_option_is_refused_when_the_options_are_built(kw: dict, fragment: str) -> None:
    with pytest.raises(ej.EinjoinError, match=fragment.replace("(", r"\(")):
        CompileOptions(**kw)
    with pytest.raises(ej.EinjoinError, match=fragment.replace("(", r"\(")):
        ej.compile(_mm(), devices=2, **kw)
    with pytest.raises(ej.EinjoinError, match=fragment.replace("(", r"\(")):
        CompileOptions().replace(**kw)  # a changed copy is checked again


def test_a_bad_graph_or_device_count_is_reported_before_a_bad_option() -> None:
    with pytest.raises(ej.EinjoinError, match="device"):
        ej.compile(_mm(), devices=0, planner="nope")


@settings(max_examples=20, deadline=None)
@given(planner=st.sampled_from(["auto", "split_largest", "single", "data_parallel"]),
       devices=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 3),
       placement=st.sampled_from(["greedy", "round_robin", "random"]))
def test_compile_equals_its_pipeline_and_the_reference(planner: str, devices: int, seed: int,
                                                       placement: str) -> None:
    z = ej.softmax(_mm(), dim=-1)
    kw = dict(planner=planner, seed=seed, placement=placement, quiet=True)
    try:
        prog = ej.compile(z, devices=devices, **kw)
    except ej.EinjoinError as e:  # a baseline that does not apply says so
        assert "not apply" in str(e) or "data_parallel" in str(e)
        return
    built = build_plan(Source.of(z), ej.local(devices), CompileOptions(**kw))  # type: ignore[arg-type]
    assert built.specs == prog.specs and built.stats == prog.stats
    feeds = _feeds()
    np.testing.assert_allclose(prog.run(**feeds), ej.reference(z, **feeds), rtol=1e-5, atol=1e-6)


def test_an_imported_module_compiles_with_its_recapture_and_dynamic_dims() -> None:
    """Issue 20: Source and CompiledPlan carry from_torch's recapture and dynamic= (what a
    program needs to compile itself for other shapes); a graph built on the import does not."""
    import torch
    fn = ej.from_torch(torch.nn.Linear(3, 2), (torch.randn(4, 3),), dynamic={"input": {0: "batch"}})
    source = Source.of(fn)
    assert source.recapture is fn.recapture and source.dynamic == {"input": {0: "batch"}}
    plan = build_plan(source, ej.local(2), CompileOptions(quiet=True, shape_cache=3))
    assert plan.recapture is fn.recapture and plan.dynamic == {"input": {0: "batch"}}
    prog = Program(plan)
    assert prog.shape_cache is not None and prog.shape_cache.maxsize == 3
    built_on = Source.of(fn.with_outputs(fn.outputs[0].sum()))
    assert built_on.recapture is None and Source.of(_mm()).recapture is None


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "4", [4]])
def test_shape_cache_is_an_int_of_at_least_one_or_none(bad) -> None:
    with pytest.raises(ej.EinjoinError, match="shape_cache must be an int >= 1"):
        CompileOptions(shape_cache=bad)
    assert CompileOptions(shape_cache=None).shape_cache is None and CompileOptions().shape_cache == 8
