"""A local Ray cluster for tests: start and stop Ray, and a ``ClusterLike`` over this host.

Ray is imported only inside :func:`local_ray`, so importing this module stays light.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["LocalCluster", "free_port", "local_ray"]

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def local_ray(num_cpus: int, **init_kwargs: Any) -> Iterator[None]:
    """Run a fresh single-node Ray cluster (no dashboard) for the duration of the block.

    Args:
        num_cpus: logical CPUs Ray may schedule on.
        init_kwargs: further ``ray.init`` arguments (for example ``object_store_memory``).
    """
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        raise RuntimeError("Ray is already initialized in this process")
    # Under `uv run`, Ray would re-create the uv environment for every worker (seconds per
    # actor); local workers already share this interpreter's environment.
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    ray.init(num_cpus=num_cpus, include_dashboard=False, **init_kwargs)
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
