"""One worker's admin transactions (this module imports no torch: Ray tasks run them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from refit_dynamo.flush import flush_fleet
from refit_dynamo.protocol import INIT_ROUTE, update_steps

if TYPE_CHECKING:
    from refit_dynamo.channel import DynamoRefitChannel

__all__ = ["flush_worker", "join_worker", "update_worker"]


def join_worker(channel: DynamoRefitChannel, index: int, payload: Mapping[str, Any]) -> str:
    """Worker ``index`` joins the trainer's group; its instance id once it has."""
    channel.post(index, INIT_ROUTE, payload, "init_weight_transfer_engine")
    return channel.workers[index].instance_id


def update_worker(channel: DynamoRefitChannel, index: int, weight_version: int | None) -> str:
    """Worker ``index`` runs start / update / finish; its instance id once finished.

    Stops at the first failed step, so a worker never finishes (commits) a partial update.
    ``weight_version``, if given, rides on the finish call (Dynamo records it).
    """
    info = channel.update_info
    if info is None:
        raise RuntimeError("the channel carries no update info; call prepare() first")
    for step in update_steps(info, weight_version):
        channel.post(index, step.route, step.payload, step.rpc)
    return channel.workers[index].instance_id


def flush_worker(channel: DynamoRefitChannel, index: int) -> str:
    """Pause worker ``index`` with ``clear_cache`` and resume it; its instance id."""
    flush_fleet(channel.admin, [channel.workers[index]])
    return channel.workers[index].instance_id
