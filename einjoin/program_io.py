"""``prog.save(path)`` and ``ej.load(path)``: a compiled program as one file that loads without
planning again and runs bit-identically.

The file is a zip archive (stored CRC-32 per member: a flipped byte is found) of three members:

- ``einjoin.json``: the manifest, ``{"format": "einjoin.Program", "version": 1}``, read first, so
  a file from a newer einjoin is refused before anything else is parsed;
- ``program.json``: the graph (a node table in creation order: each node's op payload, input
  ids, shape, dtype) and the plan (the cluster, each node's decomposition, the placement, the
  task graph with its memory plan, the stats, the options, the state slots, the forward's
  argument names);
- ``arrays.safetensors``: the bound weights and the state's current values.

An imported forward's output structure (a dict, a nested tuple, a NamedTuple, a Hugging Face
``ModelOutput``: ``CompiledPlan.structure``) is kept as ``torch.utils._pytree.treespec_dumps``'s
JSON, never pickled. Where it does not serialise (a node type registered without a
``serialized_type_name``, such as a plain NamedTuple, unless registered with
``torch.utils._pytree._register_namedtuple``; a context that is no plain JSON) the file is
written without it and a :class:`StructureWarning` says so; where the file names a type this
process has not registered (its module not imported yet: import it before ``ej.load``, e.g.
``transformers``' model module), ``ej.load`` warns the same way. Either way the loaded program
returns the outputs as a flat tuple, in the order of the structure's leaves. Loading never
imports a module the file names.

The JSON is written **generically**: a dataclass is ``{"c": class index, "f": {field: value}}``
(its ``init`` fields; the class table names each ``module:qualname``), tuples, dicts (as pairs:
keys need not be strings), sets, enums, numpy scalars and non-finite floats have one tagged form
each, a node is ``{"n": id}``; an aggregation and a link matrix have their own (they hold a
numpy ufunc, or are not a dataclass). So a new node kind, or a new field, needs no change here.
Loading never unpickles nor evaluates: a class is found by name only if it is a dataclass (or an
enum) of one of einjoin's plan-data packages (the IR, decompositions, placement, task graphs,
memory plans, the cluster, state slots), then built with its constructor (which checks its fields).

A truncated, corrupted or newer file, and one that is no einjoin program, is an
:class:`~einjoin.errors.EinjoinError` saying which.

>>> import numpy as np, tempfile, os, einjoin as ej
>>> prog = ej.compile(ej.input("x", (8, 4)) @ ej.input("w", (4, 2)), devices=2, quiet=True)
>>> path = os.path.join(tempfile.mkdtemp(), "mm.einjoin")
>>> prog.save(path)
>>> again = ej.load(path)
>>> x, w = np.ones((8, 4), np.float32), np.ones((4, 2), np.float32)
>>> bool((again.run(x, w) == prog.run(x, w)).all()), again.stats == prog.stats
(True, True)
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import json
import math
import os
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from einjoin.cluster import LinkMatrix
from einjoin.compiler import CompiledPlan, CompileOptions
from einjoin.errors import EinjoinError
from einjoin.ir.agg import Agg, get_agg
from einjoin.ir.dtypes import DTYPES
from einjoin.ir.graph import Graph
from einjoin.ir.node import Node
from einjoin.planner import PLANNERS
from einjoin.sparse.feed import declarations, declare
from einjoin.sparse.tensor import SparseTensor, is_sparse_format, sparse

__all__ = ["write", "read", "file_path", "FORMAT", "FORMAT_VERSION", "StructureWarning"]

FORMAT = "einjoin.Program"
FORMAT_VERSION = 1
_MANIFEST, _PROGRAM, _ARRAYS = "einjoin.json", "program.json", "arrays.safetensors"
_ZIP_MAGIC = b"PK\x03\x04"
_EOCD = b"PK\x05\x06"  # a zip's end-of-central-directory record: the last thing written

# safetensors stores these numpy dtypes as they are; another (bfloat16, held by numpy as 2-byte
# void) is stored as an unsigned integer view and its dtype kept in the JSON
_SAFE = {"bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
         "float32", "float64"}


# the packages whose dataclasses and enums a plan is made of (the IR, the decompositions, the
# placement, the task graph, its memory plan, the cluster, the state slots, a graph's sparse operands):
# a file may name no other
_DATA_MODULES = ("einjoin.ir.", "einjoin.decomp.", "einjoin.placement.", "einjoin.exchange.", "einjoin.plan.",
                 "einjoin.memplan.", "einjoin.cluster", "einjoin.runtime.state", "einjoin.sparse.node",
                 "einjoin.sparse.feed")


class _BadFile(Exception):
    """A file that is not what it claims (raised while decoding; load names it corrupted)."""


# ---------------------------------------------------------------- encoding


class _Encoder:
    """Plain JSON data from plan objects, with a node table and a class table."""

    def __init__(self) -> None:
        self.node_ids: dict[Node, int] = {}
        self.nodes: list[Any] = []
        self.classes: dict[type, int] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.array_keys: dict[int, str] = {}  # id of an array written -> its key

    def add_nodes(self, nodes: Any) -> None:
        """Give ``nodes`` and everything they read ids, in creation order (a topological one)."""
        new = [n for n in Graph(list(nodes)).nodes if n not in self.node_ids]
        for n in sorted(new, key=lambda n: n.serial):
            self.node_ids[n] = len(self.nodes)
            self.nodes.append({"op": self.enc(n.op), "in": [self.node_ids[i] for i in n.inputs],
                               "shape": list(n.shape), "dtype": n.dtype})

    def cls(self, t: type) -> int:
        return self.classes.setdefault(t, len(self.classes))

    def enc(self, x: Any) -> Any:
        if isinstance(x, enum.Enum):  # first: a str (or int) enum is a str (an int)
            return {"enum": self.cls(type(x)), "v": self.enc(x.value)}
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, np.generic):  # before float: a numpy float64 is a float
            return {"np": _dtype_text(x.dtype), "v": self.enc(x.item())}
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, Node):
            if x not in self.node_ids:
                self.add_nodes([x])
            return {"n": self.node_ids[x]}
        if isinstance(x, Agg):
            return {"agg": x.name}
        if isinstance(x, LinkMatrix):
            return {"links": [self.enc(v) for v in (x.groups, x.diag, x.intra, x.inter)]}
        if isinstance(x, np.ndarray):  # once per array however many ops hold it (a sparse constant's)
            key = self.array_keys.get(id(x))  # (self.arrays holds x: its id is not reused meanwhile)
            if key is None:
                key = self.array_keys[id(x)] = f"inline.{len(self.arrays)}"
                self.arrays[key] = x
            return {"array": key}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return {"c": self.cls(type(x)), "f": {f.name: self.enc(getattr(x, f.name))
                                                  for f in dataclasses.fields(x) if f.init}}
        if isinstance(x, tuple):
            return {"t": [self.enc(v) for v in x]}
        if isinstance(x, list):
            return [self.enc(v) for v in x]
        if isinstance(x, dict):
            return {"d": [[self.enc(k), self.enc(v)] for k, v in x.items()]}
        if isinstance(x, (set, frozenset)):
            return {"set" if isinstance(x, set) else "fset": [self.enc(v) for v in x]}
        raise EinjoinError(f"prog.save: cannot write a {type(x).__module__}.{type(x).__qualname__} "
                           f"({x!r:.60}); a program's plan holds plain data, dataclasses and nodes")


def _options(o: CompileOptions) -> dict[str, Any]:
    """The options as data: the planner and backend by name; ``specs`` and ``state`` are the
    graph's business once compiled (the specs are in the decompositions, the state in the slots)."""
    planner = o.planner if isinstance(o.planner, str) else getattr(o.planner, "__qualname__", repr(o.planner))
    return dict(planner=planner, backend=o.backend.name, placement=o.placement, order=o.order, seed=o.seed,
                quiet=bool(o.quiet), memory_limit=o.memory_limit, memory_policy=o.memory_policy,
                host_link=o.host_link, deterministic=bool(o.deterministic), fuse=bool(o.fuse),
                shape_cache=o.shape_cache, leave_idle=bool(o.leave_idle), objective=o.objective,
                blocks=dict(o.blocks) if o.blocks else None, relational=o.relational, engine=o.engine)


