"""Issue 38 (H1): torch's integer dtypes end to end, differential against torch 2.13.

Before this issue einjoin's only integer type was int64: ``x.to(torch.int32) * 100000`` in an
imported forward gave 7e9 where torch gives -1589934592, and int32 outputs came back int64.
int8 / int16 / int32 / uint8 are now dtypes of their own, promoted as torch's ``promote_types``,
computed in their dtype (so overflow wraps as torch's) and returned in it; uint16/32/64, which
torch 2.13 neither promotes nor adds, are refused with a DTypeError.
"""

from __future__ import annotations

import numpy as np
import pytest
from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import einjoin as ej
from einjoin.errors import DTypeError
from einjoin.ir.dtypes import promote
from einjoin.ir.graph import Graph
from einjoin.frontend.tensor import elementwise
from einjoin.ir.scalar import parse_join

torch = pytest.importorskip("torch")

INTS = ["int8", "int16", "int32", "int64", "uint8"]
ALL = INTS + ["bool", "float32"]


def _tdt(name: str) -> torch.dtype:
    return getattr(torch, name)


def _values(name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if name in ("float32", "float64"):
        return rng.normal(0, 100, n).astype(name)
    info = np.iinfo(np.dtype(name))
    return rng.integers(int(info.min), int(info.max), n, endpoint=True).astype(name)


def _read(y: ej.Tensor, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds ``y`` reads (a feed it does not read is an error)."""
    names = Graph([y.node]).input_by_name
    return {k: v for k, v in feeds.items() if k in names}


def _run(y: ej.Tensor, backend: str = "threads", devices: int = 1, **feeds: np.ndarray) -> np.ndarray:
    prog = ej.compile(y, devices=devices, backend=backend, quiet=True)
    return np.asarray(prog.run(**_read(y, feeds)))


# ---------------------------------------------------------------- the dtype table


PAIRS = [(a, b) for a in ALL for b in ALL if {a, b} & {"int8", "int16", "int32", "uint8"}]


@pytest.mark.parametrize("a, b", PAIRS)
def test_promotion_table_matches_torch(a: str, b: str) -> None:
    """Every pair's result dtype and values (``x + y``, ``x * y``) as torch's."""
    xa, xb = _values(a, 6, 1), _values(b, 6, 2)
    x, y = ej.input(f"p_{a}", (6,), a), ej.input(f"q_{b}", (6,), b)
    ta, tb = torch.from_numpy(xa), torch.from_numpy(xb)
    for got, want in ((x + y, ta + tb), (x * y, ta * tb)):
        assert got.dtype == str(want.dtype).removeprefix("torch.")
        out = ej.reference(got, **{f"p_{a}": xa, f"q_{b}": xb})
        np.testing.assert_array_equal(out, want.numpy())
    if a in INTS and b in INTS:
        assert promote(a, b) == str(torch.promote_types(_tdt(a), _tdt(b))).removeprefix("torch.")


@pytest.mark.parametrize("name", ["uint16", "uint32", "uint64"])
def test_wide_unsigned_refused(name: str) -> None:
    """torch 2.13 has no add nor promotion for them: refused, naming the dtype (never int64)."""
    why = f"{name} is not supported: torch 2.13 has no arithmetic"
    with pytest.raises(DTypeError, match=why):
        ej.input("u", (3,), name)
    with pytest.raises(DTypeError, match=why):
        ej.input("f", (3,), "int64").to(getattr(np, name))

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(DTypeError, match=why):
        ej.from_torch(M(), (torch.zeros(3, dtype=_tdt(name)),))


# ---------------------------------------------------------------- wrap-around


OPS = {
    "add": (lambda x, y: x + y), "sub": (lambda x, y: x - y), "mul": (lambda x, y: x * y),
    "add_scalar": (lambda x, y: x + 1000), "mul_scalar": (lambda x, y: x * 100003),
    "neg": (lambda x, y: -x), "floordiv": (lambda x, y: (x * 7) // 3), "max": (lambda x, y: x.amax(0)),
    "cube": (lambda x, y: x * x * x), "pow": (lambda x, y: x ** 3), "matmul": (lambda x, y: x @ y),
}


@settings(max_examples=examples(25), deadline=None)
@given(dt=st.sampled_from(INTS), op=st.sampled_from(sorted(OPS)), seed=st.integers(0, 2 ** 16))
def test_ops_wrap_as_torch(dt: str, op: str, seed: int) -> None:
    """Each op in each integer dtype: torch's dtype and torch's wrapped values, on the numpy
    kernels and the torch backend."""
    xa, xb = _values(dt, 8, seed), _values(dt, 8, seed + 1)
    want = OPS[op](torch.from_numpy(xa), torch.from_numpy(xb))
    x, y = ej.input(f"wx_{dt}", (8,), dt), ej.input(f"wy_{dt}", (8,), dt)
    got = OPS[op](x, y)
    assert got.dtype == str(want.dtype).removeprefix("torch.")
    feeds = {f"wx_{dt}": xa, f"wy_{dt}": xb}
    for backend in ("threads", "torch"):
        out = _run(got, backend, **feeds)
        np.testing.assert_array_equal(out, want.numpy())
        assert out.dtype == want.numpy().dtype


def test_int32_times_large_scalar_wraps() -> None:
    """The issue's example: ``i.to(int32) * 100000`` wraps to -1589934592, on both backends."""
    x = ej.input("big", (2,), "float32")
    y = x.to("int32") * 100000
    assert y.dtype == "int32"
    arr = np.array([70000.0, -3.9], np.float32)
    want = (torch.from_numpy(arr).to(torch.int32) * 100000).numpy()
    for backend in ("threads", "torch"):
        out = _run(y, backend, 2, big=arr)
        assert out.dtype == np.int32
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("dt", ["int8", "uint8", "int16", "int32"])
def test_float_cast_truncates_then_wraps(dt: str) -> None:
    arr = np.array([300.7, -1.5, 1e6 + 0.5, -129.0, 255.9], np.float32)
    x = ej.input(f"fc_{dt}", (5,), "float32")
    out = _run(x.to(dt) + 1, **{f"fc_{dt}": arr})
    np.testing.assert_array_equal(_run(x.to(dt) + 1, "torch", **{f"fc_{dt}": arr}), out)
    want = (torch.from_numpy(arr).to(_tdt(dt)) + 1).numpy()
    np.testing.assert_array_equal(out, want)
    assert out.dtype == want.dtype


def test_reductions_promote_as_torch() -> None:
    """sum/prod/cumsum of narrow ints are int64 (no wrap); max keeps the dtype; matmul of int32
    stays int32 (and wraps); true division gives float32; a float tensor wins."""
    a = np.array([[100, 100, 100], [-100, 27, 5]], np.int8)
    m = np.array([[60000, 3], [2, 70000]], np.int32)
    x, w = ej.input("r8", (2, 3), "int8"), ej.input("rm", (2, 2), "int32")
    f = ej.input("rf", (2, 3), "float32")
    ta, tm = torch.from_numpy(a), torch.from_numpy(m)
    tf = torch.ones(2, 3)
    cases = [(x.sum(), ta.sum()), (x.sum(1), ta.sum(1)), (x.prod(1), ta.prod(1)),
             (ej.cumsum(x, 1), ta.cumsum(1)), (x.max(), ta.max()), (w @ w, tm @ tm),
             (x / x.max(), ta / ta.max()), (x + f, ta + tf), (x * 2.5, ta * 2.5)]
    for got, want in cases:
        assert got.dtype == str(want.dtype).removeprefix("torch."), (got, want.dtype)
        out = _run(got, r8=a, rm=m, rf=np.ones((2, 3), np.float32))
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-6)
        assert out.dtype == want.numpy().dtype


# ---------------------------------------------------------------- feeds and outputs


def test_int32_feeds_and_outputs() -> None:
    """An int32 input takes int32 (and narrower) feeds as int32 and returns int32; a feed that
    could change a value (int64 into int32) is refused, naming the input."""
    x = ej.input("i32feed", (3,), "int32")
    prog = ej.compile(x * 3, devices=1, quiet=True)
    out = np.asarray(prog.run(i32feed=np.array([1, -2, 2 ** 30], np.int32)))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.array([3, -6, -1073741824], np.int32))
    np.testing.assert_array_equal(prog.run(i32feed=np.array([1, 2, 3], np.int16)), [3, 6, 9])
    with pytest.raises(DTypeError, match="i32feed"):
        prog.run(i32feed=np.array([1, 2, 3], np.int64))
    # an int64 input still takes int32 feeds, exactly
    y = ej.input("i64feed", (2,), "int64")
    got = np.asarray(ej.compile(y * 100000, devices=1, quiet=True).run(i64feed=np.array([70000, 1], np.int32)))
    assert got.dtype == np.int64 and got[0] == 7_000_000_000


