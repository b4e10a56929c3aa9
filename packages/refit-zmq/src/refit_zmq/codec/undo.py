"""Undo data: the bits an apply overwrote, so a failed refit can roll back exactly."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from refit_zmq.codec.scatter import scatter, write_range

__all__ = ["UndoEntry", "UndoLog"]


@dataclass(frozen=True)
class UndoEntry:
    """Old bits of one write into a flat integer view.

    ``indices`` None means the write covered ``old.numel()`` elements from ``start``.
    """

    target: torch.Tensor
    old: torch.Tensor
    indices: torch.Tensor | None = None
    start: int = 0

    @property
    def nbytes(self) -> int:
        """Memory this entry holds."""
        held = self.old.numel() * self.old.element_size()
        if self.indices is not None:
            held += self.indices.numel() * self.indices.element_size()
        return held

    def restore(self) -> None:
        """Write the old bits back."""
        if self.indices is None:
            write_range(self.target, self.start, self.old)
        else:
            scatter(self.target, self.indices, self.old)


@dataclass
class UndoLog:
    """Undo entries in write order; :meth:`restore` replays them newest first.

    Newest-first replay makes overlapping writes (the same payload applied twice) roll back
    to the bits from before the first write.
    """

    entries: list[UndoEntry] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Memory the log holds."""
        return sum(entry.nbytes for entry in self.entries)

    def add(self, entry: UndoEntry) -> None:
        """Record one write (before making it)."""
        self.entries.append(entry)

    def extend(self, entries: Iterable[UndoEntry]) -> None:
        """Record several writes, oldest first (for example another log's ``entries``)."""
        self.entries.extend(entries)

    def restore(self) -> None:
        """Roll every recorded write back, newest first, then forget them."""
        for entry in reversed(self.entries):
            entry.restore()
        self.entries.clear()

    def discard(self) -> None:
        """Forget the recorded writes (on commit)."""
        self.entries.clear()