def _storable(name: str, a: Any) -> tuple[np.ndarray, str | None]:
    """``a`` as safetensors stores it, and its numpy dtype when that is not how it is stored."""
    arr = np.ascontiguousarray(np.asarray(a))
    if arr.dtype.name in _SAFE:
        return arr, None
    if arr.dtype.itemsize not in (1, 2, 4, 8):
        raise EinjoinError(f"prog.save: array {name!r} has dtype {arr.dtype}, which cannot be stored")
    return arr.view(f"<u{arr.dtype.itemsize}"), _dtype_text(arr.dtype)


def _dtype_text(dt: np.dtype) -> str:
    """A numpy dtype as the file names it: einjoin's name for one of its dtypes (bfloat16's
    ``dtype.str`` is ``<V2``, a raw void that would come back without its type), else numpy's."""
    return str(dt.name) if DTYPES.get(dt.name) == dt else str(dt.str)


def _dtype_of(text: Any) -> np.dtype:
    """The numpy dtype :func:`_dtype_text` wrote (an einjoin dtype name first; files written
    before bfloat16 was named hold ``<V2`` and stay raw)."""
    if not isinstance(text, str):
        raise _BadFile(f"bad dtype {text!r:.40}")
    if text in DTYPES:
        return DTYPES[text]
    try:
        return np.dtype(text)
    except (TypeError, ValueError):
        raise _BadFile(f"bad dtype {text!r:.40}") from None


