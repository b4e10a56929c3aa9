"""Seven relays in child processes, one tree: commits are bitwise, failures roll back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from relay_helpers import (
    TUNING,
    RelayFleet,
    RelaySpec,
    Trainer,
    digests,
    fresh_trainer,
    held_digests,
    make_state,
)

from refit_core import (
    EngineState,
    NamedTensor,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    StateDictInfo,
)
from refit_core.backend import Deadline
from refit_core.sources import StateDictSource
from refit_zmq.relay import (
    FlushReport,
    RelayCoordinator,
    RelayStatus,
    RelayTree,
    SubtreeReport,
    TransferOptions,
    TransferState,
    decide_transfer,
    new_transfer_id,
    prepare_transfer,
    run_transfer,
    stream_sparse_delta_payloads_via_zmq,
)
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.control import ControlChannel
from refit_zmq.relay.wire.frames import Kind

pytestmark = pytest.mark.timeout(240)

RELAYS = 7


@pytest.fixture(scope="module")
def fleet() -> Iterator[RelayFleet]:
    with RelayFleet([RelaySpec()] * RELAYS) as relays:
        yield relays


@pytest.fixture
def coordinator(fleet: RelayFleet) -> Iterator[RelayCoordinator]:
    created = RelayCoordinator(api_key=None, timeout_s=15.0, tuning=TUNING)
    created.configure_tree(fleet.addresses, deadline=Deadline.never())
    try:
        yield created
    finally:
        created.close()


def test_sparse_commits_from_three_roots_are_bitwise_on_every_relay(
    fleet: RelayFleet, coordinator: RelayCoordinator
) -> None:
    trainer = fresh_trainer(coordinator, seed=11, shard_count=3)
    try:
        for step in range(2):
            trainer.step(seed=100 + step)
            result = trainer.transfer(coordinator)
            held = held_digests(coordinator)
            assert all(d == digests(trainer.state) for d in held.values()), "not bitwise"
            dense = sum(t.numel() * t.element_size() for t in trainer.state.values())
            assert result.total("dense_bytes") == dense
            assert result.total("wire_bytes") < dense / 10, "a 1% step must travel sparse"
            payloads = result.total("payloads")
            reports = result.outcome.reports
            assert {a: r.applied for a, r in reports.items()} == dict.fromkeys(
                fleet.addresses, payloads
            )
        tree = RelayTree.of(fleet.addresses, TUNING.fanout)
        inner = {
            a for root in fleet.addresses[:3] for a in fleet.addresses if tree.children(root, a)
        }
        forwarding = {a for a, r in reports.items() if r.bytes_forwarded > 0}
        assert forwarding == inner, "three roots must use three rotated trees"
        assert len(inner) == 5
        statuses = coordinator.status(deadline=Deadline.never())
        assert {s.version for s in statuses.values() if isinstance(s, RelayStatus)} == {
            trainer.version
        }
    finally:
        trainer.close()


def test_stale_relay_is_reported_then_resynced_densely(
    fleet: RelayFleet, coordinator: RelayCoordinator
) -> None:
    trainer = fresh_trainer(coordinator, seed=12)
    stale = fleet.addresses[2]
    try:
        coordinator.configure_tree(
            [a for a in fleet.addresses if a != stale], deadline=Deadline.never()
        )
        trainer.step(seed=200)
        trainer.transfer(coordinator)  # the stale relay misses this version
        coordinator.configure_tree(fleet.addresses, deadline=Deadline.never())
        before = held_digests(coordinator)
        trainer.step(seed=201)
        with pytest.raises(StaleBaseError, match=stale) as refused:
            trainer.transfer(coordinator)
        assert stale in str(refused.value)
        assert held_digests(coordinator) == before, "the refused transfer must roll back"

        versions = {
            a: s.version
            for a, s in coordinator.status(deadline=Deadline.never()).items()
            if isinstance(s, RelayStatus)
        }
        behind = sorted(a for a, v in versions.items() if v != trainer.version)
        assert behind == [stale]
        result = trainer.transfer(coordinator, resync=True)
        assert result.total("wire_bytes") >= result.total("dense_bytes") / 2, "a dense resync"
        assert all(d == digests(trainer.state) for d in held_digests(coordinator).values())
    finally:
        coordinator.configure_tree(fleet.addresses, deadline=Deadline.never())
        trainer.close()


@pytest.mark.timeout(300)
def test_relay_killed_mid_transfer_rolls_back_survivors_then_tree_without_it_commits() -> None:
    victim = 1  # inner in the tree rooted at relay 0: relays 3 and 4 hang below it
    specs = [RelaySpec(timeout_s=6.0)] * RELAYS
    specs[victim] = RelaySpec(timeout_s=6.0, die_at=(2, 2))  # second payload of the 2nd transfer
    with RelayFleet(specs) as fleet:
        coordinator = RelayCoordinator(api_key=None, timeout_s=6.0, tuning=TUNING)
        coordinator.configure_tree(fleet.addresses, deadline=Deadline.never())
        assert RelayTree.of(fleet.addresses, 2).children(fleet.addresses[0], fleet.addresses[1])
        trainer: Trainer | None = None
        try:
            trainer = fresh_trainer(coordinator, seed=13, timeout_s=6.0)
            previous = digests(trainer.state)
            trainer.step(seed=300, density=0.5)
            with pytest.raises(RefitError, match=fleet.addresses[victim]) as failed:
                trainer.transfer(coordinator, timeout_s=6.0)
            assert isinstance(failed.value, RefitTimeoutError)
            assert str(failed.value).index(fleet.addresses[victim]) < 80, "dead relay first"
            fleet.processes[victim].join(5)
            assert fleet.processes[victim].exitcode == -9, "the victim died mid-transfer"
            survivors = [a for i, a in enumerate(fleet.addresses) if i != victim]
            held = held_digests(coordinator)
            assert held[fleet.addresses[victim]] is None
            assert all(held[a] == previous for a in survivors), "survivors must roll back"

            coordinator.configure_tree(survivors, deadline=Deadline.never())
            trainer.transfer(coordinator, timeout_s=6.0)
            assert all(d == digests(trainer.state) for d in held_digests(coordinator).values())
        finally:
            if trainer is not None:
                trainer.close()
            coordinator.close()


@pytest.mark.timeout(120)
def test_a_frozen_child_is_given_up_once_per_transfer_and_the_rest_goes_past_it() -> None:
    # a payload stays staged at the root until every child took it, and the root stages two
    # per tree: offered to the frozen child again, every later pair would wait a timeout there
    # and the producer, waiting as long for READY, would give up on the live root instead
    with RelayFleet([RelaySpec(timeout_s=3.0)] * 2) as fleet:
        root, frozen = fleet.addresses
        coordinator = RelayCoordinator(api_key=None, timeout_s=3.0, tuning=TUNING)
        coordinator.configure_tree(fleet.addresses, deadline=Deadline.never())
        channel = ControlChannel(signer=Signer(None), tuning=TUNING)
        trainer: Trainer | None = None
        try:
            trainer = fresh_trainer(coordinator, seed=19, timeout_s=3.0)
            before = held_digests(coordinator)[root]
            trainer.step(seed=190, density=0.6)
            transfer_id = new_transfer_id(trainer.version + 1)
            os.kill(fleet.pids[1], signal.SIGSTOP)
            try:
                stats = _stream_one_shard(trainer, [root], transfer_id, timeout_s=3.0)
                assert stats["payloads"] > 2 * TUNING.window_payloads, "enough for a cascade"
                fields = {
                    "transfer_id": transfer_id,
                    "expected_payloads": stats["payloads"],
                    "wait_s": 5.0,
                }
                reply = channel.call({root: (Kind.FLUSH, fields)}, reply_within_s=10.0)[root]
                assert isinstance(reply, dict), reply
                report = FlushReport.from_json(reply)
                assert report.applied == stats["payloads"], "the root applied every payload"
                counts = report.children[frozen]
                assert counts.failed == counts.forwarded <= TUNING.window_payloads
                coordinator.decide(transfer_id, False, deadline=Deadline.never())
                trainer.shards[0].tracker.abort()
                assert held_digests(coordinator)[root] == before
            finally:
                os.kill(fleet.pids[1], signal.SIGCONT)
        finally:
            channel.close()
            if trainer is not None:
                trainer.close()
            coordinator.close()


def test_a_decision_a_relay_missed_is_finished_by_reconcile() -> None:
    # the relays would settle the missed decisions themselves after their timeout (their own
    # test below); a long one leaves it to the coordinator here
    specs = [
        RelaySpec(timeout_s=120.0),
        RelaySpec(timeout_s=120.0, fail_once=("commit",)),
        RelaySpec(timeout_s=120.0, fail_once=("rollback",)),
    ]
    with RelayFleet(specs) as fleet:
        coordinator = RelayCoordinator(api_key=None, timeout_s=15.0, tuning=TUNING)
        trainer: Trainer | None = None
        try:
            coordinator.configure_tree(fleet.addresses, deadline=Deadline.never())
            trainer = Trainer(make_state(61), version=0)
            result = trainer.transfer(coordinator, resync=True)  # relay 1 misses the commit
            missed = fleet.addresses[1]
            assert result.outcome.committed and set(result.outcome.decision_errors) == {missed}
            held = coordinator.status(deadline=Deadline.never())[missed]
            assert isinstance(held, RelayStatus) and held.open is not None
            assert (held.version, held.open.target) == (0, 1), "applied, undo held"
            assert held.transfer is not None and held.transfer.state is TransferState.PREPARED
            statuses = coordinator.close_open_transfers(deadline=Deadline.never())
            assert {s.version for s in statuses.values() if isinstance(s, RelayStatus)} == {1}
            assert all(d == digests(trainer.state) for d in held_digests(coordinator).values())

            before = held_digests(coordinator)
            trainer.step(seed=62)
            transfer_id = new_transfer_id(2)
            _stream_one_shard(trainer, fleet.addresses, transfer_id, timeout_s=15.0)
            _, errors = coordinator.decide(
                transfer_id, False, deadline=Deadline.never()
            )  # relay 2 misses the rollback
            trainer.shards[0].tracker.abort()
            assert set(errors) == {fleet.addresses[2]}
            unrolled = coordinator.status(deadline=Deadline.never())[fleet.addresses[2]]
            assert isinstance(unrolled, RelayStatus) and unrolled.transfer is None
            assert unrolled.open is not None, "the receiver still holds what the ledger closed"
            assert unrolled.open_transfers == {transfer_id}
            coordinator.close_open_transfers(deadline=Deadline.never())
            assert held_digests(coordinator) == before
        finally:
            if trainer is not None:
                trainer.close()
            coordinator.close()


def test_subtree_flush_of_the_root_reports_every_relay_of_its_tree(
    fleet: RelayFleet, coordinator: RelayCoordinator
) -> None:
    trainer = fresh_trainer(coordinator, seed=13)
    channel = ControlChannel(signer=Signer(None), tuning=TUNING)
    try:
        trainer.step(seed=130)
        result = trainer.transfer(coordinator)
        transfer_id = result.outcome.transfer_id
        payloads = result.total("payloads")
        tree = RelayTree.of(fleet.addresses, TUNING.fanout)
        root, leaf = fleet.addresses[0], fleet.addresses[-1]
        assert not tree.children(root, leaf), "the last relay is a leaf of the root's tree"

        def subtree_of(relay: str) -> dict[str, FlushReport]:
            fields = {
                "transfer_id": transfer_id,
                "expected_payloads": payloads,
                "wait_s": 5.0,
                "subtree": True,
            }
            reply = channel.call({relay: (Kind.FLUSH, fields)}, reply_within_s=30.0)[relay]
            assert isinstance(reply, dict), reply
            return dict(SubtreeReport.from_json(reply).relays)

        everyone = subtree_of(root)
        assert set(everyone) == set(fleet.addresses), "the root's subtree is the whole tree"
        assert all(r.complete and r.applied == payloads for r in everyone.values())
        assert all(r.transfer_id == transfer_id for r in everyone.values())
        assert set(subtree_of(leaf)) == {leaf}, "a leaf's subtree is itself"
    finally:
        channel.close()
        trainer.close()


class _StalledWeights:
    """A trainer rank frozen in the middle of producing its weights (a hung gather, say)."""

    def __init__(self, state: dict[str, torch.Tensor], stall_s: float) -> None:
        self._source = StateDictSource(state)
        self._stall_s = stall_s

    def state_dict_info(self) -> StateDictInfo:
        return self._source.state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        tensors = self._source.iter_tensors()
        yield next(tensors)
        time.sleep(self._stall_s)
        yield from tensors


def test_wedged_producer_is_named_at_the_deadline_and_nothing_is_half_applied(
    fleet: RelayFleet, coordinator: RelayCoordinator
) -> None:
    trainer = fresh_trainer(coordinator, seed=17, shard_count=2)
    try:
        before = held_digests(coordinator)
        trainer.step(seed=170)
        stalled = trainer.state
        trainer.weight_source = lambda: _StalledWeights(stalled, stall_s=4.0)  # type: ignore[method-assign]
        options = TransferOptions(None, 15.0, TUNING, None, 32)
        started = time.monotonic()
        with pytest.raises(RefitTimeoutError) as caught:
            run_transfer(
                coordinator,
                trainer.participants,
                target_version=trainer.version + 1,
                resync=False,
                options=options,
                deadline=Deadline.after(1.0),
            )
        assert time.monotonic() - started < 1.0 + 1.0, "not released by the deadline"
        assert set(caught.value.wedged_workers) == {"producer 0", "producer 1"}
        assert {e.state for e in caught.value.engines} == {EngineState.OLD}
        assert held_digests(coordinator) == before, "a relay kept part of the aborted refit"
        time.sleep(4.0)  # the stalled producers wake up, find the transfer aborted, abort
        assert all(p.tracker.pending is None for p in trainer.shards)
    finally:
        trainer.close()


def _stream_one_shard(
    trainer: Trainer, targets: list[str], transfer_id: str, *, timeout_s: float
) -> dict[str, int]:
    """Stream the trainer's single shard as ``transfer_id`` (no FLUSH, no decision)."""
    return stream_sparse_delta_payloads_via_zmq(
        trainer.state,
        delta_tracker=trainer.shards[0].tracker,
        refit_targets=targets,
        transfer_id=transfer_id,
        api_key_env_var=None,
        timeout_s=timeout_s,
        shard_rank=0,
        shard_count=1,
        tuning=TUNING,
        deadline=Deadline.never(),
    )


