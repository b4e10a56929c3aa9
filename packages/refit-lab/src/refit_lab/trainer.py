"""A simulated RL trainer: fp32 master weights updated by real AdamW on random gradients.

Its bf16 casts change sparsely from step to step, as a real policy's do, which is what the
sparse transports, the demo and the benchmarks need. It satisfies ``PolicyLike``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from refit_core.sources import StateDictSource

__all__ = ["SimulatedTrainer", "StaticPolicy"]

logger = logging.getLogger(__name__)


class SimulatedTrainer:
    """Holds fp32 masters of a checkpoint and steps them with ``torch.optim.AdamW``.

    Args:
        checkpoint: initial weights under checkpoint names (any floating dtype).
        engine_dtype: the dtype the engine serves; the weight source casts to it.
        seed: seed of the random gradients.
        lr: AdamW learning rate; larger rates change more bf16 elements per step.
    """

    def __init__(
        self,
        checkpoint: Mapping[str, torch.Tensor],
        *,
        engine_dtype: str = "bfloat16",
        seed: int = 0,
        lr: float = 1e-4,
    ) -> None:
        self.masters = {
            name: torch.nn.Parameter(t.detach().to(torch.float32).clone())
            for name, t in checkpoint.items()
        }
        self.engine_dtype = engine_dtype
        self._generator = torch.Generator().manual_seed(seed)
        self._optimizer = torch.optim.AdamW(list(self.masters.values()), lr=lr, weight_decay=0.0)
        self.steps = 0

    def step(self, lr: float | None = None) -> None:
        """One optimizer step on random gradients (optionally at another learning rate)."""
        if lr is not None:
            for group in self._optimizer.param_groups:
                group["lr"] = lr
        for param in self.masters.values():
            param.grad = torch.randn(param.shape, generator=self._generator)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        logger.debug("trainer step %d", self.steps)

    def engine_state(self) -> dict[str, torch.Tensor]:
        """The weights as the engine must hold them (cast to ``engine_dtype``)."""
        return {
            name: t.detach().to(getattr(torch, self.engine_dtype))
            for name, t in self.masters.items()
        }

    def weight_source(self) -> StateDictSource:
        """The current weights as a bounded-memory source under checkpoint names."""
        return StateDictSource(
            {name: p.detach() for name, p in self.masters.items()}, dtype=self.engine_dtype
        )


class StaticPolicy:
    """A policy whose weights are a given dict of tensors (change them in place between
    refits); satisfies ``PolicyLike``."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = dict(state)

    def weight_source(self) -> StateDictSource:
        """The tensors as they are now."""
        return StateDictSource(self.state)
