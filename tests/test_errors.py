"""Malformed inputs through the public API: each must raise an einjoin error naming the offender.

Every case builds something bad (a graph, a partition, a spec, a set of feeds) and states the
exception class expected and the fragments its message must hold: the offending label, shape,
name or dtype. Internals leaking out (a bare IndexError, KeyError, AssertionError, TypeError,
AttributeError, ValueError) fail the case, as does an error that does not say what is wrong.

A known bug gets its case marked ``xfail(strict=True)`` with the reason, until it is fixed.
"""

from __future__ import annotations

import json
import threading
from typing import Any
from collections.abc import Callable

import numpy as np
import pytest

import einjoin as ej
from taskcount import TaskCount

FAMILY = (ej.EinjoinError, ej.ShapeError, ej.EinsumSyntaxError, ej.DTypeError, ej.PartitionError,
          ej.ExpressionError, ej.UnsupportedOpError)


# ---------------------------------------------------------------- helpers


def t(shape: Any = (2, 3), dtype: str = "float32", name: str = "x") -> ej.Tensor:
    return ej.input(name, shape, dtype)


def mm() -> ej.Tensor:
    """An (8, 6) @ (6, 4) matmul: labels m=8, n=4, k=6."""
    return t((8, 6), name="a") @ t((6, 4), name="b")


def spec_of_other_matmul() -> Any:
    """Decompose a (4, 6) @ (6, 4) matmul (m=4) with a spec built for ``mm()`` (m=8)."""
    spec = ej.JoinAggSpec.for_node(mm().node, {"m": 2})
    z2 = t((4, 6), name="c") @ t((6, 4), name="d")
    return ej.decompose(z2.node, spec)


def gather_feeds(idx: list[int], blocked: bool = False) -> Any:
    table, ids = t((5, 2), name="table"), t((3,), "int64", "ids")
    g = ej.gather(table, ids)
    feeds = dict(table=np.ones((5, 2), np.float32), ids=np.array(idx, np.int64))
    if blocked:
        return ej.execute_blocked(g, {g: {"row": 2}}, **feeds)
    return ej.reference(g, **feeds)


def ref(out: Any, **feeds: Any) -> Any:
    return ej.reference(out, **feeds)


def attn(q: Any = (2, 4, 8), k: Any = (2, 4, 8), v: Any = (2, 4, 8), **kw: Any) -> Any:
    return ej.attention(t(q, name="q"), t(k, name="k"), t(v, name="v"), **kw)


def case(id: str, build: Callable[[], Any], cls: type, fragments: list[str]) -> Any:
    return pytest.param(build, cls, fragments, id=id)


# ---------------------------------------------------------------- the table


