"""Planning without the garbage collector re-scanning the objects that were there before it.

A search allocates many small tuples, and every so many allocations CPython's collector runs; a
full collection visits every tracked object of the process. After ``import torch`` (every model
imported with ``ej.from_torch``) that is ~330k objects, and one full collection during the first
plan of the demo's LLaMA block took 0.2-0.3 s of its ~0.6 s (measured with ``gc.callbacks``,
Dec 2026). :func:`old_objects_frozen` moves the objects that exist on entry to the permanent
generation (``gc.freeze``) for the duration and back to the oldest generation on exit
(``gc.unfreeze``): the planner's own garbage is collected as ever, the older objects are only
not visited meanwhile, and nothing is lost (they are collectable again after).

It does nothing when the collector is off or something is frozen already (an outer use, or a
program that freezes its own objects before forking: theirs stay frozen). Process-wide, like the
collector: a second thread planning meanwhile plans with them frozen too, and one that freezes
its own objects while a plan is in progress sees them unfrozen when that plan ends.

>>> import gc
>>> with old_objects_frozen():
...     gc.get_freeze_count() > 0
True
>>> gc.get_freeze_count()
0
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["old_objects_frozen"]


# True while a freeze of ours is in place. A nested use (ej.compile's eindecomp) checks this first:
# gc.get_freeze_count() walks the whole permanent generation (CPython 3.11 counts the list), so
# asking it inside our own freeze cost 0.02-0.1 s per call with 1M+ objects frozen.
_frozen_by_us = False


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """The objects of the process frozen for the ``with`` block (see the module's docstring)."""
    global _frozen_by_us
    if _frozen_by_us or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _frozen_by_us = True
    try:
        yield
    finally:
        _frozen_by_us = False
        gc.unfreeze()
