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
>>> plan.notation(), plan.blocks
('IJ, Jk -> Ik', {'i': 1, 'k': None, 'j': 1})
>>> np.allclose(plan.run().todense(), a.todense() @ h)
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, PartitionError, ShapeError, UnsupportedOpError
from einjoin.ir import ops
from einjoin.ir.equation import parse_equation
from einjoin.ir.node import Node
from einjoin.ir.scalar import is_identity, is_product, parse_join
from einjoin.cluster.sizes import parse_bytes
from einjoin.sparse.distribute import Distribution, Exchange, distribution, held_bytes
from einjoin.sparse.duckdb_exec import DuckDevice, DuckSession, device_settings, execute_duckdb, require_duckdb
from einjoin.sparse.execute import RunCounts
from einjoin.sparse.joins import JoinPlan
from einjoin.sparse.layout import Layout, Operand, choose_layout, histogram
from einjoin.sparse.replan import PatternCache, bind_operands, pattern_of
from einjoin.sparse.tensor import (EINSUM, SparseTensor, dense_operand, drop_dims, half, is_float, is_sparse_format,
                                   size1_squeeze, sparse)

__all__ = ["SparsePlan", "SparseRunStats", "Step", "sparse_compile", "sparse_einsum", "GRAD"]

GRAD: dict[str, Any] = {}  # {"vjp": einjoin.sparse.grad.sparse_vjp}: grad imports this module, not back
# {"einsum": einjoin.sparse.node.lazy_einsum}: a sparse einsum with lazy operands is a graph node (node
# imports this module, not back)
LAZY: dict[str, Any] = {}

AGGS = ("sum", "max")
KERNELS = {"batched": "one batched einsum per chunk of tuples", "looped": "one BLAS einsum per tuple",
           "spmm": "a sparse matrix of the scalar payloads times the large ones (SpMM)",
           "rowprod": "gathered payload rows multiplied, added by output key (einjoin.sparse.kernels)"}


def _operand(x: Any, i: int, what: str) -> SparseTensor | np.ndarray:
    if isinstance(x, SparseTensor):
        return x
    if is_sparse_format(x):  # a scipy / torch / pydata sparse operand stays sparse, never densified
        return sparse(f"x{i}", x)
    if type(x).__module__.startswith("einjoin"):
        raise UnsupportedOpError(f"{what}: operand {i} is a lazy einjoin {type(x).__name__}; a compiled "
                                 f"sparse einsum takes SparseTensors and arrays with their data (ej.einsum "
                                 f"on a SparseTensor and lazy tensors builds a graph node instead)")
    return dense_operand(x, i, what)


@dataclass
class Step:
    """One join-aggregation of the plan: operands are the plan's inputs (``("in", i)``) or earlier
    steps' results (``("step", j)``). ``layout`` is chosen at compile when every operand is an
    input, else at run on the intermediate's actual pattern (``ran`` keeps the last one used)."""

    refs: tuple[tuple[str, int], ...]
    in_labels: tuple[tuple[str, ...], ...]
    out_labels: tuple[str, ...]
    layout: Layout | None
    infos: list[Operand] | None
    ran: Layout | None = None
    counts: RunCounts | None = None
    exchange: Exchange | None = None  # the last run's split over devices (einjoin.sparse.distribute)
    held: list[int] | None = None  # the last run's tuple bytes per device (inputs held plus output)

    def notation(self, layout: Layout) -> str:
        """``Ij, jk -> Ik``: relational labels upper case (``Ii`` when blocks hold more than one
        index along them), dense labels lower case."""
        def one(lab: str) -> str:
            b = layout.blocks[lab]
            if b is None:
                return lab.lower()
            return lab.upper() if b == 1 else lab.upper() + lab.lower()
        terms = ["".join(one(lab) for lab in ls) for ls in self.in_labels]
        return ", ".join(terms) + " -> " + "".join(one(lab) for lab in self.out_labels)


@dataclass(frozen=True)
class SparseRunStats:
    """A sparse plan's last run, per device: ``peak_bytes`` the most tuple bytes of any step (its
    input tuples held, keys and payloads at the step's layout, plus its output tuples: the
    relations, not the executor's scratch), ``step_bytes`` each step's; ``memory_limit`` the cap
    they were checked against (bytes, None: none)."""

    peak_bytes: tuple[int, ...]
    step_bytes: tuple[tuple[int, ...], ...]
    memory_limit: int | None = None


def _infos(values: Sequence[SparseTensor | np.ndarray], labels: Sequence[tuple[str, ...]],
           names: Sequence[str]) -> list[Operand]:
    return [Operand(n, ls, tuple(v.shape), v.coo()[0], _counts=v.counts) if isinstance(v, SparseTensor)
            else Operand(n, ls, tuple(v.shape), None) for n, ls, v in zip(names, labels, values)]


