"""Issue 38 (H2): the hostile findings left open last session, differential against torch / numpy.

Each test failed before its fix (the commit that added it says what einjoin did instead):

- the module guard keeps a plain settings object the forward read (a ``SimpleNamespace``,
  dataclass or dict held by the module: ``m.cfg.mult = 5`` ran with the import's 2) and the
  attributes of a module whose forward reads them through ``object.__getattribute__``;
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from torch import nn

import einjoin as ej


def _close(got: object, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), want, rtol=tol, atol=tol, equal_nan=True)


# ---------------------------------------------------------------- 1. settings held in a plain object (C)


@dataclasses.dataclass
class _Cfg:
    mult: float = 2.0
    inner: dict = dataclasses.field(default_factory=lambda: {"bias": 1.0})


class _Held(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.lin, self.cfg = nn.Linear(4, 4), cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if isinstance(c, dict):
            return self.lin(x) * c["mult"] + c["inner"]["bias"]
        return self.lin(x) * c.mult + c.inner["bias"]


def _namespace() -> object:
    return types.SimpleNamespace(mult=2.0, inner={"bias": 1.0})


@pytest.mark.parametrize("make", [_namespace, _Cfg, lambda: {"mult": 2.0, "inner": {"bias": 1.0}}],
                         ids=["SimpleNamespace", "dataclass", "dict"])
def test_a_setting_in_a_plain_object_the_forward_read_is_guarded(make: object) -> None:
    """The guard notes reads through ``nn.Module.__getattribute__`` (and Hugging Face's config's);
    a ``SimpleNamespace``, dataclass or dict of settings held by the module is read past it, so
    ``m.cfg.mult = 5`` after the import ran silently with 2.0. The object's state is now kept
    whole and compared: a change is refused naming it; set back, it runs; an attribute of the
    module the forward never read still changes nothing."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    cfg = make()  # type: ignore[operator]
    m = _Held(cfg)
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    cfg = m.cfg  # torch.export puts a copy of a dict attribute back
    m.epoch = 1  # type: ignore[assignment]  # never read: runs
    set_ = (lambda k, v: cfg.__setitem__(k, v)) if isinstance(cfg, dict) else (lambda k, v: setattr(cfg, k, v))
    inner = cfg["inner"] if isinstance(cfg, dict) else cfg.inner  # type: ignore[attr-defined]
    with torch.no_grad():
        _close(prog.run(x), m(x))
        set_("mult", 5.0)
        with pytest.raises(ej.EinjoinError, match=r"cfg\.mult is 5\.0 now, 2\.0 when it was imported"):
            prog.run(x)
        set_("mult", 2.0)
        inner["bias"] = 3.0
        with pytest.raises(ej.EinjoinError, match=r"cfg\.inner\.bias is 3\.0 now, 1\.0"):
            prog.run(x)
        inner["bias"] = 1.0
        _close(prog.run(x), m(x))
        m.cfg = make()  # type: ignore[operator]  # an equal object: same graph
        _close(prog.run(x), m(x))


def test_a_setting_read_through_object_getattribute_is_guarded() -> None:
    """``object.__getattribute__(self, "scale")`` in a forward reads past the recorder: the
    module's attributes are guarded whole (m.scale = 5.0 ran with 2.0)."""
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(4, 4), 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * object.__getattribute__(self, "scale")

    torch.manual_seed(0)
    x, m = torch.randn(3, 4), Raw()
    prog = ej.compile(ej.from_torch(m, (x,)), quiet=True)
    with torch.no_grad():
        m.scale = 5.0
        with pytest.raises(ej.EinjoinError, match=r"scale is 5\.0 now, 2\.0 when it was imported"):
            prog.run(x)
        m.scale = 2.0
        _close(prog.run(x), m(x))

