"""Trainer ranks for the Ray tests: each a replica of one seeded ``SimulatedTrainer`` that
serves only its share of the tensors (every ``ranks``-th name), so a bucket gathers pieces
from several ranks. Shipped to Ray workers by value."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from refit_core.sources import StateDictSource
from refit_lab.reference_engine import ReferenceModelConfig, random_checkpoint
from refit_lab.trainer import SimulatedTrainer
from refit_sglang import TrainerRank


class ShardedTrainer:
    """A ``PolicyLike`` holding the tensors of shard ``rank`` of ``ranks``."""

    def __init__(self, config: ReferenceModelConfig, rank: int, ranks: int) -> None:
        self.trainer = SimulatedTrainer(
            random_checkpoint(config, 1), engine_dtype=config.dtype, lr=1e-2
        )
        self._names = sorted(self.trainer.masters)[rank::ranks]

    def weight_source(self) -> StateDictSource:
        masters = self.trainer.masters
        return StateDictSource(
            {n: masters[n].detach() for n in self._names}, dtype=self.trainer.engine_dtype
        )


class ShardRank(TrainerRank):
    """A :class:`TrainerRank` over a :class:`ShardedTrainer`, with faults for the tests."""

    def __init__(self, config: ReferenceModelConfig, rank: int, ranks: int) -> None:
        self._shard = ShardedTrainer(config, rank, ranks)
        super().__init__(self._shard)
        self._fault: tuple[str, int] | None = None
        self._served = 0

    def step(self) -> None:
        self._shard.trainer.step()

    def fault(self, kind: str, after: int) -> None:
        """``die`` (exit) or ``freeze`` (sleep) on the piece request after ``after`` served."""
        self._fault = (kind, after)

    def refit_pieces(self, names: Sequence[str]) -> list[torch.Tensor]:
        if self._fault is not None and self._served >= self._fault[1]:
            if self._fault[0] == "die":
                os._exit(1)
            time.sleep(30)
        self._served += 1
        return super().refit_pieces(names)
