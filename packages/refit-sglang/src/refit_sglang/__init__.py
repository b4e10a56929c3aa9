"""refit-sglang: the SGLang synchronizers (colocated Ray-IPC and disaggregated NCCL).

This module is the user API: the synchronizers, their options, the engine clients and the
trainer-side sources a deployment hands to ``create_weight_synchronizer``. The names import
torch on first use, so ``import refit_sglang`` (and reading its rows) stays light.
"""

from importlib import metadata
from typing import TYPE_CHECKING

from refit_core.backend import lazy_facade

if TYPE_CHECKING:
    from refit_sglang.client import HttpClient, SGLangClient, UnsupportedEngineError
    from refit_sglang.colocated import ColocatedOptions, ColocatedSGLangSynchronizer
    from refit_sglang.disaggregated import SGLangCollectiveSynchronizer
    from refit_sglang.engine_client import EngineClient
    from refit_sglang.lifecycle import PauseMode
    from refit_sglang.rank import TrainerRank
    from refit_sglang.ray_gather import RayTrainerRanks
    from refit_sglang.sources import BucketSource
else:
    __getattr__ = lazy_facade(
        __name__,
        (
            "refit_sglang.client",
            "refit_sglang.colocated",
            "refit_sglang.disaggregated",
            "refit_sglang.engine_client",
            "refit_sglang.lifecycle",
            "refit_sglang.rank",
            "refit_sglang.ray_gather",
            "refit_sglang.sources",
        ),
    )

__version__ = metadata.version("refit-sglang")

__all__ = [
    "BucketSource",
    "ColocatedOptions",
    "ColocatedSGLangSynchronizer",
    "EngineClient",
    "HttpClient",
    "PauseMode",
    "RayTrainerRanks",
    "SGLangClient",
    "SGLangCollectiveSynchronizer",
    "TrainerRank",
    "UnsupportedEngineError",
    "__version__",
]