class StructureWarning(UserWarning):
    """An imported forward's output structure could not be saved, or loaded here: the program
    returns its outputs as a flat tuple (see the module docstring)."""


def _dump_structure(structure: Any) -> tuple[str | None, str | None]:
    """``structure`` (a TreeSpec or None) as treespec_dumps' JSON, or (None, why it does not serialise)."""
    if structure is None:
        return None, None
    from torch.utils._pytree import treespec_dumps
    structure = structure.spec  # an OutputTree
    try:
        text = treespec_dumps(structure)
    except (NotImplementedError, TypeError, ValueError) as e:
        return None, f"{_node_types(structure)}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if "__enum__" in text:  # treespec_loads would import the enum's module: a file names no code
        return None, f"{_node_types(structure)}: an enum in its context"
    return text, None


def _node_types(spec: Any) -> str:
    """The container types of a TreeSpec, by qualified name (the first few)."""
    seen: list[str] = []
    todo = [spec]
    while todo:
        s = todo.pop()
        if s.is_leaf():
            continue
        t = s.context if getattr(s.type, "__name__", "") == "namedtuple" else s.type  # the class, not the kind
        name = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', t)}"
        if name not in seen:
            seen.append(name)
        todo.extend(s.children())
    return ", ".join(seen[:4]) + (" ..." if len(seen) > 4 else "")


def _load_structure(text: Any, lost: Any, outputs: int, where: str) -> Any:
    """The saved output structure (a TreeSpec), or None with a :class:`StructureWarning` when the
    file has none (it did not serialise) or names a type this process has not registered."""
    flat = "the loaded program returns the forward's outputs as a flat tuple"
    if lost is not None:
        warnings.warn(f"ej.load: {where!r}: the forward's output structure was not saved ({lost}); {flat}",
                      StructureWarning, stacklevel=4)
        return None
    if text is None:
        return None
    if not isinstance(text, str) or "__enum__" in text:
        raise _BadFile(f"bad output structure {text!r:.60}")
    from torch.utils._pytree import SERIALIZED_TYPE_TO_PYTHON_TYPE, treespec_loads
    try:
        names = _type_names(json.loads(text)[1])
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as e:
        raise _BadFile(f"bad output structure ({type(e).__name__}: {e})") from None
    unknown = sorted({n for n in names if n not in SERIALIZED_TYPE_TO_PYTHON_TYPE})
    if unknown:
        warnings.warn(f"ej.load: {where!r}: the forward's output structure names {', '.join(unknown)}, not "
                      f"registered with torch's pytree in this process (import the module defining it before "
                      f"ej.load); {flat}", StructureWarning, stacklevel=4)
        return None
    try:
        spec = treespec_loads(text)
    except NotImplementedError as e:  # a registered NamedTuple's name: in the context, not the type
        warnings.warn(f"ej.load: {where!r}: the forward's output structure could not be rebuilt here ({e}); "
                      f"{flat}", StructureWarning, stacklevel=4)
        return None
    except (TypeError, KeyError, IndexError, ValueError, AttributeError) as e:
        raise _BadFile(f"bad output structure ({type(e).__name__}: {e})") from None
    if spec.num_leaves != outputs:
        raise _BadFile(f"the output structure has {spec.num_leaves} leaves for {outputs} outputs")
    from einjoin.frontend.torch_args import OutputTree
    return OutputTree(spec)