CASES = [
    # ---- einsum equations
    case("eq-digit-label", lambda: ej.einsum("i1->i", t()), ej.EinsumSyntaxError,
         ["'1'", "'i1->i'"]),
    case("eq-hash-label", lambda: ej.einsum("i#->i", t()), ej.EinsumSyntaxError, ["'#'"]),
    case("eq-two-arrows", lambda: ej.einsum("ij->ij->i", t()), ej.EinsumSyntaxError,
         ["'ij->ij->i'", "'->'"]),
    case("eq-stray-dot", lambda: ej.einsum("i.j->i", t()), ej.EinsumSyntaxError,
         ["'.'", "'i.j'"]),
    case("eq-two-ellipses", lambda: ej.einsum("...i...->i", t()), ej.EinsumSyntaxError,
         ["'...'", "'...i...'"]),
    case("eq-not-a-string", lambda: ej.einsum(["ij->i"], t()), ej.EinsumSyntaxError, ["list"]),
    case("eq-too-few-operands", lambda: ej.einsum("ij,jk->ik", t()), ej.EinsumSyntaxError,
         ["'ij,jk->ik'", "2 input(s)", "1 tensor(s)"]),
    case("eq-too-many-operands", lambda: ej.einsum("ij->i", t(), t((3,), name="y")),
         ej.EinsumSyntaxError, ["1 input(s)", "2 tensor(s)"]),
    case("eq-operand-not-tensor", lambda: ej.einsum("ij->i", np.ones((2, 3))), ej.EinjoinError,
         ["ndarray"]),
    case("eq-repeated-output-label", lambda: ej.einsum("ij->ii", t((3, 3))),
         ej.EinsumSyntaxError, ["'i'", "repeated"]),
    case("eq-output-label-in-no-input", lambda: ej.einsum("ij->ik", t()), ej.EinsumSyntaxError,
         ["'k'"]),
    case("eq-label-sizes-disagree",
         lambda: ej.einsum("ij,jk->ik", t((2, 3), name="a"), t((4, 5), name="b")),
         ej.ShapeError, ["'j'", "(2, 3)", "(4, 5)"]),
    case("eq-label-sizes-disagree-within-input", lambda: ej.einsum("ii->i", t((2, 3))),
         ej.ShapeError, ["'i'", "(2, 3)"]),
    case("eq-ellipsis-sizes-disagree",
         lambda: ej.einsum("...i,...i->...i", t((2, 3), name="a"), t((4, 3), name="b")),
         ej.ShapeError, ["(2, 3)", "(4, 3)"]),
    case("eq-ellipsis-sizes-disagree-names-equation",
         lambda: ej.einsum("...i,...i->...i", t((2, 3), name="a"), t((4, 3), name="b")), ej.ShapeError,
         ["'...i,...i->...i'"]),
    case("eq-term-rank-mismatch", lambda: ej.einsum("ijk->i", t((2, 3))), ej.ShapeError,
         ["'ijk'", "(2, 3)"]),
    case("eq-ellipsis-term-longer-than-rank", lambda: ej.einsum("...ijk->...", t((3,))),
         ej.ShapeError, ["'...ijk'", "(3,)"]),

    # ---- joins and aggregations
    case("join-unknown-name", lambda: ej.einsum("ij->ij", t(), join="softplus"),
         ej.ExpressionError, ["'softplus'"]),
    case("join-unknown-function", lambda: ej.einsum("ij->ij", t(), join="softplus(x0)"),
         ej.ExpressionError, ["'softplus'"]),
    case("join-where-on-two-inputs",
         lambda: ej.einsum("i,i->i", t((3,), name="a"), t((3,), name="b"), join="where"),
         ej.ExpressionError, ["'where'", "3 argument(s)", "2 input(s)"]),
    case("join-exp-on-two-inputs",
         lambda: ej.einsum("i,i->i", t((3,), name="a"), t((3,), name="b"), join="exp"),
         ej.ExpressionError, ["'exp'", "2 input(s)"]),
    case("join-uses-x3-with-two-inputs",
         lambda: ej.einsum("i,i->i", t((3,), name="a"), t((3,), name="b"), join="x0 + x3"),
         ej.ExpressionError, ["x3", "2 input(s)"]),
    case("join-unparsable", lambda: ej.einsum("ij->ij", t(), join="x0 +"), ej.ExpressionError,
         ["'x0 +'", "does not parse"]),
    case("join-call-arity", lambda: ej.einsum("ij->ij", t(), join="exp(x0, x0)"),
         ej.ExpressionError, ["exp", "takes 1 argument(s)", "got 2"]),
    case("join-unsupported-operator", lambda: ej.einsum("ij->ij", t(), join="x0 << 2"),
         ej.ExpressionError, ["'x0 << 2'"]),
    case("join-not-a-string", lambda: ej.einsum("ij->ij", t(), join=3), ej.ExpressionError,
         ["got 3"]),
    case("join-long-sum-chain",
         lambda: ej.einsum("i->i", t((3,)), join="x0" + " + x0" * 400), ej.ExpressionError, ["join"]),
    case("agg-unknown-name", lambda: ej.einsum("ij->i", t(), agg="mean"), ej.ExpressionError,
         ["'mean'"]),
    case("agg-none-string-with-aggregated-label", lambda: ej.einsum("ij->i", t(), agg="none"),
         ej.EinsumSyntaxError, ["'j'", "'none'"]),
    case("agg-None-with-aggregated-label", lambda: ej.einsum("ij->i", t(), agg=None),
         ej.EinsumSyntaxError, ["'j'", "'none'"]),

    # ---- dtypes
    # (issue 16: mixed int/float/bool arithmetic, exp of ints, sums of bools, zero-size dims and
    # empty slices now follow torch instead of raising; tests/adversarial/test_dtypes.py checks them)
    case("dtype-where-float-condition", lambda: ej.where(t(), 1.0, 0.0), ej.DTypeError,
         ["condition", "float32"]),
    case("dtype-logical-and-float", lambda: t() & t(name="y"), ej.DTypeError,
         ["logical_and", "float32"]),
    case("dtype-matmul-bool", lambda: t((2, 3), "bool") @ t((3, 2), "bool", "y"), ej.DTypeError,
         ["bool"]),
    case("dtype-unknown-float8", lambda: t(dtype="float8"), ej.DTypeError, ["'float8'"]),
    case("dtype-unknown-uint16", lambda: t(dtype="uint16"), ej.DTypeError, ["uint16"]),
    case("dtype-cast-to-numpy-uint32", lambda: ej.cast(t(), np.uint32), ej.DTypeError, ["uint32"]),
    case("dtype-cast-to-unknown-name", lambda: ej.cast(t(), "float8"), ej.DTypeError,
         ["'float8'"]),
    case("dtype-fill-int64-from-float-expr", lambda: ej.fill((3,), "x0 * 0.5", "int64"),
         ej.DTypeError, ["0.5", "int64"]),
    case("dtype-fill-bool-from-index", lambda: ej.fill((3,), "x0", "bool"), ej.DTypeError,
         ["int", "bool"]),
    case("dtype-complex-numpy-scalar", lambda: t() + np.complex64(1j), ej.EinjoinError, ["complex"]),

    # ---- shapes given to constructors
    case("shape-negative-dim", lambda: t((2, -3)), ej.ShapeError, ["-3", "'x'"]),
    case("shape-non-int-dim", lambda: t((2.5, 3)), ej.ShapeError, ["2.5"]),
    case("shape-bool-dim", lambda: t((True, 3)), ej.ShapeError, ["True"]),
    case("shape-None", lambda: t(None), ej.ShapeError, ["None"]),
    case("input-empty-name", lambda: ej.input("", (2,)), ej.EinjoinError, ["''"]),
    case("fill-negative-dim", lambda: ej.fill((3, -1), 0.0), ej.ShapeError, ["-1"]),
    case("fill-rank0-with-index-variable", lambda: ej.fill((), "x0"), ej.ShapeError,
         ["'x0'", "rank-0"]),
    case("fill-unknown-name", lambda: ej.fill((3,), "y0 + 1"), ej.ExpressionError, ["'y0'"]),

    # ---- reshape, broadcast, elementwise, matmul
    case("reshape-other-element-count", lambda: t((3, 4)).reshape(5, 3), ej.ShapeError,
         ["(3, 4)", "(5, 3)", "12"]),
    case("reshape-two-minus-one", lambda: ej.reshape(t((3, 4)), (-1, -1)), ej.ShapeError,
         ["(-1, -1)", "-1"]),
    case("reshape-minus-one-does-not-divide", lambda: t((3, 4)).reshape(5, -1), ej.ShapeError,
         ["(5, -1)", "12"]),
    case("reshape-non-int-dim", lambda: t((3, 4)).reshape(6, 2.0), ej.ShapeError, ["2.0"]),
    case("broadcast-incompatible", lambda: t((2, 3)).expand(4, 5), ej.ShapeError,
         ["(2, 3)", "(4, 5)"]),
    case("broadcast-to-lower-rank", lambda: ej.broadcast_to(t((2, 3)), (3,)), ej.ShapeError,
         ["(2, 3)", "(3,)"]),
    case("elementwise-shapes-do-not-broadcast", lambda: t((2, 3)) + t((4,), name="y"),
         ej.ShapeError, ["(2, 3)", "(4,)"]),
    case("elementwise-with-ndarray", lambda: t() + np.ones(3), ej.EinjoinError, ["ndarray"]),
    case("elementwise-with-string", lambda: t() * "2", ej.EinjoinError, ["str"]),
    case("elementwise-without-tensor", lambda: ej.exp(2.0), ej.EinjoinError, ["float"]),
    case("matmul-inner-size-mismatch", lambda: t((2, 3)) @ t((4, 5), name="y"), ej.ShapeError,
         ["(2, 3)", "(4, 5)", "inner sizes 3 and 4"]),
    case("matmul-batch-mismatch", lambda: t((2, 3, 4)) @ t((5, 4, 6), name="y"), ej.ShapeError,
         ["(2, 3, 4)", "(5, 4, 6)"]),
    case("matmul-rank0", lambda: t(()) @ t((3,), name="y"), ej.ShapeError, ["()", "(3,)"]),
    case("matmul-with-int", lambda: t() @ 2, ej.EinjoinError, ["int"]),

    # ---- concat, split, indexing, gather
    case("concat-shape-mismatch", lambda: ej.concat([t((2, 3)), t((2, 4), name="y")], 0),
         ej.ShapeError, ["(2, 4)", "(2, 3)"]),
    case("concat-rank-mismatch", lambda: ej.concat([t((2, 3)), t((2,), name="y")], 1),
         ej.ShapeError, ["(2,)", "(2, 3)"]),
    case("concat-dtype-mismatch", lambda: ej.concat([t(), t(dtype="float64", name="y")], 0),
         ej.DTypeError, ["float64", "float32"]),
    case("concat-axis-out-of-range", lambda: ej.concat([t(), t(name="y")], 2), ej.ShapeError,
         ["axis 2", "rank 2"]),
    case("concat-negative-axis-out-of-range",
         lambda: ej.concat([t(), t(name="y")], -5), ej.ShapeError, ["-5", "rank 2"]),
    case("concat-empty", lambda: ej.concat([]), ej.ShapeError, ["concat"]),
    case("concat-non-tensor", lambda: ej.concat([t(), np.ones((2, 3))]), ej.EinjoinError,
         ["ndarray"]),
    case("split-sizes-do-not-add-up", lambda: ej.split(t((6,)), [2, 3]), ej.ShapeError,
         ["[2, 3]", "6"]),
    case("split-size-zero", lambda: ej.split(t((6,)), 0), ej.ShapeError, ["got 0"]),
    case("split-float-size", lambda: ej.split(t((6,)), 2.5), ej.ShapeError, ["2.5"]),
    case("index-out-of-range", lambda: t((2, 3))[5], ej.ShapeError, ["5", "(2, 3)"]),
    case("index-negative-out-of-range", lambda: t((2, 3))[:, -4], ej.ShapeError,
         ["-4", "(2, 3)"]),
    case("index-too-many", lambda: t((2, 3))[0, 0, 0], ej.ShapeError,
         ["too many indices (3)", "(2, 3)"]),
    case("index-two-ellipses", lambda: t((2, 3))[..., ...], ej.ShapeError, ["'...'"]),
    case("index-float", lambda: t((2, 3))[1.5], ej.UnsupportedOpError, ["1.5"]),
    case("slice-step-float", lambda: t((4, 3))[::1.5], ej.ShapeError, ["slice", "(4, 3)"]),
    case("slice-step-negative", lambda: t((4, 3))[:, ::-1], ej.ShapeError,  # as torch: steps are positive
         ["step -1", "positive"]),
    case("slice-step-0", lambda: t((4, 3))[::0], ej.EinjoinError, ["step 0"]),
    case("split-dim-out-of-range", lambda: ej.split(t((6,)), 2, dim=3), ej.ShapeError,
         ["dimension 3", "(6,)"]),
    case("gather-float-indices", lambda: ej.gather(t((5, 2)), t((3,), name="i")), ej.DTypeError,
         ["int64", "float32"]),
    # a bool index tensor is a mask, as in torch: its result's shape depends on the values
    case("mask-by-getitem", lambda: t((5, 2))[t((5,), "bool", "i")],
         ej.UnsupportedOpError, ["x[mask]", "data-dependent"]),
    case("gather-bool-indices", lambda: ej.gather(t((5, 2)), t((3,), "bool", "i")), ej.DTypeError,
         ["int64", "bool"]),
    case("gather-rank0-table", lambda: ej.gather(t(()), t((3,), "int64", "i")), ej.ShapeError,
         ["gather", "table"]),

    # ---- dims of reductions and layout ops
    case("sum-dim-out-of-range", lambda: t((2, 3)).sum(2), ej.ShapeError,
         ["dimension 2", "(2, 3)"]),
    case("sum-dim-float", lambda: t((2, 3)).sum(1.0), ej.ShapeError, ["1.0"]),
    case("sum-dim-repeated", lambda: t((2, 3)).sum((1, -1)), ej.ShapeError, ["(1, -1)"]),
    case("permute-not-a-permutation", lambda: t((2, 3)).permute(0, 0), ej.ShapeError,
         ["(0, 0)", "(2, 3)"]),
    case("unsqueeze-out-of-range", lambda: t((2, 3)).unsqueeze(4), ej.ShapeError,
         ["unsqueeze(4)", "rank 2"]),
    case("len-of-rank0", lambda: len(t(())), ej.ShapeError, ["rank-0"]),
    case("flatten-start-after-end", lambda: t((2, 3)).flatten(1, 0), ej.ShapeError, ["flatten", "1", "0"]),
    case("gelu-unknown-approximation", lambda: t().gelu("fast"), ej.EinjoinError, ["'fast'"]),
    case("bool-of-tensor", lambda: bool(t()), ej.EinjoinError, ["truth value"]),
    case("if-on-comparison", lambda: 1 if t() > 0 else 0, ej.EinjoinError, ["truth value"]),

    # ---- composites
    case("softmax-dim-out-of-range", lambda: ej.softmax(t((2, 3)), dim=2), ej.ShapeError,
         ["dimension 2", "(2, 3)"]),
    case("softmax-int64", lambda: ej.softmax(t(dtype="int64")), ej.DTypeError,
         ["exp", "int64"]),
    case("softmax-of-list", lambda: ej.softmax([1.0, 2.0]), ej.EinjoinError, ["list"]),
    case("layer-norm-weight-shape", lambda: ej.layer_norm(t((4, 8)), weight=t((5,), name="w")),
         ej.ShapeError, ["weight", "(5,)", "(8,)"]),
    case("layer-norm-normalized-shape-mismatch",
         lambda: ej.layer_norm(t((4, 8)), (5,)), ej.ShapeError, ["(5,)", "(4, 8)"]),
    case("layer-norm-more-dims-than-rank", lambda: ej.layer_norm(t((4, 8)), (2, 4, 8)),
         ej.ShapeError, ["last 3 dims", "(4, 8)"]),
    case("rms-norm-weight-shape", lambda: ej.rms_norm(t((4, 8)), t((5,), name="w")),
         ej.ShapeError, ["(5,)", "(8,)"]),
    case("linear-in-features-mismatch", lambda: ej.linear(t((2, 3)), t((4, 5), name="w")),
         ej.ShapeError, ["(2, 3)", "(4, 5)"]),
    case("linear-bias-mismatch",
         lambda: ej.linear(t((2, 3)), t((4, 3), name="w"), t((3,), name="b")),
         ej.ShapeError, ["(3,)", "(4, 3)"]),
    case("attention-head-dim-mismatch", lambda: attn(k=(2, 4, 6)), ej.ShapeError,
         ["(2, 4, 8)", "(2, 4, 6)"]),
    case("attention-query-heads-not-multiple", lambda: attn((3, 4, 8), (2, 4, 8), (2, 4, 8)),
         ej.ShapeError, ["3 query heads", "2 kv heads"]),
    case("attention-rank1", lambda: attn((8,), (8,), (8,)), ej.ShapeError, ["(8,)"]),
    case("attention-float-mask",
         lambda: ej.attention(t((4, 8), name="q"), t((4, 8), name="k"), t((4, 8), name="v"),
                              mask=t((4, 4), name="m")),
         ej.DTypeError, ["float32", "bool"]),
    case("attention-non-numeric-scale", lambda: attn(scale="abc"), ej.EinjoinError, ["'abc'"]),
    case("rotate-half-odd-dim", lambda: ej.rotate_half(t((2, 3))), ej.ShapeError, ["(2, 3)"]),
    case("rotate-half-rank0", lambda: ej.rotate_half(t(())), ej.ShapeError, ["()"]),
    case("rope-odd-head-dim", lambda: ej.rope(t((4, 5))), ej.ShapeError, ["(4, 5)"]),

    # ---- partitions
    case("partition-empty-block", lambda: ej.Partition.of((8,), [[0, 3, 3, 8]]),
         ej.PartitionError, ["[0, 3, 3, 8]", "[3:3]"]),
    case("partition-direct-empty-block", lambda: ej.Partition(((0, 3, 3, 8),)),
         ej.PartitionError, ["[0, 3, 3, 8]"]),
    case("partition-more-blocks-than-elements", lambda: ej.Partition.from_counts((3,), (5,)),
         ej.PartitionError, ["5 blocks", "size 3"]),
    case("partition-counts-rank-mismatch", lambda: ej.Partition.from_counts((8, 4), (2,)),
         ej.PartitionError, ["(8, 4)", "1 block counts"]),
    case("partition-bounds-past-size", lambda: ej.Partition.of((8,), [[0, 4, 9]]),
         ej.PartitionError, ["[0, 4, 9]", "8"]),
    case("partition-zero-blocks", lambda: ej.Partition.of((8,), [0]), ej.PartitionError,
         ["got 0", "(8,)"]),
    case("partition-bool-count", lambda: ej.Partition.of((8,), [True]), ej.PartitionError,
         ["True"]),
    case("partition-non-int-boundary", lambda: ej.Partition.of((8,), [[0, 2.5, 8]]), ej.PartitionError, ["2.5"]),
    case("partition-counts-not-a-sequence",
         lambda: ej.Partition.from_counts((8,), 2), ej.PartitionError, ["2", "(8,)"]),

    # ---- join-agg specs and decomposition
    case("spec-unknown-label", lambda: ej.JoinAggSpec.for_node(mm().node, {"q": 2}),
         ej.PartitionError, ["'q'", "m, n, k"]),
    case("spec-bad-boundary-list", lambda: ej.JoinAggSpec.for_node(mm().node, {"m": [0, 5, 3, 8]}),
         ej.PartitionError, ["'m'", "[0, 5, 3, 8]"]),
    case("spec-boundary-past-size", lambda: ej.decompose(mm().node, {"k": [0, 3, 7]}),
         ej.PartitionError, ["'k'", "[0, 3, 7]", "6"]),
    case("spec-more-blocks-than-size", lambda: ej.decompose(mm().node, {"n": 5}),
         ej.PartitionError, ["'n'", "5 blocks"]),
    case("spec-float-count", lambda: ej.decompose(mm().node, {"m": 2.0}), ej.PartitionError,
         ["'m'", "2.0"]),
    case("spec-sequence-wrong-length", lambda: ej.decompose(mm().node, [2, 2]),
         ej.PartitionError, ["2 block counts", "mnk"]),
    case("spec-not-a-mapping", lambda: ej.decompose(mm().node, "m2"), ej.PartitionError,
         ["str"]),
    case("spec-built-for-another-node", spec_of_other_matmul, ej.PartitionError, ["'m'", "4"]),
    case("decompose-not-a-node", lambda: ej.decompose("x", {}), ej.EinjoinError, ["str"]),
    case("blocked-spec-unknown-label",
         lambda: ej.execute_blocked(t((4,)).exp(), lambda n: {"q": 2}, x=np.ones(4, np.float32)),
         ej.PartitionError, ["'q'"]),
    case("blocked-specs-not-a-mapping",
         lambda: ej.execute_blocked(t((4,)).exp(), [{"a": 2}], x=np.ones(4, np.float32)), ej.EinjoinError, ["list"]),

    # ---- feeds and graphs at reference time
    case("feed-missing", lambda: ref(t((2,), name="x") + t((2,), name="w"),
                                     x=np.ones(2, np.float32)),
         ej.EinjoinError, ["'w'", "float32[2]"]),
    case("feed-unknown-name", lambda: ref(t((2,)).exp(), x=np.ones(2, np.float32),
                                          z=np.ones(2, np.float32)),
         ej.EinjoinError, ["'z'", "x"]),
    case("feed-wrong-shape", lambda: ref(t((2, 3)).exp(), x=np.ones((3, 2), np.float32)),
         ej.ShapeError, ["'x'", "(2, 3)", "(3, 2)"]),
    case("feed-float-into-int64", lambda: ref(t((3,), "int64") + 1, x=np.ones(3)),
         ej.DTypeError, ["'x'", "int64", "float64"]),
    case("feed-bool-into-float32", lambda: ref(t((3,)).exp(), x=np.ones(3, bool)),
         ej.DTypeError, ["'x'", "float32", "bool"]),
    case("feed-string", lambda: ref(t((3,)).exp(), x="abc"), ej.EinjoinError, ["'x'", "str"]),
    case("feed-object", lambda: ref(t((3,)).exp(), x=object()), ej.EinjoinError,
         ["'x'", "object"]),
    case("feed-ragged-list", lambda: ref(t((2, 2)).exp(), x=[[1.0], [1.0, 2.0]]),
         ej.EinjoinError, ["'x'", "rectangular"]),
    case("feed-too-many-positional",
         lambda: ej.reference(t((2,)).exp(), np.ones(2), np.ones(2)), ej.EinjoinError,
         ["2 positional"]),
    case("feed-by-position-and-name",
         lambda: ej.reference(t((2,)).exp(), np.ones(2, np.float32), x=np.ones(2, np.float32)),
         ej.EinjoinError, ["'x'"]),
    case("reference-output-not-tensor", lambda: ej.reference(np.ones(3)), ej.EinjoinError,
         ["ndarray"]),
    case("graph-two-inputs-same-name", lambda: ej.Graph([t((2,), name="dup"),
                                                        t((3,), name="dup")]),
         ej.EinjoinError, ["'dup'", "float32[2]", "float32[3]"]),
    case("reference-gather-index-out-of-range", lambda: gather_feeds([0, 7, 1]),
         ej.EinjoinError, ["7", "5 rows"]),
    case("reference-gather-negative-index", lambda: gather_feeds([0, -1, 1]), ej.EinjoinError,
         ["-1", "5 rows"]),
    case("blocked-gather-index-out-of-range", lambda: gather_feeds([0, 7, 1], blocked=True),
         ej.EinjoinError, ["7", "5 rows"]),
    case("dtype-none", lambda: ej.input("y", (2,), None), ej.DTypeError, ["None"]),
    case("blocked-spec-for-node-not-in-graph",
         lambda: ej.execute_blocked(t() * 2, {t((5,), name="other"): {"a": 2}}, x=np.ones((2, 3))),
         ej.PartitionError, ["other", "not in the graph"]),
]


