"""The op kinds of the IR: the payload classes a :class:`~einjoin.ir.node.Node` carries, and
:func:`rule_for`, how each layer dispatches on them through its rule table.

Op payloads are small frozen dataclasses — plain, hashable data. They live apart from
:class:`~einjoin.ir.node.Node` so that what only needs the kinds (the printed forms in
:mod:`einjoin.ir.printing`, which ``Node.__repr__`` uses) imports them without importing the
node type. :mod:`einjoin.ir.node` re-exports every name here.

>>> from einjoin.ir.agg import get_agg
>>> from einjoin.ir.scalar import parse_join
>>> Einsum((("i", "j"), ("j", "k")), ("i", "k"), parse_join("mul", 2), get_agg("sum")).equation
'ij,jk->ik'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from collections.abc import Mapping, Sequence

from einjoin.errors import EinjoinError
from einjoin.ir.agg import Agg
from einjoin.ir.scalar import Expr

__all__ = ["Op", "Input", "Einsum", "Reshape", "Broadcast", "Select", "Concat", "Fill", "Gather",
           "ScatterAdd", "Cast", "Conv", "Pool", "TopK", "RotateHalf", "Attention", "AttentionGrad",
           "SparseEinsum", "SparseOperand", "rule_for"]


@dataclass(frozen=True)
class Input:
    """A graph input, fed by name at run time. ``param`` marks a parameter (a weight) as opposed
    to an activation; planners such as data parallelism read it."""

    name: str
    param: bool = False


@dataclass(frozen=True)
class Einsum:
    """``out[out_labels] = agg over missing labels of join(x_i[in_labels[i]] ...)``.

    ``agg`` is ``none`` exactly when no label is aggregated."""

    in_labels: tuple[tuple[str, ...], ...]
    out_labels: tuple[str, ...]
    join: Expr
    agg: Agg

    @property
    def all_labels(self) -> tuple[str, ...]:
        """Every label once: output labels first, then aggregated ones in order of appearance."""
        seen = list(self.out_labels)
        for ls in self.in_labels:
            for lab in ls:
                if lab not in seen:
                    seen.append(lab)
        return tuple(seen)

    @property
    def agg_labels(self) -> tuple[str, ...]:
        return tuple(lab for lab in self.all_labels if lab not in self.out_labels)

    @property
    def equation(self) -> str:
        return ",".join("".join(ls) for ls in self.in_labels) + "->" + "".join(self.out_labels)


@dataclass(frozen=True)
class Reshape:
    """Row-major reshape to the node's shape (merge and split dimensions)."""


@dataclass(frozen=True)
class Broadcast:
    """Expand to the node's shape; input dim ``i`` becomes output dim ``dims[i]`` (size 1 or equal)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class Select:
    """The sub-box ``[starts, stops)`` of the input."""

    starts: tuple[int, ...]
    stops: tuple[int, ...]


@dataclass(frozen=True)
class Concat:
    """Inputs laid end to end along ``axis``."""

    axis: int


@dataclass(frozen=True)
class Fill:
    """A tensor with no inputs: ``expr`` evaluated over the index grid (``x_d`` is the index along
    dim ``d``): constants, iota, the causal mask ``x0 >= x1``, rotary tables."""

    expr: Expr


@dataclass(frozen=True)
class Gather:
    """``out[idx..., rest...] = table[indices[idx...], rest...]`` (embedding lookup by int64 rows)."""


@dataclass(frozen=True)
class ScatterAdd:
    """``out = zeros((rows,) + rest); out[indices[idx...], rest...] += updates[idx..., rest...]``
    (numpy's ``np.add.at``): the adjoint of :class:`Gather` with respect to its table, so an
    embedding's gradient costs O(tokens x hidden). Inputs ``(updates, indices)``; the row count
    is the output's first dim (the shape says it, so the op has no fields)."""


@dataclass(frozen=True)
class Cast:
    """Convert to the node's dtype."""


@dataclass(frozen=True)
class Conv:
    """A convolution, an extended einsum with affine input indices (XLA's ConvGeneralDilated in
    NC* layout). Inputs ``(x, w)``: ``x`` of shape ``(N, C, *spatial)`` (1-3 spatial dims), ``w``
    of shape ``(O, C // groups, *kernel)``; the output is ``(N, O, *out)`` with

        out[n, g*Og + o, y...] = sum over c, k... of
                                 x[n, g*Cg + c, i...] * w[g*Og + o, c, k...]

    where along each spatial dim ``lhs_dilation * i = stride * y + rhs_dilation * k - lo``
    (no such ``i``: zero; see :mod:`einjoin.ir.window`). ``padding`` is one ``(lo, hi)`` pair per
    spatial dim, negative to crop. A plain conv has dilations 1; a transposed conv (and the
    gradient w.r.t. the input) dilates the input; the gradient w.r.t. the weight is a conv of
    the input with the output's cotangent as its kernel."""

    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    groups: int = 1


@dataclass(frozen=True)
class Pool:
    """A window aggregation over the spatial dims of ``x`` of shape ``(N, C, *spatial)``:
    ``out[n, c, y...] = agg over k... of x[n, c, stride*y + dilation*k - lo ...]``, the padding
    (and every position outside the input) being the aggregation's identity (-inf for max, 0 for
    sum). ``agg`` is ``max`` or ``sum`` (average pooling divides the sum), or ``none``: the windows
    themselves, ``out[n, c*K + j, y...]`` for window position ``j`` (row-major), zero padded —
    torch's unfold (im2col) order, copied exactly (no arithmetic: an inf or NaN stays put)."""

    agg: Agg
    window: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]


