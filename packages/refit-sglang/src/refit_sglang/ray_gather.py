"""Buckets gathered from trainer ranks running as Ray actors (:class:`~refit_sglang.rank.
TrainerRank`) to the rank colocated with the engine's first rank.

Per bucket, each other owner's ``refit_pieces`` result travels as a Ray object straight into
the root's ``refit_gather`` (Ray resolves the references; the tensors never pass through the
controller); the root answers with the flattened bucket's handle, which goes to the engines,
and frees the buffer on ``refit_release`` once they have answered. One bucket is in flight at
a time. Every Ray call is bounded by the refit deadline: a rank that does not answer in time
is a ``RefitTimeoutError`` naming it, a dead one a ``WorkerError``.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import Any

import torch

from refit_core import RefitError, RefitTimeoutError, TensorSpec, WorkerError
from refit_core.backend import Deadline
from refit_sglang.buckets import group_by_dtype
from refit_sglang.sources import BucketSource, Payload

__all__ = ["RayTrainerRanks", "plan_owners"]

logger = logging.getLogger(__name__)

_Item = tuple[str, TensorSpec, int]
"""A tensor of the refit: name, spec, owning rank."""


def plan_owners(manifests: Sequence[dict[str, TensorSpec]]) -> list[_Item]:
    """Every tensor once, owned by the first rank that holds it; rank by rank, each rank's
    tensors in its own order.

    Raises:
        ValueError: two ranks hold a tensor with different specs.
    """
    items: dict[str, _Item] = {}
    for rank, manifest in enumerate(manifests):
        for name, spec in manifest.items():
            held = items.setdefault(name, (name, spec, rank))
            if held[1] != spec:
                raise ValueError(f"{name}: rank {held[2]} holds {held[1]}, rank {rank} {spec}")
    return list(items.values())


class RayTrainerRanks(BucketSource):
    """Trainer ranks as Ray actor handles of :class:`~refit_sglang.rank.TrainerRank`.

    Args:
        ranks: the actor handles, rank 0 first.
        root: the rank colocated with the engine's first rank (it builds every bucket).
        control_timeout_s: bound of every Ray call when no deadline is armed.
    """

    def __init__(
        self, ranks: Sequence[Any], *, root: int = 0, control_timeout_s: float = 60.0
    ) -> None:
        if not ranks:
            raise ValueError("need at least one trainer rank")
        if not 0 <= root < len(ranks):
            raise ValueError(f"root {root} is not one of {len(ranks)} ranks")
        self._ranks = tuple(ranks)
        self._root = root
        self._control_timeout_s = control_timeout_s

    def payloads(
        self, bucket_size_bytes: int, copies: int, deadline: Deadline
    ) -> Generator[Payload, None, None]:
        """Gather, yield, release: one bucket alive at a time, every rank reset at the end."""
        manifests = self._all("refit_manifest", deadline)
        items = plan_owners(manifests)
        self._all("refit_begin", deadline)
        try:
            for group, last in group_by_dtype(
                items,
                lambda i: i[1].dtype,
                lambda i: i[1].numel * _itemsize(i[1]),
                bucket_size_bytes,
            ):
                serialized, nbytes = self._gather(group, copies, deadline)
                yield Payload(tuple(serialized), nbytes, last)
                self._get(
                    self._root,
                    self._ranks[self._root].refit_release.remote(),
                    "refit_release",
                    deadline,
                )
        finally:
            self._end()

    def close(self) -> None:
        """Nothing to release: the actors belong to whoever created them."""

    def _gather(self, group: list[_Item], copies: int, deadline: Deadline) -> tuple[list[str], int]:
        root = self._root
        names = [name for name, _, _ in group]
        owners = [owner for _, _, owner in group]
        order = [owner for owner in dict.fromkeys(owners) if owner != root]
        pieces = {
            owner: self._ranks[owner].refit_pieces.remote(
                [n for n, o in zip(names, owners, strict=True) if o == owner]
            )
            for owner in order
        }
        ref = self._ranks[root].refit_gather.remote(names, owners, root, copies, *pieces.values())
        try:
            result: tuple[list[str], int] = self._get(root, ref, "refit_gather", deadline)
        except RefitError as exc:
            raise self._blame(pieces, exc) from exc
        return result

    @staticmethod
    def _blame(pieces: dict[int, Any], error: RefitError) -> RefitError:
        """The owner behind a failed gather: a dead one, or those still busy at a timeout."""
        import ray

        waiting: list[str] = []
        for owner, ref in pieces.items():
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                waiting.append(_label(owner))
            except ray.exceptions.RayError as exc:
                return WorkerError(str(exc), worker=_label(owner), operation="refit_pieces")
        if isinstance(error, RefitTimeoutError) and waiting:
            return RefitTimeoutError(
                f"{', '.join(waiting)}: refit_pieces got no answer by the deadline",
                wedged_workers=waiting,
            )
        return error

    def _all(self, method: str, deadline: Deadline) -> list[Any]:
        refs = [getattr(rank, method).remote() for rank in self._ranks]
        return [self._get(index, ref, method, deadline) for index, ref in enumerate(refs)]

    def _get(self, rank: int, ref: Any, operation: str, deadline: Deadline) -> Any:
        import ray

        timeout = deadline.timeout_for(self._control_timeout_s)
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            label = _label(rank)
            raise RefitTimeoutError(
                f"{label}: {operation} got no answer within {timeout:.3g} s",
                wedged_workers=[label],
            ) from exc
        except ray.exceptions.RayError as exc:
            raise WorkerError(str(exc), worker=_label(rank), operation=operation) from exc

    def _end(self) -> None:
        """Tell every rank the refit is over; not awaited (a rank runs it before its next
        call, and a dead or frozen rank must not hold the refit past its deadline)."""
        for rank in self._ranks:
            rank.refit_end.remote()


def _label(rank: int) -> str:
    return f"trainer rank {rank}"


def _itemsize(spec: TensorSpec) -> int:
    return int(getattr(torch, spec.dtype).itemsize)
