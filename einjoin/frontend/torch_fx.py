"""The torch.fx fallback of :func:`einjoin.frontend.torch.from_torch`: a module that
``torch.export`` cannot capture is traced symbolically with ``torch.fx`` (no hooks, no
data-dependent control flow) and translated node by node with the same op table, so every
problem is reported at once as on the export path.

>>> import torch
>>> fn = from_fx(torch.nn.Linear(3, 2), (torch.ones(4, 3),), {})
>>> tuple(fn.outputs[0].shape)
(4, 2)
"""

from __future__ import annotations

import math
from typing import Any

from einjoin.errors import EinjoinError, UnsupportedOpError
from einjoin.frontend import functions as F
from einjoin.frontend import aten_sparse as SP
from einjoin.frontend.bound_tensors import BoundTensors, aliases, bind_sparse, bind_tensor
from einjoin.frontend.fx_inplace import functionalize_inplace
from einjoin.frontend.nn_modules import MODULES
from einjoin.frontend.tensor import Tensor
# the translation this fallback shares with the export path
from einjoin.frontend.torch import (FX_CAPTURE, _FAILED, BRANCH_HELP, TorchFunction, _as_output, _canonical_names,
                                    _cause, _check_supported, _dtype_of, _in_module_order, _is_data_dependent, _map,
                                    _op_name, _plain_containers, _Problems, _reads_failed, _structure,
                                    _translate)

__all__ = ["from_fx"]


def _fx_call(node: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], problems: _Problems) -> Any:
    if _reads_failed(args, kwargs):
        return _FAILED
    if name == "size":
        x, *d = args
        return x.shape if not d else x.shape[d[0]]
    if name == "dim":
        return args[0].ndim
    if name == "numel":  # a Python int, as the static shape gives it
        return math.prod(args[0].shape)
    if name == "getattr":
        x, attr = args
        if attr == "shape":
            return x.shape
        if attr == "dtype":
            return x.dtype
        if attr == "T":
            return x.T
        if not isinstance(x, Tensor) and hasattr(x, attr):  # max(x, 1).values: a named tuple's field
            return getattr(x, attr)
        problems.add(node, f"getattr {attr!r}", f"attribute {attr!r} of a tensor")
        return _FAILED
    if name == "embedding" and getattr(node.target, "__module__", None) == "torch.nn.functional":
        kwargs = {**kwargs, "functional": True}  # F.embedding(input, weight): not aten's order
    return _translate(node, name, args, kwargs, problems)


def _refuse_hooks(module: Any) -> None:
    """torch.fx traces ``forward`` and keeps leaf modules whole: forward hooks and pre-hooks would
    be left out of the graph silently, so a module with any is refused, naming them (torch.export
    runs them: ``method="export"``)."""
    import torch.nn.modules.module as mm
    found = [f"{kind} hook on {name or 'the top module'} ({type(m).__name__})"
             for name, m in module.named_modules()
             for kind, hooks in (("forward", m._forward_hooks), ("forward pre-", m._forward_pre_hooks))
             if hooks]
    found += [f"global {kind} hook" for kind, hooks in (("forward", mm._global_forward_hooks),
                                                        ("forward pre-", mm._global_forward_pre_hooks)) if hooks]
    if found:
        raise UnsupportedOpError(f"from_torch: torch.fx does not apply module hooks, and {type(module).__name__} "
                                 f"has {len(found)}: {'; '.join(found[:4])}{' ...' if len(found) > 4 else ''}; "
                                 f"import with method='export' (which runs them) or remove them")