def _path(in_labels: Sequence[tuple[str, ...]], out_labels: tuple[str, ...],
          infos: list[Operand], pins: Mapping[str, int], relational: set[str], agg: str,
          what: str, engine: str = "memory") -> list[Step]:
    """The steps: one n-ary join-aggregation, or (a sum of products of three or more operands)
    binary steps when cheaper: an n-way join enumerates every path through the operands, while
    a binary step aggregates in between. For three operands every pairing and the n-ary step
    are costed (a planned intermediate counted by its estimated entries); beyond, pairs are
    taken greedily, pairs that share a label first."""
    whole = choose_layout(infos, out_labels, pins, relational, agg=agg, what=what, engine=engine)
    single = [Step(tuple(("in", i) for i in range(len(in_labels))), tuple(in_labels), out_labels,
                   whole, infos)]
    if agg != "sum" or len(in_labels) <= 2:
        return single
    live: list[tuple[tuple[str, int], tuple[str, ...], Operand, bool]] = [
        (("in", i), ls, info, info.coords is not None) for i, (ls, info) in enumerate(zip(in_labels, infos))]
    steps: list[Step] = []
    total = 0.0
    while len(live) > 2:
        scored = []
        for a in range(len(live)):
            for b in range(a + 1, len(live)):
                rest = {lab for k, x in enumerate(live) if k not in (a, b) for lab in x[1]}
                keep = rest | set(out_labels)
                labs = tuple(dict.fromkeys(lab for lab in live[a][1] + live[b][1] if lab in keep))
                sub = [live[a][2], live[b][2]]
                lay = choose_layout(sub, labs, _only(pins, sub), relational & _labels(sub), agg=agg,
                                    what=what, engine=engine)
                outer = not set(live[a][1]) & set(live[b][1])
                extra = 0.0
                if len(live) == 3:  # cost the last step too, on the planned intermediate
                    extra = _last_cost(live, a, b, labs, lay, out_labels, pins, relational, what, engine)
                scored.append((outer, lay.cost + extra, a, b, labs, lay))
        outer, cost, a, b, labs, lay = min(scored, key=lambda x: (x[0] and len(live) > 3, x[1]))
        total += cost
        original = live[a][0][0] == "in" and live[b][0][0] == "in"
        steps.append(Step((live[a][0], live[b][0]), (live[a][1], live[b][1]), labs,
                          lay if original else None, [live[a][2], live[b][2]] if original else None))
        tmp, is_sparse = _intermediate(live[a], live[b], labs, lay, f"t{len(steps) - 1}")
        live = [x for k, x in enumerate(live) if k not in (a, b)] + [(("step", len(steps) - 1), labs, tmp,
                                                                      is_sparse)]
    (ra, la, ia, _), (rb, lb, ib, _) = live
    original = ra[0] == "in" and rb[0] == "in"
    lay2 = choose_layout([ia, ib], out_labels, _only(pins, [ia, ib]), relational & _labels([ia, ib]),
                         agg=agg, what=what, engine=engine) if original else None
    steps.append(Step((ra, rb), (la, lb), out_labels, lay2, [ia, ib] if original else None))
    if len(in_labels) == 3 and whole.cost <= total:
        return single
    return steps


def _intermediate(x: tuple[tuple[str, int], tuple[str, ...], Operand, bool],
                  y: tuple[tuple[str, int], tuple[str, ...], Operand, bool], labs: tuple[str, ...],
                  lay: Layout, name: str) -> tuple[Operand, bool]:
    """A planned step result as an operand: sparse (entries estimated) when an input that is
    sparse has one of its labels, else dense."""
    sizes = {lab: n for _, ls, info, _ in (x, y) for lab, n in zip(ls, info.shape)}
    shape = tuple(sizes[lab] for lab in labs)
    is_sparse = any(sp and set(ls) & set(labs) for _, ls, _, sp in (x, y))
    estimate = None
    if is_sparse:
        ext = math.prod(lay.extent(lab, sizes[lab]) for lab in labs)
        estimate = min(lay.joined * ext, float(math.prod(shape)))
    return Operand(name, labs, shape, None, estimate), is_sparse


def _last_cost(live: list[tuple[tuple[str, int], tuple[str, ...], Operand, bool]], a: int, b: int,
               labs: tuple[str, ...], lay: Layout, out_labels: tuple[str, ...],
               pins: Mapping[str, int], relational: set[str], what: str, engine: str) -> float:
    tmp, _ = _intermediate(live[a], live[b], labs, lay, "t")
    (other,) = [x[2] for k, x in enumerate(live) if k not in (a, b)]
    sub = [other, tmp]
    return choose_layout(sub, out_labels, _only(pins, sub), relational & _labels(sub),
                         what=what, engine=engine).cost


