"""Recurrent cells and layers (torch's RNN / GRU / LSTM) unrolled over the fixed sequence length:
each step is linear EinSums and elementwise gates, so the planner splits batch, hidden and gate
dims of every step like any op, and ``ej.grad`` differentiates through the unrolled recurrence.
The input projection of a whole sequence is one EinSum (``x @ w_ih.T`` for every step at once);
only the hidden projection runs per step.

:data:`RECURRENT_OPS` holds the ATen translations (``gru_cell``, ``lstm_cell``, ``rnn_tanh_cell``,
``rnn_relu_cell``, and ``gru`` / ``lstm`` / ``rnn_tanh`` / ``rnn_relu`` with the flat weight list
torch passes: layers, directions, ``batch_first``); :data:`RECURRENT_MODULES` the ``nn`` modules
torch.fx keeps whole (``GRUCell``, ``LSTMCell``, ``RNNCell``, ``GRU``, ``LSTM``, ``RNN``).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (2, 3)); h = ej.input("h", (2, 4))
>>> w_ih, w_hh = ej.input("w_ih", (12, 3)), ej.input("w_hh", (12, 4))
>>> gru_cell(x, h, w_ih, w_hh).shape
(2, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from einjoin.errors import ShapeError, UnsupportedOpError
from einjoin.frontend import composites as C
from einjoin.frontend import functions as F
from einjoin.frontend.tensor import Tensor, _t, elementwise
from einjoin.ir.scalar import parse_join

__all__ = ["rnn_cell", "gru_cell", "lstm_cell", "recurrent", "RECURRENT_OPS", "RECURRENT_MODULES"]

_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}


def _chunks(t: Tensor, n: int) -> list[Tensor]:
    h = t.shape[-1] // n
    return [t[..., k * h:(k + 1) * h] for k in range(n)]


def _map(expr: str, *args: Tensor, name: str) -> Tensor:
    return elementwise(parse_join(expr, len(args)), *args, name=name)


def _step(kind: str, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One step from the input and hidden projections ``gi``, ``gh`` (biases included)."""
    if kind == "gru":  # torch's gate order: reset, update, new
        ir, iz, in_ = _chunks(gi, 3)
        hr, hz, hn = _chunks(gh, 3)
        n = _map("tanh(x0 + sigmoid(x1 + x2) * x3)", in_, ir, hr, hn, name="gru new gate")
        return _map("(1 - sigmoid(x0 + x1)) * x2 + sigmoid(x0 + x1) * x3", iz, hz, n, h, name="gru update"), None
    if kind == "lstm":  # input, forget, cell, output
        assert c is not None
        g = gi + gh
        i, f, gg, o = _chunks(g, 4)
        c2 = _map("sigmoid(x0) * x1 + sigmoid(x2) * tanh(x3)", f, c, i, gg, name="lstm cell")
        return _map("sigmoid(x0) * tanh(x1)", o, c2, name="lstm hidden"), c2
    fn = "tanh" if kind == "rnn_tanh" else "relu"
    return _map(f"{fn}(x0 + x1)", gi, gh, name=kind), None


def _cell(kind: str, x: Tensor, h: Tensor, c: Tensor | None, w_ih: Tensor, w_hh: Tensor, b_ih: Any,
          b_hh: Any) -> tuple[Tensor, Tensor | None]:
    x, h, w_ih, w_hh = _t(x, kind), _t(h, f"{kind} hidden"), _t(w_ih, f"{kind} w_ih"), _t(w_hh, f"{kind} w_hh")
    unbatched = x.ndim == 1
    if unbatched:
        x, h = x.unsqueeze(0), h.unsqueeze(0)
        c = None if c is None else c.unsqueeze(0)
    hidden = w_hh.shape[1]
    if w_ih.shape[0] != _GATES[kind] * hidden or h.shape[-1] != hidden:
        raise ShapeError(f"{kind}: weights {w_ih.shape} / {w_hh.shape} and hidden {h.shape} do not fit "
                         f"{_GATES[kind]} gates of {hidden}")
    h2, c2 = _step(kind, C.linear(x, w_ih, b_ih), C.linear(h, w_hh, b_hh), h, c)
    if unbatched:
        h2, c2 = h2.squeeze(0), None if c2 is None else c2.squeeze(0)
    return h2, c2


