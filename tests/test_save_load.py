"""Programs that can be saved (issue 20): ``prog.save`` / ``ej.load`` round trips in a fresh
process without planning again and with bit-identical results; every node kind's payload is
written generically; broken files are refused saying why; ``Program`` pickles (no locks or
threads in its state) and runs in a process pool."""

from __future__ import annotations

import concurrent.futures
import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import typing
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin import program_io
from einjoin.ir.agg import Agg, get_agg
from einjoin.ir.node import KINDS, SparseEinsum
from einjoin.ir.opkinds import SparseOperand
from einjoin.ir.scalar import Arg, Call, Const
from einjoin.sparse.node import graph_operand
from graphgen import graphs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 4)).eval()


def _programs() -> dict[str, tuple[ej.Program, tuple[np.ndarray, ...]]]:
    """Programs of several kinds and their inputs: an imported module on 1 and 2 devices, a
    memory-capped graph (evictions in its plan), one with state after two runs, a conv + pool."""
    rng = np.random.default_rng(0)
    out = {}
    x = rng.standard_normal((6, 8)).astype(np.float32)
    for d in (1, 2):
        fn = ej.from_torch(_mlp(), (torch.from_numpy(x),))
        out[f"mlp{d}"] = (ej.compile(fn, devices=d, quiet=True), (x,))
    a, b = ej.input("a", (64, 48)), ej.input("b", (48, 32))
    capped = ej.compile(ej.softmax(a @ b) * 2.0, devices=2, quiet=True, memory_limit="12KiB")
    assert capped.taskgraph.memory is not None and capped.stats.bytes_evicted + capped.stats.bytes_reloaded > 0
    out["capped"] = (capped, (rng.standard_normal((64, 48)).astype(np.float32),
                              rng.standard_normal((48, 32)).astype(np.float32)))
    g, w = ej.input("g", (16, 8)), ej.input("w", (16, 8))  # g first: the positional input
    stateful = ej.compile([(w * g).sum()], devices=2, quiet=True, state={w - 0.1 * g: w}, deterministic=True)
    stateful.write_state({"w": rng.standard_normal((16, 8)).astype(np.float32)})
    gv = rng.standard_normal((16, 8)).astype(np.float32)
    stateful.run(g=gv)
    stateful.run(g=gv)
    out["stateful"] = (stateful, (gv,))
    img, k = ej.input("img", (2, 3, 12, 12)), ej.input("k", (4, 3, 3, 3))
    conv = ej.compile(ej.max_pool(ej.conv(img, k, padding=1), 2), devices=2, quiet=True)
    out["conv"] = (conv, (rng.standard_normal((2, 3, 12, 12)).astype(np.float32),
                          rng.standard_normal((4, 3, 3, 3)).astype(np.float32)))
    return out


_CHILD = textwrap.dedent("""
    import sys, numpy as np
    import einjoin as ej, einjoin.compiler as C, einjoin.program as P

    def planned(*a, **k):
        raise AssertionError("a loaded program was planned, placed or lowered again")
    for mod, names in ((C, ("plan_specs", "place", "decompose", "build_taskgraph", "plan_memory",
                            "build_plan", "chain_reduces", "tie_homes")), (P, ("build_plan",))):
        for n in names:
            assert hasattr(mod, n), n  # the name the loader would call, not a new one
            setattr(mod, n, planned)
    folder, names = sys.argv[1], sys.argv[2:]
    results = {}
    for name in names:
        prog = ej.load(f"{folder}/{name}.einjoin")
        feeds = np.load(f"{folder}/{name}.in.npz")
        out = prog.run(*[feeds[f"arg{i}"] for i in range(len(feeds.files))])
        for i, o in enumerate(out if isinstance(out, tuple) else (out,)):
            results[f"{name}.{i}"] = o
        results[f"{name}.moved"] = np.asarray(prog.run_stats.bytes_moved)
        if prog.state:
            for k, v in prog.read_state().items():
                results[f"{name}.state.{k}"] = v
    np.savez(f"{folder}/out.npz", **results)
""")


