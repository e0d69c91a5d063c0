"""Exchange programs: point-to-point select / move / touch between producer and consumer blocks,
and the task vocabulary (:mod:`einjoin.exchange.tasks`) every later floor builds on."""

from einjoin.exchange.synthesis import Request, synthesize
from einjoin.exchange.tasks import RELEASES, TASK_KINDS, Task, TaskGraphBuilder, Value

__all__ = ["RELEASES", "TASK_KINDS", "Task", "TaskGraphBuilder", "Value", "Request", "synthesize"]
