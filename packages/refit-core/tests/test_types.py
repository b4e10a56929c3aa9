"""Value types, errors and deadlines of refit-core."""

from __future__ import annotations

import pickle
import time

import pytest

from refit_core import (
    BackendNotInstalledError,
    EngineReport,
    EngineState,
    InvalidTimeoutError,
    Recovery,
    RefitAbortedError,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    ShardInfo,
    TensorSpec,
    WeightVersion,
    WorkerError,
    WorkerOutcome,
)
from refit_core.backend import (
    MIN_BUFFER_BYTES,
    CollectiveSenderSpec,
    Deadline,
    checked_buffer_size,
    with_engines,
)
from refit_core.types import dtype_name


def test_tensor_spec_validates_and_counts() -> None:
    assert TensorSpec((2, 3), "bfloat16").numel == 6
    with pytest.raises(ValueError, match="bare torch dtype"):
        TensorSpec((2,), "torch.bfloat16")
    with pytest.raises(ValueError, match="negative"):
        TensorSpec((-1,), "float32")


def test_dtype_name_strips_prefix() -> None:
    assert dtype_name("torch.float8_e4m3fn") == "float8_e4m3fn"


def test_weight_version_is_monotonic() -> None:
    v = WeightVersion(3)
    assert v.next() == WeightVersion(4)
    v.require_advance_to(WeightVersion(9))
    with pytest.raises(ValueError, match="must increase"):
        v.require_advance_to(WeightVersion(3))
    with pytest.raises(ValueError):
        WeightVersion(-1)


def test_sender_spec_is_frozen_and_validated() -> None:
    spec = CollectiveSenderSpec("vllm", 1 << 30, 2)
    with pytest.raises(AttributeError):
        spec.num_buffers = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_buffers"):
        CollectiveSenderSpec("vllm", 1 << 30, 0)
    with pytest.raises(ValueError, match="buffer_size_bytes"):
        CollectiveSenderSpec("vllm", 10, 2)


def test_shard_info_validated() -> None:
    with pytest.raises(ValueError):
        ShardInfo(dim=0, index=2, count=2)


def test_refit_result_aggregates_workers() -> None:
    ok = WorkerOutcome("a", True, 2)
    bad = WorkerOutcome("b", False, 1, "died")
    result = RefitResult(2, {"transfer": 0.5}, 1.0, 10, 2_000_000_000, (ok, bad))
    assert not result.ok
    assert result.effective_gbps == pytest.approx(2.0)
    assert RefitResult(2, {}, 1.0, 1, 1, (ok,)).ok


def test_error_tree_mixes_builtins_and_pickles() -> None:
    assert issubclass(RefitTimeoutError, TimeoutError)
    assert RefitTimeoutError("x").recovery is Recovery.RECOVER
    assert not RefitTimeoutError("x").is_retryable
    err = BackendNotInstalledError("missing", install_hint='pip install "refit-core[zmq]"')
    assert isinstance(err, ImportError) and not err.is_retryable
    worker = WorkerError("status 'error'", worker="w0", operation="/engine/pause")
    assert worker.worker == "w0" and "w0: /engine/pause" in str(worker)
    wedged = RefitError("timed out", wedged_workers=["w1"])
    assert wedged.wedged_workers == ("w1",)
    assert RefitError("x", is_retryable=True).is_retryable


def test_errors_carry_structured_facts_through_pickling() -> None:
    engines = [
        EngineReport(0, "tcp://a:1", EngineState.OLD, 3),
        EngineReport(1, "tcp://b:1", EngineState.UNKNOWN, None, "UNREACHABLE: no answer"),
        EngineReport(None, "w9", EngineState.CLOSED, None),
    ]
    error = WorkerError(
        "died", worker="shard 1", operation="refit_transfer", engines=engines, wedged_workers=["w9"]
    )
    assert error.recovery is Recovery.RECOVER and not error.is_retryable
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is WorkerError and str(copy) == str(error)
    assert copy.worker == "shard 1" and copy.operation == "refit_transfer"
    assert copy.engines == tuple(engines) and copy.wedged_workers == ("w9",)
    assert copy.failed_shards == (1,)
    assert copy.states()["tcp://a:1"] is EngineState.OLD
    assert RefitError("x", recovery=Recovery.RESYNC).recovery is Recovery.RESYNC
    assert RefitError("x", is_retryable=False).recovery is Recovery.FIX
    assert not RefitAbortedError("aborted").is_retryable


def test_a_worker_error_names_its_worker_and_operation_once() -> None:
    first = WorkerError("load failed", worker="engine 0", operation="load")
    assert str(first) == "engine 0: load: load failed"
    again = WorkerError(str(first), worker="engine 0", operation="load")  # re-raised elsewhere
    assert str(again) == "engine 0: load: load failed"
    labelled = WorkerError("engine 0: out of memory", worker="engine 0", operation="load")
    assert str(labelled) == "engine 0: load: out of memory"


def test_with_engines_twice_adds_each_engine_once() -> None:
    old = EngineReport(0, "engine 0", EngineState.OLD, 3, "refused")
    closed = EngineReport(1, "engine 1", EngineState.CLOSED)
    error = with_engines(RefitError("refit failed"), [old, closed])
    text = str(error)
    assert with_engines(error, [old, closed]) is error
    assert (error.engines, str(error)) == ((old, closed), text)
    unknown = EngineReport(1, "engine 1", EngineState.UNKNOWN)
    with_engines(error, [unknown])  # newer news of engine 1 replaces what the error said
    assert error.engines == (old, unknown) and str(error).endswith("engine 1 did not answer")
    assert error.failed_shards == (0, 1)


def test_a_bucket_is_at_least_one_mib() -> None:
    assert checked_buffer_size(MIN_BUFFER_BYTES) == MIN_BUFFER_BYTES == 1 << 20
    with pytest.raises(ValueError, match=r"buffer_size_bytes must be >= 1048576 \(1 MiB\)"):
        checked_buffer_size(32768)
    with pytest.raises(TypeError, match="must be an int"):
        checked_buffer_size(2.0**20)  # type: ignore[arg-type]


def test_the_user_facade_leaves_deadlines_to_the_backend_interface() -> None:
    import refit_core
    import refit_core.backend

    assert "Deadline" not in refit_core.__all__ and not hasattr(refit_core, "Deadline")
    assert "Deadline" in refit_core.backend.__all__


def test_deadline_arithmetic() -> None:
    assert Deadline.after(None).remaining_s() is None
    assert Deadline.never().timeout_for(3.0) == 3.0
    d = Deadline.after(0.05)
    assert d.armed and not d.expired()
    remaining = d.timeout_for(10.0)
    assert remaining is not None and remaining <= 0.05
    time.sleep(0.06)
    assert d.expired() and d.remaining_s() == 0.0
    with pytest.raises(RefitTimeoutError, match="before the broadcast"):
        d.check("the broadcast")
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(InvalidTimeoutError):
            Deadline.after(bad)


def test_frozen_types_pickle() -> None:
    spec = TensorSpec((4, 4), "float16")
    assert pickle.loads(pickle.dumps(spec)) == spec
