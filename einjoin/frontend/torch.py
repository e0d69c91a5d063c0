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

import functools
import threading
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError, UnsupportedOpError
from einjoin.frontend import aten
from einjoin.frontend import aten_sparse as SP
from einjoin.frontend import attention_modules as AM
from einjoin.frontend import torch_args as A
from einjoin.frontend import functions as F
from einjoin.frontend.bound_tensors import BoundTensors, aliases, bind_sparse, bind_tensor, feeds_of
from einjoin.frontend.module_guard import ModuleGuard, recording
from einjoin.frontend.node_source import module_path as _module_path
from einjoin.frontend.node_source import qualified_name
from einjoin.frontend.node_source import source_line as _source_line
from einjoin.frontend.node_source import user_frame as _user_frame
from einjoin.frontend.nn_modules import MODULES
from einjoin.frontend.op_table import DOCS_PAGE, ops_markdown, supported_ops
from einjoin.frontend.tensor import Tensor

__all__ = ["from_torch", "TorchFunction", "supported_ops", "ops_markdown", "DOCS_PAGE"]



@dataclass(frozen=True)
class TorchFunction:
    """A module's forward as an einjoin graph: ``outputs`` (tensors), ``arg_names`` (the forward's
    tensor arguments, fed positionally in this order; those the graph never reads are accepted and
    ignored), ``bound`` (parameters and buffers by name), ``notes`` (what the import decided that
    a user should know: unused arguments, aliased example arguments)."""

    outputs: tuple[Tensor, ...]
    arg_names: tuple[str, ...]
    bound: Mapping[str, np.ndarray] = field(repr=False)
    many: bool = False
    method: str = "export"
    notes: tuple[str, ...] = ()
    parameters: Mapping[str, Tensor] = field(default_factory=dict, repr=False)
    """The module's parameters as the graph inputs holding them (``ej.param`` tensors), by
    qualified name in ``module.named_parameters()`` order: ``ej.grad(loss,
    list(fn.parameters.values()))`` differentiates the imported model."""
    buffers: Mapping[str, Tensor] = field(default_factory=dict, repr=False)
    """The buffers and constant tensors (graph inputs too, bound like the parameters; not
    parameters: nothing trains them)."""
    constants: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """The forward's non-tensor arguments the import was given (``scale=2.0``, ``use_cache=False``),
    by parameter name: the graph holds for these values (torch.export specialised it on them), so
    a call giving the same values may be run, and other values need a new import."""
    defaults: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """The forward's default value of each name in ``constants`` that has one (``scale=1.0``): a call
    leaving that argument out means the default, as in torch, not the import's value."""
    call_args: tuple[str, ...] = ()
    """The forward's parameters in the order the example gave them (positional, then keyword): each
    a tensor input of ``arg_names`` or a name in ``constants``; for binding a torch-style call
    ``run(x, 2.0, True)`` to the graph's inputs."""
    buffer_updates: Mapping[str, Tensor] = field(default_factory=dict, repr=False)
    """The buffers the forward writes (a training-mode BatchNorm's ``running_mean``, ``running_var``,
    ``num_batches_tracked``): name -> the tensor of its new value, computed from the graph's inputs
    like the outputs but not among them. ``ej.compile`` computes them beside the outputs and each
    run writes them into the module's buffers, as torch's call (:mod:`einjoin.frontend.buffer_writes`)."""
    recapture: Callable[[tuple[Any, ...], dict[str, Any]], TorchFunction] | None = field(
        default=None, repr=False, compare=False)
    """``recapture(args, kwargs)``: the same module imported again on other example arguments
    with the same options (``from_torch`` sets it; None where the outputs are no longer the
    module's forward, as after :meth:`with_outputs`). A program compiled from this import calls
    it when run with other shapes."""
    dynamic: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    """``from_torch``'s ``dynamic=``: forward argument name -> {dim: symbol}, the dims a user
    said will change between runs (dims non-negative; empty: any dim may)."""
    guard: Any = field(default=None, repr=False, compare=False)
    """The module's submodule types, train/eval flags and plain settings as imported (a
    :class:`~einjoin.frontend.module_guard.ModuleGuard`): a program refuses to run once they differ."""
    structure: Any = field(default=None, repr=False)
    """The forward's output structure (an :class:`~einjoin.frontend.torch_args.OutputTree`: its ``spec`` is
    the ``torch.utils._pytree.TreeSpec`` over :attr:`outputs`, torch.export's ``out_spec`` or the
    pytree of the fx-traced output) when it is more than one
    tensor or a flat tuple of them: a dict, a nested tuple, a list, a NamedTuple, a Hugging Face
    ``ModelOutput``. A compiled program returns its results in it (``prog.run(ids).logits``);
    None: a tensor or a tuple (``many``)."""

    def with_outputs(self, outputs: Tensor | Sequence[Tensor]) -> TorchFunction:
        """The same import computing ``outputs`` instead (a tensor, or a list: a loss and its
        gradients built on :attr:`outputs` and :attr:`parameters`): compiled or evaluated, it
        binds the module's tensors and takes the forward's arguments as this one does; other
        inputs of ``outputs`` are fed by name.

        >>> import torch, numpy as np, einjoin as ej
        >>> fn = ej.from_torch(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
        >>> loss = fn.outputs[0].sum()
        >>> train = fn.with_outputs([loss, *ej.grad(loss, list(fn.parameters.values()))])
        >>> [g.shape for g in train.reference(torch.ones(4, 3))[1:]]
        [(2, 3), (2,)]
        """
        from dataclasses import replace
        many = isinstance(outputs, (list, tuple))
        outs = tuple(outputs) if isinstance(outputs, (list, tuple)) else (outputs,)
        for i, o in enumerate(outs):
            if not isinstance(o, Tensor):
                raise EinjoinError(f"with_outputs: output {i} is {type(o).__name__}, not an einjoin tensor")
        # a recapture would rebuild the forward's outputs, not these: new shapes need a new import
        return replace(self, outputs=outs, many=many, recapture=None, structure=None)

    def reference(self, *args: Any, **feeds: Any) -> Any:
        """Evaluate with the numpy reference (``ej.reference``), binding the module's tensors."""
        from einjoin.ir.reference import reference
        from einjoin.ir.graph import Graph
        if self.guard is not None:
            self.guard.check()
        used = Graph(list(self.outputs)).input_by_name
        if len(args) > len(self.arg_names):
            raise EinjoinError(f"{len(args)} positional inputs given but the module's forward takes "
                               f"{len(self.arg_names)}: {', '.join(self.arg_names)}")
        given = {**dict(zip(self.arg_names, args)), **feeds}
        values = {**{k: v for k, v in self.bound.items() if k in used},
                  **{k: v for k, v in given.items() if k in used or k not in self.arg_names}}
        outs = reference(list(self.outputs), **values)
        if self.structure is not None:  # the forward's dict / nested tuple / ModelOutput
            return self.structure.unflatten(outs)
        return tuple(outs) if self.many else outs[0]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{o.dtype}{list(o.shape)}" for o in self.outputs)
        notes = "".join(f"; note: {n}" for n in self.notes)
        return (f"TorchFunction({self.method}; args {', '.join(self.arg_names)}; "
                f"{len(self.parameters)} parameters, {len(self.bound)} bound tensors; "
                f"outputs {shapes}{notes})")


