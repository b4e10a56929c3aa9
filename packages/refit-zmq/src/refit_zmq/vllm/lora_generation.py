"""The controller's side of LoRA refits into vLLM engines: which version of each adapter new
requests get, and when an old version may go.

:class:`VllmLoraGeneration` holds the engines (every worker of each keeps its adapters in
host memory, :mod:`refit_zmq.vllm.lora_worker`) and the ``LoRARequest`` of the version each
adapter serves. A refit of an adapter loads the new version beside the old ones on every
worker of every engine (under a LoRA id of its own); only once all of them hold it does
:meth:`VllmLoraGeneration.lora_request` hand it out. A request keeps the ``LoRARequest`` it
was submitted with, so it finishes on the version it started with. Versions go only when no
request can still name them: never the one served or the one served before it, never one a
request in flight uses (asked of the engine's front end), so a ``LoRARequest`` taken from
:meth:`~VllmLoraGeneration.lora_request` stays valid across the next refit of its adapter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from refit_core import EngineReport, EngineState, RefitError, WorkerError
from refit_core.backend import with_engines
from refit_core.vllm import VllmClient, vllm_client
from refit_zmq.lora.load import AdapterLoad, adapter_path, served_name
from refit_zmq.vllm.calls import LoraDrop, LoraLoad, LoraServe, LoraStatus, ZmqCall
from refit_zmq.vllm.engines import call_workers

__all__ = ["AdapterOnEngine", "VllmLoraGeneration"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

FIRST_LORA_ID = 1 << 20
"""LoRA ids refit gives out start here, above the small ids applications pick by hand."""


@dataclass(frozen=True)
class AdapterOnEngine:
    """One adapter on one engine, as its workers report it.

    Attributes:
        shard: the engine's index.
        label: how errors name it.
        serving: the version new requests get there (None: none, or its workers disagree).
        held: the versions every worker holds.
        began: the highest version a refit began on any worker (None: none).
        lora_id: the served version's LoRA id.
        max_lora_id: the highest LoRA id any worker holds (any adapter).
        error: why it could not be asked (then nothing else is known).
    """

    shard: int
    label: str
    serving: int | None = None
    held: frozenset[int] = frozenset()
    began: int | None = None
    lora_id: int | None = None
    max_lora_id: int = 0
    error: str | None = None


class VllmLoraGeneration:
    """vLLM engines serving LoRA adapters that refit moves from memory (the ``lora`` row).

    Start each engine with ``enable_lora=True`` (``max_lora_rank`` at least every adapter's
    rank; ``max_cpu_loras`` bounds vLLM's cache only: refit's store keeps what it holds) and
    ``refit_zmq.vllm.engine_args("lora")``. One generation serves every adapter of its
    engines; each adapter has a synchronizer of its own (``LoraOptions.adapter``).

    Args:
        engines: ``vllm.LLM`` objects, or ``AsyncLLM`` as :class:`~refit_core.vllm.AsyncVllm`.
        shared_memory: hand each refit's payloads to the workers in a memfd they map (one
            copy), or inline in the RPC (vLLM copies them on every hop): False where an
            engine's workers run on other hosts than this process (vLLM's Ray executor).
        control_timeout_s: bound of every call that carries no deadline of its own.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        shared_memory: bool = True,
        control_timeout_s: float = 120.0,
    ) -> None:
        if not engines:
            raise ValueError("VllmLoraGeneration needs at least one engine")
        self._clients: list[VllmClient] = [vllm_client(engine) for engine in engines]
        self._labels = [f"vllm engine {shard}" for shard in range(len(engines))]
        self._timeout_s = control_timeout_s
        self._shared_memory = shared_memory
        self._lock = threading.Lock()
        self._requests: dict[str, Any] = {}
        self._next_id = FIRST_LORA_ID
        self._executor = ThreadPoolExecutor(len(engines), thread_name_prefix="refit-lora")

    # -- what applications call ---------------------------------------------------------

    def lora_request(self, adapter: str) -> Any:
        """The ``vllm.lora.request.LoRARequest`` of the version of ``adapter`` new requests
        get: pass it with every request for the adapter.

        Raises:
            KeyError: no version of ``adapter`` was refitted (or adopted) yet.
        """
        with self._lock:
            return self._requests[adapter]

    def adapters(self) -> dict[str, int]:
        """Adapter -> the version it serves."""
        with self._lock:
            return {name: _version_of(r.lora_name) for name, r in self._requests.items()}

    # -- what the lora row's synchronizer calls -----------------------------------------

    def lora_engines(self) -> list[str]:
        """The engines' labels, in shard order."""
        return list(self._labels)

    def adapter_status(self, adapter: str, timeout_s: float | None) -> list[AdapterOnEngine]:
        """``adapter`` on every engine, as its workers say (an engine that cannot be asked has
        ``error`` set)."""
        return self._each(lambda shard: self._status(shard, adapter, timeout_s))

    def _status(self, shard: int, adapter: str, timeout_s: float | None) -> AdapterOnEngine:
        label = self._labels[shard]
        try:
            replies = self._call(shard, LoraStatus(adapter), timeout_s)
        except Exception as exc:
            return AdapterOnEngine(shard, label, error=f"{type(exc).__name__}: {exc}")
        serving = {r["serving"] for r in replies}
        ids = {r["lora_id"] for r in replies}
        held = frozenset.intersection(*(frozenset(r["held"]) for r in replies))
        began = [int(r["began"]) for r in replies if r["began"] is not None]
        return AdapterOnEngine(
            shard,
            label,
            serving=serving.pop() if len(serving) == 1 else None,
            held=held,
            began=max(began, default=None),
            lora_id=ids.pop() if len(ids) == 1 else None,
            max_lora_id=max(int(r["max_lora_id"]) for r in replies),
        )

    def adopt(self, adapter: str, engines: Sequence[AdapterOnEngine]) -> None:
        """Start from what the engines say (a restarted controller): LoRA ids above every one
        they hold, and the version they all serve as the one new requests get."""
        with self._lock:
            self._next_id = max(self._next_id, 1 + max((e.max_lora_id for e in engines), default=0))
            served = {(e.serving, e.lora_id) for e in engines}
            if adapter in self._requests or len(served) != 1:
                return
            ((version, lora_id),) = served
            if version is not None and lora_id is not None:
                self._requests[adapter] = _lora_request(adapter, version, lora_id)
                logger.info(
                    "adapter %s: adopted version %d (LoRA id %d)", adapter, version, lora_id
                )

    def new_lora_id(self) -> int:
        """A LoRA id no version on these engines has."""
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
            return lora_id

    def load_adapter(self, load: AdapterLoad, timeout_s: float | None) -> dict[str, float]:
        """Hold ``load``'s version on every worker of every engine, beside what they serve;
        the slowest worker's seconds per step (``engine_apply``, ``engine_register``).

        Raises:
            RefitError: an engine failed; the version was dropped everywhere, every engine
                serves the adapter's previous version (``engines`` says so).
        """
        from refit_zmq.lora.carrier import carried

        with carried(load.payloads, shared_memory=self._shared_memory) as payloads:
            message = load.to_message(payloads)
            outcomes = self._each(lambda shard: self._try(shard, LoraLoad(message), timeout_s))
        failures = {self._labels[s]: error for s, (_, error) in enumerate(outcomes) if error}
        if not failures:
            steps = [step for replies, _ in outcomes for step in replies or ()]
            return {f"engine_{k}": max(float(s[k]) for s in steps) for k in ("apply", "register")}
        self._each(lambda shard: self._try(shard, LoraDrop(load.adapter, load.version), timeout_s))
        served = self._served_version(load.adapter)
        reports = [
            EngineReport(shard, label, EngineState.OLD, served, failures.get(label))
            for shard, label in enumerate(self._labels)
        ]
        raise with_engines(
            RefitError(
                f"adapter {load.adapter!r} version {load.version}: engines failed: {failures}"
            ),
            reports,
        )

    def serve_adapter(self, load: AdapterLoad, timeout_s: float | None) -> dict[str, str]:
        """New requests get ``load``'s version from now on (every engine holds it); then each
        worker records it and lets go of versions nothing can name any more.

        Returns:
            Engine label -> why it did not confirm (it holds the version, and requests for it
            work; only its bookkeeping lags until the next refit of the adapter).
        """
        with self._lock:
            previous = self._requests.get(load.adapter)
            self._requests[load.adapter] = _lora_request(load.adapter, load.version, load.lora_id)
        before = [] if previous is None else [_version_of(previous.lora_name)]

        def serve(shard: int) -> tuple[list[Any] | None, str | None]:
            in_flight = self._in_flight(shard, load.adapter)
            keep = None if in_flight is None else before + in_flight
            return self._try(shard, LoraServe(load.adapter, load.version, keep), timeout_s)

        outcomes = self._each(serve)
        logger.info(
            "adapter %s: version %d served (LoRA id %d)", load.adapter, load.version, load.lora_id
        )
        return {self._labels[s]: error for s, (_, error) in enumerate(outcomes) if error}

    def close(self) -> None:
        """Stop the call threads (the engines belong to whoever started them)."""
        self._executor.shutdown(wait=False)

    # -- helpers ------------------------------------------------------------------------

    def _served_version(self, adapter: str) -> int | None:
        with self._lock:
            served = self._requests.get(adapter)
        return None if served is None else _version_of(served.lora_name)

    def _in_flight(self, shard: int, adapter: str) -> list[int] | None:
        """Versions of ``adapter`` that requests unfinished on the engine's front end use
        (None: its front end cannot be asked)."""
        client: Any = self._clients[shard]
        front = getattr(getattr(client, "llm", None), "llm_engine", None) or getattr(
            client, "engine", None
        )
        states = getattr(getattr(front, "output_processor", None), "request_states", None)
        if states is None:
            logger.warning(
                "%s: cannot see its requests; keeping every version", self._labels[shard]
            )
            return None
        prefix = f"{adapter}@v"
        names = {getattr(state, "lora_name", None) for state in list(states.values())}
        return sorted(_version_of(n) for n in names if isinstance(n, str) and n.startswith(prefix))

    def _call(self, shard: int, call: ZmqCall[_R], timeout_s: float | None) -> list[_R]:
        bound = self._timeout_s if timeout_s is None else timeout_s
        return call_workers(self._clients[shard], self._labels[shard], call, bound)

    def _try(
        self, shard: int, call: ZmqCall[_R], timeout_s: float | None
    ) -> tuple[list[_R] | None, str | None]:
        """The workers' replies, or why the call failed."""
        try:
            return self._call(shard, call, timeout_s), None
        except WorkerError as exc:
            return None, str(exc)
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _each(self, call: Callable[[int], _T]) -> list[_T]:
        futures = [self._executor.submit(call, shard) for shard in range(len(self._clients))]
        return [future.result() for future in futures]


def _lora_request(adapter: str, version: int, lora_id: int) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(served_name(adapter, version), lora_id, adapter_path(adapter, version))


def _version_of(lora_name: str) -> int:
    return int(lora_name.rpartition("@v")[2])
