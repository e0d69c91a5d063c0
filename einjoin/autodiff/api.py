"""``ej.grad``, ``ej.value_and_grad``, ``ej.vjp`` and ``ej.stop_gradient`` on frontend tensors.

Gradients are lazy tensors like any other: ``ej.reference``, ``ej.compile([loss, *grads])`` and
everything downstream take them unchanged, and a gradient of a gradient works.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (3,), "float64")
>>> (dx,) = ej.grad((x * x).sum(), [x])
>>> ej.reference(dx, x=np.array([1.0, 2.0, 3.0]))
array([2., 4., 6.])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from einjoin.autodiff.backward import backward
from einjoin.errors import DTypeError, EinjoinError, ShapeError
from einjoin.frontend.tensor import Tensor, elementwise
from einjoin.ir import ops
from einjoin.ir.dtypes import kind
from einjoin.ir.fold import fold
from einjoin.ir.node import Node
from einjoin.ir.scalar import FUNCTIONS

__all__ = ["grad", "value_and_grad", "vjp", "stop_gradient"]

# one cotangent per output (a tensor, a number, or None for a one-element output), or one alone
Cotangents = Tensor | float | None | Sequence[Tensor | float | None]


def _tensor(x: Any, what: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, Node):
        return Tensor(x)
    raise EinjoinError(f"{what}: expected an einjoin tensor, got {type(x).__name__} {x!r:.60}")


def _wrt(wrt: Any) -> list[Tensor]:
    items = [wrt] if isinstance(wrt, (Tensor, Node)) or hasattr(wrt, "__einjoin_wrt__") else wrt
    if not isinstance(items, (list, tuple)):
        raise EinjoinError(f"wrt: expected a tensor or a list of tensors, got "
                           f"{type(wrt).__name__} {wrt!r:.60}")
    # a value standing for a graph input (ej.sparse_input: its values) is differentiated as that input
    out = [_tensor(getattr(w, "__einjoin_wrt__", w), f"wrt[{k}]") for k, w in enumerate(items)]
    for k, w in enumerate(out):
        if kind(w.dtype) != "float":
            raise DTypeError(f"wrt[{k}] is {w!r}: a gradient with respect to an {w.dtype} tensor "
                             f"has no meaning (only float tensors have gradients)")
    return out


def _cotangent(y: Tensor, c: Any, what: str) -> Node:
    if kind(y.dtype) != "float":
        raise DTypeError(f"{what} is {y!r}: only a float tensor can be differentiated")
    if c is None:
        if y.node.size != 1:
            raise ShapeError(f"{what} has shape {y.shape}: a gradient of a non-scalar needs a "
                             f"cotangent of that shape (grad(y, wrt, cotangent=...)), or reduce "
                             f"y to a scalar first")
        return ops.fill_node(y.shape, y.dtype, 1.0)
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return ops.fill_node(y.shape, y.dtype, float(c))
    ct = _tensor(c, f"the cotangent of {what}")
    if ct.shape != y.shape:
        raise ShapeError(f"the cotangent of {what} has shape {ct.shape} but {what} has shape "
                         f"{y.shape}")
    if kind(ct.dtype) != "float":
        raise DTypeError(f"the cotangent of {what} is {ct.dtype}; it must be a float tensor")
    return fold(ops.cast_node(ct.node, y.dtype))


def vjp(outputs: Tensor | Sequence[Tensor], cotangents: Cotangents,
        wrt: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """The vector-Jacobian product: ``sum_k cotangents[k] · ∂outputs[k]/∂wrt[j]`` for each
    ``wrt[j]``, a list in ``wrt`` order with ``wrt``'s shapes and dtypes. A cotangent may be
    None for a one-element output (a 1), or a number (a constant tensor). One tensor is one
    output (with one cotangent), as in ``torch.autograd.grad``.

    >>> import numpy as np, einjoin as ej
    >>> a = ej.input("a", (2,), "float64")
    >>> g = ej.input("g", (2,), "float64")
    >>> (da,) = ej.vjp([a * a], [g], [a])           # 2 a g
    >>> ej.reference(da, a=np.array([1.0, 2.0]), g=np.array([3.0, 1.0]))
    array([6., 4.])
    """
    return _vjp(outputs, cotangents, wrt, None)


def _vjp(outputs: Tensor | Sequence[Tensor], cotangents: Cotangents,
         wrt: Tensor | Sequence[Tensor], name: str | None) -> list[Tensor]:
    """:func:`vjp`; ``name`` names a single output in errors (``y`` of :func:`grad`)."""
    # one tensor is one output, as torch.autograd.grad takes it (iterating it would make each
    # of its rows an output); likewise one cotangent
    if isinstance(outputs, (Tensor, Node)):
        outputs = [outputs]
    if cotangents is None or isinstance(cotangents, (Tensor, Node, int, float)):
        cotangents = [cotangents]
    if not isinstance(outputs, (list, tuple)):
        raise EinjoinError(f"vjp: outputs must be a tensor or a list of tensors, got "
                           f"{type(outputs).__name__}")
    if not isinstance(cotangents, (list, tuple)):
        raise EinjoinError(f"vjp: cotangents must be a list (one per output), got "
                           f"{type(cotangents).__name__}")
    outs = [_tensor(y, name or f"outputs[{k}]") for k, y in enumerate(outputs)]
    cots = list(cotangents)
    if len(cots) != len(outs):
        raise EinjoinError(f"vjp: {len(outs)} output(s) but {len(cots)} cotangent(s)")
    gs = [_cotangent(y, c, name or f"outputs[{k}]") for k, (y, c) in enumerate(zip(outs, cots))]
    ws = _wrt(wrt)
    nodes = backward([y.node for y in outs], gs, [w.node for w in ws])
    return [Tensor(n) for n in nodes]


def grad(y: Tensor, wrt: Tensor | Sequence[Tensor], cotangent: Tensor | float | None = None
         ) -> list[Tensor]:
    """Lazy gradients of ``y`` (a scalar, or any tensor with a ``cotangent`` of its shape) with
    respect to each tensor of ``wrt`` (inputs or intermediate tensors) — always a list in
    ``wrt`` order, even for one tensor, each of its tensor's shape and dtype. A tensor that does
    not reach ``y`` gets an exact zero; an int or bool tensor in ``wrt`` is a DTypeError.

    >>> import numpy as np, einjoin as ej
    >>> w = ej.input("w", (2, 2), "float64"); x = ej.input("x", (2,), "float64")
    >>> dw, dx = ej.grad((w @ x).tanh().sum(), [w, x])
    >>> dw.shape, dx.shape, dw.dtype
    ((2, 2), (2,), 'float64')
    """
    y = _tensor(y, "grad: y")
    return _vjp([y], [cotangent], _wrt(wrt), "y")


def value_and_grad(y: Tensor, wrt: Tensor | Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """``(y, grad(y, wrt))``: compile both at once with ``ej.compile([y, *grads])``.

    >>> import einjoin as ej
    >>> x = ej.input("x", (4,), "float64")
    >>> loss, (dx,) = ej.value_and_grad(x.exp().sum(), x)
    >>> loss.shape, dx.shape
    ((), (4,))
    """
    y = _tensor(y, "value_and_grad: y")
    return y, grad(y, wrt)


def stop_gradient(t: Tensor) -> Tensor:
    """``t``'s value, with a zero gradient: gradients do not flow through it (torch's
    ``detach``).

    >>> import einjoin as ej
    >>> x = ej.input("x", (3,), "float64")
    >>> (dx,) = ej.grad((x * ej.stop_gradient(x)).sum(), [x])   # d/dx of x * const: the value of x
    >>> ej.reference(dx, x=[1.0, 2.0, 3.0]).tolist()
    [1.0, 2.0, 3.0]
    """
    t = _tensor(t, "stop_gradient")
    if t.dtype == "bool":  # a bool value has no gradient to stop (and no arithmetic)
        return t
    if "stop_gradient" not in FUNCTIONS:  # pragma: no cover - added by einjoin.ir with issue 18
        raise EinjoinError("stop_gradient: the scalar function 'stop_gradient' is not registered")
    return elementwise("stop_gradient", t)
