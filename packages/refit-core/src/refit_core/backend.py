"""refit-core's interface for backend and transport authors.

What a package that implements rows (or a subcommand) may use from core besides the user API
of :mod:`refit_core`: how a row is declared and what its builder receives, the participant
handles a controller drives, the structural types of the objects users hand in, deadlines and
future helpers, and the plumbing shared by sources and receivers. Everything else in
``refit_core`` is internal and may change in any release. A guide for backend authors is in
refit-core's README.
"""

from refit_core.checkpoint import checkpoint_specs
from refit_core.deadline import Deadline, checked_timeout_s, probe_timeout_s
from refit_core.engine_hooks import notify
from refit_core.errors import refit_error_type, with_engines
from refit_core.facade import lazy_facade
from refit_core.futures import InFlight, done, failed, in_thread, then
from refit_core.options import check_field_types
from refit_core.participants import (
    ActorParticipant,
    Gathered,
    LocalParticipant,
    Participant,
    gather,
    method_name,
    role_methods,
    root_cause,
)
from refit_core.protocols import ClusterLike, GenerationLike, PolicyLike, RendezvousCluster
from refit_core.registry import SynchronizerBuilder
from refit_core.request import SynchronizerRequest
from refit_core.rows import ENTRY_POINT_GROUP, BackendRow, Topology
from refit_core.sources.cast import ENGINE_DTYPES, cast_once
from refit_core.sources.plan import (
    Unit,
    build_plan,
    fingerprint,
    materialize,
    pack_buckets,
    plan_info,
)
from refit_core.text import align_columns
from refit_core.types import (
    MIN_BUFFER_BYTES,
    CollectiveSenderSpec,
    checked_buffer_size,
    dtype_name,
)

__all__ = [
    "ENGINE_DTYPES",
    "ENTRY_POINT_GROUP",
    "MIN_BUFFER_BYTES",
    "ActorParticipant",
    "BackendRow",
    "ClusterLike",
    "CollectiveSenderSpec",
    "Deadline",
    "Gathered",
    "GenerationLike",
    "InFlight",
    "LocalParticipant",
    "Participant",
    "PolicyLike",
    "RendezvousCluster",
    "SynchronizerBuilder",
    "SynchronizerRequest",
    "Topology",
    "Unit",
    "align_columns",
    "build_plan",
    "cast_once",
    "check_field_types",
    "checked_buffer_size",
    "checked_timeout_s",
    "checkpoint_specs",
    "done",
    "dtype_name",
    "failed",
    "fingerprint",
    "gather",
    "in_thread",
    "lazy_facade",
    "materialize",
    "method_name",
    "notify",
    "pack_buckets",
    "plan_info",
    "probe_timeout_s",
    "refit_error_type",
    "role_methods",
    "root_cause",
    "then",
    "with_engines",
]
