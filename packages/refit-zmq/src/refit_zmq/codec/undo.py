"""Undo data: the bits an apply overwrote, so a failed refit can roll back exactly."""

from __future__ import annotations

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
    nbytes: int = field(init=False, default=0)
    """Memory the log holds."""

    def __post_init__(self) -> None:
        self.nbytes = sum(entry.nbytes for entry in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: UndoEntry) -> None:
        """Record one write (before making it)."""
        self.entries.append(entry)
        self.nbytes += entry.nbytes

    def extend(self, other: UndoLog) -> None:
        """Record another log's writes after this one's (they were made later)."""
        self.entries.extend(other.entries)
        self.nbytes += other.nbytes

    def restore(self) -> None:
        """Roll every recorded write back, newest first, then forget them."""
        for entry in reversed(self.entries):
            entry.restore()
        self.discard()

    def discard(self) -> None:
        """Forget the recorded writes (on commit)."""
        self.entries.clear()
        self.nbytes = 0
