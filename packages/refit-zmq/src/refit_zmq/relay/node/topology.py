"""Where a relay sits: its own address and the tree it was configured with."""

from __future__ import annotations

from refit_zmq.relay.wire.errors import TreeMismatchError
from refit_zmq.relay.wire.tree import RelayTree

__all__ = ["Topology"]


class Topology:
    """A relay's address and tree; every relay's own tree until :meth:`configure`."""

    def __init__(self, own: str = "") -> None:
        self.own = own
        self.tree: RelayTree | None = None

    @property
    def tree_id(self) -> str | None:
        """The configured tree's id."""
        return None if self.tree is None else self.tree.tree_id

    def configure(self, relays: list[str], own: str, fanout: int) -> RelayTree:
        """Adopt the tree over ``relays`` in which this relay is ``own``."""
        if own not in relays:
            raise TreeMismatchError(f"own address {own} is not among the relays")
        self.tree = RelayTree.of(relays, fanout)
        self.own = own
        return self.tree

    def children(self, root: str) -> list[str]:
        """This relay's children in the tree rooted at ``root``."""
        return [] if self.tree is None else self.tree.children(root, self.own)

    def check(self, root: str, tree_id: str | None) -> None:
        """Refuse a payload of another tree, or rooted at a relay this tree lacks.

        Raises:
            TreeMismatchError: the payload does not belong to this relay's tree.
        """
        if self.tree is None:
            if root != self.own or tree_id is not None:
                raise TreeMismatchError(f"relay {self.own} has no tree configured")
            return
        if tree_id is not None and tree_id != self.tree.tree_id:
            raise TreeMismatchError(f"tree {tree_id} is not this relay's tree {self.tree.tree_id}")
        if root not in self.tree.relays:
            raise TreeMismatchError(f"root {root} is not a relay of tree {self.tree.tree_id}")