def _labels(infos: Sequence[Operand]) -> set[str]:
    return {lab for op in infos for lab in op.labels}


def _only(pins: Mapping[str, int], infos: Sequence[Operand]) -> dict[str, int]:
    labs = _labels(infos)
    return {lab: b for lab, b in pins.items() if lab in labs}


class SparsePlan:
    """A compiled sparse einsum: the steps (binary join-aggregations for a sum of products) and
    the per-label layout of each, chosen from the operands' block histograms.

    ``run()`` computes it on the operands it was compiled with, ``run(*operands)`` or
    ``run(A=other)`` on others of the same shapes and kinds: the same block histogram reuses the
    layouts, another one replans (cached per histogram; `einjoin.sparse.replan`). ``explain()`` prints each
    step in upper-case-lower-case notation (upper: relational key, lower: dense inside the
    payload), the block sizes, each sparse input's block histogram, and estimated vs actual
    tuple counts.
    """

    def __init__(self, equation: str, operands: Sequence[SparseTensor | np.ndarray],
                 in_labels: tuple[tuple[str, ...], ...], out_labels: tuple[str, ...],
                 sizes: dict[str, int], agg: str, dtype: np.dtype, steps: list[Step],
                 pins: Mapping[str, int], relational: set[str], engine: Engine | None = None,
                 devices: Distribution | None = None) -> None:
        self.equation = equation
        # (the operands' shapes as given, each one's dims kept) when size-1 dims were broadcast:
        # ``equation`` and ``operands`` are the squeezed ones
        self.broadcast: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] | None = None
        self.engine = engine or Engine()
        self.distribution = devices or Distribution(1, None)
        self.operands = tuple(operands)
        self.in_labels = in_labels
        self.out_labels = out_labels
        self.sizes = sizes
        self.agg = agg
        self.dtype = dtype
        self.steps = steps
        self._pins = dict(pins)
        self._relational = set(relational)
        self._patterns: PatternCache[list[Step]] = PatternCache(steps)
        self._last_values = self.operands  # what explain() describes: the last run's operands
        self.torch_in = False  # a compiled operand was a torch tensor (backend torch: dense results as tensors)
        self.run_stats: SparseRunStats | None = None  # the last run's per-device tuple bytes

    @property
    def blocks(self) -> dict[str, int | None]:
        """Block size per label of the last step (None: dense, inside the payload)."""
        lay = self.steps[-1].layout or self.steps[-1].ran
        return dict(lay.blocks) if lay is not None else {}

    @property
    def sparse_result(self) -> bool:
        """Whether the result is a SparseTensor: some sparse input has an output label (a product
        is 0 wherever that input has no entry)."""
        return any(isinstance(x, SparseTensor) and set(ls) & set(self.out_labels)
                   for x, ls in zip(self.operands, self.in_labels))

    def _what(self) -> str:
        return f"sparse einsum {self.equation!r}"

    def _check(self, operands: Sequence[Any]) -> tuple[SparseTensor | np.ndarray, ...]:
        if len(operands) != len(self.operands):
            raise ShapeError(f"{self._what()}: run got {len(operands)} operand(s), compiled with "
                             f"{len(self.operands)}")
        values = tuple(_operand(x, i, self._what()) for i, x in enumerate(operands))
        if self.broadcast is not None:  # an operand of the shape given at compile: squeezed as then
            shapes, keeps = self.broadcast
            values = tuple(drop_dims(v, k) if tuple(v.shape) == sh else v for v, sh, k in zip(values, shapes, keeps))
        for i, (new, old) in enumerate(zip(values, self.operands)):
            if tuple(new.shape) != tuple(old.shape) or isinstance(new, SparseTensor) != \
                    isinstance(old, SparseTensor):
                raise ShapeError(f"{self._what()}: operand {i} of shape {tuple(new.shape)} "
                                 f"({type(new).__name__}) where the plan has {tuple(old.shape)} "
                                 f"({type(old).__name__})")
            nd, od = np.dtype(new.dtype), np.dtype(old.dtype)
            # exact or refused: a narrower float computes in the plan's dtype unchanged
            if nd != od and not (nd.kind == od.kind == "f" and nd.itemsize <= self.dtype.itemsize):
                raise DTypeError(f"{self._what()}: operand {i} is {nd} where the plan was compiled "
                                 f"for {od} (computing in {self.dtype}); its values would change: "
                                 f"compile again for {nd}, or convert it first")
        return values

    @property
    def last_operands(self) -> tuple[SparseTensor | np.ndarray, ...]:
        """The operands of the last run (the compiled ones before any run)."""
        return tuple(self._last_values)

    def vjp(self, grad_out: Any, wrt: Sequence[int | str] | None = None
            ) -> tuple[SparseTensor | np.ndarray, ...]:
        """The gradient of each operand (or of those ``wrt`` names) at the last run's operands,
        given the result's gradient ``grad_out``: dense arrays for dense operands, SparseTensors
        on their stored entries for sparse ones (:func:`einjoin.sparse.grad.sparse_vjp`, which has
        the worked example)."""
        return GRAD["vjp"](self, grad_out, wrt)  # type: ignore[no-any-return]

    @property
    def last_run(self) -> str:
        """What the last run did with the plan: reused it, or replanned for a new pattern."""
        return self._patterns.last

    def run(self, *operands: Any, **named: Any) -> SparseTensor | np.ndarray | Any:
        """The result on the compiled operands, or on new ones of the same shapes and kinds: all
        by position, or some by name (``run(A=other)``; a dense operand i is ``x<i>``). On
        ``backend="torch"`` a dense result is a torch tensor when a torch tensor went in (at
        compile or here), sharing the result's memory, as the torch backend's runs do."""
        out = self._run(operands, named)
        if isinstance(out, np.ndarray) and getattr(self.distribution.backend, "name", None) == "torch" and (
                self.torch_in or any(_is_torch(x) for x in (*operands, *named.values()))):
            from einjoin.runtime.backends.torch_backend import to_tensor
            return to_tensor(out)[0]
        return out

    def _run(self, operands: tuple[Any, ...], named: dict[str, Any]) -> SparseTensor | np.ndarray:
        if operands or named:
            names = [_name(v, i) for i, v in enumerate(self.operands)]
            values = self._check(bind_operands(names, self.operands, operands, named, self._what()))
            self.steps = self._patterns.steps_for(
                pattern_of(values, self.in_labels), lambda: pattern_of(self.operands, self.in_labels),
                lambda: _path(self.in_labels, self.out_labels, _infos(values, self.in_labels, names),
                              self._pins, self._relational, self.agg, self._what(), self.engine.name),
                self._what())
        else:
            values = self.operands
            self.steps = self._patterns.compiled_run()
        self._last_values = tuple(values)
        out_shape = tuple(self.sizes[lab] for lab in self.out_labels)
        if 0 in self.sizes.values():  # nothing runs: no tuples held
            self.run_stats = SparseRunStats((0,) * self.distribution.devices, (), self.distribution.cap)
            if not self.sparse_result:
                return np.zeros(out_shape, self.dtype)
            return SparseTensor("out", out_shape, tuple(max(n, 1) for n in out_shape),
                                np.zeros((0, len(out_shape)), np.int64), np.zeros((0, *out_shape), self.dtype),
                                trusted=True)
        if len(values) > 1:  # any aggregation: max too meets absent zeros times inf (nan densified)
            self._refuse_non_finite(values)
        if self.engine.per_device is not None:  # each device's step on a connection of its own
            self.engine.spilled, self.engine.ranges = 0, 1
        elif self.engine.name == "duckdb":
            with DuckSession(self._what(), self.engine.memory, self.engine.temp_directory,
                             self.engine.threads) as session:
                out = self._run_steps(values, session)
                self.engine.spilled = session.spilled
                self.engine.ranges = session.ranges
                return out
        return self._run_steps(values, None)

    def _refuse_non_finite(self, values: Sequence[SparseTensor | np.ndarray]) -> None:
        """A sum (or max) of products meets absent entries (zeros) with the other operands' values: on the
        densified inputs 0 * inf is nan, but the executor skips absent tuples per entry and
        multiplies the zeros inside blocks, so the answer would depend on the block layout the data
        chooses: an inf or nan value is refused, by name."""
        for k, v in enumerate(values):
            if isinstance(v, SparseTensor):
                if v.all_finite():  # once per tensor (immutable), not a pass over its data every run
                    continue
                data = v.data
            else:
                data = v
            if not is_float(data.dtype) or not data.size:
                continue
            # one pass without a temporary; a sum that overflowed is checked element by element
            if np.isfinite(data.sum(dtype=np.float64)) or np.isfinite(data).all():
                continue
            raise EinjoinError(f"{self._what()}: operand {k} ({_name(v, k)}) holds inf or nan; absent entries "
                               f"of the sparse operands are zeros and 0 * inf is nan on the densified inputs, "
                               f"which a sparse product does not compute: replace the non-finite values "
                               f"(np.nan_to_num), or run the einsum on the densified inputs")

    def _run_steps(self, values: Sequence[SparseTensor | np.ndarray], session: DuckSession | None
                   ) -> SparseTensor | np.ndarray:
        results: list[SparseTensor | np.ndarray] = []
        for j, step in enumerate(self.steps):
            args = [values[k] if kind == "in" else results[k] for kind, k in step.refs]
            lay = step.layout
            if lay is None:
                infos = _infos(args, step.in_labels, [f"t{k}" if kind == "step" else _name(values[k], k)
                                                      for kind, k in step.refs])
                lay = choose_layout(infos, step.out_labels, _only(self._pins, infos),
                                    self._relational & _labels(infos), agg=self.agg, what=self._what(),
                                    engine=self.engine.name)
            step.ran = lay
            results.append(self._step(step, args, lay, j == len(self.steps) - 1, session))
        per_step = tuple(tuple(s.held or ()) for s in self.steps)
        n = self.distribution.devices
        self.run_stats = SparseRunStats(tuple(max((h[d] for h in per_step if d < len(h)), default=0) for d in range(n)),
                                        per_step, self.distribution.cap)
        return results[-1]

    def _step(self, step: Step, args: Sequence[SparseTensor | np.ndarray], lay: Layout, last: bool,
              session: DuckSession | None) -> SparseTensor | np.ndarray:
        out_shape = tuple(self.sizes[lab] for lab in step.out_labels)
        if session is not None:
            data, rkeys, counts = execute_duckdb(session, args, step.in_labels, step.out_labels, self.sizes,
                                                 lay, self.agg, self.dtype, self._what())
            out_bytes = data[0].nbytes + 8 * sum(lay.relational(lab) for lab in step.out_labels) if len(data) else 0
            step.held = [held_bytes(args, step.in_labels, step.out_labels, lay, self.sizes, 0)[0]
                         + len(data) * out_bytes]
        else:
            names = [f"t{k}" if kind == "step" else _name(self.operands[k], k) for kind, k in step.refs]
            data, rkeys, counts, step.exchange = self.distribution.execute(
                args, step.in_labels, step.out_labels, self.sizes, lay, self.agg, self.dtype, self._what(), names,
                self.engine.per_device)
            ex = step.exchange
            if self.engine.per_device is not None and ex is not None:  # the busiest step's spill, all devices
                self.engine.spilled = max(self.engine.spilled, sum(ex.spilled))
                self.engine.ranges = max(self.engine.ranges, ex.ranges)
            step.held = list(self.distribution.held)
        step.counts = counts
        block = tuple(lay.extent(lab, self.sizes[lab]) for lab in step.out_labels)
        if last:
            sparse_out = self.sparse_result
        else:  # an intermediate stays sparse where the same rule says so for its own inputs
            sparse_out = any(isinstance(a, SparseTensor) and set(ls) & set(step.out_labels)
                             for a, ls in zip(args, step.in_labels))
        if rkeys is None:
            if not sparse_out:
                return np.array(data[0][tuple(slice(0, n) for n in out_shape)])
            present = int(counts.joined > 0)  # no joined tuple: an empty relation
            return SparseTensor("out", out_shape, block, np.zeros((present, len(out_shape)), np.int64),
                                data[:present], trusted=True)
        full = np.zeros((len(rkeys), len(out_shape)), np.int64)
        full[:, [d for d, lab in enumerate(step.out_labels) if lay.relational(lab)]] = rkeys
        result = SparseTensor("out", out_shape, block, full, data, trusted=True)
        return result if sparse_out else result.todense()

    def notation(self) -> str:
        """Every step in upper-case-lower-case notation, ``; ``-separated (``?`` for a layout
        chosen only at run)."""
        return "; ".join(s.notation(lay) if (lay := s.layout or s.ran) is not None else
                         "?" for s in self.steps)

    def _kernel(self, lay: Layout) -> str:
        if self.engine.name == "memory":
            return KERNELS[lay.kernel]
        scalar = lay.payload == 1
        return ("in SQL: join, product and GROUP BY" if scalar else
                "in SQL: join, list arithmetic per tuple pair and GROUP BY")

    def explain(self) -> str:
        lines = [f"{self._what()} ({self.agg} of mul), result "
                 f"{'sparse' if self.sparse_result else 'dense'} "
                 f"{tuple(self.sizes[lab] for lab in self.out_labels)}, {len(self.steps)} step(s), "
                 f"{self.engine.describe()}, {self.distribution.describe([s.exchange for s in self.steps])}; "
                 f"last run: {self.last_run}"]
        for j, step in enumerate(self.steps):
            names = [f"t{k}" if kind == "step" else _name(self.operands[k], k) for kind, k in step.refs]
            lay = step.layout or step.ran
            eq = ",".join("".join(ls) for ls in step.in_labels) + "->" + "".join(step.out_labels)
            head = f"  t{j} = {eq} of {', '.join(names)}"
            if lay is None:
                lines.append(head + ": layout chosen at run, on the intermediate's pattern")
                continue
            keyed = [f"{lab}={b}" for lab, b in lay.blocks.items() if b is not None]
            dense = [lab for lab, b in lay.blocks.items() if b is None]
            lines.append(f"{head}: {step.notation(lay)}  blocks {' '.join(keyed) or '-'}"
                         + (f" ({', '.join(dense)} dense)" if dense else "")
                         + (" [chosen at run]" if step.layout is None else ""))
            for name, t, (kind, k) in zip(names, lay.tuples, step.refs):
                v = self._last_values[k] if kind == "in" else None
                if isinstance(v, SparseTensor) and step.infos is not None:
                    info = step.infos[step.refs.index((kind, k))]
                    hist = ", ".join(f"{b}:{n}" for b, n in histogram(info))
                    lines.append(f"    {name}: sparse {v.shape}, nnz {v.nnz}, {t} tuple(s) at these "
                                 f"blocks; block histogram (size:blocks) {hist}")
                else:
                    lines.append(f"    {name}: {t} tuple(s) at these blocks")
            actual = (f", actual {step.counts.joined} joined, {step.counts.out} output tuple(s)"
                      if step.counts is not None else " (run() for the actual counts)")
            lines.append(f"    joined tuples: estimated {lay.joined:.0f}{actual}; {lay.payload} "
                         f"multiply-adds per tuple, {self._kernel(lay)}"
                         f", cost {lay.cost:.3g}")
            if step.exchange is not None:
                lines.append(f"    devices: {step.exchange.describe()}")
            if step.held:
                cap = self.distribution.cap
                lines.append(f"    tuple bytes per device (inputs held + output): {step.held}"
                             + (f" of memory_limit {cap}" if cap is not None else ""))
        return "\n".join(lines)


