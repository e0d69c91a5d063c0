"""Programs per shape signature: an imported torch module's program called with other shapes is
captured and compiled again for them, once per signature, and kept in an LRU cache.

A *shape signature* is the shapes of the forward arguments the graph reads, by name, in the
forward's order. :func:`signature` reads it from a run's arguments and checks it against the
shapes compiled for and ``from_torch(..., dynamic=...)``: with ``dynamic``, only the dims it
names may differ (each named dim's symbol is one size across arguments); without it, any shape
may (the issue's "simply calling an imported program with new shapes").
:class:`ShapeCache` is the LRU of compiled programs with its hit and miss counts; the program
compiled by ``ej.compile`` itself is not in it (it is never evicted).

>>> cache = ShapeCache(2)
>>> cache.put((("x", (4, 3)),), "prog4"); cache.put((("x", (8, 3)),), "prog8")
>>> cache.get((("x", (4, 3)),)), cache.get((("x", (2, 3)),)), (cache.hits, cache.misses)
('prog4', None, (1, 1))
>>> cache.put((("x", (2, 3)),), "prog2")  # evicts the least recently used: (8, 3)
>>> list(cache.keys()) == [(("x", (4, 3)),), (("x", (2, 3)),)]
True
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from einjoin.errors import EinjoinError, ShapeError

__all__ = ["ShapeCache", "Signature", "signature", "check_cache_size", "example_tensors", "call_template",
           "bind_call"]

Signature = tuple[tuple[str, tuple[int, ...]], ...]
"""A shape signature: ((forward argument name, shape), ...) in the forward's order."""

_V = TypeVar("_V")


def check_cache_size(size: Any, what: str = "shape_cache") -> int | None:
    """A cache size is an int >= 1, or None (unbounded)."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EinjoinError(f"{what} must be an int >= 1 (programs kept per shape signature) or None, got "
                           f"{size!r:.60}")
    return size


class ShapeCache(Generic[_V]):
    """An LRU mapping shape signature -> compiled program, ``maxsize`` entries (None: no bound,
    and the entries stay in insertion order), counting ``hits`` and ``misses`` of :meth:`get`.
    Thread-safe; holds no lock when pickled. ``ej.Trainer`` keeps its step programs in one."""

    def __init__(self, maxsize: int | None = 8):
        self.maxsize = check_cache_size(maxsize)
        self._items: OrderedDict[Any, _V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.lock = threading.RLock()  # also held by a caller compiling a missing entry

    def get(self, key: Any, default: Any = None) -> Any:
        """The entry for ``key`` (now the most recently used; a hit), else ``default`` (a miss)."""
        with self.lock:
            if key in self._items:
                if self.maxsize is not None:  # unbounded: nothing is evicted, insertion order kept
                    self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            return default

    def put(self, key: Any, value: _V) -> None:
        """Add or replace ``key``'s entry, evicting the least recently used beyond ``maxsize``."""
        with self.lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while self.maxsize is not None and len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    __setitem__ = put

    def __getitem__(self, key: Any) -> _V:
        return self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items))

    def keys(self) -> list[Any]:
        return list(self._items)

    def values(self) -> list[_V]:
        return list(self._items.values())

    def items(self) -> list[tuple[Any, _V]]:
        return list(self._items.items())

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()

    def __repr__(self) -> str:
        return f"<ShapeCache {len(self)}/{self.maxsize} programs, {self.hits} hits, {self.misses} misses>"


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        try:
            shape = np.shape(value)
        except Exception:  # noqa: BLE001 - not array-like: bind_feeds says so
            return None
    return tuple(int(d) for d in shape)


def _is_sparse(value: Any) -> bool:
    """A torch sparse tensor or a scipy.sparse matrix (an imported module's sparse argument)."""
    mod = type(value).__module__ or ""
    return mod.startswith("scipy.sparse") or (mod.startswith("torch") and str(getattr(value, "layout", "")) not in
                                               ("", "torch.strided"))


def _stored(value: Any) -> int:
    """The stored entries of a torch sparse tensor or a scipy.sparse matrix (an upper bound of the
    entries its feed keeps: duplicates of an uncoalesced COO are summed there)."""
    nnz = value._nnz() if hasattr(value, "_nnz") else getattr(value, "nnz", 0)
    return int(nnz)


