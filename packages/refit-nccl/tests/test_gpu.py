"""NCCL variants of the group tests (run where at least two CUDA GPUs exist)."""

from __future__ import annotations

import pytest

from nccl_workers import MiB, Report, by_event, launch
from refit_lab.faults import ProcessGang
from refit_lab.ray_cluster import free_port

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL group tests need two CUDA GPUs")


@pytest.mark.timeout(180)
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


@pytest.mark.timeout(240)
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