def _name(v: SparseTensor | np.ndarray, i: int) -> str:
    return v.name if isinstance(v, SparseTensor) else f"x{i}"


@overload
def sparse_compile(equation: str, *operands: Any, agg: str | None = "sum", join: Literal["mul"] | None = None,
                   blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None,
                   engine: str = "memory", duckdb_memory: str | None = None,
                   duckdb_temp: str | None = None, duckdb_threads: int | None = None,
                   devices: int = 1, backend: Any = "threads", memory_limit: int | str | None = None
                   ) -> SparsePlan: ...


@overload
def sparse_compile(equation: str, *operands: Any, agg: str | None = "sum", join: Any = None,
                   blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None,
                   engine: str = "memory", duckdb_memory: str | None = None,
                   duckdb_temp: str | None = None, duckdb_threads: int | None = None,
                   devices: int = 1, backend: Any = "threads", memory_limit: int | str | None = None
                   ) -> SparsePlan | JoinPlan: ...


def sparse_compile(equation: str, *operands: Any, agg: str | None = "sum", join: Any = None,
                   blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None,
                   engine: str = "memory", duckdb_memory: str | None = None,
                   duckdb_temp: str | None = None, duckdb_threads: int | None = None,
                   devices: int = 1, backend: Any = "threads", memory_limit: int | str | None = None
                   ) -> SparsePlan | JoinPlan:
    """Compile an einsum over sparse and dense operands (a ``mul`` join; ``sum`` or ``max``
    aggregation). Another ``join`` (``"add"``, ``"relu"``, ``"exp"``, an expression of x0, x1,
    ...) gives an :class:`einjoin.sparse.joins.JoinPlan`: sparse over the union of the stored
    entries when the join is 0 at zeros and every operand is sparse over all labels, else dense.
    ``blocks={"j": 256}`` pins a label's block size (relational), ``relational=
    {"i"}`` keeps a label relational at a block size of the planner's choice. A sum over three
    or more operands runs as binary steps, the cheapest pair first.

    ``engine="memory"`` (the default) runs each step with numpy in this process;
    ``engine="duckdb"`` runs each step as one SQL query in DuckDB (``pip install
    'einjoin[duckdb]'``), under its ``memory_limit`` (``duckdb_memory="1GB"``; DuckDB's default,
    80% of RAM, when None), spilling to ``duckdb_temp`` (a temporary directory when None), on
    ``duckdb_threads`` threads (DuckDB's default when None). Both give the same result.

    ``devices=n`` splits each step's relations over n devices by the block keys of one label
    (range or hash, from the block histogram) and runs the parts on ``backend`` (``"threads"``,
    ``"sync"``, ``"ray"``, ``"torch"`` (CPU; a dense result a tensor when tensors went in) or such a
    backend object); see :mod:`einjoin.sparse.distribute`. With ``engine="duckdb"`` each device
    runs its part on a DuckDB connection of its own, with ``memory_limit / devices`` (and
    ``cores // devices`` threads when ``duckdb_threads`` is None) and its own temp directory
    (``duckdb_temp``/device<d>).

    ``memory_limit`` (bytes or ``"2GiB"``; engine memory, per device): a step whose tuples on some
    device (its input tuples plus a bound of its output tuples) would exceed it is refused at run
    with an EinjoinError naming the device and the bytes, never overrun; ``plan.run_stats`` has
    each device's peak tuple bytes of the last run (on either engine)."""
    what = f"sparse einsum {equation!r}"
    if not operands:
        raise EinjoinError(f"{what}: needs at least one operand")
    eng = _engine(engine, duckdb_memory, duckdb_temp, duckdb_threads, what)
    dist = distribution(devices, backend, what)
    if memory_limit is not None and eng.name != "memory":
        raise EinjoinError(f"{what}: memory_limit= caps engine='memory'; DuckDB's is duckdb_memory= (it spills)")
    dist.cap = parse_bytes(memory_limit)
    if dist.devices > 1 and eng.name == "duckdb":  # a connection per device, each with its share
        eng.per_device = device_settings(what, eng.memory, eng.temp_directory, eng.threads, dist.devices)
    values = [_operand(x, i, what) for i, x in enumerate(operands)]
    # numpy's broadcasting of size-1 dims, as ej.einsum: squeezed here, and at each run (_check)
    given = [tuple(v.shape) for v in values]
    squeezed = size1_squeeze(equation, given)
    if squeezed is not None:
        equation, keeps = squeezed
        values = [drop_dims(v, k) for v, k in zip(values, keeps)]
    if not any(isinstance(v, SparseTensor) for v in values):
        raise EinjoinError(f"{what}: no sparse operand (use ej.sparse(name, data), or ej.einsum on "
                           f"lazy tensors for dense programs)")
    # a join other than the product: einjoin.sparse.joins (a union of stored entries, or dense)
    expr = parse_join("mul" if len(values) > 1 else "x0", len(values)) if join in (None, "mul") else \
        parse_join(join, len(values))
    product = is_product(expr, len(values)) or (len(values) == 1 and is_identity(expr))
    # None is no aggregation, as in the dense einsum (the IR check below refuses summed labels)
    agg_name = "none" if agg is None else getattr(agg, "name", agg)
    if agg_name not in AGGS + ("none",):
        raise UnsupportedOpError(f"{what}: aggregation {agg_name!r}; sparse einsums support "
                                 f"{', '.join(AGGS)}")
    in_labels, out_labels = parse_equation(equation, [tuple(v.shape) for v in values])
    names = [_name(v, i) for i, v in enumerate(values)]
    nodes = [ops.input_node(f"{n}#{i}", tuple(v.shape), np.dtype(v.dtype).name)
             for i, (n, v) in enumerate(zip(names, values))]
    # the IR's own checks (labels vs shapes, output labels), with the dense einsum's messages
    ops.einsum_node(nodes, in_labels, out_labels, expr if not product else "mul" if len(values) > 1 else "x0",
                    agg_name)
    for ls, n in zip(in_labels, names):
        if len(set(ls)) != len(ls):
            raise UnsupportedOpError(f"{what}: operand {n!r} repeats a label ({''.join(ls)!r}: "
                                     f"diagonals of sparse operands are not supported)")
    if not product:
        return JoinPlan(equation, values, in_labels, tuple(out_labels), expr, agg_name, dict(
            blocks=blocks, relational=relational, engine=engine, duckdb_memory=duckdb_memory,
            duckdb_temp=duckdb_temp, duckdb_threads=duckdb_threads, devices=devices, backend=backend,
            memory_limit=memory_limit), what, keeps=None if squeezed is None else squeezed[1],
            compile=sparse_compile, operand=_operand)
    sizes: dict[str, int] = {}
    for ls, v in zip(in_labels, values):
        sizes.update(zip(ls, v.shape))
    if not set(sizes) - set(out_labels):
        agg_name = "sum"  # nothing aggregated: every output key has one tuple
    dtype = result_dtype([np.dtype(v.dtype) for v in values])
    infos = _infos(values, in_labels, names)
    pins, rel = dict(blocks or {}), set(relational or ())
    # pins are checked once against the whole equation (each step sees its own labels' pins)
    _check_pins(pins, rel, sizes, what)
    steps = _path(in_labels, tuple(out_labels), infos, pins, rel, agg_name, what, eng.name)
    plan = SparsePlan(equation, values, tuple(in_labels), tuple(out_labels), sizes, agg_name, dtype,
                      steps, pins, rel, eng, dist)
    if squeezed is not None:
        plan.broadcast = (tuple(given), tuple(squeezed[1]))
    plan.torch_in = any(_is_torch(x) for x in operands)
    return plan


