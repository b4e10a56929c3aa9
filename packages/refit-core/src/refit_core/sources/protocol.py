"""The protocols every trainer-side source implements, and the bucket a sharded one yields."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from refit_core.sources.ordering import CollectiveOrderGuard
from refit_core.types import NamedTensor, StateDictInfo

__all__ = ["Bucket", "ShardedWeightSource", "WeightSource"]


@runtime_checkable
class WeightSource(Protocol):
    """A trainer's weights as the engine will receive them.

    Contract: ``state_dict_info()`` describes every checkpoint tensor ``iter_tensors()``
    delivers, in the same order, under the engine's checkpoint names and in the engine's dtype
    (cast once, see :mod:`refit_core.sources.cast`); scale companions are listed right after
    their owner and ride in its metadata (see :mod:`refit_core.sources.scales`). Iteration
    holds at most one tensor (or one bucket) of extra memory at a time.
    """

    def state_dict_info(self) -> StateDictInfo:
        """Checkpoint name -> spec, in iteration order."""
        ...

    def iter_tensors(self) -> Iterator[NamedTensor]:
        """Yield every checkpoint tensor once, in ``state_dict_info()`` order."""
        ...


@dataclass(frozen=True)
class Bucket:
    """One bucket of a sharded source, identical in ``index`` and ``info`` on every rank.

    Attributes:
        index: position of the bucket in the stream, from 0.
        info: checkpoint name -> spec of every tensor in the bucket (companions included), so
            a rank that does not send can still take part in a collective on it.
        tensors: the bucket's tensors on a sending rank; empty on every other rank.
    """

    index: int
    info: StateDictInfo
    tensors: tuple[NamedTensor, ...]


@runtime_checkable
class ShardedWeightSource(WeightSource, Protocol):
    """A source whose iteration runs collectives on the trainer's ranks (FSDP2, Megatron).

    Every rank of the trainer's group iterates it, in lock step, and gets the same buckets
    (tensors only where it sends). Each bucket's gathers complete before it is yielded. A
    consumer that runs its own collectives on any of those ranks runs them between yields,
    inside ``order_guard.consumer_turn()``, on every rank in the same order; the guard raises
    :class:`~refit_core.sources.ordering.CollectiveOrderError` instead of letting them overlap.
    ``iter_tensors()`` is ``iter_buckets()`` flattened.
    """

    @property
    def order_guard(self) -> CollectiveOrderGuard:
        """The guard that the source's gathers and its consumer's collectives share."""
        ...

    def iter_buckets(self) -> Iterator[Bucket]:
        """Yield every bucket once, gathered in full before it is yielded."""
        ...
