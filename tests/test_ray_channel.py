"""The Ray actors' block channel (einjoin/runtime/backends/ray_channel.py) in this process, no Ray:
blocks arrive bit-identical whatever their dtype, shape and strides; what it cannot carry (another
host's peer, a dtype not rebuilt from its name) is left to Ray (``send`` says False); the
handshake is mutual (a connection that cannot prove the secret is dropped, and nothing is sent to a
listener that cannot); a failed connect is retried on a later run only; close ends every thread.
The Ray backend's use of it: tests/test_ray.py."""

from __future__ import annotations

import itertools
import os
import socket
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from einjoin.ir.dtypes import numpy_dtype
from einjoin.runtime.backends.ray_channel import Channel, available

pytestmark = pytest.mark.skipif(not available(), reason="abstract Unix sockets are Linux's")

_names = itertools.count()
SECRET = b"0123456789abcdef"


def _name() -> str:
    return f"einjoin-test-{os.getpid()}-{next(_names)}"


class _Inbox:
    def __init__(self):
        self.got: list[tuple[int, int, int, np.ndarray]] = []
        self.lock = threading.Lock()

    def __call__(self, run, tid, src, block):
        with self.lock:
            self.got.append((run, tid, src, block))


@pytest.fixture(scope="module")
def pair():
    inbox = _Inbox()
    dst = Channel(_name(), SECRET, inbox)
    src = Channel(_name(), SECRET, lambda *m: None)
    yield src, dst, inbox
    src.close()
    dst.close()


DTYPES = ["float32", "float64", "float16", "bool", "int64", "int32", "uint8", "complex64"]


@st.composite
def blocks(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    a = draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)))
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T  # not contiguous: sent as a contiguous copy of the same values
    return a


@settings(max_examples=60, deadline=None)
@given(a=blocks(), run=st.integers(0, 2**62), tid=st.integers(0, 2**40), src=st.integers(0, 4096))
def test_blocks_arrive_bit_identical(pair, a, run, tid, src):
    sender, dst, inbox = pair
    before = len(inbox.got)
    assert sender.send(dst.name, run, tid, src, a)
    assert dst.wait_for(before + 1) or len(inbox.got) > before
    r, t, s, b = inbox.got[before]
    assert (r, t, s) == (run, tid, src)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.ascontiguousarray(a).tobytes() == b.tobytes()   # bits: -0.0 and nan payloads too


def test_bfloat16_and_many_blocks_in_order(pair):
    sender, dst, inbox = pair
    before = len(inbox.got)
    half = (np.arange(12, dtype=np.float32) - 5.5).astype(numpy_dtype("bfloat16")).reshape(3, 4)
    big = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)  # 1 MiB: several reads
    for i in range(5):
        assert sender.send(dst.name, 1, i, 0, half if i % 2 else big)
    assert dst.wait_for(before + 5)
    got = inbox.got[before:]
    assert [t for _, t, _, _ in got] == list(range(5))
    assert got[1][3].dtype == half.dtype and got[1][3].tobytes() == half.tobytes()
    np.testing.assert_array_equal(got[4][3], big)


def test_what_it_cannot_carry_is_left_to_ray(pair):
    sender, dst, inbox = pair
    assert not sender.send(dst.name, 1, 0, 0, np.zeros(3, dtype=">f4"))          # not native byte order
    assert not sender.send(dst.name, 1, 0, 0, np.zeros(3, dtype=[("a", "f4")]))  # structured
    assert not sender.send(dst.name, 1, 0, 0, np.array([None], dtype=object))
    assert not sender.send(_name(), 1, 0, 0, np.zeros(3))   # nobody listens there: a peer on another host
    assert sender.send(dst.name, 1, 0, 0, np.zeros(3))      # the known peer still works


def test_a_connection_without_the_secret_is_dropped():
    inbox = _Inbox()
    dst = Channel(_name(), SECRET, inbox)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect("\0" + dst.name)
            challenge = s.recv(16, socket.MSG_WAITALL)
            assert len(challenge) == 16 and SECRET not in challenge
            s.sendall(b"x" * 16 + SECRET * 2 + b"\0" * 64)   # a proof that is not the secret's HMAC
            try:
                assert s.recv(1) == b""   # closed by the receiver, nothing delivered
            except ConnectionResetError:  # closed with our bytes unread
                pass
        wrong = Channel(_name(), b"y" * 16, lambda *m: None)
        right = Channel(_name(), SECRET, lambda *m: None)
        assert not wrong.send(dst.name, 1, 1, 0, np.ones(2))   # refused at the handshake: Ray carries it
        assert right.send(dst.name, 1, 2, 0, np.ones(2))
        assert dst.wait_for(1)
        assert [t for _, t, _, _ in inbox.got] == [2]
        wrong.close()
        right.close()
    finally:
        dst.close()


