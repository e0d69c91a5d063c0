"""A picture of a compiled plan: per op its spec and where its output blocks live, and the bytes
each op moves.

One panel per op (topological order, at most ``max_panels``): the title is the op (``%k`` as in
the printed graph, then its description) and its join-agg spec (blocks per label); the body is
the grid of its output blocks, each coloured by the device that holds it (cell sizes follow the
block boundaries; dims before the last are flattened into rows, a 1-D output is one row, a
scalar one cell). Below, a horizontal bar chart of the bytes moved per op (the ``bytes in`` /
``bytes out`` columns of ``Program.explain``, top ``top_bars`` ops). One colour legend for the
devices. matplotlib is imported only when a picture is drawn, and only its Agg canvas is used
(no window, no change to pyplot's backend).

>>> import os, tempfile, einjoin as ej
>>> x = ej.input("x", (16, 8)); w = ej.input("w", (8, 4))
>>> prog = ej.compile(ej.softmax(x @ w), devices=2)
>>> path = save_plan_png(prog, os.path.join(tempfile.mkdtemp(), "plan.png"))
>>> path.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
True
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from einjoin.errors import EinjoinError
from einjoin.ir.node import Node
from einjoin.ir.printing import describe
from einjoin.plan.stats import bytes_per_op, human_bytes

if TYPE_CHECKING:
    from einjoin.program import Program

__all__ = ["save_plan_png", "device_colors", "block_grid"]


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def device_colors(n_devices: int) -> list[tuple[float, float, float, float]]:
    """One RGBA colour per device: tab10 / tab20 while they suffice, then a sampled turbo map.

    >>> len(device_colors(3)), len(device_colors(64))
    (3, 64)
    """
    from matplotlib import colormaps

    if n_devices <= 10:
        return [colormaps["tab10"](i) for i in range(n_devices)]
    if n_devices <= 20:
        return [colormaps["tab20"](i) for i in range(n_devices)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(n_devices - 1, 1)) for i in range(n_devices)]


def block_grid(bounds: Sequence[Sequence[int]], homes: dict[Any, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The output blocks as a 2-D grid: (row edges, column edges, device per cell), edges in
    [0, 1] proportional to the block sizes; dims before the last are flattened into rows (row
    major, like the block keys); a block without a home is ``-1``.

    >>> ye, xe, dev = block_grid(((0, 2, 4), (0, 1, 4)), {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3})
    >>> ye.tolist(), xe.tolist(), dev.tolist()
    ([0.0, 0.5, 1.0], [0.0, 0.25, 1.0], [[0, 1], [2, 3]])
    >>> block_grid((), {(): 1})[2].tolist()
    [[1]]
    """
    sizes = [np.diff(np.asarray(b, dtype=float)) for b in bounds]
    if not sizes:
        cols, rows = np.ones(1), np.ones(1)
    elif len(sizes) == 1:
        cols, rows = sizes[0], np.ones(1)
    else:
        cols = sizes[-1]
        rows = functools.reduce(np.multiply.outer, sizes[:-1]).ravel()
    counts = [len(s) for s in sizes]
    keys = np.ndindex(*counts) if counts else iter([()])
    dev = np.array([homes.get(tuple(k), -1) for k in keys], dtype=float).reshape(len(rows), len(cols))

    def edges(s: np.ndarray) -> np.ndarray:
        total = float(s.sum()) or 1.0
        return np.concatenate([[0.0], np.cumsum(s) / total])

    return edges(rows), edges(cols), dev.astype(int)


def _panel(ax: Any, index: int, node: Node, program: Program, cmap: Any, n_dev: int) -> None:
    d = program.decomps[node]
    part = d.out_partition
    ye, xe, dev = block_grid(part.bounds, program.placement[node].homes)
    many = dev.size > 256
    ax.pcolormesh(xe, ye, np.ma.masked_less(dev, 0), cmap=cmap, vmin=-0.5, vmax=n_dev - 0.5,
                  edgecolors="face" if many else "white", linewidth=0 if many else 0.6)
    ax.set_xlim(0, 1)
    ax.set_ylim(1, 0)  # block row 0 at the top
    ax.set_facecolor("lightgrey")  # blocks with no home
    ax.set_xticks([])
    ax.set_yticks([])
    shape = "×".join(map(str, node.shape)) or "scalar"
    ax.set_title(f"%{index} {_short(describe(node), 34)}\n{_short(str(d.spec), 40)}\n"
                 f"{shape}, {part.num_blocks} block{'s' * (part.num_blocks != 1)}",
                 fontsize=6.5, loc="left")


