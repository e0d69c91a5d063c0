"""``Program.explain()`` of a graph's sparse einsums (issue 24: "explain() prints each op in
upper-case-lower-case notation with block sizes and estimated vs actual tuple counts"): every
sparse node's layout, pinned or not, and after a run the joined tuples its kernels' plans
estimated next to those the run joined."""

from __future__ import annotations

import re

import numpy as np
import scipy.sparse

import einjoin as ej


def _graph() -> tuple[ej.SparseTensor, ej.Tensor, dict[str, np.ndarray]]:
    a = ej.sparse("Aexpl", scipy.sparse.random(60, 50, density=0.05, random_state=4))
    h = ej.input("hexpl", (50, 6), "float64")
    return a, ej.relu(ej.einsum("ij,jk->ik", a, h)), {"hexpl": np.random.default_rng(0).normal(size=(50, 6))}


def test_an_unpinned_graph_shows_each_layout_and_the_counts_after_a_run() -> None:
    a, y, feeds = _graph()
    prog = ej.compile(y, quiet=True)
    before = prog.explain(file=None)
    assert "sparse einsums (layouts chosen" in before and "sparse einsums (pinned" not in before
    assert re.search(r"ij,jk->ik \(Aexpl \[60, 50\]\) -> \[60, 6\]: \S*J\S*, .* blocks ", before), before
    assert "run() and explain() again" in before
    np.testing.assert_allclose(prog.run(**feeds), np.maximum(a.todense() @ feeds["hexpl"], 0), rtol=1e-12)
    found = re.search(r"joined tuples \(last run, \d+ step\(s\) over its kernels\): estimated (\d+), actual (\d+)",
                      prog.explain(file=None))
    assert found is not None and int(found[2]) > 0


def test_per_entry_blocks_join_each_stored_entry_once() -> None:
    # at blocks i = j = 1 each stored entry of A meets H's tuple of its j: nnz joined, as estimated
    a, y, feeds = _graph()
    for devices in (1, 2):
        prog = ej.compile(y, blocks={"i": 1, "j": 1}, devices=devices, quiet=True)
        prog.run(**feeds)
        text = prog.explain(file=None)
        assert "IJ, Jk -> Ik" in text, text
        assert f"estimated {a.nnz}, actual {a.nnz};" in text, text


def test_a_graph_without_sparse_einsums_prints_no_sparse_lines() -> None:
    prog = ej.compile(ej.input("xexpl", (4, 3)) @ ej.input("wexpl", (3, 2)), quiet=True)
    assert "sparse einsums" not in prog.explain(file=None)
