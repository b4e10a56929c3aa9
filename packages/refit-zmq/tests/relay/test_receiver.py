"""TensorReceiver: transactional apply, commit and rollback, in one process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from relay_helpers import MiB, Trainer, digests, make_state

from refit_core import (
    ChecksumMismatchError,
    ProtocolError,
    StaleBaseError,
    VerificationError,
    WeightVersion,
)
from refit_zmq.codec import DeltaPayload
from refit_zmq.relay import (
    AbortReply,
    CommitReply,
    StaleTransferError,
    TensorReceiver,
    TransferConflictError,
)
from refit_zmq.relay.apply.receiver import as_receiver


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    created = Trainer(make_state(1), version=3)
    try:
        yield created
    finally:
        created.close()


def _payloads(trainer: Trainer, seed: int = 5) -> list[DeltaPayload]:
    trainer.step(seed, density=0.05)
    target = WeightVersion(trainer.version + 1)
    return list(trainer.shards[0].tracker.encode(trainer.state, target))


T1 = "v4-0000000000000001"
T2 = "v4-0000000000000002"


def _meta(payload: DeltaPayload, transfer: str = T1, candidates: int = 64) -> dict[str, Any]:
    item = payload.items[0]
    return {
        "transfer_id": transfer,
        "checksum": payload.checksum,
        "verification_candidates": candidates,
        "base": None if item.base is None else item.base.value,
        "target": item.target.value,
    }


def _receiver(version: int | None = 3, **kw: Any) -> tuple[TensorReceiver, dict[str, torch.Tensor]]:
    tensors = make_state(1)
    return TensorReceiver(tensors, version=version, **kw), tensors


def test_commit_adopts_the_new_bits_and_version(trainer: Trainer) -> None:
    committed: list[int] = []
    receiver, tensors = _receiver(on_commit=committed.append)
    for payload in _payloads(trainer):
        result = receiver.apply(memoryview(payload.to_bytes()), _meta(payload))
        assert result.verified > 0
    opened = receiver.status().open
    assert opened is not None and opened.transfer_id == T1
    assert receiver.commit(T1) == CommitReply(T1, 4, committed=True)
    assert digests(tensors) == digests(trainer.state) and committed == [4]
    assert receiver.commit(T1).committed is False, "a repeated commit is a no-op"
    with pytest.raises(StaleTransferError, match="committed"):
        receiver.rollback(T1)


def test_rollback_restores_every_bit(trainer: Trainer) -> None:
    rolled: list[int] = []
    receiver, tensors = _receiver(on_rollback=rolled.append)
    before = digests(tensors)
    for payload in _payloads(trainer):
        receiver.apply(memoryview(payload.to_bytes()), _meta(payload))
    assert receiver.rollback(T1) == AbortReply(T1, 3, aborted=True, restored=True)
    assert digests(tensors) == before and rolled == [4]  # the target rolled back
    assert receiver.rollback(T1).restored is False
    assert receiver.status().open is None


@pytest.mark.parametrize(
    ("version", "metadata", "error", "begun"),
    [
        (2, {}, StaleBaseError, False),
        (3, {"checksum": "f" * 32}, ChecksumMismatchError, True),  # known after its writes
        (3, {"target": 5}, ProtocolError, False),  # the BEGIN says 5, the items say 4
        (3, {"base": None}, ProtocolError, False),  # the BEGIN says resync, the items a delta
    ],
)
def test_refused_payloads_touch_nothing(
    trainer: Trainer, version: int, metadata: dict[str, Any], error: type[Exception], begun: bool
) -> None:
    """Nothing of a refused payload stays written. A transfer whose first payload is refused
    after its engine was told it began ends there: the engine is told (every transfer begun
    ends in a commit or a rollback), and a later payload of it is refused."""
    events: list[str] = []
    receiver, tensors = _receiver(
        version,
        on_begin=lambda v: events.append(f"begin {v}"),
        on_rollback=lambda v: events.append(f"rollback {v}"),
    )
    before = digests(tensors)
    first, second = _payloads(trainer)[:2]
    with pytest.raises(error):
        receiver.apply(memoryview(first.to_bytes()), {**_meta(first), **metadata})
    assert digests(tensors) == before and receiver.status().open is None
    assert events == (["begin 4", "rollback 4"] if begun else [])
    if begun:
        with pytest.raises(StaleTransferError, match="ended"):
            receiver.apply(memoryview(second.to_bytes()), _meta(second))
        assert digests(tensors) == before and len(events) == 2


def test_a_transfer_whose_payload_was_abandoned_still_ends_for_its_engine(
    trainer: Trainer,
) -> None:
    """A relay that gives up a payload half-fed (its transfer aborted while the receiver was
    held, as by an engine frozen in on_refit_begin) undoes it and tells the engine; a late
    payload of the ended transfer is refused untouched; a transfer that kept a payload ends
    at its rollback, which tells the engine too."""
    events: list[str] = []
    receiver, tensors = _receiver(
        on_begin=lambda v: events.append(f"begin {v}"),
        on_rollback=lambda v: events.append(f"rollback {v}"),
    )
    before = digests(tensors)
    first, second = _payloads(trainer)[:2]
    sink = receiver.open_payload(_meta(first))
    body = first.to_bytes()
    sink.feed(memoryview(body)[: len(body) // 2 + 1])
    assert events == ["begin 4"] and receiver.status().began == 4
    sink.abandon()
    assert digests(tensors) == before and events == ["begin 4", "rollback 4"]
    assert receiver.status().open is None and not receiver.rollback(T1).aborted
    with pytest.raises(StaleTransferError, match="ended"):
        receiver.apply(memoryview(second.to_bytes()), _meta(second))
    assert digests(tensors) == before and events == ["begin 4", "rollback 4"]
    status = receiver.status()
    assert (status.version, status.began, status.open) == (3, 4, None)

    receiver.apply(memoryview(first.to_bytes()), _meta(first, transfer=T2))
    held = receiver.open_payload(_meta(second, transfer=T2))
    held.feed(memoryview(second.to_bytes())[:10])
    held.abandon()
    assert events[-1] == "begin 4", "a payload kept: the transfer stays open until its end"
    assert receiver.rollback(T2).restored and events[-1] == "rollback 4"
    assert digests(tensors) == before


def test_one_transfer_at_a_time_and_versions_only_advance(trainer: Trainer) -> None:
    receiver, _ = _receiver()
    first, second = _payloads(trainer)[:2]
    receiver.apply(memoryview(first.to_bytes()), _meta(first))
    with pytest.raises(TransferConflictError, match="open"):
        receiver.apply(memoryview(second.to_bytes()), _meta(second, transfer=T2))
    receiver.rollback(T1)
    ahead, _ = _receiver(version=None)
    dense = Trainer(make_state(1), version=0)
    try:
        resync = next(
            iter(dense.shards[0].tracker.encode(dense.state, WeightVersion(4), resync=True))
        )
    finally:
        dense.close()
    stale, stale_tensors = _receiver(version=4)
    before = digests(stale_tensors)
    with pytest.raises(StaleTransferError, match="holds 4"):
        stale.apply(memoryview(resync.to_bytes()), _meta(resync))
    assert digests(stale_tensors) == before
    assert ahead.apply(memoryview(resync.to_bytes()), _meta(resync)).items >= 1


def test_undo_budget_refuses_a_payload_whole(trainer: Trainer) -> None:
    receiver, tensors = _receiver(max_undo_bytes=16)
    before = digests(tensors)
    payload = _payloads(trainer)[0]
    with pytest.raises(ProtocolError, match="undo"):
        receiver.apply(memoryview(payload.to_bytes()), _meta(payload))
    assert digests(tensors) == before


def test_read_back_catches_a_write_that_did_not_land() -> None:
    """Two names served by one tensor: the later item overwrites the earlier one's bits, which
    the read-back of the earlier item sees (every entry is a candidate)."""
    state = make_state(1)
    tensors = make_state(2)
    tensors["lm_head.weight"] = tensors["embed.weight"]
    receiver = TensorReceiver(tensors, version=None)
    dense = Trainer(state, version=0, bucket_bytes=4 * MiB)
    try:
        (payload,) = dense.shards[0].tracker.encode(state, WeightVersion(1), resync=True)
    finally:
        dense.close()
    before = digests(tensors)
    with pytest.raises(VerificationError, match="weight"):
        receiver.apply(memoryview(payload.to_bytes()), _meta(payload, candidates=1 << 30))
    assert digests(tensors) == before and receiver.status().open is None


def test_a_bare_apply_function_is_refused() -> None:
    receiver, _ = _receiver()
    assert as_receiver(receiver.apply) is receiver
    with pytest.raises(TypeError, match="roll"):
        as_receiver(lambda body, metadata: {})