# ---------------------------------------------------------------- the test


@pytest.mark.parametrize("build, cls, fragments", CASES)
def test_malformed_input_raises_einjoin_error(build: Callable[[], Any], cls: type,
                                              fragments: list[str]) -> None:
    with pytest.raises(cls) as info:
        build()
    err = info.value
    assert isinstance(err, ej.EinjoinError), f"{type(err).__name__} is not an EinjoinError: {err}"
    # the exact class is one of einjoin's, not an internal IndexError/KeyError/TypeError/...
    assert type(err) in FAMILY, f"{type(err).__module__}.{type(err).__name__}: {err}"
    missing = [f for f in fragments if f not in str(err)]
    assert not missing, f"message {str(err)!r} lacks {missing}"


def test_enough_cases() -> None:
    assert len(CASES) >= 40
    ids = [p.id for p in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"


# ---------------------------------------------------------------- compile() and run() arguments
# (issue 16: a string or float seed failed with a TypeError deep in a run; bad order / callbacks /
# quiet / host_link / cancel / trace values at run() are named before any task runs)


def _small(backend: str = "threads", **kw: Any) -> Any:
    x = ej.input("x", (8, 6))
    w = ej.input("w", (6, 4))
    return ej.compile(ej.softmax(x @ w), devices=2, backend=backend, **kw)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((8, 6)).astype(np.float32),
            "w": rng.standard_normal((6, 4)).astype(np.float32)}


