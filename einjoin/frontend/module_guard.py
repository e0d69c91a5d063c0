"""What an import assumed of the module beyond its tensors, checked before each run: torch.export
specialises the graph on each submodule's type, its ``training`` flag and the plain Python values
its forward reads (``self.scale = 2.0``, ``self.causal = True``, a kernel size). After
``module.eval()``, ``module.train()`` or ``m.scale = 3.0`` torch's next call computes something
else, and a program still computing the import's graph would be silently wrong: the run is
refused, naming what changed. Replaced parameters are followed instead
(:class:`~einjoin.frontend.bound_tensors.LiveTensor`); a submodule replaced by one of the same
type and settings keeps the graph valid, and is accepted.

Exactly what the capture read is guarded: :func:`recording` notes every attribute read on a
module while the import runs (the forward, its hooks, torch.export's own reads and einjoin's
translations), so a setting the forward never reads (``m.epoch = 1``, ``lin.eval()`` on a model
without dropout or batch norm) changes nothing and is not refused. A name the capture looked up
and did not find (``hasattr(self, "cache")``) is guarded to stay absent, and a plain class
attribute read through the instance (``class M: scale = 2.0``) to stay unshadowed. What it cannot
see, it guards whole: a submodule whose class defines its own ``__getattribute__`` (reads that
bypass the recorder) keeps every plain attribute guarded, as does a guard made without a record.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
>>> with recording() as reads:
...     _ = m(torch.ones(1, 2))
>>> guard = ModuleGuard(m, reads)
>>> m.epoch = 1  # no forward reads it
>>> guard.check()
>>> _ = m[1].train()
>>> try:
...     guard.check()
... except Exception as e:
...     print(str(e).split(";")[0])
the module's 1.training is True now, False when it was imported
"""

from __future__ import annotations

import numbers
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from einjoin.errors import EinjoinError

__all__ = ["ModuleGuard", "recording"]

_MISSING = object()
# settings the import itself sets for the capture whatever the model's value (the experts'
# dispatch: torch_args.static_experts), so the graph holds for any of them
_IMPORT_CHOSEN = frozenset({"_experts_implementation"})
_PLAIN = (bool, int, float, str, type(None))


def _torch_own() -> frozenset[str]:
    """nn.Module's own bookkeeping attributes (``_is_full_backward_hook``, set by registering a
    hook; ``_compiled_call_impl``, set by ``m.compile()``): no forward reads them, so changing them
    changes nothing the capture assumed."""
    import torch
    return frozenset(k for k in (*vars(torch.nn.Module()), *vars(torch.nn.Module)) if k != "training")


_LOCAL = threading.local()  # this thread's open record (a set of (id(module), name)), if any
_INSTALL = threading.Lock()
_DEPTH = [0]  # records open in all threads: the recorder is nn.Module's while any is
_SAVED: list[Any] = []


def _library_dirs() -> tuple[str, ...]:
    """The folders of the code whose ``self.__dict__`` reads are bookkeeping, not a forward's
    setting: torch's (``nn.Module.__getattr__`` reads ``__dict__`` for every parameter),
    transformers', einjoin's own."""
    import sys
    dirs = []
    for name in ("torch", "transformers", "einjoin"):
        f = getattr(sys.modules.get(name), "__file__", None)
        if f:
            dirs.append(os.path.dirname(f) + os.sep)
    return tuple(dirs)


def _recorder(base: Any, library: tuple[str, ...]) -> Any:
    """A ``__getattribute__`` that notes ``(id(self), name)`` in this thread's open record, if
    any, then looks the name up as ``base`` does. A read of ``__dict__`` itself (``vars(self)``,
    ``self.__dict__[k]`` in a user's forward: reads no lookup of a name sees) is noted only when
    the code reading it is no library's (see :func:`_library_dirs`); the guard then keeps every
    plain attribute of that module."""
    def __getattribute__(self: Any, name: str) -> Any:
        reads = getattr(_LOCAL, "reads", None)
        if reads is not None:
            if name != "__dict__":
                reads.add((id(self), name))
            elif not sys._getframe(1).f_code.co_filename.startswith(library):
                reads.add((id(self), name))
        return base(self, name)
    _not_for_dynamo(__getattribute__.__code__)
    return __getattribute__