def _bars(ax: Any, program: Program, index: dict[Node, int], top: int) -> None:
    per_op = bytes_per_op(program.taskgraph)
    moved = [(n, b) for n, b in per_op.items() if n in index and (b.moved_in or b.moved_out)]
    moved.sort(key=lambda nb: (-(nb[1].moved_in + nb[1].moved_out), index[nb[0]]))
    shown = moved[:top]
    total = human_bytes(program.stats.bytes_moved)
    if not shown:
        ax.text(0.5, 0.5, f"no bytes moved (total {total})", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    y = np.arange(len(shown))
    ax.barh(y - 0.2, [b.moved_in for _, b in shown], height=0.4, color="tab:blue",
            label="bytes in (feeding the op)")
    ax.barh(y + 0.2, [b.moved_out for _, b in shown], height=0.4, color="tab:orange",
            label="bytes out (its data, partials included)")
    ax.set_yticks(y, [f"%{index[n]} {_short(describe(n), 40)}" for n, _ in shown], fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.xaxis.set_major_formatter(lambda v, _pos: human_bytes(v))
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"bytes moved per op: top {len(shown)} of {len(moved)} ops that move data; "
                 f"total moved {total}", fontsize=9, loc="left")


def save_plan_png(program: Program, path: str | os.PathLike[str], *, max_panels: int = 48,
                  columns: int = 5, top_bars: int = 30, dpi: int = 100) -> pathlib.Path:
    """Draw ``program``'s plan (see the module docstring) to the PNG file ``path``; returns it.
    At most ``max_panels`` op panels (then a note "… N more ops"), ``columns`` per row, and the
    ``top_bars`` ops that move the most bytes in the bar chart. The folder of ``path`` is created
    first; a path that cannot be written raises an :class:`EinjoinError` before any drawing."""
    from einjoin.viz.trace import output_path
    for name, value, least in (("max_panels", max_panels, 1), ("columns", columns, 1),
                               ("top_bars", top_bars, 0), ("dpi", dpi, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise EinjoinError(f"save_plan_png: {name} must be an integer >= {least}, got {value!r}")
    out = output_path(path, "save_plan_png path")  # before the (slow) drawing, not after it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ops = list(program.graph.ops)
    index = {n: i for i, n in enumerate(ops)}
    n_dev = program.cluster.size
    colors = device_colors(n_dev)
    cmap = ListedColormap(colors)
    cut = len(ops) > max_panels
    drawn = ops[: max_panels - 1] if cut else ops
    slots = len(drawn) + cut
    columns = max(1, min(columns, slots))
    rows = math.ceil(slots / columns) if slots else 0
    n_bars = min(top_bars, sum(1 for b in bytes_per_op(program.taskgraph).values()
                               if b.moved_in or b.moved_out))
    bar_h = max(1.6, 0.26 * n_bars + 1.0)
    fig = Figure(figsize=(3.2 * columns if rows else 10, 2.0 * rows + bar_h + 1.2), dpi=dpi,
                 layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows + 1, max(columns, 1), height_ratios=[2.0] * rows + [bar_h])
    for i, node in enumerate(drawn):
        _panel(fig.add_subplot(grid[i // columns, i % columns]), index[node], node, program, cmap, n_dev)
    if cut:
        ax = fig.add_subplot(grid[len(drawn) // columns, len(drawn) % columns])
        ax.text(0.5, 0.5, f"… {len(ops) - len(drawn)} more ops", ha="center", va="center", fontsize=10)
        ax.set_axis_off()
    _bars(fig.add_subplot(grid[rows, :]), program, index, top_bars)
    shown = colors if n_dev <= 32 else colors[:32]
    handles = [Patch(facecolor=c, label=f"device {d}") for d, c in enumerate(shown)]
    if n_dev > 32:
        handles.append(Patch(facecolor="white", label=f"… {n_dev - 32} more (turbo scale)"))
    # the legend's title carries the figure's title (a suptitle would collide with the legend)
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 12), fontsize=7,
               title=f"{len(ops)} ops on {n_dev} devices; {program.stats}\n"
                     f"colour: the device holding each output block", title_fontsize=8, frameon=False)
    try:
        fig.savefig(out, format="png", dpi=dpi)
    except OSError as e:
        raise EinjoinError(f"save_plan_png could not write {str(out)!r}: {e.strerror or e}") from e
    return out
