"""A model of identical layers, simulated through a few of them: the makespan of ``layers``
repetitions of a block from the simulations of two programs of ``k`` and ``k + 1`` of them.

Why: LLaMA-70B's forward is 80 identical decoder blocks; on 256 GPUs its task graph has some
15.6 million tasks, more than this process can build and replay in minutes. The blocks are the
same ops on the same shapes, so the planner gives the middle ones the same cuts (layer reuse)
and each middle block's tasks are the previous one's, shifted: the task graph is the first
block, one middle block repeated, the last block (a compressed task graph). Each middle block
then adds the same time once the pipeline between blocks has settled, so

    makespan(layers) = makespan(k + 1) + (layers - k - 1) * step,  step = makespan(k + 1) - makespan(k)

Why two programs and not one block's span in one: a block's tasks that read nothing of the
previous block (fills, tables) are ready at the start and run first in the ready order, so more
blocks delay the first one; the difference of two whole makespans counts that, a block's span
does not. It is an extrapolation, exact where the replay is periodic from the second block on;
:attr:`Repeated.periods` (each middle block's span in the longer program, when its tasks'
blocks are given) shows how periodic it is. ``tests/test_simulate_repeat.py`` checks it against
the full simulation of more blocks.

>>> import einjoin as ej
>>> def program(k):
...     x = ej.input("x", (64, 64))
...     for i in range(k):
...         x = ej.relu(x @ ej.input(f"w{i}", (64, 64)))
...     return ej.compile(x, devices=ej.Cluster.preset("dgx-a100", devices=2), backend="null", quiet=True)
>>> rep = repeat_layers(3, program(3).simulate(resident=True), program(4).simulate(resident=True), 80)
>>> rep.step > 0 and rep.makespan == rep.makespans[0] + 77 * rep.step
True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from einjoin.errors import EinjoinError
from einjoin.ir.graph import Graph
from einjoin.plan.taskgraph import TaskGraph
from einjoin.runtime.simulate import Simulation

__all__ = ["Repeated", "layer_of_tasks", "compiled_ends", "block_ends", "repeat_layers", "window_planner",
           "reuse_planner", "block_keys"]

WINDOW_PLANNER = "eindecomp-window"
REUSE_PLANNER = "window-reuse"


def window_planner() -> str:
    """The name (registered on first call) of ``eindecomp`` without its global ILP step
    (``Settings.ilp_max_ops`` = 1: no window is one op), for a window of a few identical blocks: a long model of them
    has more ops than ``ilp_max_ops`` and never gets that step, so its window must not either
    (a window of 3 blocks, 120 ops, would; ``ej.compile`` takes settings from no argument)."""
    from einjoin.planner import PLANNERS, seeded_eindecomp
    from einjoin.settings import SETTINGS
    if WINDOW_PLANNER not in PLANNERS:
        PLANNERS[WINDOW_PLANNER] = functools.partial(seeded_eindecomp, settings=SETTINGS.replace(ilp_max_ops=1))
    return WINDOW_PLANNER


def block_keys(graph: Graph, layer_of: Callable[[str], int | None], layers: int,
               interned: dict[Any, int] | None = None) -> dict[Any, int]:
    """Per node of ``graph`` (``layers`` identical blocks whose inputs are named so that
    ``layer_of(name)`` is their block, or None for inputs of no block), a key equal for the
    nodes that play the same part in a block of the same role: a node belongs to the first
    block whose inputs it meets downstream (an activation entering a block is that block's),
    the role of block ``i`` is first, middle or last (the graph's output: none), and the key is
    the node's op (inputs named without their block), shape, dtype, role and its inputs' keys
    inside its block, the role alone of those from another. So the middle blocks of programs of
    ``k`` and ``k + 1`` blocks have the same keys, and so do their last blocks (keys of two
    graphs compare when both calls share ``interned``, the numbering of keys)."""
    nodes = graph.nodes
    up: dict[Any, int] = {}  # the last block whose inputs a node reads, directly or not (-1: none)
    for n in nodes:
        own = layer_of(n.op.name) if n.facts.fed and hasattr(n.op, "name") else None
        up[n] = max([-1 if own is None else own, *(up[x] for x in n.inputs)])
    # a node's block: the first block a reader of it reads inputs of (the graph's output: none)
    down = {n: min((up[u] for u in graph.users[n]), default=layers) for n in nodes}

    def role(i: int) -> str:
        return "out" if i >= layers else "first" if i == 0 else "last" if i == layers - 1 else "middle"
    interned = {} if interned is None else interned
    keys: dict[Any, int] = {}
    for n in nodes:  # topological: inputs first
        op = n.op
        if n.facts.fed and hasattr(op, "name") and layer_of(op.name) is not None:
            op = dataclasses.replace(op, name=_unnumbered(op.name))  # type: ignore[arg-type]
        parts = tuple(keys[x] if down[x] == down[n] else role(down[x]) for x in n.inputs)
        keys[n] = interned.setdefault((type(op).__name__, op, n.shape, n.dtype, role(down[n]), parts), len(interned))
    return keys


def _unnumbered(name: str) -> str:
    """An input's name without its block's prefix (``l7.wq`` -> ``wq``): its part in a block."""
    return name.split(".", 1)[1] if "." in name else name


def reuse_planner(specs: Mapping[Any, Any], graph: Graph, layers: int, layer_of: Callable[[str], int | None]) -> str:
    """The name of a planner (registered) that plans a program of other many identical blocks
    with ``specs``, the plan of ``graph`` (``layers`` blocks): each node takes the spec of the
    node of ``graph`` with its key (:func:`block_keys`), so the ``k``-block window reuses the
    ``k + 1``-block plan instead of planning again (its first, middle and last blocks cut as
    there). Refused (:class:`EinjoinError`): a key whose nodes ``specs`` cuts differently (the
    blocks are not cut alike) or a node with no such key."""
    from einjoin.planner import PLANNERS
    table: dict[int, Any] = {}
    interned: dict[Any, int] = {}
    for node, key in block_keys(graph, layer_of, layers, interned).items():
        if node in specs:
            if table.setdefault(key, specs[node]) != specs[node]:
                raise EinjoinError(f"reuse_planner: two nodes of one part of a block are cut differently "
                                   f"({table[key]} and {specs[node]}): the blocks are not cut alike")

    def planner(g: Graph, cluster: Any, *, memory_limit: Any = None) -> dict[Any, Any]:
        n_layers = 1 + max((layer_of(x.op.name) or 0) for x in g.inputs if hasattr(x.op, "name"))
        out = {}
        for node, key in block_keys(g, layer_of, n_layers, interned).items():
            if key not in table:
                if node.facts.leaf:
                    continue  # an input or a fill the plan left to its readers
                raise EinjoinError(f"reuse_planner: no node of the planned {layers}-block program plays the part of "
                                   f"{node!r:.80}")
            out[node] = table[key]
        return out
    PLANNERS[REUSE_PLANNER] = planner  # a new function: the plan cache's key is another
    return REUSE_PLANNER


@dataclass(frozen=True)
class Repeated:
    """The makespan (s, simulated) of ``layers`` blocks extrapolated from the simulations of
    ``k`` and ``k + 1`` blocks (``makespans``): ``step``, what one more middle block adds;
    ``periods``, each middle block's span in the longer simulation (when the output is complete
    minus when the previous block's is; empty when not asked)."""

    layers: int
    k: int
    makespans: tuple[float, float]
    step: float
    makespan: float
    periods: tuple[float, ...] = ()


def layer_of_tasks(tg: TaskGraph, ends: Sequence[Any]) -> list[int]:
    """Per task of ``tg``, ``i`` if it computes or moves block ``i``'s output ``ends[i]`` (a
    tensor or node), else -1. An end that the compiler's fusion rebuilt (a new node: the user's
    is not in the task graph) is found as the compiled node of its shape and dtype that reads the
    same named inputs, the last of such (a block's output after its last weight's matmul)."""
    index = {n: i for i, n in enumerate(compiled_ends(tg, ends))}
    return [index.get(t.node, -1) for t in tg.tasks]


def compiled_ends(tg: TaskGraph, ends: Sequence[Any]) -> list[Any]:
    """The nodes of ``tg``'s graph that stand for ``ends`` (tensors or nodes): each end itself
    where its tasks are in ``tg``, else the node fusion rebuilt it as (:func:`layer_of_tasks`);
    an end with no such node stays as given."""
    nodes = [getattr(e, "node", e) for e in ends]
    present = {t.node for t in tg.tasks}
    return [n if n in present else _compiled(n, present) for n in nodes]


def _named_inputs(node: Any, memo: dict[Any, frozenset[str]]) -> frozenset[str]:
    """The names of the inputs ``node`` reads, directly or not (iteratively: deep graphs)."""
    stack = [node]
    while stack:
        n = stack[-1]
        if n in memo:
            stack.pop()
            continue
        todo = [x for x in n.inputs if x not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        own = frozenset((n.op.name,)) if n.facts.fed and hasattr(n.op, "name") else frozenset()
        memo[n] = own.union(*(memo[x] for x in n.inputs))
    return memo[node]


def _compiled(user: Any, present: set[Any]) -> Any:
    """The node of ``present`` that stands for ``user`` after fusion (see :func:`layer_of_tasks`),
    or ``user`` when none matches."""
    memo: dict[Any, frozenset[str]] = {}
    want = _named_inputs(user, memo)
    alike = [n for n in present if n.shape == user.shape and n.dtype == user.dtype
             and _named_inputs(n, memo) == want]
    read = {x for n in alike for x in n.inputs}
    last = [n for n in alike if n not in read]
    return last[0] if len(last) == 1 else user


def block_ends(sim: Simulation, task_layer: Sequence[int]) -> tuple[float, ...]:
    """When each block's output is complete in ``sim`` (its last task's end; ``task_layer``:
    :func:`layer_of_tasks` of the simulated task graph)."""
    ends = [0.0] * (max(task_layer, default=-1) + 1)
    for iv in sim.intervals.values():
        for _, end, tid in iv:
            i = task_layer[tid]
            if i >= 0 and end > ends[i]:
                ends[i] = end
    return tuple(ends)


def repeat_layers(k: int, shorter: Simulation, longer: Simulation, layers: int,
                  task_layer: Sequence[int] | None = None, tolerance: float = 0.01) -> Repeated:
    """The makespan of ``layers`` blocks from ``shorter`` and ``longer``, the simulations of
    programs of ``k`` and ``k + 1`` blocks (``k >= 3``: a first block, middle ones, a last one;
    ``layers >= k``), as the module's docstring says; with ``task_layer`` (of ``longer``'s
    task graph, :func:`layer_of_tasks`), its middle blocks' spans as ``periods``.

    Refused (an :class:`EinjoinError`): fewer blocks; a ``longer`` with no more tasks than
    ``shorter``, or a step <= 0 (one more block adds nothing: these are not the same blocks, one
    more of them); and, given ``task_layer``, middle blocks whose spans differ by more than
    ``tolerance`` of the longest (the replay is not periodic, so the step measures no block).

    >>> from einjoin.runtime.simulate import Simulation
    >>> def sim(ms, n):
    ...     return Simulation(ms, {}, {}, {}, {}, {}, "toy", tasks=(None,) * n)
    >>> repeat_layers(3, sim(3.0, 30), sim(4.0, 40), 10).makespan
    10.0
    >>> repeat_layers(3, sim(3.0, 30), sim(3.0, 40), 10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    einjoin.errors.EinjoinError: repeat_layers: one more block adds 0 s ...: no repeating block to extrapolate
    """
    if k < 3:
        raise EinjoinError(f"repeat_layers: k = {k} blocks; at least 3 are needed (a first, a middle one to repeat "
                           f"and a last)")
    if layers < k:
        raise EinjoinError(f"repeat_layers: {layers} blocks asked, fewer than the {k} simulated")
    if not 0 <= tolerance < 1:
        raise EinjoinError(f"repeat_layers: tolerance must be in [0, 1), got {tolerance!r}")
    if shorter.tasks and longer.tasks and len(longer.tasks) <= len(shorter.tasks):
        raise EinjoinError(f"repeat_layers: the {k + 1}-block simulation has {len(longer.tasks)} tasks, the {k}-block "
                           f"one {len(shorter.tasks)}: not the same blocks and one more")
    step = longer.makespan - shorter.makespan
    if not step > 0:
        raise EinjoinError(f"repeat_layers: one more block adds {step:.3g} s (simulated: {shorter.makespan:.3g} s for "
                           f"{k} blocks, {longer.makespan:.3g} s for {k + 1}): no repeating block to extrapolate")
    periods: tuple[float, ...] = ()
    if task_layer is not None:
        ends = block_ends(longer, task_layer)
        periods = tuple(b - a for a, b in zip(ends[:-2], ends[1:-1]))
        if len(periods) >= 2 and max(periods) - min(periods) > tolerance * max(periods):
            spans = ", ".join(f"{p:.4g}" for p in periods)
            raise EinjoinError(f"repeat_layers: the middle blocks' spans in the {k + 1}-block simulation differ by "
                               f"more than {tolerance:.0%} ({spans} s, simulated): the replay is not periodic, so "
                               f"{layers} blocks cannot be extrapolated from it (simulate more blocks, or all)")
    makespan = shorter.makespan + (layers - k) * step
    return Repeated(layers, k, (shorter.makespan, longer.makespan), step, makespan, periods)
