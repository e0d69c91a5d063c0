"""Parsing einsum equations: ``"ij,jk->ik"``, spaces, implicit outputs and ``...`` batch dims.

>>> from einjoin.ir.equation import parse_equation
>>> parse_equation("b i j, b j k -> b i k", [(2, 3, 4), (2, 4, 5)])
((('b', 'i', 'j'), ('b', 'j', 'k')), ('b', 'i', 'k'))
>>> parse_equation("...ij,...jk", [(7, 3, 4), (4, 5)])[1]  # implicit output, ellipsis first
('A', 'i', 'k')
"""

from __future__ import annotations

from collections.abc import Sequence

from einjoin.errors import EinsumSyntaxError, ShapeError

__all__ = ["parse_equation", "ELLIPSIS_LABELS"]

# labels given to the dims that "..." stands for, taken in order, skipping any the equation uses
ELLIPSIS_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def parse_equation(eq: str, shapes: Sequence[tuple[int, ...]]
                   ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]:
    """Split an equation into per-input labels and output labels, expanding ``...``.

    ``...`` stands for the trailing-aligned batch dims, as in numpy; inputs whose ``...`` covers
    fewer dims get the rightmost of those labels. Size agreement is checked by the einsum op."""
    if not isinstance(eq, str):
        raise EinsumSyntaxError(f"einsum equation must be a string, got {type(eq).__name__}")
    text = eq.replace(" ", "").replace("\t", "")
    if text.count("->") > 1:
        raise EinsumSyntaxError(f"einsum {eq!r}: more than one '->'")
    lhs, arrow, rhs = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise EinsumSyntaxError(
            f"einsum {eq!r} names {len(terms)} input(s) but {len(shapes)} tensor(s) were given")
    for t in terms + ([rhs] if arrow else []):
        body = t.replace("...", "")
        if "." in body:
            raise EinsumSyntaxError(f"einsum {eq!r}: a '.' that is not part of '...' in {t!r}")
        if t.count("...") > 1:
            raise EinsumSyntaxError(f"einsum {eq!r}: more than one '...' in {t!r}")
        for c in body:
            if not c.isalpha():
                raise EinsumSyntaxError(
                    f"einsum {eq!r}: {c!r} is not a label (labels are letters)")
    used = set(text) - set(",.->")
    free = [c for c in ELLIPSIS_LABELS if c not in used]
    n_ell = 0
    for t, shape in zip(terms, shapes):
        if "..." in t:
            n = len(shape) - (len(t) - 3)
            if n < 0:
                raise ShapeError(f"einsum {eq!r}: term {t!r} has more labels than the rank "
                                 f"{len(shape)} of its input (shape {tuple(shape)})")
            n_ell = max(n_ell, n)
    if n_ell > len(free):
        raise EinsumSyntaxError(f"einsum {eq!r}: '...' covers too many dims")
    ell = free[:n_ell]

    def expand(t: str, n: int) -> tuple[str, ...]:
        if "..." not in t:
            return tuple(t)
        head, _, tail = t.partition("...")
        return tuple(head) + tuple(ell[n_ell - n:]) + tuple(tail)

    in_labels = []
    for t, shape in zip(terms, shapes):
        n = len(shape) - (len(t) - 3) if "..." in t else 0
        labels = expand(t, n)
        if len(labels) != len(shape):
            raise ShapeError(f"einsum {eq!r}: term {t!r} has {len(labels)} label(s) but its input "
                             f"has rank {len(shape)} (shape {tuple(shape)})")
        in_labels.append(labels)
    if arrow:
        if "..." in rhs:
            out = expand(rhs, n_ell)
        else:
            out = tuple(rhs)
    else:  # numpy's implicit output: ellipsis dims, then labels seen once, alphabetically
        counts: dict[str, int] = {}
        for ls in in_labels:
            for c in ls:
                counts[c] = counts.get(c, 0) + 1
        out = tuple(ell) + tuple(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return tuple(in_labels), out
