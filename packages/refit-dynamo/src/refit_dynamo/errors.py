"""Typed failures of Dynamo admin calls: one worker's, and a fleet's."""

from __future__ import annotations

from collections.abc import Sequence

from refit_core import RefitError, RefitTimeoutError, WorkerError

__all__ = ["DynamoFleetError", "DynamoWorkerError", "DynamoWorkerTimeoutError", "FleetChangedError"]


class DynamoWorkerError(WorkerError):
    """One admin call to one Dynamo worker failed.

    Attributes:
        instance_id: the worker's Dynamo instance id (also ``worker``).
        route: the admin route, e.g. ``update_weights_from_distributed`` (also ``operation``).
        status_code: the HTTP status, when a response arrived.
    """

    def __init__(
        self,
        message: str,
        *,
        instance_id: str,
        route: str,
        status_code: int | None = None,
        is_retryable: bool | None = None,
    ) -> None:
        super().__init__(message, worker=instance_id, operation=route, is_retryable=is_retryable)
        self.detail = message
        self.status_code = status_code

    @property
    def instance_id(self) -> str:
        """The failing worker's instance id."""
        return self.worker

    @property
    def route(self) -> str:
        """The admin route that failed."""
        return self.operation


class DynamoWorkerTimeoutError(DynamoWorkerError, RefitTimeoutError):
    """An admin call got no answer within its timeout; the worker may still be running it."""


class DynamoFleetError(RefitError):
    """One operation failed on some workers of a fleet; ``failures`` holds each worker's error."""

    def __init__(self, operation: str, failures: Sequence[DynamoWorkerError], total: int) -> None:
        self.operation = operation
        self.failures = tuple(failures)
        summary = "; ".join(str(f) for f in self.failures)
        super().__init__(
            f"{operation}: {len(self.failures)} of {total} workers failed: {summary}",
            is_retryable=all(f.is_retryable for f in self.failures),
        )

    @property
    def failed_workers(self) -> tuple[str, ...]:
        """Instance ids of the failed workers, each once, in the order their errors are listed."""
        return tuple(dict.fromkeys(f.instance_id for f in self.failures))


class FleetChangedError(RefitError):
    """The fleet's membership changed since the channel was built; build a new channel."""

    def __init__(self, added: Sequence[str], removed: Sequence[str]) -> None:
        self.added = tuple(added)
        self.removed = tuple(removed)
        super().__init__(
            f"the Dynamo fleet changed (added: {list(self.added)}, removed: {list(self.removed)}); "
            "rebuild the refit channel over the current workers",
            is_retryable=True,
        )
