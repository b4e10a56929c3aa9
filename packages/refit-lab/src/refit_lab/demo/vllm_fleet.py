"""The demo's vLLM fleet: N real vLLM engines in this process, one per worker, on the
trainer's initial checkpoint, each with the receiver of the demo's transport.

No Ray here: every ``vllm.LLM`` already runs its model in an engine-core process of its own,
and the engine venv has no Ray. Bitwise digests are exposed where the receiver can read the
checkpoint back (the sparse receiver: from the runtime parameters it writes in place and from
its shadow of the repacked ones); the collective and IPC receivers load straight into vLLM's
repacked parameters, so for them only the served version and the tokens are checked. vLLM's bf16 kernels do not reproduce the trainer's float32 forward
(measured: 5 to 7 of 8 greedy continuations equal), so the token oracle is a fresh engine
started on the final weights (:meth:`VllmFleet.fresh_tokens`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from refit_lab.demo.vllm_checkpoint import write_llama_checkpoint
from refit_lab.reference_engine import ReferenceModelConfig

__all__ = ["VllmFleet"]

logger = logging.getLogger(__name__)

_KV_CACHE_GB = "1"
_RPC_TIMEOUT_S = 120.0


def _engine_args(transport: str) -> dict[str, Any]:
    if transport == "collective":
        from refit_nccl.vllm import engine_args as nccl_engine_args

        return nccl_engine_args()
    from refit_zmq.vllm import engine_args as zmq_engine_args

    return zmq_engine_args("ipc" if transport == "ipc" else "zmq_sparse")


class VllmFleet:
    """``workers`` vLLM engines on the checkpoint at ``path``, and the generation the
    synchronizer drives them through (``VllmCollectiveGeneration``, ``VllmRelayGeneration``
    or ``VllmIpcGeneration``).

    Args:
        config: the model (``max_seq_len`` bounds vLLM's ``max_model_len``).
        folder: where checkpoints are written.
        initial: the weights the engines start on (HF Llama names).
        workers: engines to start.
        transport: the demo's transport.
        timeout_s: the relays' silence bound (``zmq_sparse``).
    """

    def __init__(
        self,
        config: ReferenceModelConfig,
        folder: Path,
        initial: Mapping[str, torch.Tensor],
        workers: int,
        transport: str,
        timeout_s: float,
    ) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _KV_CACHE_GB)
        self.transport = transport
        self.exposes_bits = transport == "zmq_sparse"
        self.engines: list[Any] = []
        self._config = config
        self._folder = folder
        self._closers: list[Any] = []
        path = write_llama_checkpoint(config, initial, folder / "initial")
        try:
            for index in range(workers):
                logger.info("starting vLLM engine %d of %d", index + 1, workers)
                self.engines.append(start_engine(config, path, _engine_args(transport)))
            self.generation = self._generation(timeout_s)
        except BaseException:
            self.close()
            raise

    def _generation(self, timeout_s: float) -> Any:
        if self.transport == "collective":
            from refit_nccl.vllm import VllmCollectiveGeneration

            return VllmCollectiveGeneration(self.engines)
        from refit_zmq.vllm import VllmIpcGeneration, VllmRelayGeneration

        if self.transport == "ipc":
            generation = VllmIpcGeneration(self.engines)
            self._closers.append(generation.close)
            return generation
        return VllmRelayGeneration(self.engines, relay_timeout_s=timeout_s)

    @property
    def live(self) -> list[int]:
        """Every engine's index (the demo injects no faults into vLLM engines)."""
        return list(range(len(self.engines)))

    def call(self, method: str, *args: Any) -> dict[int, Any]:
        """``method(*args)`` (``served_version``, ``generate``, ``state_digests``) on every
        engine; index -> result."""
        return {
            index: getattr(self, f"_{method}")(llm, *args) for index, llm in enumerate(self.engines)
        }

    def _served_version(self, llm: Any) -> int | None:
        """The version vLLM reports; ``None`` before the first refit (vLLM says "default")."""
        version = str(llm.llm_engine.get_weight_version())
        return int(version) if version.isdigit() else None

    def _state_digests(self, llm: Any) -> dict[str, int]:
        from refit_zmq.vllm.calls import CheckpointDigests
        from refit_zmq.vllm.engines import call_workers

        (digests,) = call_workers(llm, "demo engine", CheckpointDigests(), _RPC_TIMEOUT_S)
        return dict(digests)

    def _generate(
        self, llm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int
    ) -> list[list[int]]:
        return generate(llm, prompts, max_new_tokens)

    def fresh_tokens(
        self,
        state: Mapping[str, torch.Tensor],
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
    ) -> list[list[int]]:
        """Greedy continuations from a fresh vLLM engine started on ``state`` (then shut down)."""
        path = write_llama_checkpoint(self._config, state, self._folder / "fresh")
        llm = start_engine(self._config, path, {})
        try:
            return generate(llm, prompts, max_new_tokens)
        finally:
            llm.llm_engine.engine_core.shutdown()

    def close(self) -> None:
        """Stop the generation's threads and shut every engine down."""
        for closer in self._closers:
            closer()
        for llm in self.engines:
            llm.llm_engine.engine_core.shutdown()
        self.engines = []


def start_engine(config: ReferenceModelConfig, path: Path, extra: dict[str, Any]) -> Any:
    """A vLLM engine on the checkpoint at ``path`` (CPU-friendly: eager, bf16, no tokenizer)."""
    from vllm import LLM

    return LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype=config.dtype,
        enforce_eager=True,
        max_model_len=config.max_seq_len,
        seed=0,
        **extra,
    )


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (EOS ignored, as the trainer's greedy knows none)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False
    )
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    results = llm.generate(requests, params, use_tqdm=False)
    return [list(result.outputs[0].token_ids) for result in results]
