"""The floors of docs/architecture.md, enforced: a lower floor never imports a higher one, the
IR builders (frontend, models) import the IR only, and no module of einjoin/ is part of an import
cycle (issue 17, finding 6).

Imports are read with `ast`, not by importing: every `import` / `from ... import` counts, at
module level or inside a function (a function-level import is a dependency that runs later, and
hiding a cycle in a function is what this test exists to stop), except under
`if TYPE_CHECKING:`, which never runs. Relative imports are resolved; `from pkg import name`
is an import of the submodule `pkg.name` when that module exists, else of `pkg` itself; an
import of `einjoin.a.b` also imports the package `einjoin.a` (its `__init__` runs first).
"""
from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "einjoin"

# Low to high. A module's room is the first name under einjoin/ (einjoin/ir/node.py is in `ir`,
# einjoin/program.py in `program`, einjoin/__init__.py in `__init__`). A module may import its
# own room, its own floor and lower floors, never a higher floor.
FLOORS: list[set[str]] = [
    # the base: the error family, registries, tunables, the IR, the cluster; `progress` (rich
    # status and bars) imports nothing of einjoin and may be used by any floor that reports
    {"errors", "registry", "settings", "ir", "cluster", "progress"},
    {"decomp"},                       # label spaces, specs, block kernels
    {"planner", "placement"},         # graph + cluster -> specs; kernels -> devices
    {"exchange"},                     # blocks produced x blocks wanted -> select / move / touch
    {"plan"},                         # the task graph
    {"memplan"},                      # the task graph under memory caps
    {"runtime"},                      # the engine and its backends
    {"sparse"},                       # block-sparse relations, their layout and executor (issue 24)
    {"frontend", "models", "viz", "autodiff", "train"},  # build IR (user code, model zoo, gradients,
    # optimizer steps); draw plans and traces
    {"program", "compiler", "cli", "demo", "__main__", "__init__", "trainer", "trainer_io", "generate",
     "variants", "program_io", "program_explain", "program_state"},
    # ^ wiring: ej.compile, CLI; programs per shape signature, saved programs, explain()
]

# The frontend, the models and autodiff build IR only: they may import these rooms and nothing else,
# whatever their floor (a frontend that plans or runs would hide a second compiler).
IR_BUILDERS: dict[str, set[str]] = {
    "frontend": {"errors", "registry", "settings", "ir", "frontend"},
    "models": {"errors", "registry", "settings", "ir", "frontend", "models"},
    # gradients are graphs too: built from the IR and the frontend's tensors, nothing above
    "autodiff": {"errors", "registry", "settings", "ir", "frontend", "autodiff"},
    # optimizer steps and clipping are graphs too (the Trainer that runs them is einjoin.trainer)
    "train": {"errors", "registry", "settings", "ir", "frontend", "autodiff", "train"},
}

FLOOR_OF = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file for every module under `root` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def room_of(module: str) -> str:
    """einjoin.ir.node -> ir; einjoin.program -> program; einjoin -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, source: str, is_package: bool, known: set[str],
               top: str = "einjoin") -> list[tuple[int, str]]:
    """(line, imported module) for every import of a module under `top` in `source`."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names
                    if a.name == top or a.name.startswith(top + ".")]
            continue
        if node.level:
            base = package.split(".")
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not (target == top or target.startswith(top + ".")):
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            out.append((node.lineno, sub if sub in known else target))
    # importing einjoin.planner.search runs einjoin/planner/__init__.py first (unless it is a
    # package of the importer itself, already running; einjoin/__init__.py always is)
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    for line, target in list(out):
        parts = target.split(".")
        out += [(line, ".".join(parts[:i])) for i in range(2, len(parts))
                if ".".join(parts[:i]) not in own and ".".join(parts[:i]) in known]
    return sorted(set(out))


