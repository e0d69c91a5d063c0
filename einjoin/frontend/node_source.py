"""Where a traced torch node came from, for error messages: the user's source line
(:func:`source_line`, :func:`user_frame`), the module path (:func:`module_path`) and how a user
spells its target (:func:`qualified_name`). Shared by the importer (``frontend/torch.py``) and the
torch.fx in-place pass (``frontend/fx_inplace.py``).

>>> import torch
>>> qualified_name(torch.nn.functional.gelu)
'torch.nn.functional.gelu'
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["source_line", "user_frame", "qualified_name", "module_path"]


def source_line(node: Any) -> str:
    """The module's source line that produced ``node`` (the last frame outside torch itself)."""
    trace = node.meta.get("stack_trace") or getattr(node, "stack_trace", None) or ""
    if not trace.strip():
        return "(no source line recorded)"
    return user_frame(trace) or "(inside torch's own code)"  # e.g. an nn layer called by Sequential


def user_frame(trace: str) -> str:
    """``File "...", line N, in f: code`` for the last frame of ``trace`` outside torch, or ''."""
    lines = trace.strip().splitlines()
    torch_dir = os.sep + "torch" + os.sep
    best = ""
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("File ") and torch_dir not in s:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            best = f"{s}: {code}"
    return best


def qualified_name(target: Any) -> str:
    """How a user would spell an fx node's target: ``torch.nn.functional.gelu`` rather than
    ``<built-in function gelu>``, ``torch.Tensor.cumsum`` for a method, ``aten.cumsum.default``
    for an ATen overload, ``torch.nn.Conv1d`` for a module class."""
    import operator

    import torch
    if isinstance(target, str):
        return f"torch.Tensor.{target}"  # an fx call_method
    if isinstance(target, torch._ops.OpOverload) or isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    name = getattr(target, "__name__", None)
    if name is not None:
        # the public namespaces first: torch.cumsum lives in torch._C._VariableFunctions
        for ns, label in ((torch.nn.functional, "torch.nn.functional"), (torch, "torch"),
                          (torch.nn, "torch.nn"), (torch.Tensor, "torch.Tensor"),
                          (torch.linalg, "torch.linalg"), (torch.special, "torch.special"),
                          (torch.fft, "torch.fft"), (operator, "operator"), (__import__("math"), "math")):
            if getattr(ns, name, None) is target:
                return f"{label}.{name}"
        mod = getattr(target, "__module__", None)
        qual = getattr(target, "__qualname__", name)
        return f"{mod}.{qual}" if mod else qual
    return repr(target)


def module_path(node: Any, root: str) -> str:
    """Where in the module tree ``node`` was recorded: ``blocks.0.attn (Attention)``."""
    stack = node.meta.get("nn_module_stack") or {}
    path, kind = "", root
    for value in stack.values():
        path, kind = value[0], value[1]
    if not isinstance(kind, str):
        kind = kind.__name__
    kind = kind.rsplit(".", 1)[-1]
    return f"{path} ({kind})" if path else f"the top module ({kind})"
