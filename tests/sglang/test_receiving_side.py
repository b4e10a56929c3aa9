"""Both SGLang rows refit engines whose receiving side is SGLang's own code (sglang_code).

(Not named test_sglang_*: ai-dynamo's pytest plugin silently drops such files where SGLang is
missing, which would hide this tier's skips.)

The engines run in processes of their own: payloads cross a process boundary and are
unpickled by SGLang's ``MultiprocessingSerializer``; the disaggregated row's group is joined
by SGLang's ``init_custom_process_group`` there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from remote_engines import START_S, RemoteDeployment, engine_processes, inspect

from refit_core import WeightSynchronizer, create_weight_synchronizer
from refit_lab.conformance import RefitDeployment, SynchronizerConformance
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_sglang.buckets import iter_buckets
from refit_sglang.handles import SharedBuffers
from refit_sglang.protocol import REFIT_FIELDS

pytestmark = pytest.mark.timeout(START_S + 300)
"""The first test's bound includes starting the engine processes (the module's fixture)."""

MODEL = ReferenceModelConfig(vocab_size=8192)
"""Embedding and head of 1 MiB each: a 1 MiB bucket size makes several calls per refit."""
BUCKET_GB = 1 / 1024
TP_SIZES = (1, 2)


_ENGINES: list[str] = []
"""The engine processes' base URLs (1 rank, 2 ranks), started once for the module."""


@pytest.fixture(scope="module", autouse=True)
def _engines() -> Iterator[None]:
    with engine_processes(MODEL, TP_SIZES, seed=2) as urls:
        _ENGINES[:] = urls
        try:
            yield
        finally:
            _ENGINES.clear()


def _deploy(colocated: bool) -> RemoteDeployment:
    """A new trainer refitting the engines, each started over as a new engine."""
    for url in _ENGINES:
        inspect(url, "reset")
    trainer = SimulatedTrainer(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype, lr=1e-2)
    synchronizer: WeightSynchronizer = create_weight_synchronizer(
        trainer,
        list(_ENGINES),
        "sglang",
        colocated=colocated,
        refit_buffer_size_gb=BUCKET_GB,
        refit_timeout_s=60.0,
    )
    return RemoteDeployment(trainer, synchronizer, MODEL, list(_ENGINES))


class TestColocatedIntoSGLangCode(SynchronizerConformance):
    """The colocated row: flattened-bucket payloads, one per rank, into 1 and 2 ranks."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy(colocated=True)


class TestDisaggregatedIntoSGLangCode(SynchronizerConformance):
    """The disaggregated row: SGLang's ranks join refit's group and receive its broadcasts."""

    def create_deployment(self) -> RefitDeployment:
        return _deploy(colocated=False)


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "disaggregated"])
def test_every_body_is_sglangs_and_served(colocated: bool) -> None:
    """Every call was parsed by SGLang's request struct and succeeded on every rank."""
    deployment = _deploy(colocated)
    try:
        deployment.trainer.step()
        deployment.synchronizer.sync_weights()
        for url, tp_size in zip(deployment.urls, TP_SIZES, strict=True):
            state = inspect(url)
            routes = [route for route, _ in state["calls"]]
            weights = (
                "update_weights_from_tensor" if colocated else "update_weights_from_distributed"
            )
            assert routes.count(weights) > 1
            assert all(set(body) <= {*REFIT_FIELDS[r]} for r, body in state["calls"])
            assert state["versions"] == [1] * tp_size and not state["paused"]
    finally:
        deployment.close()


def test_sglangs_unpickler_takes_a_payload() -> None:
    """SGLang's ``MultiprocessingSerializer`` (``SafeUnpickler``) rebuilds refit's payload."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    trainer = SimulatedTrainer(random_checkpoint(MODEL, 1), engine_dtype=MODEL.dtype)
    buffers = SharedBuffers()
    named = list(trainer.engine_state().items())
    ((bucket, _),) = iter_buckets(named[:2], 64 << 20, buffers.allocate)
    monkey_patch_torch_reductions()
    (payload,) = buffers.serialize(bucket)
    data = MultiprocessingSerializer.deserialize(payload)
    flat = data["flattened_tensor"]
    for meta, (name, view) in zip(data["metadata"], bucket.views(), strict=True):
        assert meta.name == name
        assert flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape).equal(view)
    buffers.release(bucket)