def rnn_cell(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
             b_hh: Tensor | None = None, nonlinearity: str = "tanh") -> Tensor:
    """torch's RNNCell: ``act(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh)``."""
    return _cell(f"rnn_{nonlinearity}", x, h, None, w_ih, w_hh, b_ih, b_hh)[0]


def gru_cell(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
             b_hh: Tensor | None = None) -> Tensor:
    """torch's GRUCell (gates reset, update, new): the next hidden state."""
    return _cell("gru", x, h, None, w_ih, w_hh, b_ih, b_hh)[0]


def lstm_cell(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,
              b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """torch's LSTMCell (gates input, forget, cell, output): the next (hidden, cell) states."""
    h2, c2 = _cell("lstm", x, h, _t(c, "lstm cell state"), w_ih, w_hh, b_ih, b_hh)
    assert c2 is not None
    return h2, c2


def _direction(kind: str, xs: Tensor, h0: Tensor, c0: Tensor | None, w: Sequence[Any],
               reverse: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer in one direction over time-major ``xs`` (T, B, I): (outputs (T, B, H), last h, last c)."""
    w_ih, w_hh, b_ih, b_hh = w
    gi_all = C.linear(xs, w_ih, b_ih)  # every step's input projection at once
    steps = xs.shape[0]
    outs: list[Tensor] = [h0] * steps
    h, c = h0, c0
    for t in (reversed(range(steps)) if reverse else range(steps)):
        h, c = _step(kind, gi_all[t], C.linear(h, w_hh, b_hh), h, c)
        outs[t] = h
    return F.stack(outs, 0), h, c


def recurrent(kind: str, x: Tensor, h0: Tensor | None, c0: Tensor | None, weights: Sequence[Any],
              num_layers: int = 1, bidirectional: bool = False, batch_first: bool = False
              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A multi-layer (bidirectional) RNN / GRU / LSTM unrolled over the sequence: ``weights`` is
    torch's flat list, per layer and direction ``[w_ih, w_hh, b_ih, b_hh]`` (biases may be None);
    ``x`` (T, B, I) or (B, T, I) with ``batch_first`` or (T, I) unbatched; ``h0`` / ``c0``
    (layers * directions, B, H) or None (zeros). Returns (output, h_n, c_n or None)."""
    x = _t(x, kind)
    unbatched = x.ndim == 2
    if unbatched:
        x = x.unsqueeze(1)
        h0 = None if h0 is None else h0.unsqueeze(1)
        c0 = None if c0 is None else c0.unsqueeze(1)
    elif batch_first:
        x = x.transpose(0, 1)
    dirs = 2 if bidirectional else 1
    if len(weights) != 4 * num_layers * dirs:
        raise UnsupportedOpError(f"{kind}: {len(weights)} weights for {num_layers} layers x {dirs} directions "
                                 f"(an LSTM with proj_size is not supported)")
    hidden = _t(weights[1], f"{kind} w_hh").shape[1]
    batch = x.shape[1]
    zeros = F.zeros((num_layers * dirs, batch, hidden), x.dtype)
    h0 = zeros if h0 is None else h0
    if kind == "lstm" and c0 is None:
        c0 = zeros
    layer_in = x
    hs: list[Tensor] = []
    cs: list[Tensor] = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, h, c = _direction(kind, layer_in, h0[k], None if c0 is None else c0[k], weights[4 * k:4 * k + 4],
                                   d == 1)
            outs.append(out)
            hs.append(h)
            if c is not None:
                cs.append(c)
        layer_in = outs[0] if dirs == 1 else F.concat(outs, -1)
    output, h_n = layer_in, F.stack(hs, 0)
    c_n = F.stack(cs, 0) if cs else None
    if unbatched:
        output, h_n = output.squeeze(1), h_n.squeeze(1)
        c_n = None if c_n is None else c_n.squeeze(1)
    elif batch_first:
        output = output.transpose(0, 1)
    return output, h_n, c_n


# ---------------------------------------------------------------- torch translations


def _flat_weights(params: Sequence[Any], has_biases: bool) -> list[Any]:
    ws = list(params)
    if has_biases:
        return ws
    out: list[Any] = []
    for k in range(0, len(ws), 2):
        out += [ws[k], ws[k + 1], None, None]
    return out


def _aten_rnn(kind: str) -> Callable[..., Any]:
    """aten ``gru.input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)`` and ``lstm.input`` (hx a pair); the packed-sequence forms are refused."""
    def f(x: Tensor, hx: Any, params: Any, has_biases: bool = True, num_layers: int = 1, dropout: float = 0.0,
          train: bool = False, bidirectional: bool = False, batch_first: bool = False) -> tuple[Any, ...]:
        if not isinstance(params, (list, tuple)):
            raise UnsupportedOpError(f"{kind} over a packed sequence (pack_padded_sequence); pass a padded tensor")
        if train and dropout > 0 and num_layers > 1:
            raise UnsupportedOpError(f"{kind} with dropout={dropout} between layers in training mode; "
                                     f"call module.eval() first")
        h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
        out, h_n, c_n = recurrent(kind, x, h0, c0, _flat_weights(params, has_biases), int(num_layers),
                                  bool(bidirectional), bool(batch_first))
        return (out, h_n, c_n) if kind == "lstm" else (out, h_n)
    return f


def _aten_cell(kind: str) -> Callable[..., Any]:
    def f(x: Tensor, hx: Any, w_ih: Tensor, w_hh: Tensor, b_ih: Any = None, b_hh: Any = None) -> Any:
        if kind == "lstm":
            return lstm_cell(x, hx[0], hx[1], w_ih, w_hh, b_ih, b_hh)
        return _cell(kind, x, hx, None, w_ih, w_hh, b_ih, b_hh)[0]
    return f


RECURRENT_OPS: dict[str, Callable[..., Any]] = {
    "gru_cell": _aten_cell("gru"), "lstm_cell": _aten_cell("lstm"),
    "rnn_tanh_cell": _aten_cell("rnn_tanh"), "rnn_relu_cell": _aten_cell("rnn_relu"),
    "gru": _aten_rnn("gru"), "lstm": _aten_rnn("lstm"),
    "rnn_tanh": _aten_rnn("rnn_tanh"), "rnn_relu": _aten_rnn("rnn_relu"),
}
"""The recurrent ATen ops, merged into :data:`einjoin.frontend.aten.OPS`."""


def _module_kind(m: Any) -> str:
    name = type(m).__name__.removesuffix("Cell")
    return {"GRU": "gru", "LSTM": "lstm"}.get(name) or f"rnn_{m.nonlinearity}"


def _cell_module(m: Any, p: dict[str, Any], x: Tensor, hx: Any = None) -> Any:
    kind = _module_kind(m)
    batch = () if x.ndim == 1 else (x.shape[0],)
    zeros = F.zeros(batch + (m.hidden_size,), x.dtype)
    if kind == "lstm":
        h, c = (zeros, zeros) if hx is None else hx
        return lstm_cell(x, h, c, p["weight_ih"], p["weight_hh"], p.get("bias_ih"), p.get("bias_hh"))
    return _cell(kind, x, zeros if hx is None else hx, None, p["weight_ih"], p["weight_hh"], p.get("bias_ih"),
                 p.get("bias_hh"))[0]


def _rnn_module(m: Any, p: dict[str, Any], x: Tensor, hx: Any = None) -> Any:
    kind = _module_kind(m)
    if getattr(m, "proj_size", 0):
        raise UnsupportedOpError("nn.LSTM with proj_size is not supported")
    if m.training and m.dropout > 0 and m.num_layers > 1:
        raise UnsupportedOpError(f"{type(m).__name__} with dropout={m.dropout} in training mode; call module.eval()")
    weights = []
    for layer in range(m.num_layers):
        for sfx in ("", "_reverse")[:2 if m.bidirectional else 1]:
            weights += [p[f"weight_ih_l{layer}{sfx}"], p[f"weight_hh_l{layer}{sfx}"],
                        p.get(f"bias_ih_l{layer}{sfx}"), p.get(f"bias_hh_l{layer}{sfx}")]
    h0, c0 = (hx if hx is not None else (None, None)) if kind == "lstm" else (hx, None)
    out, h_n, c_n = recurrent(kind, x, h0, c0, weights, m.num_layers, m.bidirectional, m.batch_first)
    return (out, (h_n, c_n)) if kind == "lstm" else (out, h_n)


RECURRENT_MODULES: dict[str, Callable[..., Any]] = {
    "GRUCell": _cell_module, "LSTMCell": _cell_module, "RNNCell": _cell_module,
    "GRU": _rnn_module, "LSTM": _rnn_module, "RNN": _rnn_module,
}
"""The recurrent ``nn`` modules torch.fx keeps whole, merged into ``nn_modules.MODULES``."""
