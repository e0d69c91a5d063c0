"""The one exception family of einjoin.

Every error a user can cause is an :class:`EinjoinError`; its message names the op, the
labels, the shapes or the partition at fault, so nobody has to read a traceback into
einjoin's internals to learn what went wrong.

>>> import einjoin as ej
>>> try:
...     ej.einsum("ij,jk->ik", ej.input("a", (2, 3)), ej.input("b", (4, 5)))
... except ej.ShapeError as e:
...     print(e)
einsum 'ij,jk->ik': label 'j' has size 3 in input 0 (shape (2, 3)) but size 4 in input 1 (shape (4, 5))
"""

from __future__ import annotations

__all__ = [
    "EinjoinError",
    "ShapeError",
    "EinsumSyntaxError",
    "DTypeError",
    "PartitionError",
    "UnsupportedOpError",
    "ExpressionError",
]


class EinjoinError(Exception):
    """Root of every error einjoin raises on purpose."""


class ShapeError(EinjoinError, ValueError):
    """Shapes or ranks that do not fit the op (sizes that disagree, negative dims, bad reshape)."""


class EinsumSyntaxError(EinjoinError, ValueError):
    """A malformed einsum equation (bad characters, repeated output labels, wrong input count)."""


class DTypeError(EinjoinError, TypeError):
    """An unknown dtype name, or a dtype mix the op cannot give a meaning to."""


class PartitionError(EinjoinError, ValueError):
    """A partition or join-agg spec that is not valid for the tensor or op it is applied to."""


class UnsupportedOpError(EinjoinError, NotImplementedError):
    """An op einjoin does not (yet) translate or execute."""


class ExpressionError(EinjoinError, ValueError):
    """A scalar join expression that does not parse or names unknown functions or arguments."""