def test_a_sender_sends_nothing_to_a_listener_that_cannot_prove_the_secret():
    # mutual: a process that took a peer's name (abstract names are first come, first served) and
    # does not know the secret gets neither the secret nor a block; the block goes by Ray instead
    wrong = Channel(_name(), b"y" * 16, lambda *m: None)
    sender = Channel(_name(), SECRET, lambda *m: None)
    heard = bytearray()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as impostor:
        name = _name()
        impostor.bind("\0" + name)
        impostor.listen(1)

        def listen():  # an impostor that reads whatever comes until the sender hangs up
            conn, _ = impostor.accept()
            with conn:
                conn.settimeout(30)
                conn.sendall(os.urandom(16))  # a challenge, like a listener's
                try:
                    heard.extend(conn.recv(48, socket.MSG_WAITALL))
                    conn.sendall(os.urandom(32))  # a proof it cannot make: a guess
                    while chunk := conn.recv(1 << 16):
                        heard.extend(chunk)
                except OSError:
                    pass

        t = threading.Thread(target=listen, daemon=True)
        t.start()
        block = np.full(64, 7.0)
        try:
            assert not sender.send(wrong.name, 1, 0, 0, block)
            assert not sender.send(name, 1, 0, 0, block)
        finally:
            sender.close()
            wrong.close()
        t.join(30)
    assert not t.is_alive()
    assert SECRET not in heard and block.tobytes() not in heard
    assert len(heard) == 16 + 32   # the sender's challenge and proof, nothing after


def test_a_failed_connect_is_tried_again_on_a_later_run_only():
    inbox = _Inbox()
    sender = Channel(_name(), SECRET, lambda *m: None)
    name = _name()
    try:
        assert not sender.send(name, 5, 0, 0, np.ones(2))   # nobody listens yet: Ray carries run 5's blocks
        dst = Channel(name, SECRET, inbox)
        try:
            assert not sender.send(name, 5, 1, 0, np.ones(2))   # the rest of run 5 too (no connect per block)
            assert sender.send(name, 6, 2, 0, np.ones(2))       # a later run connects
            assert dst.wait_for(1)
            assert [(r, t) for r, t, _, _ in inbox.got] == [(6, 2)]
        finally:
            dst.close()
    finally:
        sender.close()


def test_close_ends_the_listener_and_every_connection_it_accepted():
    dst = Channel(_name(), SECRET, lambda *m: None)
    sender = Channel(_name(), SECRET, lambda *m: None)
    try:
        assert sender.send(dst.name, 1, 0, 0, np.ones(2))
        assert dst.wait_for(1)
        mine = [t for t in threading.enumerate() if t.name.endswith(dst.name)]
        assert len(mine) == 2   # the accept thread and the connection's reader
        dst.close()
        for t in mine:
            t.join(30)
            assert not t.is_alive(), t.name
        with open("/proc/net/unix") as f:
            assert "@" + dst.name not in f.read()
    finally:
        sender.close()
        dst.close()


def test_a_listener_that_never_answers_is_no_channel(monkeypatch):
    # a name taken by a process that accepts and stays silent: the handshake gives up after its
    # guard (shortened here) and the block goes by Ray; nothing of it was written
    import einjoin.runtime.backends.ray_channel as rc
    monkeypatch.setattr(rc, "_HANDSHAKE_S", 0.3, raising=False)
    sender = Channel(_name(), SECRET, lambda *m: None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        name = _name()
        silent.bind("\0" + name)
        silent.listen(1)
        try:
            assert not sender.send(name, 1, 0, 0, np.full(8, 3.0))
            conn, _ = silent.accept()
            with conn:
                conn.settimeout(10)
                assert conn.recv(1 << 16) == b""   # the sender hung up without a byte
        finally:
            sender.close()
