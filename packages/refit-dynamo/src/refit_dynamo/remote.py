"""Run a worker transaction as a Ray task (Ray is imported on first use)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from refit_dynamo.admin import AdminClient

if TYPE_CHECKING:
    import ray

__all__ = ["submit"]


def _run_and_close(fn: Callable[..., Any], admin: AdminClient, *args: Any) -> Any:
    try:
        return fn(admin, *args)
    finally:
        admin.close()


@functools.cache
def _task() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "the channel's init_collective() and update_weights() return Ray ObjectRefs; "
            'install "refit-dynamo[ray]"'
        ) from exc

    # No retries: a task that died may have delivered its POST, and the routes are not
    # idempotent. Zero CPUs: the task only waits on HTTP.
    return ray.remote(num_cpus=0, max_retries=0, retry_exceptions=False)(_run_and_close)


def submit(fn: Callable[..., Any], admin: AdminClient, *args: Any) -> ray.ObjectRef[Any]:
    """Start ``fn(admin, *args)`` as a Ray task; the task's copy of ``admin`` (it pickles
    without its connections) is closed when ``fn`` returns."""
    ref: ray.ObjectRef[Any] = _task().remote(fn, admin, *args)
    return ref
