"""The buffers an imported forward writes (``self.count += 1``, a training-mode BatchNorm's
running statistics: ``TorchFunction.buffer_updates``), as a compiled program applies them: each
run computes their new values beside the outputs and writes them into the module's buffers
(torch does so in place at every call), so the next run, and the user, read the new values.

:func:`with_buffer_outputs` gives the import with the new values appended to its outputs and a
:class:`BufferWrites` that splits a run's results into the forward's and the buffers', and writes
the latter back.

>>> import torch, numpy as np, einjoin as ej
>>> class Counter(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.register_buffer("n", torch.zeros(()))
...     def forward(self, x):
...         self.n += 1
...         return x * self.n
>>> fn, writes = with_buffer_outputs(ej.from_torch(Counter(), (torch.ones(2),)))
>>> writes.names, len(fn.outputs)
(('n',), 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.frontend.bound_tensors import LiveTensor, feeds_of

__all__ = ["BufferWrites", "with_buffer_outputs"]


@dataclass(frozen=True)
class BufferWrites:
    """How a program's results end with the new values of the buffers its forward writes:
    ``users`` results are the forward's (returned in ``many`` / ``structure``), then one per name
    in ``names``, written into ``targets`` (the module's buffer, a :class:`LiveTensor`; a host
    array once the program was unpickled, detached from the module)."""

    names: tuple[str, ...]
    targets: tuple[Any, ...]
    users: int
    many: bool
    structure: Any

    def user_outputs(self, outs: Sequence[Any]) -> list[Any]:
        """The forward's results among a run's."""
        return list(outs[:self.users])

    def write(self, outs: Sequence[np.ndarray]) -> None:
        """Write the buffers' new values (the results after the forward's) into the buffers."""
        for name, target, value in zip(self.names, self.targets, outs[self.users:]):
            if isinstance(target, LiveTensor):
                target.write(value, name)
            elif target is not None:  # an unpickled program's own copy (a host array)
                np.copyto(target, np.asarray(value).astype(target.dtype, copy=False))


def with_buffer_outputs(fn: Any) -> tuple[Any, BufferWrites | None]:
    """``fn`` (``ej.from_torch``'s result) with the new values of the buffers its forward writes
    appended to its outputs (a flat tuple), and the :class:`BufferWrites` that undoes that; ``fn``
    itself and None when its forward writes none."""
    updates = dict(getattr(fn, "buffer_updates", None) or {})
    if not updates:
        return fn, None
    bound = feeds_of(fn.bound)
    # a module on the meta device binds nothing: None (it plans, and computes nothing to write)
    targets = tuple(bound.get(n) for n in updates)
    for name, t in zip(updates, targets):
        if t is not None and not isinstance(t, (LiveTensor, np.ndarray)):
            raise EinjoinError(f"the forward writes buffer {name!r}, bound to a {type(t).__name__}: "
                               f"einjoin can write back only into the module's tensor or an array")
    writes = BufferWrites(tuple(updates), targets, len(fn.outputs), bool(fn.many), fn.structure)
    outs = (*fn.outputs, *updates.values())
    return dataclasses.replace(fn, outputs=outs, many=True, structure=None), writes
