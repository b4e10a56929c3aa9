"""What the parent and the communicator's child say to each other over their socket pair.

The parent sends its :class:`~refit_nccl.group.spec.GroupSpec` and the connect timeout first,
then a registration ``("register", buffer id, path, size)`` per shared buffer and one
:class:`ChildCall` per call; the child answers the connect and every call, in order, with a
:class:`ChildReply`.
"""

from __future__ import annotations

import dataclasses

import torch

from refit_core import (
    GeometryMismatchError,
    ProtocolError,
    RefitAbortedError,
    RefitError,
    RefitTimeoutError,
)
from refit_nccl.group.calls import ReduceOpName

__all__ = ["CONNECT_ID", "ChildCall", "ChildReply"]

CONNECT_ID = -1
"""The call id of the child's answer to the connect."""

_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (RefitTimeoutError, RefitAbortedError, ProtocolError, GeometryMismatchError)
}
"""Errors the child reports that keep their type in the parent (others become RefitError)."""


@dataclasses.dataclass(frozen=True)
class ChildCall:
    """One call for the child: ``op`` on the first ``nbytes`` of buffer ``buffer``, by
    the deadline ``timeout_s`` (its wire form, ``Deadline.to_wire``)."""

    call_id: int
    op: str
    buffer: int
    nbytes: int
    dtype: torch.dtype
    peer: int
    timeout_s: float | None
    reduce: ReduceOpName = "sum"
    tag: int = 0


@dataclasses.dataclass(frozen=True)
class ChildReply:
    """The child's answer to one call: its error's type name and message, or None."""

    call_id: int
    error: tuple[str, str] | None

    @classmethod
    def failed(cls, call_id: int, error: BaseException) -> ChildReply:
        """The reply to a call that raised ``error``."""
        return cls(call_id, (type(error).__name__, str(error)))

    def raise_error(self) -> None:
        """Raise the child's error in the parent: a refit error of the same type where it has
        one of the types that keep theirs, else a RefitError naming the type."""
        if self.error is None:
            return
        name, message = self.error
        cls = _ERRORS.get(name)
        raise cls(message) if cls is not None else RefitError(f"{name}: {message}")
