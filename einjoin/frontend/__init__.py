"""The frontend: einsum strings, a PyTorch-like lazy Tensor, NumPy-like functions and composites.
It builds IR only."""

from einjoin.frontend.composites import (attention, gelu, layer_norm, linear, log_softmax,
                                         rms_norm, rope, rotate_half, silu, softmax)
from einjoin.frontend.functions import *  # noqa: F401,F403
from einjoin.frontend.functions import __all__ as _fn_all
from einjoin.frontend.tensor import Tensor
from einjoin.frontend.torch import TorchFunction, from_torch

__all__ = ["Tensor", "TorchFunction", "from_torch", "attention", "gelu", "layer_norm", "linear", "log_softmax",
           "rms_norm", "rope", "rotate_half", "silu", "softmax", *_fn_all]
