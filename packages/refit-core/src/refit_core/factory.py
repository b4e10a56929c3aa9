"""``create_weight_synchronizer``: pick and build the synchronizer of a deployment."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from refit_core.registry import SynchronizerRequest, find_row, load_builder

if TYPE_CHECKING:
    from refit_core.synchronizer import WeightSynchronizer

__all__ = ["create_weight_synchronizer"]

logger = logging.getLogger(__name__)

_CLUSTER_OPTIONAL = frozenset({"sglang"})
"""Backends whose non-colocated row works without clusters (SGLang engines join by address)."""


def _check_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def create_weight_synchronizer(
    policy: Any,
    generation: Any,
    generation_backend: str,
    colocated: bool,
    train_cluster: Any = None,
    inference_cluster: Any = None,
    refit_buffer_size_gb: float | None = None,
    refit_timeout_s: float | None = None,
    *,
    transport: str | None = None,
) -> WeightSynchronizer:
    """Build the :class:`WeightSynchronizer` for one deployment.

    The backend name, topology, transport and scalar arguments are checked before ``policy``
    or ``generation`` are looked at.

    Raises:
        ValueError: unknown backend or transport, a non-positive size or timeout, or a
            non-colocated deployment without both clusters (SGLang excepted).
        NotImplementedError: an unsupported combination (colocated dynamo), or a row its
            installed package does not implement yet.
        BackendNotInstalledError: the row's package is missing; the message says what to install.
    """
    if not isinstance(colocated, bool):
        raise ValueError(f"colocated must be a bool, got {type(colocated).__name__}")
    row = find_row(generation_backend, colocated, transport)
    _check_positive("refit_buffer_size_gb", refit_buffer_size_gb)
    _check_positive("refit_timeout_s", refit_timeout_s)
    needs_clusters = not colocated and generation_backend not in _CLUSTER_OPTIONAL
    if needs_clusters and (train_cluster is None or inference_cluster is None):
        raise ValueError(
            f"{row.key} needs both train_cluster and inference_cluster for a non-colocated refit"
        )
    builder = load_builder(row)
    request = SynchronizerRequest(
        policy=policy,
        generation=generation,
        generation_backend=generation_backend,
        colocated=colocated,
        transport=row.transport,
        train_cluster=train_cluster,
        inference_cluster=inference_cluster,
        refit_buffer_size_gb=refit_buffer_size_gb,
        refit_timeout_s=refit_timeout_s,
    )
    logger.info("building %s synchronizer", row.key)
    return builder(request)