def _dtype_of(t: Any, what: str) -> str:
    """einjoin's dtype for the tensor ``what`` (a forward argument, a parameter); a dtype einjoin
    lacks (complex, uint8, ...) is a DTypeError naming that tensor."""
    from einjoin.errors import DTypeError
    from einjoin.ir.dtypes import canonical_dtype
    name = aten.torch_dtype(t.dtype)
    try:
        canonical_dtype(name)
    except EinjoinError as e:
        raise DTypeError(f"from_torch: {what} is {t.dtype}, which einjoin does not compute in ({e}); "
                         f"convert it (module.float(), x.float(), x.long()) before importing") from None
    return name


def _op_name(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    name = getattr(target, "__name__", str(target))
    # a torch.nn.functional function whose ATen namesake returns something else (F.adaptive_max_pool2d:
    # the values; aten's: values and indices) has its own entry, "F.<name>"
    if getattr(target, "__module__", None) == "torch.nn.functional" and f"F.{name}" in aten.OPS:
        return f"F.{name}"
    return str(name)


# ---------------------------------------------------------------- every problem at once


class _Failed:
    """The value of a node that could not be translated (or reads one that could not): later
    nodes reading it are skipped, so one pass finds every unsupported op."""

    def __repr__(self) -> str:
        return "<untranslated>"


_FAILED = _Failed()


def _stand_in(node: Any) -> Any:
    """For torch.export, where every node's shape is known: an einjoin input of the shape and
    dtype an untranslatable node would have had, so the nodes after it are still checked."""
    import torch

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape):
            try:
                return F.input(f"<untranslated {node.name}>", tuple(v.shape), aten.torch_dtype(v.dtype))
            except EinjoinError:
                return _FAILED
        return _FAILED

    val = node.meta.get("val")
    return tuple(one(v) for v in val) if isinstance(val, (tuple, list)) else one(val)


