"""The IPC synchronizer end to end: the factory, receivers in Ray engine workers, the
conformance suite, one-off buffers, refused manifests and inputs, killed and frozen workers."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import ray
import torch
from ipc_actors import CONFIG, EngineFleet

from refit_core import (
    GeometryMismatchError,
    NamedTensor,
    RefitTimeoutError,
    StateDictInfo,
    create_weight_synchronizer,
)
from refit_core.sources import StateDictSource
from refit_lab.conformance import FleetDeployment, RefitDeployment, SynchronizerConformance
from refit_lab.digest import state_digest
from refit_lab.faults import thaw
from refit_lab.reference_engine import random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_zmq.ipc import IpcOptions, IpcWeightSynchronizer

pytestmark = pytest.mark.timeout(300)

KiB = 1024
TIMEOUT_S = 3.0


class TestIpcConformance(SynchronizerConformance):
    """The shared suite, through the factory, over two engine workers on CPU shared memory."""

    @pytest.fixture(autouse=True)
    def _fresh_engines(self, engines: EngineFleet) -> None:
        engines.reset(seed=100)
        self.engines = engines

    def create_deployment(self) -> RefitDeployment:
        trainer = SimulatedTrainer(random_checkpoint(CONFIG, 0), lr=1e-2)
        synchronizer = create_weight_synchronizer(
            trainer,
            self.engines,
            "vllm",
            True,
            refit_buffer_size_gb=48 * KiB / 1024**3,
            refit_timeout_s=60.0,
            options=IpcOptions(device="cpu"),
        )
        assert isinstance(synchronizer, IpcWeightSynchronizer)
        return FleetDeployment(trainer, synchronizer, CONFIG, self.engines)


class _LyingSource:
    """Declares the checkpoint's specs but yields ``liar`` one row short."""

    def __init__(self, state: Mapping[str, torch.Tensor], liar: str) -> None:
        self._state = state
        self._liar = liar

    def state_dict_info(self) -> StateDictInfo:
        return StateDictSource(self._state).state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        for named in StateDictSource(self._state).iter_tensors():
            tensor = named.tensor[:-1] if named.name == self._liar else named.tensor
            yield NamedTensor(named.name, tensor)


class _Policy:
    """A policy over a fixed state dict (any dtypes, names and shapes); with ``liar`` set its
    source breaks its own manifest on that tensor."""

    def __init__(self, state: Mapping[str, torch.Tensor], liar: str | None = None) -> None:
        self.state = dict(state)
        self.liar = liar

    def weight_source(self) -> StateDictSource | _LyingSource:
        if self.liar is None:
            return StateDictSource(self.state)
        return _LyingSource(self.state, self.liar)


def _synchronizer(
    policy: Any, engines: EngineFleet, *, buffer_bytes: int = 48 * KiB, timeout_s: float = 60.0
) -> IpcWeightSynchronizer:
    addresses = engines.ipc_addresses()  # asked once: a dead worker's actor cannot answer
    return IpcWeightSynchronizer(
        policy,
        lambda: addresses,
        refit_timeout_s=timeout_s,
        options=IpcOptions(buffer_size_bytes=buffer_bytes, device="cpu"),
    )


def _bitwise(engines: EngineFleet, state: Mapping[str, torch.Tensor]) -> list[bool]:
    expected = state_digest(state.items())
    return [digests == expected for digests in engines.call("state_digests")]


def test_tensors_larger_than_half_a_buffer_take_one_off_buffers(
    engines: EngineFleet, caplog: pytest.LogCaptureFixture
) -> None:
    engines.reset(seed=200)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 2))
    with (
        caplog.at_level(logging.DEBUG, logger="refit_zmq.ipc.packing"),
        _synchronizer(trainer, engines, buffer_bytes=24 * KiB) as synchronizer,
    ):
        for _ in range(2):
            trainer.step(lr=1e-2)
            result = synchronizer.sync_weights()
            assert result.ok and _bitwise(engines, trainer.engine_state()) == [True, True]
            assert result.wire_bytes == result.dense_bytes
    oneoffs = {r.getMessage().rsplit(" ", 1)[1] for r in caplog.records if "one-off" in r.message}
    # 32 KiB is more than a whole buffer, 16 KiB more than half of one; 8 KiB fits in a slot.
    assert "model.embed_tokens.weight" in oneoffs and "lm_head.weight" in oneoffs
    assert "model.layers.0.mlp.gate_proj.weight" in oneoffs
    assert "model.layers.0.self_attn.q_proj.weight" not in oneoffs
    assert engines.call("weight_version") == [2, 2]


