"""Cut-through forwarding to a child (a bare ROUTER here): chunks go on before the payload is whole."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from refit_zmq.relay.node.forwarder import ChildLink, Forward
from refit_zmq.relay.node.staging import StagedPayload
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.frames import Kind, Message, encode, parse
from refit_zmq.relay.wire.link import Link, LinkSettings
from refit_zmq.relay.wire.tuning import RelayTuning

pytestmark = pytest.mark.timeout(30)

NO_KEY = Signer(None)
T1 = "v1-0000000000000001"
KEY = (T1, "p", "0")


class Events:
    """Records what the child link reports."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def forwarded(self, child: str, forward: Forward, nbytes: int) -> None:
        self.log.append(("forwarded", nbytes))

    def released(self, forward: Forward) -> None:
        self.log.append(("released", forward.key))

    def acked(self, child: str, forward: Forward) -> None:
        self.log.append(("acked", forward.key))

    def failed(self, child: str, forward: Forward, code: str, message: str) -> None:
        self.log.append(("failed", code))

    def deadline_s(self, transfer_id: str) -> float | None:
        return 7.5


@pytest.fixture
def child() -> Iterator[tuple[zmq.Socket[bytes], str, zmq.Context[zmq.Socket[bytes]]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    try:
        yield router, router.getsockopt_string(zmq.LAST_ENDPOINT), context
    finally:
        router.close()
        context.term()


def _next(router: zmq.Socket[bytes], link: ChildLink) -> tuple[bytes, Message]:
    """The next message the child gets; drives the link as the relay's event loop would."""
    for _ in range(200):
        link.pump()
        if router.poll(10):
            identity, *frames = router.recv_multipart()
            return identity, parse(frames, NO_KEY)
    raise AssertionError("nothing forwarded")


def _reply(router: zmq.Socket[bytes], identity: bytes, kind: Kind, **fields: Any) -> None:
    ids = dict(zip(("transfer_id", "producer_id", "payload_id"), KEY, strict=True))
    router.send_multipart([identity, *encode(kind, {**ids, **fields}, NO_KEY)])


def _until(link: ChildLink, events: Events, entry: str) -> None:
    for _ in range(200):
        if any(kind == entry for kind, _ in events.log):
            return
        link.socket.poll(10)
        link.receive()
    raise AssertionError(f"no {entry} in {events.log}")


def test_chunks_are_forwarded_as_they_arrive(
    child: tuple[zmq.Socket[bytes], str, zmq.Context[zmq.Socket[bytes]]],
) -> None:
    router, address, context = child
    events = Events()
    link = ChildLink(
        Link(context, address, LinkSettings(NO_KEY, None, RelayTuning(hwm_messages=16))),
        signer=NO_KEY,
        events=events,
        timeout_s=2.0,
        tuning=RelayTuning(),
    )
    try:
        _stream(router, address, link, events)
    finally:
        link.close()


def _stream(router: zmq.Socket[bytes], address: str, link: ChildLink, events: Events) -> None:
    begin = {
        "checksum": "0" * 32,
        "verification_candidates": 0,
        "base": None,
        "target": 1,
        "relay_root": address,
        "hops": 1,
    }
    staged = StagedPayload(KEY, "0" * 32, 8, address, begin, b"parent")
    staged.write(0, memoryview(b"abcd"))
    link.add(staged)
    identity, offer = _next(router, link)
    assert (offer.kind, offer.number("total_bytes"), offer.number("hops")) == (Kind.BEGIN, 8, 1)
    assert offer.fields["deadline_s"] == 7.5, "a child gets what is left of the deadline"
    _reply(router, identity, Kind.READY, relay=address, chunk_bytes=4096)
    _until(link, events, "forwarded")
    _, first = _next(router, link)
    assert first.kind is Kind.DATA and first.body is not None
    assert (first.number("offset"), bytes(first.body)) == (0, b"abcd")
    assert not staged.complete and ("released", KEY) not in events.log, "cut-through"

    staged.write(4, memoryview(b"efgh"))
    _, second = _next(router, link)
    assert second.body is not None and (second.number("offset"), bytes(second.body)) == (4, b"efgh")
    assert ("released", KEY) in events.log and link.busy(T1), "streamed, awaiting the ACK"
    _reply(router, identity, Kind.ACK, relay=address, duplicate=False, result={"items": 1})
    _until(link, events, "acked")
    assert not link.busy(T1)