def _reads_failed(*values: Any) -> bool:
    import torch.fx
    found = []
    def note(v: Any) -> Any:
        if isinstance(v, _Failed):
            found.append(v)
        return v

    torch.fx.node.map_aggregate(values, note)
    return bool(found)


class _Problems:
    """Collects the ops a module uses that einjoin cannot translate: the op, why, and where
    (module path and source line) for every use; :meth:`check` raises one error naming them all."""

    def __init__(self, module: Any, method: str) -> None:
        self.name = type(module).__name__
        self.method = method
        self.groups: dict[tuple[str, str, str, bool], list[tuple[str, str]]] = {}

    def add(self, node: Any, name: str, reason: str, data_dependent: bool = False) -> None:
        key = (name, qualified_name(node.target) if node.op != "call_module" else name, reason,
               data_dependent)
        self.groups.setdefault(key, []).append((_source_line(node), _module_path(node, self.name)))

    def check(self) -> None:
        if self.groups:
            raise self.error()

    def error(self) -> UnsupportedOpError:
        unsupported = {k[0] for k in self.groups if not k[3]}
        dynamic = {k[0] for k in self.groups if k[3]}
        what = [f"{len(unsupported)} op{'s' if len(unsupported) != 1 else ''} it does not translate"
                ] if unsupported else []
        if dynamic:
            what.append(f"{len(dynamic)} data-dependent shape{'s' if len(dynamic) != 1 else ''}")
        lines = [f"from_torch: {self.name} (captured with {self.method}) uses {' and '.join(what)}:"]
        for (name, target, reason, _), uses in sorted(self.groups.items(), key=lambda kv: (kv[0][3], kv[0][0])):
            shown = f"{name!r} ({target})" if target != name else repr(name)
            lines.append(f"  {shown}: {reason}; {len(uses)} use{'s' if len(uses) != 1 else ''}")
            places: dict[str, list[str]] = {}
            for line, path in uses:
                places.setdefault(line, [])
                if path not in places[line]:
                    places[line].append(path)
            for i, (line, paths) in enumerate(places.items()):
                if i == 4:
                    lines.append(f"      ... and {len(places) - 4} more places")
                    break
                more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
                lines.append(f"      in {', '.join(paths[:3])}{more}: {line}")
        if dynamic:
            lines.append(f"  A data-dependent shape: {aten.DATA_DEPENDENT_HELP}.")
        lines.append(f"  The ops einjoin translates are listed in {DOCS_PAGE} "
                     f"(einjoin.frontend.torch.supported_ops()).")
        err = UnsupportedOpError("\n".join(lines))
        err.ops = sorted(unsupported | dynamic)  # type: ignore[attr-defined]
        return err


