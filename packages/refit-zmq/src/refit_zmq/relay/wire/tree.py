"""The k-ary relay tree: one tree per root, the relay list rotated to start at the root.

Position ``i`` of the rotated list has children ``k*i+1 .. k*i+k``, so every relay is in
every tree, each tree has depth ``ceil(log_k(n))``, and producers that root at different
relays put different relays in the inner (forwarding) positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = ["RelayTree"]


@dataclass(frozen=True)
class RelayTree:
    """An ordered set of relay addresses and the fan-out of every tree over it."""

    relays: tuple[str, ...]
    fanout: int

    def __post_init__(self) -> None:
        if not self.relays or len(set(self.relays)) != len(self.relays):
            raise ValueError("a relay tree needs distinct relay addresses")
        if self.fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {self.fanout}")

    @classmethod
    def of(cls, relays: Sequence[str], fanout: int) -> RelayTree:
        """The tree over ``relays`` (in this order) with ``fanout`` children per relay."""
        return cls(tuple(relays), fanout)

    @property
    def tree_id(self) -> str:
        """16 hex digits naming the relay list and fan-out; every relay must agree on it."""
        text = "\n".join((str(self.fanout), *self.relays))
        return xxhash.xxh3_64_hexdigest(text.encode())

    def order(self, root: str) -> list[str]:
        """The relays in breadth-first order of the tree rooted at ``root``."""
        at = self.relays.index(root)
        return [*self.relays[at:], *self.relays[:at]]

    def children(self, root: str, relay: str) -> list[str]:
        """The children of ``relay`` in the tree rooted at ``root``."""
        order = self.order(root)
        first = self.fanout * order.index(relay) + 1
        return order[first : first + self.fanout]
