"""The Ray driver's side of a run's data: the feeds it puts into the object store (only those that
changed since the program's last run: :class:`FeedCache`) and the output blocks the actors send
back over a block channel (:class:`OutputInbox`) instead of in their Ray replies.

>>> import numpy as np
>>> same_bytes(np.zeros(3, np.float32), np.zeros(3, np.float32)), same_bytes(np.zeros(3), -np.zeros(3))
(True, False)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from einjoin.errors import EinjoinError

__all__ = ["FeedCache", "OutputInbox", "FEED_CACHE_SHARE", "same_bytes"]

FEED_CACHE_SHARE = 0.25        # of the object store, at most, for feeds kept for the next run
_inbox_ids = itertools.count(1)


def same_bytes(held: Any, a: Any) -> bool:
    """Whether the array ``a`` has the bytes (and dtype and shape) of ``held``, a view of a feed
    an earlier run put; False for anything else (never put by reference then)."""
    if not (isinstance(held, np.ndarray) and isinstance(a, np.ndarray)):
        return False
    if held.dtype != a.dtype or held.shape != a.shape or not (a.flags.c_contiguous and held.flags.c_contiguous):
        return False
    if a.dtype.hasobject:
        return False
    # the bytes as the widest unsigned words that tile them: the same test, 8x fewer elements
    word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if a.nbytes % np.dtype(w).itemsize == 0)
    return bool(np.array_equal(held.reshape(-1).view(np.uint8).view(word), a.reshape(-1).view(np.uint8).view(word)))


class FeedCache:
    """Per program (its engine, weakly held): the object of its last run's feeds and read-only
    views of them in the object store."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._held: weakref.WeakKeyDictionary[Any, tuple[Any, dict[Any, np.ndarray], int]] = \
            weakref.WeakKeyDictionary()
        self._budget: int | None = None

    def clear(self) -> None:
        """Forget every object (Ray restarted: the references are stale)."""
        with self._mu:
            self._held.clear()

    def ref(self, engine: Any) -> Any:
        """The object reference kept for ``engine``'s program (tests), None if none."""
        with self._mu:
            held = self._held.get(engine)
        return held[0] if held is not None else None

    def refs(self, engine: Any, feeds: Mapping[Any, np.ndarray]) -> tuple[Any, Any]:
        """The object references a run's ``go`` takes its feeds from: (all, None) when they are put
        whole, or (an earlier run's feeds, those that differ from them) when most bytes are the
        same. Why: putting a run's feeds costs ~1 ms per MB (the raylet creates and seals the
        object, its pages fault in: 12 ms for the LLaMA block's 13 MB of weights and input on a
        busy box, a third of the threads backend's whole run), comparing them with what is in the
        store ~0.05 ms per MB; weights are fed unchanged run after run. Equal means the same bytes
        (so -0.0 and NaN payloads are told apart). Only this program's last put is kept (dropped
        with the program), and only while the programs' kept feeds fill at most
        :data:`FEED_CACHE_SHARE` of the object store."""
        from einjoin.runtime.backends.ray_start import _ray
        ray = _ray()
        with self._mu:
            held = self._held.get(engine)
        total = sum(getattr(a, "nbytes", 0) for a in feeds.values())
        if held is not None:
            ref, views, _ = held
            fresh = {n: a for n, a in feeds.items() if not same_bytes(views.get(n), a)}
            if 2 * sum(getattr(a, "nbytes", 0) for a in fresh.values()) <= total:
                return ref, (ray.put(fresh) if fresh else None)
        ref = ray.put(dict(feeds))
        with self._mu:
            if self._budget is None:
                self._budget = int(ray.cluster_resources().get("object_store_memory", 0) * FEED_CACHE_SHARE)
            self._held.pop(engine, None)
            used = sum(nb for _, _, nb in self._held.values())
            if used + total <= self._budget:
                self._held[engine] = (ref, dict(ray.get(ref)), total)  # views of the store's copy
        return ref, None


class OutputInbox:
    """This process's end of the block channels (:mod:`.ray_channel`): the actors on this host
    send a run's output blocks here when its part ends (a block in a Ray reply goes through the
    object store: a 512 KB one took ~2 ms more per call than a small reply on a busy box). Each
    run registers before its ``go`` (:meth:`expect`) and is forgotten when it ends; blocks of a
    run not expected (failed, cancelled) are dropped."""

    def __init__(self, secret: bytes, enabled: bool = True) -> None:
        self._secret, self._enabled = secret, enabled
        self._token = os.urandom(8).hex()   # the channel's name: random, never of the secret (names are public)
        self._channel: Any = None
        self._arrived: dict[int, dict[int, np.ndarray]] = {}   # run -> output blocks come
        self._cv = threading.Condition()

    def expect(self, run: int) -> str | None:
        """Register ``run``; the name the actors send its outputs to (the channel starts on first
        use), or None where there is none (Ray carries them in the reports)."""
        if not self._enabled:
            return None
        from einjoin.runtime.backends.ray_channel import Channel, available
        if not available():
            return None
        with self._cv:
            if self._channel is None:
                name = f"einjoin-{self._token}-{os.getpid()}-out{next(_inbox_ids)}"
                self._channel = Channel(name, self._secret, self._arrive)
            self._arrived[run] = {}
            return str(self._channel.name)

    def _arrive(self, run: int, vid: int, src: int, block: np.ndarray) -> None:  # a reader thread
        with self._cv:
            got = self._arrived.get(run)
            if got is not None:
                got[vid] = block
                self._cv.notify_all()

    def take(self, run: int, vids: Sequence[int], timeout: float = 120.0) -> dict[int, np.ndarray]:
        """The output blocks ``vids`` of ``run`` that the actors' reports say they sent here (each
        was written out before its report was made, so it is on its way: the wait is a guard)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            got = self._arrived.get(run, {})
            while any(v not in got for v in vids):
                if run not in self._arrived:
                    raise EinjoinError("the Ray backend was closed while the run's output blocks came")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EinjoinError(f"{sum(v not in got for v in vids)} output blocks of the run did not arrive "
                                       f"from the Ray actors over their channel in {timeout:.0f} s")
                self._cv.wait(left)
            return {v: got[v] for v in vids}

    def forget(self, run: int) -> None:
        """The run ended (or failed): drop what came for it, and anything that comes later."""
        with self._cv:
            self._arrived.pop(run, None)

    def close(self) -> None:
        """Close this process's channel (``RayBackend.close``): its listener, its connections and
        their threads; a run waiting for its blocks fails, and a later run opens a new channel."""
        with self._cv:
            ch, self._channel = self._channel, None
            self._arrived.clear()
            self._cv.notify_all()
        if ch is not None:
            ch.close()
