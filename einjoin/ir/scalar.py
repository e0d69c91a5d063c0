"""Scalar join expressions: the function an einsum applies to each joined tuple of elements.

An expression is plain, hashable data: :class:`Arg` (the i-th input's element), :class:`Const`
and :class:`Call` of a function from :data:`FUNCTIONS`. The function table is data too — arity,
the dtype rule, the numpy implementation and how it prints.

>>> from einjoin.ir.scalar import parse_join, infer_dtype
>>> e = parse_join("exp(x0 - x1)", 2)
>>> print(e, infer_dtype(e, ("float32", "float32")))
exp(x0 - x1) float32
>>> print(parse_join("mul", 3))
x0 * x1 * x2
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ExpressionError
from einjoin.ir.dtypes import kind, numpy_dtype, promote

__all__ = ["Arg", "Const", "Call", "Expr", "ScalarFn", "FUNCTIONS", "MAX_DEPTH", "parse_join",
           "infer_dtype", "const_value", "is_product", "is_identity", "num_args", "substitute"]


@dataclass(frozen=True)
class Arg:
    index: int

    def __str__(self) -> str:
        return f"x{self.index}"


@dataclass(frozen=True)
class Const:
    value: float | int | bool

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Call:
    """``fn(*args)``. Its hash and nesting depth are computed once, at construction, from its
    arguments' (so hashing a deep expression does not recurse); ``depth`` is 1 + the deepest
    argument's (an Arg or a Const counts 0). Equality is structural, as a dataclass's."""

    fn: str
    args: tuple[Expr, ...]
    _hash: int = field(init=False, repr=False, compare=False)
    depth: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # frozen: set the cached fields past the dataclass's __setattr__; an argument that is not
        # an Expr (a hand-built bad tree) gets depth 1 and is refused by parse_join's check
        try:
            h = hash((self.fn, self.args))
        except TypeError:  # args not a tuple of Exprs: parse_join's check refuses it
            h = 0
        object.__setattr__(self, "_hash", h)
        object.__setattr__(self, "depth", 1 + max(
            (a.depth if isinstance(a, Call) else 0 for a in self.args), default=0)
            if isinstance(self.args, tuple) else 1)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Call):
            return NotImplemented
        return self._hash == other._hash and self.fn == other.fn and self.args == other.args

    def __reduce__(self) -> tuple[type, tuple[str, tuple[Expr, ...]]]:
        return Call, (self.fn, self.args)  # str hashes differ between processes: recompute

    def __str__(self) -> str:
        f = FUNCTIONS[self.fn]
        if f.infix is not None:
            # the left operand of a left-associative op needs no parentheses at equal precedence;
            # that of ** needs them around any infix op and around a negation (-x ** y is -(x ** y));
            # comparisons chain in Python (a < b < c is not (a < b) < c), so they always need them
            left_prec = 9 if self.fn == "pow" else f.precedence - (f.rule != "compare")
            left = _paren(self.args[0], left_prec)
            return f"{left} {f.infix} {_paren(self.args[1], f.precedence)}"
        if self.fn == "neg" and not isinstance(self.args[0], Const):  # "-1.0" would parse as a Const
            return "-" + _paren(self.args[0], 9)
        return f"{self.fn}({', '.join(str(a) for a in self.args)})"


Expr = Arg | Const | Call


def _paren(e: Expr, prec: int) -> str:
    if isinstance(e, Call):
        f = FUNCTIONS[e.fn]
        if (f.infix is not None and f.precedence <= prec) or (e.fn == "neg" and prec >= 9):
            return f"({e})"
    if isinstance(e, Const) and str(e).startswith("-"):  # -0.0 included
        return f"({e})"
    return str(e)


@dataclass(frozen=True)
class ScalarFn:
    """One scalar function. ``rule`` is its dtype rule:

    - ``arith``: numeric args of one kind, result their promoted dtype;
    - ``float``: float args only, result their promoted dtype;
    - ``compare``: numeric args of one kind, result bool;
    - ``logical``: bool args, result bool;
    - ``select``: ``where(cond, a, b)``, bool cond, result the promotion of a and b;
    - ``bits``: integer or bool args of one kind, result their promoted dtype (bitwise ops).
    """

    name: str
    arity: int
    rule: str
    impl: Callable[..., np.ndarray]
    infix: str | None = None
    precedence: int = 10


def _erf(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    # scipy.special costs ~0.5 s to import: imported on first use, not with einjoin
    from scipy.special import erf
    r: np.ndarray = erf(x) if out is None else erf(x, out=out)
    return r


def _expit(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    from scipy.special import expit
    r: np.ndarray = expit(x) if out is None else expit(x, out=out)
    return r


def _gelu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    return out


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = _expit(x)
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    # x / (1 + exp(-x)), torch's formula, on float32/float64 (arrays and numpy scalars alike:
    # the evaluator's in-place form computes the same, so a 0-d value that came back as a numpy
    # scalar gets the bits an array gets); x * expit(x) on other dtypes
    if getattr(x, "dtype", None) in (np.dtype(np.float32), np.dtype(np.float64)):
        out: np.ndarray = x / (1.0 + np.exp(-x))
        return out
    out = x * _expit(x)
    return out


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out: np.ndarray = np.true_divide(a, b)
    return out


def _safe(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    # Floating-point edge cases (log 0, 0/0) give inf/nan as IEEE says, without warnings.
    def run(*a: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            out = fn(*a)
        return out
    run.__name__ = getattr(fn, "__name__", "fn")
    return run


def _py_int_pow(a: int, b: int) -> int:
    if b >= 0:
        out: int = int(a) ** int(b)
        return out
    return 1 if a == 1 else (-1 if b % 2 else 1) if a == -1 else 0


def _int_pow(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer powers in the integers, wrapping on overflow as torch does (a float64 detour is
    exact only below 2**53); a negative exponent gives 0 except for bases 1 and -1 (torch's
    rule for tensor exponents)."""
    # the dtype numpy gives the arguments as they come: a Python-int constant (x ** 2, 2 ** x in
    # a fused join) is weak, so an int32 chain goes on (and wraps) in int32 as unfused
    dt = np.result_type(a, b)
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype == object:  # Python ints (constants): exact, the same rule
        exact: np.ndarray = np.frompyfunc(_py_int_pow, 2, 1)(a, b)
        return exact
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        with np.errstate(all="ignore"):
            power: np.ndarray = np.power(a, b)
        return power if power.dtype == dt else power.astype(dt)
    neg = b < 0
    with np.errstate(all="ignore"):
        out: np.ndarray = np.power(a, np.where(neg, 0, b))
    if np.any(neg):
        odd = (b % 2) != 0
        small = np.where(a == 1, 1, np.where(a == -1, np.where(odd, -1, 1), 0)).astype(out.dtype)
        out = np.where(neg, small, out)
    return out if out.dtype == dt else out.astype(dt)


