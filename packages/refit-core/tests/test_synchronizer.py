"""The ``WeightSynchronizer`` template methods, over a minimal in-test backend."""

from __future__ import annotations

import logging
import time

import pytest

from refit_core import (
    DeadlineTooShortError,
    InvalidTimeoutError,
    Recovery,
    RefitError,
    RefitResult,
    RefitTimeoutError,
    StagedRefit,
    SynchronizerClosedError,
    WeightSynchronizer,
)
from refit_core.backend import Deadline
from refit_core.fleet import EngineHealth, EngineStatus, FleetStatus


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


@pytest.mark.parametrize("failure", [RefitError("typed\nsecond line"), KeyError("boom")])
def test_a_failed_refit_logs_one_warning_line_and_its_traceback_at_debug(
    caplog: pytest.LogCaptureFixture, failure: BaseException
) -> None:
    sync = RecordingSynchronizer()
    sync.fail_with = failure
    with (
        caplog.at_level(logging.DEBUG, logger="refit_core.synchronizer"),
        pytest.raises(RefitError),
    ):
        sync.sync_weights()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = warnings
    assert warning.exc_info is None and "\n" not in warning.getMessage()
    assert warning.getMessage().startswith("RecordingSynchronizer: refit to version 1 failed: ")
    assert (
        "typed" if isinstance(failure, RefitError) else "KeyError: 'boom'"
    ) in warning.getMessage()
    traced = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert len(traced) == 1 and traced[0].exc_info[1] is failure  # type: ignore[index]


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
    with pytest.raises(InvalidTimeoutError, match="refit_timeout_s must be None or a positive"):
        RecordingSynchronizer(refit_timeout_s=0)


class FleetSynchronizer(RecordingSynchronizer):
    """An in-test backend over a dict fleet: shard -> served version, or a health."""

    def __init__(self, fleet: dict[int, int | EngineHealth]) -> None:
        super().__init__(refit_timeout_s=5.0)
        self.fleet = fleet
        self.absent: frozenset[int] = frozenset()

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        engines = []
        for shard, held in self.fleet.items():
            if isinstance(held, EngineHealth):
                engines.append(EngineStatus(shard, f"w{shard}", held, detail="test"))
            else:
                engines.append(EngineStatus(shard, f"w{shard}", EngineHealth.SERVING, held))
        return FleetStatus.of(engines)

    def _reconcile_communicator(self, absent_shards: frozenset[int], deadline: Deadline) -> None:
        self.calls.append(f"reconcile:{sorted(absent_shards)}")
        self.absent = absent_shards

    def _close_open_transfers(self, deadline: Deadline) -> None:
        self.calls.append("close_open")

    def live_shards(self) -> frozenset[int] | None:
        return frozenset(self.fleet) - self.absent

    def _sync_weights(self, version: int, deadline: Deadline) -> RefitResult:
        result = super()._sync_weights(version, deadline)
        for shard in self.live_shards() or ():
            self.fleet[shard] = version
        return result


def test_a_new_synchronizer_adopts_the_newest_version_the_fleet_serves() -> None:
    sync = FleetSynchronizer({0: 4, 1: 4})
    sync.init_communicator()
    assert sync.version == 4
    assert sync.sync_weights().version == 5
    disagreeing = FleetSynchronizer({0: 2, 1: 3})
    assert disagreeing.status().agreed_version is None
    disagreeing.init_communicator()
    assert disagreeing.version == 3


def test_status_reports_each_engine_and_whether_they_agree() -> None:
    sync = FleetSynchronizer({0: 1, 1: EngineHealth.CLOSED, 2: EngineHealth.UNREACHABLE})
    status = sync.status()
    assert status.serving() == {1: (0,)} and status.agreed_version == 1
    assert status.shards(EngineHealth.CLOSED) == (1,)
    assert status.shards(EngineHealth.UNREACHABLE) == (2,)
    assert not status.consistent
    assert "closed shards [1]" in status.describe()
    with pytest.raises(ValueError, match="serving engine"):
        EngineStatus(0, "w0", EngineHealth.CLOSED, version=3)


