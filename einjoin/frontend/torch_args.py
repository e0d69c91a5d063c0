"""The forward's arguments, for :func:`einjoin.frontend.torch.from_torch`: what the example
arguments are called and whether the forward can take them, copies of aliased ones, the checked
``dynamic=`` dims, the Hugging Face settings a capture needs (``use_cache=False``, static-shape
experts), and the recapture: the same import on other example tensors, with the first import's
non-tensor arguments, containers and training modes, on a copy of the module sharing its weights.

>>> import torch
>>> labels(torch.nn.Linear(3, 2), 1, {})
['input']
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.errors import EinjoinError

if TYPE_CHECKING:
    from einjoin.frontend.torch import TorchFunction

__all__ = ["labels", "defaults", "check_signature", "unalias", "check_dynamic", "static_experts", "no_cache",
           "recapture_for", "shared_copy", "OutputTree"]


def labels(module: Any, n: int, kwargs: Mapping[str, Any]) -> list[str]:
    """The forward's parameter names for ``n`` positional arguments (``argument i`` where the
    signature does not say)."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i}" for i in range(n)] + list(kwargs)


def defaults(module: Any, names: Mapping[str, Any]) -> dict[str, Any]:
    """The forward's default values of the parameters ``names`` (those with one)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {n: params[n].default for n in names
            if n in params and params[n].default is not inspect.Parameter.empty}


def check_signature(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Example arguments that the forward cannot take are an error here: the fx fallback would
    otherwise drop an extra one silently."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # no signature to check against (a builtin forward)
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise EinjoinError(f"from_torch: the example arguments do not fit "
                           f"{type(module).__name__}.forward{sig}: {e}") from None


def unalias(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """Copies of example arguments that are (or share memory with) an earlier one. Traced with
    ``mha(x, x, x)``, torch.export specialises the graph to ``query is key is value`` (it reads
    only one of them), so a later run with three different tensors would be silently wrong; with
    copies the graph holds for any tensors, the same one included."""
    import torch

    def storage(t: Any) -> int:
        try:
            return 0 if t.is_meta else t.untyped_storage().data_ptr()
        except Exception:  # tensor subclasses without storage
            return 0

    names = labels(module, len(args), kwargs)
    values = [*args, *kwargs.values()]
    seen: list[tuple[Any, str]] = []
    groups: dict[str, list[str]] = {}
    out = []
    for v, label in zip(values, names):
        if isinstance(v, torch.Tensor):
            first = next((lab for t, lab in seen if t is v or (storage(t) and storage(t) == storage(v))), None)
            if first is not None:
                groups.setdefault(first, [first]).append(label)
                v = v.clone()
            else:
                seen.append((v, label))
        out.append(v)
    notes = [f"example arguments {', '.join(g)} were one tensor (or shared memory); they were "
             f"traced as separate tensors, so run() takes the same tensor or different ones"
             for g in groups.values()]
    return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):])), notes


def check_dynamic(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dynamic: Any) -> dict[str, dict[int, str]]:
    """``dynamic`` checked against the example arguments: names of tensor arguments of the
    forward, dims in range (a negative dim counts from the end; stored non-negative), symbols
    non-empty strings."""
    import torch
    if dynamic is None:
        return {}
    if not isinstance(dynamic, Mapping):
        raise EinjoinError(f"from_torch: dynamic must be a mapping argument name -> {{dim: symbol}}, "
                           f"got {type(dynamic).__name__}")
    values = dict(zip(labels(module, len(args), kwargs), [*args, *kwargs.values()]))
    tensors = [n for n, v in values.items() if isinstance(v, torch.Tensor)]
    out: dict[str, dict[int, str]] = {}
    for name, dims in dynamic.items():
        if name not in values or not isinstance(values[name], torch.Tensor):
            raise EinjoinError(f"from_torch: dynamic names {name!r}, which is not a tensor argument of "
                               f"{type(module).__name__}.forward (those given: {', '.join(tensors) or 'none'})")
        if not isinstance(dims, Mapping):
            raise EinjoinError(f"from_torch: dynamic[{name!r}] must be a mapping dim -> symbol, got "
                               f"{type(dims).__name__}")
        ndim = values[name].dim()
        out[name] = {}
        for d, sym in dims.items():
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not -ndim <= d < ndim:
                raise EinjoinError(f"from_torch: dynamic[{name!r}] names dim {d!r}, but {name} has "
                                   f"{ndim} dims (shape {tuple(values[name].shape)})")
            if not isinstance(sym, str) or not sym:
                raise EinjoinError(f"from_torch: dynamic[{name!r}][{d}] must be a symbol name (a "
                                   f"non-empty str), got {sym!r:.60}")
            out[name][int(d) % ndim] = sym
    return out


@contextlib.contextmanager
def static_experts(module: Any, notes: list[str]) -> Iterator[None]:
    """A Hugging Face mixture of experts (Mixtral, Qwen2-MoE, ...) dispatches tokens to experts with
    data-dependent shapes (``grouped_mm``: an opaque custom op over per-expert token counts;
    ``eager``: a loop over ``nonzero()``); ``batched_mm`` is the same sum with static shapes (each
    token's chosen experts' weights gathered, batched matmuls, weighted sum). The capture uses it;
    the model's setting is restored afterwards."""
    configs: dict[int, tuple[Any, str]] = {}  # any submodule (a user's wrapper around a model)
    for m in module.modules():
        if not hasattr(type(m), "_apply_gate"):  # transformers' experts classes (use_experts_implementation)
            continue
        config: Any = getattr(m, "config", None)
        impl = getattr(config, "_experts_implementation", None)
        if isinstance(impl, str) and impl != "batched_mm":
            configs.setdefault(id(config), (config, impl))
    if not configs:
        yield
        return
    for config, _ in configs.values():
        config._experts_implementation = "batched_mm"
    was = sorted({impl for _, impl in configs.values()})
    notes.append(f"the experts were captured with experts_implementation='batched_mm' (the model's "
                 f"{', '.join(map(repr, was))} dispatches with data-dependent shapes; the result is the same sum)")
    try:
        yield
    finally:
        for config, impl in configs.values():
            config._experts_implementation = impl


