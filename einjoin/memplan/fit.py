"""The memory planner's finer cuts: when one task alone does not fit its device, the op that
sized its blocks is cut finer by :func:`einjoin.planner.fit.finer_spec` (and, last,
:func:`~einjoin.planner.fit.element_spec`) — the one finer-cut search the optimizer's fitting
uses too. This module only re-exports them where the memory planner's callers look.

>>> import einjoin as ej
>>> from einjoin.memplan.fit import finer_spec, op_need
>>> z = ej.input("a", (64, 32)) @ ej.input("b", (32, 16))
>>> d = ej.decompose(z.node)
>>> op_need(d), finer_spec(z.node, d.spec).counts()   # cutting the rows halves a and the output
(14336, {'m': 2, 'n': 1, 'k': 1})
"""

from __future__ import annotations

from einjoin.planner.fit import element_spec, finer_spec, op_need
from einjoin.settings import SETTINGS

__all__ = ["op_need", "finer_spec", "element_spec", "MAX_KERNELS"]

# the kernel limit is a setting now (SETTINGS.max_kernels); this name stays until
# einjoin.program reads the setting (issue 17), then goes
MAX_KERNELS = SETTINGS.max_kernels
