"""The torch.fx capture's in-place pre-pass (einjoin/frontend/fx_inplace.py): later readers of a
tensor written in place read the write's result; writes it cannot follow are refused.

The pass runs on the traced graph before translation; here it is applied to the trace and the
rewritten graph imported as a GraphModule (the order from_torch(method="fx") runs them in)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import einjoin as ej
from einjoin.frontend.fx_inplace import functionalize_inplace


def _functional(m: nn.Module) -> torch.fx.GraphModule:
    graph = torch.fx.Tracer().trace(m)
    return torch.fx.GraphModule(m, functionalize_inplace(graph, dict(m.named_modules()), type(m).__name__))


def _matches(m: nn.Module, *args: torch.Tensor) -> None:
    m.eval()
    gm = _functional(m)
    expected = m(*[a.clone() for a in args])
    expected = expected if isinstance(expected, tuple) else (expected,)
    again = gm(*[a.clone() for a in args])
    again = again if isinstance(again, tuple) else (again,)
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))  # the rewrite runs as torch
    fn = ej.from_torch(gm, args, method="fx")
    for d in (1, 2):
        out = ej.compile(fn, devices=d).run(*args)
        out = out if isinstance(out, tuple) else (out,)
        for o, e in zip(out, expected, strict=True):
            assert np.asarray(o).dtype == e.detach().numpy().dtype
            np.testing.assert_allclose(np.asarray(o), e.detach().numpy(), rtol=1e-5, atol=1e-5)


class _Writes(nn.Module):
    """Every kind of in-place write the pass follows, each read after it."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.leaky = nn.LeakyReLU(0.2, inplace=True)
        self.hardtanh = nn.Hardtanh(-0.5, 0.5, inplace=True)
        self.drop = nn.Dropout(0.3, inplace=True)  # eval: the input itself

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 1
        y2 = y.addcmul_(z.double(), z)  # float32 stays float32 (in place keeps the dtype)
        w = y * 2  # reads the written y
        F.relu(y, inplace=True)
        self.relu(w)
        self.leaky(y)
        F.leaky_relu(w, 0.1, True)  # positional inplace
        y.masked_fill_(x > 0.5, 3.0)
        torch.relu_(y)
        self.hardtanh(w)
        self.drop(w)
        u = x + 1
        u.copy_(z)  # broadcast to u's shape
        v = x - 1
        v.fill_(2.0)
        return y + y2, w, u * v


def test_every_later_reader_sees_the_write_on_1_and_2_devices() -> None:
    _matches(_Writes(), torch.randn(3, 4), torch.randn(4))


class _Chain(nn.Module):
    """The write's own result used, and a write of the write's result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        r = y.relu_()
        s = r.clamp_min_(1.5)
        return y * 10 + r + s


def test_a_writes_result_is_the_same_tensor() -> None:
    _matches(_Chain(), torch.randn(5, 6))


def test_without_the_pass_the_readers_see_the_old_value() -> None:
    """The bug the pass fixes, shown on the raw trace: a function of the old value."""
    m = _Chain()
    x = torch.randn(5, 6)
    raw = torch.fx.GraphModule(m, torch.fx.Tracer().trace(m))
    _matches(m, x)
    # the raw graph run by torch is right (torch writes in place); only its node-by-node
    # translation, which reads each node's value once, would not be: count the readers of y
    y = next(n for n in raw.graph.nodes if n.name == "exp")
    assert len(y.users) == 2  # relu_ and the final mul: the mul reads the pre-write node
    fixed = _functional(m)
    y = next(n for n in fixed.graph.nodes if n.name == "exp")
    assert [u.name for u in y.users] == ["relu_"]


class _WriteView(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.ident = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if self.how == "getitem":
            y[0].relu_()
        elif self.how == "transpose":
            y.t().fill_(1.0)
        elif self.how == "chunk":
            torch.chunk(y, 2, 1)[0].masked_fill_(y[:, :2] > 0, 0.0)
        elif self.how == "identity":
            self.ident(y).relu_()
        elif self.how == "view_read_later":
            v = y[1:]
            F.relu(y, inplace=True)
            return v + 1
        elif self.how == "input":
            x.relu_()
        elif self.how == "buffer":
            self.get_buffer("b").fill_(0.0)
            return y + self.get_buffer("b")
        return y + 1


@pytest.mark.parametrize("how,says", [("getitem", "a view of"), ("transpose", "a view of"),
                                      ("chunk", "a view of"), ("identity", "may alias"),
                                      ("view_read_later", "read after the write"),
                                      ("input", "caller's tensor would not be written")])
def test_writes_it_cannot_follow_are_refused_naming_the_op_and_why(how: str, says: str) -> None:
    m = _WriteView(how)
    with pytest.raises(ej.UnsupportedOpError) as e:
        _functional(m)
    assert ("method='export'" in str(e.value)) == (how != "input")  # export refuses a write to an argument too
    assert says in str(e.value) and "_WriteView" in str(e.value) and "in-place op" in str(e.value)
    # export functionalises the writes to a view / under a view: the right numbers
    x = torch.randn(4, 4)
    if how == "input":  # export's import refuses it as well
        with pytest.raises(ej.UnsupportedOpError, match="mutates 'x'"):
            ej.from_torch(m, (x,), method="export")
    else:
        np.testing.assert_allclose(np.asarray(ej.compile(ej.from_torch(m, (x,), method="export")).run(x)),
                                   m(x.clone()).numpy(), rtol=1e-5, atol=1e-5)


class _BufferWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(x.mean())  # (with a constant, fx itself would run the write while tracing)
        return x + self.count


def test_a_write_to_a_buffer_is_refused() -> None:
    with pytest.raises(ej.UnsupportedOpError, match="count.*buffer_updates"):
        _functional(_BufferWrite())


class _Sizes(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        m = n
        n += 1  # a Python number: no write
        return x * m + n


def test_numbers_and_plain_augmented_assignment_are_untouched() -> None:
    _matches(_Sizes(), torch.randn(3, 2))


def test_a_rewritten_graph_traced_again_is_rewritten_to_itself() -> None:
    """from_torch(gm, method="fx") of a GraphModule this pass made runs the pass a second time."""
    m = _Writes().eval()
    _matches(_functional(m), torch.randn(3, 4), torch.randn(4))
