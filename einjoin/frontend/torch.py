"""Import an unmodified ``torch.nn.Module``: capture it with ``torch.export`` (``torch.fx.symbolic_trace``
where export cannot), translate the graph op by op (:mod:`einjoin.frontend.aten`) into einjoin IR.

Parameters and buffers become named graph inputs bound to the module's tensors; the forward's
tensor arguments stay inputs, in order. The result compiles like any graph. A module built on
the ``meta`` device (``with torch.device("meta"): ...``) imports without weights, for planning
(``backend="null"``) models that do not fit in memory.

>>> import torch, einjoin as ej
>>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
>>> fn = ej.from_torch(mlp, (torch.randn(2, 8),))
>>> fn.arg_names, sorted(fn.bound)[:2]
(('input',), ['0.bias', '0.weight'])
>>> x = torch.randn(2, 8)
>>> out = ej.compile(fn, devices=2).run(x)
>>> bool(torch.allclose(out, mlp(x), atol=1e-5))
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from einjoin.errors import EinjoinError, UnsupportedOpError
from einjoin.frontend import aten
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor

__all__ = ["from_torch", "TorchFunction"]


@dataclass(frozen=True)
class TorchFunction:
    """A module's forward as an einjoin graph: ``outputs`` (tensors), ``arg_names`` (the graph
    inputs fed positionally, in the forward's order), ``bound`` (parameters and buffers by name)."""

    outputs: tuple[Tensor, ...]
    arg_names: tuple[str, ...]
    bound: Mapping[str, np.ndarray] = field(repr=False)
    many: bool = False
    method: str = "export"

    def reference(self, *args: Any, **feeds: Any) -> Any:
        """Evaluate with the numpy reference (``ej.reference``), binding the module's tensors."""
        from einjoin.ir.reference import reference
        from einjoin.ir.graph import Graph
        used = Graph(list(self.outputs)).input_by_name
        values = {**{k: v for k, v in self.bound.items() if k in used},
                  **dict(zip(self.arg_names, args)), **feeds}
        outs = reference(list(self.outputs), **values)
        return tuple(outs) if self.many else outs[0]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{o.dtype}{list(o.shape)}" for o in self.outputs)
        return (f"TorchFunction({self.method}; args {', '.join(self.arg_names)}; "
                f"{len(self.bound)} bound tensors; outputs {shapes})")


def _source_line(node: Any) -> str:
    """The module's source line that produced ``node`` (the last frame outside torch itself)."""
    trace = node.meta.get("stack_trace") or getattr(node, "stack_trace", None) or ""
    lines = trace.strip().splitlines()
    torch_dir = os.sep + "torch" + os.sep
    best = ""
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("File ") and torch_dir not in s:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            best = f"{s}: {code}"
    return best or "(no source line recorded)"


def _dtype_of(t: Any) -> str:
    return aten.torch_dtype(t.dtype)


def _to_numpy(t: Any) -> np.ndarray:
    from einjoin.ir.reference import to_numpy
    return to_numpy(t.detach().cpu().contiguous(), "module tensor")