def _not_for_dynamo(code: Any) -> None:
    """Tell torch.compile (dynamo) never to compile the recorder's frame: installed on nn.Module
    while an import runs, it is called from another thread's compiled module too, where dynamo
    compiled it as a frame of its own for each module type it met (hitting its recompile limit,
    and that thread's calls crawling). A skipped frame runs as plain Python (the recorder reads
    this thread's record only). torch.export has imported dynamo already."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip = getattr(eval_frame, "skip_code", None)
    if skip is not None:
        skip(code)


def _config_class() -> type | None:
    """Hugging Face's ``PretrainedConfig`` when transformers is imported already (never imported
    here): a model's forward reads settings from it (``config.pad_token_id``), not only from its
    modules."""
    import sys
    cls = getattr(sys.modules.get("transformers"), "PretrainedConfig", None)
    return cls if isinstance(cls, type) else None


def _recorded_classes() -> list[type]:
    import torch
    cfg = _config_class()
    return [torch.nn.Module] + ([cfg] if cfg is not None else [])


@contextmanager
def recording() -> Iterator[set[tuple[int, str]]]:
    """Note every attribute looked up on an ``nn.Module`` (and on a Hugging Face config) by this
    thread inside the block (as ``(id(object), name)``; found or not). Their classes'
    ``__getattribute__`` is the recorder while any thread records (other threads' reads go
    through it unrecorded: one thread-local read); a record opened inside another adds its reads
    to the outer one too."""
    reads: set[tuple[int, str]] = set()
    outer = getattr(_LOCAL, "reads", None)
    with _INSTALL:
        if _DEPTH[0] == 0:
            _SAVED[:] = [(cls, cls.__dict__.get("__getattribute__")) for cls in _recorded_classes()]
            for cls, own in _SAVED:
                cls.__getattribute__ = _recorder(own if own is not None else object.__getattribute__,
                                                 _library_dirs())
        _DEPTH[0] += 1
    _LOCAL.reads = reads
    try:
        yield reads
    finally:
        _LOCAL.reads = outer
        if outer is not None:
            outer.update(reads)
        with _INSTALL:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                for cls, own in _SAVED:
                    if own is not None:
                        cls.__getattribute__ = own
                    else:
                        del cls.__getattribute__
                _SAVED.clear()


def _plain(v: Any) -> bool:
    """A value the capture can have specialised on and that compares by value."""
    if isinstance(v, _PLAIN) or _value_like(v):
        return True
    return isinstance(v, tuple) and len(v) <= 8 and all(isinstance(e, _PLAIN) for e in v)


def _value_like(v: Any) -> bool:
    """Other numbers (np.float32(2.0), a Fraction, a complex) and torch's value types (a dtype the
    forward casts to, a device): they pass no recorder and compare by value."""
    if isinstance(v, numbers.Number):
        return True
    t = sys.modules.get("torch")
    return t is not None and isinstance(v, (t.dtype, t.device, t.layout, t.memory_format))


class ModuleGuard:
    """The module tree's shape as imported: per submodule (by path), its type and the plain
    attributes in its ``__dict__`` that the capture read (``reads``, from :func:`recording`; all
    of them without it), ``training`` among them when read. :meth:`check` compares the module now,
    walking ``_modules`` by name (a few dict reads per module and attribute); a change is an
    :class:`EinjoinError` naming the path, the attribute and both values."""

    __slots__ = ("root", "entries", "configs", "objects")

    def __init__(self, module: Any, reads: set[tuple[int, str]] | None = None):
        self.root = module
        entries, own = [], _torch_own()
        read_by: dict[int, set[str]] = {}
        for i, name in reads or ():
            read_by.setdefault(i, set()).add(name)
        objects: list[tuple[tuple[str, ...], str, Any]] = []
        cfg = _config_class()
        for path, m in module.named_modules(remove_duplicate=False):
            d = vars(m)
            whole = reads is None or "__dict__" in read_by.get(id(m), ())  # reads unseen, or all of them read
            if whole or "__getattribute__" in vars(type(m)) or any(
                    "__getattribute__" in vars(c) for c in type(m).__mro__[1:] if c is not object
            ) or _bypasses_recorder(type(m)):
                keys = tuple(k for k, v in d.items() if _plain(v) and k not in own)  # reads unseen: all
                held = tuple(k for k in d if k not in own)
            else:
                keys = tuple(sorted(k for k in read_by.get(id(m), ()) if k not in own and _guarded(m, d, k)))
                held = tuple(sorted(k for k in read_by.get(id(m), ()) if k in d and k not in own))
            p = tuple(path.split(".")) if path else ()
            entries.append((p, type(m), keys, tuple(_effective(d, type(m), k) for k in keys)))
            # a plain object the forward read (a SimpleNamespace, dataclass or dict of settings):
            # its reads pass no recorder, so all of its state is kept and compared
            objects.extend((p, k, _state(d[k])) for k in held
                           if (_held_object(d[k]) or _kept_by_state(d[k]))
                           and not (cfg is not None and isinstance(d[k], cfg)))
            # what torch's __call__ reads past the recorder: the hooks (a hook registered after the
            # import changes torch's output) and a container's children (Sequential.append)
            objects.extend((p, k, _state(d[k])) for k in _HOOKS if k in d)
            if isinstance(m, _containers()):
                objects.append((p, "_modules", ("children", tuple(d["_modules"]))))
        objects.append(((), _GLOBAL, _global_hooks()))  # torch's hooks on every module's call
        self.entries: tuple[tuple[tuple[str, ...], type, tuple[str, ...], tuple[Any, ...]], ...] = tuple(entries)
        self.configs = _config_entries(module, read_by) if reads is not None else ()
        self.objects: tuple[tuple[tuple[str, ...], str, Any], ...] = tuple(objects)

    def without(self, names: set[str]) -> ModuleGuard:
        """This guard less the attributes ``names`` in every submodule (``{"training"}``: the
        Trainer sets the mode of its captures itself)."""
        out = ModuleGuard.__new__(ModuleGuard)
        out.root, out.configs, out.objects = self.root, self.configs, self.objects
        out.entries = tuple((path, kind, tuple(k for k in keys if k not in names),
                             tuple(v for k, v in zip(keys, values) if k not in names))
                            for path, kind, keys, values in self.entries)
        return out

    def union(self, other: ModuleGuard | None) -> ModuleGuard:
        """This guard with ``other``'s names too (the same module captured again at other shapes,
        on a copy of its tree: a forward may read other settings there), matched by path; the
        values are this import's where it has them."""
        if other is None:
            return self
        more = {path: set(keys) for path, _, keys, _ in other.entries}
        out = ModuleGuard.__new__(ModuleGuard)
        out.root = self.root
        seen = {(p, a) for p, a, _, _ in self.configs}
        out.configs = self.configs + tuple(c for c in other.configs if (c[0], c[1]) not in seen)
        held = {(p, a) for p, a, _ in self.objects}
        out.objects = self.objects + tuple(o for o in other.objects if (o[0], o[1]) not in held)
        entries = []
        for path, kind, keys, values in self.entries:
            extra = tuple(sorted(more.get(path, set()) - set(keys)))
            if extra:
                was = dict(zip(keys, values))
                o = {k: v for p, _, ks, vs in other.entries if p == path for k, v in zip(ks, vs)}
                keys = keys + extra
                values = tuple(was[k] if k in was else o[k] for k in keys)
            entries.append((path, kind, keys, values))
        out.entries = tuple(entries)
        return out

    def check(self) -> None:
        """Raise if the module differs from the import's in a way the graph was specialised on."""
        root = self.root
        for path, kind, keys, values in self.entries:
            m = _submodule(root, path)
            if type(m) is not kind:
                where = ".".join(path) or "top module"
                raise EinjoinError(f"the module's {where} is {type(m).__name__} now, {kind.__name__} when it "
                                   f"was imported: the program computes the import's graph; import the "
                                   f"module again (ej.from_torch) to run the new one")
            d = vars(m)
            now = tuple(d[k] if k in d else _effective(d, kind, k) for k in keys)
            changed = _changed(keys, values, now)
            if changed is not None:
                k, was, v = changed
                where = ".".join((*path, k))
                shown = "deleted" if v is _MISSING else repr(v)
                then = "not set on the module" if was is _MISSING else repr(was)
                raise EinjoinError(
                    f"the module's {where} is {shown} now, {then} when it was imported; the "
                    f"graph was captured for that value (torch.export specialises on it, as on "
                    f"train/eval mode): import the module again (ej.from_torch) to run the "
                    f"new setting")

        for path, attr, keys, values in self.configs:
            m = _submodule(root, path)
            cfg = vars(m).get(attr) if m is not None else None
            changed = _changed(keys, values, tuple(getattr(cfg, k, _MISSING) for k in keys))
            if changed is not None:
                k, was, v = changed
                where = ".".join((*path, attr, k))
                raise EinjoinError(
                    f"the module's {where} is {'deleted' if v is _MISSING else repr(v)} now, "
                    f"{'not set' if was is _MISSING else repr(was)} when it was imported; the "
                    f"forward read it while captured: import the module again (ej.from_torch) "
                    f"to run the new setting")

        for path, attr, was in self.objects:
            m = _submodule(root, path)
            now_v: Any = vars(m).get(attr, _MISSING) if m is not None else _MISSING
            now = ("children", tuple(now_v)) if attr == "_modules" and now_v is not _MISSING else _state(now_v)
            if attr == _GLOBAL:
                now = _global_hooks()
            if now != was:
                where = ".".join(path) or "top module"
                if attr == _GLOBAL:
                    raise EinjoinError(
                        "torch's global forward hooks (torch.nn.modules.module.register_module_forward_hook / "
                        "_pre_hook) are other than when the module was imported (the graph ran the import's "
                        "hooks): import the module again (ej.from_torch)")
                if attr == "_modules":
                    raise EinjoinError(
                        f"the module's {where} holds {', '.join(now[1]) if now[0] == 'children' else 'nothing'} "
                        f"now, {', '.join(was[1])} when it was imported: the program computes the "
                        f"import's graph; import the module again (ej.from_torch) to run the new one")
                if attr in _HOOKS:
                    raise EinjoinError(
                        f"the module's {where} has other {_HOOKS[attr]} now than when it was imported "
                        f"(the graph ran the import's hooks): import the module again (ej.from_torch)")
                k, before, after = _state_change(was, now, attr)
                raise EinjoinError(
                    f"the module's {'.'.join((*path, k))} is {after} now, {before} when it was "
                    f"imported; the forward read it while captured (a plain object's settings are "
                    f"kept whole: they are read past the guard's recorder): import the module "
                    f"again (ej.from_torch) to run the new setting")

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # a pickled program is detached from the module (its bound tensors travel as arrays): no guard
        return _none, ()


