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
such name here: the connect fails and that peer's blocks go by Ray (as does every block where the
channel is off or broken). A connection opens with a secret the driver gave every actor of its
backend; a connection without it is closed. A message is a fixed header (run, task, source device,
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

import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

__all__ = ["Channel", "available"]

_HEAD = struct.Struct("<qqiHH")   # run, task id, source device, len(dtype name), ndim
_SECRET = 16                      # bytes of the secret a connection opens with
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


class Channel:
    """One actor's end: a listener named ``name`` whose connections hand each block received to
    ``on_block(run, task id, source device, block)`` (on the connection's reader thread), and
    ``send`` to a peer's name."""

    def __init__(self, name: str, secret: bytes, on_block: Callable[[int, int, int, np.ndarray], None]):
        self.name, self._secret, self._on_block = name, secret, on_block
        self._out: dict[str, socket.socket | None] = {}   # peer name -> connection (None: use Ray)
        self._send_lock = threading.Lock()   # an actor's executor sends moves, a run's end its outputs
        self._received = 0
        self._cv = threading.Condition()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + name)
        self._listener.listen(64)
        threading.Thread(target=self._accept, name=f"einjoin-channel-{name}", daemon=True).start()

    # -- receiving
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(conn,), name=f"einjoin-channel-in-{self.name}",
                             daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
                if _recv(conn, _SECRET) != self._secret:
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
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            s.connect("\0" + peer)
            s.sendall(self._secret)
            return s
        except OSError:  # not on this host (or gone): that peer's blocks go by Ray
            s.close()
            return None

    def send(self, peer: str, run: int, tid: int, src: int, block: np.ndarray) -> bool:
        """Send ``block`` to the actor listening as ``peer``; False when there is no channel to it
        (another host, closed, or the connection broke): the caller sends it by Ray instead."""
        with self._send_lock:
            return self._send(peer, run, tid, src, block)

    def _send(self, peer: str, run: int, tid: int, src: int, block: np.ndarray) -> bool:
        if self._closed:
            return False
        if peer not in self._out:
            self._out[peer] = self._connect(peer)
        conn = self._out[peer]
        if conn is None:
            return False
        block = np.asarray(block)
        if not _plain(block.dtype):
            return False
        if not block.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d block 1-d)
            block = np.ascontiguousarray(block)
        name = block.dtype.name.encode()
        try:
            conn.sendall(_HEAD.pack(run, tid, src, len(name), block.ndim) + name
                         + struct.pack(f"<{block.ndim}q", *block.shape))
            if block.nbytes:
                conn.sendall(block.reshape(-1).view(np.uint8).data)
            return True
        except OSError:  # the peer is gone: Ray says so to the driver (a lost device); no channel now
            self._out[peer] = None
            conn.close()
            return False

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in self._out.values():
            if conn is not None:
                conn.close()
        self._out.clear()
