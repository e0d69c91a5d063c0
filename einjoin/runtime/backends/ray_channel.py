"""Block channels between the Ray device actors of one host: a move's block goes from the source
actor to the destination actor over a Unix socket, not through a Ray actor call.

Why: a Ray call with a block puts it into the object store (the raylet's shared memory: a create and a
seal, each a round trip to the raylet) and sends the call to the destination's core worker, which
fetches it from the store before the call runs. On a busy machine every one of those processes waits
for a core, and a move took ~4-7 ms from the end of its source task to its arrival (the LLaMA block
of ``bench/ray_exec.py``: 10 moves, most on its critical path). Over a socket the block is two copies
through the kernel and one hop, with no process between the two actors.

Each actor listens on an abstract Unix socket (Linux; the name space of the host, no file) named by
the driver, and connects to a peer's name on its first send to it. A peer on another host has no
such name here: the connect fails and that peer's blocks go by Ray for that run (as does every block
where the channel is off or broken; the next run tries to connect again). Names are random tokens,
never derived from the secret: abstract sockets are listed in ``/proc/net/unix`` for every user to read.
A connection opens with a mutual proof of the secret the driver gave every actor of its backend
(HMAC-SHA256 challenge-response over a nonce from each side; the secret itself never crosses): the
listener drops a connection that cannot prove it, and a sender sends nothing to a listener that
cannot (a name taken by another process). A message is a fixed header (run, task, source device,
the lengths of the dtype's name and of the shape), the dtype's name, the shape and the raw bytes;
the receiver builds a fresh array from them (nothing is unpickled).

>>> import numpy as np
>>> got = []
>>> a = Channel("einjoin-doctest-a", b"s" * 16, lambda *m: got.append(m))
>>> b = Channel("einjoin-doctest-b", b"s" * 16, lambda *m: None)
>>> b.send("einjoin-doctest-a", 7, 3, 1, np.arange(6, dtype=np.float32).reshape(2, 3))
True
>>> a.wait_for(1)
True
>>> got[0][:3], got[0][3].tolist()
((7, 3, 1), [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
>>> a.close(); b.close()
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["Channel", "available"]

_HEAD = struct.Struct("<qqiHH")   # run, task id, source device, len(dtype name), ndim
_NONCE = 16                       # bytes of each side's challenge
_MAC = hashlib.sha256().digest_size
_HANDSHAKE_S = 10.0               # a peer that does not answer the handshake in it is no channel (a guard)
_BUFFER = 4 << 20                 # socket buffers: a block up to it is written without waiting for the reader


def available() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def _plain(dtype: np.dtype) -> bool:
    """A dtype the receiver rebuilds from its name alone: numpy's numbers and bools in native byte
    order, and bfloat16 (others go by Ray)."""
    return dtype.isnative and (dtype.kind in "biufc" or dtype.name == "bfloat16")


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from einjoin.ir.dtypes import numpy_dtype
        return numpy_dtype(name)
    return np.dtype(name)


def _recv_into(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``conn`` (MSG_WAITALL: one call, the GIL released while it waits);
    False at the end of the stream."""
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            return False
        got += k
    return True


