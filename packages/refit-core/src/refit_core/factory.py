"""``create_weight_synchronizer``: pick and build the synchronizer of a deployment."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from refit_core.deadline import checked_timeout_s
from refit_core.registry import InstalledRow, find_row, load_builder, load_options_type
from refit_core.request import SynchronizerRequest

if TYPE_CHECKING:
    from refit_core.synchronizer import WeightSynchronizer

__all__ = ["create_weight_synchronizer"]

logger = logging.getLogger(__name__)


def _check_positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_cluster(name: str, cluster: object, methods: tuple[str, ...], key: str) -> None:
    """A cluster the row calls must have every method it calls."""
    if not methods:
        return
    needed = ", ".join(f"{m}()" for m in methods)
    if cluster is None:
        raise ValueError(f"{key} needs {name} (an object with {needed})")
    missing = [m for m in methods if not callable(getattr(cluster, m, None))]
    if missing:
        raise ValueError(
            f"{key} needs {name} with {needed}; {type(cluster).__name__} lacks "
            + ", ".join(f"{m}()" for m in missing)
        )


def _check_options(options: object, installed: InstalledRow) -> None:
    row = installed.row
    if options is None:
        return
    kind = load_options_type(installed)
    if kind is None:
        raise ValueError(
            f"{row.key} takes no options; got {type(options).__name__} (options are typed per "
            "row: `refit backends` shows each row's)"
        )
    if not isinstance(options, kind):
        raise ValueError(
            f"options of {row.key} must be {kind.__name__} (from {kind.__module__}), "
            f"got {type(options).__name__}"
        )


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
    options: object = None,
) -> WeightSynchronizer:
    """Build the :class:`WeightSynchronizer` for one deployment; sizes in GiB, times in seconds.

    The scalar arguments, then the backend name, topology and transport, then the clusters and
    options are checked before ``policy`` or ``generation`` are looked at.

    Args:
        policy: the trainer side (what the row reads weights from).
        generation: the engine side.
        generation_backend: ``"vllm"``, ``"sglang"``, ``"megatron"``, ``"dynamo"``, or a
            backend an installed package registers (``refit backends`` lists them).
        colocated: whether trainer and engines share GPUs.
        train_cluster: needed only by rows that call it (``refit backends`` says which and
            what for): the collective rows call ``get_master_address_and_port()`` alone.
        inference_cluster: needed only by rows that call it (no row of refit's does).
        refit_buffer_size_gb: bucket or payload size in GiB (2**30 bytes); None: the row's
            default.
        refit_timeout_s: deadline of one refit in seconds; None disarms it.
        transport: the row's transport; None picks the backend's default for the topology.
        options: the row's own options (``ZmqSparseOptions``, ``CollectiveOptions``,
            ``IpcOptions``, ...); their type must be the one the row declares.

    Raises:
        InvalidTimeoutError: ``refit_timeout_s`` is not None or a positive finite number.
        ValueError: unknown backend or transport, a non-positive size, a cluster the row
            needs that is missing or lacks a method, or options of another row.
        NotImplementedError: an unsupported combination (colocated dynamo), or a row its
            installed package does not implement yet.
        BackendNotInstalledError: the row's package is missing; the message says what to install.
    """
    if not isinstance(colocated, bool):
        raise ValueError(f"colocated must be a bool, got {type(colocated).__name__}")
    _check_positive("refit_buffer_size_gb", refit_buffer_size_gb)
    refit_timeout_s = checked_timeout_s("refit_timeout_s", refit_timeout_s)
    installed = find_row(generation_backend, colocated, transport)
    row = installed.row
    _check_cluster("train_cluster", train_cluster, row.train_cluster, row.key)
    _check_cluster("inference_cluster", inference_cluster, row.inference_cluster, row.key)
    _check_options(options, installed)
    builder = load_builder(installed)
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
        options=options,
    )
    logger.info(
        "building %s synchronizer (%s %s)", row.key, installed.distribution, installed.version
    )
    return builder(request)
