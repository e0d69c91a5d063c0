"""Plans: the task graph (plain data from shapes alone), its accounting and explanation, what
each task computes, and the reference executor."""

from einjoin.plan.execute import assemble_outputs, compute, run_reference
from einjoin.plan.stats import OpBytes, PlanStats, bytes_per_op, compute_stats, explain, human_bytes
from einjoin.plan.taskgraph import OutputLayout, TaskGraph, build_taskgraph, kernel_flops

__all__ = ["assemble_outputs", "compute", "run_reference", "PlanStats", "OpBytes", "bytes_per_op",
           "compute_stats", "explain",
           "human_bytes", "OutputLayout", "TaskGraph", "build_taskgraph", "kernel_flops"]
