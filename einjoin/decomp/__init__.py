"""Decomposition: partitions, join-agg specs, (op, spec) -> block kernels, tensor relations, and
the single-process blocked executor. Built from shapes alone; arrays appear only in relations."""

from einjoin.decomp.blocked import execute_blocked
from einjoin.decomp.decompose import Decomposition, Kernel, decompose
from einjoin.decomp.partition import BlockKey, Partition
from einjoin.decomp.relation import TensorRelation
from einjoin.decomp.spec import JoinAggSpec, aggregated_labels, label_sizes

__all__ = ["execute_blocked", "Decomposition", "Kernel", "decompose", "BlockKey", "Partition",
           "TensorRelation", "JoinAggSpec", "aggregated_labels", "label_sizes"]
