"""refit-toy: a backend outside refit that copies a dict of bytes into a toy engine.

refit-core imports this package whenever it reads the rows of ``refit_toy.rows`` (``refit
backends``, every ``create_weight_synchronizer``), so it stays light: its names import on
first use.
"""

from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
    from refit_toy.synchronizer import ToyEngine, ToyOptions, ToyPolicy, ToySynchronizer
else:
    __getattr__ = lazy_facade(__name__, ["refit_toy.synchronizer"])

__all__ = ["ToyEngine", "ToyOptions", "ToyPolicy", "ToySynchronizer"]
