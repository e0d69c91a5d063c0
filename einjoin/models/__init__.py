"""Built-in models: graphs written with the frontend (the torch zoo comes with torch import)."""

from einjoin.models.graphs import MODELS, build

__all__ = ["MODELS", "build"]
