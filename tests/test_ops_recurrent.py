"""Recurrences (issue 20): GRUCell / LSTMCell / RNNCell and nn.GRU / nn.LSTM / nn.RNN unrolled over
the fixed sequence length, imported with ``ej.from_torch`` (torch.export's ``gru_cell`` /
``gru.input`` ... and torch.fx's leaf modules), compiled for 1 and 2 devices, against torch; the
issue's GRUCell loop; gradients through the unrolled recurrence against torch.autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ops_harness import check_grads, check_import


class CellLoop(nn.Module):
    """The issue's GRUCell loop: a cell stepped over a fixed number of inputs, then a head."""

    def __init__(self, cell="gru", n_in=5, hidden=8, steps=6):
        super().__init__()
        self.steps = steps  # a Python int: torch.fx cannot loop over a traced size
        self.kind = cell
        self.cell = {"gru": nn.GRUCell, "lstm": nn.LSTMCell, "rnn": nn.RNNCell}[cell](n_in, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, xs):
        h = None
        for t in range(self.steps):
            h = self.cell(xs[:, t], h)
        return self.head(h[0] if self.kind == "lstm" else h)


@pytest.mark.parametrize("cell", ["gru", "lstm", "rnn"])
def test_cell_loop(cell):
    check_import(CellLoop(cell).eval(), (torch.randn(3, 6, 5),))


def test_gru_cell_loop_gradients():
    m = CellLoop("gru", steps=4).double()
    check_grads(_Loss(m), (torch.randn(2, 4, 5, dtype=torch.float64),))


class _Loss(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *args):
        out = self.m(*args)
        out = out[0] if isinstance(out, tuple) else out
        return (out * out).sum()


@pytest.mark.parametrize("kind", ["gru", "lstm", "rnn"])
@pytest.mark.parametrize("layers,bidirectional,batch_first", [(1, False, False), (2, True, True), (2, False, True)])
def test_unrolled_layers(kind, layers, bidirectional, batch_first):
    cls = {"gru": nn.GRU, "lstm": nn.LSTM, "rnn": nn.RNN}[kind]
    m = _Flat(cls(4, 6, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)).eval()
    x = torch.randn(2, 5, 4) if batch_first else torch.randn(5, 2, 4)
    check_import(m, (x,))


class _Flat(nn.Module):
    """The layer's outputs as one flat tuple (torch.fx keeps a module's nested tuple as is)."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, h = self.rnn(x)
        return (out, h[0], h[1]) if isinstance(self.rnn, nn.LSTM) else (out, h)


def test_lstm_with_initial_state_and_no_bias():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 5, num_layers=2, bias=False, batch_first=True)

        def forward(self, x, h, c):
            out, (hn, cn) = self.lstm(x, (h, c))
            return out, hn, cn
    check_import(M().eval(), (torch.randn(2, 4, 3), torch.randn(2, 2, 5), torch.randn(2, 2, 5)))


def test_unrolled_gradients():
    m = nn.LSTM(3, 4, num_layers=2, bidirectional=True, batch_first=True).double()
    check_grads(_Loss(m), (torch.randn(2, 5, 3, dtype=torch.float64),))
    g = nn.GRU(3, 4).double()
    check_grads(_Loss(g), (torch.randn(5, 2, 3, dtype=torch.float64),))
