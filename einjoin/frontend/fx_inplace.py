"""In-place ops in a torch.fx trace, made functional before translation.

``torch.fx`` records ``y.relu_()``, ``F.relu(y, inplace=True)``, ``nn.ReLU(inplace=True)(y)``,
``y.masked_fill_(m, v)``, ``y.copy_(z)``, ``operator.iadd(y, z)`` ... as ordinary nodes; the
translation computes each node's value once, so a reader of ``y`` after the write would see the
old value (silently wrong numbers). :func:`functionalize_inplace` rewrites the graph: every later
use of the written tensor (and of the in-place op's own result, the same tensor) reads the op's
result, cast back to the written tensor's dtype where another tensor argument could promote it.

What it cannot follow it refuses (:class:`~einjoin.errors.UnsupportedOpError`, naming the op,
where it is and why), as ``torch.export`` (``method="export"``, which functionalises) would not:

- a write to a view (``y[0].add_(1)``, ``y.t().relu_()``, ``torch.chunk(y, 2)[0].fill_(0)``) or to
  a tensor that may alias another (``x.contiguous()``, ``x.float()``, ``nn.Identity()(x)``): the
  base would have to change too;
- a write to a tensor that has a view read after the write (``v = y[0]; y.add_(1); return v``);
- a write to a forward argument: einjoin graphs are functional, the caller's tensor would not be
  written (``torch.export``'s import refuses it as well): clone it first (``x = x.clone()``);
- a write to a module parameter or buffer (its new value would be lost between calls;
  ``method="export"`` keeps a buffer's new value as ``buffer_updates``).
"""
from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from typing import Any

from einjoin.errors import UnsupportedOpError
from einjoin.frontend.node_source import module_path, source_line

# ops whose result is (or may be) a view of, or the same tensor as, their first argument
VIEW_OPS = frozenset({
    "getitem", "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims", "t",
    "permute", "narrow", "select", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "chunk", "split", "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "unbind",
    "diagonal", "movedim", "moveaxis", "as_strided", "unfold", "real", "imag", "view_as_real",
    "view_as_complex", "detach", "alias", "contiguous", "to", "type", "type_as", "float", "double",
    "half", "bfloat16", "int", "long", "short", "char", "byte", "bool", "cpu", "cuda", "align_as",
    "squeeze_", "unsqueeze_", "t_", "transpose_", "swapaxes_", "swapdims_", "detach_", "as_strided_",
    "T", "mT", "H", "mH", "data", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_to",
    "expand_copy", "ravel", "requires_grad_",
})
# nn modules that return their input (or a view of it)
VIEW_MODULES = frozenset({"Identity", "Flatten", "Unflatten"})
DROPOUT_MODULES = frozenset({"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                             "FeatureAlphaDropout"})
# ops returning a tuple of fresh tensors: getitem on their result is not a view
TUPLE_OPS = frozenset({"max", "min", "topk", "sort", "kthvalue", "median", "nanmedian", "mode", "var_mean",
                       "std_mean", "aminmax", "cummax", "cummin", "frexp", "unique", "unique_consecutive",
                       "histogram", "lstm", "gru", "rnn_tanh", "rnn_relu", "multi_head_attention_forward",
                       "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
                       "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices", "slogdet",
                       "qr", "svd", "eig", "eigh", "linalg_eigh", "broadcast_tensors", "meshgrid"})
# ops giving Python numbers / sizes: ``n += 1`` on them is no write to a tensor
NUMBER_OPS = frozenset({"size", "dim", "numel", "shape", "dtype", "device", "item", "tolist", "stride",
                        "ndim", "ndimension", "nelement", "element_size"})
# in-place-named methods that write no values
NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "record_stream"})
AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
             operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
             operator.imod: operator.mod, operator.ipow: operator.pow, operator.iand: operator.and_,
             operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
             operator.irshift: operator.rshift, operator.imatmul: operator.matmul}
# the writes that keep the written tensor's dtype already (no cast back needed)
KEEP_DTYPE = frozenset({"copy_", "fill_", "masked_fill_", "index_fill_", "zero_", "clamp_", "clamp_min_",
                        "clamp_max_", "clip_"})


def _name(node: Any) -> str:
    t = node.target
    if node.op == "call_method" or isinstance(t, str):
        return str(t)
    packet = getattr(t, "_overloadpacket", None)
    return str(packet.__name__) if packet is not None else str(getattr(t, "__name__", t))