def no_cache(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A Hugging Face model returns its key/value cache (a ``DynamicCache`` object torch.export
    cannot return) unless told ``use_cache=False``: when the forward takes ``use_cache``, the
    example does not set it and the model's config would, it is set False (noted)."""
    config = getattr(module, "config", None)
    if "use_cache" in kwargs or not getattr(config, "use_cache", False):
        return kwargs, []
    try:
        sig = inspect.signature(module.forward)
        sig.bind(*args, **kwargs, use_cache=False)
    except (TypeError, ValueError):  # no use_cache argument (or given positionally)
        return kwargs, []
    return {**kwargs, "use_cache": False}, [
        "use_cache=False was passed (an einjoin graph returns tensors, not cache objects; "
        "ej.generate decodes with a static cache)"]


def recapture_for(importer: Callable[..., TorchFunction], module: Any, arg_names: tuple[str, ...], method: str,
                  dropout_seed: int, dynamic: Mapping[str, Mapping[int, str]], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[_Recapture, dict[str, Any], tuple[str, ...]]:
    """The recapture of an import (``importer`` = from_torch, ``arg_names`` its inputs, ``method``
    the capture that worked: export is not tried again after fx), the non-tensor arguments it was
    given by name, and the forward's parameters in the example's order."""
    import torch
    names = labels(module, len(args), kwargs)
    values = [*args, *kwargs.values()]
    slots = [(lab, _slot(v)) for lab, v in zip(names, values)]
    order = {n: i for i, n in enumerate(arg_names)}

    def first_input(item: tuple[str, Any]) -> int:  # keyword tensors in the order export took them
        lab, slot = item
        if slot is None or isinstance(slot, _Tree):
            return order.get(lab, order.get(f"{lab}_0", len(order)))
        return len(order)

    rec = _Recapture(importer, module, method, dropout_seed, dynamic, tuple(slots[:len(args)]),
                     tuple(sorted(slots[len(args):], key=first_input)), tuple(m.training for m in module.modules()))
    constants = {lab: v for lab, v in zip(names, values) if not isinstance(v, torch.Tensor)}
    return rec, constants, tuple(names)


@dataclass(frozen=True)
class _Fixed:
    """A non-tensor example argument, kept as given."""

    value: Any


@dataclass(frozen=True)
class _Tree:
    """An example argument holding tensors in a container (``hx=(h, c)``): export flattened its
    tensors into consecutive inputs (``hx_0``, ``hx_1``); a recapture refills them in that order."""

    value: Any

    def fill(self, given: list[Any]) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten, tree_unflatten
        leaves, spec = tree_flatten(self.value)
        return tree_unflatten([_take(None, given) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def _slot(v: Any) -> _Fixed | _Tree | None:
    import torch
    from torch.utils._pytree import tree_leaves
    if isinstance(v, torch.Tensor):
        return None
    return _Tree(v) if any(isinstance(x, torch.Tensor) for x in tree_leaves(v)) else _Fixed(v)


def _take(slot: _Fixed | _Tree | None, given: list[Any]) -> Any:
    if isinstance(slot, _Fixed):
        return slot.value
    if isinstance(slot, _Tree):
        return slot.fill(given)
    if not given:
        raise EinjoinError("recapture: fewer tensors given than the forward's first import took")
    return given.pop(0)


@dataclass(frozen=True)
class _Recapture:
    """``from_torch`` again on other example tensors with the options of the first import (a
    class, not a closure, so that a program holding it pickles with its module). Called with the
    forward's tensors flat, in ``arg_names`` order (positional arguments first, then keyword ones;
    a container's tensors in turn), and/or whole arguments by name; non-tensor arguments are the
    first import's unless given by name. It captures in the modules' import-time training modes."""

    importer: Callable[..., TorchFunction]  # from_torch (a module-level function: pickles by name)
    module: Any
    method: str
    dropout_seed: int
    dynamic: Mapping[str, Mapping[int, str]]
    positional: tuple[tuple[str, _Fixed | _Tree | None], ...] = ()
    keywords: tuple[tuple[str, _Fixed | _Tree | None], ...] = ()
    modes: tuple[bool, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # the module's tensors go through the standard pickler, as bytes, even when a process pool
        # pickles the program: multiprocessing's pickler has torch's reductions, which move each
        # tensor's storage to shared memory and free the old one, of which the program's bound
        # weights are views (that program, in this process, would compute with freed memory)
        import pickle
        return _unpickle_recapture, (pickle.dumps(tuple(getattr(self, f.name) for f in fields(self))),)

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TorchFunction:
        # torch.export instruments the module it captures while it runs; a recapture happens while the
        # user may be calling that module in torch (serving both side by side), so it captures a copy
        # of the module tree that shares the parameters and buffers (no weight is copied), in the
        # training modes of the first import (the user may have called .train() on the module since)
        module = shared_copy(self.module)
        if module is not self.module and len(self.modes) == len(list(module.modules())):
            for m, mode in zip(module.modules(), self.modes):
                m.training = mode
        given, named = list(args), dict(kwargs)
        positional = [named.pop(name) if name in named else _take(slot, given) for name, slot in self.positional]
        keyword = {name: named.pop(name) if name in named else _take(slot, given) for name, slot in self.keywords}
        return self.importer(module, (*positional, *given), {**keyword, **named}, self.method,
                             dropout_seed=self.dropout_seed, dynamic=self.dynamic)


def _unpickle_recapture(data: bytes) -> _Recapture:
    import pickle
    return _Recapture(*pickle.loads(data))


def shared_copy(module: Any) -> Any:
    """``module``'s tree of modules copied, its parameters and buffers the same tensors (the
    copy's forward computes with the module's weights, now and after in-place updates); the module
    itself when it cannot be deep-copied."""
    import copy
    import itertools
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # an attribute deepcopy refuses (a lock, a handle): the live module
        return module


class OutputTree:
    """An imported forward's output structure: ``spec``, a ``torch.utils._pytree.TreeSpec`` over
    the graph's outputs (a dict, a nested tuple or list, a NamedTuple, a Hugging Face
    ``ModelOutput``), which runs rebuild (:meth:`unflatten`). Pickled as plain nested tuples
    (type, context, children), not as torch's TreeSpec objects (whose leaves warn on unpickling)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any):
        self.spec = spec

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        from torch.utils._pytree import tree_unflatten
        return tree_unflatten(list(leaves), self.spec)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_output_tree, (_portable(self.spec),))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputTree) and bool(self.spec == other.spec)

    def __hash__(self) -> int:
        return hash(repr(self.spec))

    def __repr__(self) -> str:
        return f"OutputTree({self.spec})"


def _portable(spec: Any) -> Any:
    """A TreeSpec as nested tuples (None: a leaf)."""
    if spec.is_leaf():
        return None
    return (spec.type, spec.context, tuple(_portable(c) for c in spec.children()))


def _treespec(p: Any) -> Any:
    from torch.utils._pytree import TreeSpec, treespec_leaf
    if p is None:
        return treespec_leaf()
    kind, context, children = p
    return TreeSpec(kind, context, [_treespec(c) for c in children])


def _output_tree(p: Any) -> OutputTree:
    return OutputTree(_treespec(p))
