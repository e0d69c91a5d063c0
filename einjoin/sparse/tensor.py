"""Block-sparse tensor relations: only the non-empty blocks exist, each a tuple (key, payload).

A :class:`SparseTensor` of rank r holds ``keys`` (n × r block coordinates, unique, sorted) and
``data`` (n payloads of the block shape, stacked: ``data[t]`` is the block at ``keys[t]``). A
block of size 1 in every dim is plain COO; a block of the full size in a dim makes that dim
dense inside the payload (the key column is then 0). Edge blocks are padded with zeros, so every
payload has the same shape and kernels run batched over tuples.

>>> import numpy as np, einjoin as ej
>>> s = ej.sparse("A", (np.array([[0, 0, 2], [1, 1, 0]]), np.array([1., 2., 5.]), (3, 2)))
>>> s.nnz, s.todense().tolist()      # the duplicate (0, 1) entries are summed
(2, [[0.0, 3.0], [0.0, 0.0], [5.0, 0.0]])
>>> s.reblock((2, 2)).keys.tolist()  # two non-empty 2x2 blocks
[[0, 0], [1, 0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.ir.dtypes import is_bfloat16
from einjoin.ir.reference import to_numpy

__all__ = ["SparseTensor", "sparse", "is_sparse", "dense_operand", "broadcast_size1",
           "is_sparse_format"]

# {"sparse_einsum": einjoin.sparse.plan.sparse_einsum, "cached": einjoin.sparse.replan.einsum_cached}
EINSUM: dict[str, Callable[..., Any]] = {}
# the Tensor API's ops on a SparseTensor ("apply", "add", "mul", "truediv", "power"), registered by
# einjoin.sparse.tensor_ops (which builds on this module; einjoin.sparse imports it)
TENSOR_OPS: dict[str, Callable[..., Any]] = {}


def _numpy_reduce(t: Any, name: str, dim: Any, keepdim: bool, kw: dict[str, Any]) -> tuple[Any, bool]:
    """A reduction's (dim, keepdim) from numpy's keywords as well (``np.sum(t)`` calls
    ``t.sum(axis=None, dtype=None, out=None)``); a dtype or an out array is refused by name."""
    if "axis" in kw:
        if dim is not None:
            raise EinjoinError(f"sparse tensor {t.name!r}: {name}() got both dim and axis")
        dim = kw.pop("axis")
    if "keepdims" in kw:
        keepdim = bool(kw.pop("keepdims"))
    extra = {k: v for k, v in kw.items() if v is not None and not (k == "where" and v is True)}
    if extra:
        raise EinjoinError(f"sparse tensor {t.name!r}: {name}() takes dim and keepdim (numpy's axis and "
                           f"keepdims), not {', '.join(sorted(extra))}; use .todense() for numpy's other options")
    return dim, keepdim


def _matmul(t: Any, other: Any, reflected: bool) -> Any:
    """``t @ a`` / ``a @ t`` with a dense array of rank 1 or 2, as numpy's matmul on the densified
    tensor: the sparse einsum (a dense result)."""
    a = np.asarray(other) if not hasattr(other, "__einjoin_einsum__") else other
    ranks = (a.ndim, t.ndim) if reflected else (t.ndim, a.ndim)
    if t.ndim not in (1, 2) or getattr(a, "ndim", 0) not in (1, 2):
        shapes = (tuple(a.shape), t.shape) if reflected else (t.shape, tuple(a.shape))
        raise EinjoinError(f"sparse tensor {t.name!r}: @ takes operands of rank 1 or 2, got shapes "
                           f"{shapes[0]} @ {shapes[1]}; use ej.einsum for other products")
    left, right = ("ij"[2 - ranks[0]:], "jk"[:ranks[1]])
    out = left.replace("j", "") + right.replace("j", "")
    operands = [a, t] if reflected else [t, a]
    return t.__einjoin_einsum__(f"{left},{right}->{out}", operands)
_MAX_CODE = 2 ** 62  # mixed-radix codes of keys fit an int64 below this


def _lazy(x: Any) -> bool:
    """An einjoin graph tensor (no values until it runs), not a sparse tensor."""
    return type(x).__module__.startswith("einjoin.") and not isinstance(x, SparseTensor)


def grid_of(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """Blocks per dim (ceil), at least 1 so that a size-0 dim keeps a well-formed grid."""
    return tuple(max(1, -(-n // b)) for n, b in zip(shape, block))


def key_codes(keys: np.ndarray, grid: Sequence[int]) -> np.ndarray | None:
    """One int64 per key row (row-major over ``grid``), or None when the grid is too large."""
    if int(np.prod([max(g, 1) for g in grid], dtype=object)) >= _MAX_CODE:
        return None
    code = np.zeros(len(keys), np.int64)
    for d, g in enumerate(grid):
        code = code * g + keys[:, d]
    return code


def unique_rows(keys: np.ndarray, grid: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique rows, inverse) of an int64 key matrix; codes when the grid allows."""
    if keys.shape[1] == 0:
        return np.zeros((min(len(keys), 1), 0), np.int64), np.zeros(len(keys), np.int64)
    code = key_codes(keys, grid)
    if code is None:
        uniq, inv = np.unique(keys, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)
    order = np.argsort(code, kind="stable")  # not np.unique: numpy 2 hashes, far slower here
    sorted_code = code[order]
    first = np.r_[True, sorted_code[1:] != sorted_code[:-1]] if len(code) else np.zeros(0, bool)
    inv = np.empty(len(code), np.int64)
    inv[order] = np.cumsum(first) - 1
    ucode = sorted_code[first]
    return np.stack(np.unravel_index(ucode, tuple(grid)), axis=1).astype(np.int64), inv


