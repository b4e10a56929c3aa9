"""Worker side: :class:`IpcReceiver` loads refits from the control socket into an engine.

Engine-agnostic: the engine only needs :class:`IpcEngine` (the reference engine has it; a
vLLM worker wraps its model runner). Tensors handed to ``load_weights`` are read-only views
of the trainer's shared buffer, valid only during that call: the engine copies them.

Nothing is rolled back: the engine exposes no way to read its weights, and a copy of them
would double the memory. Instead every check that can fail runs before the first byte is
loaded (the manifest against the engine at ``begin``, each bucket's items before the bucket),
and a refit that fails later leaves the engine on its old version with ``partial`` set; the
trainer names such workers in ``wedged_workers`` and the next (always dense) refit heals them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
import zmq

from refit_core import (
    ProtocolError,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    TensorSpec,
)
from refit_core.backend import Deadline
from refit_zmq.ipc.handles import attach, handle_from_json
from refit_zmq.ipc.protocol import (
    PROTOCOL,
    Item,
    Op,
    code_for_error,
    decode,
    encode,
    error_for_reply,
    manifest_from_json,
    parse_items,
    require,
    slot_bytes,
    torch_dtype,
)
from refit_zmq.ipc.transaction import RefitTransaction, check_manifest

__all__ = ["IpcEngine", "IpcReceiver"]

logger = logging.getLogger(__name__)

_POLL_MS = 100


class IpcEngine(Protocol):
    """What :class:`IpcReceiver` needs from an engine worker. An engine that keeps each refit
    aside until its commit (vLLM's staged receiver) says so with a true ``stages_refits``
    attribute: a refit that fails then leaves it unchanged, not ``partial``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Copy checkpoint-named tensors into the engine's weights."""
        ...

    def set_weight_version(self, version: int) -> None:
        """Commit a new weight version."""
        ...

    def reset_prefix_cache(self) -> object:
        """Drop every cached prefix computed with older weights."""
        ...

    def checkpoint_tensor_specs(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        """Checkpoint name -> ``(shape, dtype name)`` of every tensor a refit must carry."""
        ...


class IpcReceiver:
    """Serves the IPC channel's control socket for one engine worker.

    Drive it either from the worker's own loop, ``serve_refit()`` per refit (what a vLLM
    weight-transfer engine does inside ``update_weights``), or with ``start()``, a background
    thread for engines whose calls are thread-safe (the reference engine).

    Args:
        engine: the worker's engine.
        bind_address: the REP socket's address (default loopback, an ephemeral port; an
            ``ipc://`` path also works, both ends being on one host).
        version: the engine's current weight version; refits must go above it.
        began: the highest version a refit ever began on the engine (default: ``version``).
    """

    def __init__(
        self,
        engine: IpcEngine,
        *,
        bind_address: str = "tcp://127.0.0.1:*",
        version: int = 0,
        began: int | None = None,
    ) -> None:
        self._engine = engine
        self._version = version
        self._began = max(version, began or 0)
        self._partial = False
        self._session: str | None = None
        self._buffers: list[torch.Tensor] = []
        self._transaction: RefitTransaction | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socket: zmq.Socket[bytes] = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(bind_address)
        except zmq.ZMQError:
            self._socket.close()
            self._context.term()
            raise
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The address the trainer connects to (lists it in ``ipc_addresses()``)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def version(self) -> int:
        """The last weight version this receiver committed (or the initial one)."""
        return self._version

    @property
    def began(self) -> int:
        """The highest version a refit ever began here (committed or not)."""
        return self._began

    @property
    def partial(self) -> bool:
        """Whether the engine holds weights of a refit that did not commit."""
        return self._partial

    # -- driving -------------------------------------------------------------------------

    def serve_refit(self, timeout_s: float | None = None) -> int:
        """Serve requests until a refit commits (its version) or is aborted, by the refit's
        deadline as the trainer sent it (``timeout_s``: ``Deadline.to_wire``, the seconds
        left; None: none).

        After a refused request the trainer always sends ``abort``; this call serves it and
        then raises the refusal.

        Raises:
            RefitTimeoutError: the refit neither committed nor was aborted within ``timeout_s``.
            RefitAbortedError: the trainer aborted the refit (its own failure).
            RefitError: this worker refused the refit (typed, as the trainer sees it).
        """
        if self._thread is not None:
            raise RuntimeError("the receiver is served by its background thread")
        deadline = Deadline.from_wire(timeout_s)
        failure: RefitError | None = None
        while True:
            left = deadline.remaining_s()
            if left == 0.0:
                raise RefitTimeoutError(f"no refit ended within {timeout_s} s") from failure
            reply = self._serve_one(_POLL_MS if left is None else min(_POLL_MS, int(left * 1000)))
            if reply is None:
                continue
            if reply.get("ok") is not True:
                failure = failure or error_for_reply(self.address, str(reply.get("op")), reply)
            elif reply["op"] == Op.COMMIT:
                return self._version
            elif reply["op"] == Op.ABORT:
                raise failure or RefitAbortedError("the trainer aborted the refit")

    def start(self) -> str:
        """Serve in a background thread until :meth:`close`; the control address."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="refit-ipc-receiver", daemon=True
            )
            self._thread.start()
        return self.address

    def close(self) -> None:
        """Stop serving and release the socket and the mapped buffers; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._socket.closed:
            self._socket.close(linger=0)
            self._context.term()
        self._buffers = []

    def _run(self) -> None:
        while not self._stop.is_set():
            self._serve_one(_POLL_MS)

    def _serve_one(self, timeout_ms: int) -> dict[str, Any] | None:
        """Answer at most one request arriving within ``timeout_ms``; the reply sent."""
        if not self._socket.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        reply = self._handle(frames)
        try:
            self._socket.send(encode(reply), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("ipc receiver %s: reply to %s dropped", self.address, reply["op"])
        return reply

    # -- requests ------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> dict[str, Any]:
        op: object = None
        try:
            if len(frames) != 1:
                raise ProtocolError(f"a request is one frame, got {len(frames)}")
            message = decode(frames[0])
            op = message.get("op")
            if op == Op.BEGIN:
                extra = self._begin(message)
            elif op == Op.BUCKET:
                extra = self._bucket(message)
            elif op == Op.COMMIT:
                extra = self._commit(message)
            elif op == Op.ABORT:
                extra = self._abort(message)
            else:
                raise ProtocolError(f"unknown op {op!r}")
        except Exception as exc:
            self._transaction = None  # a refused refit cannot go on
            level = logging.WARNING if isinstance(exc, RefitError) else logging.ERROR
            logger.log(
                level,
                "ipc receiver %s: %s refused: %s",
                self.address,
                op,
                exc,
                exc_info=not isinstance(exc, RefitError),
            )
            return {
                "ok": False,
                "op": op,
                "error": code_for_error(exc),
                "message": str(exc),
                "partial": self._partial,
            }
        return {"ok": True, "op": op, "partial": self._partial, **extra}

    def _open(self, message: Mapping[str, Any]) -> RefitTransaction:
        transaction = self._transaction
        if transaction is None or require(message, "version", int) != transaction.version:
            raise ProtocolError(f"{message.get('op')} outside the refit it names")
        return transaction

    def _begin(self, message: Mapping[str, Any]) -> dict[str, Any]:
        if message.get("protocol") != PROTOCOL:
            raise ProtocolError(
                f"protocol {message.get('protocol')!r}, this worker speaks {PROTOCOL}"
            )
        version: int = require(message, "version", int)
        session: str = require(message, "session", str)
        handles = require(message, "buffers", list)
        manifest = manifest_from_json(message.get("manifest"))
        if version <= self._version:
            raise StaleBaseError(f"version must increase: this worker is at {self._version}")
        engine = {
            name: TensorSpec(tuple(shape), dtype)
            for name, (shape, dtype) in self._engine.checkpoint_tensor_specs().items()
        }
        check_manifest(manifest, engine)
        if self._transaction is not None:
            logger.warning(
                "ipc receiver %s: refit %d superseded by %d",
                self.address,
                self._transaction.version,
                version,
            )
        if session != self._session:
            self._buffers = []
            self._buffers = [attach(handle_from_json(h)) for h in handles]
            self._session = session
        self._transaction = RefitTransaction(version, manifest)
        self._began = max(self._began, version)
        return {}

    def _bucket(self, message: Mapping[str, Any]) -> dict[str, Any]:
        transaction = self._open(message)
        seq: int = require(message, "seq", int)
        items = parse_items(message.get("items"))
        if "oneoff" in message:
            memory = attach(handle_from_json(message["oneoff"]))
        else:
            index: int = require(message, "buffer", int)
            if not 0 <= index < len(self._buffers):
                raise ProtocolError(f"no buffer {index}")
            memory = self._buffers[index]
        transaction.check_bucket(seq, items, memory.numel())
        self._partial = self._partial or not getattr(self._engine, "stages_refits", False)
        self._engine.load_weights(_views(memory, items))
        if memory.is_cuda:
            torch.cuda.synchronize(memory.device)  # loaded before the trainer refills it
        transaction.record(items)
        return {"seq": seq}

    def _commit(self, message: Mapping[str, Any]) -> dict[str, Any]:
        transaction = self._open(message)
        transaction.check_complete(require(message, "count", int))
        self._transaction = None
        self._engine.set_weight_version(transaction.version)
        self._engine.reset_prefix_cache()
        self._version, self._partial = transaction.version, False
        logger.info("ipc receiver %s: version %d committed", self.address, self._version)
        return {"version": self._version}

    def _abort(self, message: Mapping[str, Any]) -> dict[str, Any]:
        if self._transaction is not None:
            logger.warning(
                "ipc receiver %s: refit %d aborted", self.address, self._transaction.version
            )
        self._transaction = None
        return {}


def _views(memory: torch.Tensor, items: list[Item]) -> Iterator[tuple[str, torch.Tensor]]:
    for item in items:
        region = memory[item.offset : item.offset + slot_bytes(item.spec)]
        yield item.name, region.view(torch_dtype(item.spec.dtype)).view(item.spec.shape)