def _translate(node: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], problems: _Problems) -> Any:
    if _reads_failed(args, kwargs):
        return _FAILED
    try:
        return aten.call(name, args, kwargs)
    except UnsupportedOpError as e:  # a known op in a form einjoin does not translate
        what = getattr(e, "data_dependent", None)
        if what:
            problems.add(node, name, f"{what}: a data-dependent shape", True)
        else:
            problems.add(node, name, str(e).splitlines()[0])
        return _FAILED
    except EinjoinError as e:
        raise type(e)(f"{e}\n  while translating torch op {name!r} (node {node.name}, target "
                      f"{qualified_name(node.target)}) from {_source_line(node)}") from None


def _map(value: Any, env: dict[Any, Any]) -> Any:
    import torch.fx
    return torch.fx.node.map_aggregate(value, lambda v: env[v] if isinstance(v, torch.fx.Node) else v)


def _data_dependent_value(node: Any) -> bool:
    """Whether export recorded a value whose shape (or a Python number) is not known statically:
    without dynamic_shapes every symbol export makes is an unbacked, data-dependent one."""
    import torch
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape)


def _check_supported(graph: Any, fx: bool, modules: Mapping[str, Any], problems: _Problems) -> set[Any]:
    """Look every op up before translating anything; returns the nodes to skip (their problem
    is recorded). Data-dependent values are reported where they arise, not at every reader."""
    skip: set[Any] = set()
    dynamic: set[Any] = set()
    for node in graph.nodes:
        if any(a in dynamic for a in node.all_input_nodes):
            dynamic.add(node)  # a consequence (sym_size, asserts, ...) of one reported already
            continue
        if not fx and node.op == "call_function" and _data_dependent_value(node):
            dynamic.add(node)
            name = _op_name(node.target)
            what = "boolean-mask indexing x[mask]: " if name in ("index", "getitem") else ""
            problems.add(node, name, f"{what}a data-dependent shape", True)
            continue
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
        if name in aten.DATA_DEPENDENT:
            skip.add(node)
            problems.add(node, name, "a data-dependent shape", True)
        elif not (name in aten.NO_OPS or name in aten.OPS or (fx and name in FX_ONLY)):
            skip.add(node)
            what = "nn module" if node.op == "call_module" else "op"
            problems.add(node, qualified_name(type(modules[node.target])) if node.op == "call_module"
                         else name, f"no einjoin translation of this {what}")
    return skip | dynamic


# ---------------------------------------------------------------- torch.export


