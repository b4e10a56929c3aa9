"""DynamoRefitChannel without a fleet: validation, geometry, update info, copies, errors."""

from __future__ import annotations

import pickle
import sys
import types

import pytest

from refit_core import GeometryMismatchError, Recovery, RefitTimeoutError, TensorSpec
from refit_core.backend import CollectiveSenderSpec
from refit_dynamo import (
    VLLM_SENDER_SPEC,
    DynamoRefitChannel,
    DynamoWorkerEndpoint,
    DynamoWorkerError,
    DynamoWorkerTimeoutError,
    FleetChangedError,
)

WORKERS = [DynamoWorkerEndpoint(str(i), f"http://127.0.0.1:{9000 + i}") for i in range(3)]
INFO = {
    "model.embed_tokens.weight": TensorSpec((256, 64), "bfloat16"),
    "model.norm.weight": TensorSpec((64,), "float32"),
}


def channel(**overrides: object) -> DynamoRefitChannel:
    kwargs: dict[str, object] = {"engine_world_size": 2, "control_timeout_s": 5.0, **overrides}
    return DynamoRefitChannel(WORKERS, **kwargs)  # type: ignore[arg-type]


def test_world_size_and_rank_offsets() -> None:
    ch = channel()
    assert ch.inference_world_size == 6
    assert [ch.rank_offset(i, train_world_size=2) for i in range(3)] == [2, 4, 6]
    with pytest.raises(ValueError, match="worker index 3"):
        ch.rank_offset(3, 1)


@pytest.mark.parametrize(
    ("workers", "kwargs", "match"),
    [
        ([], {}, "at least one worker"),
        ([WORKERS[0], WORKERS[0]], {}, "unique"),
        (["http://127.0.0.1:1"], {}, "DynamoWorkerEndpoint"),
        (WORKERS, {"engine_world_size": 0}, "engine_world_size must be >= 1"),
        (WORKERS, {"engine_world_size": True}, "engine_world_size must be an int"),
        (WORKERS, {"control_timeout_s": 0.0}, "control_timeout_s"),
        (WORKERS, {"control_timeout_s": float("inf")}, "control_timeout_s"),
        (WORKERS, {"control_timeout_s": float("nan")}, "control_timeout_s"),
        (WORKERS, {"device": "tpu"}, "device must be"),
    ],
)
def test_construction_is_validated(
    workers: list[object], kwargs: dict[str, object], match: str
) -> None:
    full: dict[str, object] = {"engine_world_size": 1, "control_timeout_s": 5.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        DynamoRefitChannel(workers, **full)  # type: ignore[arg-type]


def test_sender_spec_is_vllms_packed_geometry() -> None:
    assert channel().sender_spec == CollectiveSenderSpec("vllm", 1 << 30, 2) == VLLM_SENDER_SPEC


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, buffer_bytes: int, buffers: int) -> None:
    defaults = types.ModuleType("vllm.distributed.weight_transfer.packed_tensor")
    defaults.DEFAULT_PACKED_BUFFER_SIZE_BYTES = buffer_bytes  # type: ignore[attr-defined]
    defaults.DEFAULT_PACKED_NUM_BUFFERS = buffers  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, defaults.__name__, defaults)


def test_sender_spec_is_checked_against_an_importable_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, 1 << 30, 2)
    assert channel().sender_spec == VLLM_SENDER_SPEC
    _fake_vllm(monkeypatch, 512 << 20, 3)
    with pytest.raises(GeometryMismatchError, match="differs from the installed vLLM"):
        channel()


def test_prepare_builds_vllm_update_info() -> None:
    ch = channel()
    assert ch.update_info is None
    ch.prepare(INFO)
    assert ch.update_info == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[256, 64], [64]],
    }
    with pytest.raises(TypeError):
        ch.update_info["names"] = []  # type: ignore[index]
    with pytest.raises(ValueError, match="empty"):
        ch.prepare({})


def test_update_before_prepare_is_refused() -> None:
    with pytest.raises(RuntimeError, match="prepare"):
        channel().update_weights()


def test_init_collective_validates_world_and_membership() -> None:
    with pytest.raises(ValueError, match="world_size 8"):
        channel().init_collective("127.0.0.1", 1234, 8, train_world_size=1)
    with pytest.raises(ValueError, match="train_world_size"):
        channel().init_collective("127.0.0.1", 1234, 6, train_world_size=0)
    moved = DynamoWorkerEndpoint("1", "http://127.0.0.1:9999")
    fleet = [WORKERS[0], moved, DynamoWorkerEndpoint("9", "http://127.0.0.1:9009")]
    ch = channel(validate_workers=lambda: fleet)
    with pytest.raises(FleetChangedError) as caught:
        ch.init_collective("127.0.0.1", 1234, 7, train_world_size=1)
    assert caught.value.added == ("9", "1")
    assert caught.value.removed == ("2", "1")


def test_client_copy_is_picklable_and_keeps_the_update_info() -> None:
    ch = channel(validate_workers=lambda: WORKERS)
    ch.prepare(INFO)
    copy = pickle.loads(pickle.dumps(ch.client_copy()))
    assert copy.workers == ch.workers
    assert copy.inference_world_size == 6
    assert copy.control_timeout_s == 5.0
    assert copy.update_info == ch.update_info
    assert copy._validate_workers is None


def test_worker_errors_pickle_with_their_fields() -> None:
    error = DynamoWorkerError(
        "status 'error': boom", instance_id="7", route="pause_generation", status_code=200
    )
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.instance_id, copy.route, copy.status_code, str(copy)) == (
        "7",
        "pause_generation",
        200,
        str(error),
    )
    timeout = pickle.loads(
        pickle.dumps(DynamoWorkerTimeoutError("slow", instance_id="7", route="r"))
    )
    assert isinstance(timeout, RefitTimeoutError) and isinstance(timeout, TimeoutError)
    assert timeout.recovery is Recovery.RECOVER and timeout.worker == "7"
