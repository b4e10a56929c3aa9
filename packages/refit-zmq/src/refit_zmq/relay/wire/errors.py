"""NACK codes and the typed errors they map to, on both sides of a relay link."""

from __future__ import annotations

import enum

from refit_core import (
    AuthenticationError,
    ChecksumMismatchError,
    EngineReport,
    EngineState,
    GeometryMismatchError,
    ProtocolError,
    RefitError,
    RefitTimeoutError,
    StaleBaseError,
    VerificationError,
    WorkerError,
)

__all__ = [
    "NackCode",
    "StaleTransferError",
    "TransferConflictError",
    "TreeMismatchError",
    "code_for_error",
    "error_for_nack",
]


class StaleTransferError(ProtocolError):
    """A message names a transfer that is finished or older than the receiver's version."""


class TransferConflictError(ProtocolError):
    """A payload id reused with another checksum, or a second transfer while one is open."""


class TreeMismatchError(GeometryMismatchError):
    """A payload names a root or tree that this relay is not configured with."""


class NackCode(enum.StrEnum):
    """Why a relay refused a message (the ``code`` field of a NACK)."""

    MALFORMED = "MALFORMED"
    AUTH = "AUTH"
    CHECKSUM = "CHECKSUM"
    STALE_BASE = "STALE_BASE"
    STALE_TRANSFER = "STALE_TRANSFER"
    CONFLICT = "CONFLICT"
    BUSY = "BUSY"
    TOO_LARGE = "TOO_LARGE"
    VERIFICATION = "VERIFICATION"
    GEOMETRY = "GEOMETRY"
    TREE = "TREE"
    APPLY_FAILED = "APPLY_FAILED"


RETRYABLE: frozenset[NackCode] = frozenset({NackCode.BUSY})
"""Codes a sender answers by backing off and sending the same message again."""

_BY_ERROR: tuple[tuple[type[BaseException], NackCode], ...] = (
    (StaleTransferError, NackCode.STALE_TRANSFER),
    (TreeMismatchError, NackCode.TREE),
    (TransferConflictError, NackCode.CONFLICT),
    (AuthenticationError, NackCode.AUTH),
    (ChecksumMismatchError, NackCode.CHECKSUM),
    (StaleBaseError, NackCode.STALE_BASE),
    (VerificationError, NackCode.VERIFICATION),
    (GeometryMismatchError, NackCode.GEOMETRY),
    (ProtocolError, NackCode.MALFORMED),
)


def code_for_error(error: BaseException) -> NackCode:
    """The NACK code that reports ``error`` (raised by a receiver or the relay itself)."""
    for kind, code in _BY_ERROR:
        if isinstance(error, kind):
            return code
    return NackCode.APPLY_FAILED


def error_for_nack(code: NackCode, message: str, *, relay: str, what: str) -> RefitError:
    """The typed error a sender raises for a NACK from ``relay`` about ``what``; it names
    the refusing relay among its ``engines`` (with the refusal as its reason; the shard and
    the state after the transfer are for the coordinator to tell)."""
    text = f"relay {relay} refused {what}: {code}: {message}"
    refusing = (EngineReport(None, relay, EngineState.UNKNOWN, None, f"{code}: {message}"),)
    if code is NackCode.APPLY_FAILED:
        return WorkerError(f"{code}: {message}", worker=relay, operation=what, engines=refusing)
    if code is NackCode.BUSY:
        return RefitTimeoutError(text)
    by_code: dict[NackCode, type[RefitError]] = {
        NackCode.AUTH: AuthenticationError,
        NackCode.CHECKSUM: ChecksumMismatchError,
        NackCode.STALE_BASE: StaleBaseError,
        NackCode.STALE_TRANSFER: StaleTransferError,
        NackCode.CONFLICT: TransferConflictError,
        NackCode.VERIFICATION: VerificationError,
        NackCode.GEOMETRY: GeometryMismatchError,
        NackCode.TREE: TreeMismatchError,
    }
    return by_code.get(code, ProtocolError)(text, engines=refusing)