def _needs_functionalising(graph: Any) -> bool:
    """Whether an exported graph mutates (``add_``, ``index_put_``, ``div_``: the op's schema says
    so) or holds a higher-order op (an autocast region's ``wrap_with_autocast`` and its
    sub-graph). A translation reads each node's value once, so a tensor written in place after a
    read would be seen unwritten by later readers: such graphs are functionalised first."""
    import torch
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        t = node.target
        if isinstance(t, torch._ops.HigherOrderOperator):
            return True
        schema = getattr(t, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def _from_export(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TorchFunction:
    import torch
    with SP.unviewed(module):  # torch.export cannot fake a sparse view (adj.t()): 'meta converter nyi'
        ep = torch.export.export(module, SP.unview(args), SP.unview(kwargs))
    if _needs_functionalising(ep.graph):
        # an empty table: functionalisation only, the ops stay whole (linear stays linear) and
        # autocast regions are inlined as their casts
        import warnings
        with warnings.catch_warnings():  # torch's own pytree deprecation, said on every call
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
            ep = ep.run_decompositions({})
    sig = ep.graph_signature
    specs = {s.arg.name: s for s in sig.input_specs}
    problems = _Problems(module, "torch.export")
    canon = _canonical_names(module)
    names_of = aliases(canon)
    skip = _check_supported(ep.graph, False, {}, problems)
    env: dict[Any, Any] = {}
    bound: dict[str, Any] = {}
    params: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    arg_names: list[str] = []
    outputs: list[Tensor] = []
    updates: dict[str, Tensor] = {}
    for node in ep.graph.nodes:
        if node in skip:
            env[node] = _stand_in(node)
        elif node.op == "placeholder":
            spec = specs[node.name]
            kind = spec.kind.name
            if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                t = ep.state_dict.get(spec.target) if spec.target in ep.state_dict else ep.constants[spec.target]
                name = canon.get(spec.target, spec.target)
                if SP.is_sparse(t) and kind != "PARAMETER":  # a GNN's adjacency: a sparse input, fed as it is
                    what = f"{kind.lower()} {name!r}"
                    env[node] = SP.sparse_placeholder(name, t, t._nnz(), _dtype_of(t, what), what)
                    bound[name] = bind_sparse(t, module, names_of.get(name, (name,)))
                    continue
                env[node] = F.param(name, tuple(t.shape), _dtype_of(t, f"{kind.lower()} {name!r}"))
                (params if kind == "PARAMETER" else buffers)[name] = env[node]
                if not t.is_meta:  # a module on the meta device plans but cannot run
                    bound[name] = bind_tensor(t, module, names_of.get(name, (name,)))
            elif kind == "USER_INPUT":
                val = node.meta.get("val")
                if val is None or isinstance(val, (bool, int, float, str)):
                    # export specialised the graph on this value (use_cache=False, a flag): a
                    # constant of the graph, not an input (``constants`` on the result)
                    env[node] = val
                    continue
                if not isinstance(val, torch.Tensor):
                    raise EinjoinError(f"from_torch: forward argument {node.name!r} is "
                                       f"{type(val).__name__}, not a tensor; bind it with "
                                       f"functools.partial before tracing")
                what = f"forward argument {node.name!r}"
                if SP.is_sparse(val):  # fed as a sparse input at each run (its capacity: the example's)
                    env[node] = SP.sparse_placeholder(node.name, val, SP.example_nnz(val, (args, kwargs)),
                                                      _dtype_of(val, what), what)
                else:
                    env[node] = F.input(node.name, tuple(int(s) for s in val.shape), _dtype_of(val, what))
                arg_names.append(node.name)
            else:
                raise UnsupportedOpError(f"from_torch: input kind {kind} ({node.name}) is not supported")
        elif node.op == "call_function":
            name = _op_name(node.target)
            if name in aten.NO_OPS:
                env[node] = None
                continue
            env[node] = _translate(node, name, _map(node.args, env), _map(node.kwargs, env), problems)
            if env[node] is _FAILED:
                env[node] = _stand_in(node)
        elif node.op == "output":
            problems.check()  # every unsupported op, all at once
            outs = _map(node.args[0], env)
            for s, o in zip(sig.output_specs, outs):
                if s.kind.name == "BUFFER_MUTATION":  # training BatchNorm's running stats: kept aside
                    updates[canon.get(s.target, s.target)] = _as_output(o, f"new value of {s.target}")
                elif s.kind.name != "USER_OUTPUT":
                    raise UnsupportedOpError(f"from_torch: the forward mutates {s.target!r} "
                                             f"({s.kind.name}); einjoin graphs are functional")
                else:
                    outputs.append(_as_output(o, str(len(outputs))))  # its place, as fx's (a constant has no name)
        else:
            raise UnsupportedOpError(f"from_torch: fx node kind {node.op!r} ({node.name})")
    problems.check()
    # constants torch.export lifted that no output reads (HF attention's empty `lifted_tensor_0`,
    # read only by a `detach_`) are dropped; parameters and buffers stay (named_parameters order)
    from einjoin.ir.graph import Graph
    used = Graph(list(outputs)).input_by_name
    for spec in sig.input_specs:
        name = canon.get(spec.target, spec.target) if spec.target else ""
        if spec.kind.name == "CONSTANT_TENSOR" and name not in used:
            bound.pop(name, None)
            buffers.pop(name, None)
    notes = (f"the forward updates buffer{'s' if len(updates) > 1 else ''} {', '.join(updates)} (training-mode "
             f"running statistics): the new values are buffer_updates, not outputs",) if updates else ()
    out_spec = ep.call_spec.out_spec
    return TorchFunction(tuple(outputs), tuple(arg_names), BoundTensors(bound), _many(out_spec), "export",
                         notes=notes, parameters=_in_module_order(module, params), buffers=buffers,
                         buffer_updates=updates, structure=_structure(out_spec, len(outputs)))


def _canonical_names(module: Any) -> dict[str, str]:
    """Every qualified name of a parameter or buffer -> the name ``named_parameters()`` /
    ``named_buffers()`` give it. A tied weight (GPT-2's ``wte`` and ``lm_head``) has several names
    but is one tensor: it must be one graph input, so its gradient is the sum over its uses (what
    torch accumulates in its one ``.grad``), under the name an optimizer sees."""
    canon: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first = {id(t): n for n, t in named()}
        for n, t in named(remove_duplicate=False):
            canon[n] = first.get(id(t), n)
    return canon


def _in_module_order(module: Any, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """``params`` in ``module.named_parameters()`` order (the order an optimizer sees them)."""
    order = [n for n, _ in module.named_parameters()]
    rank = {n: i for i, n in enumerate(order)}
    return dict(sorted(params.items(), key=lambda kv: rank.get(kv[0], len(order))))


def _many(out_spec: Any) -> bool:
    return out_spec is not None and not (out_spec.num_children == 0 and out_spec.type is None)


def _structure(spec: Any, count: int) -> Any:
    """``spec`` (the forward's output TreeSpec) when the run must rebuild it: None for a tensor or
    a flat tuple of tensors (``many`` says which), and where it does not cover the outputs."""
    if spec is None or spec.is_leaf() or spec.num_leaves != count:
        return None
    if spec.type is tuple and all(c.is_leaf() for c in spec.children()):
        return None
    return A.OutputTree(spec)



def _plain_containers(out: Any) -> Any:
    """fx's output with its immutable dicts and lists as the dicts and lists the forward returned."""
    if isinstance(out, dict):
        return {k: _plain_containers(v) for k, v in out.items()}
    if isinstance(out, list):
        return [_plain_containers(v) for v in out]
    if type(out) is tuple:
        return tuple(_plain_containers(v) for v in out)
    return out


def _as_output(v: Any, what: str) -> Tensor:
    if not isinstance(v, Tensor):
        raise EinjoinError(f"from_torch: output {what} is {type(v).__name__}, not a tensor")
    return v


# ---------------------------------------------------------------- torch.fx fallback


FX_ONLY = frozenset({"size", "getattr", "dim", "numel"})


# ---------------------------------------------------------------- the entry point


# the torch.fx fallback's capture: :mod:`einjoin.frontend.torch_fx` registers it when the frontend
# package loads (it builds on this module's translation, so this module does not import it)
FX_CAPTURE: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], TorchFunction]] = []


