"""A local Ray cluster for tests: start and stop Ray, a ``ClusterLike`` over this host, and
a fleet of actors called together.

Ray is imported only where it is used, so importing this module stays light.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["ActorFleet", "LocalCluster", "free_port", "local_ray"]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def local_ray(
    num_cpus: int, *, by_value: Iterable[ModuleType] = (), **init_kwargs: Any
) -> Iterator[None]:
    """Run a fresh single-node Ray cluster (no dashboard) for the duration of the block.

    Args:
        num_cpus: logical CPUs Ray may schedule on.
        by_value: modules whose classes are pickled by value (test actor modules that Ray's
            workers could not import by name).
        init_kwargs: further ``ray.init`` arguments (for example ``object_store_memory``).
    """
    import ray
    from ray._private import ray_constants

    register: Callable[[ModuleType], None] = ray.cloudpickle.register_pickle_by_value
    for module in by_value:
        register(module)

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    # Under `uv run`, Ray would re-create the uv environment for every worker (seconds per
    # actor); local workers already share this interpreter's environment.
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    # Ray starts its workers at nice 15; beside any busy process at nice 0 they then get a few
    # percent of a core, and every deadline on an actor call is missed. The actors here are
    # the engines and trainers under test, so they run at the driver's priority.
    system_config = {"worker_niceness": 0, **init_kwargs.pop("_system_config", {})}
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, _system_config=system_config, **init_kwargs
    )
    logger.info("local Ray cluster started with %d CPUs", num_cpus)
    try:
        yield
    finally:
        ray.shutdown()
        logger.info("local Ray cluster stopped")


@dataclass(frozen=True)
class LocalCluster:
    """A ``ClusterLike`` of ``size`` workers on this host; rendezvous on ``host``."""

    size: int
    host: str = "127.0.0.1"

    def world_size(self) -> int:
        """Number of workers."""
        return self.size

    def get_placement_groups(self) -> list[Any]:
        """None: local actors are scheduled without placement groups."""
        return []

    def get_master_address_and_port(self) -> tuple[str, int]:
        """``host`` and a port that is free now (a fresh one per call)."""
        return self.host, free_port(self.host)


class ActorFleet:
    """Ray actors started together: called together, reset together, killed together.

    Args:
        workers: the actor handles, in order.
        timeout_s: the deadline of every call.
    """

    def __init__(self, workers: list[Any], *, timeout_s: float = 120.0) -> None:
        self.workers = workers
        self._timeout_s = timeout_s

    def call(self, method: str, *args: Any) -> list[Any]:
        """Every worker's ``method(*args)``, in worker order."""
        import ray

        calls = [getattr(worker, method).remote(*args) for worker in self.workers]
        results: list[Any] = ray.get(calls, timeout=self._timeout_s)
        return results

    def reset(self, seed: int) -> None:
        """Every worker's ``reset(seed + index)``."""
        import ray

        calls = [worker.reset.remote(seed + i) for i, worker in enumerate(self.workers)]
        ray.get(calls, timeout=self._timeout_s)

    def close(self) -> None:
        """Kill every worker."""
        import ray

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