COMPILE_ARGS = [
    pytest.param(dict(seed="1"), ["seed", "str"], id="seed-str"),
    pytest.param(dict(seed=1.5), ["seed", "float"], id="seed-float"),
    pytest.param(dict(seed=None), ["seed", "None"], id="seed-none"),
    pytest.param(dict(order="fastest"), ["order", "'fastest'", "fifo"], id="order-unknown"),
    pytest.param(dict(order=["fifo"]), ["order", "fifo"], id="order-list"),
    pytest.param(dict(quiet="no"), ["quiet", "'no'"], id="quiet-str"),
    pytest.param(dict(host_link=True), ["host_link", "True"], id="host-link-bool"),
    pytest.param(dict(host_link="16e9"), ["host_link", "'16e9'"], id="host-link-str"),
    pytest.param(dict(planner=["auto"]), ["planner", "['auto']"], id="planner-list"),
    pytest.param(dict(backend=["threads"]), ["backend", "['threads']"], id="backend-list"),
    pytest.param(dict(placement={"greedy"}), ["placement", "greedy"], id="placement-set"),
]


@pytest.mark.parametrize("kw, fragments", COMPILE_ARGS)
def test_bad_compile_argument_is_named(kw: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ej.EinjoinError) as info:
        _small(**kw)
    assert type(info.value) in FAMILY, repr(info.value)
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"message {str(info.value)!r} lacks {missing}"