def capacity_for(nnz: int, compiled: int, shape: Sequence[int]) -> int:
    """The capacity of a sparse argument's program for a run storing ``nnz`` entries, where the
    program was compiled for ``compiled``: that one while it holds them, else the next power of two
    (so a growing graph recompiles once per doubling, not per call), at most the dense size.

    >>> capacity_for(8, 10, (6, 6)), capacity_for(11, 10, (6, 6)), capacity_for(33, 10, (6, 6))
    (10, 16, 36)
    """
    if nnz <= compiled:
        return compiled
    # at most the dense size: an uncoalesced argument's raw entries may exceed it, its feed sums them
    return min(1 << (nnz - 1).bit_length(), int(np.prod(shape, dtype=np.int64)))


def shown(shapes: Mapping[str, tuple[int, ...]], given: Mapping[str, Any]) -> str:
    """``shapes`` (a signature's) for a log line: a sparse argument's as its capacity.

    >>> shown({"x": (8, 4)}, {})
    'x (8, 4)'
    """
    return ", ".join(f"{n} nnz<={s[0]}" if _is_sparse(given.get(n)) else f"{n} {tuple(s)}" for n, s in shapes.items())


def signature(arg_names: Sequence[str], compiled: Mapping[str, tuple[int, ...]], given: Mapping[str, Any],
              dynamic: Mapping[str, Mapping[int, str]]) -> Signature | None:
    """The shape signature of a run's forward arguments ``given`` (name -> value), or None when
    it is the one compiled for (``compiled``: name -> shape of each argument the graph reads;
    an argument not given is left to the feed check). With ``dynamic`` only its named dims may
    differ, and the dims sharing a symbol must agree: else a :class:`ShapeError` naming the
    argument, the dim, the size compiled for and the size given.

    >>> signature(("x",), {"x": (4, 3)}, {"x": np.zeros((4, 3))}, {}) is None
    True
    >>> signature(("x",), {"x": (4, 3)}, {"x": np.zeros((8, 3))}, {"x": {0: "batch"}})
    (('x', (8, 3)),)
    >>> signature(("x",), {"x": (4, 3)}, {"x": np.zeros((4, 5))}, {"x": {0: "batch"}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    einjoin.errors.ShapeError: input 'x' dim 1 is not dynamic: the program was compiled for size 3, got 5 ...
    """
    shapes: dict[str, tuple[int, ...]] = {}
    sparse: set[str] = set()
    for name in arg_names:
        if name in compiled and name in given:
            if _is_sparse(given[name]):  # its input is its values (capacity,): its feed checks the shape
                sparse.add(name)
                shapes[name] = (capacity_for(_stored(given[name]), compiled[name][0], given[name].shape),)
                continue
            got = _shape(given[name])
            if got is None:
                return None  # not an array: the feed check names it
            shapes[name] = got
    if all(shapes[n] == compiled[n] for n in shapes):
        return None
    if dynamic:
        sizes: dict[str, tuple[str, int, int]] = {}  # symbol -> (argument, dim, size) first seen
        for name, got in shapes.items():
            if name in sparse:  # a capacity, not a dim
                continue
            want, dims = compiled[name], dynamic.get(name, {})
            if len(got) != len(want):
                raise ShapeError(f"input {name!r} has {len(got)} dims (shape {got}), but the program was "
                                 f"compiled for {len(want)} (shape {want}); only the dims that "
                                 f"from_torch(..., dynamic=...) names may change")
            for d, (w, g) in enumerate(zip(want, got)):
                if d not in dims:
                    if w != g:
                        named = ", ".join(map(str, sorted(dims))) or "none"
                        raise ShapeError(f"input {name!r} dim {d} is not dynamic: the program was compiled "
                                         f"for size {w}, got {g} (shape {got}; from_torch(..., dynamic=...) "
                                         f"names dims {named} of {name!r})")
                    continue
                sym = dims[d]
                first = sizes.setdefault(sym, (name, d, g))
                if first[2] != g:
                    raise ShapeError(f"dynamic dim {sym!r} has two sizes: input {first[0]!r} dim {first[1]} "
                                     f"is {first[2]} but input {name!r} dim {d} is {g}")
    return tuple(shapes.items())


