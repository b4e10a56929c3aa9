"""An SGLang engine whose receiving side is SGLang 0.5.23's own code.

What is SGLang's here, and what stands in:

- Every request body is parsed by SGLang's own request struct (``sglang.srt.managers.
  io_struct``) through pydantic, as its FastAPI routes parse them (``Annotated[<ReqInput>,
  Body()]``; ``serialized_named_tensors`` is decoded by its ``Base64Bytes`` marker).
- Each tensor-parallel rank is a process of its own, as SGLang's schedulers are (rank 0 is
  the server's own process), with a real ``WeightUpdater``:
  ``update_weights_from_tensor``: the payload list is normalized by SGLang's
  ``normalize_serialized_named_tensor_payloads`` (as ``TokenizerManager`` does), rank ``r``
  takes entry ``r`` as ``TpModelWorker.deserialize_own_rank`` does, and after SGLang's
  ``monkey_patch_torch_reductions()`` unpickles it with ``MultiprocessingSerializer.
  deserialize`` (its ``SafeUnpickler``); the ``WeightUpdater`` rebuilds the flattened bucket
  (``_update_weights_from_flattened_bucket``: ``FlattenedTensorMetadata``,
  ``FlattenedTensorBucket.reconstruct_tensors``).
  ``init_weights_update_group`` / ``update_weights_from_distributed`` /
  ``destroy_weights_update_group``: the ``WeightUpdater`` joins the group with SGLang's
  ``init_custom_process_group`` (over a one-rank default process group, as every SGLang rank
  has its own), receives with ``receive_weights_from_distributed`` and leaves with
  ``destroy_weights_update_group``.
- Stands in: the model the ``WeightUpdater`` loads into (its ``load_weights`` is refit-lab's
  reference engine: SGLang's model runner needs CUDA kernels); the tokenizer manager and the
  HTTP server process (:mod:`sglang_standin`'s ``serve``: pause, continue and flush mark state
  and reset the reference engines' prefix caches; requests fan out to every rank).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch

from refit_lab.reference_engine import ReferenceEngine, ReferenceModelConfig
from refit_sglang.protocol import TOKENIZER_CALLS, validate_request
from sglang_standin import serve

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
    """What a ``WeightUpdater`` loads into: the rank's reference engine."""

    def __init__(self, engine: ReferenceEngine) -> None:
        super().__init__()
        self.engine = engine

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(weights)


def _not_used(*_: object, **__: object) -> None:
    raise AssertionError("refit's routes do not reach this WeightUpdater hook")


class RankWorker:
    """One SGLang tensor-parallel rank: a reference engine behind SGLang's ``WeightUpdater``."""

    def __init__(self, config: dict[str, Any], seed: int, tp_rank: int) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():  # SGLang's init_weights_update_group requires one
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._args = (config, seed, tp_rank)
        self.reset()

    def reset(self) -> None:
        """Start over: leave every group still joined, fresh weights, no version."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            WeightUpdater,
        )

        if hasattr(self, "updater"):
            for name in list(self.updater._model_update_group):
                self.updater.destroy_weights_update_group(name)
        config, seed, tp_rank = self._args
        self.engine = ReferenceEngine(ReferenceModelConfig(**config), seed=seed)
        model = _Model(self.engine)
        self.updater = WeightUpdater(
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

    def load_payload(self, payload: bytes) -> tuple[bool, str]:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        data = MultiprocessingSerializer.deserialize(payload)
        result: tuple[bool, str] = self.updater._update_weights_from_flattened_bucket(data)
        return result

    def init_group(self, **fields: Any) -> tuple[bool, str]:
        result: tuple[bool, str] = self.updater.init_weights_update_group(**fields)
        return result

    def receive(self, **fields: Any) -> None:
        self.engine.load_weights(self.updater.receive_weights_from_distributed(**fields))

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        result: tuple[bool, str] = self.updater.destroy_weights_update_group(group_name)
        return result

    def commit(self, flush_cache: bool, weight_version: str | None) -> None:
        if flush_cache:
            self.engine.reset_prefix_cache()
        if weight_version is not None:
            self.engine.set_weight_version(int(weight_version))

    def state(self) -> dict[str, Any]:
        return {"digest": self.engine.state_digests(), "version": self.engine.weight_version}

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self.engine.generate(prompts, max_new_tokens).tokens


def _rank_main(conn: Connection, config: dict[str, Any], seed: int, tp_rank: int) -> None:
    """Process entry of one rank: serve ``(method, kwargs)`` requests until the pipe closes."""
    worker = RankWorker(config, seed, tp_rank)
    conn.send(("ok", None))
    while True:
        try:
            method, kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(worker, method)(**kwargs)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _RankProcess:
    """A rank in a process of its own, called one request at a time."""

    def __init__(self, config: dict[str, Any], seed: int, tp_rank: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=_rank_main, args=(theirs, config, seed, tp_rank), daemon=True
        )
        self._process.start()
        theirs.close()
        self._lock = threading.Lock()
        self._answer()  # the rank's ready line

    def _answer(self) -> Any:
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, method: str, **kwargs: Any) -> Any:
        with self._lock:
            self._conn.send((method, kwargs))
            return self._answer()


class _LocalRank:
    """Rank 0, in the engine's own process (as SGLang's first scheduler shares its host)."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        self._worker = RankWorker(config, seed, 0)

    def call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self._worker, method)(**kwargs)


