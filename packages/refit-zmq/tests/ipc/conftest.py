"""Fixtures of the IPC tests: a local Ray cluster and reference-engine workers serving
IpcReceivers. The directory goes on ``sys.path`` for :mod:`ipc_actors`; without Ray (an
isolated install of refit-zmq) the Ray tests are not collected."""

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
    import ipc_actors

    from refit_lab.ray_cluster import local_ray

    options = {"object_store_memory": 80 * MiB, "log_to_driver": False}
    with local_ray(num_cpus=4, by_value=[ipc_actors], **options):
        yield


@pytest.fixture(scope="module")
def engines(ray_session: None) -> Iterator[Any]:
    from ipc_actors import EngineFleet

    fleet = EngineFleet(workers=2)
    try:
        yield fleet
    finally:
        fleet.close()
