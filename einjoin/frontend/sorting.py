"""Ordering along a dim, as torch names it: ``topk``, ``sort``, ``argsort`` on the IR's
:class:`~einjoin.ir.opkinds.TopK` kind (the sorted dim is read whole by each kernel; every other
dim cuts freely). Equal values keep their order (a stable sort: one of the orders torch may
give); NaN counts as the largest. The values' gradient is placed back at their positions. Also
the torch translations (:data:`SORT_OPS`, merged into the op table with the convolutions').

>>> import einjoin as ej
>>> v, i = topk(ej.input("x", (4, 10)), 3)
>>> v.shape, i.dtype, argsort(ej.input("y", (5, 6)), dim=0, descending=True).shape
((4, 3), 'int64', (5, 6))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from einjoin.errors import DTypeError, EinjoinError
from einjoin.frontend.tensor import Tensor
from einjoin.ir import ops
from einjoin.registry import registrar

__all__ = ["topk", "sort", "argsort", "Ordered", "SORT_OPS"]


class Ordered(NamedTuple):
    """(values, indices), with the field names of torch's ``torch.return_types.topk`` / ``sort``."""

    values: Tensor
    indices: Tensor


def _x(x: Any, what: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise EinjoinError(f"{what}: expected an einjoin tensor, got {type(x).__name__}")
    return x


def _rank1(x: Tensor) -> tuple[Tensor, bool]:
    # torch orders a 0-d tensor as one element
    return (x.reshape((1,)), True) if x.ndim == 0 else (x, False)


def _pair(x: Tensor, k: int, dim: int, largest: bool) -> Ordered:
    if x.dtype == "bool":  # torch orders False before True: as uint8 0 / 1, the values back in bool
        v, i = _pair(x.to("uint8"), k, dim, largest)
        return Ordered(v.to("bool"), i)
    x, scalar = _rank1(x)
    v = Tensor(ops.topk_node(x.node, k, dim, largest))
    i = Tensor(ops.topk_node(x.node, k, dim, largest, indices=True))
    return Ordered(v.reshape(()), i.reshape(())) if scalar else Ordered(v, i)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Ordered:
    """torch's ``topk``: the ``k`` largest (or smallest) values along ``dim`` and their int64
    positions, in order (also when ``sorted=False``: any order is torch's contract then)."""
    x = _x(x, "topk")
    if x.dtype == "bool":  # torch's topk refuses bool (its sort does not): refused alike
        raise DTypeError(f"topk of a bool tensor {x.shape}: torch's topk does not support bool; "
                         "cast it first (x.to(torch.uint8)) or use sort")
    return _pair(x, k, dim, largest)


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Ordered:
    """torch's ``sort``: (values, int64 indices) along ``dim`` (always stable)."""
    x = _x(x, "sort")
    n = x.shape[dim] if x.ndim else 1
    return _pair(x, n, dim, descending)


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = False) -> Tensor:
    """torch's ``argsort``: the int64 positions that sort ``x`` along ``dim`` (stable)."""
    return sort(x, dim, descending, stable)[1]


SORT_OPS: dict[str, Callable[..., Any]] = {}
op = registrar(SORT_OPS)


@op("topk")
def _topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Ordered:
    return topk(x, int(k), int(dim), bool(largest), bool(sorted))


@op("sort")
def _sort(x: Tensor, dim: Any = -1, descending: bool = False, stable: Any = False) -> Ordered:
    if isinstance(dim, bool):  # aten.sort.stable(x, stable, dim, descending) spelled positionally
        dim, stable = -1, dim
    return sort(x, int(dim), bool(descending), bool(stable))


@op("argsort")
def _argsort(x: Tensor, dim: Any = -1, descending: bool = False, stable: Any = False) -> Tensor:
    if isinstance(dim, bool):
        dim, stable = -1, dim
    return argsort(x, int(dim), bool(descending), bool(stable))
