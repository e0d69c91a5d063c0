"""Evaluating join expressions over numpy arrays (:func:`evaluate`), the kernels' inner loop: an
expression compiles once into straight-line steps over value slots (equal sub-expressions
computed once), and float temporaries this evaluation allocated are reused in place where that
gives the same numbers; hot functions have in-place forms (sigmoid and silu as torch computes
them, ``where`` on floats as a bit mask).

>>> from einjoin.ir.scalar import parse_join
>>> evaluate(parse_join("x0 * x0 + 1", 1), [np.arange(3.0)])
array([1., 2., 5.])
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from einjoin.ir.scalar import FUNCTIONS, Arg, Call, Const, Expr, Number, _erf, _eval_consts, _expit

__all__ = ["evaluate", "quiet_floats", "QUIET_FLOATS"]

# per thread: ``on`` inside quiet_floats(), whose np.errstate covers every evaluation there
QUIET_FLOATS = threading.local()


@contextlib.contextmanager
def quiet_floats() -> Iterator[None]:
    """``np.errstate(all="ignore")`` for this thread, marked in :data:`QUIET_FLOATS` so that
    :func:`evaluate` does not enter it again on every call (~2 us each; a local backend's
    worker holds it for a whole run, over hundreds of small kernels).

    >>> with quiet_floats():
    ...     QUIET_FLOATS.on, float(np.float32(1.0) / np.float32(0.0))
    (True, inf)
    """
    was = getattr(QUIET_FLOATS, "on", False)
    with np.errstate(all="ignore"):
        QUIET_FLOATS.on = True
        try:
            yield
        finally:
            QUIET_FLOATS.on = was


def evaluate(expr: Expr, args: Sequence[np.ndarray]) -> np.ndarray | Number:
    """Evaluate ``expr`` elementwise over numpy arrays that broadcast together. An expression of
    constants only gives a Python number (a weak scalar: numpy keeps the array dtype it meets).
    A sub-expression that occurs several times (``tanh(u)`` in ``tanh``'s derivative
    ``1 - tanh(u) * tanh(u)``, also as equal but distinct objects) is computed once; a float
    temporary this evaluation allocated is overwritten in place by the next function that
    consumes it for the last time when that gives the same dtype and shape (the same numbers
    as a fresh array, one pass less over new memory).

    >>> from einjoin.ir.scalar import parse_join
    >>> evaluate(parse_join("exp(x0) * 2.0 + exp(x0)", 1), [np.zeros(3, np.float32)])
    array([3., 3., 3.], dtype=float32)
    """
    if isinstance(expr, Arg):
        return args[expr.index]
    if isinstance(expr, Const):
        return expr.value
    out: np.ndarray | Number = _compiled(expr).run(args)
    return out


# in-place forms of FUNCTIONS' implementations, keyed by the implementation object (a function
# replaced in FUNCTIONS, as a test's counting wrapper, is called as it is): (args, out or None)
# -> the value, computing exactly what the implementation computes
_Fast = Callable[[list[Any], "np.ndarray | None"], np.ndarray]


def _ufunc_form(u: Any) -> _Fast:
    def run(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
        r: np.ndarray = u(*xs) if out is None else u(*xs, out=out)
        return r
    _RAW[run] = u
    return run


# the ufunc each _ufunc_form calls: a Replay calls it directly (one Python frame less per step)
_RAW: dict[Any, Any] = {}


def _rsqrt_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    t: np.ndarray = np.sqrt(xs[0], out=out)
    r: np.ndarray = np.divide(1.0, t, out=t) if type(t) is np.ndarray else 1.0 / t
    return r


def _reciprocal_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    r: np.ndarray = np.divide(1.0, xs[0], out=out) if out is not None else 1.0 / xs[0]
    return r


def _sigmoid_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    # 1 / (1 + exp(-x)), torch's formula, in place: numpy's exp is vectorised, scipy's expit
    # is not (2.4x slower); the same value at every element whatever the array's extent
    x = xs[0]
    if type(x) is not np.ndarray or x.dtype not in _EXP_DTYPES:
        r: np.ndarray = _expit(x, out)
        return r
    if x.ndim == 0:  # numpy scalars come back: no buffer to work in
        return 1.0 / (1.0 + np.exp(-x))
    t: np.ndarray = np.negative(x, out=out)
    np.exp(t, out=t)
    np.add(t, 1.0, out=t)
    return np.divide(1.0, t, out=t)  # type: ignore[no-any-return]


def _silu_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    # x / (1 + exp(-x)), torch's formula (x * expit(x) before: scipy's expit is not vectorised);
    # a float numpy scalar (a 0-d result comes back as one) by the same formula, as scalar.py's
    # silu computes it: fused and unfused graphs give the same bits (issue 22)
    x = xs[0]
    if isinstance(x, np.floating) and x.dtype in _EXP_DTYPES:
        return x / (1.0 + np.exp(-x))  # type: ignore[no-any-return]
    if type(x) is not np.ndarray or x.dtype not in _EXP_DTYPES:
        s = _expit(x)
        if type(s) is not np.ndarray:
            return x * s  # type: ignore[no-any-return]
        r: np.ndarray = np.multiply(x, s, out=s)  # x * sigmoid(x), into the fresh sigmoid
        return r
    if x.ndim == 0:  # numpy scalars come back: no buffer to work in
        return x / (1.0 + np.exp(-x))
    t: np.ndarray = np.negative(x)  # fresh: x is read again by the division
    np.exp(t, out=t)
    np.add(t, 1.0, out=t)
    return np.divide(x, t, out=t)  # type: ignore[no-any-return]


_EXP_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _pow_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    # x ** 2 and x ** 3 of float32/64 (RMSNorm's and its gradient's) as products, as torch
    # computes them (its CPU pow kernel: x * x, x * x * x): numpy's float32 power calls powf per
    # element (1024 elements: 68 us; the products 1 us); numpy scalars (a 0-d chain's values)
    # alike, so a fused and an unfused graph give the same bits
    x, c = xs
    if type(c) in (int, float) and (c == 2 or c == 3) and isinstance(x, (np.ndarray, np.floating)) \
            and x.dtype in _EXP_DTYPES:
        if type(x) is not np.ndarray or x.ndim == 0:
            return x * x if c == 2 else x * x * x
        if c == 2:
            return np.multiply(x, x, out=out)
        t: np.ndarray = np.multiply(x, x, out=None if out is x else out)
        return np.multiply(t, x, out=t)  # type: ignore[no-any-return]
    r: np.ndarray = np.power(x, c) if out is None else np.power(x, c, out=out)
    return r
_BITS: dict[Any, Any] = {np.dtype(np.float32): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.int64)}


def _where_form(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
    """``where(c, a, b)`` on floats as a bit mask: each element's bits are a's or b's, the same
    numbers as ``np.where`` (which branches per element: ~12x slower on a data-dependent mask,
    as relu's or max's gradient is)."""
    c, a, b = xs
    if type(c) is not np.ndarray or c.dtype != np.bool_ or not all(type(v) in (np.ndarray, float, int) for v in (a, b)):
        return np.where(c, a, b)  # type: ignore[no-any-return]
    arrays = [v for v in (a, b) if type(v) is np.ndarray]
    dt = np.result_type(a, b) if arrays else None
    itype = _BITS.get(dt) if dt is not None else None
    if itype is None or any(v.dtype != dt for v in arrays):
        return np.where(c, a, b)  # type: ignore[no-any-return]
    assert dt is not None
    shape = np.broadcast_shapes(c.shape, np.shape(a), np.shape(b))
    if not shape or 0 in shape:
        return np.where(c, a, b)  # type: ignore[no-any-return]

    def bits(v: Any) -> np.ndarray:
        r: np.ndarray = (v if type(v) is np.ndarray else np.array(v, dt)).view(itype)
        return r

    m = np.empty(shape, itype)
    np.copyto(m, c, casting="unsafe")  # 1 where c, else 0
    if type(a) is not np.ndarray and not bits(a).any():  # where(c, 0.0, b): b's bits or none
        np.subtract(m, 1, out=m)
        np.bitwise_and(bits(b), m, out=m)
    elif type(b) is not np.ndarray and not bits(b).any():  # where(c, a, 0.0)
        np.negative(m, out=m)
        np.bitwise_and(bits(a), m, out=m)
    else:
        np.negative(m, out=m)  # all ones where c
        picked = np.bitwise_and(bits(a), m)
        np.invert(m, out=m)
        np.bitwise_and(bits(b), m, out=m)
        m = np.bitwise_or(picked, m, out=picked)
    r: np.ndarray = m.view(dt)
    return r
_FAST: dict[Any, _Fast] = {FUNCTIONS[name].impl: _ufunc_form(u) for name, u in [
    ("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.true_divide),
    ("max", np.maximum), ("min", np.minimum), ("neg", np.negative), ("abs", np.abs),
    ("exp", np.exp), ("log", np.log), ("log1p", np.log1p), ("expm1", np.expm1), ("sqrt", np.sqrt),
    ("tanh", np.tanh), ("erf", _erf),
    ("sin", np.sin), ("cos", np.cos)]}
_FAST[FUNCTIONS["sigmoid"].impl] = _sigmoid_form
_FAST[FUNCTIONS["pow"].impl] = _pow_form
_FAST[FUNCTIONS["where"].impl] = _where_form
_FAST[FUNCTIONS["rsqrt"].impl] = _rsqrt_form
_FAST[FUNCTIONS["reciprocal"].impl] = _reciprocal_form
_FAST[FUNCTIONS["silu"].impl] = _silu_form
# IEEE addition and multiplication are commutative (the same result for a + b and b + a, in
# numpy's type promotion too); max and min are not (max(-0.0, 0.0) is the first argument)
_COMMUTATIVE = frozenset({"add", "mul"})
_WEAK = (int, float, bool)  # Python scalars: numpy keeps the array dtype they meet


def _fits(t: Any, xs: list[Any]) -> bool:
    """Whether a function of ``xs`` gives exactly ``t``'s dtype and shape (so writing into ``t``
    changes no number): a float array, every other argument of its dtype broadcasting into it,
    or a Python scalar."""
    if type(t) is not np.ndarray or t.dtype.kind != "f":
        return False
    for x in xs:
        if x is t or type(x) in _WEAK:
            continue
        if type(x) is not np.ndarray or x.dtype != t.dtype or x.ndim > t.ndim:
            return False
        if any(a != b and a != 1 for a, b in zip(x.shape[::-1], t.shape[::-1])):
            return False
    return True


class SlotProgram:
    """An expression as straight-line steps over value slots, one slot per distinct leaf or call
    (equal sub-expressions share one; constants are told apart by type and sign, so
    ``where(c, 1, 0)`` and ``where(c, 1.0, 0.0)`` stay two), each step knowing which
    computed slots it reads for the last time."""

    def __init__(self, expr: Expr):
        self.leaves: list[tuple[int, bool, Any]] = []  # (slot, is an argument, its index or the constant)
        steps: list[tuple[int, str, tuple[int, ...]]] = []  # (slot, function, argument slots)
        index: dict[tuple[Any, ...], int] = {}

        def slot(e: Expr) -> int:
            if isinstance(e, Arg):
                key: tuple[Any, ...] = ("a", e.index)
            elif isinstance(e, Const):
                key = ("c", type(e.value).__name__, repr(e.value))
            else:
                key = ("f", e.fn, tuple(slot(a) for a in e.args))
                swapped = ("f", e.fn, key[2][::-1])
                if e.fn in _COMMUTATIVE and key not in index and swapped in index:
                    # b * a where a * b was computed: that value, exactly the same numbers
                    # (RMSNorm's gradient has ``g * x + x * g``, a full-size product twice)
                    key = swapped
            got = index.get(key)
            if got is None:
                got = index[key] = len(index)
                if isinstance(e, Call):
                    steps.append((got, e.fn, key[2]))
                else:
                    self.leaves.append((got, isinstance(e, Arg), e.index if isinstance(e, Arg) else e.value))
            return got

        self.result = slot(expr)
        self.size = len(index)
        computed = {s for s, _, _ in steps}
        last: dict[int, int] = {}
        for i, (_, _, args) in enumerate(steps):
            for x in args:
                last[x] = i
        self.steps = [(s, fn, args, tuple(sorted({x for x in args if x in computed and last[x] == i})))
                      for i, (s, fn, args) in enumerate(steps)]

    def run(self, args: Sequence[Any]) -> Any:
        vals: list[Any] = [None] * self.size
        for s, is_arg, v in self.leaves:
            vals[s] = args[v] if is_arg else v
        if getattr(QUIET_FLOATS, "on", False):
            return self._steps(vals)
        with np.errstate(all="ignore"):
            return self._steps(vals)

    def _steps(self, vals: list[Any], trace: list[tuple[int, int, Any, int, bool]] | None = None) -> Any:
        # trace: each step's decisions for a Replay, (slot, how, function, the slot written into
        # or -1, whether the value is an array of >= 1 dim); how: 0 constants, 1 in-place form,
        # 2 the implementation
        owned: set[int] = set()  # slots holding arrays this evaluation allocated
        for s, fn, a, dying in self.steps:
            f = FUNCTIONS[fn]
            xs = [vals[i] for i in a]
            if all(isinstance(x, _WEAK) for x in xs):  # constants only: Python numbers
                vals[s] = _eval_consts(f, xs)
                if trace is not None:
                    trace.append((s, 0, None, -1, False))
                continue
            fast = _FAST.get(f.impl)
            if fast is None:
                vals[s] = f.impl(*xs)
                if trace is not None:
                    trace.append((s, 2, f.impl, -1, _array(vals[s])))
                continue
            out, o = None, -1
            for i in dying:
                if i in owned and _fits(vals[i], xs):
                    out, o = vals[i], i
                    break
            vals[s] = fast(xs, out)
            if trace is not None:
                trace.append((s, 1, fast, o, _array(vals[s])))
            owned.add(s)
            for i in dying:  # nothing later reads it: its memory goes back now
                if i != s:
                    vals[i] = None
        return vals[self.result]

    def replay(self) -> Replay:
        """This program for arguments of one fixed set of types, shapes and dtypes (a task's
        blocks): see :class:`Replay`."""
        return Replay(self)


class Replay:
    """A :class:`SlotProgram` for arguments whose types, shapes and dtypes never change (a task's
    blocks, checked by its prepared kernel): the first call evaluates as
    :meth:`SlotProgram.run` does and records each step's decisions (which function, which dying
    temporary it writes into, constants folded); later calls replay them -- the same numpy calls
    with the same ``out=`` buffers, so the same bits -- without the per-step lookups and checks
    (~1 us a step). Only where those decisions cannot depend on values: every argument and
    every computed value a numpy array of at least one dimension (a 0-d computation gives numpy
    scalars, which count as Python numbers); otherwise every call is :meth:`SlotProgram.run`'s.
    The caller holds numpy's errstate (as :func:`einjoin.plan.execute.compute` does).

    >>> from einjoin.ir.scalar import parse_join
    >>> r = SlotProgram(parse_join("exp(x0) * 2.0 + 1.0", 1)).replay()
    >>> x = np.zeros(3, np.float32)
    >>> r([x]), r([x])  # recorded, then replayed
    (array([3., 3., 3.], dtype=float32), array([3., 3., 3.], dtype=float32))
    """

    def __init__(self, prog: SlotProgram):
        self.prog = prog
        self.result = prog.result
        self.fixed = False  # True once recorded, False again never: a failed record runs generically
        self.generic = False
        # what a call runs: the record, then the replay (one ufunc of the arguments: that call)
        self.run: Callable[[Sequence[Any]], Any] = self._record
        self.base: list[Any] = []
        self.args: tuple[tuple[int, int], ...] = ()
        # (slot, raw ufunc or None, in-place form or implementation, argument slots, out slot, slots freed)
        self.steps: tuple[tuple[int, Any, Any, tuple[int, ...], int, tuple[int, ...]], ...] = ()

    def __call__(self, args: Sequence[Any]) -> Any:
        return self.run(args)

    def _replay(self, args: Sequence[Any]) -> Any:
        vals = self.base.copy()
        for s, i in self.args:
            vals[s] = args[i]
        for s, u, fn, a, o, free in self.steps:
            xs = [vals[i] for i in a]
            if u is not None:  # a numpy ufunc, called as its in-place form calls it
                vals[s] = u(*xs) if o < 0 else u(*xs, out=vals[o])
            else:
                vals[s] = fn(xs, vals[o] if o >= 0 else None)
            for i in free:
                vals[i] = None
        return vals[self.result]

    def _record(self, args: Sequence[Any]) -> Any:
        prog = self.prog
        vals: list[Any] = [None] * prog.size
        for s, is_arg, v in prog.leaves:
            vals[s] = args[v] if is_arg else v
        if self.generic:
            return prog._steps(vals)
        trace: list[tuple[int, int, Any, int, bool]] = []
        snapshot = vals.copy()
        out = prog._steps(vals, trace)
        self._fix(trace, snapshot)
        return out

    def _fix(self, trace: list[tuple[int, int, Any, int, bool]], vals: list[Any]) -> None:
        """The replay of one recorded evaluation (``vals``: the slots before it), or generic."""
        prog = self.prog
        arg_slots = {s for s, is_arg, _ in prog.leaves if is_arg}
        if not all(type(vals[s]) is np.ndarray and vals[s].ndim > 0 for s in arg_slots):
            self.generic = True
            return
        static = {s for s, is_arg, _ in prog.leaves if not is_arg}  # slots known without the arguments
        base: list[Any] = [None if s in arg_slots else vals[s] for s in range(prog.size)]
        steps: list[tuple[int, Any, Any, tuple[int, ...], int, tuple[int, ...]]] = []
        for (s, fn, a, dying), (_, how, f, o, array) in zip(prog.steps, trace):
            if how == 0:  # constants only: folded now, if they are the program's own constants
                if not all(i in static for i in a):
                    self.generic = True  # a numpy scalar computed from the arguments
                    return
                base[s] = _eval_consts(FUNCTIONS[fn], [base[i] for i in a])
                static.add(s)
            elif not array:  # a numpy scalar or another type: later steps may decide otherwise
                self.generic = True
                return
            elif how == 2:
                steps.append((s, None, _star(f), a, -1, ()))
            else:
                steps.append((s, _RAW.get(f), f, a, o, tuple(i for i in dying if i != s)))
        self.base = base
        self.args = tuple((s, v) for s, is_arg, v in prog.leaves if is_arg)
        self.steps = tuple(steps)
        self.fixed = True
        self.run = self._one() or self._replay

    def _one(self) -> Callable[[Sequence[Any]], Any] | None:
        """One ufunc of arguments and constants (most unfused elementwise tasks): that call."""
        if len(self.steps) != 1 or self.steps[0][1] is None:
            return None
        _, u, _, a, _, _ = self.steps[0]
        where = dict(self.args)  # slot -> argument index
        if len(a) == 1 and a[0] in where:
            i = where[a[0]]
            return lambda args: u(args[i])
        if len(a) != 2:
            return None
        x, y = a
        if x in where and y in where:
            i, j = where[x], where[y]
            return lambda args: u(args[i], args[j])
        if x in where:
            i, c = where[x], self.base[y]
            return lambda args: u(args[i], c)
        if y in where:
            j, c = where[y], self.base[x]
            return lambda args: u(c, args[j])
        return None


def _array(v: Any) -> bool:
    return type(v) is np.ndarray and v.ndim > 0


def _star(impl: Any) -> _Fast:
    def run(xs: list[Any], out: np.ndarray | None) -> np.ndarray:
        r: np.ndarray = impl(*xs)
        return r
    return run


_COMPILED: dict[int, tuple[Expr, SlotProgram]] = {}


def _compiled(expr: Expr) -> SlotProgram:
    # keyed by identity (an op keeps its join alive), checked, since an id can be reused
    hit = _COMPILED.get(id(expr))
    if hit is not None and hit[0] is expr:
        return hit[1]
    if len(_COMPILED) > 4096:
        _COMPILED.clear()
    c = SlotProgram(expr)
    _COMPILED[id(expr)] = (expr, c)
    return c
