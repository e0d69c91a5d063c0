"""A compiled program's state: values that persist between runs (``ej.compile(...,
state={new: input})``: parameters, optimizer moments, a step count), kept resident on their
devices by :class:`~einjoin.runtime.state.Resident` and read or written on request.
:class:`ProgramState` is the part of :class:`~einjoin.program.Program` that handles it.

>>> import numpy as np, einjoin as ej
>>> w = ej.input("w", (2,))
>>> prog = ej.compile([w * 2.0], state={w * 2.0: w}, quiet=True)
>>> prog.write_state({"w": np.ones(2, np.float32)})
>>> _ = prog.run(), prog.run()
>>> prog.read_state()["w"]
array([4., 4.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.ir.reference import bind_feeds
from einjoin.runtime.state import Resident, StateRun, StateSlot

__all__ = ["ProgramState"]


def _assemble(node: Node, blocks: Mapping[Any, Any], backend: str) -> np.ndarray:
    """A state value from its resident blocks (box -> block); a backend that computes nothing
    has none to give."""
    if any(b is None for b in blocks.values()):
        raise EinjoinError(f"the {backend} backend computes no values: there is no state to read")
    out = np.empty(node.shape, dtype=next(iter(blocks.values())).dtype)
    for box, b in blocks.items():
        out[tuple(slice(a, e) for a, e in box)] = b
    return out


class ProgramState:
    """State handling of a :class:`~einjoin.program.Program` (a base class: the program sets
    these attributes)."""

    graph: Graph
    backend: Any
    _slots: tuple[StateSlot, ...]
    _resident: Resident

    def _with_state(self, values: dict[Node, np.ndarray]) -> tuple[dict[Node, np.ndarray], StateRun | None]:
        """The run's feeds and its view of the state (under the state lock): a state input not fed
        takes its resident value (blocks on the devices, or a host array: then it is fed)."""
        if not self._slots:
            return values, None
        run = StateRun(self._slots, len(self.graph.outputs) - len(self._slots))
        res = self._resident
        values = dict(values)
        missing = []
        for s in self._slots:
            if s.node in values:
                continue  # fed explicitly: replaces the resident value (loaded and counted)
            if s.node in res.blocks:
                run.resident[s.node] = res.blocks[s.node]
            elif s.node in res.refs:
                run.refs[s.node] = res.refs[s.node]
            elif s.node in res.host:
                values[s.node] = res.host[s.node]
                if s.node not in res.written:  # a capped graph's state in host RAM: reloaded
                    run.on_host.add(s.node)
            else:
                missing.append(s.name)
        if missing:
            raise EinjoinError(f"state input(s) {', '.join(map(repr, missing))} have no value yet: feed them "
                               f"in the first run (prog.run(..., {missing[0]}=...)) or call prog.write_state")
        return values, run

    @property
    def state(self) -> tuple[str, ...]:
        """The names of the state inputs (``ej.compile(..., state={new: input})``), in the given order."""
        return tuple(s.name for s in self._slots)

    def has_state(self) -> bool:
        """Whether every state input has a value (from a run, or :meth:`write_state`)."""
        with self._resident.lock:
            return all(self._resident.has(s.node) for s in self._slots)

    def _slot(self, name: Any) -> Any:
        for s in self._slots:
            if s.name == name:
                return s
        raise EinjoinError(f"{name!r} is not a state input of this program; its state: "
                           f"{', '.join(self.state) or '(none)'}")

    def read_state(self, names: Sequence[str] | str | None = None) -> dict[str, np.ndarray]:
        """The state's current values as host arrays (copies), by input name (``names``: some of
        them; default all). Only this reads state back to the host. A state input without a value
        yet raises an :class:`EinjoinError`."""
        wanted = self.state if names is None else ((names,) if isinstance(names, str) else tuple(names))
        slots = [self._slot(n) for n in wanted]
        out: dict[str, np.ndarray] = {}
        with self._resident.lock:
            res = self._resident
            for s in slots:
                if s.node in res.blocks:
                    out[s.name] = _assemble(s.node, res.blocks[s.node], self.backend.name)
                elif s.node in res.refs:
                    out[s.name] = _assemble(s.node, self.backend.read_state(res.refs[s.node]), self.backend.name)
                elif s.node in res.host:
                    if res.host[s.node] is None:
                        raise EinjoinError(f"the {self.backend.name} backend computes no values: there is no "
                                           f"state to read")
                    out[s.name] = np.array(res.host[s.node])
                else:
                    raise EinjoinError(f"state input {s.name!r} has no value yet (run the program or write_state)")
        return out

    def write_state(self, values: Mapping[str, Any]) -> None:
        """Set state values from host arrays (by input name; shapes and dtypes checked as feeds
        are). The next run loads them (counted in its ``bytes_loaded``) and carries on from them."""
        if not isinstance(values, Mapping):
            raise EinjoinError(f"write_state takes a mapping name -> array, got {type(values).__name__}")
        slots = {n: self._slot(n) for n in values}
        checked = bind_feeds(self.graph, (), dict(values), self.graph.input_by_name.keys())
        with self._resident.lock:
            for s in slots.values():
                self._release(self._resident.set_host(s.node, np.array(checked[s.node], order="C")))

    def _release(self, refs: list[Any]) -> None:
        """Drop state blocks a remote backend keeps that nothing refers to any more."""
        release = getattr(self.backend, "release_state", None)
        if release is not None:
            for r in refs:
                release(r)
