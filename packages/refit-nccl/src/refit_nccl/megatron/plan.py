"""The reshard planner: source and destination layouts -> the copies that move the bytes.

Pure: no torch, no communication. Source ranks are numbered ``0..S-1`` and destination ranks
``0..D-1`` in their own layouts. When ``colocated``, source rank ``r`` and destination rank
``r`` are the same process, so what a destination rank already holds as a source shard is
copied in place, never sent. Each piece of a destination shard comes from exactly one source
rank (a replicated piece is sent once per destination rank that needs it, from the least
loaded source holding it), so the bytes sent equal the lower bound: the bytes each destination
rank needs and does not already hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from refit_nccl.megatron.layout import ParamLayout, Span

__all__ = ["Copy", "ReshardPlan", "plan_reshard"]


@dataclass(frozen=True)
class Copy:
    """Rows ``span`` (along the layout's dim) of ``name`` from ``src`` to ``dst``.

    ``src_offset`` / ``dst_offset`` are where the rows start in the local tensors.
    """

    name: str
    src: int
    dst: int
    span: Span
    src_offset: int
    dst_offset: int


@dataclass(frozen=True)
class ReshardPlan:
    """The copies of one reshard, in the order every rank executes them.

    Attributes:
        sources: layouts of the source ranks.
        destinations: layouts of the destination ranks.
        colocated: source rank ``r`` and destination rank ``r`` are one process.
        copies: the copies, ordered by parameter then destination then position.
    """

    sources: Mapping[str, ParamLayout]
    destinations: Mapping[str, ParamLayout]
    colocated: bool
    copies: tuple[Copy, ...]

    @property
    def source_world(self) -> int:
        """Number of source ranks."""
        return _world(self.sources)

    @property
    def destination_world(self) -> int:
        """Number of destination ranks."""
        return _world(self.destinations)

    @property
    def world_size(self) -> int:
        """Processes taking part: shared when colocated, sources then destinations otherwise."""
        if self.colocated:
            return max(self.source_world, self.destination_world)
        return self.source_world + self.destination_world

    def process_of_source(self, rank: int) -> int:
        """Process (group rank) of source rank ``rank``."""
        return rank

    def process_of_destination(self, rank: int) -> int:
        """Process (group rank) of destination rank ``rank``."""
        return rank if self.colocated else self.source_world + rank

    def copy_bytes(self, copy: Copy) -> int:
        """Bytes ``copy`` moves."""
        return len(copy.span) * self.sources[copy.name].row_bytes

    def is_local(self, copy: Copy) -> bool:
        """Whether ``copy`` stays inside one process."""
        return self.process_of_source(copy.src) == self.process_of_destination(copy.dst)

    @property
    def sent_bytes(self) -> int:
        """Bytes that cross between processes."""
        return sum(self.copy_bytes(c) for c in self.copies if not self.is_local(c))

    @property
    def lower_bound_bytes(self) -> int:
        """Bytes each destination rank needs and its process does not hold, summed."""
        total = 0
        for name, dst in self.destinations.items():
            src = self.sources[name]
            for rank, spans in dst.holders.items():
                held = src.holders.get(rank, ()) if self.colocated else ()
                needed = sum(len(s) for s in spans) - _overlap(spans, held)
                total += needed * dst.row_bytes
        return total

    @property
    def naive_bytes(self) -> int:
        """Gather-then-broadcast: each parameter gathered whole on its lowest source rank, then
        the whole model broadcast to every destination rank."""
        total = 0
        for src in self.sources.values():
            root = min(src.holders)
            gathered = src.shape[src.dim] - _overlap(
                (Span(0, src.shape[src.dim]),), src.holders[root]
            )
            total += gathered * src.row_bytes + self.destination_world * src.nbytes
        return total


def plan_reshard(
    sources: Mapping[str, ParamLayout],
    destinations: Mapping[str, ParamLayout],
    *,
    colocated: bool = False,
) -> ReshardPlan:
    """Plan the copies that turn ``sources`` into ``destinations``.

    Raises:
        ValueError: the two sides name different parameters, disagree on a parameter's
            shape, itemsize or split dim, or a destination piece is held by no source rank.
    """
    if set(sources) != set(destinations):
        missing = sorted(set(sources) ^ set(destinations))
        raise ValueError(f"sources and destinations differ in parameters: {missing[:5]}")
    load: dict[int, int] = {}
    copies: list[Copy] = []
    for name in sorted(destinations):
        src, dst = sources[name], destinations[name]
        if (src.shape, src.itemsize, src.dim) != (dst.shape, dst.itemsize, dst.dim):
            raise ValueError(f"{name}: source and destination disagree on shape, dtype or dim")
        for rank in sorted(dst.holders):
            copies.extend(_copies_of(name, src, dst, rank, colocated, load))
    return ReshardPlan(sources, destinations, colocated, tuple(copies))


def _copies_of(
    name: str,
    src: ParamLayout,
    dst: ParamLayout,
    rank: int,
    colocated: bool,
    load: dict[int, int],
) -> Iterator[Copy]:
    pending: Copy | None = None
    for span in dst.holders[rank]:
        for piece in _pieces(span, src):
            holders = [r for r, spans in src.holders.items() if _covers(spans, piece)]
            if not holders:
                raise ValueError(f"{name}: rows {piece} of destination rank {rank} have no source")
            if colocated and rank in holders:
                chosen = rank
            else:
                chosen = min(holders, key=lambda r: (load.get(r, 0), r))
                load[chosen] = load.get(chosen, 0) + len(piece) * src.row_bytes
            copy = Copy(
                name,
                chosen,
                rank,
                piece,
                src.local_offset(chosen, piece.start),
                dst.local_offset(rank, piece.start),
            )
            if pending is not None and _extends(pending, copy):
                pending = Copy(
                    name,
                    chosen,
                    rank,
                    Span(pending.span.start, piece.stop),
                    pending.src_offset,
                    pending.dst_offset,
                )
                continue
            if pending is not None:
                yield pending
            pending = copy
    if pending is not None:
        yield pending


def _pieces(span: Span, src: ParamLayout) -> Iterator[Span]:
    """``span`` cut at every source span boundary inside it."""
    cuts = {span.start, span.stop}
    for spans in src.holders.values():
        for s in spans:
            cuts.update(c for c in (s.start, s.stop) if span.start < c < span.stop)
    ordered = sorted(cuts)
    for start, stop in itertools.pairwise(ordered):
        yield Span(start, stop)


def _covers(spans: tuple[Span, ...], piece: Span) -> bool:
    return any(s.start <= piece.start and piece.stop <= s.stop for s in spans)


def _extends(prev: Copy, nxt: Copy) -> bool:
    """Whether ``nxt`` continues ``prev`` contiguously on both sides."""
    return (
        prev.src == nxt.src
        and prev.span.stop == nxt.span.start
        and prev.src_offset + len(prev.span) == nxt.src_offset
        and prev.dst_offset + len(prev.span) == nxt.dst_offset
    )


def _overlap(spans: tuple[Span, ...], held: tuple[Span, ...]) -> int:
    """Rows of ``spans`` that also lie in ``held`` (spans of one rank never overlap)."""
    return sum(max(0, min(a.stop, b.stop) - max(a.start, b.start)) for a in spans for b in held)


def _world(layouts: Mapping[str, ParamLayout]) -> int:
    return 1 + max((r for layout in layouts.values() for r in layout.holders), default=-1)