def _type_names(schema: Any) -> list[str]:
    """The serialized type names in treespec_dumps' JSON schema (checked for its shape)."""
    names: list[str] = []
    todo = [schema]
    while todo:
        s = todo.pop()
        if not isinstance(s, dict) or not isinstance(s["children_spec"], list):
            raise ValueError("not a TreeSpec schema")
        if s["type"] is not None:
            names.append(str(s["type"]))
        todo.extend(s["children_spec"])
    return names


def _plain(x: Any) -> bool:
    """``x`` is plain data (None, bool, int, float, str, in tuples and lists)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return True
    return isinstance(x, (tuple, list)) and all(_plain(v) for v in x)


def file_path(path: Any, what: str) -> str:
    """``path`` as a str (a bytes path decoded), or an EinjoinError naming ``what`` for a value that
    is no path (None, an int, a file object)."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise EinjoinError(f"{what} takes a file path (str or os.PathLike), got {type(path).__name__} "
                           f"{path!r:.80}") from None


def write(path: str | os.PathLike[str], plan: CompiledPlan, bound: Mapping[str, Any],
          state: Mapping[str, Any]) -> None:
    """Write ``plan``, the arrays ``bound`` to its inputs and the ``state`` values to the file
    ``path`` (what :meth:`Program.save` does; see the module docstring); the folder must exist."""
    from safetensors.numpy import save as st_save
    path = file_path(path, "prog.save")  # checked before any work
    structure, lost = _dump_structure(plan.structure)
    if lost is not None:
        warnings.warn(f"prog.save: the forward's output structure does not serialise ({lost}): the file is "
                      f"written without it and ej.load's program returns the outputs as a flat tuple",
                      StructureWarning, stacklevel=3)
    enc = _Encoder()
    enc.add_nodes(plan.graph.nodes)
    body: dict[str, Any] = {
        "graph": {"outputs": [enc.node_ids[n] for n in plan.graph.outputs],
                  "inputs": [enc.node_ids[n] for n in plan.graph.inputs]},
        "cluster": enc.enc(plan.cluster),
        "decomps": enc.enc(plan.decomps),
        "placement": enc.enc(plan.placement),
        "taskgraph": enc.enc(plan.taskgraph),
        "stats": enc.enc(plan.stats),
        "options": enc.enc(_options(plan.options)),
        "many": plan.many,
        "arg_names": enc.enc(plan.arg_names),
        "state": enc.enc(plan.state),
        "dynamic": enc.enc(dict(plan.dynamic)),
        # how a torch-style call binds (its constants only when plain data: a file holds no objects)
        "call": enc.enc(plan.call) if _plain(plan.call) else None,
        # the forward's output pytree (torch's treespec JSON), or why it is not here
        "structure": structure,
        "structure_lost": lost,
        # the sparse inputs it is fed (one read by its keys alone is declared by no node: ej.load
        # declares them again, or a fresh process would not know 'A' of 'A.keys[5,4]')
        "sparse_inputs": enc.enc(declarations(plan.graph)),
    }
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}

    def put(key: str, value: Any) -> None:
        arrays[key], dt = _storable(key, value)
        if dt is not None:
            dtypes[key] = dt
    for k, v in enc.arrays.items():
        put(k, v)
    sparse_bound: dict[str, list[int]] = {}
    for k, v in bound.items():
        held = v.now() if callable(getattr(v, "now", None)) else v  # a module's sparse buffer (LiveSparse)
        if is_sparse_format(held) or isinstance(held, SparseTensor):
            # a sparse bound value: its COO arrays (keys n x rank, values), loaded as a SparseTensor
            st = held if isinstance(held, SparseTensor) else sparse(k, held)
            coords, vals = st.coo()
            put(f"bound_sparse.{k}.keys", coords)
            put(f"bound_sparse.{k}.values", vals)
            sparse_bound[k] = list(st.shape)
            continue
        put(f"bound.{k}", v)
    for k, v in state.items():
        put(f"state.{k}", v)
    body["bound"] = [k for k in bound if k not in sparse_bound]
    body["bound_sparse"] = sparse_bound
    body["state_values"] = list(state)
    body["array_dtypes"] = dtypes
    body["nodes"] = enc.nodes  # after everything else: encoding may have met more nodes
    body["classes"] = [f"{t.__module__}:{t.__qualname__}" for t in enc.classes]
    manifest = {"format": FORMAT, "version": FORMAT_VERSION}
    tmp = f"{path}.partial"
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr(_MANIFEST, json.dumps(manifest), compress_type=zipfile.ZIP_STORED)
            z.writestr(_PROGRAM, json.dumps(body, separators=(",", ":"), allow_nan=False),
                       compress_type=zipfile.ZIP_DEFLATED)
            z.writestr(_ARRAYS, st_save(arrays) if arrays else b"", compress_type=zipfile.ZIP_STORED)
        os.replace(tmp, path)  # a save that fails half-way leaves no half file under the name
    except OSError as e:
        raise EinjoinError(f"prog.save: cannot write {path!r}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------- decoding


class _Decoder:
    def __init__(self, classes: list[str], arrays: Mapping[str, np.ndarray]):
        self.classes = [_find_class(c) for c in classes]
        self.nodes: list[Node] = []
        self.arrays = arrays

    def add_nodes(self, table: list[Any]) -> None:
        for i, row in enumerate(table):
            inputs = tuple(self.nodes[k] for k in row["in"])
            if any(k >= i for k in row["in"]):
                raise _BadFile(f"node {i} reads a later node")
            self.nodes.append(Node(self.dec(row["op"]), inputs, tuple(row["shape"]), row["dtype"]))

    def dec(self, x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [self.dec(v) for v in x]
        if not isinstance(x, dict) or len(x) > 2:
            raise _BadFile(f"unexpected value {x!r:.60}")
        if "n" in x:
            return self.nodes[x["n"]]
        if "c" in x:
            cls = self.classes[x["c"]]
            if not dataclasses.is_dataclass(cls):
                raise _BadFile(f"{cls.__qualname__} is not a dataclass")
            return cls(**{k: self.dec(v) for k, v in x["f"].items()})
        if "t" in x:
            return tuple(self.dec(v) for v in x["t"])
        if "d" in x:
            return {self.dec(k): self.dec(v) for k, v in x["d"]}
        if "enum" in x:
            cls = self.classes[x["enum"]]
            if not issubclass(cls, enum.Enum):
                raise _BadFile(f"{cls.__qualname__} is not an enum")
            return cls(self.dec(x["v"]))
        if "agg" in x:
            return get_agg(x["agg"])
        if "links" in x:
            groups, diag, intra, inter = (self.dec(v) for v in x["links"])
            return LinkMatrix(groups, diag, intra, inter)
        if "np" in x:
            return _dtype_of(x["np"]).type(self.dec(x["v"]))
        if "float" in x:
            if x["float"] not in ("inf", "-inf", "nan"):
                raise _BadFile(f"bad float {x['float']!r:.20}")
            return float(x["float"])
        if "array" in x:
            return self.arrays[x["array"]]
        if "set" in x or "fset" in x:
            items = [self.dec(v) for v in (x["set"] if "set" in x else x["fset"])]
            return set(items) if "set" in x else frozenset(items)
        raise _BadFile(f"unexpected value {x!r:.60}")


def _find_class(name: str) -> type:
    """An einjoin dataclass or enum by ``module:qualname``; nothing else is ever looked up."""
    module, _, qual = name.partition(":")
    if not module.startswith(_DATA_MODULES) or not qual or "." in qual:
        raise _BadFile(f"class {name!r} is not one of einjoin's plan data classes")
    try:
        cls = getattr(importlib.import_module(module), qual)
    except (ImportError, AttributeError):
        raise _BadFile(f"class {name!r} does not exist in this einjoin") from None
    if not isinstance(cls, type) or not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise _BadFile(f"{name!r} is not a dataclass or enum")
    return cls


def _complete(data: bytes) -> bool:
    """Whether the archive ends as prog.save ends it: an end-of-central-directory record (its
    whole 22 bytes and comment) right after the central directory it points to."""
    i = data.rfind(_EOCD, max(0, len(data) - 65536 - 22))
    if i < 0 or len(data) < i + 22:
        return False
    size, offset, comment = (int.from_bytes(data[i + a:i + a + n], "little") for a, n in ((12, 4), (16, 4), (20, 2)))
    return offset + size == i and len(data) == i + 22 + comment


def _open(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bytes]:
    """The program JSON and the arrays' bytes, after the checks that say what is wrong."""
    where = file_path(path, "ej.load")
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EinjoinError(f"ej.load: cannot read {where!r}: {e.strerror or e}") from None
    if not data.startswith(_ZIP_MAGIC):
        raise EinjoinError(f"ej.load: {where!r} is not an einjoin program file (prog.save writes a zip "
                           f"archive; this starts with {data[:8]!r})")
    if not _complete(data):
        raise EinjoinError(f"ej.load: {where!r} is truncated: the archive's end is missing or damaged "
                           f"({len(data)} bytes read); save it again or copy the whole file")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = set(z.namelist())
            if _MANIFEST not in names:
                raise EinjoinError(f"ej.load: {where!r} is not an einjoin program file (a zip archive "
                                   f"without {_MANIFEST})")
            manifest = json.loads(z.read(_MANIFEST))
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise EinjoinError(f"ej.load: {where!r} is not an einjoin program file (format "
                                   f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r:.40})")
            version = manifest.get("version")
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise _BadFile(f"format version {version!r:.40}")
            if version > FORMAT_VERSION:
                raise EinjoinError(f"ej.load: {where!r} was written by a newer einjoin (program format version "
                                   f"{version}; this einjoin reads version {FORMAT_VERSION} and older): "
                                   f"upgrade einjoin to load it")
            body = json.loads(z.read(_PROGRAM))
            arrays = z.read(_ARRAYS)
    except EinjoinError:
        raise
    # RecursionError: JSON nested deeper than the parser's stack (a hand-made file, not ours)
    except (zipfile.BadZipFile, zlib.error, KeyError, ValueError, EOFError, RecursionError, _BadFile) as e:
        raise EinjoinError(f"ej.load: {where!r} is corrupted ({type(e).__name__}: {e})") from None
    if not isinstance(body, dict):
        raise EinjoinError(f"ej.load: {where!r} is corrupted (the program is not a JSON object)")
    return body, arrays


def _saved_input_order(graph: Graph, saved: list[Node]) -> None:
    """Check the loaded graph's inputs against the saved ones. Inputs are hash-consed, so one this
    process declared before (another program loaded or built here sharing an input) keeps its
    first place: the loaded graph may list its inputs in another order than the saved program
    did. Then positional feeds would bind to other inputs than in the saving process, so they are
    refused asking for names (``Graph.positional_conflict``, as for a graph built here whose
    inputs were declared again the other way round); other inputs than the saved ones: corrupted."""
    if saved == list(graph.inputs):
        return
    if len(saved) != len(graph.inputs) or set(saved) != set(graph.inputs):
        raise _BadFile("the graph's inputs are not the saved ones")
    place = {x: i for i, x in enumerate(graph.inputs)}
    later, earlier = next((a, b) for a, b in zip(saved, saved[1:]) if place[a] > place[b])
    graph.positional_conflict = (earlier, later)  # first-declared here first, as Graph names them


def read(path: str | os.PathLike[str], backend: Any = None) -> tuple[CompiledPlan, dict[str, np.ndarray]]:
    """The plan and the state values saved at ``path`` (what ``ej.load`` runs): nothing is
    planned, placed or lowered again. ``backend`` overrides the saved one. A truncated,
    corrupted or newer file, or one that is not an einjoin program, raises an
    :class:`EinjoinError` saying which."""
    body, raw = _open(path)
    where = file_path(path, "ej.load")
    try:
        arrays = _read_arrays(raw, body.get("array_dtypes", {}))
        dec = _Decoder(body["classes"], arrays)
        dec.add_nodes(body["nodes"])
        outputs = [dec.nodes[i] for i in body["graph"]["outputs"]]
        graph = Graph(outputs)
        _saved_input_order(graph, [dec.nodes[i] for i in body["graph"]["inputs"]])
        declare(dec.dec(body.get("sparse_inputs", [])))
        opts = dec.dec(body["options"])
        planner = opts["planner"] if opts["planner"] in PLANNERS else "auto"  # a callable's name only
        try:
            options = CompileOptions(**{**opts, "planner": planner,
                                        "backend": opts["backend"] if backend is None else backend})
        except EinjoinError as e:  # e.g. a Ray program where Ray is missing
            raise EinjoinError(f"ej.load: {where!r}: the saved options do not apply here ({e}); "
                               f"ej.load(..., backend=...) chooses another backend") from None
        arg_names = dec.dec(body["arg_names"])
        sparse_bound = body.get("bound_sparse", {})
        bound: dict[str, Any] | None = {k: arrays[f"bound.{k}"] for k in body["bound"]} \
            if body["bound"] or sparse_bound or arg_names else None
        for k, shape in sparse_bound.items():  # fed as a SparseTensor (sparse/feed.py reads it)
            assert bound is not None
            bound[k] = sparse(k, (arrays[f"bound_sparse.{k}.keys"].T, arrays[f"bound_sparse.{k}.values"],
                                  tuple(shape)))
        plan = CompiledPlan(graph, dec.dec(body["cluster"]), dec.dec(body["decomps"]), dec.dec(body["placement"]),
                            dec.dec(body["taskgraph"]), dec.dec(body["stats"]), options, bool(body["many"]),
                            arg_names, bound, dec.dec(body["state"]), None, dec.dec(body["dynamic"]),
                            _call(dec.dec(body.get("call"))))
        if body.get("structure") is not None or body.get("structure_lost") is not None:
            plan = dataclasses.replace(plan, structure=_load_structure(
                body.get("structure"), body.get("structure_lost"), len(outputs) - len(plan.state), where))
        state = {k: arrays[f"state.{k}"] for k in body["state_values"]}
    except EinjoinError as e:
        if "ej.load" in str(e):
            raise
        raise EinjoinError(f"ej.load: {where!r} is corrupted or from an incompatible einjoin ({e})") from None
    except (_BadFile, KeyError, IndexError, TypeError, ValueError, RecursionError) as e:
        raise EinjoinError(f"ej.load: {where!r} is corrupted ({type(e).__name__}: {e})") from None
    return plan, state


def _call(call: Any) -> Any:
    """The saved call template, as tuples (it binds run()'s arguments: checked for its shape)."""
    if call is None:
        return None
    if not isinstance(call, tuple) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                              and isinstance(p[1], tuple) for p in call):
        raise _BadFile(f"bad call {call!r:.60}")
    return call


def _read_arrays(raw: bytes, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
    if not raw:
        return {}
    from safetensors.numpy import load as st_load
    try:
        arrays = st_load(raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise _BadFile(f"the arrays: {e}") from None
    return {k: (v.view(_dtype_of(dtypes[k])) if k in dtypes else v) for k, v in arrays.items()}
