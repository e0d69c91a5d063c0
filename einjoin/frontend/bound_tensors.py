"""A torch module's parameters and buffers as a program's bound inputs: :class:`LiveTensor` (the
tensor itself, viewed as numpy when fed, so a storage that moves is followed) and
:class:`BoundTensors` (``TorchFunction.bound``); :func:`bind_tensor` makes one, :func:`feeds_of`
gives what a program keeps to feed at each run.

>>> import torch
>>> b = BoundTensors({"w": bind_tensor(torch.ones(2, 3))})
>>> b["w"].shape, type(feeds_of(b)["w"]).__name__
((2, 3), 'LiveTensor')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from einjoin.errors import DTypeError, EinjoinError

__all__ = ["LiveTensor", "LiveSparse", "BoundTensors", "bind_tensor", "bind_sparse", "feeds_of", "aliases"]


class LiveTensor:
    """A module's parameter or buffer bound to a graph input: the torch tensor itself (no copy),
    read as a numpy array (``np.asarray``: a zero-copy view) each time it is fed.

    Why not a numpy view taken once at import: a torch storage can change its data pointer in
    place. ``share_memory_()`` (``module.share_memory()``, or multiprocessing's pickler sending
    the module, or a program holding it, to a process pool) copies the data into shared memory
    and frees the old block, so a view taken before reads freed memory: silently wrong numbers.
    A view taken when fed follows the storage; copying every weight instead would double the
    memory of a large model. ``source`` is the module's tensor object itself, so that what it
    holds now is read: ``p.data = new`` and in-place writes (a non-contiguous CPU tensor is
    viewed with its strides, so a write through ``p.data``, which no version counts, is seen
    too) are followed; a tensor numpy cannot view (on a GPU, sparse, a conj / neg bit) is
    copied again at every feed, for the same reason (see :meth:`now`). A dtype change
    (``module.half()`` / ``.double()``, which swap ``.data``) is refused at the next feed: the
    program computes in the dtype it was compiled for.

    ``where`` (the root module and the qualified names that held the tensor at import, each split
    at its dots): the tensor object is looked up by that path at each feed, so one *replaced* by
    another (``lin.weight = nn.Parameter(w)``, ``load_state_dict(sd, assign=True)``, a new
    submodule) is followed, as torch's next call would read it. A few attribute reads per tensor
    per run; a tied weight's other names are checked to hold the same tensor still."""

    __slots__ = ("source", "tensor", "_cache", "_where", "_dtype")

    def __init__(self, source: Any, tensor: Any = None,
                 where: tuple[Any, tuple[tuple[str, ...], ...]] | None = None):
        self.source = source  # the module's tensor (a Parameter: what .data holds can change)
        self.tensor = _dense(source) if tensor is None else tensor  # detached, CPU, dense, contiguous
        self._cache: tuple[Any, np.ndarray] | None = None  # (the source's key when viewed, the view)
        self._where = where
        self._dtype = self.tensor.dtype  # what the program was compiled for (see current())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.current().shape)

    def current(self) -> Any:
        """The module's tensor now: what its path holds (followed when replaced), else the tensor
        bound at import. A replacement of another shape, or a path that holds no tensor now, or
        the names of a tied weight holding different tensors, is an error naming them."""
        where = self._where
        if where is None:
            return self._same_dtype(self.source, "a module tensor")
        root, paths = where
        src = _follow(root, paths[0])
        for more in paths[1:]:  # a tied weight (one graph input): every name must hold it still
            if _follow(root, more) is not src:
                raise EinjoinError(f"{'.'.join(paths[0])} and {'.'.join(more)} were one tensor when the module "
                                   f"was imported and now differ (a tied weight replaced on one side): the "
                                   f"program computes with one tensor for both; import the module again")
        if src is not self.source:
            import torch
            old = self.source
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(old.shape):
                what = (f"{type(src).__name__}" if not isinstance(src, torch.Tensor)
                        else f"{src.dtype}{list(src.shape)}")
                raise EinjoinError(f"the module's {'.'.join(paths[0])} is now {what}; the program was "
                                   f"compiled for {old.dtype}{list(old.shape)}: import the module again")
            self.source = src  # the new object from now on (a feed compares its key: viewed again)
        return self._same_dtype(src, ".".join(paths[0]))

    def _same_dtype(self, src: Any, name: str) -> Any:
        # module.half() / .double() / .to(dtype) after import: torch's next call computes in the
        # new dtype (float16 rounds every op's result), the program in the old one; an exact cast
        # of the feed would still give other numbers and another output dtype than torch's
        if src.dtype != self._dtype:
            raise DTypeError(f"the module's {name} is now {src.dtype}; the program was compiled for "
                               f"{self._dtype} (the module's dtype changed after import, e.g. "
                               f"module.half()): import the module again")
        return src

    def now(self) -> np.ndarray:
        """A zero-copy numpy view of the tensor's storage where it is now (the last one while the
        source's storage, version, dtype and layout are unchanged), with the tensor's strides: a
        non-contiguous CPU tensor is viewed too, never copied, because a write through ``p.data``
        (``p.data.mul_(2)``) leaves ``p._version`` as it was and a copy would go stale. A source
        numpy cannot view (another device, sparse, conj / neg bits) is copied at every call, for
        that reason: no counter sees a write through ``.data`` (on a GPU module one device-to-host
        copy of each such tensor per run)."""
        src = self.current()
        if not _viewable(src):
            t = _dense(src)  # what the source holds now: a cache could not know that it changed
            self.tensor = t
            return _as_numpy(t)
        key = (src.data_ptr(), src._version, src.dtype, tuple(src.shape), src.stride())
        cache = self._cache
        if cache is not None and cache[0] == key:
            return cache[1]
        t = src.detach()
        arr = _as_numpy(t)
        self.tensor, self._cache = t, (key, arr)
        return arr

    def write(self, value: np.ndarray, name: str) -> None:
        """Write ``value`` into the module's tensor in place (a forward's buffer write, which torch
        makes in place at every call): the module, and the next run's feed, hold it."""
        import torch
        src = self.current()
        arr = np.asarray(value, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        if arr.dtype.kind == "V" or arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: its bits
            new = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            new = torch.from_numpy(arr)
        if tuple(new.shape) != tuple(src.shape):
            raise EinjoinError(f"buffer {name!r} is {list(src.shape)} in the module now, but the program "
                               f"computes its new value as {list(new.shape)}: import the module again")
        with torch.no_grad():
            src.copy_(new)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.now()
        if dtype is not None and arr.dtype != dtype:
            return arr.astype(dtype)
        return np.array(arr) if copy else arr

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:
        # pickled as its values (a numpy array, standard pickling: a copy in the stream), never as
        # the tensor: multiprocessing's pickler (a process pool) would move the module's storage to
        # shared memory in place, freeing the block a run in progress here may be reading
        return np.asarray, (np.asarray(self),)

    def __repr__(self) -> str:
        return f"LiveTensor({self.tensor.dtype}{list(self.tensor.shape)})"


class LiveSparse(LiveTensor):
    """A module's sparse buffer (a torch COO / CSR tensor: a GNN's adjacency) bound to a sparse
    input (``ej.sparse_input``): fed as the torch sparse tensor the module holds now, which the
    sparse input's feed reads into its keys and values; never densified. Followed by its path
    as a :class:`LiveTensor` is (``model.adj = other`` of the same shape is fed at the next run)."""

    __slots__ = ()

    def now(self) -> Any:
        return self.current().detach()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        raise EinjoinError(f"a sparse module tensor {self.tensor.dtype}{list(self.tensor.shape)} is fed as a "
                           f"sparse tensor at each run and has no dense array (read the torch tensor with .now(); "
                           f"prog.save writes its stored entries)")

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _itself, (self.now().clone(),)  # a copy, as LiveTensor's (never the module's storage)

    def __repr__(self) -> str:
        return f"LiveSparse({self.tensor.dtype}{list(self.tensor.shape)}, {self.tensor.layout})"


def _itself(x: Any) -> Any:
    return x


def bind_sparse(t: Any, root: Any = None, names: tuple[str, ...] = ()) -> LiveSparse:
    """A module's sparse tensor as its bound value (:class:`LiveSparse`): fed as it is at each run."""
    paths = tuple(tuple(n.split(".")) for n in names)
    held = tuple(p for p in paths if _holds(root, p, t)) if root is not None else ()
    return LiveSparse(t, t.detach(), (root, held) if held else None)


class BoundTensors(Mapping[str, np.ndarray]):
    """:attr:`TorchFunction.bound`: name -> value, each lookup a numpy view of the module's
    tensor as it is now (:class:`LiveTensor` says why); :meth:`feeds` gives what a program keeps
    and feeds at each run (the live tensors, not views)."""

    def __init__(self, values: Mapping[str, Any] | None = None):
        self._values: dict[str, Any] = dict(values or {})

    def __getitem__(self, name: str) -> np.ndarray:
        from einjoin.ir.reference import to_numpy
        v = self._values[name]
        if isinstance(v, LiveSparse):  # a sparse buffer: fed as the torch sparse tensor
            return v.now()  # type: ignore[no-any-return]
        return to_numpy(v, f"bound tensor {name!r}")

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BoundTensors):
            return self._values == other._values
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def feeds(self) -> dict[str, Any]:
        """Name -> the value to feed (a :class:`LiveTensor` or an array), read at each run."""
        return dict(self._values)

    def with_values(self, values: Mapping[str, Any]) -> BoundTensors:
        return BoundTensors({**self._values, **values})

    def __repr__(self) -> str:
        return f"BoundTensors({list(self._values)})"