def _submodule(root: Any, path: tuple[str, ...]) -> Any:
    """The submodule at ``path`` now (walking ``_modules`` by name), or None where it is gone."""
    m = root
    for part in path:
        m = m._modules.get(part) if hasattr(m, "_modules") else None
        if m is None:
            break
    return m


def _changed(keys: tuple[str, ...], values: tuple[Any, ...], now: tuple[Any, ...]) -> tuple[str, Any, Any] | None:
    """The first (name, value at import, value now) that differs (by identity, then by type and
    value: 1 and 1.0 and True differ), or None."""
    if now == values:
        return None
    for k, was, v in zip(keys, values, now):
        if was is not v and (v is _MISSING or was is _MISSING or was != v or type(was) is not type(v)):
            return k, was, v
    return None


def _config_entries(module: Any, read_by: dict[int, set[str]]
                    ) -> tuple[tuple[tuple[str, ...], str, tuple[str, ...], tuple[Any, ...]], ...]:
    """The Hugging Face configs the modules hold (each once: every layer shares the model's), with
    the plain settings the capture read from them: (module path, attribute, names, values)."""
    cls = _config_class()
    if cls is None:
        return ()
    out, seen = [], set()
    for path, m in module.named_modules(remove_duplicate=False):
        for attr, cfg in vars(m).items():
            if not isinstance(cfg, cls) or id(cfg) in seen or id(cfg) not in read_by:
                continue
            seen.add(id(cfg))
            keys = tuple(sorted(k for k in read_by[id(cfg)]
                                if k not in _IMPORT_CHOSEN and _plain(getattr(cfg, k, None))))
            out.append((tuple(path.split(".")) if path else (), attr, keys,
                        tuple(getattr(cfg, k, _MISSING) for k in keys)))
    return tuple(out)