@dataclass(frozen=True)
class TopK:
    """The ``k`` largest (``largest``) or smallest values along ``axis``, in order — or their
    int64 positions (``indices``): torch's ``topk`` / ``sort`` / ``argsort`` (a sort is ``k`` =
    the dim's size). Equal values keep their order (a stable sort); NaN counts as the largest,
    as in torch. Values and indices are two nodes (each computes the order of its rows)."""

    axis: int
    k: int
    largest: bool
    indices: bool


@dataclass(frozen=True)
class RotateHalf:
    """Rotary embedding's ``rotate_half`` along ``axis`` (of even size ``2h``), times ``sign``:
    ``sign * cat(-x[h:], x[:h])``. Its adjoint is the same op with the other sign (the map is
    orthogonal and its transpose is its negation), so forward and backward are one node each
    instead of two selects, a negation and a concat. No rounding: values are moved and negated."""

    axis: int
    sign: int = 1


@dataclass(frozen=True)
class Attention:
    """Fused scaled dot-product attention, torch's ``scaled_dot_product_attention``: inputs
    ``(q, k, v[, mask])`` of shapes ``(..., L, E)``, ``(..., S, E)``, ``(..., S, Ev)`` (one batch
    shape) and a mask of q's rank whose dims are 1 or ``(..., L, S)``'s (bool: True may attend;
    or additive, in q's dtype); the output ``(..., L, Ev)`` is ``softmax(q k^T scale + mask) v``.
    ``causal`` allows key ``j`` to query ``i`` only where ``j <= i`` (top-left aligned, as
    torch's ``is_causal``). A query with no allowed key gets zeros, as torch's. The scores are
    never a tensor of the graph: a kernel computes them in tiles (torch's flash kernel).
    ``window`` (with ``causal``): a sliding window, key ``j`` for query ``i`` only where
    ``i - window < j <= i`` (Mistral's); a block of queries then reads only its band of keys."""

    scale: float
    causal: bool
    window: int | None = None

    def __repr__(self) -> str:  # the window only where there is one (the common node prints as before)
        w = "" if self.window is None else f", window={self.window}"
        return f"Attention(scale={self.scale!r}, causal={self.causal!r}{w})"


@dataclass(frozen=True)
class AttentionGrad:
    """The gradients of an :class:`Attention` with respect to some of its inputs, from inputs
    ``(q, k, v, dout[, mask])``: for ``parts`` a run of ``("q", "k", "v")`` sharing their last
    dim, ``dq``, ``dk``, ``dv`` stacked along the rows (dim -2: ``L``, ``S``, ``S`` rows), read
    back by selects; for ``parts == ("mask",)`` an additive mask's gradient (its shape).
    ``window``: the forward's."""

    scale: float
    causal: bool
    parts: tuple[str, ...]
    window: int | None = None

    def __repr__(self) -> str:
        w = "" if self.window is None else f", window={self.window}"
        return f"AttentionGrad(scale={self.scale!r}, causal={self.causal!r}, parts={self.parts!r}{w})"


class SparseOperand(Protocol):
    """What the IR asks of the sparse constant of a :class:`SparseEinsum` (einjoin.sparse's
    ``GraphSparse`` wraps a ``SparseTensor``; the IR never imports the sparse engine, which sits
    floors above it): its name, shape, dtype name and stored entries, its densified value (the
    reference), and the einsum computed by the sparse engine on dense blocks."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype_name(self) -> str: ...

    @property
    def nnz(self) -> int: ...

    def todense(self) -> Any: ...

    def einsum(self, op: SparseEinsum, dense: Sequence[Any], dtype: str) -> Any: ...


@dataclass(frozen=True)
class SparseEinsum:
    """``out[out_labels] = sum over missing labels of the product of the operands``, one of
    which (at ``position`` of ``in_labels``) is ``operand``, a sparse constant of the node; the
    node's inputs are the dense operands in order (issue 24: a sparse adjacency inside a dense
    graph, ``relu(A @ H @ W)``). Evaluated by the sparse engine (:class:`SparseOperand`'s
    ``einsum``); the planner cuts it by its output dims (``ir.sparse_einsum.dense_follows``).
    ``agg="max"``: the maximum of the products instead of their sum, an absent entry's product
    being 0 (a row with no stored entries has maximum 0)."""

    in_labels: tuple[tuple[str, ...], ...]
    out_labels: tuple[str, ...]
    position: int
    operand: SparseOperand
    agg: str = "sum"

    @property
    def equation(self) -> str:
        return ",".join("".join(ls) for ls in self.in_labels) + "->" + "".join(self.out_labels)

    @property
    def dense_labels(self) -> tuple[tuple[str, ...], ...]:
        """The labels of the node's inputs (the dense operands), in order."""
        return self.in_labels[:self.position] + self.in_labels[self.position + 1:]


Op = (Input | Einsum | Reshape | Broadcast | Select | Concat | Fill | Gather | ScatterAdd | Cast | Conv | Pool | TopK
      | RotateHalf | Attention | AttentionGrad | SparseEinsum)


_Rule = TypeVar("_Rule")


def rule_for(table: Mapping[type, _Rule], op: Op, table_name: str) -> _Rule:
    """``table``'s entry for ``op``'s kind: how each layer dispatches on node kinds.

    >>> rule_for({Input: "feed"}, Input("x"), "example")
    'feed'
    """
    try:
        return table[type(op)]
    except KeyError:
        raise EinjoinError(f"{table_name} has no rule for node kind {type(op).__name__!r} "
                           f"(op {op!r}); every kind needs an entry there") from None
