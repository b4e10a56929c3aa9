"""refit-toy: a backend outside refit that copies a dict of bytes into a toy engine."""

from refit_toy.synchronizer import ToyEngine, ToyOptions, ToyPolicy, ToySynchronizer

__all__ = ["ToyEngine", "ToyOptions", "ToyPolicy", "ToySynchronizer"]