RUN_ARGS = [
    pytest.param(dict(seed="1"), ["seed", "str"], id="seed-str"),
    pytest.param(dict(seed=2.0), ["seed", "float"], id="seed-float"),
    pytest.param(dict(order="fastest"), ["order", "'fastest'", "fifo"], id="order-unknown"),
    pytest.param(dict(order=1), ["order", "1"], id="order-int"),
    pytest.param(dict(callbacks=TaskCount()), ["callbacks", "list"], id="callbacks-single"),
    pytest.param(dict(callbacks=5), ["callbacks", "int"], id="callbacks-int"),
    pytest.param(dict(callbacks=[print]), ["callbacks[0]", "on_start"], id="callbacks-function"),
    pytest.param(dict(quiet="yes"), ["quiet", "'yes'"], id="quiet-str"),
    pytest.param(dict(host_link=0), ["host_link", "0"], id="host-link-zero"),
    pytest.param(dict(host_link=-5.0), ["host_link", "-5.0"], id="host-link-negative"),
    pytest.param(dict(host_link=True), ["host_link", "True"], id="host-link-bool"),
    pytest.param(dict(host_link="fast"), ["host_link", "'fast'"], id="host-link-str"),
    pytest.param(dict(cancel="now"), ["cancel", "CancelToken"], id="cancel-not-a-token"),
    pytest.param(dict(trace=3), ["trace=", "int"], id="trace-int"),
]


