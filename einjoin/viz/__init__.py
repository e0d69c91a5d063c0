"""Pictures and traces of plans and runs.

- :func:`save_plan_png` (``plan_png.py``): per op its spec and the device of each output block,
  and the bytes each op moves, as a PNG (matplotlib, imported only when drawing).
- :class:`TraceRecorder` (``trace.py``): an engine callback that writes a Chrome / Perfetto
  trace of a run, one track per device (``Program.run(trace="run.json")``).

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (8, 8))
>>> rec = TraceRecorder(2)
>>> _ = ej.compile(ej.softmax(x), devices=2).run(np.ones((8, 8), np.float32), callbacks=[rec])
>>> len(rec) > 0
True
"""

from einjoin.viz.plan_png import save_plan_png
from einjoin.viz.trace import TraceRecorder, task_name

__all__ = ["save_plan_png", "TraceRecorder", "task_name"]
