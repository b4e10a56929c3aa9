"""Shared fixtures of refit-nccl's tests.

The tests directory goes on ``sys.path`` so spawned worker processes can import
:mod:`nccl_workers` by name (the spawn start method sends the parent's ``sys.path``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="session")
def gloo_reports() -> list[dict[str, Any]]:
    """Every report of the shared gloo worker processes (collective steps, then faults)."""
    from nccl_workers import launch_session
    from refit_lab.faults import ProcessGang

    with ProcessGang() as gang:
        expected = launch_session(gang)
        reports: list[dict[str, Any]] = gang.collect(expected, timeout_s=240)
    return reports


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    """A local Ray cluster for one test module (the actors of :mod:`ray_actors` by value)."""
    import ray_actors
    from ray_fleet import MiB
    from refit_lab.ray_cluster import local_ray

    options = {"object_store_memory": 80 * MiB, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[ray_actors], **options):
        yield


@pytest.fixture(scope="module")
def fleet(ray_session: None) -> Iterator[Any]:
    """Two reference-engine shards of one worker each on the module's Ray cluster."""
    from ray_actors import Fleet
    from ray_fleet import CONFIG, GEOMETRY

    created = Fleet(CONFIG, GEOMETRY, shards=2)
    try:
        yield created
    finally:
        created.close()