def import_graph(root: pathlib.Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """module -> [(line, imported einjoin module)], over every module under `root`."""
    modules = _modules(root)
    known = set(modules)
    return {m: imports_of(m, p.read_text(), p.name == "__init__.py", known, top=root.name)
            for m, p in modules.items()}


def floor_violations(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for module, imports in sorted(graph.items()):
        src = room_of(module)
        for line, target in imports:
            dst = room_of(target)
            if src in FLOOR_OF and dst in FLOOR_OF and FLOOR_OF[dst] > FLOOR_OF[src]:
                bad.append(f"{module}:{line} imports {target} ({dst}, floor {FLOOR_OF[dst]} "
                           f"above {src}, floor {FLOOR_OF[src]})")
            if src in IR_BUILDERS and dst not in IR_BUILDERS[src]:
                bad.append(f"{module}:{line} imports {target}: {src} builds IR only "
                           f"(may import {', '.join(sorted(IR_BUILDERS[src]))})")
    return bad


def cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iterative); each sorted, the list sorted."""
    succ = {m: sorted({t for _, t in imps if t in graph}) for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1 or node in succ[node]:
                    found.append(sorted(component))
    return sorted(found)


def _cycle_report(graph: dict[str, list[tuple[int, str]]], component: list[str]) -> str:
    members = set(component)
    edges = [f"  {m}:{line} -> {t}" for m in component for line, t in graph[m] if t in members]
    return "cycle among " + ", ".join(component) + "\n" + "\n".join(edges)


# --- the checks on einjoin/ -------------------------------------------------------------------

GRAPH = import_graph()


def test_every_room_has_a_floor():
    rooms = {room_of(m) for m in GRAPH}
    missing = sorted(rooms - set(FLOOR_OF))
    assert not missing, f"rooms with no floor in tests/test_imports.py FLOORS: {missing}"


def test_a_lower_floor_never_imports_a_higher_one():
    bad = floor_violations(GRAPH)
    assert not bad, "imports against the floors of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "\n".join(_cycle_report(GRAPH, c) for c in found)


# --- the checker itself, on made-up packages ---------------------------------------------------

def _write(tmp: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp / "einjoin" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp / "einjoin"


def test_checker_sees_function_level_relative_and_submodule_imports(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "from einjoin.program import compile\n",
        "program.py": "import einjoin.runtime.engine\n",
        "ir/__init__.py": "from . import node\n",
        "ir/node.py": ("from typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from einjoin.program import Program\n"
                       "else:\n    from ..errors import EinjoinError\n"
                       "def f():\n    from ..runtime import engine\n"),
        "errors.py": "",
        "runtime/__init__.py": "",
        "runtime/engine.py": "from einjoin.ir import node\n",
    })
    graph = import_graph(root)
    assert graph["einjoin.ir.node"] == [(5, "einjoin.errors"), (7, "einjoin.runtime"),
                                        (7, "einjoin.runtime.engine")]
    assert graph["einjoin.ir"] == [(1, "einjoin.ir.node")]
    assert graph["einjoin.program"] == [(1, "einjoin.runtime"), (1, "einjoin.runtime.engine")]
    assert graph["einjoin.runtime.engine"] == [(1, "einjoin.ir"), (1, "einjoin.ir.node")]
    assert floor_violations(graph) == [
        "einjoin.ir.node:7 imports einjoin.runtime (runtime, floor 6 above ir, floor 0)",
        "einjoin.ir.node:7 imports einjoin.runtime.engine (runtime, floor 6 above ir, floor 0)"]
    # ir.node -> runtime.engine -> ir (its __init__) -> ir.node
    assert cycles(graph) == [["einjoin.ir", "einjoin.ir.node", "einjoin.runtime.engine"]]


@pytest.mark.parametrize("source, ok", [
    ("from einjoin.ir.node import Node\n", True),
    ("from einjoin.frontend.tensor import Tensor\n", True),
    ("import einjoin as ej\n", False),              # the top package wires everything
    ("from einjoin.planner import plan\n", False),
    ("from einjoin.decomp.spec import JoinAggSpec\n", False),
])
def test_models_build_ir_only(tmp_path, source, ok):
    root = _write(tmp_path, {"models/graphs.py": source, "ir/node.py": "",
                             "frontend/tensor.py": "", "decomp/spec.py": ""})
    assert (floor_violations(import_graph(root)) == []) is ok
