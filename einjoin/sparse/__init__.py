"""Sparse tensors (issue 24): block-sparse tensor relations, the per-label relational / dense
layout, and an in-memory relational executor of sparse einsums.

Upper-case (relational) labels are keys over non-empty blocks, joined and grouped; lower-case
(dense) labels live inside each tuple's payload and are handled by the einsum kernel, batched
over tuples. See docs/architecture.md, "Sparse".
"""

import einjoin.sparse.einsum_cache  # noqa: F401 - registers ej.einsum's kept plans (EINSUM["cached"])
from einjoin.sparse.feed import SparseInput, sparse_input  # registers the feed hook (a sparse tensor fed by name)
from einjoin.sparse.grad import sparse_vjp
from einjoin.sparse.node import GraphSparse  # registers the graph node builder (ej.einsum with lazy operands)
from einjoin.sparse.plan import SparsePlan, sparse_compile, sparse_einsum
from einjoin.sparse.tensor import SparseTensor, is_sparse, sparse
import einjoin.sparse.tensor_ops  # noqa: F401 - registers the Tensor API's ops (TENSOR_OPS)

__all__ = ["SparseTensor", "SparsePlan", "sparse", "sparse_compile", "sparse_einsum", "is_sparse",
           "sparse_vjp", "GraphSparse", "SparseInput", "sparse_input"]
