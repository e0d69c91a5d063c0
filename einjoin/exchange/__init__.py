"""Exchange programs: point-to-point select / move / touch between producer and consumer blocks,
and the task vocabulary (:mod:`einjoin.exchange.tasks`) every later floor builds on."""

from einjoin.exchange.synthesis import Request, synthesize
from einjoin.exchange.tasks import (PAYLOADS, TASK_KINDS, Block, Kernel, Move, Payload, Reduce, Release, Reload,
                                    Select, Task, TaskGraphBuilder, TaskKind, Touch, Value)

__all__ = ["TASK_KINDS", "PAYLOADS", "Task", "TaskKind", "TaskGraphBuilder", "Value", "Request", "synthesize",
           "Payload", "Block", "Kernel", "Reduce", "Select", "Move", "Touch", "Release", "Reload"]
