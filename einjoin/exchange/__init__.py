"""Exchange programs: point-to-point select / move / touch between producer and consumer blocks."""

from einjoin.exchange.program import (RELEASES, TASK_KINDS, Box, Task, TaskGraphBuilder, Value, box_shape,
                                      box_size, intersect, relative)
from einjoin.exchange.synthesis import Request, synthesize

__all__ = ["RELEASES", "TASK_KINDS", "Box", "Task", "TaskGraphBuilder", "Value", "box_shape", "box_size",
           "intersect", "relative", "Request", "synthesize"]
