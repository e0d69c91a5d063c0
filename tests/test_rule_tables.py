"""Per-kind rule tables (issue 17, finding 3): every layer asks a node's kind through a table.

The convention this file enforces:

- A **rule table** is a module-level ``dict`` of any ``einjoin`` module whose keys are node-kind
  classes (members of :data:`einjoin.ir.node.KINDS`, the op classes). The tests find every one by
  importing every module of the package, so a new table needs no registration here. Each table

  * covers **every** kind of ``KINDS`` (a kind the concern does not apply to gets an explicit
    entry saying so: a rule returning nothing, 0 or the node unchanged, or one that raises), so
    a new kind is added table by table and a forgotten table fails here, naming it;
  * is named in capitals (a leading underscore allowed) ending in ``RULES``, ``KERNELS`` or
    ``FACTS`` (``DECOMPOSE_RULES``, ``BLOCK_KERNELS``, ``_SPEC_RULES``), one per concern.

- Code asks a table with :func:`einjoin.ir.node.rule_for`, which refuses a kind without an entry
  with an :class:`~einjoin.errors.EinjoinError` naming the table and the kind.

- Outside ``einjoin/ir/`` (the IR itself may look at its own classes) no module tests a node's kind
  any other way (an ast check): no ``isinstance``/``issubclass`` on an op class, no ``type(x)``
  (or ``x.__class__``, or its ``__name__``) compared with an op class or its name, no ``match``
  ``case Einsum():``, and no ``.kind`` compared with an op kind's name (``node.kind == "einsum"``).
  Two op kinds share their names with task kinds (``fill``, ``select``: ``task.kind == "fill"`` is
  a task test), so those two names count only where the receiver names a node or an op
  (``node.kind``, ``x.node.kind``, ``src_node.kind``, ``op.kind``). Boolean kind questions go
  to ``node.facts`` (:class:`einjoin.ir.node.KindFacts`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from budget import examples

import einjoin
from einjoin.errors import EinjoinError
from einjoin.ir.node import FACTS, KINDS, Node, rule_for

ROOT = Path(einjoin.__file__).parent
OP_NAMES = {k.__name__ for k in KINDS}
KIND_NAMES = {name.lower() for name in OP_NAMES}
_NAME = re.compile(r"_?([A-Z][A-Z0-9]*_)*(RULES|KERNELS|FACTS)")


# ---------------------------------------------------------------- (a) every table covers every kind

def _modules() -> Iterator[Any]:
    yield einjoin
    for info in pkgutil.walk_packages(einjoin.__path__, "einjoin."):
        if info.name != "einjoin.__main__":  # runs the command line when imported
            yield importlib.import_module(info.name)


def _defines(mod: Any, name: str) -> bool:
    """Whether ``mod``'s own source assigns ``name`` at top level (rather than importing it)."""
    path = getattr(mod, "__file__", None)
    return bool(path) and re.search(rf"^{re.escape(name)}\s*[:=]", Path(path).read_text(), re.M) is not None


def rule_tables() -> dict[str, dict[type, Any]]:
    """Every rule table of the package, as ``module.NAME -> table``, named where it is defined
    (a package re-exporting a table does not list it twice)."""
    seen: dict[int, list[tuple[Any, str, dict[type, Any]]]] = {}
    for mod in _modules():
        for name, value in vars(mod).items():
            if (isinstance(value, dict) and value
                    and all(isinstance(k, type) and k in KINDS for k in value)):
                seen.setdefault(id(value), []).append((mod, name, value))
    found = {}
    for places in seen.values():
        mod, name, table = next((p for p in places if _defines(p[0], p[1])), places[0])
        found[f"{mod.__name__}.{name}"] = table
    return dict(sorted(found.items()))


def test_the_tables_are_found() -> None:
    """The discovery is not vacuous: the tables of the IR and decomposition floors are among them."""
    names = set(rule_tables())
    for expected in ("einjoin.ir.node.FACTS", "einjoin.ir.kernels.KERNELS",
                     "einjoin.ir.printing.DESCRIBE_RULES", "einjoin.ir.fold.FOLD_RULES",
                     "einjoin.decomp.spec.LABEL_RULES", "einjoin.decomp.decompose.DECOMPOSE_RULES",
                     "einjoin.decomp.block_kernels.BLOCK_KERNELS", "einjoin.decomp.flops.FLOPS_RULES",
                     "einjoin.decomp.footprint.SCRATCH_RULES"):
        assert expected in names, f"{expected} is not found as a rule table (found: {sorted(names)})"


def test_every_rule_table_covers_every_node_kind() -> None:
    missing = {name: sorted(k.__name__ for k in set(KINDS) - set(table))
               for name, table in rule_tables().items() if set(KINDS) - set(table)}
    assert not missing, f"rule tables without an entry for some node kinds: {missing}"


def test_rule_tables_are_named_by_the_convention() -> None:
    wrong = [name for name in rule_tables() if not _NAME.fullmatch(name.rsplit(".", 1)[1])]
    assert not wrong, (f"rule tables must be named in capitals ending in RULES, KERNELS or FACTS: "
                       f"{wrong}")