def test_a_saved_program_loads_in_a_fresh_process_without_planning_and_runs_bit_identically(tmp_path):
    progs = _programs()
    want = {}
    for name, (prog, args) in progs.items():
        prog.save(tmp_path / f"{name}.einjoin")
        np.savez(tmp_path / f"{name}.in.npz", **{f"arg{i}": a for i, a in enumerate(args)})
    for name, (prog, args) in progs.items():  # after saving: the state saved is the one before this run
        out = prog.run(*args)
        for i, o in enumerate(out if isinstance(out, tuple) else (out,)):
            want[f"{name}.{i}"] = o
        want[f"{name}.moved"] = prog.run_stats.bytes_moved
        if prog.state:
            want.update({f"{name}.state.{k}": v for k, v in prog.read_state().items()})
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), *progs], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    assert set(got.files) == set(want)
    for key, w in want.items():
        g = got[key]
        assert g.dtype == np.asarray(w).dtype and np.array_equal(g, w), key  # bit for bit
    # the torch module's outputs, through the file
    x = progs["mlp2"][1][0]
    np.testing.assert_allclose(got["mlp2.0"], _mlp()(torch.from_numpy(x)).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_a_loaded_program_is_the_saved_plan(tmp_path):
    prog, args = _programs()["capped"]
    prog.save(tmp_path / "p.einjoin")
    again = ej.load(tmp_path / "p.einjoin", backend="sync")
    assert again.backend.name == "sync" and ej.load(tmp_path / "p.einjoin").backend.name == "threads"
    assert again.stats == prog.stats and again.taskgraph.memory == prog.taskgraph.memory
    assert [t.kind for t in again.taskgraph.tasks] == [t.kind for t in prog.taskgraph.tasks]
    assert again.specs == prog.specs and again.placement == prog.placement
    assert again.plan.options.memory_limit == "12KiB" and again.cluster == prog.cluster
    assert np.array_equal(again.run(*args), prog.run(*args))
    assert again.run_stats.bytes_evicted == prog.run_stats.bytes_evicted


def test_the_objective_and_leave_idle_are_kept(tmp_path):
    x, w = ej.input("x", (64, 32)), ej.input("w", (32, 16))
    prog = ej.compile(x @ w, devices=2, objective="time", leave_idle=True, quiet=True)
    prog.save(tmp_path / "p.einjoin")
    again = ej.load(tmp_path / "p.einjoin")
    assert (again.plan.options.objective, again.plan.options.leave_idle) == ("time", True)
    assert "objective: time" in again.explain() and again.specs == prog.specs


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), devices=st.sampled_from([1, 2, 4]), fuse=st.booleans())
def test_random_graphs_round_trip_bit_identically(tmp_path_factory, data, devices, fuse):
    outs, feeds = data.draw(graphs("float64"))
    prog = ej.compile(outs, devices=devices, quiet=True, fuse=fuse)
    path = tmp_path_factory.mktemp("g") / "g.einjoin"
    prog.save(path)
    again = ej.load(path)
    assert again.stats == prog.stats and again.specs == prog.specs
    for a, b in zip(again.run(**feeds), prog.run(**feeds)):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


# ---- every node kind's payload, written generically