def test_a_prepared_transfer_waits_for_its_decision_and_an_abort_keeps_the_baselines(
    fleet: RelayFleet, coordinator: RelayCoordinator
) -> None:
    """The two phases apart (a staged refit): every relay holds the transfer prepared, with
    its version unmoved, until the decision; after an abort the trackers' baselines are
    the receivers' bits, so the next transfer is again a delta and lands bitwise."""
    trainer = fresh_trainer(coordinator, seed=15, shard_count=2)
    try:
        before = digests(trainer.state)
        trainer.step(seed=500)
        options = TransferOptions(None, 15.0, TUNING, None, 32)
        prepared = prepare_transfer(
            coordinator,
            trainer.participants,
            target_version=trainer.version + 1,
            resync=False,
            options=options,
            deadline=Deadline.never(),
        )
        time.sleep(1.0)  # the decision may come later: nothing settles it meanwhile
        statuses = coordinator.status(deadline=Deadline.never())
        assert {s.version for s in statuses.values() if isinstance(s, RelayStatus)} == {
            trainer.version
        }
        assert all(
            isinstance(s, RelayStatus)
            and s.transfer is not None
            and s.transfer.state is TransferState.PREPARED
            for s in statuses.values()
        ), statuses
        aborted = decide_transfer(
            coordinator,
            trainer.participants,
            prepared,
            commit=False,
            options=options,
            deadline=Deadline.never(),
        )
        assert not aborted.outcome.committed and not aborted.outcome.decision_errors
        assert all(d == before for d in held_digests(coordinator).values()), "rolled back"
        result = trainer.transfer(coordinator)  # the same step again, as a delta
        dense = sum(t.numel() * t.element_size() for t in trainer.state.values())
        assert result.total("wire_bytes") < dense / 10, "the abort forced no resync"
        assert all(d == digests(trainer.state) for d in held_digests(coordinator).values())
    finally:
        trainer.close()