def _op_name(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _translate(node: Any, name: str, args: tuple, kwargs: dict) -> Any:
    try:
        return aten.call(name, args, kwargs)
    except EinjoinError as e:
        target = node.target if isinstance(node.target, str) else _op_name(node.target)
        where = _source_line(node)
        raise type(e)(f"{e}\n  while translating torch op {name!r} (node {node.name}, target "
                      f"{node.target if isinstance(node.target, str) else str(node.target)}) "
                      f"from {where}") from None


def _map(value: Any, env: dict) -> Any:
    import torch.fx
    return torch.fx.node.map_aggregate(value, lambda v: env[v] if isinstance(v, torch.fx.Node) else v)


def _check_supported(graph: Any, fx: bool, modules: Mapping[str, Any]) -> None:
    """Every op name known before any translation: one error names the op and its source line."""
    for node in graph.nodes:
        if node.op == "call_function":
            name = _op_name(node.target)
        elif node.op == "call_method":
            name = node.target
        elif node.op == "call_module":
            name = type(modules[node.target]).__name__
            if name in MODULES:
                continue
        else:
            continue
        if name in aten.NO_OPS or name in aten.OPS or (fx and name in FX_ONLY):
            continue
        raise UnsupportedOpError(
            f"torch op {name!r} (target {node.target}) has no einjoin translation; it comes from "
            f"{_source_line(node)}\n  supported ops: {', '.join(sorted(aten.OPS))}")


# ---------------------------------------------------------------- torch.export


def _from_export(module: Any, args: tuple, kwargs: dict) -> TorchFunction:
    import torch
    ep = torch.export.export(module, args, kwargs)
    sig = ep.graph_signature
    specs = {s.arg.name: s for s in sig.input_specs}
    _check_supported(ep.graph, False, {})
    env: dict[Any, Any] = {}
    bound: dict[str, np.ndarray] = {}
    arg_names: list[str] = []
    outputs: list[Tensor] = []
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = specs[node.name]
            kind = spec.kind.name
            if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                t = ep.state_dict.get(spec.target) if spec.target in ep.state_dict else ep.constants[spec.target]
                name = spec.target
                env[node] = F.param(name, tuple(t.shape), _dtype_of(t))
                if not t.is_meta:  # a module on the meta device plans but cannot run
                    bound[name] = _to_numpy(t)
            elif kind == "USER_INPUT":
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    raise EinjoinError(f"from_torch: forward argument {node.name!r} is "
                                       f"{type(val).__name__}, not a tensor; bind it with "
                                       f"functools.partial before tracing")
                env[node] = F.input(node.name, tuple(int(s) for s in val.shape), _dtype_of(val))
                arg_names.append(node.name)
            else:
                raise UnsupportedOpError(f"from_torch: input kind {kind} ({node.name}) is not supported")
        elif node.op == "call_function":
            name = _op_name(node.target)
            if name in aten.NO_OPS:
                env[node] = None
                continue
            env[node] = _translate(node, name, _map(node.args, env), _map(node.kwargs, env))
        elif node.op == "output":
            outs = _map(node.args[0], env)
            for s, o in zip(sig.output_specs, outs):
                if s.kind.name != "USER_OUTPUT":
                    raise UnsupportedOpError(f"from_torch: the forward mutates {s.target!r} "
                                             f"({s.kind.name}); einjoin graphs are functional")
                outputs.append(_as_output(o, s.arg.name))
        else:
            raise UnsupportedOpError(f"from_torch: fx node kind {node.op!r} ({node.name})")
    return TorchFunction(tuple(outputs), tuple(arg_names), bound, _many(ep.call_spec.out_spec), "export")


def _many(out_spec: Any) -> bool:
    return out_spec is not None and not (out_spec.num_children == 0 and out_spec.type is None)


def _as_output(v: Any, what: str) -> Tensor:
    if not isinstance(v, Tensor):
        raise EinjoinError(f"from_torch: output {what} is {type(v).__name__}, not a tensor")
    return v


# ---------------------------------------------------------------- torch.fx fallback


def _linear_m(m: Any, p: dict, x: Tensor) -> Tensor:
    return aten.OPS["linear"](x, p["weight"], p.get("bias"))


def _layer_norm_m(m: Any, p: dict, x: Tensor) -> Tensor:
    return aten.OPS["layer_norm"](x, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps)


def _rms_norm_m(m: Any, p: dict, x: Tensor) -> Tensor:
    return aten.OPS["rms_norm"](x, m.normalized_shape, p.get("weight"), m.eps)


MODULES = {
    "Linear": _linear_m,
    "LayerNorm": _layer_norm_m,
    "RMSNorm": _rms_norm_m,
    "Embedding": lambda m, p, x: F.gather(p["weight"], x),
    "Dropout": lambda m, p, x: x,
    "Identity": lambda m, p, x: x,
    "ReLU": lambda m, p, x: aten.OPS["relu"](x),
    "SiLU": lambda m, p, x: aten.OPS["silu"](x),
    "GELU": lambda m, p, x: aten.OPS["gelu"](x, m.approximate),
    "Tanh": lambda m, p, x: aten.OPS["tanh"](x),
    "Sigmoid": lambda m, p, x: aten.OPS["sigmoid"](x),
    "Softmax": lambda m, p, x: aten.OPS["softmax"](x, m.dim),
}
FX_ONLY = frozenset({"size", "getattr", "dim"})


def _fx_call(node: Any, name: str, args: tuple, kwargs: dict) -> Any:
    if name == "size":
        x, *d = args
        return x.shape if not d else x.shape[d[0]]
    if name == "dim":
        return args[0].ndim
    if name == "getattr":
        x, attr = args
        if attr == "shape":
            return x.shape
        if attr == "dtype":
            return x.dtype
        if attr == "T":
            return x.T
        raise UnsupportedOpError(f"attribute {attr!r} of a tensor")
    return _translate(node, name, args, kwargs)


def _from_fx(module: Any, args: tuple, kwargs: dict) -> TorchFunction:
    import torch
    import torch.fx

    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    try:
        graph = tracer.trace(module)
    except Exception as e:
        raise EinjoinError(f"from_torch: torch.fx could not trace {type(module).__name__}: "
                           f"{type(e).__name__}: {e}") from e
    modules = dict(module.named_modules())
    _check_supported(graph, True, modules)
    env: dict[Any, Any] = {}
    bound: dict[str, np.ndarray] = {}
    arg_names: list[str] = []
    given = list(args)
    params: dict[str, Tensor] = {}

    def param(qual: str, t: Any) -> Tensor:
        if qual not in params:
            params[qual] = F.param(qual, tuple(t.shape), _dtype_of(t))
            if not t.is_meta:
                bound[qual] = _to_numpy(t)
        return params[qual]

    outputs: list[Tensor] = []
    many = False
    for node in graph.nodes:
        if node.op == "placeholder":
            v = given.pop(0) if given else kwargs.get(node.target)
            if not isinstance(v, torch.Tensor):
                raise EinjoinError(f"from_torch: forward argument {node.target!r} is "
                                   f"{type(v).__name__}, not a tensor")
            env[node] = F.input(node.target, tuple(v.shape), _dtype_of(v))
            arg_names.append(node.target)
        elif node.op == "get_attr":
            t = module
            for part in node.target.split("."):
                t = getattr(t, part)
            env[node] = param(node.target, t)
        elif node.op == "call_module":
            m = modules[node.target]
            kind = type(m).__name__
            if kind not in MODULES:
                raise UnsupportedOpError(f"module {kind} ({node.target}) has no einjoin translation")
            ps = {n: param(f"{node.target}.{n}", t) for n, t in
                  [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)] if t is not None}
            env[node] = MODULES[kind](m, ps, *_map(node.args, env))
        elif node.op in ("call_function", "call_method"):
            name = _op_name(node.target) if node.op == "call_function" else node.target
            env[node] = _fx_call(node, name, _map(node.args, env), _map(node.kwargs, env))
        elif node.op == "output":
            out = _map(node.args[0], env)
            many = isinstance(out, (tuple, list))
            outputs = [_as_output(o, f"{i}") for i, o in enumerate(out if many else [out])]
    return TorchFunction(tuple(outputs), tuple(arg_names), bound, many, "fx")