def test_facts_is_one_literal_line_per_kind() -> None:
    """FACTS stays a dict literal, one kind a line (the shared decision), and its facts are
    consistent: ``leaf`` is ``fed`` or ``free``; a kind that contracts computes."""
    tree = ast.parse((ROOT / "ir" / "node.py").read_text())
    facts = next(n for n in tree.body if isinstance(n, ast.AnnAssign)
                 and isinstance(n.target, ast.Name) and n.target.id == "FACTS")
    assert isinstance(facts.value, ast.Dict)
    lines = [k.lineno for k in facts.value.keys if k is not None]
    assert len(lines) == len(set(lines)) == len(KINDS)
    for kind, f in FACTS.items():
        assert f.leaf == (f.fed or f.free) and not (f.fed and f.free), kind
        assert f.computes or not f.contracts, kind


# ---------------------------------------------------------------- (b) no kind tests outside the IR

def _is_type_of(e: ast.expr) -> bool:
    """``type(x)`` or ``x.__class__``."""
    return ((isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "type"
             and len(e.args) == 1) or (isinstance(e, ast.Attribute) and e.attr == "__class__"))


def _strings(e: ast.expr) -> set[str]:
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return {e.value}
    if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(x) for x in e.elts)) if e.elts else set()
    return set()


def _task_kinds() -> set[str]:
    try:
        from einjoin.exchange.tasks import TaskKind
    except ImportError:  # pragma: no cover - before the task kinds became an enum
        return {"fill", "select"}
    return {str(k.value) for k in TaskKind}


class _KindTests(ast.NodeVisitor):
    """Collects the node-kind tests of one module (see the module docstring)."""

    def __init__(self, ambiguous: set[str]) -> None:
        self.op_names: set[str] = set()   # local names of op classes
        self.modules: set[str] = set()    # local names of modules that hold op classes
        self.ambiguous = ambiguous
        self.found: list[tuple[int, str]] = []

    # imports: which local names are op classes, or modules holding them
    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").startswith("einjoin") and node.level == 0:
            for a in node.names:
                if a.name in OP_NAMES:
                    self.op_names.add(a.asname or a.name)
                elif node.module in ("einjoin", "einjoin.ir"):
                    self.modules.add(a.asname or a.name)  # from einjoin.ir import node, ops

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.startswith("einjoin"):
                self.modules.add(a.asname or a.name.split(".")[0])

    def _op_ref(self, e: ast.expr) -> bool:
        if isinstance(e, ast.Name):
            return e.id in self.op_names
        if isinstance(e, ast.Attribute) and e.attr in OP_NAMES:
            root: ast.expr = e
            while isinstance(root, ast.Attribute):
                root = root.value
            return isinstance(root, ast.Name) and root.id in self.modules
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return any(self._op_ref(x) for x in e.elts)
        return False

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append((getattr(node, "lineno", 0), f"{what}: {ast.unparse(node)[:90]}"))

    def visit_Call(self, node: ast.Call) -> None:
        if (isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2 and self._op_ref(node.args[1])):
            self._flag(node, f"{node.func.id} on an op class")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        if any(_is_type_of(s) for s in sides) and any(self._op_ref(s) for s in sides):
            self._flag(node, "type compared with an op class")
        names = set().union(*(_strings(s) for s in sides))
        if any(isinstance(s, ast.Attribute) and s.attr == "__name__" and _is_type_of(s.value)
               for s in sides) and names & OP_NAMES:
            self._flag(node, "type name compared with an op class's name")
        for s in sides:
            if isinstance(s, ast.Attribute) and s.attr == "kind" and names & KIND_NAMES:
                receiver = ast.unparse(s.value).rsplit(".", 1)[-1].lower()
                if names & KIND_NAMES - self.ambiguous or "node" in receiver or receiver == "op":
                    self._flag(node, "a node's .kind compared with an op kind's name")
        self.generic_visit(node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        if self._op_ref(node.cls):
            self._flag(node, "match on an op class")
        self.generic_visit(node)


def kind_tests(source: str, ambiguous: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, what) for every node-kind test in ``source`` (a module outside the IR)."""
    v = _KindTests(_task_kinds() & KIND_NAMES if ambiguous is None else ambiguous)
    tree = ast.parse(source)
    for stmt in ast.walk(tree):  # imports first, wherever they are (functions import lazily too)
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            v.visit(stmt)
    v.found.clear()
    for stmt in ast.walk(tree):
        if isinstance(stmt, (ast.Call, ast.Compare, ast.MatchClass)):
            # visit each node once: generic_visit would descend again into nested ones
            getattr(v, f"visit_{type(stmt).__name__}").__func__(_NoDescend(v), stmt)
    return sorted(set(v.found))


class _NoDescend:
    """A view of a visitor whose generic_visit does nothing (ast.walk already reaches every node)."""

    def __init__(self, v: _KindTests) -> None:
        self._v = v

    def __getattr__(self, name: str) -> Any:
        return getattr(self._v, name)

    def generic_visit(self, node: ast.AST) -> None:
        pass


def test_the_kind_test_check_finds_each_form() -> None:
    """The ast check itself: each forbidden form is found, the allowed ones are not."""
    bad = '''
from einjoin.ir.node import Einsum, Fill as F
import einjoin.ir.node as irn
from einjoin.ir import node
isinstance(x.op, Einsum)
isinstance(x.op, (int, F))
issubclass(t, irn.Gather)
type(op) is node.Cast
type(x.op) in (Einsum, F)
x.op.__class__ == Einsum
type(x.op).__name__ == "Reshape"
x.kind == "einsum"
n.kind in ("broadcast", "load")
node.kind == "fill"
src.node.kind != "select"
match op:
    case Einsum():
        pass
'''
    found = kind_tests(bad, {"fill", "select"})
    assert [line for line, _ in found] == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17], found
    fine = '''
from einjoin.ir.node import Einsum, Node, rule_for
isinstance(x, Node)
isinstance(v, (int, float))
type(x) is int
t.kind == "fill"
task.kind in ("load", "select")
rule_for(TABLE, node.op, "table")
node.facts.free
d.kind == "cpu"
'''
    assert kind_tests(fine, {"fill", "select"}) == []


def test_no_module_outside_the_ir_tests_node_kinds() -> None:
    """Strict: every module outside einjoin/ir/ asks rule tables and facts, never the kind itself."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if (ROOT / "ir") in path.parents:
            continue
        for line, what in kind_tests(path.read_text()):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}: {what}")
    assert not found, "node-kind tests outside the IR (use a rule table or node.facts):\n" + "\n".join(found)


