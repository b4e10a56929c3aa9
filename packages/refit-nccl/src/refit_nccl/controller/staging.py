"""Two-phase refits over the collective group (:class:`Staging`): every engine receives the
whole refit into a host copy beside it while it keeps serving, then all commit it at once (or
drop it)."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from typing import Any, cast

from refit_core import RefitResult, StagedRefit, WorkerOutcome
from refit_core.backend import Deadline, Participant, gather
from refit_nccl.controller.failures import Failures
from refit_nccl.controller.formation import FormedGroup, GroupFormation
from refit_nccl.controller.waits import Waits, time_left
from refit_nccl.roles.contract import (
    CollectiveEngineRole,
    CollectiveMemberRole,
    CollectiveStagingRole,
    CommitStats,
)
from refit_nccl.transfer.stats import TransferStats

__all__ = ["Staging"]


class Staging:
    """Stages refits on the engines of the formed group, and commits or drops them.

    Args:
        owner: the synchronizer's name, for errors.
        formation: the group the refits run over.
        waits: how long to wait for the participants.
        failures: builds the error of a failed step.
    """

    def __init__(
        self, owner: str, formation: GroupFormation, waits: Waits, failures: Failures
    ) -> None:
        self._owner = owner
        self._formation = formation
        self._waits = waits
        self._failures = failures
        self._staged_on: dict[str, tuple[Participant[CollectiveStagingRole], ...]] = {}

    def stage(self, version: int, deadline: Deadline) -> StagedRefit:
        """Broadcast ``version`` into every engine's staging copy; the engines keep serving.

        Raises:
            NotImplementedError: an engine participant cannot stage.
            RefitError: the staging failed (nothing is staged anywhere).
        """
        group = self._formation.usable()
        engines = self._staging_engines(group, deadline)
        started = time.monotonic()
        what = f"staging version {version}"
        left = time_left(deadline, what)
        calls: dict[Participant[Any], Future[TransferStats]] = {
            p: p.call(CollectiveMemberRole.refit_transfer, version, left)
            for p in group.members.values()
            if p not in group.engines
        }
        calls.update({e: e.call(CollectiveStagingRole.refit_stage, version, left) for e in engines})
        gathered = self._waits.collective(calls, deadline, group.abort)
        if not gathered.ok:
            self._formation.invalidate(group, f"{what} failed")
            for engine in engines:
                engine.call(CollectiveStagingRole.refit_drop_staged, version)
            raise self._failures.error(what, gathered, deadline, target=version, started=started)
        sender: TransferStats = gathered.results[group.members[0]]
        received: list[TransferStats] = [gathered.results[e] for e in engines]
        staging_id = f"{group.name}/{version}/{uuid.uuid4().hex[:8]}"
        self._staged_on = {staging_id: engines}
        elapsed = time.monotonic() - started
        result = RefitResult(
            version=version,
            timings_s={
                "transfer": elapsed,
                "pack": sender.pack_s,
                "send_wait": sender.wait_s,
                "receive_wait": max(s.wait_s for s in received),
            },
            total_s=elapsed,
            wire_bytes=sender.wire_bytes,
            dense_bytes=sender.dense_bytes,
            workers=tuple(WorkerOutcome(p.label, True, None) for p in engines),
        )
        return StagedRefit(version, staging_id, result)

    def commit(self, staged: StagedRefit, deadline: Deadline) -> RefitResult:
        """Have every engine serve the staged version (each pauses for its own load)."""
        engines = self._staged_on.pop(staged.staging_id)
        version = staged.version
        started = time.monotonic()
        committed = gather(
            {e: e.call(CollectiveStagingRole.refit_commit_staged, version) for e in engines},
            self._waits.control_s(deadline),
        )
        if not committed.ok:
            self._formation.invalidate_current(f"commit of version {version} failed")
            raise self._failures.error(
                f"commit of version {version}", committed, deadline, target=version
            )
        commit_s = time.monotonic() - started
        stats: list[CommitStats] = [committed.results[e] for e in engines]
        return RefitResult(
            version=version,
            timings_s={
                **staged.result.timings_s,
                "commit": commit_s,
                "pause": max(s.paused_s for s in stats),
            },
            total_s=staged.result.total_s + commit_s,
            wire_bytes=staged.result.wire_bytes,
            dense_bytes=staged.result.dense_bytes,
            workers=tuple(WorkerOutcome(e.label, True, version) for e in engines),
        )

    def abort(self, staged: StagedRefit, deadline: Deadline) -> None:
        """Have every engine drop the staged version."""
        engines = self._staged_on.pop(staged.staging_id)
        dropped = gather(
            {e: e.call(CollectiveStagingRole.refit_drop_staged, staged.version) for e in engines},
            self._waits.control_s(deadline),
        )
        if not dropped.ok:
            raise self._failures.error(
                f"abort of staged version {staged.version}", dropped, deadline
            )

    def _staging_engines(
        self, group: FormedGroup, deadline: Deadline
    ) -> tuple[Participant[CollectiveStagingRole], ...]:
        """The group's engines as staging participants, once each said it can stage.

        Raises:
            NotImplementedError: an engine participant cannot stage (named by its type).
        """
        asked = gather(
            {e: e.call(CollectiveEngineRole.refit_status) for e in group.engines},
            self._waits.control_s(deadline),
        )
        cannot = [
            e
            for e in group.engines
            if isinstance(asked.errors.get(e), NotImplementedError)
            or (e in asked.results and not asked.results[e].can_stage)
        ]
        if cannot:
            who = ", ".join(f"{e.label} ({type(e).__name__})" for e in cannot)
            raise NotImplementedError(
                f"{self._owner} cannot stage: these engine participants cannot ({who}); "
                "use sync_weights()"
            )
        if not asked.ok:
            raise self._failures.error("asking the engines whether they can stage", asked, deadline)
        # Each one said it serves CollectiveStagingRole's methods.
        return tuple(cast("Participant[CollectiveStagingRole]", e) for e in group.engines)