def _fx_import() -> Callable[[Any, tuple[Any, ...], dict[str, Any]], TorchFunction]:
    return FX_CAPTURE[0]


def _cause(e: BaseException) -> str:
    """One line for a capture failure: the exception's first line and the user's frame it names."""
    text = str(e)
    first = text.strip().splitlines()[0] if text.strip() else ""
    where = _user_frame(text)
    return f"{type(e).__name__}: {first}" + (f" (at {where})" if where and where not in first else "")


BRANCH_HELP = ("\n  The forward branches on tensor values or makes a data-dependent shape, and einjoin graphs "
               "are static: compute both branches and pick with torch.where, or decide in Python and "
               f"bind the choice with functools.partial; for shapes see {DOCS_PAGE}.")


def _is_data_dependent(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return any(k in text for k in ("GuardOnDataDependent", "data-dependent", "data dependent",
                                   "cannot be used as inputs to control flow"))


def _notes(fn: TorchFunction, notes: list[str]) -> TorchFunction:
    """``fn`` with the import's notes: aliased examples, forward arguments the graph never reads."""
    from dataclasses import replace
    from einjoin.ir.graph import Graph
    used = Graph(list(fn.outputs)).input_by_name
    unused = [a for a in fn.arg_names if a not in used]
    if unused:
        notes = [*notes, f"forward argument{'s' if len(unused) > 1 else ''} {', '.join(unused)} "
                         f"{'are' if len(unused) > 1 else 'is'} not used by the graph; run() accepts "
                         f"and ignores {'them' if len(unused) > 1 else 'it'}"]
    return replace(fn, notes=(*fn.notes, *notes)) if notes else fn


def _capture(how: Callable[[Any, tuple[Any, ...], dict[str, Any]], TorchFunction], module: Any,
             args: tuple[Any, ...], kwargs: dict[str, Any], dropout_seed: int) -> TorchFunction:
    """``how(module, args, kwargs)`` with its own record of training-mode dropouts: if there were
    any, their seed input is bound to ``dropout_seed`` (a feed of that name overrides it)."""
    from dataclasses import replace
    sites = aten.DropoutSites()
    token = aten.DROPOUT.set(sites)
    try:
        fn = how(module, args, kwargs)
    finally:
        aten.DROPOUT.reset(token)
    if sites.count:
        fn = replace(fn, bound=BoundTensors(feeds_of(fn.bound)).with_values(
            {aten.DROPOUT_SEED: np.asarray(dropout_seed, np.int64)}))
    return fn


_CAPTURE_LOCK = threading.RLock()


def from_torch(module: Any, example_args: Sequence[Any] = (), example_kwargs: Mapping[str, Any] | None = None,
               method: str = "auto", *, dropout_seed: int = 0,
               dynamic: Mapping[str, Mapping[int, str]] | None = None) -> TorchFunction:
    """Trace ``module`` on example inputs (their shapes and dtypes fix the graph's) and translate
    it. ``method``: ``"export"`` (torch.export), ``"fx"`` (torch.fx.symbolic_trace) or ``"auto"``
    (export, then fx if export cannot capture the module). A module using ops einjoin cannot
    translate raises one :class:`UnsupportedOpError` naming every such op with its count, module
    path and source line (data-dependent shapes such as ``nonzero`` or ``x[mask]`` named as such;
    the error's ``ops`` attribute lists their names); the supported ops are listed in
    ``docs/torch_ops.md`` (:func:`supported_ops`). When export fails and the fx fallback fails too,
    the error gives both causes. Example arguments that are one tensor (``mha(x, x, x)``) are traced
    as copies, so the graph holds for distinct tensors too; ``notes`` on the result says so, and
    names forward arguments the graph never reads (``run()`` accepts and ignores them).

    ``fn.parameters`` maps each parameter's qualified name to the graph input holding it, so
    ``ej.grad(loss, list(fn.parameters.values()))`` differentiates the model; compare with torch
    in eval mode. A module in training mode keeps its dropouts: each draws its keep-mask from a
    hash of the element index and the int64 scalar input ``dropout_seed`` (bound to
    ``dropout_seed``; feed ``dropout_seed=`` to ``run()`` for a new mask each step), scaled by
    ``1 / (1 - p)`` as torch's; torch's own random masks cannot be reproduced.

    ``dynamic`` (``{"x": {0: "batch"}}``: forward argument name -> {dim: symbol}) names the dims
    that change between runs; it is checked (tensor arguments of the forward, dims in range) and
    kept on the result with a ``recapture`` that imports the module again for other shapes, the
    way a compiled program does when called with them."""
    # torch's attention modules compute some inputs differently with autograd on or off: the import
    # follows the call made here (a recapture: the first import's), and its notes say so
    paths = AM.paths_at_import(example_args if isinstance(example_args, (list, tuple)) else (example_args,),
                               example_kwargs if isinstance(example_kwargs, Mapping) else {})
    # one capture at a time in the process: torch.export is not thread-safe (two threads importing
    # at once failed: 'CURRENT_PATCHER is None in finally block', then the fx fallback too)
    with _CAPTURE_LOCK, recording() as reads, AM.following(module, paths) as path_notes:  # the guard: reads
        fn, dyn, args, kwargs = _from_torch(module, example_args, example_kwargs, method, dropout_seed, dynamic)
    from dataclasses import replace
    if path_notes:
        fn = replace(fn, notes=(*fn.notes, *path_notes))
    rec, constants, call_args = A.recapture_for(functools.partial(_import_as, paths), module, fn.arg_names,
                                                fn.method, int(dropout_seed), dyn, args, kwargs)
    # the defaults of what the user gave (a setting the import added, use_cache=False, has none:
    # leaving it out at run() is no departure from torch's call)
    given = {k: v for k, v in constants.items() if k in (example_kwargs or {}) or k not in kwargs}
    return replace(fn, recapture=rec, dynamic=dyn, constants=constants, call_args=call_args,
                   defaults=A.defaults(module, given), guard=ModuleGuard(module, reads))


def _import_as(paths: AM.ImportPaths, *args: Any, **kwargs: Any) -> TorchFunction:
    """``from_torch`` in the grad state ``paths`` (a recapture: the first import's, picklable)."""
    with AM.forced(paths):
        return from_torch(*args, **kwargs)


def _from_torch(module: Any, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
                method: str, dropout_seed: int, dynamic: Any
                ) -> tuple[TorchFunction, dict[str, dict[int, str]], tuple[Any, ...], dict[str, Any]]:
    import torch

    if not isinstance(module, torch.nn.Module):
        raise EinjoinError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(method, str) or method not in ("auto", "export", "fx"):
        raise EinjoinError(f"from_torch: method must be 'auto', 'export' or 'fx', got {method!r:.60}")
    args = tuple(example_args) if isinstance(example_args, (list, tuple)) else (example_args,)
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise EinjoinError(f"from_torch: example_kwargs must be a mapping name -> value, got "
                           f"{type(example_kwargs).__name__}")
    kwargs = dict(example_kwargs or {})
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, (int, np.integer)):
        raise EinjoinError(f"from_torch: dropout_seed must be an int, got {dropout_seed!r:.60}")
    A.check_signature(module, args, kwargs)
    dyn = A.check_dynamic(module, args, kwargs, dynamic)  # before the capture: a typo fails fast
    kwargs, notes = A.no_cache(module, args, kwargs)
    with A.static_experts(module, notes):
        fn = _import(module, args, kwargs, method, dropout_seed)
    if notes:
        from dataclasses import replace
        fn = replace(fn, notes=(*fn.notes, *notes))
    return fn, dyn, args, kwargs


