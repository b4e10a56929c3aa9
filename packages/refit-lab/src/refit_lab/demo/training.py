"""The demo's trainer: a small GPT-like model trained with real AdamW on synthetic tokens.

Masters are fp32; every forward runs on their bf16 cast (the engine's dtype), so each
optimizer step moves only the few bf16 elements whose fp32 master crossed a rounding step:
the sparse deltas a real RL step produces. The model is :class:`ReferenceModel`, run through
``torch.func.functional_call`` on the fused cast of the masters, so the trainer's own forward
is the very computation the reference engines run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from refit_core.sources import StateDictSource
from refit_lab.reference_engine import (
    KVCache,
    ReferenceModel,
    ReferenceModelConfig,
    fuse_checkpoint,
    random_checkpoint,
)

__all__ = ["DemoTrainer", "SyntheticTask", "TrainingConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingConfig:
    """How the demo trains: AdamW learning rate, batch shape and seeds."""

    lr: float = 2e-6
    batch_size: int = 8
    seq_len: int = 32
    checkpoint_seed: int = 0
    data_seed: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(
                f"need batch_size >= 1 and seq_len >= 2, got {self.batch_size}, {self.seq_len}"
            )


class SyntheticTask:
    """Token sequences that mostly follow a fixed random permutation (90 %), else random.

    A model can learn it, so the loss falls and the gradients are real, not noise.
    """

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._vocab = vocab_size
        self._next = torch.randperm(vocab_size, generator=self._generator)

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        """``[batch_size, seq_len]`` token ids."""
        tokens = torch.empty(batch_size, seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(self._vocab, (batch_size,), generator=self._generator)
        for position in range(1, seq_len):
            follow = self._next[tokens[:, position - 1]]
            noise = torch.randint(self._vocab, (batch_size,), generator=self._generator)
            keep = torch.rand(batch_size, generator=self._generator) < 0.9
            tokens[:, position] = torch.where(keep, follow, noise)
        return tokens


class DemoTrainer:
    """fp32 masters under checkpoint names, AdamW, bf16 forward. Satisfies ``PolicyLike``."""

    def __init__(self, model: ReferenceModelConfig, training: TrainingConfig) -> None:
        self.model_config = model
        self.training = training
        self.masters = {
            name: nn.Parameter(tensor.float())
            for name, tensor in random_checkpoint(model, training.checkpoint_seed).items()
        }
        self._model = ReferenceModel(model)
        self._optimizer = torch.optim.AdamW(list(self.masters.values()), lr=training.lr)
        self._task = SyntheticTask(model.vocab_size, training.data_seed)
        self.steps = 0

    @property
    def num_elements(self) -> int:
        """Elements of the whole model."""
        return sum(p.numel() for p in self.masters.values())

    def train_step(self) -> float:
        """One AdamW step of next-token prediction on a fresh batch; the batch's loss."""
        cfg = self.training
        tokens = self._task.batch(cfg.batch_size, cfg.seq_len)
        weights = {name: p.to(self.model_config.torch_dtype) for name, p in self.masters.items()}
        logits, _ = functional_call(
            self._model, fuse_checkpoint(self.model_config, weights), (tokens[:, :-1],)
        )
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        logger.debug("step %d: loss %.4f", self.steps, loss.item())
        return float(loss.item())

    def engine_state(self) -> dict[str, torch.Tensor]:
        """The weights exactly as an engine must hold them (the bf16 cast of the masters)."""
        dtype = self.model_config.torch_dtype
        return {name: p.detach().to(dtype) for name, p in self.masters.items()}

    def weight_source(self) -> StateDictSource:
        """The current weights as a source under checkpoint names, cast once to bf16."""
        return StateDictSource(
            {name: p.detach() for name, p in self.masters.items()}, dtype=self.model_config.dtype
        )

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """``count`` prompts of ``length`` tokens drawn from the task (deterministic)."""
        task = SyntheticTask(self.model_config.vocab_size, self.training.data_seed + 1)
        return [[int(t) for t in row] for row in task.batch(count, length)]

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations from the trainer's own forward pass on its current weights.

        Prompts are fed one token at a time with a KV cache, as the engines decode.
        """
        params = fuse_checkpoint(self.model_config, self.engine_state())
        with torch.no_grad():
            return [self._greedy_one(params, list(p), max_new_tokens) for p in prompts]

    def _greedy_one(
        self, params: Mapping[str, torch.Tensor], prompt: list[int], max_new_tokens: int
    ) -> list[int]:
        def forward(token: int, past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
            ids = torch.tensor([[token]], dtype=torch.long)
            out, present = functional_call(self._model, dict(params), (ids, past))
            return out[0, -1], present

        logits, past = forward(prompt[0], None)
        for token in prompt[1:]:
            logits, past = forward(token, past)
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            generated.append(int(torch.argmax(logits)))
            if len(generated) < max_new_tokens:
                logits, past = forward(generated[-1], past)
        return generated
