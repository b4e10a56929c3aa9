"""Typed calls into an engine's workers, and the replies that never raise.

A backend that reaches its receivers through an engine's own RPC (vLLM's ``collective_rpc``)
adds one worker method to the engine. Each call is a frozen dataclass of a
:class:`WorkerCall` subclass whose :meth:`~WorkerCall.run` calls the backend's worker role (a
``Protocol``) by its typed method, so a wrong method or argument is a type error where the call
is written, and the worker method is one dispatcher: :func:`answer` decodes the call and runs
it, never switching on a method's name::

    @dataclass(frozen=True)
    class Commit(WorkerCall[WorkerRole, int]):
        version: int

        def run(self, target: WorkerRole) -> int:
            return target.commit(self.version)

Calls and replies travel as pickled bytes: vLLM serializes RPC arguments with msgpack, which
refuses custom types unless insecure serialization is switched on, while bytes always pass.
Both ends are refit code on the engine's own control channel (it carries the model), as Ray
actor calls are. A worker method answers with a :class:`WorkerReply` and never raises: vLLM
0.32's multiprocess executor stops reading replies at the first worker that raised, leaving the
others queued for the next RPC to read as its own.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from refit_core.errors import (
    BackendNotInstalledError,
    ProtocolError,
    Recovery,
    RefitError,
    WorkerError,
    refit_error_type,
)

__all__ = ["WorkerCall", "WorkerReply", "answer", "encode", "reply_from_bytes"]

logger = logging.getLogger(__name__)

TargetT_contra = TypeVar("TargetT_contra", contravariant=True)
ResultT_co = TypeVar("ResultT_co", covariant=True)
_TargetT = TypeVar("_TargetT")
_ResultT = TypeVar("_ResultT")


class WorkerCall(Generic[TargetT_contra, ResultT_co]):
    """One call into an engine worker: its arguments (subclasses are frozen dataclasses) and
    the typed role method it runs there. (Not abstract, so that a worker can name the base of
    the calls it takes: :func:`answer`.)"""

    def run(self, target: TargetT_contra) -> ResultT_co:
        """Run the call on the worker's role object; its result."""
        raise NotImplementedError(f"{type(self).__name__} does not say what it runs")


@dataclass(frozen=True)
class WorkerReply(Generic[_ResultT]):
    """A worker's answer to a call: its result, or its error by type name and message
    (exceptions do not always unpickle); and whether the worker's model now holds weights other
    than the version it serves (for backends whose workers report it with every reply)."""

    result: _ResultT | None = None
    error_type: str | None = None
    error_message: str = ""
    recovery: str | None = None
    partial: bool = False

    @classmethod
    def failed(cls, error: BaseException, *, partial: bool = False) -> WorkerReply[Any]:
        """The reply that carries ``error``."""
        recovery = error.recovery.value if isinstance(error, RefitError) else None
        return cls(None, type(error).__name__, str(error), recovery, partial)

    @property
    def ok(self) -> bool:
        """Whether the call returned."""
        return self.error_type is None

    def unwrap(self, worker: str, operation: str) -> _ResultT:
        """The result; the error raised as the refit error of the same name (``TimeoutError``
        as :class:`~refit_core.errors.RefitTimeoutError`), anything else as a
        :class:`~refit_core.errors.WorkerError` naming ``worker`` and ``operation``."""
        if self.error_type is None:
            return self.result  # type: ignore[return-value]  # None only for a None result
        name = "RefitTimeoutError" if self.error_type == "TimeoutError" else self.error_type
        error_type = refit_error_type(name)
        recovery = None if self.recovery is None else Recovery(self.recovery)
        if error_type is not None and error_type not in (WorkerError, BackendNotInstalledError):
            raise error_type(f"{worker}: {operation}: {self.error_message}", recovery=recovery)
        raise WorkerError(
            f"{self.error_type}: {self.error_message}",
            worker=worker,
            operation=operation,
            recovery=recovery,
        )


def encode(message: WorkerCall[Any, Any] | WorkerReply[Any]) -> bytes:
    """A call or a reply as the bytes it travels as."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def answer(
    data: bytes,
    call_type: type[WorkerCall[_TargetT, Any]],
    target: Callable[[], _TargetT],
    *,
    partial: Callable[[], bool] = lambda: False,
) -> WorkerReply[Any]:
    """Decode a call of ``call_type`` and run it on ``target()``; never raises.

    Anything else (not a pickled ``call_type``, a target that cannot be built, a call that
    raises) is answered by the failed reply that says why: a :class:`ProtocolError` for what
    is not such a call. ``partial()`` is asked after the call, also after a failed one.
    """
    try:
        call = pickle.loads(data)
        if not isinstance(call, call_type):
            raise ProtocolError(
                f"{type(call).__name__} is not one of the {call_type.__name__} calls"
            )
        reply: WorkerReply[Any] = WorkerReply(call.run(target()))
    except Exception as exc:
        logger.warning("worker call failed", exc_info=True)
        reply = WorkerReply.failed(exc)
    try:
        return WorkerReply(
            reply.result, reply.error_type, reply.error_message, reply.recovery, partial()
        )
    except Exception as exc:
        logger.warning("worker cannot say whether its model is partial", exc_info=True)
        return WorkerReply.failed(exc)


def reply_from_bytes(data: bytes, worker: str) -> WorkerReply[Any]:
    """The reply ``data`` encodes.

    Raises:
        ProtocolError: not an encoded reply.
    """
    try:
        reply = pickle.loads(data)
    except Exception as exc:
        raise ProtocolError(f"{worker}: not a refit reply: {exc}") from exc
    if not isinstance(reply, WorkerReply):
        raise ProtocolError(f"{worker}: not a refit reply: {type(reply).__name__}")
    return reply
