"""One keyed relay in a child process: retries, conflicts, corruption, old transfers, keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from relay_helpers import (
    KEY,
    KEY_VAR,
    TUNING,
    RelayFleet,
    Trainer,
    digests,
    fresh_trainer,
    held_digests,
)

from refit_core import AuthenticationError, ChecksumMismatchError, WeightVersion
from refit_core.backend import Deadline
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import (
    Acknowledged,
    RelayCoordinator,
    RelayStatus,
    StaleTransferError,
    TransferConflictError,
    ZmqSparseRefitClient,
    new_transfer_id,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def coordinator(keyed_relay: RelayFleet, api_key: str) -> Iterator[RelayCoordinator]:
    created = RelayCoordinator(api_key=api_key, timeout_s=4.0, tuning=TUNING)
    created.configure_tree(keyed_relay.addresses, deadline=Deadline.never())
    try:
        yield created
    finally:
        created.close()


@pytest.fixture
def trainer(coordinator: RelayCoordinator) -> Iterator[Trainer]:
    created = fresh_trainer(coordinator, seed=21, api_key_env_var=KEY_VAR)
    try:
        yield created
    finally:
        created.close()


def _client(relay: RelayFleet, key: str | None = KEY) -> ZmqSparseRefitClient:
    return ZmqSparseRefitClient(
        relay.addresses[0], timeout_s=4.0, producer_id="test", retries=0, api_key=key, tuning=TUNING
    )


def _payloads(trainer: Trainer, seed: int) -> list[DeltaPayload]:
    trainer.step(seed)
    tracker = trainer.shards[0].tracker
    return list(tracker.encode(trainer.state, WeightVersion(trainer.version + 1)))


def _send(
    client: ZmqSparseRefitClient, transfer_id: str, index: int, payload: DeltaPayload, **kw: object
) -> Acknowledged:
    base = payload.items[0].base
    fields: dict[str, object] = {
        "transfer_id": transfer_id,
        "payload_id": f"p{index}",
        "checksum": payload.checksum,
        "verification_candidates": 16,
        "body": payload,
        "base_version": None if base is None else base.value,
        **kw,
    }
    return client.send_payload(**fields, deadline=Deadline.never())  # type: ignore[arg-type]


def test_duplicate_and_retried_payloads_are_applied_once(
    keyed_relay: RelayFleet, coordinator: RelayCoordinator, trainer: Trainer
) -> None:
    payloads = _payloads(trainer, seed=1)
    transfer_id = new_transfer_id(trainer.version + 1)
    with _client(keyed_relay) as first, _client(keyed_relay) as retry:
        for index, payload in enumerate(payloads):
            assert _send(first, transfer_id, index, payload).duplicate is False
        # the same ids again: once on the same socket, once on a new one (a lazy-pirate retry)
        assert _send(first, transfer_id, 0, payloads[0]).duplicate is True
        assert _send(retry, transfer_id, 1, payloads[1]).duplicate is True
    outcome = coordinator.finish(
        transfer_id,
        len(payloads),
        expected_digests=digests(trainer.state),
        deadline=Deadline.never(),
    )
    assert outcome.committed, outcome.failures
    (report,) = outcome.reports.values()
    assert (report.applied, report.duplicates) == (len(payloads), 2)
    trainer.shards[0].tracker.commit()
    trainer.version += 1


def test_same_id_with_another_checksum_is_refused(
    keyed_relay: RelayFleet, coordinator: RelayCoordinator, trainer: Trainer
) -> None:
    before = held_digests(coordinator)
    payloads = _payloads(trainer, seed=2)
    assert len(payloads) >= 2
    transfer_id = new_transfer_id(trainer.version + 1)
    with _client(keyed_relay) as client:
        _send(client, transfer_id, 0, payloads[0])
        with pytest.raises(TransferConflictError, match="CONFLICT"):
            _send(client, transfer_id, 0, payloads[1])
    coordinator.decide(transfer_id, False, deadline=Deadline.never())
    trainer.shards[0].tracker.abort()
    assert held_digests(coordinator) == before


def test_corrupted_body_is_refused_and_nothing_applied(
    keyed_relay: RelayFleet, coordinator: RelayCoordinator, trainer: Trainer
) -> None:
    before = held_digests(coordinator)
    payload = _payloads(trainer, seed=3)[0]
    frames = [bytearray(memoryview(frame).cast("B")) for frame in payload.frames]
    frames[-1][len(frames[-1]) // 2] ^= 0x40  # one bit of the values, frames as sent
    transfer_id = new_transfer_id(trainer.version + 1)
    with _client(keyed_relay) as client:
        with pytest.raises(ChecksumMismatchError, match="CHECKSUM"):
            _send(client, transfer_id, 0, payload, body=[bytes(f) for f in frames])
        with pytest.raises(ChecksumMismatchError, match="declared"):
            _send(client, transfer_id, 1, payload, checksum="0" * 32)
    status = next(iter(coordinator.status(deadline=Deadline.never()).values()))
    assert isinstance(status, RelayStatus) and status.open is None, "nothing may stay applied"
    assert held_digests(coordinator) == before
    outcome = coordinator.finish(transfer_id, 1, deadline=Deadline.never())
    assert not outcome.committed and outcome.failures[0].code == "CHECKSUM"
    trainer.shards[0].tracker.abort()


def test_finished_transfer_ids_are_refused(
    keyed_relay: RelayFleet, coordinator: RelayCoordinator, trainer: Trainer
) -> None:
    trainer.step(seed=4)
    committed = trainer.transfer(coordinator, api_key_env_var=KEY_VAR).outcome.transfer_id
    payload = _payloads(trainer, seed=5)[0]
    aborted = new_transfer_id(trainer.version + 1)
    coordinator.decide(aborted, False, deadline=Deadline.never())
    with _client(keyed_relay) as client:
        for old in (committed, aborted):
            with pytest.raises(StaleTransferError, match="STALE_TRANSFER"):
                _send(client, old, 0, payload, base_version=None)  # refused before the items
    trainer.shards[0].tracker.abort()


@pytest.mark.parametrize("key", [None, "not-the-key"])
def test_missing_or_wrong_key_is_refused_and_nothing_applied(
    keyed_relay: RelayFleet, coordinator: RelayCoordinator, trainer: Trainer, key: str | None
) -> None:
    before = held_digests(coordinator)
    payload = _payloads(trainer, seed=6)[0]
    with _client(keyed_relay, key) as client, pytest.raises(AuthenticationError):
        _send(client, new_transfer_id(trainer.version + 1), 0, payload)
    trainer.shards[0].tracker.abort()
    status = next(iter(coordinator.status(deadline=Deadline.never()).values()))
    assert isinstance(status, RelayStatus) and status.open is None and status.transfer is None
    assert held_digests(coordinator) == before