def from_torch(module: Any, example_args: Sequence[Any] = (), example_kwargs: Mapping[str, Any] | None = None,
               method: str = "auto") -> TorchFunction:
    """Trace ``module`` on example inputs (their shapes and dtypes fix the graph's) and translate
    it. ``method``: ``"export"`` (torch.export), ``"fx"`` (torch.fx.symbolic_trace) or ``"auto"``
    (export, then fx if export cannot capture the module). Unsupported ops raise
    :class:`UnsupportedOpError` naming the op and the module's source line."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise EinjoinError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    if method not in ("auto", "export", "fx"):
        raise EinjoinError(f"from_torch: method must be 'auto', 'export' or 'fx', got {method!r}")
    args = tuple(example_args) if isinstance(example_args, (list, tuple)) else (example_args,)
    kwargs = dict(example_kwargs or {})
    if method == "fx":
        return _from_fx(module, args, kwargs)
    try:
        with torch.no_grad():
            return _from_export(module, args, kwargs)
    except EinjoinError:
        raise
    except Exception as e:  # export could not capture the module: fx, when allowed
        if method == "export":
            raise EinjoinError(f"from_torch: torch.export failed on {type(module).__name__}: "
                               f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        try:
            return _from_fx(module, args, kwargs)
        except EinjoinError:
            raise
        except Exception as e2:
            raise EinjoinError(f"from_torch: neither torch.export ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}) nor torch.fx "
                               f"({type(e2).__name__}: {e2}) could capture "
                               f"{type(module).__name__}") from e2