def _unchanged(engines: EngineFleet, before: list[dict[str, int]]) -> None:
    assert engines.call("state_digests") == before
    assert engines.call("weight_version") == [0, 0]
    assert engines.call("partial") == [False, False]


def test_a_manifest_the_engine_does_not_match_is_refused_before_loading(
    engines: EngineFleet,
) -> None:
    engines.reset(seed=300)
    before = engines.call("state_digests")
    state = random_checkpoint(CONFIG, 3)
    missing = {n: t for n, t in state.items() if n != "model.norm.weight"}
    extra = {**state, "model.layers.9.mlp.up_proj.weight": state["model.norm.weight"]}
    for policy, why in ((missing, "missing \\['model.norm.weight'\\]"), (extra, "unknown")):
        with (
            _synchronizer(_Policy(policy), engines) as synchronizer,
            pytest.raises(GeometryMismatchError, match=why),
        ):
            synchronizer.sync_weights()
        assert synchronizer.version == 0
    _unchanged(engines, before)


def test_wrong_dtype_or_shape_is_a_typed_error_and_loses_nothing(engines: EngineFleet) -> None:
    engines.reset(seed=400)
    before = engines.call("state_digests")
    state = random_checkpoint(CONFIG, 4)
    name = "model.layers.1.mlp.down_proj.weight"
    wrong_dtype = {**state, name: state[name].float()}
    wrong_shape = {**state, name: state[name][:, :-1].contiguous()}
    for bad in (wrong_dtype, wrong_shape):
        with (
            _synchronizer(_Policy(bad), engines) as synchronizer,
            pytest.raises(GeometryMismatchError, match=name),
        ):
            synchronizer.sync_weights()
    _unchanged(engines, before)

    # A source that breaks its own manifest mid-refit: the packer refuses the tensor, every
    # worker aborts and is named as holding a partial load; the next refit heals them.
    policy = _Policy(state, liar=name)
    with _synchronizer(policy, engines) as synchronizer:
        with pytest.raises(GeometryMismatchError, match="manifest says") as info:
            synchronizer.sync_weights()
        assert sorted(info.value.wedged_workers) == sorted(engines.ipc_addresses())
        assert engines.call("weight_version") == [0, 0]
        assert engines.call("partial") == [True, True]
        policy.liar = None  # the trainer fixed its source
        assert synchronizer.sync_weights().ok
    assert _bitwise(engines, state) == [True, True]
    assert engines.call("partial") == [False, False]


# Frozen first: a thawed worker is reset and serves again; the killed one stays dead, so that
# case must run last in this module.
@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_a_dead_or_frozen_worker_ends_the_refit_at_its_deadline(
    engines: EngineFleet, fault: signal.Signals
) -> None:
    engines.reset(seed=500)
    faulty = engines.workers[1]
    ray.get(faulty.reset.remote(7, (2, int(fault))), timeout=60)  # faults on its 2nd bucket
    pid = ray.get(faulty.pid.remote(), timeout=60)
    addresses = engines.ipc_addresses()
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 5))
    try:
        with _synchronizer(trainer, engines, timeout_s=TIMEOUT_S) as synchronizer:
            started = time.monotonic()
            with pytest.raises(RefitTimeoutError) as info:
                synchronizer.sync_weights()
            elapsed = time.monotonic() - started
            assert elapsed <= TIMEOUT_S + 1.0, f"released {elapsed:.2f} s after the start"
            assert info.value.wedged_workers == (addresses[1],)
            assert synchronizer.is_stale() and synchronizer.version == 0

            synchronizer.reconcile_communicator({1})
            assert not synchronizer.is_stale()
            result = synchronizer.sync_weights()
            assert [w.worker for w in result.workers] == [addresses[0]]
            healthy = ray.get(engines.workers[0].state_digests.remote(), timeout=60)
            assert healthy == state_digest(trainer.engine_state().items())
    finally:
        thaw(pid)
    if fault == signal.SIGSTOP:
        ray.get(faulty.reset.remote(101), timeout=60)
