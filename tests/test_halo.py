"""The halo of a spatially split convolution: a conv2d on a 512x512 image cut into blocks of output
rows (and of rows and columns) across 4 devices moves — per the plan's stats and the run's
``run_stats`` — exactly the halo rows its kernels share beyond the one loaded copy of the input
(plus the weight's replicas), the figure computed by hand below; the cost model's join bytes
count the same halo."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej
from einjoin.decomp.partition import Covering
from einjoin.planner.cost import join_cost_per_input, model_cost
from einjoin.planner.exact import plan_bytes

N, C, O, H, W, K = 1, 2, 2, 512, 512, 3   # float32, 3x3 kernel, padding 1 (a 'same' conv)
F32 = 4


def _conv() -> tuple[ej.Tensor, ej.Tensor, ej.Tensor]:
    x, w = ej.input("x", (N, C, H, W)), ej.param("w", (O, C, K, K))
    return x, w, ej.conv(x, w, padding=1)


@pytest.mark.parametrize("cut, halo_elems", [
    # 4 row blocks [0,128) [128,256) [256,384) [384,512) read input rows [0,129) [127,257) [255,385)
    # [383,512): the input is loaded cut where those start (0, 127, 255, 383), so each of the 3
    # inner boundaries moves K-1 = 2 rows of 512 columns, per input channel
    ({"p": 4}, 3 * (K - 1) * W * C),
    # 2 x 2 blocks read rows/cols [0,257) and [255,512): each box is its core block and 2 rows or
    # columns more where a neighbour is; in all (257 + 257)^2 - 512^2 elements per channel
    ({"p": 2, "q": 2}, ((H + K - 1) * (W + K - 1) - H * W) * C),
])
def test_a_spatially_split_conv_moves_only_the_halo(cut: dict[str, int], halo_elems: int) -> None:
    x, w, y = _conv()
    prog = ej.compile(y, devices=4, specs={y: cut}, quiet=True)
    weight_replicas = 3 * O * C * K * K * F32          # the weight goes to the 3 other devices
    expected = halo_elems * F32 + weight_replicas
    assert prog.stats.bytes_moved == expected
    assert plan_bytes(prog.graph, prog.decomps, prog.placement) == expected  # the exact volume formula
    assert model_cost(prog.graph, ej.local(4), prog.specs) == expected       # the planners' cost model
    assert prog.stats.bytes_loaded == (N * C * H * W + O * C * K * K) * F32  # one copy of each
    rng = np.random.default_rng(0)
    X, Wt = rng.standard_normal((N, C, H, W)).astype("float32"), rng.standard_normal((O, C, K, K)).astype("float32")
    got = prog.run(x=X, w=Wt)
    assert prog.run_stats is not None and prog.run_stats.bytes_moved == expected
    want = torch.nn.functional.conv2d(torch.tensor(X), torch.tensor(Wt), padding=1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_cost_model_counts_the_halo() -> None:
    x, w, y = _conv()
    d = ej.decompose(y.node, {"p": 4})
    cov = d.in_partitions[0]
    assert isinstance(cov, Covering) and cov.core.bounds[2] == (0, 127, 255, 383, 512)
    assert [cov.box(k)[2] for k in cov.keys()] == [(0, 129), (127, 257), (255, 385), (383, 512)]
    x_join, w_join = join_cost_per_input(d)
    assert x_join == 3 * (K - 1) * W * C * F32
    assert w_join == 3 * O * C * K * K * F32


def test_a_strided_conv_whose_windows_leave_gaps_reads_no_halo() -> None:
    """Stride 4 with a 3-wide window: neighbouring blocks share no input row, so nothing but the
    weight moves (the rows no window reads are loaded, never moved)."""
    x, w = ej.input("x", (N, C, 64, 64)), ej.param("w", (O, C, K, K))
    y = ej.conv(x, w, stride=4)
    prog = ej.compile(y, devices=4, specs={y: {"p": 4}}, quiet=True)
    assert prog.stats.bytes_moved == 3 * O * C * K * K * F32
