"""The ``nn`` modules that torch.fx keeps whole (a ``call_module`` node), translated: one entry per
module class name in :data:`MODULES`, each ``(module, its parameters by name, *inputs) -> Tensor``
built from the ATen translations (:data:`einjoin.frontend.aten.OPS`) and the losses.

>>> import torch
>>> sorted(MODULES)[:3]
['CrossEntropyLoss', 'Dropout', 'Embedding']
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from einjoin.errors import UnsupportedOpError
from einjoin.frontend import aten
from einjoin.frontend.losses import LOSS_MODULES
from einjoin.frontend.tensor import Tensor

__all__ = ["MODULES"]


def _linear_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    return typing.cast(Tensor, aten.OPS["linear"](x, p["weight"], p.get("bias")))


def _layer_norm_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    return typing.cast(Tensor, aten.OPS["layer_norm"](x, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps))


def _rms_norm_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    return typing.cast(Tensor, aten.OPS["rms_norm"](x, m.normalized_shape, p.get("weight"), m.eps))


def _dropout_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    return typing.cast(Tensor, aten.OPS["dropout"](x, m.p, m.training))


def _embedding_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    if m.max_norm is not None:
        raise UnsupportedOpError("nn.Embedding with max_norm= (torch renormalises the weight rows in place "
                                 "during the forward) is not supported")
    return aten.embedding(p["weight"], x, -1 if m.padding_idx is None else m.padding_idx, m.scale_grad_by_freq)


MODULES: dict[str, Callable[..., Tensor]] = {
    "Linear": _linear_m,
    "LayerNorm": _layer_norm_m,
    "RMSNorm": _rms_norm_m,
    "Embedding": _embedding_m,
    "Dropout": _dropout_m,
    "Identity": lambda m, p, x: x,
    "ReLU": lambda m, p, x: aten.OPS["relu"](x),
    "SiLU": lambda m, p, x: aten.OPS["silu"](x),
    "GELU": lambda m, p, x: aten.OPS["gelu"](x, m.approximate),
    "Tanh": lambda m, p, x: aten.OPS["tanh"](x),
    "Sigmoid": lambda m, p, x: aten.OPS["sigmoid"](x),
    "Softmax": lambda m, p, x: aten.OPS["softmax"](x, m.dim),  # dim None: torch's legacy rule
    "LogSoftmax": lambda m, p, x: aten.OPS["log_softmax"](x, m.dim),
    **LOSS_MODULES,  # CrossEntropyLoss, NLLLoss, MSELoss: (module, params, input, target)
}
