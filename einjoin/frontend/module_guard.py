"""What an import assumed of the module beyond its tensors, checked before each run: torch.export
specialises the graph on each submodule's type, its ``training`` flag and the plain Python values
its forward reads (``self.scale = 2.0``, ``self.causal = True``, a kernel size). After
``module.eval()``, ``module.train()`` or ``m.scale = 3.0`` torch's next call computes something
else, and a program still computing the import's graph would be silently wrong: the run is
refused, naming what changed. Replaced parameters are followed instead
(:class:`~einjoin.frontend.bound_tensors.LiveTensor`); a submodule replaced by one of the same
type and settings keeps the graph valid, and is accepted.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
>>> guard = ModuleGuard(m)
>>> guard.check()
>>> _ = m[1].train()
>>> try:
...     guard.check()
... except Exception as e:
...     print(str(e).split(";")[0])
the module's 1.training is True now, False when it was imported
"""

from __future__ import annotations

from typing import Any

from einjoin.errors import EinjoinError

__all__ = ["ModuleGuard"]

_MISSING = object()
_PLAIN = (bool, int, float, str, type(None))


def _torch_own() -> frozenset[str]:
    """nn.Module's own bookkeeping attributes (``_is_full_backward_hook``, set by registering a
    hook): no forward reads them, so changing them changes nothing the capture assumed."""
    import torch
    return frozenset(k for k in vars(torch.nn.Module()) if k != "training")


def _plain(v: Any) -> bool:
    """A value the capture can have specialised on and that compares by value."""
    if isinstance(v, _PLAIN):
        return True
    return isinstance(v, tuple) and len(v) <= 8 and all(isinstance(e, _PLAIN) for e in v)


class ModuleGuard:
    """The module tree's shape as imported: per submodule (by path), its type and the plain
    attributes in its ``__dict__`` (``training`` among them). :meth:`check` compares the module
    now, walking ``_modules`` by name (a few dict reads per module and attribute); a change is an
    :class:`EinjoinError` naming the path, the attribute and both values."""

    __slots__ = ("root", "entries")

    def __init__(self, module: Any):
        self.root = module
        entries, own = [], _torch_own()
        for path, m in module.named_modules(remove_duplicate=False):
            d = vars(m)
            keys = tuple(k for k, v in d.items() if _plain(v) and k not in own)
            entries.append((tuple(path.split(".")) if path else (), type(m), keys, tuple(d[k] for k in keys)))
        self.entries: tuple[tuple[tuple[str, ...], type, tuple[str, ...], tuple[Any, ...]], ...] = tuple(entries)

    def check(self) -> None:
        """Raise if the module differs from the import's in a way the graph was specialised on."""
        root = self.root
        for path, kind, keys, values in self.entries:
            m = root
            for part in path:
                m = m._modules.get(part) if hasattr(m, "_modules") else None
                if m is None:
                    break
            if type(m) is not kind:
                where = ".".join(path) or "top module"
                raise EinjoinError(f"the module's {where} is {type(m).__name__} now, {kind.__name__} when it "
                                   f"was imported: the program computes the import's graph; import the "
                                   f"module again (ej.from_torch) to run the new one")
            d = vars(m)
            now = tuple(d.get(k, _MISSING) for k in keys)
            if now != values:
                for k, was, v in zip(keys, values, now):
                    if was is not v and (v is _MISSING or was != v or type(was) is not type(v)):
                        where = ".".join((*path, k))
                        shown = "deleted" if v is _MISSING else repr(v)
                        raise EinjoinError(
                            f"the module's {where} is {shown} now, {was!r} when it was imported; the "
                            f"graph was captured for that value (torch.export specialises on it, as on "
                            f"train/eval mode): import the module again (ej.from_torch) to run the "
                            f"new setting")

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # a pickled program is detached from the module (its bound tensors travel as arrays): no guard
        return _none, ()


def _none() -> None:
    return None
