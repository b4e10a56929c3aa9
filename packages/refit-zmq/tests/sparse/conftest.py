"""Fixtures of the synchronizer tests: a local Ray cluster and reference-engine workers whose
relays run beside them. The directory goes on ``sys.path`` for :mod:`sparse_actors`; without
Ray (an isolated install of refit-zmq) these tests are not collected."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

MiB = 1 << 20

collect_ignore = [] if importlib.util.find_spec("ray") else ["test_synchronizer.py"]


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    import sparse_actors

    from refit_lab.ray_cluster import local_ray

    options = {"object_store_memory": 80 * MiB, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[sparse_actors], **options):
        yield


@pytest.fixture(scope="module")
def engines(ray_session: None) -> Iterator[Any]:
    from sparse_actors import CONFIG, EngineFleet

    fleet = EngineFleet(CONFIG, workers=3)
    try:
        yield fleet
    finally:
        fleet.close()
