"""Relational autodiff: gradients as einsum graphs (``ej.grad``), planned with the forward pass.

It builds IR only, like the frontend: a gradient is an ordinary lazy tensor whose graph reuses
the forward's nodes.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 3), "float64"); w = ej.input("w", (3,), "float64")
>>> loss = (x @ w).sum()
>>> (dw,) = ej.grad(loss, [w])
>>> ej.reference(dw, x=np.ones((2, 3)))
array([2., 2., 2.])
"""

from einjoin.autodiff.api import grad, stop_gradient, value_and_grad, vjp
from einjoin.autodiff.backward import RULE_HITS, backward
from einjoin.autodiff.rules import GRAD_RULES

__all__ = ["grad", "value_and_grad", "vjp", "stop_gradient", "backward", "GRAD_RULES", "RULE_HITS"]