# ---------------------------------------------------------------- (c) an unknown kind is refused clearly

_TABLES = sorted(rule_tables().items())


def _fake_kind(name: str) -> type:
    return dataclasses.make_dataclass(name, [], frozen=True)


def _entry_points() -> dict[str, Callable[[Node], Any]]:
    from einjoin.decomp import decompose
    from einjoin.decomp.spec import aggregated_labels, label_sizes
    from einjoin.ir.kernels import eval_node
    from einjoin.ir.printing import describe
    return {"describe": describe, "eval_node": lambda n: eval_node(n, []),
            "decompose": decompose, "label_sizes": label_sizes,
            "aggregated_labels": aggregated_labels, "facts": lambda n: n.facts}


_kind_names = st.from_regex(r"[A-Z][a-z]{2,10}", fullmatch=True)


@settings(max_examples=examples(40), deadline=None)
@given(_kind_names, st.sampled_from(_TABLES))
def test_a_table_refuses_a_kind_it_lacks_naming_both(name: str, table: tuple[str, dict]) -> None:
    label, rules = table
    op = _fake_kind(name)()
    with pytest.raises(EinjoinError) as e:
        rule_for(rules, op, label)  # type: ignore[arg-type]
    assert label in str(e.value) and repr(name) in str(e.value)


@settings(max_examples=examples(40), deadline=None)
@given(_kind_names, st.sampled_from(sorted(_entry_points())), st.sampled_from(["float32", "int64"]))
def test_a_node_of_an_unknown_kind_is_refused_with_the_table_named(name: str, entry: str,
                                                                      dtype: str) -> None:
    """A kind added to the IR without its rules fails at the first table asked, with an
    EinjoinError that names the kind and the table (not a KeyError or a wrong answer)."""
    node = Node(_fake_kind(name)(), (), (2, 3), dtype)  # type: ignore[arg-type]
    with pytest.raises(EinjoinError) as e:
        _entry_points()[entry](node)
    msg = str(e.value)
    assert repr(name) in msg and "has no rule for node kind" in msg
    assert any(t.rsplit(".", 1)[1] in msg for t in rule_tables()), msg


def test_the_fold_rule_of_a_cast_changes_the_expression_s_kind() -> None:
    """FOLD_RULES[Cast]: a folded cast's fill gives values of the new kind, so an op folded over
    it later sees that kind (a causal bool mask cast to int64 and multiplied, as T5's relative
    position buckets do, was refused: 'mul does not take bool arguments')."""
    import numpy as np
    from einjoin.ir import ops
    from einjoin.ir.fold import fold
    mask = ops.fill_node((4, 4), "bool", "x1 - x0 > 0")
    as_int = fold(ops.cast_node(mask, "int64"))
    scaled = fold(ops.einsum_node([as_int], ("ij",), "ij", "x0 * 16", None))
    assert scaled.kind == "fill" and scaled.dtype == "int64"
    np.testing.assert_array_equal(einjoin.reference(einjoin.Tensor(scaled)), np.triu(np.full((4, 4), 16), 1))
    as_bool = fold(ops.cast_node(ops.fill_node((3,), "int64", "x0 - 1"), "bool"))
    np.testing.assert_array_equal(einjoin.reference(einjoin.Tensor(as_bool)), [True, False, True])