def feeds_of(bound: Mapping[str, Any]) -> dict[str, Any]:
    """What a program keeps of ``bound`` to feed at each run (``BoundTensors.feeds``; a plain
    mapping's values as they are)."""
    return bound.feeds() if isinstance(bound, BoundTensors) else dict(bound)


def _viewable(t: Any) -> bool:
    """Whether numpy can view ``t``'s storage as it is (a strided CPU tensor without lazy bits)."""
    import torch
    return bool(t.layout == torch.strided and t.device.type == "cpu" and not t.is_conj() and not t.is_neg())


def _as_numpy(t: Any) -> np.ndarray:
    """A strided CPU tensor's numpy view (bfloat16, which numpy lacks, as ml_dtypes' type)."""
    import torch
    if t.dtype == torch.bfloat16:  # its bits, viewed as ml_dtypes' bfloat16
        import ml_dtypes
        arr: np.ndarray = t.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16)
        return arr
    return t.numpy()  # type: ignore[no-any-return]


def _dense(t: Any) -> Any:
    """``t`` detached as a dense contiguous CPU tensor: the same storage when it is one already."""
    import torch
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.cpu().contiguous().resolve_conj().resolve_neg()


def aliases(canon: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """``canon`` (every qualified name of a module's tensor -> the one it is bound under) turned
    round: that name -> all its qualified names (a tied weight's several; its own first), for
    :func:`bind_tensor`.

    >>> aliases({"wte.weight": "wte.weight", "lm_head.weight": "wte.weight", "b": "b"})
    {'wte.weight': ('wte.weight', 'lm_head.weight'), 'b': ('b',)}
    """
    names: dict[str, list[str]] = {}
    for n, c in canon.items():
        names.setdefault(c, [c]).extend([n] if n != c else [])
    return {c: tuple(ns) for c, ns in names.items()}


def _follow(root: Any, path: tuple[str, ...]) -> Any:
    """What ``root``'s attribute path holds now (``("0", "weight")``: ``root[0].weight``)."""
    try:  # the usual case, read from the modules' own tables (nn.Module.__getattr__ costs ~1 us a step)
        m = root
        for part in path[:-1]:
            m = m._modules[part]
        leaf = path[-1]
        if leaf in m._parameters:
            return m._parameters[leaf]
        if leaf in m._buffers:
            return m._buffers[leaf]
    except (AttributeError, KeyError, TypeError):
        pass
    t = root
    try:
        for part in path:
            t = getattr(t, part)
    except AttributeError:
        raise EinjoinError(f"the module has no {'.'.join(path)} now (it had when it was imported): "
                           f"import the module again") from None
    return t


def bind_tensor(t: Any, root: Any = None, names: tuple[str, ...] = ()) -> LiveTensor:
    """A module tensor as its bound value: the same storage when it is already a dense contiguous
    CPU tensor (a converted copy otherwise), checked now to be readable as an array; the module's
    tensor object is kept, so later changes to what it holds are followed (:class:`LiveTensor`).
    ``names``: the qualified names under which ``root`` (the imported module) holds ``t``; those
    that do now are looked up at each feed (a replaced parameter is followed)."""
    from einjoin.ir.reference import to_numpy
    dense = _dense(t)
    to_numpy(dense, "module tensor")  # a dtype numpy has no type for is refused at import, as before
    paths = tuple(tuple(n.split(".")) for n in names)
    held = tuple(p for p in paths if _holds(root, p, t)) if root is not None else ()
    return LiveTensor(t, dense, (root, held) if held else None)


def _holds(root: Any, path: tuple[str, ...], t: Any) -> bool:
    try:
        return _follow(root, path) is t
    except EinjoinError:  # a constant torch.export lifted (no attribute of the module)
        return False
