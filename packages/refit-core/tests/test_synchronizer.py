"""The ``WeightSynchronizer`` template methods, over a minimal in-test backend."""

from __future__ import annotations

import time

import pytest

from refit_core import (
    Recovery,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    SynchronizerClosedError,
    WeightSynchronizer,
)
from refit_core.backend import Deadline


class RecordingSynchronizer(WeightSynchronizer):
    """Records hook calls; ``fail_with`` makes the next refit raise."""

    def __init__(self, refit_timeout_s: float | None = None) -> None:
        super().__init__(refit_timeout_s=refit_timeout_s)
        self.calls: list[str] = []
        self.fail_with: BaseException | None = None
        self.deadlines: list[Deadline] = []

    def _init_communicator(self, deadline: Deadline) -> None:
        self.calls.append("init")

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        self.calls.append(f"sync:{version}")
        self.deadlines.append(deadline)
        if self.fail_with is not None:
            raise self.fail_with
        return RefitResult(version=version, timings_s={}, total_s=0.0, wire_bytes=1, dense_bytes=1)

    def _shutdown(self) -> None:
        self.calls.append("shutdown")


def test_versions_increase_by_default_and_init_runs_once() -> None:
    sync = RecordingSynchronizer()
    assert sync.sync_weights().version == 1
    assert sync.sync_weights().version == 2
    assert sync.sync_weights(version=7).version == 7
    assert sync.version == 7
    assert sync.calls == ["init", "sync:1", "sync:2", "sync:7"]


@pytest.mark.parametrize("version", [0, 3])
def test_non_increasing_version_is_refused(version: int) -> None:
    sync = RecordingSynchronizer()
    sync.sync_weights(version=3)
    with pytest.raises(ValueError, match="must increase"):
        sync.sync_weights(version=version)
    assert sync.version == 3


def test_foreign_errors_are_wrapped_and_version_kept() -> None:
    sync = RecordingSynchronizer()
    sync.fail_with = KeyError("boom")
    with pytest.raises(RefitError, match="refit to version 1 failed: KeyError") as info:
        sync.sync_weights()
    assert isinstance(info.value.__cause__, KeyError)
    assert sync.version == 0


def test_timeouts_become_refit_timeout_errors() -> None:
    sync = RecordingSynchronizer()
    sync.fail_with = TimeoutError("socket")
    with pytest.raises(RefitTimeoutError) as info:
        sync.sync_weights()
    assert info.value.recovery is Recovery.RECOVER


def test_refit_errors_pass_through_unchanged() -> None:
    sync = RecordingSynchronizer()
    error = RefitError("typed")
    sync.fail_with = error
    with pytest.raises(RefitError) as info:
        sync.sync_weights()
    assert info.value is error


def test_each_refit_gets_a_fresh_deadline() -> None:
    sync = RecordingSynchronizer(refit_timeout_s=30.0)
    sync.sync_weights()
    time.sleep(0.01)
    sync.sync_weights()
    first, second = sync.deadlines
    assert first.at is not None and second.at is not None and second.at > first.at
    disarmed = RecordingSynchronizer()
    disarmed.sync_weights()
    assert not disarmed.deadlines[0].armed


def test_shutdown_is_idempotent_and_final() -> None:
    sync = RecordingSynchronizer()
    sync.shutdown()
    sync.shutdown()
    assert sync.calls.count("shutdown") == 1
    for call in (
        sync.sync_weights,
        sync.init_communicator,
        sync.is_stale,
        sync.reconcile_communicator,
    ):
        with pytest.raises(SynchronizerClosedError):
            call()


def test_reconcile_without_change_is_noop_and_absent_shards_refused_without_membership() -> None:
    sync = RecordingSynchronizer()
    sync.reconcile_communicator()
    assert not sync.is_stale()
    with pytest.raises(NotImplementedError, match="no membership"):
        sync.reconcile_communicator({1})
    with pytest.raises(ValueError, match=">= 0"):
        sync.reconcile_communicator({-1})


def test_invalid_timeout_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="positive"):
        RecordingSynchronizer(refit_timeout_s=0)