def _effective(d: dict[str, Any], kind: type, k: str) -> Any:
    """What ``m.k`` reads for a guarded name: the instance's value, else the class's, else missing."""
    if k in d:
        return d[k]
    v = getattr(kind, k, _MISSING)
    return v if v is _MISSING or _plain(v) else _MISSING


def _guarded(m: Any, d: dict[str, Any], k: str) -> bool:
    """Whether a name the capture read on ``m`` is a setting to guard: a plain value in its
    ``__dict__``; or absent from it and no parameter, buffer or submodule, where the class holds a
    plain value or nothing (an instance attribute set later would shadow it, or appear)."""
    if k in d:
        return _plain(d[k])
    if k in d.get("_parameters", ()) or k in d.get("_buffers", ()) or k in d.get("_modules", ()):
        return False
    import inspect
    at_class = inspect.getattr_static(type(m), k, _MISSING)
    return at_class is _MISSING or _plain(at_class)


def _bypasses_recorder(kind: type) -> bool:
    """Whether a method of ``kind`` (its own or a base's outside torch, transformers and einjoin)
    names ``__getattribute__`` (``object.__getattribute__(self, "scale")`` in a forward): such a
    read passes no recorder, so that module's attributes are guarded whole."""
    hit = _BYPASS.get(kind)
    if hit is None:
        library = _library_dirs()
        codes = [f.__code__ for c in kind.__mro__ if c is not object
                 for f in (getattr(v, "__func__", v) for v in vars(c).values())
                 if hasattr(f, "__code__") and not f.__code__.co_filename.startswith(library)]
        hit = False
        while codes and not hit:
            code = codes.pop()
            hit = "__getattribute__" in code.co_names
            codes.extend(c for c in code.co_consts if hasattr(c, "co_names"))
        _BYPASS[kind] = hit
    return hit


