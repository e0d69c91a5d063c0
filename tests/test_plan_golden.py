"""The plans the default planner chooses, pinned: bytes moved by the compiled plan for the LLaMA
block, the MLP and the matmul chain (``einjoin.models.graphs`` at their default sizes) on
P = 2, 4, 8, 16, 64 devices. The house redesign (issue 17) must leave every figure unchanged;
a later change of the optimizer may update a pinned value only with the reason written here.

Pinned on the main of stop 13 (after the wrong-answers work of issue 16, before issue 17)."""

from __future__ import annotations

import pytest

import einjoin as ej
from einjoin.models.graphs import build

# bytes moved between devices by the plan `ej.compile(build(model), devices=P)` chooses
GOLDEN: dict[str, dict[int, int]] = {
    "llama-block": {2: 167804928, 4: 411107328, 8: 939655168, 16: 1520631808, 64: 3198615552},
    "mlp": {2: 33554432, 4: 100663296, 8: 167772160, 16: 301989888, 64: 704643072},
    "chain": {2: 134217728, 4: 268435456, 8: 402653184, 16: 671088640, 64: 1207959552},
}


@pytest.mark.parametrize("model, devices", [(m, p) for m, by_p in GOLDEN.items() for p in by_p])
def test_the_chosen_plan_moves_the_pinned_bytes(model: str, devices: int) -> None:
    prog = ej.compile(build(model), devices=devices, backend="null", quiet=True)
    assert prog.stats.bytes_moved == GOLDEN[model][devices], (
        f"{model} on {devices} devices now moves {prog.stats.bytes_moved} bytes, pinned "
        f"{GOLDEN[model][devices]}: a plan changed")
