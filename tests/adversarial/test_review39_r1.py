"""Reviewer R1's checks of session 39's changes (each fails before its fix)."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej
from einjoin.errors import ShapeError

# ---------------------------------------------------------------- a max over nothing (9721cfc)


@pytest.mark.parametrize("fed", [False, True])
def test_a_graph_max_over_an_empty_label_is_refused_as_the_dense_max_not_zero(fed: bool) -> None:
    # max over a label of extent 0 has no value: the dense einsum refuses it when the node is
    # built, and the compiled sparse run refused it in its kernel, but ej.reference of the same
    # sparse node gave 0 for every row (its docstring: "0, as the engine gives")
    a = ej.sparse_input("Aempty", (3, 0), nnz=1, dtype="float64") if fed else ej.sparse("Aempty", np.zeros((3, 0)))
    v = ej.input("v_empty", (0,), "float64")
    with pytest.raises(ShapeError, match="max over label"):
        ej.einsum("ij,j->i", ej.input("d_empty", (3, 0), "float64"), v, agg="max")
    with pytest.raises(ShapeError, match="max over label"):
        ej.einsum("ij,j->i", a, v, agg="max")
    # a summed extent of 0 under sum is still 0, and a max with nothing summed is fine
    np.testing.assert_array_equal(ej.reference(ej.einsum("ij,j->i", a, v), v_empty=np.zeros(0),
                                               **({"Aempty": ej.sparse("Aempty", np.zeros((3, 0)))} if fed else {})),
                                  np.zeros(3))