def example_tensors(arg_names: Sequence[str], shapes: Mapping[str, tuple[int, ...]],
                    dtypes: Mapping[str, str], given: Mapping[str, Any]) -> tuple[Any, ...]:
    """Example arguments for a recapture, in the forward's order: zeros of each read argument's
    new shape and compiled dtype (a capture reads shapes and dtypes, never values); an argument
    the graph does not read is passed as given (it must be given)."""
    import torch
    out = []
    for name in arg_names:
        if name in shapes and name in given and _is_sparse(given[name]):
            out.append(_sparse_example(given[name], shapes[name][0], getattr(torch, dtypes[name])))
        elif name in shapes:
            out.append(torch.zeros(shapes[name], dtype=getattr(torch, dtypes[name])))
        elif name in given:
            v = given[name]
            out.append(v if isinstance(v, torch.Tensor) else torch.as_tensor(v))
        else:
            raise EinjoinError(f"to run with other shapes the module is imported again, which needs every "
                               f"forward argument: {name!r} is not given")
    return tuple(out)


def _sparse_example(value: Any, capacity: int, dtype: Any) -> Any:
    """A torch sparse example of ``value``'s shape and layout (CSR stays CSR; COO otherwise) that
    stores ``capacity`` distinct entries (zeros): the import gives its argument that capacity."""
    import torch
    shape = tuple(int(d) for d in value.shape)
    idx = torch.as_tensor(np.stack(np.unravel_index(np.arange(capacity), shape)), dtype=torch.int64)
    coo = torch.sparse_coo_tensor(idx, torch.zeros(capacity, dtype=dtype), shape).coalesce()
    csr = getattr(value, "layout", None) == torch.sparse_csr or getattr(value, "format", "") == "csr"
    return coo.to_sparse_csr() if csr else coo



# ---------------------------------------------------------------- torch-style calls

Template = Any
"""How one forward parameter reaches the graph: ``("in", input name)`` (a tensor), ``("tuple",
[templates])`` / ``("list", [templates])`` (a structure holding tensors, flattened as torch.export
flattens it: ``hx`` -> ``hx_0``, ``hx_1``) or ``("const", value)`` (a value the graph was
specialised on)."""


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


def _template(value: Any, name: str, arg_names: Sequence[str]) -> Template | None:
    """``value``'s template under parameter (or flattened) name ``name``; None where a tensor in
    it is no graph argument of that name (it cannot be bound)."""
    if _is_array(value):
        return ("in", name) if name in arg_names else None
    if isinstance(value, (tuple, list)):
        items = [_template(v, f"{name}_{i}", arg_names) for i, v in enumerate(value)]
        if any(t is None for t in items):
            return None
        if any(t is not None and t[0] != "const" for t in items):
            return ("tuple" if isinstance(value, tuple) else "list", items)
    elif isinstance(value, Mapping) and any(_is_array(v) for v in value.values()):
        return None
    return ("const", value)


def call_template(call_args: Sequence[str], constants: Mapping[str, Any], arg_names: Sequence[str],
                  defaults: Mapping[str, Any] | None = None) -> tuple[tuple[str, Template], ...] | None:
    """The forward's parameters as an import saw them (``TorchFunction.call_args`` with its
    ``constants`` and ``arg_names``): (parameter name, template) in the example's order, for
    :func:`bind_call`; None where some parameter cannot be bound to the graph's inputs.

    >>> call_template(("x", "hx", "scale"), {"hx": (np.zeros(2), np.zeros(2)), "scale": 2.0},
    ...               ("x", "hx_0", "hx_1"))
    (('x', ('in', 'x')), ('hx', ('tuple', [('in', 'hx_0'), ('in', 'hx_1')])), ('scale', ('const', 2.0)))
    """
    out = []
    for name in call_args:
        if name in arg_names:
            t: Template | None = ("in", name)
        elif name in constants:
            t = _template(constants[name], name, arg_names)
            d = (defaults or {}).get(name, constants[name])
            if (t is not None and t[0] == "const" and not _same(d, constants[name])
                    and (d is None or isinstance(d, (bool, int, float, str)))):
                # left out at run(), torch would use this default, not the import's value
                t = ("const", constants[name], d)
        else:
            t = None
        if t is None:
            return None
        out.append((name, t))
    return tuple(out)


class _Flat(Exception):
    """The call gives a flattened tensor where the template has a structure or a constant: it is
    the graph's own calling convention (``run(x, h, c)``), bound as such."""


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare (arrays) are not the same
        return False