def _check_shape(shape: Any, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(n) for n in shape)
        ok = all(int(n) == n for n in shape)
    except (TypeError, ValueError):
        raise ShapeError(f"{what}: shape must be a sequence of integers, got {shape!r}") from None
    if not ok or any(n < 0 for n in out):
        raise ShapeError(f"{what}: shape {tuple(shape)} has a negative or non-integer size")
    return out


def is_float(dt: np.dtype) -> bool:
    """A floating dtype: numpy's float16/32/64 or ml_dtypes' bfloat16 (numpy kind 'V')."""
    return dt.kind == "f" or is_bfloat16(dt)


def half(dt: np.dtype) -> bool:
    """float16 or bfloat16: computed in float32 and rounded once at the end, as torch does."""
    return dt == np.float16 or is_bfloat16(dt)


def exact_values(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` in a dtype the einsum computes in, every value unchanged: float16/32/64, bfloat16,
    (u)int8, int16/32/64 and bool as they are (a product of narrow ints wraps in their dtype, as
    torch's does), uint16/32 as int64, uint64 as int64 when every value fits."""
    dt = arr.dtype
    if dt.kind in "fb" and dt.itemsize <= 8 or is_bfloat16(dt) or \
            dt in (np.int8, np.uint8, np.int16, np.int32, np.int64):
        return arr
    if dt.kind in "iu" and (dt.itemsize < 8 or arr.size == 0 or int(arr.max()) < 2 ** 63):
        return arr.astype(np.int64)
    raise DTypeError(f"{what}: values of dtype {dt} (sparse einsums compute in float16/32/64, "
                     f"bfloat16, int64 or bool; {dt} values beyond int64 or without a numpy kind of number "
                     f"are refused: convert them first, e.g. .astype(np.float64) or t.float())")


def dense_operand(x: Any, i: int, what: str) -> np.ndarray:
    """A dense operand's values (numpy, torch, nested lists): a torch tensor is read by value
    (requires_grad is fine: nothing here differentiates), in a dtype of :func:`exact_values`;
    bool as float32 0 / 1, as a sparse tensor's bool values are (:func:`sparse`): a bool sparse
    operand with a bool dense one was refused as "cannot mix float32 and bool"."""
    return _check_dtype(to_numpy(x, f"{what}: operand {i}"), f"{what}: operand {i}")


def _check_dtype(vals: np.ndarray, what: str) -> np.ndarray:
    vals = exact_values(vals, what)
    return vals.astype(np.float32) if vals.dtype.kind == "b" else vals


def _block_size(b: Any) -> bool:
    """An integer >= 1 (a bool is not a size: ``block=True`` was read as 1, ``reblock((1.5, 1))``
    as 1)."""
    return isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_)) and bool(b >= 1)


def _read_only(a: np.ndarray) -> np.ndarray:
    view: np.ndarray = a.view()
    view.flags.writeable = False
    return view


def _checked(name: str, shape: Any, block: Any, keys: np.ndarray, data: np.ndarray
             ) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray, np.ndarray]:
    """The shape, block, int64 keys and data (scalar payloads given flat: as ``(n,) + block``) of
    a directly built tensor, or a ShapeError / DTypeError
    naming what does not hold: sizes, payload shapes, keys in range, sorted and unique."""
    what = f"sparse tensor {name!r}"
    shp = _check_shape(shape, what)
    if not all(_block_size(b) for b in block):
        raise ShapeError(f"{what}: block {tuple(block)} (integer sizes >= 1)")
    blk = tuple(int(b) for b in block)
    if data.ndim == 1 and all(b == 1 for b in blk):  # scalar payloads: one value per tuple
        data = data.reshape((len(data),) + blk)
    if tuple(data.shape[1:]) != blk:
        raise ShapeError(f"{what}: payloads of shape {tuple(data.shape[1:])}, block {blk} (data: tuples x block)")
    if keys.dtype.kind not in "iu" or (keys.dtype == np.uint64 and keys.size and int(keys.max()) >= 2 ** 63):
        raise DTypeError(f"{what}: keys must be integers (block coordinates), got {keys.dtype}")
    keys = keys.astype(np.int64, copy=False)
    fix = "build tensors with ej.sparse(name, (indices, values, shape)), which sorts and sums duplicates"
    if len(keys) and len(shp):
        bad = (keys < 0) | (keys * np.asarray(blk, np.int64) >= np.asarray(shp, np.int64))
        if bad.any():
            t, d = (int(v[0]) for v in np.nonzero(bad))
            raise ShapeError(f"{what} of shape {shp}, block {blk}: key {tuple(int(k) for k in keys[t])} (tuple {t}) "
                             f"is out of range in dim {d} (block coordinates 0 .. {grid_of(shp, blk)[d] - 1}); {fix}")
    if len(keys) > 1:
        code = key_codes(keys, grid_of(shp, blk))
        if code is not None:
            step = np.diff(code)
        else:  # a grid too large for one code: compare rows lexicographically
            diff = keys[1:] - keys[:-1]
            first = np.argmax(diff != 0, axis=1)
            step = np.where((diff != 0).any(axis=1), diff[np.arange(len(diff)), first], 0)
        if (step <= 0).any():
            t = int(np.argmax(step <= 0)) + 1
            how = "repeats" if step[t - 1] == 0 else "comes before"
            raise ShapeError(f"{what}: keys must be sorted row-major and unique, but key "
                             f"{tuple(int(k) for k in keys[t])} (tuple {t}) {how} key "
                             f"{tuple(int(k) for k in keys[t - 1])} (tuple {t - 1}); {fix}")
    return shp, blk, keys, data


class SparseTensor:
    """A block-sparse tensor relation: ``keys`` (n × rank, int64) and ``data`` (n × block).

    Build one with :func:`sparse`. ``block[d] == 1`` is COO along d; ``block[d] == shape[d]``
    is d kept dense in the payload. Immutable: ``keys`` and ``data`` are read-only views (what is
    derived from them is kept with the tensor and reused by every run); for new values build a new
    tensor and pass it to ``plan.run(A=...)``. Results of :func:`einjoin.einsum` on sparse operands are
    SparseTensors where the algebra keeps them sparse.

    >>> import numpy as np, einjoin as ej
    >>> a = ej.sparse("A", np.eye(3))
    >>> a.nnz, a.block, float(a.todense().trace())
    (3, (1, 1), 3.0)
    """

    __slots__ = ("name", "shape", "dtype", "block", "keys", "data", "_coo", "counts", "derived")

    def __init__(self, name: str, shape: tuple[int, ...], block: tuple[int, ...],
                 keys: np.ndarray, data: np.ndarray, *, trusted: bool = False) -> None:
        # the parts must fit each other; the keys must be in range, sorted row-major and unique
        # (every join and grouping assumes it), checked in O(n) unless ``trusted`` (einjoin's own
        # constructions, which sort and sum: from_coo, the executor's results)
        keys, data = np.asarray(keys), np.asarray(data)
        if len(block) != len(shape) or keys.ndim != 2 or keys.shape[1] != len(shape) or \
                data.ndim < 1 or len(data) != len(keys):
            raise ShapeError(f"sparse tensor {name!r} of shape {tuple(shape)}, block {tuple(block)}: keys of "
                             f"shape {keys.shape} and data of shape {data.shape} do not fit (keys: tuples x "
                             f"{len(shape)} block coordinates, data: one payload per tuple); build tensors "
                             f"with ej.sparse")
        if not trusted:
            shape, block, keys, data = _checked(name, shape, block, keys, data)
        self.name = name
        self.shape = shape
        self.block = block
        # read-only views: a tensor is immutable, as the caches kept with it (its COO, block counts,
        # joins and SpMM orders, a split's per-device parts) assume; new values are a new tensor
        self.keys = _read_only(keys)
        self.data = _read_only(data)
        self.dtype = data.dtype
        self._coo: tuple[np.ndarray, np.ndarray] | None = None
        # non-empty blocks per keyed layout (einjoin.sparse.layout.Operand.tuples), kept with the
        # data so that a plan choosing a layout again (a later step, another run) counts once
        self.counts: dict[tuple[int | None, ...], int] = {}
        # structures the executor derives from the keys alone (einjoin.sparse.kernels: the column
        # order of an SpMM), kept with them so that each run of a plan reuses them
        self.derived: dict[tuple[object, ...], object] = {}

    def __getstate__(self) -> dict[str, Any]:
        # without ``derived``: a device's part sent to a Ray actor every run would carry its kept
        # join and SpMM order (several times the tuples' own bytes); they are rebuilt where it lands
        return {k: getattr(self, k) for k in self.__slots__ if k != "derived"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.derived = {}

    # -- the sparse-operand protocol of einjoin.einsum (the frontend knows only this name); the
    # executor registers itself in EINSUM (einjoin.sparse.plan imports this module, not back) --
    @classmethod
    def __einjoin_einsum__(cls, equation: str, operands: Sequence[Any], join: Any = None,
                           agg: Any = "sum") -> Any:
        # another library's sparse operand (torch / scipy / pydata) joins as a SparseTensor (named
        # as a dense operand i is, x<i>), not densified (scipy's was refused, torch's densified)
        operands = [sparse(f"x{i}", x) if is_sparse_format(x) else x for i, x in enumerate(operands)]
        equation, operands = broadcast_size1(equation, operands)
        # the plans of recent calls, reused per equation, shapes and histogram (einjoin.sparse.replan)
        run = EINSUM.get("cached")
        if run is not None:
            return run(equation, operands, join=join, agg=agg)
        return EINSUM["sparse_einsum"](equation, *operands, join=join, agg=agg)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # numpy would read it as a 0-d object array (np.asarray silently, h @ s a raw error deep in
        # numpy); densifying implicitly could be terabytes: say which call gives what
        raise EinjoinError(f"sparse tensor {self.name!r} {self.shape} ({self.nnz} entries): numpy does not "
                           f"read a sparse tensor implicitly; use .todense() for the dense array, "
                           f".to_scipy(), or ej.einsum for products with arrays")

    # -- the Tensor API on the stored entries (einjoin.sparse.tensor_ops: each equal to numpy on
    # the densified tensor; sparse where f(0) == 0, dense arrays otherwise) --
    __array_ufunc__ = None  # ``array * t`` defers to ``t.__rmul__`` (numpy would refuse it in __array__)

    def __einjoin_op__(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """The frontend's functional forms on a sparse tensor (``ej.sum(t, 1)``, ``ej.relu(t)``)."""
        return TENSOR_OPS["apply"](self, op, *args, **kwargs)

    def sum(self, dim: Any = None, keepdim: bool = False, **numpy_kw: Any) -> Any:
        """The sum over ``dim`` (None: all): a SparseTensor, or a dense array over every dim.

        >>> import numpy as np
        >>> sparse("A", np.array([[1, 0], [2, 3]])).sum(0).todense().tolist()
        [3, 3]
        """
        return self.__einjoin_op__("sum", *_numpy_reduce(self, "sum", dim, keepdim, numpy_kw))

    def max(self, dim: Any = None, keepdim: bool = False, **numpy_kw: Any) -> Any:
        """The max over ``dim``, a missing entry counting 0 (as the densified tensor)."""
        return self.__einjoin_op__("max", *_numpy_reduce(self, "max", dim, keepdim, numpy_kw))

    def min(self, dim: Any = None, keepdim: bool = False, **numpy_kw: Any) -> Any:
        return self.__einjoin_op__("min", *_numpy_reduce(self, "min", dim, keepdim, numpy_kw))

    def mean(self, dim: Any = None, keepdim: bool = False, **numpy_kw: Any) -> Any:
        return self.__einjoin_op__("mean", *_numpy_reduce(self, "mean", dim, keepdim, numpy_kw))

    def prod(self, dim: Any = None, keepdim: bool = False, **numpy_kw: Any) -> Any:
        return self.__einjoin_op__("prod", *_numpy_reduce(self, "prod", dim, keepdim, numpy_kw))

    def neg(self) -> Any:
        return self.__einjoin_op__("neg")

    def abs(self) -> Any:
        return self.__einjoin_op__("abs")

    def relu(self) -> Any:
        return self.__einjoin_op__("relu")

    def sqrt(self) -> Any:
        return self.__einjoin_op__("sqrt")

    def square(self) -> Any:
        return self.__einjoin_op__("square")

    def sin(self) -> Any:
        return self.__einjoin_op__("sin")

    def tanh(self) -> Any:
        return self.__einjoin_op__("tanh")

    def exp(self) -> Any:
        """Dense (``exp(0) == 1``): an ``np.ndarray``."""
        return self.__einjoin_op__("exp")

    def cos(self) -> Any:
        return self.__einjoin_op__("cos")

    def __neg__(self) -> Any:
        return self.neg()

    def __abs__(self) -> Any:
        return self.abs()

    def __add__(self, other: Any) -> Any:
        return TENSOR_OPS["add"](self, other)

    def __radd__(self, other: Any) -> Any:
        return TENSOR_OPS["add"](self, other, reflected=True)

    def __sub__(self, other: Any) -> Any:
        return TENSOR_OPS["add"](self, other, sign=-1)

    def __rsub__(self, other: Any) -> Any:
        return TENSOR_OPS["add"](self, other, sign=-1, reflected=True)

    def __mul__(self, other: Any) -> Any:
        if _lazy(other):  # an einjoin graph tensor: its __rmul__ builds the sparse einsum node
            return NotImplemented
        return TENSOR_OPS["mul"](self, other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        return TENSOR_OPS["truediv"](self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return TENSOR_OPS["truediv"](self, other, reflected=True)

    def __matmul__(self, other: Any) -> Any:
        if _lazy(other):  # an einjoin graph tensor: its __rmatmul__ builds the sparse einsum node
            return NotImplemented
        return _matmul(self, other, reflected=False)

    def __rmatmul__(self, other: Any) -> Any:
        return _matmul(self, other, reflected=True)

    def __pow__(self, other: Any) -> Any:
        return TENSOR_OPS["power"](self, other)

    def __rpow__(self, other: Any) -> Any:
        return TENSOR_OPS["power"](self, other, reflected=True)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nnz(self) -> int:
        """Stored entries (inside the shape; explicit zeros count, as in scipy)."""
        return len(self.coo()[1])

    @property
    def nblocks(self) -> int:
        """Non-empty blocks: the relation's tuples."""
        return len(self.keys)

    def __repr__(self) -> str:
        return (f"SparseTensor({self.name!r}, shape={self.shape}, dtype={self.dtype}, "
                f"block={self.block}, tuples={self.nblocks})")

    def coo(self) -> tuple[np.ndarray, np.ndarray]:
        """(coords n × rank, values n): the stored entries; for blocks > 1 the payloads' non-zeros."""
        if self._coo is None:
            if all(b == 1 for b in self.block):
                coords, vals = self.keys, self.data.reshape(-1)
            else:
                t, *offs = np.nonzero(self.data)
                coords = np.stack([self.keys[t, d] * b + o for d, (b, o) in
                                   enumerate(zip(self.block, offs))], axis=1) if self.ndim else \
                    np.zeros((len(t), 0), np.int64)
                vals = self.data[(t,) + tuple(offs)]
                inside = np.all(coords < np.asarray(self.shape, np.int64), axis=1)
                coords, vals = coords[inside], vals[inside]
            self._coo = (coords.astype(np.int64, copy=False).reshape(len(vals), self.ndim), vals)
        return self._coo

    def reblock(self, block: Sequence[int]) -> SparseTensor:
        """The same tensor as a relation of ``block``-shaped tuples (sizes capped at the shape)."""
        if len(block) != self.ndim or not all(_block_size(b) for b in block):
            raise ShapeError(f"sparse tensor {self.name!r} of shape {self.shape}: block {tuple(block)} "
                             f"needs {self.ndim} integer sizes >= 1")
        blk = tuple(max(1, min(int(b), max(n, 1))) for b, n in zip(block, self.shape))
        if blk == self.block:
            return self
        # the last block shape asked for is kept (one copy: a plan asks for one per operand), so
        # that each run of a plan neither cuts the tensor again (~45 ns an entry: blocked B·C of
        # 2048² block-diagonals, 8.2 -> 4.9 ms CPU a run) nor loses what the executor keeps in
        # the cut tensor's own ``derived`` (a step's join with dense operands)
        kept = self.derived.get(("reblock",))
        if isinstance(kept, SparseTensor) and kept.block == blk:
            return kept
        coords, vals = self.coo()
        out = from_coo(self.name, coords, vals, self.shape, blk, summed=True)
        self.derived[("reblock",)] = out
        return out

    def todense(self) -> np.ndarray:
        """An ``np.ndarray`` of the exact shape (missing entries are 0)."""
        grid = grid_of(self.shape, self.block)
        size = tuple(g * b for g, b in zip(grid, self.block))
        try:
            padded = np.zeros(size, self.dtype)
        except (MemoryError, ValueError):  # numpy's _ArrayMemoryError, or a size beyond any array
            gib = math.prod(self.shape) * self.dtype.itemsize / 2 ** 30
            raise EinjoinError(f"sparse tensor {self.name!r}: todense() of shape {self.shape} ({self.dtype}) "
                               f"needs {gib:.3g} GiB, which this machine cannot allocate; use .to_scipy(), "
                               f".coo(), or ej.einsum with the sparse tensor") from None
        if self.nblocks:
            split = padded.reshape(tuple(x for gb in zip(grid, self.block) for x in gb))
            r = self.ndim
            view = split.transpose(tuple(range(0, 2 * r, 2)) + tuple(range(1, 2 * r, 2)))
            view[tuple(self.keys[:, d] for d in range(r))] = self.data if r else self.data[0]
        return padded[tuple(slice(0, n) for n in self.shape)].copy() if padded.shape != self.shape \
            else padded

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.csr_array`` (rank 2 only; float16 / bfloat16 values come as float32,
        which holds each exactly: scipy.sparse has neither)."""
        if self.ndim != 2:
            raise ShapeError(f"sparse tensor {self.name!r}: to_scipy needs rank 2, shape is {self.shape}")
        import scipy.sparse
        coords, vals = self.coo()
        if half(vals.dtype):
            vals = vals.astype(np.float32)
        return scipy.sparse.coo_array((vals, (coords[:, 0], coords[:, 1])), shape=self.shape).tocsr()

    def all_finite(self) -> bool:
        """Whether every stored value is finite (no inf or nan), worked out once per tensor (it is
        immutable): a sum of products checks it on every run (a pass over the data, ~8 ms at 5M
        entries).

        >>> import numpy as np
        >>> sparse("A", np.array([[1.0, 0.0], [np.inf, 2.0]])).all_finite()
        False
        """
        hit = self.derived.get(("finite",))
        if isinstance(hit, bool):
            return hit
        data = self.data
        # one pass without a temporary; a sum that overflowed is checked element by element
        ok = not is_float(data.dtype) or not data.size or bool(np.isfinite(data.sum(dtype=np.float64))) \
            or bool(np.isfinite(data).all())
        self.derived[("finite",)] = ok
        return ok

    def tuples(self) -> dict[tuple[int, ...], np.ndarray]:
        """The relation as a dict ``block key -> payload`` (a view of each payload)."""
        return {tuple(int(k) for k in key): self.data[t] for t, key in enumerate(self.keys)}


def from_coo(name: str, coords: np.ndarray, values: np.ndarray, shape: tuple[int, ...],
             block: tuple[int, ...], summed: bool = False) -> SparseTensor:
    """A relation of ``block`` tuples from (n × rank coords, values); duplicates summed."""
    r = len(shape)
    grid = grid_of(shape, block)
    bk = np.asarray(block, np.int64)
    keys = coords // bk if r else coords
    if all(b == 1 for b in block):
        if summed:
            order = np.lexsort(keys.T[::-1]) if r else np.arange(len(keys))
            return SparseTensor(name, shape, block, keys[order], values[order].reshape((-1,) + block), trusted=True)
        uniq, inv = unique_rows(keys, grid)
        if len(uniq) == len(keys):
            vals = np.empty(len(uniq), values.dtype)
            vals[inv] = values
        else:
            order = np.argsort(inv, kind="stable")
            starts = np.searchsorted(inv[order], np.arange(len(uniq)))
            # in the values' dtype: numpy's reduceat widens int8 / int32 to int64 (summed duplicates
            # changed the tensor's dtype; the densified sum wraps in the dtype, as torch's coalesce)
            keep = values.dtype if values.dtype.kind in "iu" else None
            vals = np.add.reduceat(values[order], starts, dtype=keep) if len(order) else values[:0]
        return SparseTensor(name, shape, block, uniq, vals.reshape((-1,) + block), trusted=True)
    if not summed:  # the stored entries first: duplicates summed, explicit zeros kept
        entries = from_coo(name, coords, values, shape, (1,) * r)
        coords, values = entries.keys, entries.data.reshape(-1)
        keys = coords // bk if r else coords
    uniq, inv = unique_rows(keys, grid)
    data = np.zeros((len(uniq),) + block, values.dtype)
    offs = tuple((coords % bk)[:, d] for d in range(r))
    data[(inv,) + offs] = values
    out = SparseTensor(name, shape, block, uniq, data, trusted=True)
    # the stored entries are these coordinates, explicit zeros included (coo() would find only the
    # payloads' non-zeros: the same data stored at block 2 had fewer entries, nnz and gradient
    # support, than at block 1)
    out._coo = (_read_only(coords.astype(np.int64, copy=False).reshape(len(values), r)), _read_only(values))
    return out


def is_sparse(x: Any) -> bool:
    return isinstance(x, SparseTensor)


def is_sparse_format(x: Any) -> bool:
    """Whether ``x`` is another library's sparse tensor that :func:`sparse` reads (a torch sparse
    tensor of any sparse layout, a ``scipy.sparse`` matrix or array, a pydata ``sparse.COO``): an
    operand given so should become a SparseTensor, not be densified.

    >>> import numpy as np, scipy.sparse
    >>> is_sparse_format(scipy.sparse.eye(3)), is_sparse_format(np.eye(3))
    (True, False)
    """
    mod = type(x).__module__ or ""
    if mod.startswith("scipy.sparse") or (mod.startswith("sparse") and hasattr(x, "coords")):
        return True
    if mod.startswith("torch"):
        import torch
        return isinstance(x, torch.Tensor) and x.layout != torch.strided
    return False


def size1_squeeze(equation: str, shapes: Sequence[tuple[int, ...]]) -> tuple[str, list[tuple[int, ...]]] | None:
    """numpy's broadcasting of size-1 dims, which the sparse executor does not do itself: the
    equation with a label's size-1 dims dropped where another operand has it larger, and each
    operand's kept dims; None when nothing is dropped or the equation does not parse (the
    compiler names what is wrong).

    >>> size1_squeeze("ij,ij->ij", [(3, 3), (1, 3)])
    ('ij,j->ij', [(0, 1), (1,)])
    """
    from einjoin.ir.equation import parse_equation
    try:
        in_labels, out = parse_equation(equation, [tuple(sh) for sh in shapes])
    except Exception:  # noqa: BLE001 - the compiler checks the same input and names what is wrong
        return None
    widest: dict[str, int] = {}
    for ls, shape in zip(in_labels, shapes):
        if len(ls) != len(shape):
            return None
        for lab, n in zip(ls, shape):
            widest[lab] = max(widest.get(lab, 0), int(n))
    keeps: list[tuple[int, ...]] = []
    for ls, shape in zip(in_labels, shapes):
        # a repeated label only where every one of its dims here is 1 (a diagonal's sizes agree)
        keeps.append(tuple(d for d, lab in enumerate(ls) if not (widest[lab] > 1 and all(
            shape[e] == 1 for e, other in enumerate(ls) if other == lab))))
    if all(len(k) == len(ls) for k, ls in zip(keeps, in_labels)):
        return None
    eq = ",".join("".join(ls[d] for d in k) for k, ls in zip(keeps, in_labels)) + "->" + "".join(out)
    return eq, keeps


def drop_dims(x: Any, keep: Sequence[int]) -> Any:
    """``x`` (a SparseTensor or an array) with only the dims ``keep``, the others of size 1: a
    sparse tensor loses those key columns (all zeros: its keys stay unique and sorted) and
    payload axes, an array is reshaped."""
    shape = tuple(x.shape)
    if len(keep) == len(shape):
        return x
    new_shape = tuple(shape[d] for d in keep)
    if isinstance(x, SparseTensor):
        blk = tuple(x.block[d] for d in keep)
        return SparseTensor(x.name, new_shape, blk, np.ascontiguousarray(x.keys[:, list(keep)]),
                            x.data.reshape((len(x.keys),) + blk), trusted=True)
    return (x if hasattr(x, "reshape") else np.asarray(x)).reshape(new_shape)


def restore_dims(x: Any, shape: Sequence[int], keep: Sequence[int]) -> Any:
    """The inverse of :func:`drop_dims`: ``x`` given back the size-1 dims of ``shape`` that are not
    in ``keep`` (a gradient computed on squeezed operands, in its operand's own shape)."""
    shape = tuple(shape)
    if len(keep) == len(shape):
        return x
    if isinstance(x, SparseTensor):
        keys = np.zeros((len(x.keys), len(shape)), np.int64)
        keys[:, list(keep)] = x.keys
        blk = [1] * len(shape)
        for d, b in zip(keep, x.block):
            blk[d] = b
        return SparseTensor(x.name, shape, tuple(blk), keys, x.data.reshape((len(keys),) + tuple(blk)), trusted=True)
    return np.asarray(x).reshape(shape)


def broadcast_size1(equation: str, operands: Sequence[Any]) -> tuple[str, Sequence[Any]]:
    """The equation and operands with a label's size-1 dims squeezed away where another operand
    has it larger (:func:`size1_squeeze`; ``'ij,ij->ij'`` of (5, 4) and (1, 4) was "label 'i' has
    size 5 ... but size 1"). Lazy operands are left as they are.

    >>> import numpy as np
    >>> eq, ops = broadcast_size1("ij,ij->ij", [sparse("A", np.eye(3)), np.ones((1, 3))])
    >>> eq, ops[1].shape
    ('ij,j->ij', (3,))
    """
    if any(type(x).__module__.startswith("einjoin") and not isinstance(x, SparseTensor) for x in operands):
        return equation, operands
    try:
        shapes = [tuple(x.shape) if isinstance(x, SparseTensor) else tuple(np.shape(x)) for x in operands]
    except Exception:  # noqa: BLE001 - the compiler checks the same input and names what is wrong
        return equation, operands
    found = size1_squeeze(equation, shapes)
    if found is None:
        return equation, operands
    eq, keeps = found
    return eq, [drop_dims(x, k) for x, k in zip(operands, keeps)]


def _coo_of(data: Any, what: str) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], bool]:
    """(coords n × rank, values, shape, duplicates already summed) of any accepted input."""
    mod = type(data).__module__ or ""
    if mod.startswith("scipy.sparse"):
        coo = data.tocoo()
        # coords: one index array per dim (scipy >= 1.13's n-d coo_array too; row / col are 2-d only)
        idx = coo.coords if hasattr(coo, "coords") else (coo.row, coo.col)
        coords = np.stack([np.asarray(c) for c in idx], axis=1).astype(np.int64).reshape(-1, len(coo.shape))
        return coords, np.asarray(coo.data), _check_shape(coo.shape, what), False
    if mod.startswith("torch"):
        import torch
        t = data.detach()
        if t.device.type == "meta":
            raise EinjoinError(f"{what}: a torch tensor on the meta device {tuple(t.shape)} has no values "
                               f"to read (materialise it first, e.g. torch.empty_like(t, device='cpu'))")
        if t.layout == torch.strided:
            t = t.to_sparse()
        elif t.layout != torch.sparse_coo:
            t = t.to_sparse_coo()
        t = t.coalesce()
        vals = to_numpy(t.values(), what)  # bfloat16 too (numpy() refuses it)
        if vals.ndim != 1:
            raise ShapeError(f"{what}: hybrid torch sparse tensors (dense value dims {tuple(vals.shape[1:])}) "
                             f"are not supported")
        return (t.indices().cpu().numpy().T.astype(np.int64), vals, _check_shape(t.shape, what), True)
    if mod.startswith("sparse") and hasattr(data, "coords"):  # pydata sparse.COO
        return (np.asarray(data.coords).T.astype(np.int64), np.asarray(data.data),
                _check_shape(data.shape, what), False)
    if isinstance(data, tuple) and len(data) == 3:
        idx, vals, shape = data
        shape = _check_shape(shape, what)
        idx = np.asarray(idx)
        vals = np.asarray(vals)
        if idx.size == 0:
            idx = idx.reshape(len(shape), 0)
        if idx.ndim != 2 or idx.shape[0] != len(shape):
            raise ShapeError(f"{what}: COO indices of shape {idx.shape} for a tensor of shape {shape} "
                             f"(expected ({len(shape)}, nnz), one row per dim)")
        if idx.dtype.kind not in "iu":
            raise DTypeError(f"{what}: COO indices must be integers, got {idx.dtype}")
        if idx.dtype == np.uint64 and idx.size and int(idx.max()) >= 2 ** 63:  # would wrap negative
            raise ShapeError(f"{what}: COO index {int(idx.max())} out of range (shape {shape})")
        if vals.shape != (idx.shape[1],):
            raise ShapeError(f"{what}: {idx.shape[1]} COO indices but values of shape {vals.shape}")
        coords = idx.T.astype(np.int64)
        if len(coords):
            lo, hi = coords.min(axis=0), coords.max(axis=0)
            for d, n in enumerate(shape):
                if lo[d] < 0 or hi[d] >= n:
                    bad = int(lo[d]) if lo[d] < 0 else int(hi[d])
                    raise ShapeError(f"{what}: COO index {bad} out of range for dim {d} of size {n} "
                                     f"(shape {shape})")
        return coords, vals, shape, False
    if isinstance(data, (np.ndarray, list, float, int)) or hasattr(data, "__array__"):
        try:
            arr = np.asarray(data)
        except ValueError as e:  # ragged nested lists
            raise ShapeError(f"{what}: cannot read {type(data).__name__} as an array: {e}") from None
        if arr.ndim == 0:  # a scalar: one entry with no coordinates, or none (np.nonzero refuses 0-d)
            coords = np.zeros((int(arr != 0), 0), np.int64)
            return coords, arr.reshape(-1)[: len(coords)], (), True
        nz = np.nonzero(arr)
        return np.stack(nz, axis=1).astype(np.int64), arr[nz], arr.shape, True
    raise EinjoinError(f"{what}: cannot read a sparse tensor from {type(data).__name__} (give a "
                       f"scipy.sparse matrix, a torch sparse tensor, a pydata sparse.COO, an array, "
                       f"or COO arrays (indices, values, shape))")


def sparse(name: str, data: Any, block: int | Sequence[int] = 1) -> SparseTensor:
    """A sparse tensor from a ``scipy.sparse`` matrix or array, a ``torch.sparse_coo_tensor``
    (or CSR), a pydata ``sparse.COO``, a dense array (its non-zeros), or COO arrays
    ``(indices, values, shape)`` with indices of shape (rank, nnz); any rank. Duplicate entries
    are summed. ``block`` stores it as a block-sparse relation (one size, or one per dim).

    >>> import numpy as np, scipy.sparse, einjoin as ej
    >>> a = ej.sparse("A", scipy.sparse.random(40, 30, density=0.1, random_state=0), block=8)
    >>> a.block, a.nnz, np.allclose(a.todense(), a.to_scipy().toarray())
    ((8, 8), 120, True)
    """
    what = f"sparse {name!r}"
    if not isinstance(name, str) or not name:
        raise EinjoinError(f"sparse tensor name must be a non-empty string, got {name!r}")
    coords, vals, shape, summed = _coo_of(data, what)
    vals = _check_dtype(np.asarray(vals), what)
    try:
        blk = (block,) * len(shape) if isinstance(block, (int, np.integer)) else tuple(block)
        ok = len(blk) == len(shape) and all(_block_size(b) for b in blk)
    except TypeError:  # not a sequence (1.5, None)
        ok = False
    if not ok:
        raise ShapeError(f"{what}: block {block!r} for shape {shape} (one size >= 1, or one per dim)")
    blk = tuple(max(1, min(int(b), max(n, 1))) for b, n in zip(blk, shape))
    return from_coo(name, coords, vals, shape, blk, summed=summed)
