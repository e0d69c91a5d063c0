"""Issue 35 (session 35): a hostile hunt for wrong answers and raw errors in places the earlier
hunts (issues 33, 34) did not look: the torch backend on empty blocks, run() feeds, saved programs,
``from_torch`` corner cases, the Trainer's state, and the backends against each other. Each test
here failed before its fix (or is an ``xfail(strict=True)`` naming whose module holds the bug)."""

from __future__ import annotations

import numpy as np
import pytest

import einjoin as ej

# ---- finding 1: on the torch backend a max / min over the columns of a tensor with no rows
# (x of shape (0, 4), x.max(1)) failed every run with torch's "cannot reshape tensor of 0
# elements into shape [0, -1]" (the kernel's aggregation flattened the summed dims as -1);
# sync and threads gave the empty result


@pytest.mark.parametrize("agg", ["max", "min", "sum", "prod"])
@pytest.mark.parametrize("devices", [1, 2])
def test_torch_backend_reduces_a_tensor_with_no_rows(agg: str, devices: int) -> None:
    x = ej.input("x", (0, 4))
    y = ej.einsum("ab->a", x, agg=agg)
    out = ej.compile(y, devices=devices, backend="torch").run(x=np.zeros((0, 4), np.float32))
    assert np.asarray(out).shape == (0,) and np.asarray(out).dtype == np.float32