def _match(name: str, t: Template, value: Any, out: dict[str, Any]) -> None:
    kind = t[0]
    if kind == "in":
        out[t[1]] = value
        return
    if _is_array(value):
        raise _Flat
    if kind == "const":
        if not _same(value, t[1]):
            raise EinjoinError(f"argument {name!r} is {value!r:.60}, but the program was specialised on the "
                               f"import's value {t[1]!r:.60} (torch.export fixes non-tensor arguments): "
                               f"give {t[1]!r:.60} or leave it out, or import the module again with {name}="
                               f"{value!r:.40} in from_torch's example arguments for the other value")
        return
    items = t[1]
    if not isinstance(value, (tuple, list)) or len(value) != len(items):
        got = f"{type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else type(value).__name__
        raise EinjoinError(f"argument {name!r} must be a {kind} of {len(items)} (as at the import), got {got}")
    for i, (sub, v) in enumerate(zip(items, value)):
        _match(f"{name}[{i}]", sub, v, out)


def _match_const_array(name: str, const: Any, value: Any) -> None:
    """A numpy scalar or 0-d tensor given by name for a non-tensor argument: the import's value
    (``scale=np.float64(2.0)`` computes what ``scale=2.0`` does), else an error naming it (the
    program has no input of that name: "unknown input" would say the forward has no such
    argument)."""
    if getattr(value, "ndim", None) == 0 and _same(value, const):
        return
    raise EinjoinError(f"argument {name!r} is {type(value).__name__} {value!r:.60}, but the program was "
                       f"specialised on the import's value {const!r:.60} (torch.export fixes non-tensor "
                       f"arguments): give {const!r:.60} or leave it out, or import the module again with "
                       f"this argument in from_torch's example arguments")


def bind_call(call: Sequence[tuple[str, Template]] | None, arg_names: Sequence[str], args: Sequence[Any],
              feeds: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A torch-style call ``run(x, (h, c), 2.0, flip=True)`` as the graph's own: (positional
    arguments, feeds by input name). Non-tensor arguments must equal the import's (an
    :class:`EinjoinError` names the argument and both values; left out, the import's hold, unless
    the forward's default differs: then torch would use the default, and that is an error too);
    tuples and lists are flattened as at the import. A call already in the graph's convention
    (flattened tensors ``run(x, h, c)``, inputs by their graph names) is returned as it is.

    >>> call = (("x", ("in", "x")), ("hx", ("tuple", [("in", "hx_0"), ("in", "hx_1")])), ("k", ("const", 2)))
    >>> x, h, c = np.zeros(1), np.ones(1), np.full(1, 2.0)
    >>> args, feeds = bind_call(call, ("x", "hx_0", "hx_1"), (x, (h, c)), {"k": 2})
    >>> args, sorted(feeds)
    ((), ['hx_0', 'hx_1', 'x'])
    >>> bind_call(call, ("x", "hx_0", "hx_1"), (x, h, c), {})[0] == (x, h, c)  # the flat convention
    True
    """
    if call is None or len(args) > len(call):
        return tuple(args), dict(feeds)
    params = dict(call)
    if (all(t[0] == "in" for _, t in call) and not any(k in params and k not in arg_names for k in feeds)):
        return tuple(args), dict(feeds)  # every parameter a tensor input: the graph's convention
    out: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    try:
        for (name, t), v in zip(call, args):
            _match(name, t, v, out)
        for k, v in feeds.items():
            if k in params and params[k][0] != "in":
                if k in [n for n, _ in call[:len(args)]]:
                    raise EinjoinError(f"argument {k!r} is given both by position and by name")
                if params[k][0] == "const" and _is_array(v):  # by name: never the flat convention
                    _match_const_array(k, params[k][1], v)
                    continue
                _match(k, params[k], v, out)
            else:
                rest[k] = v
    except _Flat:
        return tuple(args), dict(feeds)
    for k in rest:
        if k in out:
            raise EinjoinError(f"input {k!r} is given both by position and by name")
    given = {n for n, _ in call[:len(args)]} | set(feeds)
    for name, t in call:
        if name not in given and t[0] == "const" and len(t) == 3:
            raise EinjoinError(f"argument {name!r} is left out, so torch would use its default {t[2]!r:.60}, "
                               f"but the program was specialised on the import's value {t[1]!r:.60}: give "
                               f"{name}={t[1]!r:.40}, or import the module with the default")
    return (), {**out, **rest}
