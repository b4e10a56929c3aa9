"""refit-sglang: flattened tensor buckets and the SGLang synchronizers."""

from refit_sglang.buckets import FlattenedBucket, TensorSlot, iter_buckets
from refit_sglang.builder import build_colocated_synchronizer, build_disaggregated_synchronizer
from refit_sglang.client import HttpClient, SGLangClient, UnsupportedEngineError
from refit_sglang.clients import clients_for
from refit_sglang.colocated import ColocatedOptions, ColocatedSGLangSynchronizer
from refit_sglang.disaggregated import SGLangCollectiveSynchronizer
from refit_sglang.engine_client import EngineClient
from refit_sglang.handles import SharedBuffers, serialize_bucket
from refit_sglang.lifecycle import PauseMode, check_pause_mode
from refit_sglang.participants import EngineSettings, SGLangRankParticipant
from refit_sglang.plan import DistributedPlan
from refit_sglang.protocol import SGLANG_COMMIT, RequestSchemaError, validate_request
from refit_sglang.rank import TrainerRank
from refit_sglang.ray_gather import RayTrainerRanks
from refit_sglang.sources import BucketSource, LocalBuckets, Payload
from refit_sglang.trainer import SGLangPeerTrainer

__version__ = "0.1.0"

__all__ = [
    "SGLANG_COMMIT",
    "BucketSource",
    "ColocatedOptions",
    "ColocatedSGLangSynchronizer",
    "DistributedPlan",
    "EngineClient",
    "EngineSettings",
    "FlattenedBucket",
    "HttpClient",
    "LocalBuckets",
    "PauseMode",
    "Payload",
    "RayTrainerRanks",
    "RequestSchemaError",
    "SGLangClient",
    "SGLangCollectiveSynchronizer",
    "SGLangPeerTrainer",
    "SGLangRankParticipant",
    "SharedBuffers",
    "TensorSlot",
    "TrainerRank",
    "UnsupportedEngineError",
    "__version__",
    "build_colocated_synchronizer",
    "build_disaggregated_synchronizer",
    "check_pause_mode",
    "clients_for",
    "iter_buckets",
    "serialize_bucket",
    "validate_request",
]
