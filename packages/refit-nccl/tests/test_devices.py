"""The backend comes from the devices the members report, never from the controller's.

Pure choice rules, then real groups (gloo, threads as ranks) that agree on their backend over
the store, then the synchronizer asking real endpoints for their devices before it joins
anything.
"""

from __future__ import annotations

import importlib.util
import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from refit_core import BackendNotInstalledError, GeometryMismatchError
from refit_core.backend import CollectiveSenderSpec, Deadline, LocalParticipant, Participant
from refit_core.sources import StateDictSource
from refit_lab.ray_cluster import free_port
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_nccl import (
    CollectiveOptions,
    CollectiveWeightSynchronizer,
    DeviceMismatchError,
    EngineEndpoint,
    TrainerEndpoint,
)
from refit_nccl.backend import DeviceReport, VllmPeerTrainer, choose_backend
from refit_nccl.group.abortable import AbortableProcessGroup
from refit_nccl.group.devices import DeviceType, local_device
from refit_nccl.group.spec import GroupSpec
from refit_nccl.vllm_native.engine import VllmNativeGeneration

MiB = 1024 * 1024
CONFIG = ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64)
GEOMETRY = CollectiveSenderSpec("refit", MiB, 2)
CPU, CUDA = DeviceReport.of("cpu"), DeviceReport.of("cuda")
no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed")


# -- the rules ---------------------------------------------------------------------------


def test_every_member_on_one_device_picks_that_devices_backend() -> None:
    assert choose_backend({"trainer 0": CPU, "shard 0": CPU}) == "gloo"
    assert choose_backend({"trainer 0": CUDA, "shard 0": CUDA}) == "nccl"
    assert choose_backend({"trainer 0": CUDA, "shard 0": CUDA}, "gloo") == "gloo"


def test_mixed_devices_are_refused_naming_who_is_where() -> None:
    with pytest.raises(
        DeviceMismatchError, match=r"on cpu: trainer 0; on cuda: shard 0, shard 1"
    ) as caught:
        choose_backend({"trainer 0": CPU, "shard 0": CUDA, "shard 1": CUDA})
    assert isinstance(caught.value, GeometryMismatchError) and not caught.value.is_retryable


def test_a_member_that_cannot_join_the_backend_is_named() -> None:
    with pytest.raises(DeviceMismatchError, match="shard 0 joins only gloo"):
        choose_backend({"trainer 0": CPU, "shard 0": CPU}, "nccl")
    with pytest.raises(DeviceMismatchError, match="shard 0 joins only nccl"):
        choose_backend({"trainer 0": CUDA, "shard 0": DeviceReport.only("cuda")}, "gloo")
    lacking = DeviceReport.lacking("cuda", "vLLM does not import", "pip install vllm")
    with pytest.raises(BackendNotInstalledError, match="trainer 0 cannot join a nccl group") as e:
        choose_backend({"trainer 0": lacking, "shard 0": DeviceReport.only("cuda")})
    assert e.value.install_hint == "pip install vllm"
    assert choose_backend({"trainer 0": lacking, "shard 0": CUDA}, "gloo") == "gloo"


