"""NCCL variants of the group tests.

On one GPU: the communicator is created eagerly on its device while the group connects, a
world of one connects, broadcasts, aborts and refuses calls after, and an init that a peer
never completes is ended by the deadline through torch's communicator abort. On two GPUs
(``two_gpus``): the packed broadcast bitwise (also over NCCL's network transport, as between
two nodes), and a receiver killed or frozen mid-transfer releasing the survivor by the
deadline + 1 s.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from nccl_workers import MiB, Report, by_event, launch
from refit_lab.faults import ProcessGang
from refit_lab.ray_cluster import free_port
from refit_nccl.group.traits import traits_of

pytestmark = pytest.mark.gpu


@pytest.fixture
def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL group tests need two CUDA GPUs")


@pytest.mark.timeout(60)
def test_the_communicator_exists_once_connected_before_any_collective() -> None:
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    device = torch.device("cuda", torch.cuda.current_device())
    store = TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=30))
    traits = traits_of("nccl")
    pg = traits.construct(
        PrefixStore("eager", store), 0, 1, timedelta(seconds=30), "127.0.0.1", device
    )
    traits.connect(pg, device, timedelta(seconds=30))
    assert pg.bound_device_id == device  # type: ignore[attr-defined]
    assert pg._comm_ptr() != 0  # type: ignore[attr-defined]  # no collective has run yet
    pg.abort()


@pytest.mark.timeout(60)
def test_a_single_gpu_group_connects_broadcasts_aborts_and_refuses_calls_after() -> None:
    from refit_lab.device_check.phases.collective import single_rank_group

    result = single_rank_group()
    assert result["all_reduce_correct"]
    assert result["call_after_abort"] == "RefitAbortedError"


@pytest.mark.timeout(60)
def test_an_init_a_peer_never_completes_ends_by_the_deadline() -> None:
    """The peer joins the store but never creates its communicator: the first member's eager,
    non-blocking NCCL init waits for it until the watchdog aborts it at the deadline."""
    from refit_lab.device_check.phases.collective import absent_peer

    result = absent_peer()
    assert result["absent_peer_error"] == "RefitTimeoutError"
    assert result["absent_peer_released_after_deadline_s"] <= 1.0


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("two_gpus")
def test_nccl_packed_broadcast_is_bitwise() -> None:
    params: Report = {
        "peer": "refit",
        "bucket_bytes": MiB,
        "num_buffers": 2,
        "seed": 1,
        "filler_bytes": 8 * MiB,
        "backend": "nccl",
        "ports": [free_port()],
    }
    with ProcessGang() as gang:
        launch(gang, range(2), 2, [("broadcast", params)])
        reports = gang.collect(2, timeout_s=150)
    for rank, report in by_event(reports, "broadcast", "broadcast").items():
        assert report["wrong"] == [], f"rank {rank}"


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("two_gpus")
def test_nccl_packed_broadcast_over_the_network_transport_is_bitwise() -> None:
    """Each rank claims a host of its own (``NCCL_HOSTID``) and peer-to-peer and shared memory
    are off, so NCCL moves the buckets over its network transport, as between two nodes."""
    params: Report = {
        "peer": "refit",
        "bucket_bytes": MiB,
        "num_buffers": 2,
        "seed": 3,
        "filler_bytes": 8 * MiB,
        "backend": "nccl",
        "ports": [free_port()],
        "nccl_env": {
            "NCCL_HOSTID": "refit-test-host-{rank}",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
        },
    }
    with ProcessGang() as gang:
        launch(gang, range(2), 2, [("broadcast", params)])
        reports = gang.collect(2, timeout_s=150)
    for rank, report in by_event(reports, "broadcast", "broadcast").items():
        assert report["wrong"] == [], f"rank {rank}"


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_nccl_abort_releases_the_survivor_and_retry_is_bitwise(signal_name: str) -> None:
    params: Report = {
        "bucket_bytes": 8 * MiB,
        "filler_bytes": 72 * MiB,
        "seed": 5,
        "deadline_s": 3.0,
        "signals": [signal_name],
        "join_timeout_s": 120.0,
        "backend": "nccl",
        "ports": [free_port() for _ in range(3)],
    }
    with ProcessGang() as gang:
        # world 2: rank 0 sends, rank 1 is the victim; the retry group is rank 0 alone
        launch(gang, [0], 2, [("survivor", params)])
        launch(gang, [1], 2, [("victim", {**params, "victim": 0})])
        launch(gang, [1], 2, [("rejoin", params)])
        reports = gang.collect(5, timeout_s=200)
    transfer = by_event(reports, "survivor", f"{signal_name}:transfer")
    assert transfer[0]["error"] == "RefitTimeoutError"
    assert transfer[0]["after_deadline_s"] <= 1.0
    rejoin = by_event(reports, "rejoin", "rejoin")
    assert rejoin[1]["wrong"] == []
