"""Pure membership planning: contiguous ranks for trainers, then each surviving engine shard."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

__all__ = ["Membership", "ShardRanks", "plan_membership"]


@dataclass(frozen=True)
class ShardRanks:
    """The ranks of one engine shard: ``size`` ranks starting at ``offset``."""

    shard: int
    offset: int
    size: int

    def rank_of(self, local_rank: int) -> int:
        """Group rank of the shard's ``local_rank``-th worker."""
        if not 0 <= local_rank < self.size:
            raise ValueError(f"shard {self.shard} has no local rank {local_rank}")
        return self.offset + local_rank


@dataclass(frozen=True)
class Membership:
    """Who is in one group: ranks ``0..trainers-1`` are trainers (rank 0 the source), then
    the shards in ascending shard index, each on contiguous ranks."""

    trainers: int
    shards: tuple[ShardRanks, ...]

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.trainers + sum(s.size for s in self.shards)

    @property
    def shard_indices(self) -> tuple[int, ...]:
        """Indices of the member shards, ascending."""
        return tuple(s.shard for s in self.shards)

    def shard(self, index: int) -> ShardRanks:
        """The ranks of shard ``index``; KeyError if it is not a member."""
        for ranks in self.shards:
            if ranks.shard == index:
                return ranks
        raise KeyError(f"shard {index} is not a member (members: {list(self.shard_indices)})")


def plan_membership(
    trainers: int, shard_sizes: Mapping[int, int], absent: Collection[int] = ()
) -> Membership:
    """Assign ranks: trainers first, then every shard of ``shard_sizes`` not in ``absent``.

    Args:
        trainers: number of trainer ranks (>= 1; rank 0 sends).
        shard_sizes: shard index -> number of engine workers (ranks) in that shard.
        absent: shard indices to leave out (dead, frozen or drained).

    Raises:
        ValueError: no trainer, a shard without workers, a negative index, or no shard left.
    """
    if trainers < 1:
        raise ValueError(f"need at least one trainer rank, got {trainers}")
    if any(index < 0 for index in shard_sizes):
        raise ValueError(f"shard indices must be >= 0, got {sorted(shard_sizes)}")
    empty = sorted(index for index, size in shard_sizes.items() if size < 1)
    if empty:
        raise ValueError(f"shards {empty} have no workers")
    members = sorted(set(shard_sizes) - set(absent))
    if not members:
        raise ValueError(f"no engine shard left (all of {sorted(shard_sizes)} are absent)")
    shards: list[ShardRanks] = []
    offset = trainers
    for index in members:
        shards.append(ShardRanks(index, offset, shard_sizes[index]))
        offset += shard_sizes[index]
    return Membership(trainers, tuple(shards))