def test_recover_drops_the_dead_reopens_the_closed_and_leaves_one_version() -> None:
    sync = FleetSynchronizer({0: 2, 1: EngineHealth.CLOSED, 2: EngineHealth.UNREACHABLE, 3: 1})
    sync.init_communicator()
    report = sync.recover()
    assert report.dropped_shards == (2,)
    assert report.resync is not None and report.resync.version == 3
    assert sync.calls[-3:] == ["reconcile:[2]", "close_open", "sync:3"]
    live = [e for e in report.after.engines if e.shard != 2]
    assert {e.version for e in live} == {3} and sync.version == 3


def test_recover_of_a_healthy_fleet_moves_nothing() -> None:
    sync = FleetSynchronizer({0: 0, 1: 0})
    sync.sync_weights()
    report = sync.recover()
    assert report.resync is None and report.dropped_shards == ()
    assert sync.calls == ["init", "sync:1", "reconcile:[]", "close_open"]


def test_rows_without_a_fleet_status_say_so() -> None:
    with pytest.raises(NotImplementedError, match="cannot report"):
        RecordingSynchronizer().status()


class StagingSynchronizer(FleetSynchronizer):
    """An in-test row that stages: versions held beside the served ones until a commit."""

    supports_staging = True

    def __init__(self, fleet: dict[int, int | EngineHealth]) -> None:
        super().__init__(fleet)
        self.beside: dict[int, int] = {}

    def _stage_weights(self, version: int, deadline: Deadline) -> StagedRefit:
        self.calls.append(f"stage:{version}")
        if self.fail_with is not None:
            raise self.fail_with
        self.beside = dict.fromkeys(self.fleet, version)
        result = RefitResult(version, {}, 0.0, 1, 1)
        return StagedRefit(version, f"s{version}", result)

    def _commit_staged(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        self.calls.append(f"commit:{staged.version}")
        self.fleet.update(self.beside)
        self.beside = {}
        return staged.result

    def _abort_staged(self, staged: StagedRefit, deadline: Deadline) -> None:
        self.calls.append(f"abort:{staged.version}")
        self.beside = {}


def test_two_phases_serve_nothing_new_until_the_commit() -> None:
    sync = StagingSynchronizer({0: 0, 1: 0})
    staged = sync.stage_weights()
    assert staged.version == 1 and sync.staged is staged
    assert sync.status().serving() == {0: (0, 1)} and sync.version == 0
    with pytest.raises(RefitError, match="version 1 is staged"):
        sync.sync_weights()
    with pytest.raises(RefitError, match="version 1 is staged"):
        sync.stage_weights()
    assert sync.commit_weights(staged).version == 1
    assert sync.version == 1 and sync.status().agreed_version == 1 and sync.staged is None
    with pytest.raises(RefitError, match="not the pending staging"):
        sync.commit_weights(staged)


def test_an_aborted_staging_changes_nothing_and_frees_the_next_refit() -> None:
    sync = StagingSynchronizer({0: 0})
    staged = sync.stage_weights(version=5)
    sync.abort_weights(staged)
    assert sync.version == 0 and sync.status().agreed_version == 0 and sync.staged is None
    assert sync.stage_weights().version == 6, "version 5 was used: never again"
    sync.fail_with = RefitError("relay refused")
    sync.abort_weights(sync.staged)  # type: ignore[arg-type]
    with pytest.raises(RefitError, match="relay refused"):
        sync.stage_weights()
    assert sync.staged is None and sync.version == 0


def test_recover_drops_a_pending_staging_first() -> None:
    sync = StagingSynchronizer({0: 0, 1: 0})
    sync.sync_weights()
    sync.stage_weights()
    report = sync.recover()
    assert sync.calls == ["init", "sync:1", "stage:2", "abort:2", "reconcile:[]", "close_open"]
    assert sync.staged is None and sync.beside == {} and report.resync is None
    assert sync.stage_weights().version == 3, "the next staging starts afresh, above 2"


def test_a_row_that_cannot_stage_says_so() -> None:
    with pytest.raises(NotImplementedError, match="RecordingSynchronizer cannot stage"):
        RecordingSynchronizer().stage_weights()


def test_a_failed_refits_version_is_never_tried_again() -> None:
    sync = RecordingSynchronizer()
    sync.fail_with = RefitTimeoutError("frozen engine")
    with pytest.raises(RefitTimeoutError):
        sync.sync_weights()
    assert sync.version == 0 and sync.high_water_mark == 1
    sync.fail_with = None
    with pytest.raises(ValueError, match="not above 1"):
        sync.sync_weights(version=1)
    assert sync.sync_weights().version == 2
    assert sync.calls == ["init", "sync:1", "sync:2"]


class BeganSynchronizer(FleetSynchronizer):
    """A fleet whose engines also say the highest version they began."""

    def __init__(self, engines: list[EngineStatus]) -> None:
        super().__init__({})
        self.engines = engines

    def fleet_status(self, deadline: Deadline) -> FleetStatus:
        return FleetStatus.of(self.engines)


def test_a_new_synchronizer_continues_above_the_highest_version_any_engine_began() -> None:
    """A controller killed mid-refit leaves every engine closed: nothing is served, but the
    engines remember version 5 began; the next controller must not reuse 1-5."""
    closed = [
        EngineStatus(s, f"w{s}", EngineHealth.CLOSED, detail="partial", began_version=5)
        for s in (0, 1)
    ]
    sync = BeganSynchronizer(closed)
    sync.init_communicator()
    assert sync.version == 0 and sync.high_water_mark == 5
    assert sync.sync_weights().version == 6
    serving = [
        EngineStatus(0, "w0", EngineHealth.SERVING, 2, began_version=4),
        EngineStatus(1, "w1", EngineHealth.SERVING, 2, staged_version=3, began_version=2),
        EngineStatus(2, "w2", EngineHealth.UNREACHABLE, detail="frozen"),
    ]
    adopting = BeganSynchronizer(serving)
    adopting.init_communicator()
    assert adopting.version == 2 and adopting.high_water_mark == 4
    assert adopting.status().high_water_mark == 4


def test_status_names_left_out_shards_and_those_that_answer_again() -> None:
    sync = FleetSynchronizer({0: 1, 1: EngineHealth.UNREACHABLE, 2: 1})
    sync.init_communicator()
    sync.recover()
    assert sync.status().left_out == (1,) and sync.status().returned == ()
    sync.fleet[1] = 0  # the dropped engine answers again, on its old version
    status = sync.status()
    assert status.returned == (1,) and "left out shards [1]" in status.describe()
    report = sync.recover()
    assert report.dropped_shards == () and report.resync is not None
    assert sync.status().left_out == () and sync.status().consistent


def test_a_deadline_too_short_says_what_the_transfer_needed_and_needs_a_fix() -> None:
    import pickle

    error = DeadlineTooShortError.measured(
        "refit to version 3", deadline_s=2.0, elapsed_s=2.0, progress=0.25
    )
    assert error.recovery is Recovery.FIX and not error.is_retryable
    assert isinstance(error, RefitTimeoutError) and error.needed_s == pytest.approx(8.0)
    assert "needs about 8.0 s" in str(error) and "refit_timeout_s=2 s" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.needed_s, copy.deadline_s, copy.recovery) == (8.0, 2.0, Recovery.FIX)
    unknown = DeadlineTooShortError.measured("x", deadline_s=1.0, elapsed_s=1.0, progress=0.0)
    assert unknown.needed_s is None and "nothing of it moved" in str(unknown)


def test_a_shard_of_several_workers_is_named_once() -> None:
    workers = [EngineStatus(0, f"w{rank}", EngineHealth.SERVING, 2) for rank in range(2)]
    status = FleetStatus.of([*workers, EngineStatus(1, "w2", EngineHealth.SERVING, 2)])
    assert status.serving() == {2: (0, 1)} and status.shards(EngineHealth.SERVING) == (0, 1)


def test_recover_with_no_engine_answering_drops_nothing_and_says_try_again() -> None:
    sync = FleetSynchronizer({0: EngineHealth.UNREACHABLE, 1: EngineHealth.UNREACHABLE})
    with pytest.raises(RefitTimeoutError, match="no engine answered") as failed:
        sync.recover()
    assert failed.value.recovery is Recovery.RECOVER and failed.value.failed_shards == (0, 1)
    assert not any(call.startswith("reconcile") for call in sync.calls)
