"""Issue 34 (session 34, H5): a hostile hunt for wrong answers and raw errors where fewer eyes
have been: the sparse module (``ej.sparse``, ``ej.einsum`` on sparse operands, ``SparsePlan.run``),
compared with numpy on the densified data. Each test here failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import einjoin as ej

# ---- finding 1: a 0-d array as a sparse tensor (ej.sparse("s", np.array(5.0))) was a raw
# ValueError from np.nonzero ("Calling nonzero on 0d arrays"), so a scalar sparse operand could
# not be built at all


@pytest.mark.parametrize("value", [5.0, 0.0, -2])
def test_a_zero_dim_sparse_tensor_is_a_scalar(value: float) -> None:
    for data in (np.array(value), torch.tensor(value)):
        s = ej.sparse("s", data)
        assert s.shape == () and s.nnz == int(value != 0)
        np.testing.assert_array_equal(s.todense(), np.array(value))
        h = np.arange(6).reshape(2, 3).astype(s.dtype)
        np.testing.assert_array_equal(ej.einsum(",ij->", s, h), np.einsum(",ij->", np.array(value), h))
        np.testing.assert_array_equal(ej.einsum("->", s), np.array(value, s.dtype))


# ---- finding 2: a block that is neither an int nor a sequence of them (block=1.5, block="2")
# was a raw TypeError / ValueError from tuple() / int()


@pytest.mark.parametrize("block", [1.5, "2", [1, "x"], (2.5, 1), None])
def test_a_malformed_block_is_a_shape_error_naming_it(block: object) -> None:
    with pytest.raises(ej.ShapeError, match="'A'.*block"):
        ej.sparse("A", np.eye(3), block=block)  # type: ignore[arg-type]
