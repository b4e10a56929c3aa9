"""The RL admin route handlers of a Dynamo vLLM worker, for the lab's workers.

Dynamo's own handlers are methods of ``dynamo.vllm.handlers.BaseWorkerHandler``, a module
that imports vLLM (and msgspec, redis, PIL, safetensors, transformers) at import time, so
they cannot run on a machine without vLLM. These handlers follow their route names, bodies,
validation and answers as read in ``ai-dynamo`` 1.6.1 (``dynamo/vllm/handlers.py``:
``pause_generation``, ``resume_generation``, ``flush_cache``,
``update_weights_from_distributed``, ``init_weights_update_group``, ``get_weight_version``;
the route table in
``dynamo/vllm/worker_factory.py``) and are registered through Dynamo's own
``dynamo.common.rl.register_rl_routes``. Engine-side failures become
``{"status": "error", "message": ...}`` answers, as there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

__all__ = ["EngineClient", "RLAdminHandlers"]

logger = logging.getLogger(__name__)

Body = dict[str, Any]

_RESERVED_KEYS = frozenset({"allow_unpaused", "engine_rpc", "reset_prefix_cache", "weight_version"})
"""Keys of ``update_weights_from_distributed`` that are not passed to the engine RPC."""


class EngineClient(Protocol):
    """The part of vLLM's ``AsyncLLM`` the RL routes call."""

    async def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None: ...

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None: ...

    async def resume_generation(self) -> None: ...

    async def reset_prefix_cache(self) -> None: ...


def _error(message: str) -> Body:
    return {"status": "error", "message": message}


class RLAdminHandlers:
    """One worker's RL admin routes over an engine client."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.paused = False
        self.weight_version: Any = None
        self.version_declared = False
        self._pause_lock = asyncio.Lock()

    def routes(self) -> dict[str, Any]:
        """Route name -> handler, as Dynamo's worker factory registers them."""
        return {
            "pause_generation": self.pause_generation,
            "resume_generation": self.resume_generation,
            "flush_cache": self.flush_cache,
            "init_weights_update_group": self.init_weights_update_group,
            "update_weights_from_distributed": self.update_weights_from_distributed,
            "get_weight_version": self.get_weight_version,
        }

    async def pause_generation(self, body: Body | None) -> Body:
        body = body or {}
        mode = body.get("mode", "keep")
        clear_cache = bool(body.get("clear_cache", False))
        if mode not in ("keep", "wait", "abort"):
            return _error(f"Invalid mode '{mode}'; expected keep|wait|abort")
        async with self._pause_lock:
            try:
                await self.engine.pause_generation(mode=mode, clear_cache=clear_cache)
            except Exception as exc:
                logger.error("[RL] Failed to pause: %s", exc)
                return _error(str(exc))
            self.paused = True
            return {
                "status": "ok",
                "message": "Engine paused",
                "mode": mode,
                "clear_cache": clear_cache,
            }

    async def resume_generation(self, body: Body | None) -> Body:
        async with self._pause_lock:
            try:
                await self.engine.resume_generation()
            except Exception as exc:
                logger.error("[RL] Failed to resume: %s", exc)
                return _error(str(exc))
            self.paused = False
            return {"status": "ok", "message": "Engine resumed"}

    async def flush_cache(self, body: Body | None) -> Body:
        async with self._pause_lock:
            try:
                await self.engine.reset_prefix_cache()
            except Exception as exc:
                return _error(str(exc))
            return {"status": "ok", "message": "Cache flushed"}

    async def init_weights_update_group(self, body: Body | None) -> Body:
        body = dict(body or {})
        rpc = body.pop("engine_rpc", "init_broadcaster")
        async with self._pause_lock:
            try:
                await self.engine.collective_rpc(rpc, kwargs=body)
            except Exception as exc:
                logger.error("[RL] init_weights_update_group failed: %s", exc)
                return _error(str(exc))
            return {"status": "ok", "message": "Weight update group initialized"}

    async def update_weights_from_distributed(self, body: Body | None) -> Body:
        body = body or {}
        allow_unpaused = body.get("allow_unpaused", False)
        reset_prefix_cache = body.get("reset_prefix_cache", True)
        if not isinstance(allow_unpaused, bool) or not isinstance(reset_prefix_cache, bool):
            return _error("'allow_unpaused' and 'reset_prefix_cache' must be booleans")
        if allow_unpaused and reset_prefix_cache:
            return _error("Unpaused weight updates cannot reset the prefix cache.")
        async with self._pause_lock:
            if not self.paused and not allow_unpaused:
                return _error(
                    "Worker must be paused via pause_generation() before updating weights."
                )
            rpc = body.get("engine_rpc", "update_weights_from_path")
            kwargs = {k: v for k, v in body.items() if k not in _RESERVED_KEYS}
            try:
                await self.engine.collective_rpc(rpc, kwargs=kwargs)
                if reset_prefix_cache:
                    await self.engine.reset_prefix_cache()
            except Exception as exc:
                logger.error("[RL] update_weights_from_distributed failed: %s", exc)
                return _error(str(exc))
            if "weight_version" in body:
                self.weight_version = body["weight_version"]
                self.version_declared = True
            return {
                "status": "ok",
                "version": body.get("weight_version", "unknown"),
                "version_declared": "weight_version" in body,
            }

    async def get_weight_version(self, body: Body | None) -> Body:
        return {
            "status": "ok",
            "version": self.weight_version,
            "version_declared": self.version_declared,
        }
