"""An imported module's sparse forward argument called with more stored entries than its example
(issue 24): the module is imported and compiled again at the next power-of-two capacity, kept in
the program's shape cache (its hits and misses counted, each compile logged); fewer entries run on
the program compiled. Differential against torch, COO and CSR."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.variants import capacity_for

warnings.filterwarnings("ignore", message="Sparse invariant checks")
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

N = 12  # nodes: the adjacency is N x N (144 entries at most)


def adjacency(nnz: int, seed: int, csr: bool) -> torch.Tensor:
    """A graph of ``nnz`` distinct random edges with random weights."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(N * N, generator=g)[:nnz]
    a = torch.sparse_coo_tensor(torch.stack([flat // N, flat % N]), torch.rand(nnz, generator=g), (N, N))
    a = a.coalesce()
    return a.to_sparse_csr() if csr else a


class GCN(torch.nn.Module):
    """Two graph convolutions, the adjacency a forward argument: A relu(A X W1) W2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(5, 6)
        self.l2 = torch.nn.Linear(6, 3)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.sparse.mm(adj, self.l1(x)))
        return adj @ self.l2(h)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("csr", [False, True], ids=["coo", "csr"])
def test_smaller_and_larger_adjacencies_match_torch_and_compile_once_per_capacity(csr, caplog):
    m, x = GCN().eval(), torch.randn(N, 5, generator=torch.Generator().manual_seed(1))
    prog = ej.compile(ej.from_torch(m, (adjacency(10, 0, csr), x)), quiet=True)
    seen = []
    with caplog.at_level(logging.INFO, logger="einjoin.program"):
        for seed, nnz in enumerate([6, 10, 11, 16, 13, 40, 9, 64, 144]):
            a = adjacency(nnz, seed + 1, csr)
            _close(prog.run(a, x), m(a, x))
            s = prog.run_stats
            seen.append((s.cache_key and dict(s.cache_key)["adj"][0], s.cache_hits, s.cache_misses))
    # <= 10 entries: the program compiled (no key); 11, 16, 13 -> 16; 40, 64 -> 64; 144 -> 128 is
    # below 144, so the dense size 144
    assert seen == [(None, 1, 0), (None, 2, 0), (16, 2, 1), (16, 3, 1), (16, 4, 1), (64, 4, 2),
                    (None, 5, 2), (64, 6, 2), (144, 6, 3)]
    assert len(prog.shape_cache) == 3
    compiles = [r.getMessage() for r in caplog.records if r.name == "einjoin.program"]
    assert len(compiles) == 3 and "adj nnz<=16" in compiles[0] and "adj nnz<=144" in compiles[2]


def test_the_same_larger_capacity_twice_compiles_once_and_smaller_is_a_hit():
    """Two runs at 30 entries (capacity 32) share one compile; 5 and 8 entries (within the
    example's 8) run on the program compiled; each matches torch."""
    m = GCN().eval()
    x = torch.randn(N, 5)
    prog = ej.compile(ej.from_torch(m, (adjacency(8, 0, False), x)), quiet=True)
    for nnz in (5, 30, 30, 8):
        a = adjacency(nnz, nnz, False)
        _close(prog.run(a, x), m(a, x))
    assert (prog.run_stats.cache_hits, prog.run_stats.cache_misses) == (3, 1)
    assert [dict(k)["adj"] for k in prog.shape_cache.keys()] == [(32,)]


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from([(4, 4), (6, 6), (3, 100)]))
def test_capacity_for_holds_the_entries_and_doubles(nnz, compiled, shape):
    dense = int(np.prod(shape))
    nnz = min(nnz, dense)
    cap = capacity_for(nnz, compiled, shape)
    assert cap >= nnz and cap >= min(compiled, cap)
    if nnz <= compiled:
        assert cap == compiled
    else:
        assert cap <= dense and (cap == dense or (cap & (cap - 1) == 0 and cap < 2 * nnz))
