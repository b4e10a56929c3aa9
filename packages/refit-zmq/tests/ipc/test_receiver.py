"""The worker side of the IPC channel on its real socket and shared memory, driven message by
message: manifest checks at the completion sentinel, refused requests, ``serve_refit``, and
the trainer-side packing and sizing it relies on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from refit_core import GeometryMismatchError, NamedTensor, ProtocolError, StaleBaseError, TensorSpec
from refit_core.backend import Deadline
from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_zmq.ipc import IpcOptions, IpcReceiver, IpcWeightSynchronizer, WorkerLinks
from refit_zmq.ipc.handles import handle_from_json
from refit_zmq.ipc.packing import BufferPool, Packer
from refit_zmq.ipc.protocol import manifest_to_json
from refit_zmq.ipc.shm import ShmBuffer, ShmHandle, attach_shm
from refit_zmq.ipc.sizing import (
    ALIGN_BYTES,
    MAX_DEFAULT_HOST_BUFFER_BYTES,
    MIN_BUFFER_BYTES,
    default_buffer_bytes,
)

pytestmark = pytest.mark.timeout(120)

CONFIG = ReferenceModelConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64)
KiB = 1024


class RawTrainer:
    """A trainer speaking the wire protocol by hand, with real shared buffers."""

    def __init__(self, address: str, state: dict[str, torch.Tensor]) -> None:
        self.address = address
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.REQ)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.state = state
        self.manifest = {name: TensorSpec.of(t) for name, t in state.items()}
        self.pool = BufferPool(64 * KiB, torch.device("cpu"))
        self.buckets = list(Packer(self.manifest, self.pool).buckets(_named(state)))

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self.socket.send_json(message)
        assert self.socket.poll(10_000), "the receiver did not answer"
        reply: dict[str, Any] = self.socket.recv_json()  # type: ignore[assignment]
        return reply

    def begin_message(self, version: int, **overrides: Any) -> dict[str, Any]:
        return {
            "op": "begin",
            "protocol": "refit-ipc/1",
            "version": version,
            "session": "s1",
            "buffers": [b.handle.to_json() for b in self.pool.buffers],
            "manifest": manifest_to_json(self.manifest),
            **overrides,
        }

    def begin(self, version: int, **overrides: Any) -> dict[str, Any]:
        return self.ask(self.begin_message(version, **overrides))

    def close(self) -> None:
        self.socket.close()
        self.context.term()
        self.pool.close()


def _named(state: dict[str, torch.Tensor]) -> Iterator[NamedTensor]:
    return (NamedTensor(name, tensor) for name, tensor in state.items())


@pytest.fixture
def engine() -> ReferenceEngine:
    return ReferenceEngine(CONFIG, seed=1)


@pytest.fixture
def trainer(engine: ReferenceEngine) -> Iterator[RawTrainer]:
    receiver = IpcReceiver(engine)
    raw = RawTrainer(receiver.start(), random_checkpoint(CONFIG, 2))
    try:
        yield raw
    finally:
        raw.close()
        receiver.close()


def test_a_full_refit_by_hand_commits(trainer: RawTrainer, engine: ReferenceEngine) -> None:
    assert trainer.begin(1)["ok"]
    for bucket in trainer.buckets:
        reply = trainer.ask(bucket.message(1))
        assert reply == {"ok": True, "op": "bucket", "partial": True, "seq": bucket.seq}
    reply = trainer.ask({"op": "commit", "version": 1, "count": len(trainer.state)})
    assert reply == {"ok": True, "op": "commit", "partial": False, "version": 1}
    assert engine.weight_version == 1
    assert engine.state_digests() == ReferenceEngine(CONFIG, seed=2).state_digests()


def test_the_trainer_links_keep_requests_outstanding_and_match_replies_in_order(
    trainer: RawTrainer, engine: ReferenceEngine
) -> None:
    """The next request goes out before the previous one is answered (a worker finds the
    next bucket queued when it finishes loading one); after a refusal, ``settle`` drains
    what is still outstanding, aborts, and the links serve the next refit."""
    links = WorkerLinks([trainer.address])
    deadline = Deadline.after(30)
    try:
        links.send(trainer.begin_message(1), deadline)
        for bucket in trainer.buckets:
            links.send(bucket.message(1), deadline)
        replies = [links.gather(deadline)[trainer.address] for _ in range(len(trainer.buckets) + 1)]
        assert [r["op"] for r in replies] == ["begin"] + ["bucket"] * len(trainer.buckets)
        assert [r["seq"] for r in replies[1:]] == [b.seq for b in trainer.buckets]
        links.request({"op": "commit", "version": 1, "count": len(trainer.state)}, deadline)
        assert engine.weight_version == 1

        links.send(trainer.begin_message(2), deadline)
        first = trainer.buckets[0].message(2)
        for seq in range(4):  # two still outstanding after the refusal
            links.send({**first, "seq": seq}, deadline)
        links.gather(deadline)
        links.gather(deadline)
        with pytest.raises(GeometryMismatchError, match="sent twice"):
            links.gather(deadline)
        assert links.settle({"op": "abort", "version": 2}, deadline) == [trainer.address]
        reply = links.request(trainer.begin_message(3), deadline)[trainer.address]
        assert reply["op"] == "begin" and reply["ok"], "every earlier reply was drained"
        assert engine.weight_version == 1
    finally:
        links.close()


def test_the_sentinel_refuses_a_refit_with_tensors_never_loaded(
    trainer: RawTrainer, engine: ReferenceEngine
) -> None:
    before = engine.state_digests()
    assert trainer.begin(1)["ok"]
    reply = trainer.ask({"op": "commit", "version": 1, "count": len(trainer.state)})
    assert reply["error"] == "GEOMETRY" and "never loaded" in reply["message"]
    assert not reply["partial"] and engine.weight_version == 0
    assert engine.state_digests() == before
    assert not trainer.ask({"op": "commit", "version": 1, "count": 0})["ok"], "refit is over"


def test_a_tensor_sent_twice_or_unknown_is_refused_and_nothing_commits(
    trainer: RawTrainer, engine: ReferenceEngine
) -> None:
    first = trainer.buckets[0].message(1)
    assert trainer.begin(1)["ok"] and trainer.ask(first)["ok"]
    again = {**first, "seq": 1}
    reply = trainer.ask(again)
    assert reply["error"] == "GEOMETRY" and "sent twice" in reply["message"]
    assert reply["partial"] and engine.weight_version == 0

    assert trainer.begin(2)["ok"]
    unknown = trainer.buckets[0].message(2)
    unknown["items"][0][0] = "model.layers.7.mlp.up_proj.weight"
    reply = trainer.ask(unknown)
    assert reply["error"] == "GEOMETRY" and "not in this refit's manifest" in reply["message"]
    assert engine.weight_version == 0


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        ({"op": "launch"}, "MALFORMED"),
        ({"op": "bucket", "version": 1, "seq": 0, "buffer": 0, "items": []}, "MALFORMED"),
        ({"op": "commit", "version": "1", "count": 0}, "MALFORMED"),
        ({"op": "begin", "version": 0}, "MALFORMED"),
    ],
)
def test_malformed_requests_are_refused_and_the_receiver_keeps_serving(
    trainer: RawTrainer, request_: dict[str, Any], code: str
) -> None:
    assert trainer.ask(request_)["error"] == code
    assert trainer.begin(1)["ok"]


def test_slots_outside_the_buffer_and_old_versions_are_refused(
    trainer: RawTrainer, engine: ReferenceEngine
) -> None:
    assert trainer.begin(1)["ok"]
    outside = trainer.buckets[0].message(1)
    outside["items"][0][1] = 64 * KiB
    assert trainer.ask(outside)["error"] == "MALFORMED"
    assert trainer.begin(0)["error"] == "VERSION"
    assert trainer.begin(2, protocol="refit-ipc/0")["error"] == "MALFORMED"
    wrong = trainer.begin(1, manifest={"lm_head.weight": [[1], "bfloat16"]})
    assert wrong["error"] == "GEOMETRY"
    assert engine.weight_version == 0


def test_serve_refit_returns_the_version_or_raises_the_refusal(engine: ReferenceEngine) -> None:
    receiver = IpcReceiver(engine)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 3))
    options = IpcOptions(buffer_size_bytes=16 * KiB, device="cpu")
    sync = IpcWeightSynchronizer(
        trainer, lambda: [receiver.address], refit_timeout_s=30, options=options
    )
    outcome: list[object] = []

    def serve() -> None:
        try:
            outcome.append(receiver.serve_refit(timeout_s=30))
        except Exception as exc:
            outcome.append(exc)

    try:
        server = threading.Thread(target=serve)
        server.start()
        assert sync.sync_weights().version == 1
        server.join(30)
        assert outcome.pop() == 1

        server = threading.Thread(target=serve)
        server.start()
        trainer.masters["lm_head.weight"] = trainer.masters["lm_head.weight"][:-1]
        with pytest.raises(GeometryMismatchError):
            sync.sync_weights()
        server.join(30)
        assert isinstance(outcome.pop(), GeometryMismatchError), "raised after the abort"
        assert engine.weight_version == 1
        with pytest.raises(TimeoutError):
            receiver.serve_refit(timeout_s=0.2)
    finally:
        sync.shutdown()
        receiver.close()


def test_the_packer_aligns_slots_and_gives_big_tensors_their_own_buffer() -> None:
    state = {
        "a": torch.ones(3, dtype=torch.bfloat16),
        "b": torch.arange(5, dtype=torch.int64),
        "big": torch.zeros(700, dtype=torch.float32),  # 2800 B > half of 4 KiB
        "c": torch.ones((2, 2), dtype=torch.float16),
    }
    pool = BufferPool(4 * KiB, torch.device("cpu"))
    manifest = {name: TensorSpec.of(t) for name, t in state.items()}
    packer = Packer(manifest, pool)
    buckets = []
    for bucket in packer.buckets(_named(state)):
        buckets.append(bucket)
        if bucket.buffer is not None:
            pool.release(bucket.buffer)
    assert [[i.name for i in b.items] for b in buckets] == [["a", "b"], ["big"], ["c"]]
    assert [i.offset for i in buckets[0].items] == [0, ALIGN_BYTES]
    assert buckets[1].oneoff is not None and buckets[1].oneoff.nbytes >= 2800
    assert [b.seq for b in buckets] == [0, 1, 2]
    with pytest.raises(GeometryMismatchError, match="never yielded"):
        list(packer.buckets(_named({"a": state["a"]})))
    pool.close()


def test_default_buffers_are_bounded_and_aligned() -> None:
    size = default_buffer_bytes(torch.device("cpu"))
    assert MIN_BUFFER_BYTES <= size <= MAX_DEFAULT_HOST_BUFFER_BYTES and size % ALIGN_BYTES == 0


def test_a_shared_buffer_is_refused_when_it_is_not_the_one_named() -> None:
    buffer = ShmBuffer(4 * KiB)
    buffer.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    handle = buffer.handle
    assert attach_shm(handle)[:4].tolist() == [1, 2, 3, 4]
    wrong = ShmHandle(handle.pid, handle.fd, handle.inode + 1, handle.nbytes)
    with pytest.raises(ProtocolError, match="not the buffer named"):
        attach_shm(wrong)
    buffer.close()
    with pytest.raises(ProtocolError, match="cannot open"):
        attach_shm(handle)
    with pytest.raises(ProtocolError):
        handle_from_json({"kind": "shm", "pid": -1, "fd": 3, "inode": 1, "nbytes": 1})
    with pytest.raises(ProtocolError):
        handle_from_json({"kind": "cuda", "handle": "***"})


def test_version_refusals_are_typed_for_the_trainer(engine: ReferenceEngine) -> None:
    receiver = IpcReceiver(engine, version=5)
    trainer = SimulatedTrainer(random_checkpoint(CONFIG, 4))
    options = IpcOptions(buffer_size_bytes=16 * KiB, device="cpu")
    receiver.start()
    with (
        IpcWeightSynchronizer(
            trainer, lambda: [receiver.address], refit_timeout_s=30, options=options
        ) as sync,
        pytest.raises(StaleBaseError, match="at 5"),
    ):
        sync.sync_weights(version=3)
    receiver.close()