def _recv(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_into(conn, memoryview(buf)) else None


def _proof(secret: bytes, side: bytes, listener_nonce: bytes, sender_nonce: bytes) -> bytes:
    """What ``side`` (b"send" or b"listen") answers to the two challenges: an HMAC of both under the
    secret, the side named so that neither answer can be replayed as the other."""
    return hmac.new(secret, side + listener_nonce + sender_nonce, hashlib.sha256).digest()


class Channel:
    """One actor's end: a listener named ``name`` whose connections hand each block received to
    ``on_block(run, task id, source device, block)`` (on the connection's reader thread), and
    ``send`` to a peer's name."""

    def __init__(self, name: str, secret: bytes, on_block: Callable[[int, int, int, np.ndarray], None]):
        self.name, self._secret, self._on_block = name, secret, on_block
        self._out: dict[str, socket.socket] = {}    # peer name -> connection
        self._failed: dict[str, int] = {}           # peer name -> the run whose connect to it failed (Ray then)
        self._in: set[socket.socket] = set()        # connections accepted (closed with the channel)
        self._send_lock = threading.Lock()   # an actor's executor sends moves, a run's end its outputs
        self._received = 0
        self._cv = threading.Condition()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + name)
        self._listener.listen(64)
        self._acceptor = threading.Thread(target=self._accept, name=f"einjoin-channel-{name}", daemon=True)
        self._acceptor.start()

    # -- receiving
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._cv:
                if self._closed:
                    conn.close()
                    return
                self._in.add(conn)
            threading.Thread(target=self._read, args=(conn,), name=f"einjoin-channel-in-{self.name}",
                             daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
                if not self._prove_listener(conn):
                    return
                while True:
                    head = _recv(conn, _HEAD.size)
                    if head is None:
                        return
                    run, tid, src, n_dtype, ndim = _HEAD.unpack(head)
                    meta = _recv(conn, n_dtype + 8 * ndim)
                    if meta is None:
                        return
                    dtype = _dtype(meta[:n_dtype].decode())
                    shape = struct.unpack(f"<{ndim}q", meta[n_dtype:])
                    block = np.empty(shape, dtype)
                    if block.nbytes and not _recv_into(conn, block.reshape(-1).view(np.uint8).data):
                        return
                    self._on_block(run, tid, src, block)
                    with self._cv:
                        self._received += 1
                        self._cv.notify_all()
            except (OSError, ValueError, TypeError, struct.error):  # a peer gone or a foreign stream
                return
            finally:
                with self._cv:
                    self._in.discard(conn)

    def _prove_listener(self, conn: socket.socket) -> bool:
        """The listener's side of the handshake: its challenge out, the sender's challenge and proof
        in (checked), its own proof out. False (the connection is dropped) for a wrong proof."""
        conn.settimeout(_HANDSHAKE_S)
        mine = os.urandom(_NONCE)
        conn.sendall(mine)
        got = _recv(conn, _NONCE + _MAC)
        if got is None:
            return False
        theirs, proof = got[:_NONCE], got[_NONCE:]
        if not hmac.compare_digest(proof, _proof(self._secret, b"send", mine, theirs)):
            return False
        conn.sendall(_proof(self._secret, b"listen", mine, theirs))
        conn.settimeout(None)
        return True

    def wait_for(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` blocks have been received (tests)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._received < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    # -- sending
    def _connect(self, peer: str) -> socket.socket | None:
        """A connection to ``peer`` whose listener proved the secret, else None."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            s.settimeout(_HANDSHAKE_S)
            s.connect("\0" + peer)
            theirs = _recv(s, _NONCE)
            if theirs is not None:
                mine = os.urandom(_NONCE)
                s.sendall(mine + _proof(self._secret, b"send", theirs, mine))
                proof = _recv(s, _MAC)
                if proof is not None and hmac.compare_digest(proof, _proof(self._secret, b"listen", theirs, mine)):
                    s.settimeout(None)
                    return s
        except OSError:  # not on this host (or gone, or silent): that peer's blocks go by Ray
            pass
        s.close()
        return None

    def send(self, peer: str, run: int, tid: int, src: int, block: np.ndarray) -> bool:
        """Send ``block`` to the actor listening as ``peer``; False when there is no channel to it
        (another host, closed, the connection broke, or the listener could not prove the secret): the
        caller sends it by Ray instead. A failed connect is tried again on a later run (the peer may
        have been slow to listen), never again in ``run``."""
        with self._send_lock:
            return self._send(peer, run, tid, src, block)

    def _send(self, peer: str, run: int, tid: int, src: int, block: np.ndarray) -> bool:
        if self._closed:
            return False
        block = np.asarray(block)
        if not _plain(block.dtype):
            return False
        conn = self._out.get(peer)
        if conn is None:
            if self._failed.get(peer) == run:
                return False
            conn = self._connect(peer)
            if conn is None:
                self._failed[peer] = run
                return False
            self._out[peer] = conn
            self._failed.pop(peer, None)
        if not block.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d block 1-d)
            block = np.ascontiguousarray(block)
        name = block.dtype.name.encode()
        try:
            conn.sendall(_HEAD.pack(run, tid, src, len(name), block.ndim) + name
                         + struct.pack(f"<{block.ndim}q", *block.shape))
            if block.nbytes:
                conn.sendall(block.reshape(-1).view(np.uint8).data)
            return True
        except OSError:  # the peer is gone: Ray says so to the driver (a lost device); no channel this run
            del self._out[peer]
            self._failed[peer] = run
            conn.close()
            return False

    def close(self) -> None:
        """Stop listening and end every connection (the reader threads end with theirs)."""
        with self._cv:
            self._closed = True
            accepted = list(self._in)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (it then ends)
        except OSError:
            pass
        self._listener.close()
        # the listening socket is released only when the woken accept() returns: wait for it, so
        # the name is free (and gone from /proc/net/unix) when close returns, even on a busy host
        if threading.current_thread() is not self._acceptor:
            self._acceptor.join(10)
        for conn in accepted:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its reader (it closes the socket as it ends)
            except OSError:
                pass
        for conn in list(self._out.values()):
            conn.close()
        self._out.clear()