def test_reports_are_validated() -> None:
    with pytest.raises(ValueError, match="no participant"):
        choose_backend({})
    with pytest.raises(ValueError, match="unknown device"):
        DeviceReport("tpu", ("gloo",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must say why"):
        DeviceReport("cpu", ())
    assert DeviceReport.of() == DeviceReport.of(local_device())


# -- groups that agree over the store ----------------------------------------------------


def _ranks(world: int, run: Callable[[int], Any]) -> dict[int, Any]:
    """Run ``run(rank)`` for every rank on threads; rank -> result or raised exception."""
    results: dict[int, Any] = {}

    def one(rank: int) -> None:
        try:
            results[rank] = run(rank)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.timeout(90)
def test_members_on_cpu_agree_on_gloo_and_move_data() -> None:
    port = free_port()

    def run(rank: int) -> list[float]:
        group = AbortableProcessGroup(GroupSpec("127.0.0.1", port, rank, 3, None, "agree"))
        group.connect(Deadline.after(30))
        assert group.backend == "gloo"
        data = torch.full((2,), float(rank))
        group.all_reduce(data, Deadline.after(30))
        group.abort("done")
        return data.tolist()

    assert _ranks(3, run) == {r: [3.0, 3.0] for r in range(3)}


@pytest.mark.timeout(90)
def test_a_mixed_report_fails_every_member_before_a_communicator_exists() -> None:
    port = free_port()

    def run(rank: int) -> str:
        device = "cuda" if rank == 1 else "cpu"
        group = AbortableProcessGroup(
            GroupSpec("127.0.0.1", port, rank, 3, None, "mixed", device=device)
        )
        with pytest.raises(DeviceMismatchError, match=r"on cpu: rank 0, rank 2; on cuda: rank 1"):
            group.connect(Deadline.after(30))
        assert group.aborted
        return "refused"

    assert _ranks(3, run) == {r: "refused" for r in range(3)}


# -- the synchronizer asks the members ---------------------------------------------------


def _engine(seed: int, device: DeviceType | None = None) -> EngineEndpoint:
    return EngineEndpoint(lambda: ReferenceEngine(CONFIG, seed=seed), GEOMETRY, device=device)


def _synchronizer(
    trainer: object, engines: list[Participant], options: CollectiveOptions | None = None
) -> tuple[CollectiveWeightSynchronizer, int]:
    port = free_port()
    sync = CollectiveWeightSynchronizer(
        [LocalParticipant(trainer, "trainer 0")],
        lambda: {i: [e] for i, e in enumerate(engines)},
        lambda: ("127.0.0.1", port),
        refit_timeout_s=30.0,
        options=options,
    )
    return sync, port


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.timeout(120)
def test_members_reporting_cpu_get_a_gloo_group_and_a_bitwise_refit() -> None:
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1), seed=1, lr=1e-2)
    endpoints = [_engine(5), _engine(6)]
    engines: list[Participant] = [
        LocalParticipant(e, f"shard {i}") for i, e in enumerate(endpoints)
    ]
    sync, _ = _synchronizer(TrainerEndpoint(trainer), engines)
    try:
        sync.init_communicator()
        assert sync.backend == "gloo"
        trainer.step()
        sync.sync_weights()
        expected = trainer.engine_state()
        for endpoint in endpoints:
            served = endpoint.engine.checkpoint_tensors()  # type: ignore[attr-defined]
            assert served.keys() == expected.keys()
            assert all(torch.equal(served[n], t) for n, t in expected.items())
    finally:
        sync.shutdown()
        for engine in engines:
            engine.close()


def test_a_member_on_another_device_is_refused_before_anything_is_joined() -> None:
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1), seed=1, lr=1e-2)
    engines: list[Participant] = [
        LocalParticipant(_engine(5, "cpu"), "shard 0"),
        LocalParticipant(_engine(6, "cuda"), "shard 1"),
    ]
    sync, port = _synchronizer(TrainerEndpoint(trainer, device="cpu"), engines)
    try:
        with pytest.raises(
            DeviceMismatchError, match=r"on cpu: trainer 0, shard 0; on cuda: shard 1"
        ):
            sync.init_communicator()
        assert sync.backend is None and _port_is_free(port)
    finally:
        sync.shutdown()


def test_a_backend_asked_for_must_suit_every_member() -> None:
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 1), seed=1, lr=1e-2)
    engines: list[Participant] = [LocalParticipant(_engine(5, "cpu"), "shard 0")]
    options = CollectiveOptions(backend="nccl")
    sync, port = _synchronizer(TrainerEndpoint(trainer, device="cpu"), engines, options)
    try:
        with pytest.raises(DeviceMismatchError, match="trainer 0 joins only gloo"):
            sync.init_communicator()
        assert _port_is_free(port)
    finally:
        sync.shutdown()


class _Policy:
    def weight_source(self) -> StateDictSource:
        return StateDictSource({"w": torch.zeros(4, 4)}, dtype="bfloat16")


class _SyncClient:
    """vLLM's weight-sync surface; refused before any call reaches it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")


@no_vllm
def test_vllms_nccl_engines_need_vllm_on_a_cuda_trainer() -> None:
    client = _SyncClient()
    generation = VllmNativeGeneration([client])
    engines = list(generation.collective_shards()[0])
    sync, port = _synchronizer(VllmPeerTrainer(_Policy(), device="cuda"), engines)
    try:
        with pytest.raises(BackendNotInstalledError, match="trainer 0 cannot join a nccl") as e:
            sync.init_communicator()
        assert e.value.install_hint.startswith("pip install vllm")
        assert client.calls == [] and _port_is_free(port)
    finally:
        sync.shutdown()


def test_vllms_nccl_engines_and_a_cpu_trainer_are_a_device_mismatch() -> None:
    client = _SyncClient()
    engines = list(VllmNativeGeneration([client], engine_world_size=2).collective_shards()[0])
    assert [e.label for e in engines] == ["vllm engine 0", "vllm engine 0/rank1"]
    sync, _ = _synchronizer(VllmPeerTrainer(_Policy(), device="cpu"), engines)
    try:
        with pytest.raises(
            DeviceMismatchError, match="on cuda: vllm engine 0, vllm engine 0/rank1"
        ):
            sync.init_communicator()
        assert client.calls == []
    finally:
        sync.shutdown()