class _Positions(torch.nn.Module):
    """HF's create_position_ids_from_input_ids (RoBERTa): an int32 mask, its cumsum, back to int64."""

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = ids.ne(1).int()
        inc = (torch.cumsum(mask, dim=1).type_as(mask) + 0) * mask
        return inc.long() + 1, mask, inc


def test_imported_int32_mask_cumsum_position_ids() -> None:
    ids = torch.tensor([[5, 7, 1, 1], [1, 9, 9, 9]])
    m = _Positions()
    want = m(ids)
    fn = ej.from_torch(m, (ids,))
    for backend in ("threads", "torch"):
        got = ej.compile(fn, devices=1, backend=backend, quiet=True).run(ids)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w)


class _Casts(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        i = x.to(torch.int32)
        return (i * 100000, i.int() + n, x.type(torch.int16) * 1000, x.char() + 100, x.byte() - 3,
                (n * n).sum(), n // 3)


def test_imported_casts_keep_torch_dtypes() -> None:
    """``.to(torch.int32)``, ``.int()``, ``.type(int16)``, ``.char()``, ``.byte()`` in a forward:
    torch's dtypes and torch's wrapped values; an int32 forward argument is an int32 input."""
    x = torch.tensor([70000.0, 3.5, -200.0])
    n = torch.tensor([2 ** 31 - 1, 5, -7], dtype=torch.int32)
    m = _Casts()
    want = m(x, n)
    fn = ej.from_torch(m, (x, n))
    got = ej.compile(fn, devices=2, quiet=True).run(x, n)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        torch.testing.assert_close(g, w)


def test_int32_indices() -> None:
    """gather / index_select / embedding take int32 indices, as torch's."""
    table = np.arange(15, dtype=np.float32).reshape(5, 3)
    idx = np.array([4, 0, 2], np.int32)
    t, i = ej.input("tab", (5, 3), "float32"), ej.input("ix32", (3,), "int32")
    tt, ti = torch.from_numpy(table), torch.from_numpy(idx)
    for got, want in ((ej.index_select(t, 0, i), tt.index_select(0, ti)),
                      (t[i], tt[ti]),
                      (ej.embedding(i, t), torch.nn.functional.embedding(ti, tt))):
        np.testing.assert_array_equal(ej.reference(got, tab=table, ix32=idx), want.numpy())


def test_narrow_constant_outside_range_refused() -> None:
    """An expression constant that an int8 cannot hold is a DTypeError at build time, not numpy's
    OverflowError in a kernel (tensor ops with Python ints wrap them first, as torch)."""
    x = ej.input("c8", (3,), "int8")
    with pytest.raises(DTypeError, match="int8"):
        elementwise(parse_join("x0 + 1000", 1), x)
    np.testing.assert_array_equal(ej.reference(x + 1000, c8=np.array([1, 2, 100], np.int8)),
                                  (torch.tensor([1, 2, 100], dtype=torch.int8) + 1000).numpy())


SCALAR_OPS = {
    "add": lambda x: x + 1000, "sub": lambda x: x - 1000, "rsub": lambda x: 1000 - x,
    "mul": lambda x: x * 1000, "floordiv": lambda x: x // 1000, "mod": lambda x: x % 1000,
    "lt": lambda x: x < 1000, "eq": lambda x: x == 1000, "ge_neg": lambda x: x >= -1,
    "pow": lambda x: x ** 1000, "where": lambda x: torch.where(x > 1, x, 1000) if isinstance(x, torch.Tensor)
    else ej.where(x > 1, x, 1000), "full": lambda x: (torch.full((3,), 1000, dtype=x.dtype) if isinstance(
        x, torch.Tensor) else ej.full((3,), 1000, x.dtype)),
}


@pytest.mark.parametrize("dt", ["int8", "uint8", "int16"])
@pytest.mark.parametrize("op", sorted(SCALAR_OPS))
def test_python_int_out_of_range_as_torch(dt: str, op: str) -> None:
    """A Python int a narrow dtype cannot hold: wrapped where torch wraps it (+ - * // % and
    comparisons: ``int8 < 1000`` compares with -24), a DTypeError where torch refuses it
    (``where``, ``pow``, ``full``: 'value cannot be converted ... without overflow')."""
    arr = np.array([-100, 1, 100], dt) if dt != "uint8" else np.array([0, 1, 255], dt)
    try:
        want = SCALAR_OPS[op](torch.from_numpy(arr))
    except RuntimeError:
        with pytest.raises(DTypeError, match=f"(cannot be converted to|outside the range of) {dt}"):
            SCALAR_OPS[op](ej.input(f"so_{dt}", (3,), dt))
        return
    got = SCALAR_OPS[op](ej.input(f"so_{dt}", (3,), dt))
    assert got.dtype == str(want.dtype).removeprefix("torch.")
    np.testing.assert_array_equal(_run(got, **{f"so_{dt}": arr}), want.numpy())


def test_constant_folding_wraps_narrow_intermediates() -> None:
    """Parameter-free int32/int8 arithmetic (folded into fills, which compute ints in int64) wraps
    at each step as torch's: ``arange(int32) * 1e9 // 7`` and ``(arange(int8) * 100).long() * 3``."""
    a = ej.arange(5, dtype="int32") * 1000000000 // 7
    b = (ej.arange(5, dtype="int8") * 100).to("int64") * 3
    np.testing.assert_array_equal(ej.reference(a), (torch.arange(5, dtype=torch.int32) * 1000000000 // 7).numpy())
    np.testing.assert_array_equal(ej.reference(b), ((torch.arange(5, dtype=torch.int8) * 100).long() * 3).numpy())


class _DtypeArgs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.sum(dtype=torch.int32), x.sum(-1, dtype=torch.int8), torch.cumsum(x, 0, dtype=torch.int16),
                x.prod(dtype=torch.int32), x.to(torch.int8).cumprod(0, dtype=torch.uint8))


def test_reduction_dtype_arguments() -> None:
    """``sum / prod / cumsum / cumprod(dtype=narrow int)`` return that dtype, wrapped as torch's
    (cumsum(dtype=int16) gave int64 sums that never wrapped)."""
    x = torch.tensor([[100000, 2], [300000, 4]]) * 1000 + 3
    m = _DtypeArgs()
    got = ej.compile(ej.from_torch(m, (x,)), devices=2, quiet=True).run(x)
    for g, w in zip(got, m(x)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


class _Truth(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.any(), x.all(), x.any(0), torch.all(x, 0, keepdim=True)


@pytest.mark.parametrize("dt", [torch.uint8, torch.int32])
def test_any_all_dtype(dt: torch.dtype) -> None:
    """torch's any/all of uint8 are uint8 (0/1), of other types bool."""
    x = torch.tensor([[0, 3], [2, 5]], dtype=dt)
    m = _Truth()
    got = ej.compile(ej.from_torch(m, (x,)), devices=1, quiet=True).run(x)
    for g, w in zip(got, m(x)):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dt", ["int8", "uint8", "int32"])
def test_split_matmul_wraps_as_torch(dt: str) -> None:
    """A narrow-int matmul split over 4 devices (partial sums in the dtype, added after) gives
    torch's wrapped int8/int32 product on both backends."""
    rng = np.random.default_rng(3)
    info = np.iinfo(np.dtype(dt))
    a_ = rng.integers(int(info.min), int(info.max), (32, 128), endpoint=True).astype(dt)
    b_ = rng.integers(int(info.min), int(info.max), (128, 16), endpoint=True).astype(dt)
    want = (torch.from_numpy(a_) @ torch.from_numpy(b_)).numpy()
    y = ej.input(f"sa_{dt}", (32, 128), dt) @ ej.input(f"sb_{dt}", (128, 16), dt)
    for backend in ("threads", "torch"):
        prog = ej.compile(y, devices=4, backend=backend, planner="split_largest", quiet=True)
        out = np.asarray(prog.run(**{f"sa_{dt}": a_, f"sb_{dt}": b_}))
        assert out.dtype == want.dtype
        np.testing.assert_array_equal(out, want)


def test_signed_feed_into_uint8_refused() -> None:
    """int8 data fed to a uint8 input would turn -1 into 255: refused, naming the input; uint8
    into int16 and int8 into int32 are exact and taken."""
    x = ej.input("u8feed", (2,), "uint8")
    with pytest.raises(DTypeError, match="u8feed"):
        ej.reference(x + 0, u8feed=np.array([-1, 2], np.int8))
    np.testing.assert_array_equal(ej.reference(x + 0, u8feed=[255, 2]), np.array([255, 2], np.uint8))
    y = ej.input("i16feed", (2,), "int16")
    assert ej.reference(y * 1, i16feed=np.array([255, 0], np.uint8)).dtype == np.int16


class _Arange(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(0, 8.0, 2.0, dtype=torch.int32) * 1000000000


def test_int32_arange_with_float_bounds() -> None:
    """torch truncates float bounds of an integer arange (XLNet's pattern) for int32 too."""
    x = torch.arange(4, dtype=torch.int32)
    m = _Arange()
    got = ej.compile(ej.from_torch(m, (x,)), devices=1, quiet=True).run(x)
    assert got.dtype == torch.int32
    torch.testing.assert_close(got, m(x))


@settings(max_examples=examples(30), deadline=None)
@given(dt=st.sampled_from(INTS), zero=st.sampled_from(ALL + ["float64"]), scalar=st.sampled_from([7, -3, 2.5, True]),
       op=st.sampled_from(["add", "mul", "sub"]))
def test_zero_dim_and_scalar_tiers_as_torch(dt: str, zero: str, scalar: object, op: str) -> None:
    """torch's three tiers with narrow ints: a dimensioned tensor, a 0-d tensor and a Python
    number; result dtype and values as torch's."""
    if op == "sub" and (zero == "bool" or scalar is True):
        return  # torch refuses - on bools
    xa = _values(dt, 4, 5)
    za = _values(zero, 1, 6).reshape(())
    f = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "sub": lambda a, b: a - b}[op]
    want = f(f(torch.from_numpy(xa), torch.from_numpy(za)), scalar)
    x, z = ej.input(f"tx_{dt}", (4,), dt), ej.input(f"tz_{zero}", (), zero)
    got = f(f(x, z), scalar)
    assert got.dtype == str(want.dtype).removeprefix("torch.")
    np.testing.assert_allclose(ej.reference(got, **{f"tx_{dt}": xa, f"tz_{zero}": za}), want.numpy(), rtol=1e-6)
