"""The rotated k-ary trees over a relay list."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refit_zmq.relay import RelayTree


def _relays(count: int) -> list[str]:
    return [f"tcp://10.0.0.{i}:5555" for i in range(count)]


@given(count=st.integers(1, 40), fanout=st.integers(1, 5), root=st.integers(0, 39))
def test_every_tree_reaches_every_relay_once(count: int, fanout: int, root: int) -> None:
    relays = _relays(count)
    tree = RelayTree.of(relays, fanout)
    top = relays[root % count]
    reached = [top]
    for relay in tree.order(top):
        children = tree.children(top, relay)
        assert len(children) <= fanout
        reached.extend(children)
    assert sorted(reached) == sorted(relays)


def test_roots_rotate_the_inner_relays() -> None:
    relays = _relays(7)
    tree = RelayTree.of(relays, 2)
    inner = {root: {r for r in relays if tree.children(root, r)} for root in relays[:3]}
    assert inner[relays[0]] == set(relays[0:3])
    assert inner[relays[1]] == set(relays[1:4])
    assert tree.children(relays[0], relays[1]) == relays[3:5]
    assert RelayTree.of(relays, 1).children(relays[5], relays[6]) == [relays[0]]


def test_tree_id_names_order_and_fanout() -> None:
    relays = _relays(4)
    ids = {
        RelayTree.of(relays, 2).tree_id,
        RelayTree.of(relays, 3).tree_id,
        RelayTree.of(list(reversed(relays)), 2).tree_id,
    }
    assert len(ids) == 3 and all(len(i) == 16 for i in ids)
    assert RelayTree.of(relays, 2).tree_id == RelayTree.of(list(relays), 2).tree_id
    with pytest.raises(ValueError, match="distinct"):
        RelayTree.of([relays[0], relays[0]], 2)
