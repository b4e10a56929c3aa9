"""The generation side of a collective refit into a Dynamo fleet of vLLM workers.

The trainer broadcasts packed buckets over its collective; this channel drives each worker's
side over its admin HTTP routes: join the group, then per refit start / update / finish, and
afterwards flush the caches. :meth:`~DynamoRefitChannel.init_collective` and
:meth:`~DynamoRefitChannel.update_weights` block until the collective makes progress, so they
run as Ray tasks, one per worker, while the trainer broadcasts (the factory row runs the same
transactions on threads instead, see :mod:`refit_dynamo.participants`).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from refit_core import StateDictInfo
from refit_core.backend import CollectiveSenderSpec
from refit_dynamo.admin import AdminClient
from refit_dynamo.endpoint import DynamoWorkerEndpoint
from refit_dynamo.errors import FleetChangedError
from refit_dynamo.flush import flush_fleet
from refit_dynamo.geometry import vllm_sender_spec
from refit_dynamo.protocol import init_payload, update_info
from refit_dynamo.remote import submit
from refit_dynamo.transactions import join_worker, update_worker

if TYPE_CHECKING:
    import ray

    from refit_nccl.backend import DeviceType

__all__ = ["DynamoRefitChannel", "WorkerValidator"]

logger = logging.getLogger(__name__)

WorkerValidator = Callable[[], Sequence[DynamoWorkerEndpoint]]
"""Returns the fleet as discovery sees it now."""


class DynamoRefitChannel:
    """Drives the refit of a fixed fleet of Dynamo workers over their admin routes.

    Args:
        workers: the fleet, in rank order; instance ids must be unique.
        engine_world_size: ranks each worker contributes to the group (its TP x PP size).
        control_timeout_s: timeout of every admin call (an update call lasts as long as the
            worker's receive, so it must cover one transfer).
        validate_workers: optional callable returning the fleet as discovery sees it now;
            :meth:`init_collective` refuses to start when it differs from ``workers``.
        device: where the workers receive: ``"cuda"`` for vLLM's NCCL weight transfer (the
            synchronizer row then hosts vLLM's own NCCL data plane, which needs vLLM on the
            trainer), ``"cpu"`` for a gloo receiver. The workers' report in the row's choice
            of backend.
    """

    def __init__(
        self,
        workers: Sequence[DynamoWorkerEndpoint],
        *,
        engine_world_size: int,
        control_timeout_s: float,
        validate_workers: WorkerValidator | None = None,
        device: DeviceType = "cuda",
    ) -> None:
        self._workers = tuple(workers)
        if not self._workers:
            raise ValueError("a Dynamo refit channel needs at least one worker")
        if not all(isinstance(w, DynamoWorkerEndpoint) for w in self._workers):
            raise ValueError("workers must be DynamoWorkerEndpoint instances")
        ids = [w.instance_id for w in self._workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker instance ids must be unique, got {ids}")
        if isinstance(engine_world_size, bool) or not isinstance(engine_world_size, int):
            raise ValueError(f"engine_world_size must be an int, got {engine_world_size!r}")
        if engine_world_size < 1:
            raise ValueError(f"engine_world_size must be >= 1, got {engine_world_size}")
        if not math.isfinite(control_timeout_s) or control_timeout_s <= 0:
            raise ValueError(f"control_timeout_s must be > 0 and finite, got {control_timeout_s!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self._device: DeviceType = device
        self._engine_world_size = engine_world_size
        self._control_timeout_s = float(control_timeout_s)
        self._validate_workers = validate_workers
        self._sender_spec = vllm_sender_spec()
        self._update_info: dict[str, Any] | None = None
        self._client = AdminClient(self._control_timeout_s)

    # -- description -------------------------------------------------------------------

    @property
    def workers(self) -> tuple[DynamoWorkerEndpoint, ...]:
        """The fleet, in rank order."""
        return self._workers

    @property
    def device(self) -> DeviceType:
        """Where the workers receive (``cuda``: vLLM's NCCL data plane)."""
        return self._device

    @property
    def engine_world_size(self) -> int:
        """Ranks per worker."""
        return self._engine_world_size

    @property
    def control_timeout_s(self) -> float:
        """Timeout of every admin call."""
        return self._control_timeout_s

    @property
    def inference_world_size(self) -> int:
        """Ranks the fleet contributes to the group: workers x engine_world_size."""
        return len(self._workers) * self._engine_world_size

    @property
    def sender_spec(self) -> CollectiveSenderSpec:
        """vLLM's packed geometry (peer ``"vllm"``, 1 GiB x 2) the trainer must send with."""
        return self._sender_spec

    @property
    def update_info(self) -> Mapping[str, Any] | None:
        """The update info :meth:`prepare` built (read-only), or None before it."""
        return None if self._update_info is None else MappingProxyType(self._update_info)

    def rank_offset(self, index: int, train_world_size: int) -> int:
        """First group rank of worker ``index``: trainers come first, then each worker."""
        if not 0 <= index < len(self._workers):
            raise ValueError(f"worker index {index} is not in a fleet of {len(self._workers)}")
        return train_world_size + index * self._engine_world_size

    # -- refit -------------------------------------------------------------------------

    def prepare(self, state_dict_info: StateDictInfo, *, vllm_nccl: bool = False) -> None:
        """Build the update info (names, dtype names, shapes) of later refits.

        Args:
            state_dict_info: the state, in transfer order.
            vllm_nccl: build it with the trainer's vLLM (workers on vLLM's NCCL data plane,
                :func:`~refit_dynamo.protocol.update_info`).
        """
        geometry = self._sender_spec if vllm_nccl else None
        self._update_info = update_info(state_dict_info, vllm_nccl=geometry)
        logger.debug("prepared update info for %d tensors", len(state_dict_info))

    def client_copy(self) -> DynamoRefitChannel:
        """An endpoint-only copy (no validation callback, no open connections) to pickle into
        a Ray task or actor; it keeps the prepared update info."""
        clone = copy.copy(self)  # through __getstate__: the clone opens its own connections
        clone._validate_workers = None
        return clone

    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[ray.ObjectRef[str]]:
        """Ask every worker to join the trainer's group at ``ip:port``; one ref per worker.

        Each ref resolves to the worker's instance id once it joined (or raises its
        :class:`DynamoWorkerError`); the trainer ranks must join concurrently.

        Raises:
            ValueError: ``world_size`` is not ``train_world_size + inference_world_size``.
            FleetChangedError: ``validate_workers`` sees another fleet.
        """
        if train_world_size < 1:
            raise ValueError(f"train_world_size must be >= 1, got {train_world_size}")
        if world_size != train_world_size + self.inference_world_size:
            raise ValueError(
                f"world_size {world_size} != train_world_size {train_world_size} + "
                f"{len(self._workers)} workers x engine_world_size {self._engine_world_size}"
            )
        self.check_membership()
        refs = []
        for index in range(len(self._workers)):
            offset = self.rank_offset(index, train_world_size)
            refs.append(
                submit(
                    join_worker,
                    self._client,
                    self._workers[index],
                    init_payload(ip, port, offset, world_size, self._sender_spec),
                )
            )
        logger.info("asked %d Dynamo workers to join %s:%d", len(refs), ip, port)
        return refs

    def update_weights(self, *, weight_version: int | None = None) -> list[ray.ObjectRef[str]]:
        """Run start / update / finish on every worker concurrently; one ref per worker.

        Each ref resolves to the worker's instance id once it finished (or raises the
        :class:`DynamoWorkerError` of the first failed step; later steps are not sent, so a
        worker never commits a partial update). The trainer broadcasts meanwhile.
        ``weight_version``, if given, is declared to Dynamo with the finish call.

        Raises:
            RuntimeError: :meth:`prepare` was not called.
        """
        if self._update_info is None:
            raise RuntimeError("call prepare(state_dict_info) before update_weights()")
        info = dict(self._update_info)
        return [submit(update_worker, self._client, w, info, weight_version) for w in self._workers]

    def flush_cache(self) -> bool:
        """Pause every worker (wait, clear cache) in parallel, resume those that paused.

        Returns True; raises :class:`DynamoFleetError` naming every failed worker.
        """
        flush_fleet(self._client, self._workers)
        return True

    def close(self) -> None:
        """Close pooled connections."""
        self._client.close()

    # -- helpers -----------------------------------------------------------------------

    @property
    def admin(self) -> AdminClient:
        """The pooled admin client of this copy."""
        return self._client

    def check_membership(self) -> None:
        """Raise :class:`FleetChangedError` if ``validate_workers`` sees another fleet."""
        if self._validate_workers is None:
            return
        current = {w.instance_id: w for w in self._validate_workers()}
        mine = {w.instance_id: w for w in self._workers}
        added = sorted(k for k in current.keys() - mine.keys())
        removed = sorted(k for k in mine.keys() - current.keys())
        moved = sorted(k for k in mine.keys() & current.keys() if mine[k] != current[k])
        if added or removed or moved:
            raise FleetChangedError(added + moved, removed + moved)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_client"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = AdminClient(self._control_timeout_s)

    def __repr__(self) -> str:
        return (
            f"DynamoRefitChannel({len(self._workers)} workers x {self._engine_world_size} ranks, "
            f"control_timeout_s={self._control_timeout_s:g})"
        )