@pytest.mark.parametrize("backend", ["threads", "sync"])
@pytest.mark.parametrize("kw, fragments", RUN_ARGS)
def test_bad_run_argument_is_named_before_any_task(kw: dict[str, Any], fragments: list[str],
                                                   backend: str) -> None:
    prog = _small(backend)
    count = TaskCount()
    kw = dict(kw)  # the parameter is shared by both backends' cases
    cbs = kw.pop("callbacks", [count])
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(**_feeds(), callbacks=cbs, **kw)
    assert type(info.value) in FAMILY, repr(info.value)
    missing = [f for f in fragments if f not in str(info.value)]
    assert not missing, f"message {str(info.value)!r} lacks {missing}"
    assert count.n == 0 and prog.run_stats is None, "tasks ran before the argument was checked"
    out = prog.run(**_feeds())  # the program is untouched
    np.testing.assert_allclose(out, prog.run_reference(**_feeds()), rtol=1e-5, atol=1e-6)


def test_numpy_integer_seed_is_a_seed() -> None:
    prog = _small(seed=np.int64(3))
    out = prog.run(**_feeds(), seed=np.int32(5), order="random")
    np.testing.assert_allclose(out, prog.run_reference(**_feeds()), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- outputs into missing folders


def test_trace_into_a_missing_folder_creates_it(tmp_path: Any) -> None:
    prog = _small()
    path = tmp_path / "no" / "such" / "dir" / "run.json"
    out = prog.run(**_feeds(), trace=path)
    np.testing.assert_allclose(out, prog.run_reference(**_feeds()), rtol=1e-5, atol=1e-6)
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(prog.taskgraph)


@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_trace_path_that_cannot_be_written_fails_before_running(tmp_path: Any, where: str) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    path = blocker / "run.json" if where == "under-a-file" else tmp_path
    prog = _small()
    count = TaskCount()
    with pytest.raises(ej.EinjoinError) as info:
        prog.run(**_feeds(), trace=path, callbacks=[count])
    assert "trace=" in str(info.value) and str(path) in str(info.value), str(info.value)
    assert count.n == 0, "the run started although its trace could not be written"


def test_save_plan_png_into_a_missing_folder_creates_it(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    prog = _small()
    path = prog.save_plan_png(tmp_path / "plans" / "today" / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_plan_png_refuses_an_unwritable_path_and_bad_options(tmp_path: Any) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    prog = _small()
    with pytest.raises(ej.EinjoinError, match="save_plan_png path"):
        prog.save_plan_png(blocker / "plan.png")
    with pytest.raises(ej.EinjoinError, match="max_panels"):
        prog.save_plan_png(tmp_path / "p.png", max_panels=0)
    with pytest.raises(ej.EinjoinError, match="dpi"):
        prog.save_plan_png(tmp_path / "p.png", dpi="high")


# ---------------------------------------------------------------- Ctrl-C


class _Interrupt(TaskCount):
    """Raises KeyboardInterrupt (what Ctrl-C raises) at the ``at``-th task."""

    def __init__(self, at: int = 3) -> None:
        super().__init__()
        self.at = at

    def on_start(self, task: Any) -> None:
        super().on_start(task)
        if self.n == self.at:
            raise KeyboardInterrupt


def _only_idle_workers_left(prog: Any, before: int) -> None:
    """After an interrupted run the only threads left are the program's own idle worker threads
    (einjoin.runtime.workers: reused by the next run), which ``prog.close()`` ends."""
    extra = threading.enumerate()[before:]
    assert all(t.daemon and t.name.startswith("einjoin-dev") for t in extra), extra
    prog.close()
    assert threading.active_count() == before, threading.enumerate()


@pytest.mark.parametrize("backend", ["sync", "threads"])
def test_ctrl_c_is_a_plain_keyboard_interrupt_and_the_program_stays_usable(backend: str) -> None:
    prog = _small(backend)
    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt) as info:
        prog.run(**_feeds(), callbacks=[_Interrupt()])
    assert type(info.value) is KeyboardInterrupt  # not wrapped in an EinjoinError
    _only_idle_workers_left(prog, before)
    np.testing.assert_allclose(prog.run(**_feeds()), prog.run_reference(**_feeds()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["sync", "threads"])
def test_real_sigint_mid_run_is_a_plain_keyboard_interrupt(backend: str) -> None:
    """A real SIGINT (what Ctrl-C sends), raised by a task's callback: Python's handler raises
    KeyboardInterrupt in the main thread — inside the inline worker (sync) or in the loop that
    joins the device threads (threads). Either way it comes out unwrapped, and nothing hangs."""
    import signal
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is handled by something else in this process")

    class Sigint(TaskCount):
        def on_start(self, task: Any) -> None:
            super().on_start(task)
            if self.n == 2:
                signal.raise_signal(signal.SIGINT)

    prog = _small(backend)
    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt) as info:
        prog.run(**_feeds(), callbacks=[Sigint()])
    assert type(info.value) is KeyboardInterrupt
    _only_idle_workers_left(prog, before)
    np.testing.assert_allclose(prog.run(**_feeds()), prog.run_reference(**_feeds()), rtol=1e-5, atol=1e-6)


def test_a_feed_the_outputs_do_not_read_is_told_from_a_typo() -> None:
    # a gradient need not read its own weight: d(x @ w)/dw reads x only
    x = ej.input("x", (4, 3), "float64")
    w = ej.input("w", (3, 2), "float64")
    (dw,) = ej.grad((x @ w).sum(), [w])
    feeds = dict(x=np.ones((4, 3)), w=np.ones((3, 2)))
    with pytest.raises(ej.EinjoinError, match=r"input 'w' is not read by these outputs .*inputs are x"):
        ej.reference(dw, **feeds)
    with pytest.raises(ej.EinjoinError, match=r"input 'w' is not read"):
        ej.compile(dw, devices=2, quiet=True).run(**feeds)
    with pytest.raises(ej.EinjoinError, match=r"unknown input 'wq'; the graph's inputs are x"):
        ej.reference(dw, x=feeds["x"], wq=feeds["w"])
    np.testing.assert_allclose(ej.reference(dw, x=feeds["x"]), np.full((3, 2), 4.0))
