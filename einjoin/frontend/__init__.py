"""The frontend: einsum strings, a PyTorch-like lazy Tensor, NumPy-like functions and composites.
It builds IR only."""

from einjoin.frontend.composites import (attention, gelu, layer_norm, linear, log_softmax,
                                         rms_norm, rope, rotate_half, silu, softmax)
from einjoin.frontend.activations import (celu, elu, glu, hardsigmoid, hardswish, hardtanh, leaky_relu,
                                          log_sigmoid, mish, prelu, relu6, selu, softplus, softsign)
from einjoin.frontend.functions import *  # noqa: F401,F403
from einjoin.frontend.functions import __all__ as _fn_all
from einjoin.frontend.losses import (binary_cross_entropy, binary_cross_entropy_with_logits, huber_loss, kl_div,
                                     l1_loss, smooth_l1_loss)
from einjoin.frontend.norms import batch_norm, batch_norm_train, group_norm, instance_norm
from einjoin.frontend.resize import interpolate
from einjoin.frontend.routing import (argmax, argmin, cumprod, cumsum, index_add, index_copy, index_put,
                                      index_select, max_dim, min_dim, one_hot, pad, scatter, scatter_add,
                                      scatter_reduce, take_along_dim)
from einjoin.frontend.tensor import Tensor
from einjoin.frontend.torch import TorchFunction, from_torch
from einjoin.frontend import torch_fx as _torch_fx  # noqa: F401 - registers from_torch's torch.fx fallback

__all__ = ["Tensor", "TorchFunction", "from_torch", "attention", "gelu", "layer_norm", "linear", "log_softmax",
           "rms_norm", "rope", "rotate_half", "silu", "softmax", *_fn_all,
           # issue 20: activations, norms, losses, routing and indexing
           "celu", "elu", "glu", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "log_sigmoid", "mish",
           "prelu", "relu6", "selu", "softplus", "softsign",
           "batch_norm", "batch_norm_train", "group_norm", "instance_norm",
           "binary_cross_entropy", "binary_cross_entropy_with_logits", "huber_loss", "kl_div", "l1_loss",
           "smooth_l1_loss",
           "argmax", "argmin", "cumprod", "cumsum", "index_add", "index_copy", "index_select", "max_dim",
           "min_dim", "one_hot", "pad", "scatter", "scatter_add", "take_along_dim", "interpolate", "index_put",
           "scatter_reduce"]