def _inplace_kwarg(node: Any) -> bool:
    """``F.relu(x, inplace=True)``: fx records keyword ``inplace``; positional forms are bound
    against the function's signature."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get("inplace") is True


def _is_write(node: Any, modules: Mapping[str, Any]) -> bool:
    """Whether ``node`` writes its first argument in place."""
    import torch
    import torch.nn.functional as F
    if node.op == "call_module":
        return getattr(modules.get(node.target), "inplace", False) is True
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if node.op == "call_function" and node.target in AUGMENTED:
        return True
    name = _name(node)
    if name.endswith("_") and not name.startswith("_") and name not in NOT_WRITES and (
            hasattr(torch.Tensor, name) or hasattr(torch, name) or hasattr(F, name)):
        return True
    return _inplace_kwarg(node)


def _where(node: Any, root: str) -> str:
    return f"node {node.name} in {module_path(node, root)}: {source_line(node)}"


def _op_label(node: Any, modules: Mapping[str, Any]) -> str:
    if node.op == "call_module":
        return f"{type(modules[node.target]).__name__}(inplace=True)"
    return _name(node)


def functionalize_inplace(graph: Any, modules: Mapping[str, Any], root: str = "module") -> Any:
    """Rewrite the torch.fx ``graph`` (in place; returned) so that no node writes a tensor another
    node reads afterwards: each later reader of the written tensor reads the write's result.
    ``modules``: the traced module's ``named_modules()`` (``nn.ReLU(inplace=True)`` is a write);
    ``root``: its class name, for the messages. Raises UnsupportedOpError for a write it cannot
    follow (see the module docstring)."""
    import torch.fx

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    cls: dict[Any, Any] = {}  # a node -> the first node of the tensor it is (writes keep the tensor)
    latest: dict[Any, Any] = {}  # that first node -> the node holding the tensor's current value
    view_of: dict[Any, tuple[Any, str]] = {}  # a view (or possible alias) -> (the tensor it views, op)
    views: dict[Any, list[Any]] = {}  # a tensor (first node) -> views of it, transitively
    numbers: set[Any] = set()  # nodes that are Python numbers / sizes, not tensors

    def first(n: Any) -> Any:
        return cls.get(n, n)

    def now(n: Any) -> Any:
        return latest.get(first(n), n)

    def base(n: Any) -> Any:
        """The tensor ``n`` is a view of, followed to one that is no view."""
        n = first(n)
        while n in view_of:
            n = first(view_of[n][0])
        return n

    writes: set[Any] = set()
    for node in nodes:
        if (node.op == "call_method" and node.target == "type_as" and len(node.args) == 2 and node.args[0] in writes
                and isinstance(node.args[1], torch.fx.Node) and first(node.args[1]) == first(node.args[0])):
            # this pass's own cast back (a graph rewritten already, traced again): the same tensor
            cls[node] = first(node.args[0])
            latest[cls[node]] = node
            continue
        if node.op == "output" or node.op in ("call_function", "call_method", "call_module"):
            node.args = torch.fx.node.map_arg(node.args, now)
            node.kwargs = torch.fx.node.map_arg(node.kwargs, now)
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        src = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        name = _name(node) if node.op != "call_module" else type(modules[node.target]).__name__
        if src is not None and (src in numbers or (name in NUMBER_OPS and node.op != "call_module")
                                or (name == "getattr" and node.args[1] in NUMBER_OPS)):
            numbers.add(node)
            if node.op == "call_function" and node.target in AUGMENTED:
                node.target = AUGMENTED[node.target]  # n += 1 on a size: a new number
            continue
        if src is None:
            continue
        write = _is_write(node, modules)
        if not write:
            what = node.args[1] if name == "getattr" and len(node.args) > 1 else name
            module = modules.get(node.target) if node.op == "call_module" else None
            alias = (what in VIEW_OPS and (name != "getitem" or _name(src) not in TUPLE_OPS and
                                           src.op != "call_module")) if node.op != "call_module" else (
                name in VIEW_MODULES or (name in DROPOUT_MODULES and not getattr(module, "training", False)))
            if alias:
                view_of[node] = (src, str(what))
                views.setdefault(base(src), []).append(node)
            continue
        # a write to ``src``
        label = _op_label(node, modules)
        target = first(src)
        if node.op == "call_function" and node.target in AUGMENTED:
            node.target = AUGMENTED[node.target]  # translated as the plain op; the rebinding below
        why = None
        if target in view_of:
            viewed, op = view_of[target]
            why = (f"it writes {target.name}, a view of (or a tensor that may alias) {base(viewed).name} "
                   f"(made by {op!r}): the write would have to reach {base(viewed).name} too")
        elif target.op == "placeholder":
            why = (f"it writes the forward argument {target.target!r}: einjoin graphs are functional and "
                   f"the caller's tensor would not be written (torch.export's import refuses this too); "
                   f"write to a copy (x = x.clone()) instead")
        elif target.op == "get_attr":
            why = (f"it writes the module's tensor {target.target!r}, whose new value would be lost "
                   f"between calls; method='export' keeps a buffer's new value as buffer_updates")
        else:
            later = [v for v in views.get(target, ()) if any(order[u] > order[node] for u in v.users)]
            if later:
                why = (f"{later[0].name} (made by {view_of[later[0]][1]!r}) is a view of {target.name} and is "
                       f"read after the write: it would have to see the new values")
        if why is not None:
            raise UnsupportedOpError(
                f"from_torch: torch.fx capture of {root}: the in-place op {label!r} ({_where(node, root)}) "
                f"cannot be made functional: {why}. " + (
                    "Write the forward without the in-place op" if target.op == "placeholder" else
                    "Import with method='export' (torch.export functionalises in-place ops), or write the "
                    "forward without the in-place op"))
        result = node
        others = [a for a in [*node.args[1:], *node.kwargs.values()] if isinstance(a, torch.fx.Node)
                  and a not in numbers]
        if node.op != "call_module" and others and _name(node) not in KEEP_DTYPE:
            # in place keeps the written tensor's dtype (float32 += float64 stays float32)
            with graph.inserting_after(node):
                result = graph.call_method("type_as", (node, src))
            result.meta = dict(node.meta)
            cls[result] = target
        cls[node] = target
        latest[target] = result
        writes.add(node)
    graph.lint()
    return graph
