"""The ``nn`` modules that torch.fx keeps whole (a ``call_module`` node), translated: one entry per
module class name in :data:`MODULES`, each ``(module, its parameters by name, *inputs) -> Tensor``
built from the ATen translations (:data:`einjoin.frontend.aten.OPS`) and the losses.

>>> [name in MODULES for name in ("CrossEntropyLoss", "GroupNorm", "LSTM", "MultiheadAttention")]
[True, True, True, True]
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

from einjoin.errors import UnsupportedOpError
from einjoin.frontend import activations as A
from einjoin.frontend import aten
from einjoin.frontend import losses as L
from einjoin.frontend import norms as N
from einjoin.frontend import routing as R
from einjoin.frontend.aten_nn import TRAINING_BN_HELP
from einjoin.frontend.aten_conv import CONV_MODULES
from einjoin.frontend.attention_modules import ATTENTION_MODULES
from einjoin.frontend.losses import LOSS_MODULES
from einjoin.frontend.recurrent import RECURRENT_MODULES
from einjoin.frontend.resize import RESIZE_MODULES
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


def _batch_norm_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    # nn.BatchNorm's rule: batch statistics in training mode or without running stats
    batch_stats = m.training or p.get("running_mean") is None
    if m.training and p.get("running_mean") is not None:
        raise UnsupportedOpError(f"{type(m).__name__} in training mode with running statistics: {TRAINING_BN_HELP}")
    return N.batch_norm(x, p.get("running_mean"), p.get("running_var"), p.get("weight"), p.get("bias"),
                        batch_stats, m.momentum if m.momentum is not None else 0.1, m.eps)


def _instance_norm_m(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
    unbatched = x.ndim == {"InstanceNorm1d": 2, "InstanceNorm2d": 3, "InstanceNorm3d": 4}.get(type(m).__name__, -1)
    if unbatched:  # (C, ...) without the batch dim, as torch allows
        return _instance_norm_m(m, p, x.unsqueeze(0)).squeeze(0)
    use_input_stats = m.training or not m.track_running_stats
    if use_input_stats and m.track_running_stats:
        raise UnsupportedOpError(f"{type(m).__name__} with track_running_stats in training mode: {TRAINING_BN_HELP}")
    return N.instance_norm(x, p.get("running_mean"), p.get("running_var"), p.get("weight"), p.get("bias"),
                           use_input_stats, m.momentum if m.momentum is not None else 0.1, m.eps)


def _pad_m(mode: str) -> Callable[..., Tensor]:
    def f(m: Any, p: dict[str, Any], x: Tensor) -> Tensor:
        return R.pad(x, m.padding, mode, getattr(m, "value", None) if mode == "constant" else None)
    return f


def _bce_logits_m(m: Any, p: dict[str, Any], x: Tensor, t: Tensor) -> Tensor:
    return L.binary_cross_entropy_with_logits(x, t, p.get("weight"), str(m.reduction), p.get("pos_weight"))


_ACTIVATIONS: dict[str, Callable[..., Tensor]] = {
    "Softplus": lambda m, p, x: A.softplus(x, m.beta, m.threshold),
    "Mish": lambda m, p, x: A.mish(x),
    "Hardswish": lambda m, p, x: A.hardswish(x),
    "Hardsigmoid": lambda m, p, x: A.hardsigmoid(x),
    "ELU": lambda m, p, x: A.elu(x, m.alpha),
    "SELU": lambda m, p, x: A.selu(x),
    "CELU": lambda m, p, x: A.celu(x, m.alpha),
    "LeakyReLU": lambda m, p, x: A.leaky_relu(x, m.negative_slope),
    "ReLU6": lambda m, p, x: A.relu6(x),
    "Hardtanh": lambda m, p, x: A.hardtanh(x, m.min_val, m.max_val),
    "LogSigmoid": lambda m, p, x: A.log_sigmoid(x),
    "Softsign": lambda m, p, x: A.softsign(x),
    "Threshold": lambda m, p, x: A.threshold(x, m.threshold, m.value),
    "PReLU": lambda m, p, x: A.prelu(x, p["weight"]),
    "GLU": lambda m, p, x: A.glu(x, m.dim),
    "Softmin": lambda m, p, x: aten.OPS["softmin"](x, m.dim),
    "Flatten": lambda m, p, x: x.flatten(m.start_dim, m.end_dim),
    "Unflatten": lambda m, p, x: aten.OPS["unflatten"](x, m.dim, m.unflattened_size),
}

_NORMS: dict[str, Callable[..., Tensor]] = {
    **{f"BatchNorm{k}d": _batch_norm_m for k in (1, 2, 3)},
    **{f"InstanceNorm{k}d": _instance_norm_m for k in (1, 2, 3)},
    "GroupNorm": lambda m, p, x: N.group_norm(x, m.num_groups, p.get("weight"), p.get("bias"), m.eps),
    **{f"{kind}Pad{k}d": _pad_m(mode) for k in (1, 2, 3) for kind, mode in
       (("Constant", "constant"), ("Zero", "constant"), ("Reflection", "reflect"), ("Replication", "replicate"),
        ("Circular", "circular"))},
}

_LOSSES: dict[str, Callable[..., Tensor]] = {
    "L1Loss": lambda m, p, x, t: L.l1_loss(x, t, str(m.reduction)),
    "SmoothL1Loss": lambda m, p, x, t: L.smooth_l1_loss(x, t, str(m.reduction), m.beta),
    "HuberLoss": lambda m, p, x, t: L.huber_loss(x, t, str(m.reduction), m.delta),
    "BCEWithLogitsLoss": _bce_logits_m,
    "BCELoss": lambda m, p, x, t: L.binary_cross_entropy(x, t, p.get("weight"), str(m.reduction)),
    "KLDivLoss": lambda m, p, x, t: L.kl_div(x, t, str(m.reduction), m.log_target),
}


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
    **_ACTIVATIONS, **_NORMS, **_LOSSES, **RECURRENT_MODULES, **ATTENTION_MODULES, **RESIZE_MODULES,
    **CONV_MODULES,  # convolutions and pooling (frontend/aten_conv.py)
}