def _from_fx(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TorchFunction:
    import torch
    import torch.fx
    import torch.utils._pytree as pytree

    _refuse_hooks(module)
    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    try:
        graph = tracer.trace(module)
    except Exception as e:
        raise EinjoinError(f"from_torch: torch.fx could not trace {type(module).__name__}: "
                           f"{_cause(e)}{BRANCH_HELP if _is_data_dependent(e) else ''}") from e
    modules = dict(module.named_modules())
    functionalize_inplace(graph, modules, type(module).__name__)  # in-place writes: later readers read the result
    problems = _Problems(module, "torch.fx")
    skip = _check_supported(graph, True, modules, problems)
    env: dict[Any, Any] = {}
    bound: dict[str, Any] = {}
    arg_names: list[str] = []
    given = list(args)
    params: dict[str, Tensor] = {}
    trained = {id(t) for t in module.parameters()}
    canon = _canonical_names(module)
    names_of = aliases(canon)

    sparse: dict[str, Any] = {}  # sparse buffers: sparse inputs fed as the module holds them (aten_sparse)

    def param(qual: str, t: Any) -> Any:
        qual = canon.get(qual, qual)
        if SP.is_sparse(t) and not t.is_meta:
            if qual not in sparse:
                what = f"tensor {qual!r}"
                sparse[qual] = SP.sparse_placeholder(qual, t, t._nnz(), _dtype_of(t, what), what)
                bound[qual] = bind_sparse(t, module, names_of.get(qual, (qual,)))
            return sparse[qual]
        if qual not in params:
            params[qual] = F.param(qual, tuple(t.shape), _dtype_of(t, f"tensor {qual!r}"))
            if not t.is_meta:
                bound[qual] = bind_tensor(t, module, names_of.get(qual, (qual,)))
        return params[qual]

    outputs: list[Tensor] = []
    many = False
    structure = None
    for node in graph.nodes:
        if node in skip:
            env[node] = _FAILED
        elif node.op == "placeholder":
            v = given.pop(0) if given else kwargs.get(node.target)
            if not isinstance(v, torch.Tensor):
                raise EinjoinError(f"from_torch: forward argument {node.target!r} is "
                                   f"{type(v).__name__}, not a tensor")
            what = f"forward argument {node.target!r}"
            if SP.is_sparse(v):  # fed as a sparse input at each run (its capacity: the example's)
                env[node] = SP.sparse_placeholder(node.target, v, v._nnz(), _dtype_of(v, what), what)
            else:
                env[node] = F.input(node.target, tuple(v.shape), _dtype_of(v, what))
            arg_names.append(node.target)
        elif node.op == "get_attr":
            t = module
            for part in node.target.split("."):
                t = getattr(t, part)
            env[node] = param(node.target, t)
        elif node.op == "call_module":
            m = modules[node.target]
            margs = _map(node.args, env)
            mkw = _map(node.kwargs, env)  # masks given by name (attn(q, k, v, key_padding_mask=m))
            if _reads_failed(margs, mkw):
                env[node] = _FAILED
                continue
            ps = {n: param(f"{node.target}.{n}", t) for n, t in
                  [*m.named_parameters(), *m.named_buffers()] if t is not None}  # submodules' too: "out_proj.weight"
            try:
                env[node] = MODULES[type(m).__name__](m, ps, *margs, **mkw)
            except UnsupportedOpError as e:
                problems.add(node, type(m).__name__, str(e).splitlines()[0])
                env[node] = _FAILED
            except TypeError as e:  # a keyword the translation does not take: never dropped silently
                problems.add(node, type(m).__name__, f"arguments the translation does not take ({e})")
                env[node] = _FAILED
        elif node.op in ("call_function", "call_method"):
            name = _op_name(node.target) if node.op == "call_function" else node.target
            env[node] = _fx_call(node, name, _map(node.args, env), _map(node.kwargs, env), problems)
        elif node.op == "output":
            problems.check()
            out = _map(node.args[0], env)
            many = isinstance(out, (tuple, list, dict))
            leaves, spec = pytree.tree_flatten(_plain_containers(out))
            outputs = [_as_output(o, f"{i}") for i, o in enumerate(leaves)]
            structure = _structure(spec, len(outputs))
    problems.check()
    names = dict(module.named_parameters())
    weights = {q: t for q, t in params.items() if q in names or id(_attr(module, q)) in trained}
    return TorchFunction(tuple(outputs), tuple(arg_names), BoundTensors(bound), many, "fx",
                         structure=structure, parameters=_in_module_order(module, weights),
                         buffers={q: t for q, t in params.items() if q not in weights})


def _attr(module: Any, qual: str) -> Any:
    t = module
    for part in qual.split("."):
        t = getattr(t, part, None)
    return t


from_fx = _from_fx
FX_CAPTURE.append(from_fx)
