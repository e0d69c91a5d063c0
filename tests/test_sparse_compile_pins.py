"""Pins of a graph's sparse einsums on ``ej.compile`` (issue 24: ``blocks={"j": 256}``,
``relational={"i"}``, ``engine="memory" | "duckdb"``; einjoin/sparse/pins.py): each pin reaches
the sparse plans the kernels run (their layouts keep it), the results equal numpy on the
densified data with every pin, ``explain()`` shows the pinned layouts in upper-case-lower-case
notation, gradients and saved programs keep them, and a pin no sparse einsum can take is refused
naming the label, its size and the op.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from budget import examples
from einjoin.errors import EinjoinError, PartitionError, UnsupportedOpError


def _plans(prog):
    """The sparse plans the program's kernels ran, with their nodes' pins."""
    out = []
    for n in prog.graph.nodes:
        if n.kind == "sparseeinsum":
            out += n.op.operand._plans.plans()
    return out


def _layout_keeps(plan, blocks, relational):
    for step in plan.steps:
        lay = step.layout or step.ran
        for lab, b in blocks.items():
            if lab in lay.blocks:
                assert lay.blocks[lab] == min(b, plan.sizes[lab]), (lab, lay.blocks)
        for lab in relational:
            if lab in lay.blocks:
                assert lay.blocks[lab] is not None, (lab, lay.blocks)


EQUATIONS = ["ij,jk->ik", "ji,jk->ik", "ij,j->i", "ijk,jr,kr->ir", "ij,jk,kl->il"]


@settings(max_examples=examples(24), deadline=None)
@given(data=st.data())
def test_pinned_sparse_einsums_equal_numpy_on_the_densified_data(data):
    eq = data.draw(st.sampled_from(EQUATIONS))
    ins, out = eq.split("->")
    terms = ins.split(",")
    sizes = {lab: data.draw(st.integers(1, 9), label=f"size {lab}") for lab in sorted(set(ins) - {","})}
    shapes = [tuple(sizes[lab] for lab in t) for t in terms]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    density = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    dense_a = np.where(rng.random(shapes[0]) < density, rng.normal(size=shapes[0]), 0.0)
    a = ej.sparse(f"Apin{len(shapes[0])}", dense_a)
    xs = [ej.input(f"xpin{i}", s, "float64") for i, s in enumerate(shapes[1:], 1)]
    feeds = {f"xpin{i}": rng.normal(size=s) for i, s in enumerate(shapes[1:], 1)}
    agg = data.draw(st.sampled_from(["sum", "max"])) if len(terms) < 3 else "sum"
    y = ej.einsum(eq, a, *xs, agg=agg)
    labels = sorted(sizes)
    pinned = data.draw(st.lists(st.sampled_from(labels), unique=True, max_size=2), label="blocks")
    blocks = {lab: data.draw(st.integers(1, sizes[lab]), label=f"block {lab}") for lab in pinned}
    relational = set(data.draw(st.lists(st.sampled_from(labels), unique=True, max_size=2), label="relational"))
    engine = data.draw(st.sampled_from(["memory", "memory", "duckdb"]))
    devices = data.draw(st.sampled_from([1, 2]))
    prog = ej.compile(y, devices=devices, blocks=blocks or None, relational=relational or None, engine=engine,
                      quiet=True)
    arrays = [dense_a, *feeds.values()]
    if agg == "sum":
        want = np.einsum(eq, *arrays)
    else:
        every = "".join(dict.fromkeys(ins.replace(",", "")))
        prod = np.einsum(f"{ins}->{every}", *arrays)
        summed = tuple(d for d, lab in enumerate(every) if lab not in out)
        want = prod.max(axis=summed) if summed else prod
        want = np.transpose(want, ["".join(c for c in every if c in out).index(c) for c in out])
    np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-10, atol=1e-10)
    ran = _plans(prog)
    assert ran and all(p.engine.name == engine for p in ran)
    for p in ran:
        _layout_keeps(p, blocks, relational)


def test_each_pin_reaches_the_plans_and_explain_shows_it_in_upper_lower_notation():
    import scipy.sparse
    a = ej.sparse("Agnn", scipy.sparse.random(60, 48, density=0.05, random_state=3))
    h = ej.input("hgnn", (48, 16), "float64")
    w = ej.input("wgnn", (16, 4), "float64")
    y = ej.relu(ej.einsum("ij,jk->ik", a, h @ w))
    rng = np.random.default_rng(1)
    feeds = {"hgnn": rng.normal(size=(48, 16)), "wgnn": rng.normal(size=(16, 4))}
    want = np.maximum(a.todense() @ feeds["hgnn"] @ feeds["wgnn"], 0)
    free = ej.compile(y, quiet=True)
    assert "sparse einsums (pinned" not in free.explain(file=None)
    for kw, shown in [(dict(blocks={"j": 16}), "Jj"), (dict(relational={"k"}), "K"),
                      (dict(engine="duckdb"), "engine duckdb"),
                      (dict(blocks={"i": 4}, relational="j", engine="duckdb"), "Ii")]:
        prog = ej.compile(y, devices=2, quiet=True, **kw)
        np.testing.assert_allclose(prog.run(**feeds), want, rtol=1e-12, atol=1e-12)
        text = prog.explain(file=None)
        assert "sparse einsums (pinned at compile" in text and shown in text.split("pinned at compile")[1], text
        for p in _plans(prog):
            _layout_keeps(p, kw.get("blocks", {}), set(kw.get("relational", ())))
            assert p.engine.name == kw.get("engine", "memory")
    # the user's graph is left as it was: compiled again without pins, its plans are unpinned
    assert all(p.engine.name == "memory" for p in _plans(ej.compile(y, engine=None, quiet=True)))


def test_a_fed_sparse_input_takes_the_pins_and_explain_shows_the_last_runs_layout():
    import scipy.sparse
    A = ej.sparse_input("Apinfed", (40, 30), nnz=200, dtype="float64")
    h = ej.input("hpinfed", (30, 5), "float64")
    prog = ej.compile(A @ h, blocks={"j": 8}, relational={"i"}, quiet=True)
    assert "layout chosen at run" in prog.explain(file=None)
    rng = np.random.default_rng(2)
    for seed in (1, 2):  # two patterns: the second replanned under the same pins
        av = scipy.sparse.random(40, 30, density=0.1, random_state=seed)
        hv = rng.normal(size=(30, 5))
        np.testing.assert_allclose(prog.run(Apinfed=av, hpinfed=hv), av.toarray() @ hv, rtol=1e-12, atol=1e-12)
    for p in _plans(prog):
        _layout_keeps(p, {"j": 8}, {"i"})
    assert "IJj" in prog.explain(file=None).split("pinned at compile")[1]


def test_gradients_of_a_pinned_graph_equal_numpy_and_share_the_pinned_operand():
    dense_a = np.where(np.random.default_rng(4).random((12, 10)) < 0.3, 1.5, 0.0)
    a = ej.sparse("Apingrad", dense_a)
    h = ej.param("hpingrad", (10, 3), "float64")
    loss = (ej.einsum("ij,jk->ik", a, h) ** 2).sum()
    (dh,) = ej.grad(loss, [h])
    hv = np.random.default_rng(5).normal(size=(10, 3))
    prog = ej.compile([loss, dh], devices=2, blocks={"j": 4}, engine="duckdb", quiet=True)
    got_loss, got_dh = prog.run(hpingrad=hv)
    y = dense_a @ hv
    np.testing.assert_allclose(got_loss, (y ** 2).sum(), rtol=1e-12)
    np.testing.assert_allclose(got_dh, dense_a.T @ (2 * y), rtol=1e-12, atol=1e-12)
    operands = {id(n.op.operand) for n in prog.graph.nodes if n.kind == "sparseeinsum"}
    assert len(operands) == 1  # the forward and gradient nodes share one pinned operand (and its plans)


def test_a_saved_program_keeps_its_pins(tmp_path):
    a = ej.sparse("Apinsave", np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 3.0]]))
    x = ej.input("xpinsave", (3, 2), "float64")
    prog = ej.compile(ej.einsum("ij,jk->ik", a, x), blocks={"j": 2}, relational={"i"}, engine="duckdb", quiet=True)
    prog.save(tmp_path / "pins.ej")
    loaded = ej.load(tmp_path / "pins.ej")
    xv = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(loaded.run(xpinsave=xv), a.todense() @ xv)
    o = loaded.plan.options
    assert (o.blocks, o.relational, o.engine) == ((("j", 2),), ("i",), "duckdb")
    (p,) = _plans(loaded)
    assert p.engine.name == "duckdb"
    _layout_keeps(p, {"j": 2}, {"i"})


def test_pins_that_no_sparse_einsum_takes_are_refused_naming_them():
    a = ej.sparse("Apinerr", np.eye(5))
    h = ej.input("hpinerr", (5, 3), "float64")
    y = ej.einsum("ij,jk->ik", a, h)
    with pytest.raises(EinjoinError, match=r"label 'z' is pinned but no sparse einsum .*'Apinerr'.*'ijk'"):
        ej.compile(y, blocks={"z": 2}, quiet=True)
    with pytest.raises(EinjoinError, match=r"label 'q' is pinned but no sparse einsum"):
        ej.compile(y, relational={"q"}, quiet=True)
    with pytest.raises(PartitionError, match=r"block size 8 for label 'j' does not fit sparse_einsum 'ij,jk->ik' "
                                             r"\(sparse operand 'Apinerr' \[5, 5\]\), where 'j' has size 5"):
        ej.compile(y, blocks={"j": 8}, quiet=True)
    with pytest.raises(PartitionError, match=r"block size 0 for label 'j'"):
        ej.compile(y, blocks={"j": 0}, quiet=True)
    with pytest.raises(PartitionError, match=r"block size True for label 'j'"):
        ej.compile(y, blocks={"j": True}, quiet=True)
    with pytest.raises(EinjoinError, match=r"'jk' is not an einsum label"):
        ej.compile(y, blocks={"jk": 2}, quiet=True)
    with pytest.raises(EinjoinError, match=r"blocks=...\): a mapping"):
        ej.compile(y, blocks=[("j", 2)], quiet=True)
    with pytest.raises(UnsupportedOpError, match=r"engine='postgres'.*known: memory, duckdb"):
        ej.compile(y, engine="postgres", quiet=True)
    dense = ej.input("dpinerr", (4, 4), "float64") @ ej.input("epinerr", (4, 4), "float64")
    with pytest.raises(EinjoinError, match=r"relational=\{'i'\}\): these pin sparse einsums, and the graph has none"):
        ej.compile(dense, relational={"i"}, quiet=True)
    with pytest.raises(EinjoinError, match=r"engine='duckdb'\): these pin sparse einsums"):
        ej.compile(dense, engine="duckdb", quiet=True)


def test_pins_follow_user_specs_and_survive_options_replace():
    dense_a = np.where(np.random.default_rng(8).random((9, 7)) < 0.4, 2.0, 0.0)
    a = ej.sparse("Apinspec", dense_a)
    h = ej.input("hpinspec", (7, 4), "float64")
    y = ej.einsum("ij,jk->ik", a, h)
    prog = ej.compile(ej.relu(y), devices=2, specs={y.node: {"a": 1, "b": 2}}, blocks={"j": 2}, quiet=True)
    (node,) = [n for n in prog.graph.nodes if n.kind == "sparseeinsum"]
    assert node is not y.node and str(prog.decomps[node].spec) == "{a: 1, b: 2}"  # the user's spec, followed
    hv = np.random.default_rng(9).normal(size=(7, 4))
    np.testing.assert_allclose(prog.run(hpinspec=hv), np.maximum(dense_a @ hv, 0), rtol=1e-12, atol=1e-12)
    again = prog.plan.options.replace(seed=1)  # checked again from the stored form
    assert (again.blocks, again.relational, again.engine) == ((("j", 2),), None, None)


def test_engine_duckdb_without_the_package_is_named_at_compile(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_duckdb(name, *args, **kwargs):
        if name == "duckdb":
            raise ImportError("no duckdb here")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_duckdb)
    a = ej.sparse("Apinnodb", np.eye(3))
    y = ej.einsum("ij,jk->ik", a, ej.input("xpinnodb", (3, 2), "float64"))
    with pytest.raises(EinjoinError, match=r"ej.compile\(engine='duckdb'\): engine='duckdb' needs the duckdb package"):
        ej.compile(y, engine="duckdb", quiet=True)


def test_an_imported_modules_sparse_product_takes_the_pins():
    import torch

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, adj, x):
            return torch.relu(torch.sparse.mm(adj, self.lin(x)))

    torch.manual_seed(0)
    edges = torch.randint(0, 30, (2, 90))
    adj = torch.sparse_coo_tensor(edges, torch.rand(90), (30, 30)).coalesce()
    x, layer = torch.randn(30, 6), Layer()
    prog = ej.compile(ej.from_torch(layer, (adj, x)), blocks={"j": 4}, relational={"i"}, quiet=True)
    np.testing.assert_allclose(prog.run(adj, x), layer(adj, x).detach().numpy(), rtol=1e-5, atol=1e-6)
    ran = _plans(prog)
    assert ran
    for p in ran:
        _layout_keeps(p, {"j": 4}, {"i"})