def _int_division(np_fn: Callable[..., np.ndarray], what: str) -> Callable[..., np.ndarray]:
    """Floor division or remainder with Python's and torch's signs (numpy's floor_divide and
    remainder); an integer divisor of 0 is an error, as in torch (numpy would give 0)."""
    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        aa, bb = np.asarray(a), np.asarray(b)
        if aa.dtype.kind in "iubO" and bb.dtype.kind in "iubO" and np.any(bb == 0):
            raise EinjoinError(f"integer {what} by zero (torch raises too; use float tensors for inf/nan)")
        with np.errstate(all="ignore"):  # the arguments as given: a Python-int constant stays weak
            return np_fn(a, b)            # (x // 3 of int32 is int32, not int64, in a fused join)
    run.__name__ = np_fn.__name__
    return run


def _fmod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C's fmod (the remainder with the dividend's sign, torch.fmod); an integer divisor of 0 is
    an error, as in torch (numpy would give 0)."""
    aa, bb = np.asarray(a), np.asarray(b)
    if aa.dtype.kind in "iubO" and bb.dtype.kind in "iubO" and np.any(bb == 0):
        raise EinjoinError("integer fmod by zero (torch raises too; use float tensors for nan)")
    if aa.dtype == object or bb.dtype == object:  # exact Python ints (constants folded): no ufunc loop
        exact: np.ndarray = np.frompyfunc(lambda x, y: -(abs(x) % abs(y)) if x < 0 else abs(x) % abs(y),
                                          2, 1)(aa, bb)
        return exact
    with np.errstate(all="ignore"):  # the arguments as given: a Python-int constant stays weak
        out: np.ndarray = np.fmod(a, b)
    return out


def _truncdiv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Division rounded toward zero (torch's ``div(rounding_mode="trunc")``): ``trunc(a / b)`` for
    floats; for integers the quotient of C's division, exactly (``a - fmod(a, b)`` divides ``b``;
    an integer divisor of 0 is an error, as in torch)."""
    aa, bb = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        if aa.dtype.kind in "iubO" and bb.dtype.kind in "iubO":
            if np.any(bb == 0):  # named here: _fmod's message would name fmod
                raise EinjoinError("integer trunc division by zero (torch raises too; use float tensors "
                                   "for inf/nan)")
            r = _fmod(a, b)
            out: np.ndarray = np.floor_divide(a - r, b)
            return out
        out = np.trunc(np.true_divide(a, b))
    return out