def _is_torch(x: Any) -> bool:
    """A torch tensor (dense or sparse) given as an operand."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


@dataclass
class Engine:
    """Which executor runs the steps, and DuckDB's settings."""

    name: str = "memory"
    memory: str | None = None
    temp_directory: str | None = None
    threads: int | None = None
    spilled: int = 0  # DuckDB temp-directory bytes at the end of the last run's busiest step
    ranges: int = 1  # the most output-key ranges (one query each) of a step in the last run
    # on several devices: each device's connection settings (its share of memory_limit and cores)
    per_device: list[DuckDevice] | None = None

    def describe(self) -> str:
        if self.name == "memory":
            return "engine memory"
        share = (f", a connection per device with {self.per_device[0].memory_limit} and "
                 f"{self.per_device[0].threads} thread(s) each" if self.per_device else "")
        return (f"engine duckdb (memory_limit {self.memory or 'default'}{share}"
                + (f", last run spilled {self.spilled / 2 ** 20:.1f} MiB" if self.spilled else "")
                + (f", output keys in {self.ranges} ranges" if self.ranges > 1 else "") + ")")


ENGINES = ("memory", "duckdb")


def _engine(name: str, memory: str | None, temp: str | None, threads: int | None, what: str) -> Engine:
    if name not in ENGINES:
        raise UnsupportedOpError(f"{what}: engine {name!r}; sparse einsums run on {', '.join(ENGINES)}")
    if name == "memory" and (memory, temp, threads) != (None, None, None):
        raise EinjoinError(f"{what}: duckdb_memory / duckdb_temp / duckdb_threads are settings of "
                           f"engine='duckdb', not of engine='memory'")
    if threads is not None and (not isinstance(threads, (int, np.integer)) or isinstance(threads, bool)
                                or threads < 1):
        raise EinjoinError(f"{what}: duckdb_threads={threads!r} (an integer >= 1, or None for DuckDB's default)")
    if name == "duckdb":
        require_duckdb(what)  # a missing package is named at compile, not at the first run
    return Engine(name, memory, temp, threads)