def _import(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: str,
            dropout_seed: int) -> TorchFunction:
    import torch
    args, kwargs, notes = A.unalias(module, args, kwargs)
    name = type(module).__name__
    if method == "fx":
        return _notes(_capture(_fx_import(), module, args, kwargs, dropout_seed), notes)
    try:
        with torch.no_grad(), AM.export_forwards(module):  # the attention modules: the path torch takes
            return _notes(_capture(_from_export, module, args, kwargs, dropout_seed), notes)
    except EinjoinError:
        raise
    except Exception as e:  # export could not capture the module: fx, when allowed
        cause = _cause(e)
        hint = BRANCH_HELP if _is_data_dependent(e) else ""
        if method == "export":
            raise EinjoinError(f"from_torch: torch.export could not capture {name}: {cause}{hint}") from e
        try:
            return _notes(_capture(_fx_import(), module, args, kwargs, dropout_seed), notes)
        except Exception as e2:  # both failed: both causes, so neither is hidden
            detail = str(e2).removeprefix("from_torch: ") if isinstance(e2, EinjoinError) else _cause(e2)
            if BRANCH_HELP in detail:
                hint = ""  # the fx error ends with it already: said once
            elif _is_data_dependent(e2):
                hint = BRANCH_HELP
            kind = type(e2) if isinstance(e2, EinjoinError) else EinjoinError
            raise kind(f"from_torch: could not import {name}, neither with torch.export nor with "
                       f"the torch.fx fallback:\n  torch.export: {cause}\n  torch.fx: {detail}{hint}") from e2
