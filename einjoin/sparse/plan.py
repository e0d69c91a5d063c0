"""Sparse einsums compiled and run: ``ej.sparse_compile`` → :class:`SparsePlan`, and
``ej.einsum`` on sparse operands (compile, then run once).

Compiling checks the equation and shapes through the IR's own einsum constructor (the same
errors as a dense einsum), then chooses the layout (`einjoin.sparse.layout`); running builds the
relations and runs the executor (`einjoin.sparse.execute`). The result is a
:class:`~einjoin.sparse.tensor.SparseTensor` when some sparse operand has an output label (a
``mul`` join keeps only co-present tuples, so the output's support is within that operand's),
else a dense ``np.ndarray``.

>>> import numpy as np, scipy.sparse, einjoin as ej
>>> a = ej.sparse("A", scipy.sparse.random(400, 300, density=0.01, random_state=0))
>>> h = np.ones((300, 16))
>>> plan = ej.sparse_compile("ij,jk->ik", a, h, relational={"i"})
>>> print(plan.explain().splitlines()[1])
  IJ, Jk -> Ik  blocks i=1 j=1 (k dense)
>>> np.allclose(plan.run().todense(), a.todense() @ h)
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.equation import parse_equation
from einjoin.sparse.execute import RunCounts, execute
from einjoin.sparse.layout import Layout, Operand, choose_layout, histogram
from einjoin.sparse.tensor import EINSUM, SparseTensor

__all__ = ["SparsePlan", "sparse_compile", "sparse_einsum"]

AGGS = ("sum", "max")


def _operand(x: Any, i: int, what: str) -> SparseTensor | np.ndarray:
    if isinstance(x, SparseTensor):
        return x
    if type(x).__module__.startswith("einjoin"):
        raise UnsupportedOpError(f"{what}: operand {i} is a lazy einjoin {type(x).__name__}; sparse "
                                 f"einsums take SparseTensors and arrays with their data (lazy graphs "
                                 f"with sparse inputs are not built yet, issue 24)")
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise DTypeError(f"{what}: operand {i} has dtype {arr.dtype}")
    return arr


class SparsePlan:
    """A compiled sparse einsum: the per-label layout chosen from the operands' block histograms.

    ``run()`` computes it on the operands it was compiled with, ``run(*operands)`` on others of
    the same shapes and kinds (the layout is kept). ``explain()`` prints the op in
    upper-case-lower-case notation (upper: relational key, lower: dense inside the payload),
    the block sizes, each operand's block histogram, and estimated vs actual tuple counts.
    """

    def __init__(self, equation: str, operands: Sequence[SparseTensor | np.ndarray],
                 in_labels: tuple[tuple[str, ...], ...], out_labels: tuple[str, ...],
                 sizes: dict[str, int], agg: str, dtype: np.dtype, layout: Layout,
                 infos: list[Operand]) -> None:
        self.equation = equation
        self.operands = tuple(operands)
        self.in_labels = in_labels
        self.out_labels = out_labels
        self.sizes = sizes
        self.agg = agg
        self.dtype = dtype
        self.layout = layout
        self._infos = infos
        self.last: RunCounts | None = None

    @property
    def blocks(self) -> dict[str, int | None]:
        """Block size per label; None: dense (inside the payload)."""
        return dict(self.layout.blocks)

    @property
    def sparse_result(self) -> bool:
        return any(isinstance(x, SparseTensor) and set(ls) & set(self.out_labels)
                   for x, ls in zip(self.operands, self.in_labels))

    def _what(self) -> str:
        return f"sparse einsum {self.equation!r}"

    def run(self, *operands: Any) -> SparseTensor | np.ndarray:
        """The result on the compiled operands, or on new ones of the same shapes and kinds."""
        values = self.operands
        if operands:
            if len(operands) != len(self.operands):
                raise ShapeError(f"{self._what()}: run got {len(operands)} operand(s), compiled with "
                                 f"{len(self.operands)}")
            values = tuple(_operand(x, i, self._what()) for i, x in enumerate(operands))
            for i, (new, old) in enumerate(zip(values, self.operands)):
                if tuple(new.shape) != tuple(old.shape) or isinstance(new, SparseTensor) != \
                        isinstance(old, SparseTensor):
                    raise ShapeError(f"{self._what()}: operand {i} of shape {tuple(new.shape)} "
                                     f"({type(new).__name__}) where the plan has {tuple(old.shape)} "
                                     f"({type(old).__name__})")
        out_shape = tuple(self.sizes[lab] for lab in self.out_labels)
        if 0 in self.sizes.values():
            data, keys = np.zeros((0, *out_shape), self.dtype), np.zeros((0, len(out_shape)), np.int64)
            self.last = RunCounts(tuple(0 for _ in values), 0, 0)
            if not self.sparse_result:
                return np.zeros(out_shape, self.dtype)
            return SparseTensor("out", out_shape, tuple(max(n, 1) for n in out_shape), keys, data)
        data, rkeys, counts = execute(values, self.in_labels, self.out_labels, self.sizes, self.layout,
                                      self.agg, self.dtype, self._what())
        self.last = counts
        block = tuple(self.layout.extent(lab, self.sizes[lab]) for lab in self.out_labels)
        if rkeys is None:
            dense = data[0][tuple(slice(0, n) for n in out_shape)] if len(data) else \
                np.zeros(out_shape, self.dtype)
            if not self.sparse_result:
                return np.ascontiguousarray(dense)
            keys = np.zeros((1, len(out_shape)), np.int64)
            return SparseTensor("out", out_shape, block, keys, data)
        full = np.zeros((len(rkeys), len(out_shape)), np.int64)
        rel = [d for d, lab in enumerate(self.out_labels) if self.layout.relational(lab)]
        full[:, rel] = rkeys
        result = SparseTensor("out", out_shape, block, full, data)
        return result if self.sparse_result else result.todense()

    def notation(self) -> str:
        """``Ij, jk -> Ik``: relational labels upper case (``Ii`` when blocks hold more than one
        index along them), dense labels lower case."""
        def one(lab: str) -> str:
            b = self.layout.blocks[lab]
            if b is None:
                return lab.lower()
            return lab.upper() if b == 1 else lab.upper() + lab.lower()
        terms = ["".join(one(lab) for lab in ls) for ls in self.in_labels]
        return ", ".join(terms) + " -> " + "".join(one(lab) for lab in self.out_labels)

    def explain(self) -> str:
        lay = self.layout
        keyed = [f"{lab}={b}" for lab, b in lay.blocks.items() if b is not None]
        dense = [lab for lab, b in lay.blocks.items() if b is None]
        lines = [f"{self._what()} ({self.agg} of mul), result "
                 f"{'sparse' if self.sparse_result else 'dense'} {tuple(self.sizes[lab] for lab in self.out_labels)}",
                 f"  {self.notation()}  blocks {' '.join(keyed) or '-'}"
                 + (f" ({', '.join(dense)} dense)" if dense else "")]
        for info, t in zip(self._infos, lay.tuples):
            if info.coords is None:
                lines.append(f"  {info.name}: dense {info.shape}, {t} tuple(s) at these blocks")
                continue
            hist = ", ".join(f"{b}:{n}" for b, n in histogram(info))
            lines.append(f"  {info.name}: sparse {info.shape}, nnz {len(info.coords)}, {t} tuple(s) at "
                         f"these blocks; block histogram (size:blocks) {hist}")
        actual = (f", actual {self.last.joined} joined, {self.last.out} output tuple(s)"
                  if self.last is not None else " (run() for the actual counts)")
        lines.append(f"  joined tuples: estimated {lay.joined:.0f}{actual}; "
                     f"payload {lay.payload} element-ops per tuple, cost {lay.cost:.3g}")
        return "\n".join(lines)


def sparse_compile(equation: str, *operands: Any, agg: str | None = "sum", join: Any = None,
                   blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None
                   ) -> SparsePlan:
    """Compile an einsum over sparse and dense operands (a ``mul`` join; ``sum`` or ``max``
    aggregation). ``blocks={"j": 256}`` pins a label's block size (relational), ``relational=
    {"i"}`` keeps a label relational at a block size of the planner's choice."""
    what = f"sparse einsum {equation!r}"
    if not operands:
        raise EinjoinError(f"{what}: needs at least one operand")
    values = [_operand(x, i, what) for i, x in enumerate(operands)]
    if not any(isinstance(v, SparseTensor) for v in values):
        raise EinjoinError(f"{what}: no sparse operand (use ej.sparse(name, data), or ej.einsum on "
                           f"lazy tensors for dense programs)")
    if join not in (None, "mul"):
        raise UnsupportedOpError(f"{what}: join {join!r}; sparse einsums support the product ('mul') only")
    agg_name = "sum" if agg is None else getattr(agg, "name", agg)
    if agg_name not in AGGS:
        raise UnsupportedOpError(f"{what}: aggregation {agg_name!r}; sparse einsums support "
                                 f"{', '.join(AGGS)}")
    in_labels, out_labels = parse_equation(equation, [tuple(v.shape) for v in values])
    names = [v.name if isinstance(v, SparseTensor) else f"x{i}" for i, v in enumerate(values)]
    nodes = [ops.input_node(f"{n}#{i}", tuple(v.shape), np.dtype(v.dtype).name)
             for i, (n, v) in enumerate(zip(names, values))]
    # the IR's own checks (labels vs shapes, output labels), with the dense einsum's messages
    ops.einsum_node(nodes, in_labels, out_labels, "mul" if len(values) > 1 else "x0", agg_name)
    for ls, n in zip(in_labels, names):
        if len(set(ls)) != len(ls):
            raise UnsupportedOpError(f"{what}: operand {n!r} repeats a label ({''.join(ls)!r}: "
                                     f"diagonals of sparse operands are not supported)")
    sizes: dict[str, int] = {}
    for ls, v in zip(in_labels, values):
        sizes.update(zip(ls, v.shape))
    if not set(sizes) - set(out_labels):
        agg_name = "sum"  # nothing aggregated: every output key has one tuple
    dtype = np.result_type(*[v.dtype for v in values])
    if dtype.kind == "b":
        dtype = np.dtype(np.float32)
    infos = [Operand(n, ls, tuple(v.shape), v.coo()[0] if isinstance(v, SparseTensor) else None)
             for n, ls, v in zip(names, in_labels, values)]
    layout = choose_layout(infos, out_labels, dict(blocks or {}), set(relational or ()), what=what)
    return SparsePlan(equation, values, tuple(in_labels), tuple(out_labels), sizes, agg_name, dtype,
                      layout, infos)


def sparse_einsum(equation: str, *operands: Any, join: Any = None, agg: str | None = "sum",
                  blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None
                  ) -> SparseTensor | np.ndarray:
    """Compile and run once: what ``ej.einsum`` does when an operand is a SparseTensor."""
    return sparse_compile(equation, *operands, agg=agg, join=join, blocks=blocks,
                          relational=relational).run()


EINSUM["sparse_einsum"] = sparse_einsum
