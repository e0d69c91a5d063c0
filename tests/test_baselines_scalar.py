"""data_parallel follows the batch through an einsum that also reads a scalar computed from the
batch (a mean loss's 1 / count, which fusion puts into the loss gradient's node): the scalar
broadcasts, so it does not stop the batch cut. Without this the small LLaMA training step's
seed plan left the lm head's backward on one device (einjoin.planner.baselines._einsum_batch)."""

from __future__ import annotations

import numpy as np

import einjoin as ej
from einjoin.planner.baselines import batch_dims, data_parallel


def test_batch_cut_through_a_scalar_of_the_batch():
    x = ej.input("x", (8, 4))
    w = ej.param("w", (4, 4))
    h = x @ w
    y = (h / h.sum()) @ w          # "ab,->ab": the batch and a scalar of it
    g = ej.Graph(y.sum())
    bdim, _ = batch_dims(g)
    div = next(n for n in g.ops if n.kind == "einsum" and len(n.inputs) == 2 and n.inputs[1].ndim == 0)
    assert bdim[div] == 0
    cluster = ej.local(2)
    specs = data_parallel(g, cluster)
    assert [len(b) - 1 for b in specs[div].bounds][0] == 2
    prog = ej.compile(y, cluster, planner="data_parallel", backend="threads", quiet=True)
    xv, wv = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), np.eye(4, dtype=np.float32)
    np.testing.assert_allclose(prog.run(x=xv, w=wv), ej.reference(y, x=xv, w=wv), rtol=1e-6)
