"""An SGLang engine whose receiving side is SGLang 0.5.23's own code.

What is SGLang's here, and what stands in:

- Every request body is parsed by SGLang's own request struct (``sglang.srt.managers.
  io_struct``) through pydantic, as its FastAPI routes parse them (``Annotated[<ReqInput>,
  Body()]``; ``serialized_named_tensors`` is decoded by its ``Base64Bytes`` marker).
- ``update_weights_from_tensor``: the payload list is normalized by SGLang's
  ``normalize_serialized_named_tensor_payloads`` (as ``TokenizerManager`` does), tensor-parallel
  rank ``r`` takes entry ``r`` as ``TpModelWorker.deserialize_own_rank`` does, after SGLang's
  ``monkey_patch_torch_reductions()``, through ``MultiprocessingSerializer.deserialize`` (its
  ``SafeUnpickler``), and each rank's real ``WeightUpdater`` rebuilds the flattened bucket
  (``_update_weights_from_flattened_bucket``: ``FlattenedTensorMetadata``,
  ``FlattenedTensorBucket.reconstruct_tensors``).
- ``init_weights_update_group`` / ``update_weights_from_distributed`` /
  ``destroy_weights_update_group``: each rank's real ``WeightUpdater`` joins the group with
  SGLang's ``init_custom_process_group`` (over a default process group of its own, as every
  SGLang rank has one), receives with ``receive_weights_from_distributed`` and leaves with
  ``destroy_weights_update_group``.
- Stands in: the model the ``WeightUpdater`` loads into (its ``load_weights`` is refit-lab's
  reference engine: SGLang's model runner needs CUDA kernels), the scheduler and tokenizer
  manager processes (ranks are threads of this process; pause, continue and flush mark state
  and reset the reference engine's prefix cache), and the HTTP server process
  (:mod:`sglang_standin`'s ``serve``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from refit_lab.reference_engine import ReferenceEngine
from refit_sglang.protocol import TOKENIZER_CALLS
from sglang_standin import StandInSGLang, serve

_INSPECT = "_test/"
"""Routes a test reads the engine process through (never called by refit)."""


def parse_request(route: str, body: Mapping[str, Any]) -> Any:
    """``body`` as SGLang's HTTP route parses it (ValueError when SGLang refuses it);
    None for ``flush_cache``, whose route reads no body."""
    import pydantic
    from sglang.srt.managers import io_struct

    name = TOKENIZER_CALLS[route].request_type
    if name is None:
        return None
    return pydantic.TypeAdapter(getattr(io_struct, name)).validate_python(dict(body))


class _Model(torch.nn.Module):
    """What a ``WeightUpdater`` loads into: the reference engine of one rank."""

    def __init__(self, engine: ReferenceEngine) -> None:
        super().__init__()
        self.engine = engine

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(weights)


def _not_used(*_: object, **__: object) -> None:
    raise AssertionError("refit's routes do not reach this WeightUpdater hook")


def _updater(tp_rank: int, engine: ReferenceEngine) -> Any:
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater,
    )

    model = _Model(engine)
    return WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=_not_used,
        recapture_cuda_graph=_not_used,
        get_model_runner=_not_used,
    )


def _default_group() -> None:
    """A one-rank default process group, which SGLang's ``init_weights_update_group``
    requires (every SGLang rank has its TP world)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@dataclass
class SGLangCodeEngine(StandInSGLang):
    """A :class:`StandInSGLang` whose routes run SGLang's own code (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.updaters = [_updater(rank, engine) for rank, engine in enumerate(self.ranks)]

    def handle(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if route.startswith(_INSPECT):
            return {"success": True, "message": "", **self._inspect(route.removeprefix(_INSPECT), body)}
        try:
            parse_request(route, body)
        except ValueError as exc:
            return {"success": False, "message": f"SGLang refuses the body: {exc}"}
        return super().handle(route, body)

    def _inspect(self, what: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """What a test reads from the engine process: state, or greedy tokens per rank."""
        if what == "generate":
            return {
                "tokens": [
                    rank.generate(body["prompts"], body["max_new_tokens"]).tokens
                    for rank in self.ranks
                ]
            }
        return {
            "digests": [rank.state_digests() for rank in self.ranks],
            "versions": [rank.weight_version for rank in self.ranks],
            "paused": self.paused,
            "calls": self.calls,
        }

    def _on_ranks(self, work: Callable[[int, Any], tuple[bool, str] | None]) -> None:
        """``work(rank, updater)`` on every rank at once (SGLang's ranks are processes that
        all serve each request); the first failure is raised."""
        results: list[tuple[bool, str] | BaseException | None] = [None] * len(self.updaters)

        def run(rank: int) -> None:
            try:
                results[rank] = work(rank, self.updaters[rank])
            except BaseException as exc:
                results[rank] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.updaters))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise RuntimeError(f"rank {rank}: {type(result).__name__}: {result}") from result
            if result is not None and not result[0]:
                raise RuntimeError(f"rank {rank}: {result[1]}")

    def _update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str | bytes],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        **_: object,
    ) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        if load_format != "flattened_bucket":
            raise ValueError(f"refit sends load_format='flattened_bucket', not {load_format!r}")
        payloads = normalize_serialized_named_tensor_payloads(serialized_named_tensors)

        def load(rank: int, updater: Any) -> tuple[bool, str]:
            monkey_patch_torch_reductions()
            data = MultiprocessingSerializer.deserialize(payloads[rank])
            result: tuple[bool, str] = updater._update_weights_from_flattened_bucket(data)
            return result

        self._on_ranks(load)
        self._commit(flush_cache, weight_version)

    def _init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        _default_group()
        self._on_ranks(
            lambda _, updater: updater.init_weights_update_group(
                master_address, master_port, rank_offset, world_size, group_name, backend
            )
        )
        self.groups[group_name] = []

    def _update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
        load_format: str | None = None,
        **_: object,
    ) -> None:
        def receive(rank: int, updater: Any) -> None:
            weights = updater.receive_weights_from_distributed(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                group_name=group_name,
                load_format=load_format,
            )
            self.ranks[rank].load_weights(weights)

        self._on_ranks(receive)
        self._commit(flush_cache, weight_version)

    def _destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._on_ranks(lambda _, updater: updater.destroy_weights_update_group(group_name))
        self.groups.pop(group_name, None)


def serve_in_child(config: dict[str, Any], seed: int, tp_size: int, results: Any) -> None:
    """Process entry: serve an :class:`SGLangCodeEngine` over HTTP, put its URL on
    ``results``, live until killed."""
    from refit_lab.reference_engine import ReferenceModelConfig

    engine = SGLangCodeEngine(ReferenceModelConfig(**config), seed, tp_size)
    with serve(engine) as url:
        results.put(url)
        threading.Event().wait()