def result_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The result's dtype: numpy's promotion, bool as float32; with a float16 / bfloat16 operand
    torch's (an integer with a half gives the half, float16 with bfloat16 float32), which numpy
    cannot promote (ml_dtypes' bfloat16) or widens (int64 with float16 is float64 there)."""
    if not any(half(d) for d in dtypes):
        dt = np.result_type(*dtypes)
        return np.dtype(np.float32) if dt.kind == "b" else dt
    floats = {d for d in dtypes if is_float(d)}
    if len(floats) == 1:
        return floats.pop()
    return max((d for d in floats if not half(d)), key=lambda d: d.itemsize, default=np.dtype(np.float32))


def _check_pins(pins: Mapping[str, int], relational: set[str], sizes: Mapping[str, int], what: str
                ) -> None:
    for lab in list(pins) + sorted(relational):
        if lab not in sizes:
            raise EinjoinError(f"{what}: pinned label {lab!r} is not one of its labels "
                               f"{''.join(sizes)!r}")
    for lab, b in pins.items():
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise PartitionError(f"{what}: block size {b!r} for label {lab!r} (size {sizes[lab]}) "
                                 f"must be an integer >= 1")


def sparse_einsum(equation: str, *operands: Any, join: Any = None, agg: str | None = "sum",
                  blocks: Mapping[str, int] | None = None, relational: Sequence[str] | None = None,
                  devices: int = 1, backend: Any = "threads") -> SparseTensor | np.ndarray | Node:
    """Compile and run once: what ``ej.einsum`` does when an operand is a SparseTensor. With
    lazy einjoin operands (and no devices, blocks or relational pins) it builds a graph node
    instead (:func:`einjoin.sparse.node.lazy_einsum`), which the frontend wraps as a Tensor."""
    lazy = any(isinstance(getattr(x, "node", x), Node) for x in operands)
    if lazy and devices == 1 and blocks is None and relational is None:
        node: Node = LAZY["einsum"](equation, operands, join=join, agg=agg)
        return node
    out: SparseTensor | np.ndarray = sparse_compile(equation, *operands, agg=agg, join=join, blocks=blocks,
                                                    relational=relational, devices=devices, backend=backend).run()
    return out


EINSUM["sparse_einsum"] = sparse_einsum
