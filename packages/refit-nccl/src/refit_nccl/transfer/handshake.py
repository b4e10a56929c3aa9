"""Agree on a transfer plan before the first byte moves: every rank compares plan digests."""

from __future__ import annotations

import torch

from refit_core import GeometryMismatchError
from refit_core.backend import Deadline
from refit_nccl.group.abortable import AbortableProcessGroup

__all__ = ["agree_on_plan"]

_WORD_BYTES = 7
"""Digest bytes per int64 word, so a word and its negation both fit."""
_WORDS = 4


def agree_on_plan(group: AbortableProcessGroup, digest: str, deadline: Deadline) -> None:
    """Compare this rank's plan ``digest`` (hex) with every other rank's.

    One all-reduce of ``[words, -words]`` under MAX yields the maximum and minimum of every
    word across ranks, so all ranks reach the same verdict.

    Raises:
        GeometryMismatchError: some rank planned differently; no rank starts the transfer.
        RefitTimeoutError: the exchange did not complete by the deadline.
    """
    raw = bytes.fromhex(digest)
    if len(raw) < _WORD_BYTES * _WORDS:
        raise ValueError(f"digest {digest!r} is shorter than {_WORD_BYTES * _WORDS} bytes")
    words = [
        int.from_bytes(raw[i * _WORD_BYTES : (i + 1) * _WORD_BYTES], "big") for i in range(_WORDS)
    ]
    probe = torch.tensor(words + [-w for w in words], dtype=torch.int64, device=group.device)
    group.all_reduce(probe, deadline, op="max")
    highest, lowest = probe[:_WORDS].tolist(), [-v for v in probe[_WORDS:].tolist()]
    if highest != words or lowest != words:
        raise GeometryMismatchError(
            f"{group.spec.label}: transfer plans differ across ranks (this rank's digest "
            f"{digest[:16]}...); sender and receivers disagree on names, dtypes, shapes or "
            "packing geometry"
        )
