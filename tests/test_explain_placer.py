"""explain() names the placer and, on devices with a time model, its simulated makespan next to
the critical_path placer's for the same plan: the figures are prog.simulate() of each placement."""

from __future__ import annotations

import re

import pytest

import einjoin as ej
import einjoin.program_explain as pe


def _mlp() -> ej.Tensor:
    x = ej.input("x", (512, 256), dtype="bfloat16")
    w1 = ej.param("w1", (256, 1024), dtype="bfloat16")
    w2 = ej.param("w2", (1024, 256), dtype="bfloat16")
    return (x @ w1).relu() @ w2


def _figures(text: str) -> tuple[str, float, float]:
    m = re.search(r"^placer: (\w+); simulated makespan ([0-9.]+) ms, critical_path's placement of the "
                  r"same plan ([0-9.]+) ms \(both simulated\)$", text, re.M)
    assert m, text
    return m.group(1), float(m.group(2)), float(m.group(3))


@pytest.mark.parametrize("placement", ["greedy", "round_robin"])
def test_explain_compares_the_placer_with_critical_path(placement: str) -> None:
    cluster = ej.Cluster.preset("dgx-a100", devices=4)
    prog = ej.compile(_mlp(), cluster, backend="null", quiet=True, placement=placement)
    name, own, cp = _figures(prog.explain(file=None))
    assert name == placement
    assert f"{own:.3f}" == f"{prog.simulate().makespan * 1e3:.3f}"
    # the same decompositions placed by critical_path, compiled: its prog.simulate() is the CP figure
    cp_prog = ej.compile(_mlp(), cluster, backend="null", quiet=True, placement="critical_path",
                         specs=dict(zip(prog.graph.nodes, (prog.decomps[n].spec for n in prog.graph.nodes))))
    assert [cp_prog.decomps[n].spec for n in cp_prog.graph.nodes] == [prog.decomps[n].spec for n in prog.graph.nodes]
    assert f"{cp:.3f}" == f"{cp_prog.simulate().makespan * 1e3:.3f}"
    assert "simulated makespan" in cp_prog.explain(file=None) and "critical_path's" not in cp_prog.explain(file=None)


def test_explain_without_a_cached_calibration_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pe, "load_cached", lambda: None)
    called: list[int] = []
    monkeypatch.setattr(ej.Program, "simulate", lambda *a, **k: called.append(1))  # never measured
    text = ej.compile(_mlp(), 2, backend="null", quiet=True).explain(file=None)
    assert "placer: greedy; no simulated makespan: this machine has no cached calibration" in text
    assert not called


def test_explain_skips_the_simulations_of_big_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pe, "COMPARE_TASKS", 3)
    prog = ej.compile(_mlp(), ej.Cluster.preset("dgx-a100", devices=4), backend="null", quiet=True)
    assert re.search(r"placer: greedy; placers not simulated: \d+ tasks > 3 ", prog.explain(file=None))


def test_explain_says_what_the_simulator_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise ej.EinjoinError("simulate: no time model for this op")
    prog = ej.compile(_mlp(), ej.Cluster.preset("dgx-a100", devices=2), backend="null", quiet=True,
                      objective="bytes")
    monkeypatch.setattr(ej.Program, "simulate", refuse)
    text = prog.explain(file=None)
    assert "placer: greedy; not simulated: simulate: no time model for this op" in text
    assert "total:" in text  # the plan's table is still there