def _bits_dtype(a: object, b: object) -> np.dtype[np.generic]:
    dt: np.dtype[np.generic] = np.result_type(a, b)  # type: ignore[arg-type]
    return dt


def _shift(left: bool) -> Callable[..., np.ndarray]:
    """torch's shifts: a shift by a negative count or by the width or more gives 0 (left, and
    right of an unsigned type) or the sign fill ``a >> (width - 1)`` (right of a signed type);
    numpy's left_shift / right_shift are C's within the width."""
    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dt = _bits_dtype(a, b)  # a Python-int constant is weak: int8 << 3 stays int8
        width = dt.itemsize * 8
        aa, bb = np.asarray(a, dtype=dt), np.asarray(b)
        bad = (bb < 0) | (bb >= width)
        s = np.where(bad, 0 if left else width - 1, bb).astype(dt)
        out: np.ndarray = (np.left_shift if left else np.right_shift)(aa, s)
        if (left or dt.kind == "u") and np.any(bad):
            out = np.where(bad, np.zeros((), dt), out)
        return out.astype(dt, copy=False)
    run.__name__ = "lshift" if left else "rshift"
    return run


def _xlogy(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """torch.xlogy: ``x * log(y)``, 0 where ``x == 0`` (log 0 included) unless ``y`` is NaN."""
    out: np.ndarray = np.where(np.isnan(y), np.nan, np.where(x == 0, 0, x * np.log(y)))
    return out.astype(np.result_type(x, y), copy=False)


def _logit(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.log(x / (1 - x))  # torch's formula (logit(1) is inf, outside [0, 1] NaN)
    return out


def _gcd(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """torch.gcd: Euclid's algorithm on ``|a|`` and ``|b|`` with C's remainder, elementwise (so
    ``|int64 min|`` wraps as in torch's kernel: ``gcd(5, -2**63)`` is -1); bools as uint8."""
    dt = _bits_dtype(a, b)
    work = np.dtype(np.uint8) if dt.kind == "b" else dt
    with np.errstate(all="ignore"):
        x, y = (np.abs(np.asarray(v).astype(work)) for v in (a, b))
        x, y = (np.array(v) for v in np.broadcast_arrays(x, y))
        while np.any(x != 0):  # at most ~93 rounds for int64 (Fibonacci worst case)
            nz = x != 0
            r = np.fmod(y, np.where(nz, x, 1))
            y = np.where(nz, x, y)
            x = np.where(nz, r, 0).astype(work)
    return y.astype(dt, copy=False)


# precedences follow Python's grammar, which parses the printed form: comparisons (1) bind
# loosest, then | (2), & (3), + - (4), * / (5), unary minus, ** (7)
_FN_LIST = [
    ScalarFn("add", 2, "arith", np.add, "+", 4),
    ScalarFn("sub", 2, "arith", np.subtract, "-", 4),
    ScalarFn("mul", 2, "arith", np.multiply, "*", 5),
    ScalarFn("div", 2, "float", _div, "/", 5),
    ScalarFn("floordiv", 2, "arith", _int_division(np.floor_divide, "floor division"), "//", 5),
    ScalarFn("mod", 2, "arith", _int_division(np.remainder, "remainder"), "%", 5),
    ScalarFn("pow", 2, "float", _safe(np.power), "**", 7),
    ScalarFn("ipow", 2, "arith", _int_pow),   # int ** int stays int (torch); floats as pow
    ScalarFn("fmod", 2, "arith", _fmod),
    ScalarFn("truncdiv", 2, "arith", _truncdiv),
    ScalarFn("bitand", 2, "bits", np.bitwise_and),
    ScalarFn("bitor", 2, "bits", np.bitwise_or),
    ScalarFn("bitxor", 2, "bits", np.bitwise_xor),
    ScalarFn("bitnot", 1, "bits", np.invert),
    ScalarFn("lshift", 2, "bits", _shift(True)),
    ScalarFn("rshift", 2, "bits", _shift(False)),
    ScalarFn("gcd", 2, "bits", _gcd),
    ScalarFn("max", 2, "arith", np.maximum),
    ScalarFn("min", 2, "arith", np.minimum),
    ScalarFn("neg", 1, "arith", np.negative),
    ScalarFn("abs", 1, "arith", np.abs),
    ScalarFn("exp", 1, "float", _safe(np.exp)),
    ScalarFn("log", 1, "float", _safe(np.log)),
    ScalarFn("log1p", 1, "float", _safe(np.log1p)),  # softplus, log_sigmoid: exact near 0
    ScalarFn("expm1", 1, "float", _safe(np.expm1)),  # elu, selu, celu: exact near 0
    ScalarFn("sqrt", 1, "float", _safe(np.sqrt)),
    ScalarFn("rsqrt", 1, "float", _safe(lambda x: 1.0 / np.sqrt(x))),
    ScalarFn("reciprocal", 1, "float", _safe(lambda x: 1.0 / x)),
    ScalarFn("relu", 1, "arith", lambda x: np.maximum(x, 0)),
    ScalarFn("silu", 1, "float", _safe(_silu)),
    ScalarFn("gelu", 1, "float", _gelu),
    ScalarFn("gelu_tanh", 1, "float", _gelu_tanh),
    ScalarFn("tanh", 1, "float", np.tanh),
    ScalarFn("erf", 1, "float", _erf),
    ScalarFn("sigmoid", 1, "float", _sigmoid),
    ScalarFn("sin", 1, "float", np.sin),
    ScalarFn("cos", 1, "float", np.cos),
    # torch.from_torch's transcendental ops (session 40): numpy's, torch's formulas and edge cases
    ScalarFn("sinh", 1, "float", _safe(np.sinh)),
    ScalarFn("cosh", 1, "float", _safe(np.cosh)),
    ScalarFn("asin", 1, "float", _safe(np.arcsin)),
    ScalarFn("acos", 1, "float", _safe(np.arccos)),
    ScalarFn("atan", 1, "float", np.arctan),
    ScalarFn("asinh", 1, "float", np.arcsinh),
    ScalarFn("acosh", 1, "float", _safe(np.arccosh)),
    ScalarFn("atanh", 1, "float", _safe(np.arctanh)),
    ScalarFn("logit", 1, "float", _safe(_logit)),
    ScalarFn("atan2", 2, "float", np.arctan2),
    ScalarFn("copysign", 2, "float", np.copysign),
    ScalarFn("xlogy", 2, "float", _safe(_xlogy)),
    ScalarFn("logaddexp", 2, "float", _safe(np.logaddexp)),
    ScalarFn("logaddexp2", 2, "float", _safe(np.logaddexp2)),
    ScalarFn("where", 3, "select", np.where),
    ScalarFn("lt", 2, "compare", np.less, "<", 1),
    ScalarFn("le", 2, "compare", np.less_equal, "<=", 1),
    ScalarFn("gt", 2, "compare", np.greater, ">", 1),
    ScalarFn("ge", 2, "compare", np.greater_equal, ">=", 1),
    ScalarFn("eq", 2, "compare", np.equal, "==", 1),
    ScalarFn("ne", 2, "compare", np.not_equal, "!=", 1),
    ScalarFn("logical_not", 1, "logical", np.logical_not),
    ScalarFn("logical_and", 2, "logical", np.logical_and, "&", 3),
    ScalarFn("logical_or", 2, "logical", np.logical_or, "|", 2),
    # the identity whose derivative is 0 (einjoin.ir.derivative): ej.stop_gradient's join; a
    # copy, so no kernel hands back its input's buffer
    ScalarFn("stop_gradient", 1, "arith", lambda x: np.array(x, copy=True)),
]
FUNCTIONS: dict[str, ScalarFn] = {f.name: f for f in _FN_LIST}
# n-ary folds allowed when a join is named rather than written out ("mul" over three inputs)
_FOLDABLE = {"add", "mul", "max", "min", "logical_and", "logical_or"}


# ---------------------------------------------------------------- parsing


_BINOPS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.Pow: "pow",
           ast.FloorDiv: "floordiv", ast.Mod: "mod",
           ast.BitAnd: "logical_and", ast.BitOr: "logical_or"}
_CMPOPS = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_NAMED_CONSTS = {"pi": math.pi, "e": math.e, "inf": math.inf, "nan": math.nan}


# the deepest nesting of calls a join may have: printing, comparing and evaluating an expression
# recurse about 2-3 Python frames per call, so a deeper join would parse and then fail as a raw
# RecursionError in the planner or a kernel (Python's default limit is 1000 frames)
MAX_DEPTH = 200


def parse_join(join: str | Expr, n_inputs: int) -> Expr:
    """Parse a join given as a function name (``"mul"``, ``"exp"``), an expression string over
    ``x0, x1, ...`` (``"exp(x0 - x1)"``, ``"x0 * 0.5"``), or an :data:`Expr`; check its arguments.
    A join nesting calls deeper than :data:`MAX_DEPTH` is an :class:`ExpressionError`."""
    if isinstance(join, (Arg, Const, Call)):
        expr = join
        _check_depth(expr, join)
        try:
            _check_expr(expr)
        except RecursionError:
            raise ExpressionError("join expression nests too deeply") from None
    elif not isinstance(join, str):
        raise ExpressionError(f"join must be a function name or an expression string, got {join!r}")
    elif join in FUNCTIONS:
        f = FUNCTIONS[join]
        if f.arity == n_inputs or (f.name in _FOLDABLE and n_inputs >= 2):
            expr = Arg(0)
            for i in range(1, n_inputs) if f.arity == 2 else ():
                expr = Call(f.name, (expr, Arg(i)))
            if f.arity != 2:
                expr = Call(f.name, tuple(Arg(i) for i in range(f.arity)))
        else:
            raise ExpressionError(
                f"join {join!r} takes {f.arity} argument(s) but the einsum has {n_inputs} input(s)")
    elif join in ("id", "identity"):
        expr = Arg(0)
    else:
        try:
            tree = ast.parse(join.strip(), mode="eval")
        except (RecursionError, MemoryError):  # CPython's parser gives up on deep nesting either way
            raise ExpressionError(f"join expression {join[:40]!r}... nests too deeply") from None
        except ValueError as e:  # a NUL character in the source
            raise ExpressionError(f"join expression {join[:40]!r} does not parse: {e}") from None
        except SyntaxError as e:
            raise ExpressionError(f"join expression {join!r} does not parse: {e.msg}") from None
        try:
            expr = _from_ast(tree.body, join)
        except RecursionError:
            raise ExpressionError(f"join expression {join[:40]!r}... nests too deeply") from None
    _check_depth(expr, join)
    try:
        used = _max_arg(expr)
    except RecursionError:
        raise ExpressionError(f"join expression nests too deeply ({str(join)[:40]!r}...)") from None
    if used >= n_inputs:
        raise ExpressionError(
            f"join {str(expr)!r} uses x{used} but the einsum has only {n_inputs} input(s)")
    return expr


def _check_depth(expr: Expr, join: object) -> None:
    if isinstance(expr, Call) and expr.depth > MAX_DEPTH:
        text = join if isinstance(join, str) else f"{expr.fn}(...)"
        raise ExpressionError(f"join expression {text[:40]!r}... nests too deeply: calls {expr.depth} deep, "
                              f"above the limit of {MAX_DEPTH} (einjoin.ir.scalar.MAX_DEPTH)")


def _check_expr(e: object) -> None:
    """Validate an expression built by hand from :class:`Arg`, :class:`Const` and :class:`Call`
    (parsed ones are valid by construction): argument indices, constant types, function names
    and arities, so a bad tree fails here and not as a KeyError inside a kernel."""
    if isinstance(e, Arg):
        if isinstance(e.index, bool) or not isinstance(e.index, int) or e.index < 0:
            raise ExpressionError(f"join: Arg index must be an int >= 0, got {e.index!r}")
    elif isinstance(e, Const):
        if not isinstance(e.value, (bool, int, float)):
            raise ExpressionError(f"join: Const value must be a Python bool, int or float, "
                                  f"got {e.value!r}")
    elif isinstance(e, Call):
        if not isinstance(e.fn, str) or e.fn not in FUNCTIONS:
            raise ExpressionError(f"join: unknown function {e.fn!r}; known: "
                                  f"{', '.join(sorted(FUNCTIONS))}")
        if not isinstance(e.args, tuple) or len(e.args) != FUNCTIONS[e.fn].arity:
            raise ExpressionError(f"join: {e.fn} takes {FUNCTIONS[e.fn].arity} argument(s) as a "
                                  f"tuple, got {e.args!r}")
        for a in e.args:
            _check_expr(a)
    else:
        raise ExpressionError(f"join: expected Arg, Const or Call, got {type(e).__name__} ({e!r})")


def _from_ast(node: ast.AST, text: str) -> Expr:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
        return Const(node.value)
    if isinstance(node, ast.Name):
        if node.id in _NAMED_CONSTS:
            return Const(_NAMED_CONSTS[node.id])
        if node.id.startswith("x") and node.id[1:].isdigit():
            return Arg(int(node.id[1:]))
        if node.id in ("x", "y", "z"):
            return Arg("xyz".index(node.id))
        raise ExpressionError(f"join {text!r}: unknown name {node.id!r} (use x0, x1, ...)")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return Call(_BINOPS[type(node.op)], (_from_ast(node.left, text), _from_ast(node.right, text)))
    if isinstance(node, ast.UnaryOp):
        inner = _from_ast(node.operand, text)
        if isinstance(node.op, ast.USub):
            if isinstance(inner, Const) and not isinstance(inner.value, bool):
                return Const(-inner.value)
            return Call("neg", (inner,))
        if isinstance(node.op, ast.UAdd):
            return inner
        if isinstance(node.op, (ast.Invert, ast.Not)):
            return Call("logical_not", (inner,))
    if isinstance(node, ast.Compare) and len(node.ops) > 1:
        raise ExpressionError(f"join {text!r}: a chained comparison; & and | bind tighter than "
                              f"comparisons (as in Python and torch), so write (x0 > 0) & (x1 < 1)")
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPOPS:
        return Call(_CMPOPS[type(node.ops[0])],
                    (_from_ast(node.left, text), _from_ast(node.comparators[0], text)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        name = node.func.id
        if name not in FUNCTIONS:
            raise ExpressionError(
                f"join {text!r}: unknown function {name!r}; known: {', '.join(sorted(FUNCTIONS))}")
        f = FUNCTIONS[name]
        if len(node.args) != f.arity:
            raise ExpressionError(
                f"join {text!r}: {name} takes {f.arity} argument(s), got {len(node.args)}")
        return Call(name, tuple(_from_ast(a, text) for a in node.args))
    raise ExpressionError(f"join {text!r}: unsupported syntax {ast.dump(node)[:60]}")


def _max_arg(e: Expr) -> int:
    if isinstance(e, Arg):
        return e.index
    if isinstance(e, Call):
        return max((_max_arg(a) for a in e.args), default=-1)
    return -1


def num_args(e: Expr) -> int:
    """One more than the highest argument index the expression reads."""
    return _max_arg(e) + 1


# ---------------------------------------------------------------- typing


def infer_dtype(expr: Expr, arg_dtypes: Sequence[str]) -> str:
    """The result dtype of ``expr`` over arguments of ``arg_dtypes``; raise DTypeError on a
    mix without meaning. Constants are weak: they take the dtype of what they meet."""
    dt = _infer(expr, tuple(arg_dtypes))
    if dt is None:  # an expression of constants only: the kind of its values decides
        k = _const_only_kind(expr)
        if k == "int":  # where(x0, 2**70, 0) is int64; a constant fill must at least be a float64
            _check_int_range(expr, expr, "int64" if _max_arg(expr) >= 0 else "float64")
        return {"bool": "bool", "int": "int64", "float": "float32"}[k]
    return dt


def _const_only_kind(e: Expr) -> str:
    order = ["bool", "int", "float"]
    if isinstance(e, Const):
        return _const_kind(e.value)
    if isinstance(e, Arg):  # an argument whose dtype was unknown: treat as float
        return "float"
    f = FUNCTIONS[e.fn]
    if f.rule in ("compare", "logical"):
        return "bool"
    if f.rule == "float":
        return "float"
    vals = e.args[1:] if f.rule == "select" else e.args
    k = max((_const_only_kind(a) for a in vals), key=order.index)
    return "int" if k == "bool" and f.rule == "arith" else k  # -True is -1, as in Python


def _const_kind(v: object) -> str:
    return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "float"


def _infer(e: Expr, dts: tuple[str, ...]) -> str | None:
    if isinstance(e, Arg):
        return dts[e.index]
    if isinstance(e, Const):
        return None
    f = FUNCTIONS[e.fn]
    sub = [_infer(a, dts) for a in e.args]
    if f.rule == "select":
        cond, a, b = sub
        if cond is None and _const_only_kind(e.args[0]) != "bool":
            cond = _const_only_kind(e.args[0])  # where(1, ...): an int constant is no condition
        if cond is not None and cond != "bool":
            raise DTypeError(f"{e}: where's condition must be bool, got {cond}")
        out = _common(e, [a, b], e.args[1:], allow_bool=True)
        if out == "bool" and any(d is None and _const_only_kind(v) == "int" for v, d in zip(e.args[1:], (a, b))):
            return "int64"  # where(c, bool_t, 0): a Python int beside a bool tensor makes int64 (torch)
        return out
    if f.rule == "logical":
        for arg, d in zip(e.args, sub):
            if d is None and _const_only_kind(arg) != "bool":
                d = f"the constant {arg}"  # x & 5 is no logical and (and 2**63 overflowed inside)
            if d is not None and d != "bool":
                raise DTypeError(f"{e}: {f.name} needs bool arguments, got {d}")
        return "bool"
    if f.rule == "bits":
        for arg, d in zip(e.args, sub):
            if d is None and _const_only_kind(arg) == "float":  # bitand(0, 0.0): no dtype holds it
                raise DTypeError(f"{e}: {f.name} needs integer or bool arguments, got the float constant {arg}")
    # bool < bool is bool, as in torch; so is bool & bool
    common = _common(e, sub, e.args, allow_bool=f.rule in ("compare", "bits"))
    if f.rule == "bits" and common == "bool" and any(
            d is None and _const_only_kind(arg) == "int" for arg, d in zip(e.args, sub)):
        return "int64"  # a Python int beside a bool tensor makes int64 (torch: t & 0, t << 1)
    if f.rule == "float" and common is not None and kind(common) != "float":
        raise DTypeError(f"{e}: {f.name} needs float arguments, got {common}")
    if f.rule == "bits" and common is not None and kind(common) == "float":
        raise DTypeError(f"{e}: {f.name} needs integer or bool arguments, got {common}")
    if f.rule == "compare":
        return "bool"
    return common


def _common(e: Expr, sub: list[str | None], args: Sequence[Expr], allow_bool: bool) -> str | None:
    concrete = [d for d in sub if d is not None]
    if not concrete:
        return None
    out = concrete[0]
    for d in concrete[1:]:
        try:
            out = promote(out, d)
        except DTypeError:
            raise DTypeError(f"{e}: cannot mix {out} and {d} in one expression; cast first") from None
    if kind(out) == "bool" and not allow_bool:
        raise DTypeError(f"{e}: {getattr(e, 'fn', '')} does not take bool arguments")
    for a, dt in zip(args, sub):
        if dt is None:  # a constant, or an expression of constants only (2 ** -1)
            ck = _const_only_kind(a)
            if ck == "float" and kind(out) != "float":
                raise DTypeError(f"{e}: float constant {a} meets {out}; cast first")
            if ck in ("int", "bool"):
                _check_int_range(e, a, out)
    return out


_INT64 = (-2 ** 63, 2 ** 63)


def _int_range(dtype: str) -> tuple[int, int]:
    info = np.iinfo(numpy_dtype(dtype))
    return int(info.min), int(info.max)


def _check_int_range(e: Expr, a: Expr, out: str) -> None:
    """An integer constant must fit what it meets: int64's range, or a finite float64 (numpy would
    raise OverflowError inside a kernel, or wrap silently)."""
    if _max_arg(a) >= 0:  # where(x0, 1, 0): no dtype of its own, yet reads an argument
        for sub in a.args if isinstance(a, Call) else ():
            _check_int_range(e, sub, out)
        return
    v = const_value(a)
    if isinstance(v, bool) or not isinstance(v, int):
        return
    if kind(out) == "int" and not _INT64[0] <= v < _INT64[1]:
        raise DTypeError(f"{e}: integer constant {v} is outside int64's range [-2**63, 2**63)")
    if kind(out) == "int" and out != "int64" and not _int_range(out)[0] <= v <= _int_range(out)[1]:
        lo, hi = _int_range(out)  # numpy would raise OverflowError in the kernel
        raise DTypeError(f"{e}: integer constant {v} is outside {out}'s range [{lo}, {hi}]; wrap it "
                         f"as torch does (a tensor op with a Python int wraps it) or cast to int64")
    if kind(out) == "float":
        try:
            float(v)
        except OverflowError:
            raise DTypeError(f"{e}: integer constant {str(v)[:20]}... is too large for any float "
                             f"dtype") from None


# ---------------------------------------------------------------- evaluation


Number = int | float | bool


def _as_float(v: Number) -> float:
    try:
        return float(v)
    except OverflowError:  # an int beyond float64: its float value is infinite
        return math.copysign(math.inf, v)


def _eval_consts(f: ScalarFn, vals: list[Number]) -> Number:
    """``f`` over Python scalars, with Python's number semantics and IEEE's edge cases (1/0 is
    inf): a float function computes in float64 (numpy's integer ``2 ** -1`` raises and
    ``2 ** 64`` wraps), integer arithmetic is exact (object arrays of Python ints), arithmetic
    on bools is on ints (``-True`` is -1). The result is a weak scalar."""
    if f.rule == "float" or (f.rule in ("arith", "compare")
                             and any(isinstance(v, float) for v in vals)):
        args = [np.asarray(_as_float(v), dtype=np.float64) for v in vals]
    elif f.rule in ("arith", "compare"):
        args = [np.asarray(int(v), dtype=object) for v in vals]
    elif f.rule == "select":
        c, a, b = vals
        return a if c else b
    elif f.rule == "bits" and any(isinstance(v, float) for v in vals):
        raise DTypeError(f"{f.name} needs integer or bool arguments, got {vals}")
    else:
        args = [np.asarray(v) for v in vals]
    with np.errstate(all="ignore"):
        out = f.impl(*args)
    out = out.item() if isinstance(out, np.ndarray) else out
    if isinstance(out, (np.generic,)):
        out = out.item()
    return bool(out) if f.rule in ("compare", "logical") else out


def const_value(e: Expr) -> Number:
    """The value of an expression of constants only, as a Python number (what the evaluator gives
    it: each call over Python scalars by :func:`_eval_consts`)."""
    if isinstance(e, Const):
        return e.value
    assert isinstance(e, Call), f"{e} reads an argument"
    return _eval_consts(FUNCTIONS[e.fn], [const_value(x) for x in e.args])


def is_product(expr: Expr, n: int) -> bool:
    """True when ``expr`` is ``x0 * x1 * ... * x{n-1}`` (each once), the contraction case."""
    seen: list[int] = []

    def walk(e: Expr) -> bool:
        if isinstance(e, Arg):
            seen.append(e.index)
            return True
        return isinstance(e, Call) and e.fn == "mul" and all(walk(a) for a in e.args)

    return walk(expr) and sorted(seen) == list(range(n))


def is_identity(expr: Expr) -> bool:
    return expr == Arg(0)


def substitute(expr: Expr, args: Sequence[Expr]) -> Expr:
    """Replace each ``Arg(i)`` by ``args[i]`` (used to fuse elementwise chains and fold constants).
    A sub-expression object used several times stays one object, so :func:`evaluate` still
    computes it once."""
    memo: dict[int, Expr] = {}

    def go(e: Expr) -> Expr:
        if isinstance(e, Arg):
            return args[e.index]
        if isinstance(e, Const):
            return e
        out = memo.get(id(e))
        if out is None:
            out = memo[id(e)] = Call(e.fn, tuple(go(a) for a in e.args))
        return out

    return go(expr)
