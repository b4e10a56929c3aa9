"""The pure membership planner."""

from __future__ import annotations

import pytest

from refit_nccl.controller.membership import ShardRanks, plan_membership


def test_trainers_first_then_shards_on_contiguous_ranks() -> None:
    membership = plan_membership(2, {0: 2, 1: 1, 2: 2})
    assert membership.world_size == 7
    assert membership.shards == (ShardRanks(0, 2, 2), ShardRanks(1, 4, 1), ShardRanks(2, 5, 2))
    assert membership.shard(2).rank_of(1) == 6


def test_absent_shards_are_left_out_and_ranks_stay_contiguous() -> None:
    membership = plan_membership(1, {3: 2, 0: 2, 1: 2}, absent={1})
    assert membership.shard_indices == (0, 3)
    assert [(s.offset, s.size) for s in membership.shards] == [(1, 2), (3, 2)]
    with pytest.raises(KeyError, match="not a member"):
        membership.shard(1)


def test_same_inputs_give_equal_memberships() -> None:
    assert plan_membership(1, {0: 1, 1: 1}, absent={1}) == plan_membership(1, {0: 1})


@pytest.mark.parametrize(
    ("trainers", "shards", "absent", "match"),
    [
        (0, {0: 1}, set(), "trainer"),
        (1, {0: 0}, set(), "no workers"),
        (1, {-1: 1}, set(), ">= 0"),
        (1, {0: 1}, {0}, "no engine shard left"),
    ],
)
def test_invalid_memberships(
    trainers: int, shards: dict[int, int], absent: set[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        plan_membership(trainers, shards, absent)


def test_local_rank_bounds() -> None:
    with pytest.raises(ValueError, match="no local rank"):
        ShardRanks(0, 1, 2).rank_of(2)