class SGLangCodeEngine:
    """One SGLang server with ``tp_size`` rank processes (see the module docstring).

    Attributes:
        calls: ``(route, body)`` of every request served, payloads left out.
    """

    def __init__(self, config: dict[str, Any], seed: int, tp_size: int) -> None:
        self.tp_size = tp_size
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.paused = False
        self.ranks: list[_LocalRank | _RankProcess] = [_LocalRank(config, seed)]
        self.ranks += [_RankProcess(config, seed, r) for r in range(1, tp_size)]
        self._pool = ThreadPoolExecutor(tp_size)

    def handle(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Serve ``route``: ``{"success", "message"}`` (and a test's reads under ``_test/``)."""
        if route.startswith(_INSPECT):
            return {"success": True, "message": "", **self._inspect(route[len(_INSPECT) :], body)}
        try:
            validate_request(route, body)
            request = parse_request(route, body)
        except ValueError as exc:
            return {"success": False, "message": f"refused: {exc}"}
        self.calls.append(
            (route, {k: v for k, v in body.items() if k != "serialized_named_tensors"})
        )
        try:
            getattr(self, f"_{route}")(request)
        except Exception as exc:
            return {"success": False, "message": f"{type(exc).__name__}: {exc}"}
        return {"success": True, "message": "Succeeded"}

    def _on_ranks(self, call: Callable[[int, Any], Any]) -> list[Any]:
        """``call(rank, process)`` on every rank at once (SGLang's schedulers all serve each
        request); RuntimeError naming the first rank that failed."""
        futures = [self._pool.submit(call, r, p) for r, p in enumerate(self.ranks)]
        results = []
        for rank, future in enumerate(futures):
            result = future.result()
            if isinstance(result, tuple) and result and result[0] is False:
                raise RuntimeError(f"rank {rank}: {result[1]}")
            results.append(result)
        return results

    def _inspect(self, what: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A test's read: ``state``, ``generate`` (greedy tokens per rank), or ``reset``
        (start over as a new engine: every rank reset, no calls)."""
        if what == "reset":
            self._on_ranks(lambda _, p: p.call("reset"))
            self.calls, self.paused = [], False
            return {}
        if what == "generate":
            return {"tokens": self._on_ranks(lambda _, p: p.call("generate", **body))}
        states = self._on_ranks(lambda _, p: p.call("state"))
        return {
            "digests": [s["digest"] for s in states],
            "versions": [s["version"] for s in states],
            "paused": self.paused,
            "calls": self.calls,
        }

    def _commit(self, flush_cache: bool, weight_version: str | None) -> None:
        self._on_ranks(
            lambda _, p: p.call("commit", flush_cache=flush_cache, weight_version=weight_version)
        )

    # Each route takes SGLang's parsed request struct (its defaults filled in); None for
    # flush_cache.

    def _pause_generation(self, request: Any) -> None:
        self.paused = True

    def _continue_generation(self, request: Any) -> None:
        self.paused = False

    def _flush_cache(self, request: None) -> None:
        self._commit(True, None)

    def _update_weights_from_tensor(self, request: Any) -> None:
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        if request.load_format != "flattened_bucket":
            raise ValueError(f"refit sends flattened buckets, not {request.load_format!r}")
        payloads = normalize_serialized_named_tensor_payloads(request.serialized_named_tensors)
        self._on_ranks(lambda rank, p: p.call("load_payload", payload=payloads[rank]))
        self._commit(request.flush_cache, request.weight_version)

    def _init_weights_update_group(self, request: Any) -> None:
        fields = {
            name: getattr(request, name)
            for name in ("master_address", "master_port", "rank_offset", "world_size")
        }
        fields.update(group_name=request.group_name, backend=request.backend)
        self._on_ranks(lambda _, p: p.call("init_group", **fields))

    def _update_weights_from_distributed(self, request: Any) -> None:
        fields = {
            "names": request.names,
            "dtypes": request.dtypes,
            "shapes": request.shapes,
            "group_name": request.group_name,
            "load_format": request.load_format,
        }
        self._on_ranks(lambda _, p: p.call("receive", **fields))
        self._commit(request.flush_cache, request.weight_version)

    def _destroy_weights_update_group(self, request: Any) -> None:
        self._on_ranks(lambda _, p: p.call("destroy_group", group_name=request.group_name))


def serve_in_child(config: dict[str, Any], seed: int, tp_size: int, results: Any) -> None:
    """Process entry: serve an :class:`SGLangCodeEngine` over HTTP, put its URL on
    ``results``, live until killed."""
    engine = SGLangCodeEngine(config, seed, tp_size)
    with serve(engine) as url:  # type: ignore[arg-type]  # serve takes any handle()/tp_size
        results.put(url)
        threading.Event().wait()
