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

__all__ = ["LiveTensor", "BoundTensors", "bind_tensor", "feeds_of"]


class LiveTensor:
    """A module's parameter or buffer bound to a graph input: the torch tensor itself (no copy),
    read as a numpy array (``np.asarray``: a zero-copy view) each time it is fed.

    Why not a numpy view taken once at import: a torch storage can change its data pointer in
    place. ``share_memory_()`` (``module.share_memory()``, or multiprocessing's pickler sending
    the module, or a program holding it, to a process pool) copies the data into shared memory
    and frees the old block, so a view taken before reads freed memory: silently wrong numbers.
    A view taken when fed follows the storage; copying every weight instead would double the
    memory of a large model."""

    __slots__ = ("tensor", "_view", "_at")

    def __init__(self, tensor: Any):
        self.tensor = tensor  # detached, on the CPU, dense and contiguous (bind_tensor)
        self._view: np.ndarray | None = None
        self._at = -1  # the data address _view was taken at

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def now(self) -> np.ndarray:
        """A zero-copy numpy view of the tensor's storage where it is now (the last one while the
        storage has not moved: a view is its address, shape and dtype)."""
        t = self.tensor
        at = t.data_ptr()
        arr = self._view
        if arr is None or at != self._at:  # first use, or the storage moved: a view of where it is now
            import torch
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, as ml_dtypes' type
                import ml_dtypes
                arr = t.view(dtype=torch.int16).numpy().view(ml_dtypes.bfloat16)
            else:
                arr = t.numpy()
            self._view, self._at = arr, at
        return arr

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


class BoundTensors(Mapping[str, np.ndarray]):
    """:attr:`TorchFunction.bound`: name -> value, each lookup a numpy view of the module's
    tensor as it is now (:class:`LiveTensor` says why); :meth:`feeds` gives what a program keeps
    and feeds at each run (the live tensors, not views)."""

    def __init__(self, values: Mapping[str, Any] | None = None):
        self._values: dict[str, Any] = dict(values or {})

    def __getitem__(self, name: str) -> np.ndarray:
        from einjoin.ir.reference import to_numpy
        return to_numpy(self._values[name], f"bound tensor {name!r}")

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


def bind_tensor(t: Any) -> LiveTensor:
    """A module tensor as its bound value: the same storage when it is already a dense contiguous
    CPU tensor (a converted copy otherwise), checked now to be readable as an array."""
    from einjoin.ir.reference import to_numpy
    import torch
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().contiguous().resolve_conj().resolve_neg()
    to_numpy(t, "module tensor")  # a dtype numpy has no type for is refused at import, as before
    return LiveTensor(t)
