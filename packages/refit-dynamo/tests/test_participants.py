"""The Dynamo fleet as refit-nccl participants, and the factory row's validation (no fleet)."""

from __future__ import annotations

import pytest

from refit_core import GeometryMismatchError, TensorSpec, create_weight_synchronizer
from refit_core.backend import CollectiveSenderSpec
from refit_core.sources import StateDictSource
from refit_dynamo import DynamoRefitChannel, DynamoWorkerEndpoint, FleetChangedError
from refit_dynamo.participants import dynamo_shards
from refit_lab.ray_cluster import LocalCluster
from refit_nccl import CollectiveEngineRole as Engine
from refit_nccl import DeviceMismatchError
from refit_nccl.backend import DeviceReport, GroupSpec, JoinRequest, TransferPlan

WORKERS = [DynamoWorkerEndpoint(f"w{i}", f"http://127.0.0.1:{9100 + i}") for i in range(2)]
WAIT_S = 10.0
"""Bound of a call that answers without touching a worker (it runs on a thread of its own)."""
STATE = (("a.weight", TensorSpec((4, 4), "bfloat16")), ("b.weight", TensorSpec((3,), "float32")))


def channel(validate: list[DynamoWorkerEndpoint] | None = None) -> DynamoRefitChannel:
    return DynamoRefitChannel(
        WORKERS,
        engine_world_size=2,
        control_timeout_s=5.0,
        validate_workers=None if validate is None else lambda: validate,
    )


def test_shards_have_one_participant_per_engine_rank() -> None:
    shards = dynamo_shards(channel(WORKERS))
    assert [[p.label for p in ps] for ps in shards.values()] == [
        ["w0", "w0/rank1"],
        ["w1", "w1/rank1"],
    ]
    assert dynamo_shards(channel())[1][1].key == shards[1][1].key != shards[1][0].key
    with pytest.raises(FleetChangedError, match="removed: \\['w1'\\]"):
        dynamo_shards(channel(WORKERS[:1]))


def request(geometry: CollectiveSenderSpec) -> JoinRequest:
    return JoinRequest(GroupSpec("127.0.0.1", 29500, 2, 5, "gloo", "g"), STATE, geometry, 5.0)


def test_followers_answer_at_once_and_geometry_is_checked() -> None:
    ch = channel()
    leader, follower = dynamo_shards(ch)[0]
    spec = ch.sender_spec
    digest = TransferPlan.build(dict(STATE), spec).digest
    assert follower.call(Engine.refit_geometry).result(WAIT_S) == spec
    assert follower.call(Engine.refit_join, request(spec)).result(WAIT_S) == digest
    transferred = follower.call(Engine.refit_transfer, 1, 5.0).result(WAIT_S)
    assert transferred.dense_bytes == 4 * 4 * 2 + 3 * 4
    assert follower.call(Engine.refit_commit, 1).result(WAIT_S) == 1
    other = CollectiveSenderSpec("vllm", 1 << 20, 2)
    with pytest.raises(GeometryMismatchError):
        leader.call(Engine.refit_join, request(other)).result(WAIT_S)
    assert leader.call(Engine.refit_abort, "test", "g").result(WAIT_S) is None
    with pytest.raises(RuntimeError, match="before refit_join"):
        leader.call(Engine.refit_transfer, 1, 5.0).result(WAIT_S)


class Policy:
    """A one-tensor trainer."""

    def weight_source(self) -> StateDictSource:
        import torch

        return StateDictSource({"a.weight": torch.zeros(4, 4)}, dtype="bfloat16")


def build(generation: object, policy: object = None, **kwargs: object) -> object:
    return create_weight_synchronizer(
        Policy() if policy is None else policy,
        generation,
        "dynamo",
        False,
        train_cluster=LocalCluster(1),
        inference_cluster=LocalCluster(2),
        **kwargs,  # type: ignore[arg-type]
    )


def test_factory_row_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="DynamoRefitChannel"):
        build(object())
    with pytest.raises(ValueError, match="weight_source"):
        build(channel(), policy=object())
    with pytest.raises(ValueError, match="buckets"):
        build(channel(), refit_buffer_size_gb=0.5)
    with pytest.raises(NotImplementedError, match="colocated"):
        create_weight_synchronizer(object(), channel(), "dynamo", True)
    with pytest.raises(ValueError, match="must exceed refit_timeout_s"):
        build(channel(), refit_timeout_s=1.0)
    synchronizer = build(channel(), refit_buffer_size_gb=1.0, refit_timeout_s=None)
    assert type(synchronizer).__name__ == "CollectiveWeightSynchronizer"


class MeetingPoint:
    """A train_cluster with only the rendezvous method the row calls."""

    def get_master_address_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", 29512


def test_the_row_asks_train_cluster_for_a_rendezvous_only() -> None:
    synchronizer = create_weight_synchronizer(
        Policy(), channel(), "dynamo", False, train_cluster=MeetingPoint()
    )
    assert type(synchronizer).__name__ == "CollectiveWeightSynchronizer"
    with pytest.raises(ValueError, match="needs train_cluster"):
        create_weight_synchronizer(Policy(), channel(), "dynamo", False)
    with pytest.raises(ValueError, match="dynamo.non-colocated.collective takes no options"):
        build(channel(), options=object())


def test_workers_report_the_channels_device() -> None:
    cuda_ranks = dynamo_shards(channel())[0]
    assert [p.call(Engine.refit_device).result(WAIT_S) for p in cuda_ranks] == [
        DeviceReport.only("cuda")
    ] * 2
    cpu = DynamoRefitChannel(WORKERS, engine_world_size=1, control_timeout_s=5.0, device="cpu")
    assert dynamo_shards(cpu)[1][0].call(Engine.refit_device).result(WAIT_S) == DeviceReport.only(
        "cpu"
    )


def test_cuda_workers_and_a_cpu_trainer_are_refused_before_any_admin_call() -> None:
    """The workers' URLs answer nothing: the refusal comes from the device reports alone."""
    synchronizer = build(channel(), refit_timeout_s=None)
    try:
        with pytest.raises(DeviceMismatchError, match=r"on cpu: trainer 0; on cuda: w0, w0/rank1"):
            synchronizer.init_communicator()  # type: ignore[attr-defined]
    finally:
        synchronizer.shutdown()  # type: ignore[attr-defined]
