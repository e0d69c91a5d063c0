"""Train a torch model with einjoin: the zoo's small LLaMA (2 layers, hidden 64, a byte vocabulary
of 256) learns the bytes of the project's own docs (docs/architecture.md) with ``ej.Trainer`` on
two local devices, and the same model trains in torch on the same batches from the same initial
weights. A progress bar shows the loss and tokens/s; a PNG shows both loss curves side by side.

    python examples/train.py                  (200 steps; the PNG goes to build/train/loss.png)
    python examples/train.py --steps 20 --out /tmp/run
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import einjoin as ej
from einjoin.models.zoo import example

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "architecture.md"


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batches(data: np.ndarray, steps: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``steps`` batches of ``batch`` random windows of the text: the tokens and the next ones."""
    rng = np.random.default_rng(seed)
    out: list[tuple[torch.Tensor, ...]] = []
    for _ in range(steps):
        starts = rng.integers(0, len(data) - seq - 1, batch)
        win = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
        out.append((torch.from_numpy(win[:, :-1].copy()), torch.from_numpy(win[:, 1:].copy())))
    return out


def save_curves(path: pathlib.Path, ours: list[float], theirs: list[float], rates: tuple[float, float]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    steps = np.arange(1, len(ours) + 1)
    left.plot(steps, ours, color="tab:blue")
    left.set_title(f"einjoin Trainer, local(2) ({rates[0]:,.0f} tokens/s)")
    right.plot(steps, theirs, color="tab:orange")
    right.set_title(f"torch, 2 threads ({rates[1]:,.0f} tokens/s)")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    left.set_ylabel("cross-entropy (nats per byte)")
    fig.suptitle(f"small LLaMA on the bytes of {TEXT.relative_to(ROOT)}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    ap.add_argument("--out", default=str(ROOT / "build" / "train"), help="folder for loss.png")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    console = Console()
    torch.set_num_threads(2)  # the cores local(2) uses

    data = np.frombuffer(TEXT.read_bytes(), np.uint8)
    module, _ = example("llama", dim=64, layers=2, vocab=256, seq=args.seq, batch=args.batch)
    reference = copy.deepcopy(module)  # torch trains a copy from the same initial weights
    work = batches(data, args.steps, args.batch, args.seq, seed=0)
    tokens = args.batch * args.seq

    t0 = time.perf_counter()
    trainer = ej.Trainer(module, work[0], next_token_loss, optimizer=ej.optim.AdamW(lr=args.lr),
                         devices=ej.local(2), backend="threads")
    console.print(f"built the training step in {time.perf_counter() - t0:.1f} s: "
                  f"{len(trainer.program.graph.ops)} ops, {len(trainer.parameter_names)} parameters, "
                  f"state {len(trainer.program.state)} tensors on 2 devices")

    warm = 3 if len(work) > 6 else 0  # tokens/s after the first steps (torch's first steps are slow)

    def run(name: str, step) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
        losses: list[float] = []
        spent, counted = 0.0, 0
        columns = (TextColumn(f"{name:8}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[rate]:,.0f} tokens/s"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as bar:
            task = bar.add_task(name, total=len(work), loss=float("nan"), rate=0.0)
            for b in work:
                t = time.perf_counter()
                losses.append(step(*b))
                if len(losses) > warm:
                    spent += time.perf_counter() - t
                    counted += 1
                bar.update(task, advance=1, loss=losses[-1], rate=tokens * counted / spent if spent else 0.0)
        return losses, tokens * counted / spent

    ours, our_rate = run("einjoin", trainer.step)
    reference.train()
    opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, foreach=False)

    def torch_step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = next_token_loss(reference(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    theirs, their_rate = run("torch", torch_step)
    png = pathlib.Path(args.out) / "loss.png"
    save_curves(png, ours, theirs, (our_rate, their_rate))
    diff = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    console.print(f"loss: einjoin {ours[0]:.3f} -> {ours[-1]:.3f}, torch {theirs[0]:.3f} -> {theirs[-1]:.3f} "
                  f"(largest relative difference {diff:.1e}); {our_rate:,.0f} vs {their_rate:,.0f} tokens/s")
    console.print(f"loss curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
