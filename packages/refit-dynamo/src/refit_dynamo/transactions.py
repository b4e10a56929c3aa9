"""One worker's admin transactions over an :class:`~refit_dynamo.admin.AdminClient`.

This module imports no torch and knows no channel: Ray tasks (:mod:`refit_dynamo.remote`)
and the factory row's threads (:mod:`refit_dynamo.participants`) run the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refit_dynamo.admin import AdminClient
from refit_dynamo.endpoint import DynamoWorkerEndpoint
from refit_dynamo.flush import flush_fleet
from refit_dynamo.protocol import INIT_ROUTE, update_steps

__all__ = ["flush_worker", "join_worker", "update_worker"]


def join_worker(
    admin: AdminClient, worker: DynamoWorkerEndpoint, payload: Mapping[str, Any]
) -> str:
    """``worker`` joins the trainer's group; its instance id once it has."""
    admin.post(worker, INIT_ROUTE, payload, rpc="init_weight_transfer_engine")
    return worker.instance_id


def update_worker(
    admin: AdminClient,
    worker: DynamoWorkerEndpoint,
    info: Mapping[str, Any],
    weight_version: int | None,
) -> str:
    """``worker`` runs start / update ``info`` / finish; its instance id once finished.

    Stops at the first failed step, so a worker never finishes (commits) a partial update.
    ``weight_version``, if given, rides on the finish call (Dynamo records it).
    """
    for step in update_steps(info, weight_version):
        admin.post(worker, step.route, step.payload, rpc=step.rpc)
    return worker.instance_id


def flush_worker(admin: AdminClient, worker: DynamoWorkerEndpoint) -> str:
    """Pause ``worker`` with ``clear_cache`` and resume it; its instance id."""
    flush_fleet(admin, [worker])
    return worker.instance_id
