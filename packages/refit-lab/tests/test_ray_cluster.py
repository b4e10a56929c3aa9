"""The local cluster helper (Ray itself is exercised by the backends' tests)."""

from __future__ import annotations

import os
import socket

import pytest

from refit_core.backend import ClusterLike
from refit_lab.ray_cluster import LocalCluster, free_port, local_ray

MiB = 1 << 20


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_local_cluster_is_cluster_like_with_a_fresh_port_per_call() -> None:
    cluster = LocalCluster(3)
    assert isinstance(cluster, ClusterLike)
    assert cluster.world_size() == 3
    assert cluster.get_placement_groups() == []
    host, port = cluster.get_master_address_and_port()
    assert host == "127.0.0.1" and 0 < port < 65536


def _niceness() -> int:
    return os.nice(0)


@pytest.mark.slow
def test_local_ray_workers_run_at_the_drivers_priority() -> None:
    """Ray's default (nice 15) starves the actors under test beside any busy process."""
    ray = pytest.importorskip("ray")
    with local_ray(num_cpus=1, object_store_memory=80 * MiB, log_to_driver=False):
        worker_niceness = ray.get(ray.remote(_niceness).remote(), timeout=120)
    assert worker_niceness == os.nice(0)
