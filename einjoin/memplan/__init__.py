"""Memory planning: run a task graph under a per-device memory cap by evicting blocks to the
host store and reloading them (TURNIP-style), so that any ready order stays within the cap."""

from einjoin.memplan.needs import MemoryCapError, kernel_scratch, parse_caps, task_needs
from einjoin.memplan.planner import POLICIES, MemoryPlan, plan_memory

__all__ = ["MemoryCapError", "MemoryPlan", "POLICIES", "kernel_scratch", "parse_caps", "plan_memory",
           "task_needs"]