_BYPASS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()  # a class's scan, once


_HOOKS = {"_forward_hooks": "forward hooks", "_forward_pre_hooks": "forward pre-hooks"}
_GLOBAL = "<global forward hooks>"


def _global_hooks() -> tuple[Any, ...]:
    """The handles of torch's global forward (pre-)hooks, which every module's call runs."""
    mm = sys.modules["torch.nn.modules.module"]
    return ("hooks", tuple(mm._global_forward_hooks), tuple(mm._global_forward_pre_hooks))


def _containers() -> tuple[type, ...]:  # built on first use: torch is imported late
    import torch
    return (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _kept_by_state(v: Any) -> bool:
    """A list or tuple of settings (``self.scales = [2.0, 3.0]``, compared element by element)
    or a function the forward calls (``self.act = torch.relu``, compared by identity): the
    capture specialised on them past the recorder."""
    import torch
    if isinstance(v, (list, tuple, set, frozenset)):
        return True
    return callable(v) and not isinstance(v, (torch.nn.Module, torch.Tensor))


def _held_object(v: Any) -> bool:
    """A settings holder whose state the guard keeps whole: a dict, or an instance of a plain
    Python class (SimpleNamespace, a dataclass, a user's config object), not a module, tensor,
    function, class or callable."""
    import torch
    if isinstance(v, dict):
        return True
    if isinstance(v, (torch.nn.Module, torch.Tensor, type)) or callable(v):
        return False
    return hasattr(v, "__dict__") or hasattr(type(v), "__dataclass_fields__")


def _state(v: Any, depth: int = 3, seen: frozenset[int] = frozenset()) -> Any:
    """A comparable picture of a held object, a few levels deep: ``("v", type, value)`` for a plain
    value (1, 1.0 and True differ), ``("seq", ...)`` for a list or tuple, ``("map", ...)`` with
    sorted (key, state) pairs for a dict or an object's fields; what is none of these (a tensor, a
    function) by identity."""
    if v is _MISSING:
        return ("deleted",)
    if _plain(v):
        return ("v", type(v).__name__, v)
    if depth == 0 or id(v) in seen:
        return ("id", id(v))
    seen = seen | {id(v)}
    if isinstance(v, (list, tuple)):
        return ("seq", type(v).__name__, tuple(_state(e, depth - 1, seen) for e in v))
    if isinstance(v, (set, frozenset)):  # its elements are hashable, so are their states
        return ("set", type(v).__name__, frozenset(_state(e, depth - 1, seen) for e in v))
    if isinstance(v, dict):
        items: Any = v.items()
    elif _held_object(v):
        d = getattr(v, "__dict__", None)
        items = d.items() if d is not None else (
            (f, getattr(v, f, _MISSING)) for f in type(v).__dataclass_fields__)
    else:
        return ("id", id(v))
    pairs = sorted(((k if isinstance(k, str) else repr(k), _state(e, depth - 1, seen)) for k, e in items
                    if k not in _IMPORT_CHOSEN), key=lambda kv: kv[0])
    return ("map", type(v).__name__, tuple(pairs))


def _state_change(was: Any, now: Any, name: str) -> tuple[str, str, str]:
    """The dotted name under a held object whose state differs, and its two values as shown."""
    if was[0] == now[0] == "map":
        a, b = dict(was[2]), dict(now[2])
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _state_change(a.get(k, ("deleted",)), b.get(k, ("deleted",)), f"{name}.{k}")
    if was[0] == now[0] == "seq" and len(was[2]) == len(now[2]):
        for i, (x, y) in enumerate(zip(was[2], now[2])):
            if x != y:
                return _state_change(x, y, f"{name}[{i}]")

    def shown(st: Any) -> str:
        if st[0] == "deleted":
            return "not set" if st is was else "deleted"
        return repr(st[2]) if st[0] == "v" else f"another {st[1] if len(st) > 2 else 'object'}"
    return name, shown(was), shown(now)


def _none() -> None:
    return None
