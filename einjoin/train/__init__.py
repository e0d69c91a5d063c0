"""Training as graphs: optimizer steps and gradient clipping built as EinSums (``ej.optim``).
It builds IR only; the Trainer that compiles and runs a step is ``einjoin.trainer``."""

from einjoin.train import optim

__all__ = ["optim"]