def _sample(tp: typing.Any) -> typing.Any:
    """A value of the annotated type ``tp`` (a node kind's payload field)."""
    args = typing.get_args(tp)
    if tp is str:
        return "i"
    if tp is bool:
        return True
    if tp is int:
        return 3
    if tp is float:
        return -2.5
    if tp is Agg:
        return get_agg("max")
    if Call in args:  # a join expression: every form, a non-finite constant too
        return Call("where", (Call("gt", (Arg(0), Const(0))), Call("exp", (Arg(1),)), Const(float("-inf"))))
    if tp is SparseOperand:  # a sparse constant (issue 24): its tensor as plain data
        return graph_operand(ej.sparse("A", np.eye(4, 3)))
    origin = typing.get_origin(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (_sample(args[0]), _sample(args[0]))
        return tuple(_sample(a) for a in args)
    if args and type(None) in args:
        return _sample(next(a for a in args if a is not type(None)))
    raise AssertionError(f"the test cannot make a {tp!r}: teach _sample that type")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_every_node_kind_round_trips_through_the_json(kind):
    hints = typing.get_type_hints(kind)
    op = kind(**{f: _sample(t) for f, t in hints.items() if f in kind.__dataclass_fields__
                 and kind.__dataclass_fields__[f].init})
    x = ej.input("x", (4, 3)).node
    node = ej.Node(op, (x,), (4, 3), "float32")  # not a valid node: the payload is what is written
    enc = program_io._Encoder()
    enc.add_nodes([node])
    table = json.loads(json.dumps({"nodes": enc.nodes, "op": enc.enc(op)}, allow_nan=False))
    dec = program_io._Decoder([f"{t.__module__}:{t.__qualname__}" for t in enc.classes], enc.arrays)
    back = dec.dec(table["op"])
    if kind is SparseEinsum:  # its sparse constant (hashed by identity) comes back as an equal tensor
        a, b = op.operand, back.operand
        assert (b.name, b.shape, b.dtype_name) == (a.name, a.shape, a.dtype_name)
        np.testing.assert_array_equal(b.todense(), a.todense())
        return
    assert type(back) is kind and back == op and hash(back) == hash(op)
    dec.add_nodes(table["nodes"])
    assert dec.nodes[-1] is node  # the same op, inputs, shape and dtype: the same (interned) node


def test_kinds_are_many():
    assert len(KINDS) >= 10


# ---- files that are not what they should be


def _saved(tmp_path) -> tuple[str, bytes]:
    prog = ej.compile(ej.input("x", (8, 4)) @ ej.input("w", (4, 2)), devices=2, quiet=True)
    path = str(tmp_path / "mm.einjoin")
    prog.save(path)
    with open(path, "rb") as f:
        return path, f.read()


def _rezip(path: str, data: bytes, change: typing.Callable[[str, bytes], bytes]) -> None:
    """Rewrite the archive with valid checksums but members changed by ``change``."""
    src = zipfile.ZipFile(io.BytesIO(data))
    with zipfile.ZipFile(path, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, change(info.filename, src.read(info.filename)))


def test_truncated_corrupted_newer_and_foreign_files_say_which(tmp_path):
    path, data = _saved(tmp_path)
    bad = str(tmp_path / "bad.einjoin")
    for cut in (len(data) // 2, len(data) - 10, 30):
        with open(bad, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(ej.EinjoinError, match="is truncated"):
            ej.load(bad)
    json_at = data.index(b"program.json") + 40  # inside the deflated program, past its local header
    arrays_at = data.index(b"arrays.safetensors")
    for at in (json_at, json_at + 200, arrays_at + 60, arrays_at + 120):
        flipped = bytearray(data)
        flipped[at] ^= 0x5A
        with open(bad, "wb") as f:
            f.write(bytes(flipped))
        with pytest.raises(ej.EinjoinError, match="is corrupted"):
            ej.load(bad)
    _rezip(bad, data, lambda n, b: json.dumps({"format": "einjoin.Program", "version": 2}).encode()
           if n == "einjoin.json" else b)
    with pytest.raises(ej.EinjoinError, match=r"newer einjoin \(program format version 2; this einjoin reads "
                                              r"version 1"):
        ej.load(bad)
    _rezip(bad, data, lambda n, b: json.dumps({"format": "einjoin.Trainer", "version": 1}).encode()
           if n == "einjoin.json" else b)
    with pytest.raises(ej.EinjoinError, match="not an einjoin program file"):
        ej.load(bad)
    _rezip(bad, data, lambda n, b: b"{\"graph\": 1" if n == "program.json" else b)
    with pytest.raises(ej.EinjoinError, match="is corrupted"):
        ej.load(bad)
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(ej.EinjoinError, match="not an einjoin program file"):
        ej.load(bad)
    from safetensors.numpy import save_file
    save_file({"w": np.ones(3, np.float32)}, bad, metadata={"format": "einjoin.Trainer/1"})
    with pytest.raises(ej.EinjoinError, match="not an einjoin program file"):
        ej.load(bad)
    with pytest.raises(ej.EinjoinError, match="cannot read"):
        ej.load(tmp_path / "missing.einjoin")
    with pytest.raises(ej.EinjoinError, match=r"saved options do not apply here \(unknown backend 'gpu'"):
        ej.load(path, backend="gpu")


def test_a_file_naming_other_classes_is_refused_without_importing_them(tmp_path):
    path, data = _saved(tmp_path)

    def evil(name: str) -> typing.Callable[[str, bytes], bytes]:
        def change(n: str, b: bytes) -> bytes:
            if n != "program.json":
                return b
            body = json.loads(b)
            body["classes"][0] = name
            return json.dumps(body).encode()
        return change
    for name in ("os:system", "builtins:eval", "subprocess:Popen", "einjoin.program:Program",
                 "einjoin.runtime.backends.ray:RayBackend", "einjoin.ir.node:Node", "einjoin.ir.ops:einsum_node",
                 "einjoin.nonexistent_module_xyz:X", "pickle:loads"):
        _rezip(path, data, evil(name))
        with pytest.raises(ej.EinjoinError, match="is corrupted"):
            ej.load(path)
    assert "einjoin.nonexistent_module_xyz" not in sys.modules


def test_save_refuses_what_it_cannot_write_and_leaves_no_partial_file(tmp_path):
    prog = ej.compile(ej.input("x", (4,)) * 2.0, quiet=True)
    with pytest.raises(ej.EinjoinError, match="cannot write"):
        prog.save(tmp_path / "no" / "such" / "folder" / "p.einjoin")
    enc = program_io._Encoder()
    with pytest.raises(ej.EinjoinError, match="cannot write a builtins.function"):
        enc.enc(lambda: 0)
    assert os.listdir(tmp_path) == []


# ---- pickling


def test_a_program_pickles_with_its_state_and_runs_after():
    progs = _programs()
    for name, (prog, args) in progs.items():
        blob = pickle.dumps(prog)
        again = pickle.loads(blob)
        assert again.run_stats is None and again._made_engine is None  # the runtime comes on first run
        if prog.state:
            for k, v in prog.read_state().items():
                assert np.array_equal(again.read_state()[k], v)
        out, want = again.run(*args), prog.run(*args)
        assert np.array_equal(out, want), name
        if prog.state:  # both moved on by one run, from the same state
            assert all(np.array_equal(again.read_state()[k], v) for k, v in prog.read_state().items())


def test_a_deep_graph_pickles_without_deep_recursion():
    x = ej.input("x", (4,))
    y = x
    for i in range(3000):
        y = y * 1.0001 if i % 2 else y + 0.5
    prog = ej.compile(y, quiet=True, fuse=False, planner="single")
    again = pickle.loads(pickle.dumps(prog))
    v = np.arange(4, dtype=np.float32)
    assert np.array_equal(again.run(v), prog.run(v))


def test_a_program_runs_in_a_process_pool():
    prog, (x,) = _programs()["mlp2"]
    want = prog.run(x)
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: everything goes by pickle
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        got = pool.submit(prog.run, x).result(timeout=240)
    assert np.array_equal(got, want)


def test_a_ray_program_pickles_as_its_settings():
    pytest.importorskip("ray")
    prog = ej.compile(ej.input("x", (8, 4)) * 2.0, devices=2, quiet=True,
                      backend=ej.runtime.backends.ray.RayBackend(num_cpus=3, retries=2))
    again = pickle.loads(pickle.dumps(prog))  # no actor is started, none is pickled
    assert again.backend is not prog.backend and again.backend.name == "ray"
    assert (again.backend.num_cpus, again.backend.retries) == (3, 2) and again.backend._pools == {}


@pytest.mark.parametrize("devices", [1, 2])
def test_bfloat16_state_weights_and_constants_round_trip(tmp_path, devices):
    """bfloat16 (numpy holds it as ml_dtypes' 2-byte type, whose dtype.str is a raw void ``<V2``)
    comes back as bfloat16: the state's values and a bound weight."""
    import ml_dtypes
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    w, g = ej.input("w", (8, 4), "bfloat16"), ej.input("g", (8, 4), "bfloat16")
    step = ej.compile([(w * g).sum()], devices=devices, quiet=True, state={w - 0.25 * g: w})
    step.write_state({"w": rng.standard_normal((8, 4)).astype(bf)})
    gv = rng.standard_normal((8, 4)).astype(bf)
    step.run(g=gv)
    step.save(tmp_path / "s.einjoin")
    again = ej.load(tmp_path / "s.einjoin")
    assert again.read_state()["w"].dtype == np.dtype(bf)
    assert np.array_equal(again.read_state()["w"], step.read_state()["w"])
    a, b = again.run(g=gv), step.run(g=gv)
    assert a[0].dtype == b[0].dtype == np.dtype(bf) and np.array_equal(a[0], b[0])
    assert np.array_equal(again.read_state()["w"], step.read_state()["w"])
    m = torch.nn.Linear(4, 3).to(torch.bfloat16)
    x = torch.randn(2, 4).to(torch.bfloat16)
    prog = ej.compile(ej.from_torch(m, (x,)), devices=devices, quiet=True)
    prog.save(tmp_path / "m.einjoin")
    assert torch.equal(ej.load(tmp_path / "m.einjoin").run(x), prog.run(x))
