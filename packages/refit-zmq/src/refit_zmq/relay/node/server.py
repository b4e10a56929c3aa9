"""The relay: a ROUTER in front of a local receiver that applies, acknowledges and forwards.

One event-loop thread owns every socket: it validates each message and hands it to the
payload path (:mod:`~refit_zmq.relay.node.intake`) or the transaction path
(:mod:`~refit_zmq.relay.node.transactions`). One receiver thread runs the receiver, so an ACK is
sent only after the payload is applied locally, and the loop never waits for it. Malformed,
unauthenticated or unexpected input is answered with a NACK and never stops the loop.
PROTOCOL.md specifies the messages and the transfer state machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import zmq

from refit_core import AuthenticationError, ProtocolError, RefitError
from refit_zmq.relay.apply.receiver import Receiver, as_receiver
from refit_zmq.relay.node.intake import PayloadIntake
from refit_zmq.relay.node.jobs import ReceiverJobs
from refit_zmq.relay.node.ledger import Ledger
from refit_zmq.relay.node.peers import PeerRequests
from refit_zmq.relay.node.replies import PAYLOAD_FIELDS, Replies
from refit_zmq.relay.node.staging import Staging
from refit_zmq.relay.node.topology import Topology
from refit_zmq.relay.node.transactions import Respond, TransferControl
from refit_zmq.relay.node.unattended import Unattended
from refit_zmq.relay.wire.auth import Signer
from refit_zmq.relay.wire.curve import CurveConfig
from refit_zmq.relay.wire.errors import NackCode, code_for_error
from refit_zmq.relay.wire.frames import MAX_HEADER_BYTES, Kind, Message, parse, reply_ids
from refit_zmq.relay.wire.link import socket_options
from refit_zmq.relay.wire.reports import FlushReport, RelayStatus, SubtreeReport, TreeReply
from refit_zmq.relay.wire.tuning import RelayTuning

__all__ = ["ZmqSparseRefitServer"]

logger = logging.getLogger(__name__)

_TICK_MS = 50
_READ_BATCH = 64


def _ids(message: Message) -> dict[str, str]:
    """The id fields of a request, to address its NACK."""
    names = (*PAYLOAD_FIELDS, "request_id")
    return {name: str(message.fields[name]) for name in names if name in message.fields}


@dataclass
class _Parts:
    """What a running relay is made of (built by ``start``)."""

    context: zmq.Context[zmq.Socket[bytes]]
    router: zmq.Socket[bytes]
    replies: Replies
    ledger: Ledger
    intake: PayloadIntake
    control: TransferControl
    unattended: Unattended
    peers: PeerRequests


class ZmqSparseRefitServer:
    """A relay of the sparse refit tree, in front of one local receiver.

    Args:
        apply_payload: the receiver (an object with ``apply``, ``commit``, ``rollback`` and
            ``status``, see :class:`~refit_zmq.relay.apply.receiver.Receiver`) or its bound
            ``apply``.
        bind_address: where the ROUTER binds (default: loopback, an ephemeral port).
        api_key_env_var: the environment variable holding the API key (None: no key).
        timeout_s: how long a child, a sender or a queued BEGIN may stay silent; an open
            transfer idle this long is aborted here, and a prepared one left without a
            decision this long makes the relay ask its peers.
        tuning: fan-out, chunk size, staging budget, high-water marks.
        curve: the relays' CURVE key pair, to encrypt and authenticate the server.
    """

    def __init__(
        self,
        apply_payload: Receiver | Callable[..., Any],
        *,
        bind_address: str = "tcp://127.0.0.1:*",
        api_key_env_var: str | None,
        timeout_s: float,
        tuning: RelayTuning | None = None,
        curve: CurveConfig | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._receiver = as_receiver(apply_payload)
        self._signer = Signer.from_env(api_key_env_var)
        self._bind_address = bind_address
        self._timeout_s = timeout_s
        self._tuning = tuning or RelayTuning()
        self._curve = curve
        self._topology = Topology()
        self._jobs = ReceiverJobs(self._wake)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._parts: _Parts | None = None
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle and local API --------------------------------------------------------

    def start(self) -> str:
        """Bind and start serving; return the bound address."""
        if self._parts is not None:
            raise RuntimeError("relay already started")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        router = context.socket(zmq.ROUTER)
        socket_options(
            router,
            hwm=self._tuning.hwm_messages,
            max_message_bytes=max(self._tuning.chunk_bytes, MAX_HEADER_BYTES) + 64,
            tuning=self._tuning,
        )
        if self._curve is not None:
            self._curve.secure_server(router)
        router.bind(self._bind_address)
        if not self._topology.own:
            self._topology.own = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._parts = self._build(context, router)
        self._thread = threading.Thread(target=self._run, name="refit-relay", daemon=True)
        self._thread.start()
        logger.info(
            "relay serving on %s (API key %s, CURVE %s)",
            self._topology.own,
            "on" if self._signer.enabled else "off",
            "on" if self._curve is not None else "off",
        )
        return router.getsockopt_string(zmq.LAST_ENDPOINT)

    def _build(self, context: zmq.Context[zmq.Socket[bytes]], router: zmq.Socket[bytes]) -> _Parts:
        replies = Replies(router, self._signer, self._topology)
        ledger = Ledger(self._receiver.status().version)
        staging = Staging(
            budget_bytes=self._tuning.max_inflight_bytes,
            window=self._tuning.window_payloads,
            max_pending=self._tuning.max_pending_admissions,
        )
        control: TransferControl | None = None

        def progress() -> None:
            if control is not None:
                control.check_flushes()

        intake = PayloadIntake(
            context=context,
            receiver=self._receiver,
            jobs=self._jobs,
            ledger=ledger,
            staging=staging,
            topology=self._topology,
            replies=replies,
            signer=self._signer,
            curve=self._curve,
            tuning=self._tuning,
            timeout_s=self._timeout_s,
            progress=progress,
        )
        peers = PeerRequests(
            signer=self._signer,
            curve=self._curve,
            tuning=self._tuning,
            wake=self._wake,
            name="peers",
        )
        control = TransferControl(
            receiver=self._receiver,
            jobs=self._jobs,
            ledger=ledger,
            staging=staging,
            intake=intake,
            topology=self._topology,
            replies=replies,
            peers=peers,
        )
        unattended = Unattended(
            ledger=ledger,
            intake=intake,
            control=control,
            topology=self._topology,
            peers=peers,
            timeout_s=self._timeout_s,
        )
        return _Parts(context, router, replies, ledger, intake, control, unattended, peers)

    def configure_tree(self, relay_addresses: Sequence[str], *, own_address: str) -> str:
        """Adopt the tree over ``relay_addresses`` (this relay is ``own_address``); its id."""
        return str(self._call(lambda: self._configure(list(relay_addresses), own_address, None)))

    def flush(
        self, transfer_id: str, expected_payloads: int = 0, *, timeout_s: float | None = None
    ) -> FlushReport:
        """Wait until the transfer's payloads are applied here and acknowledged by the children.

        Args:
            transfer_id: the transfer.
            expected_payloads: payloads this relay must have applied (0: whatever began).
            timeout_s: the longest wait (default: the relay's ``timeout_s``).

        Returns:
            This relay's report: payloads, bytes, timings, per-child acknowledgements, and
            every failure with the relay address and payload id (``complete`` False and a
            TIMEOUT failure when the wait ran out). A complete report prepares the transfer
            here: from then on only a COMMIT or an ABORT ends it.
        """
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        future: Future[FlushReport] = Future()
        self._on_loop(
            lambda parts: parts.control.flush(
                transfer_id, expected_payloads, wait_s, False, future.set_result
            )
        )
        return future.result(timeout=wait_s + self._timeout_s)

    def flush_subtree(
        self, transfer_id: str, expected_payloads: int = 0, *, timeout_s: float | None = None
    ) -> dict[str, FlushReport]:
        """:meth:`flush`, then the same for every relay this one forwarded to, recursively,
        all within ``timeout_s`` (default: the relay's ``timeout_s``).

        Returns:
            Relay address -> its report, for this relay and its whole subtree (a child that
            did not answer has ``complete`` False and an UNREACHABLE failure).
        """
        wait_s = self._timeout_s if timeout_s is None else timeout_s
        future: Future[SubtreeReport] = Future()

        def start(parts: _Parts) -> None:
            respond: Respond = parts.control.with_subtree(wait_s, future.set_result)
            parts.control.flush(transfer_id, expected_payloads, wait_s, False, respond)

        self._on_loop(start)
        return dict(future.result(timeout=wait_s + self._timeout_s).relays)

    def status(self, *, digests: bool = False) -> RelayStatus:
        """What STATUS answers: the receiver's version and open transfer, the ledger's open
        transfer, the staging (and every tensor's digest). Needs no tree."""
        future: Future[RelayStatus] = Future()

        def answer(status: RelayStatus | BaseException) -> None:
            if isinstance(status, BaseException):
                future.set_exception(status)
            else:
                future.set_result(status)

        self._on_loop(lambda parts: parts.control.status(digests, answer))
        return future.result(timeout=self._timeout_s)

    def _on_loop(self, fn: Callable[[_Parts], None]) -> None:
        """Run ``fn`` on the event loop (the relay must be started)."""
        parts = self._parts
        if parts is None:
            raise RuntimeError("relay not started")
        self._commands.put(lambda: fn(parts))
        self._wake()

    def close(self) -> None:
        """Stop serving and close every socket; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        thread = self._thread
        if thread is not None:
            self._wake()
            thread.join(self._timeout_s + 5)
            if thread.is_alive():
                logger.error("relay %s: event loop did not stop; sockets leak", self._topology.own)
                return
        self._jobs.close()
        if self._parts is not None:
            self._parts.peers.close()
            self._parts.context.term()
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> ZmqSparseRefitServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the event loop (directly, while no loop runs); return its result."""
        if self._thread is None or not self._thread.is_alive():
            return fn()
        future: Future[object] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(run)
        self._wake()
        return future.result(timeout=self._timeout_s)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"\0")

    # -- event loop ---------------------------------------------------------------------

    def _run(self) -> None:
        parts = self._parts
        assert parts is not None
        try:
            while not self._stopping:
                self._turn(parts)
        except Exception:
            logger.exception("relay %s: event loop crashed", self._topology.own)
        finally:
            parts.intake.close()
            parts.router.close(linger=0)

    def _turn(self, parts: _Parts) -> None:
        """One turn of the loop: wait (at most a tick), then handle whatever is ready."""
        children = list(parts.intake.children.values())
        poller = zmq.Poller()
        poller.register(parts.router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        for child in children:
            poller.register(
                child.socket, zmq.POLLIN | (zmq.POLLOUT if child.wants_to_send() else 0)
            )
        events = dict(poller.poll(_TICK_MS))
        if self._wake_read in events:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_read, 4096):
                    pass
        while not self._commands.empty():
            self._commands.get_nowait()()
        self._jobs.finish()
        parts.peers.finish()
        now = time.monotonic()
        parts.unattended.expire(now)
        parts.intake.expire(now)
        if parts.router in events:
            self._read(parts)
        for child in children:
            if events.get(child.socket, 0) & zmq.POLLIN:
                child.receive()
            else:
                child.pump()
        parts.control.check_flushes()

    def _read(self, parts: _Parts) -> None:
        for _ in range(_READ_BATCH):
            try:
                frames = parts.router.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            parts.unattended.expire(time.monotonic())  # no message of a transfer past its end
            self._handle(parts, frames[0].bytes, [frame.buffer for frame in frames[1:]])

    def _handle(self, parts: _Parts, identity: bytes, frames: list[memoryview]) -> None:
        replies = parts.replies
        try:
            message = parse(frames, self._signer)
        except AuthenticationError as exc:
            logger.warning("relay %s: refused a message: %s", self._topology.own, exc)
            replies.nack(identity, NackCode.AUTH, str(exc), {}, sign=False)
            return
        except ProtocolError as exc:
            replies.nack(identity, NackCode.MALFORMED, str(exc), reply_ids(frames))
            return
        handlers: dict[Kind, Callable[[bytes, Message], None]] = {
            Kind.BEGIN: parts.intake.on_begin,
            Kind.DATA: parts.intake.on_data,
            Kind.FLUSH: parts.control.on_flush,
            Kind.COMMIT: parts.control.on_commit,
            Kind.ABORT: parts.control.on_abort,
            Kind.STATUS: parts.control.on_status,
            Kind.OUTCOME: parts.control.on_outcome,
            Kind.CONFIGURE: self._on_configure,
        }
        handler = handlers.get(message.kind)
        if handler is None:
            replies.nack(
                identity, NackCode.MALFORMED, f"{message.kind} is not a request", _ids(message)
            )
            return
        try:
            handler(identity, message)
        except RefitError as exc:
            replies.nack(identity, code_for_error(exc), str(exc), _ids(message))
        except Exception as exc:
            logger.exception("relay %s: %s handler failed", self._topology.own, message.kind)
            text = f"{type(exc).__name__}: {exc}"
            replies.nack(identity, NackCode.APPLY_FAILED, text, _ids(message))

    def _on_configure(self, identity: bytes, message: Message) -> None:
        tree_id = self._configure(
            message.strings("relays"), message.text("own_address"), message.number("fanout")
        )
        assert self._parts is not None
        reply = TreeReply(tree_id)
        self._parts.replies.done(identity, message.text("request_id"), reply.to_json())

    def _configure(self, relays: list[str], own: str, fanout: int | None) -> str:
        tree = self._topology.configure(relays, own, fanout or self._tuning.fanout)
        if self._parts is not None:
            self._parts.intake.prune(tree.relays)
        logger.info(
            "relay %s: tree %s over %d relays, fanout %d",
            own,
            tree.tree_id,
            len(relays),
            tree.fanout,
        )
        return tree.tree_id
