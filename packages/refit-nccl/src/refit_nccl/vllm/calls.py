"""The bytes a refit call and its reply travel as through vLLM's ``collective_rpc``.

vLLM serializes RPC arguments with msgpack and refuses arbitrary objects (tensors and custom
types fail unless insecure serialization is switched on), while bytes always pass. A call is a
method name from a fixed set plus its arguments, pickled; a reply is the result, the
error's type name and message, or word that the call still runs (a staging polled), pickled. Both ends are refit code on a trusted control channel
(vLLM's own, which carries the model), exactly as Ray actor calls are.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from refit_core import BackendNotInstalledError, ProtocolError, Recovery, RefitError, WorkerError
from refit_core.backend import refit_error_type, role_methods
from refit_nccl.roles.contract import CollectiveStagingRole

__all__ = [
    "ENDPOINT_METHODS",
    "decode_call",
    "decode_reply",
    "encode_call",
    "encode_reply",
    "reply_partial",
    "reply_pending",
]

ENDPOINT_METHODS = role_methods(CollectiveStagingRole)
"""The methods of the engine role (staging included) a controller may call."""


@dataclass(frozen=True)
class _Call:
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _Reply:
    result: Any = None
    error_type: str | None = None
    error_message: str = ""
    recovery: str | None = None
    partial: bool = False
    pending: bool = False


def encode_call(method: str, args: tuple[Any, ...]) -> bytes:
    """One endpoint call as bytes.

    Raises:
        ValueError: ``method`` is not an endpoint method.
    """
    if method not in ENDPOINT_METHODS:
        raise ValueError(f"{method!r} is not an endpoint method")
    return pickle.dumps(_Call(method, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)


def decode_call(data: bytes) -> tuple[str, tuple[Any, ...]]:
    """``(method, args)`` of an encoded call.

    Raises:
        ProtocolError: not an encoded endpoint call.
    """
    call = pickle.loads(data)
    if not isinstance(call, _Call) or call.method not in ENDPOINT_METHODS:
        raise ProtocolError(f"not a refit endpoint call: {type(call).__name__}")
    return call.method, call.args


def encode_reply(
    result: Any = None,
    error: BaseException | None = None,
    *,
    partial: bool = False,
    pending: bool = False,
) -> bytes:
    """A result, an error by type name and message (exceptions do not always unpickle), or
    ``pending`` (the call still runs); and whether the worker's model now holds weights other
    than the version it serves."""
    if error is None:
        reply = _Reply(result, partial=partial, pending=pending)
    else:
        recovery = error.recovery.value if isinstance(error, RefitError) else None
        reply = _Reply(None, type(error).__name__, str(error), recovery, partial)
    return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)


def _reply(data: bytes, worker: str) -> _Reply:
    reply = pickle.loads(data)
    if not isinstance(reply, _Reply):
        raise ProtocolError(f"{worker}: not a refit reply: {type(reply).__name__}")
    return reply


def reply_partial(data: bytes, worker: str) -> bool:
    """Whether the replying worker's model holds weights other than the version it serves.

    Raises:
        ProtocolError: not an encoded reply.
    """
    return _reply(data, worker).partial


def reply_pending(data: bytes, worker: str) -> bool:
    """Whether the replying worker's call still runs (no result or error yet).

    Raises:
        ProtocolError: not an encoded reply.
    """
    return _reply(data, worker).pending


def decode_reply(data: bytes, worker: str, method: str) -> Any:
    """The result of an encoded reply; its error raised as the refit error of the same name
    (``TimeoutError`` as :class:`~refit_core.errors.RefitTimeoutError`), anything else as a
    :class:`~refit_core.errors.WorkerError`.

    Raises:
        ProtocolError: not an encoded reply.
    """
    reply = _reply(data, worker)
    if reply.error_type is None:
        return reply.result
    name = "RefitTimeoutError" if reply.error_type == "TimeoutError" else reply.error_type
    error_type = refit_error_type(name)
    message = f"{worker}: {method}: {reply.error_message}"
    recovery = None if reply.recovery is None else Recovery(reply.recovery)
    if error_type is not None and error_type not in (WorkerError, BackendNotInstalledError):
        raise error_type(message, recovery=recovery)
    raise WorkerError(
        f"{reply.error_type}: {reply.error_message}",
        worker=worker,
        operation=method,
        recovery=recovery,
    )
