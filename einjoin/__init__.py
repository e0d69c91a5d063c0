"""einjoin: tensor programs as join-aggregations over blocks, planned and run across devices.

>>> import numpy as np, einjoin as ej
>>> x = ej.input("x", (4, 8)); w = ej.input("w", (8, 3))
>>> y = ej.softmax(x @ w)
>>> out = ej.reference(y, x=np.ones((4, 8), np.float32), w=np.ones((8, 3), np.float32))
>>> out.shape, round(float(out.sum()), 4)
((4, 3), 4.0)
"""

from einjoin.autodiff import grad, stop_gradient, value_and_grad, vjp
from einjoin.cluster import Cluster, Device, local
from einjoin.decomp import (Decomposition, JoinAggSpec, Kernel, Partition, TensorRelation,
                            decompose, execute_blocked)
from einjoin.errors import (DTypeError, EinjoinError, EinsumSyntaxError, ExpressionError,
                            PartitionError, ShapeError, UnsupportedOpError)
from einjoin.frontend import *  # noqa: F401,F403
from einjoin.frontend import __all__ as _frontend_all
from einjoin.ir import Graph, Node
from einjoin.ir.reference import reference
from einjoin.program import Program, compile, load
from einjoin.runtime.engine import CancelToken, RunHandle
from einjoin.runtime.simulate_calibrate import calibrate
from einjoin.runtime.backends.ray import ray_cluster
from einjoin.train import optim
from einjoin.frontend.losses import cross_entropy, mse_loss, nll_loss
from einjoin.trainer import Trainer
from einjoin.generate import generate
from einjoin.frontend.conv import adaptive_avg_pool, adaptive_max_pool, avg_pool, conv, conv_transpose, max_pool, unfold
from einjoin.frontend.sorting import argsort, sort, topk
# `ej.sparse` is the constructor; its package's modules are imported as `from einjoin.sparse import ...`
from einjoin.sparse import SparseInput, SparsePlan, SparseTensor, sparse, sparse_compile, sparse_input

__version__ = "0.1.0"

__all__ = ["Cluster", "Device", "local", "calibrate", "ray_cluster", "Program", "compile", "load", "CancelToken",
           "RunHandle",
           "Decomposition", "JoinAggSpec", "Kernel", "Partition", "TensorRelation", "decompose",
           "execute_blocked", "DTypeError", "EinjoinError", "EinsumSyntaxError", "ExpressionError",
           "PartitionError", "ShapeError", "UnsupportedOpError", "Graph", "Node", "reference",
           "grad", "value_and_grad", "vjp", "stop_gradient", "optim", "Trainer", "cross_entropy", "nll_loss",
           "mse_loss", "generate", *_frontend_all,
           "conv", "conv_transpose", "max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool", "unfold",
           "topk", "sort", "argsort", "sparse", "SparseTensor", "SparsePlan", "sparse_compile",
           "sparse_input", "SparseInput"]
