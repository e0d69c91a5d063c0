"""The llama case of ``bench/local_exec.py`` in a light module: its graph and feeds, numpy's
hand-written block, and the peak RSS of one peer's runs of it, measured here in a fresh process
(``python bench/llama_memory.py PEER`` prints a JSON line; without an argument it runs each peer
in a fresh process and compares them; ``local_exec.py``'s memory row does the same). It imports
only numpy and einjoin, so that the peers' peaks are not measured over pages that torch's or
dask's import touched and freed (measured: a child that imports torch starts 190 MiB higher, and
a run reuses those freed pages, so its peak above that baseline reads 30% lower than it is).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import einjoin as ej
from einjoin.models.graphs import transformer_block

__all__ = ["HEADS", "PEERS", "block_math", "in_children", "llama_graph", "peak_rss", "measure", "randn"]

HEADS = 8
DEVICES = 2
PEERS = ("einjoin", "numpy", "numpy (hand-written block)")
Feeds = dict[str, np.ndarray]


def randn(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    return x


def block_math(xp: Any, t: dict[str, Any], heads: int) -> Any:
    """``einjoin.models.graphs.transformer_block`` (RMSNorm, rotary causal attention, SwiGLU) as a
    numpy or dask user writes it (``xp`` is numpy or dask.array): the peers' code, not a model."""
    x = t["x"]
    seq, d = x.shape
    hd = d // heads
    inv = (1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    f = np.outer(np.arange(seq, dtype=np.float32), inv)
    emb = np.concatenate([f, f], -1)
    cos, sin = np.cos(emb), np.sin(emb)
    mask = np.tril(np.ones((seq, seq), dtype=bool))

    def rms(v: Any, g: Any) -> Any:
        return v * (1.0 / xp.sqrt((v * v).mean(-1, keepdims=True) + 1e-6)) * g

    def rot(v: Any) -> Any:
        half = xp.concatenate([-v[..., hd // 2:], v[..., :hd // 2]], axis=-1)
        return v * cos + half * sin

    h = rms(x, t["attn_norm"])

    def heads_of(w: Any) -> Any:  # (seq, d) -> (heads, seq, hd)
        return (h @ w.T).reshape(seq, heads, hd).transpose(1, 0, 2)

    q, k, v = rot(heads_of(t["wq"])), rot(heads_of(t["wk"])), heads_of(t["wv"])
    s = (q @ k.transpose(0, 2, 1)) * np.float32(1.0 / math.sqrt(hd))
    s = xp.where(mask, s, np.float32(-np.inf))
    p = xp.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    a = (p @ v).transpose(1, 0, 2).reshape(seq, d)
    x = x + a @ t["wo"].T
    h2 = rms(x, t["mlp_norm"])
    u = h2 @ t["w1"].T
    return x + ((u / (1.0 + xp.exp(-u))) * (h2 @ t["w3"].T)) @ t["w2"].T


def llama_graph(rng: np.random.Generator) -> tuple[Any, Feeds]:
    """The llama case's graph and feeds (the memory row's children build them the same way)."""
    out, shapes = transformer_block(seq=2048, d=1024, heads=HEADS, hidden=2816)
    feeds = {k: randn(rng, s, 0.05 if k.startswith("w") else 1.0) for k, s in shapes.items()}
    for g in ("attn_norm", "mlp_norm"):
        feeds[g] = np.ones(shapes[g], np.float32)
    return out, feeds


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes: Linux's VmHWM, else ru_maxrss (KiB on
    Linux, bytes on macOS). Not ru_maxrss on Linux: a child's starts at its parent's peak (exec
    from a vfork keeps the parent's high-water mark: 426 MiB in a child of a 426 MiB parent whose
    own VmHWM was 11 MiB), so the children would all report this bench's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def measure(peer: str, runs: int = 2) -> dict[str, Any]:
    """In a fresh process: the llama case's feeds, then ``runs`` runs of ``peer`` (one of
    :data:`PEERS`; each result dropped before the next). Peaks (:func:`peak_rss`, bytes) after the
    imports (numpy and einjoin: every peer's the same), after the feeds, after compiling (einjoin)
    and at the end; einjoin's stores' own peak (the blocks they counted) beside it."""
    got: dict[str, Any] = {"peer": peer, "imports": peak_rss()}
    out, feeds = llama_graph(np.random.default_rng(0))
    got["feeds"] = peak_rss()
    if peer == "einjoin":
        prog = ej.compile(out, devices=ej.local(DEVICES), backend="threads", quiet=True)
        got["compiled"] = peak_rss()
        fn: Callable[[], Any] = lambda: prog.run(**feeds)  # noqa: E731
    elif peer == "numpy":
        fn = lambda: ej.reference(out, **feeds)  # noqa: E731
    else:
        fn = lambda: block_math(np, feeds, HEADS)  # noqa: E731
    for _ in range(runs):
        result = fn()
        result = None  # noqa: F841 - dropped before the next run, as the timed columns do
    got["peak"] = peak_rss()
    if peer == "einjoin":
        got["stores"] = sum(prog.run_stats.peak_bytes_per_device.values())
    return got



def in_children(children: int, log: Callable[[str], None] = print) -> dict[str, list[dict[str, Any]]]:
    """:func:`measure` in ``children`` fresh processes per peer, in turn (einjoin, numpy,
    hand-written, again ...): per peer, their reports."""
    import subprocess
    got: dict[str, list[dict[str, Any]]] = {p: [] for p in PEERS}
    for i in range(children):
        for peer in PEERS:
            log(f"memory: {peer}, child {i + 1}/{children}")
            done = subprocess.run([sys.executable, __file__, peer], capture_output=True, text=True, check=True)
            got[peer].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return got


def main(argv: list[str]) -> int:
    """``PEER``: measure it here and print its report (a JSON line); no argument: each peer in a
    fresh process, and their peaks above the import baseline against numpy's."""
    if argv:
        if argv[0] not in PEERS:
            print(f"usage: llama_memory.py [PEER], PEER one of {', '.join(map(repr, PEERS))}", file=sys.stderr)
            return 2
        print(json.dumps(measure(argv[0])))
        return 0
    got = {p: g[0] for p, g in in_children(1).items()}
    above = {p: (g["peak"] - g["imports"]) / (1 << 20) for p, g in got.items()}
    for p, g in got.items():
        print(f"{p}: peak RSS {g['peak'] / (1 << 20):.0f} MiB, {above[p]:.0f} MiB above the import baseline "
              f"({g['imports'] / (1 << 20):.0f} MiB): {above[p] / above['numpy']:.2f}x numpy's")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
