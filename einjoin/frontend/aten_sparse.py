"""torch sparse tensors in an imported module (issue 24): a forward argument or a buffer that is a
torch sparse tensor (COO or CSR: a GNN's adjacency) becomes a sparse input of the graph
(``ej.sparse_input``: its keys and values are two graph inputs, the tensor is fed at each run), and
``torch.sparse.mm(A, h)`` (``aten._sparse_mm``) / ``A @ h`` (``aten.matmul`` / ``mm``, whose
translation dispatches on a sparse operand) become one ``sparse_einsum`` node, never a dense
adjacency.

The capacity (``nnz``) of a sparse argument is the stored entries of the example it was imported
with (the largest, where examples of one shape differ), of a buffer what it stores at import: a
run may feed another pattern of the same shape with at most that many entries. A forward
argument with more is imported and compiled again at the next power of two (at most the dense
size), kept in the program's shape cache as a new shape is (``einjoin.variants.capacity_for``;
logged by ``einjoin.program``); a buffer with more is refused naming the input.

>>> import torch, einjoin as ej
>>> class Layer(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin = torch.nn.Linear(4, 3)
...     def forward(self, adj, x):
...         return torch.relu(torch.sparse.mm(adj, self.lin(x)))
>>> g = torch.Generator().manual_seed(0)
>>> adj = torch.sparse_coo_tensor(torch.randint(0, 6, (2, 10), generator=g), torch.rand(10, generator=g), (6, 6))
>>> x = torch.randn(6, 4, generator=g)
>>> layer = Layer()
>>> fn = ej.from_torch(layer, (adj, x))
>>> fn.arg_names
('adj', 'x')
>>> bool(torch.allclose(ej.compile(fn).run(adj, x), layer(adj, x), atol=1e-6))
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from einjoin.errors import EinjoinError
from einjoin.frontend import aten
from einjoin.frontend import functions as F
from einjoin.ir.sparse_einsum import DECLARE_INPUT
from einjoin.registry import registrar

__all__ = ["SPARSE_OPS", "is_sparse", "sparse_placeholder", "example_nnz", "unview", "unviewed"]

SPARSE_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(SPARSE_OPS)


@op("_sparse_mm")
def _sparse_mm(a: Any, b: Any) -> Any:
    """``torch.sparse.mm(A, h)`` (``aten._sparse_mm``): ``A @ h``, a ``sparse_einsum`` node when
    ``A`` is a sparse input (a dense ``A`` is a plain matmul, as torch computes it)."""
    return F.matmul(a, b)


@op("_sparse_addmm")
def _sparse_addmm(bias: Any, a: Any, b: Any, beta: Any = 1, alpha: Any = 1) -> Any:
    """``torch.sparse.addmm(bias, A, h, beta=, alpha=)``: ``beta * bias + alpha * (A @ h)`` (beta 0:
    bias is not read, as torch's addmm)."""
    return aten.OPS["addmm"](bias, a, b, beta=beta, alpha=alpha)


aten.OPS.update(SPARSE_OPS)  # registered in the op table here (aten.py's other tables are merged there)


def is_sparse(t: Any) -> bool:
    """Whether ``t`` is a torch tensor of a sparse layout (COO, CSR, CSC, BSR, BSC)."""
    import torch
    return isinstance(t, torch.Tensor) and t.layout != torch.strided


def example_nnz(val: Any, examples: Any) -> int:
    """The capacity of a sparse forward argument whose traced value is ``val`` (a fake tensor:
    its stored entries are not known): the most stored entries among the example arguments
    (``examples``, any nesting) that are sparse tensors of its shape, layout and dtype."""
    import torch.utils._pytree as pytree
    found = [int(x._nnz()) for x in pytree.tree_leaves(examples)
             if is_sparse(x) and tuple(x.shape) == tuple(val.shape) and x.layout == val.layout
             and x.dtype == val.dtype]
    if not found:  # pragma: no cover - export traces the examples it was given
        raise EinjoinError(f"from_torch: no example sparse tensor of shape {list(val.shape)} for a sparse argument")
    return max(found)


def unview(x: Any) -> Any:
    """``x`` (an argument, any nesting) with each sparse tensor that is a view (``adj.t()``,
    ``adj.transpose(0, 1)``) detached: the same entries, not a view, which torch.export can trace
    (it fails on the view: 'meta converter nyi')."""
    import torch.utils._pytree as pytree
    return pytree.tree_map(lambda t: t.detach() if is_sparse(t) and t._is_view() else t, x)


@contextmanager
def unviewed(module: Any) -> Iterator[None]:
    """The module's sparse buffers that are views detached (:func:`unview`) while the block runs,
    put back after it."""
    held = [(m, k, t) for m in module.modules() for k, t in m._buffers.items()
            if t is not None and is_sparse(t) and t._is_view()]
    for m, k, t in held:
        m._buffers[k] = t.detach()
    try:
        yield
    finally:
        for m, k, t in held:
            m._buffers[k] = t


def sparse_placeholder(name: str, t: Any, nnz: int, dtype: str, what: str) -> Any:
    """The sparse input (``ej.sparse_input(name, shape, nnz, dtype)``) standing for the torch sparse
    tensor ``t`` (``what``: a forward argument, a buffer, for errors)."""
    if t.dense_dim() > 0:
        raise EinjoinError(f"from_torch: {what} is a hybrid sparse tensor ({t.sparse_dim()} sparse and "
                           f"{t.dense_dim()} dense dims), which einjoin does not import; make its dense "
                           f"dims sparse too (t.to_dense().to_sparse())")
    if not DECLARE_INPUT:  # pragma: no cover - einjoin's package import loads the sparse engine
        raise EinjoinError(f"from_torch: {what} is sparse, and the sparse engine is not loaded (import einjoin)")
    return DECLARE_INPUT[0](name, tuple(int(s) for s in t.shape), max(int(nnz), 1), dtype)
