"""Flush every worker's cache: pause (wait, clear cache) all, then resume those that paused."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from refit_dynamo.admin import AdminClient
from refit_dynamo.endpoint import DynamoWorkerEndpoint
from refit_dynamo.errors import DynamoFleetError, DynamoWorkerError
from refit_dynamo.protocol import PAUSE_PAYLOAD, PAUSE_ROUTE, RESUME_PAYLOAD, RESUME_ROUTE

__all__ = ["flush_fleet"]

logger = logging.getLogger(__name__)


def _on_each(
    workers: Sequence[DynamoWorkerEndpoint], call: Callable[[DynamoWorkerEndpoint], object]
) -> list[DynamoWorkerError | None]:
    """Run ``call`` on every worker in parallel; each worker's error, or None."""

    def guarded(worker: DynamoWorkerEndpoint) -> DynamoWorkerError | None:
        try:
            call(worker)
        except DynamoWorkerError as exc:
            return exc
        return None

    if not workers:
        return []
    with ThreadPoolExecutor(len(workers), thread_name_prefix="refit-dynamo") as pool:
        return list(pool.map(guarded, workers))


def flush_fleet(client: AdminClient, workers: Sequence[DynamoWorkerEndpoint]) -> None:
    """Pause every worker with ``clear_cache`` in parallel, then resume only those that paused.

    A worker whose pause failed is not resumed (it may never have paused, or may be half way).

    Raises:
        DynamoFleetError: one error naming every worker whose pause or resume failed.
    """
    paused = _on_each(workers, lambda w: client.post(w, PAUSE_ROUTE, PAUSE_PAYLOAD))
    to_resume = [w for w, error in zip(workers, paused, strict=True) if error is None]
    resumed = _on_each(to_resume, lambda w: client.post(w, RESUME_ROUTE, RESUME_PAYLOAD))
    failures = [e for e in paused if e is not None] + [e for e in resumed if e is not None]
    if failures:
        error = DynamoFleetError("flush_cache", failures, len(workers))
        logger.warning("%s", error)
        raise error
    logger.info("flushed the cache of %d workers", len(workers))
