"""A Dynamo worker process: Dynamo's real runtime and system server, serving the RL admin
routes over a reference engine.

Run as ``python -m refit_lab.dynamo_lab.worker SEED CONFIG_JSON`` (``CONFIG_JSON``: the fields
of a ``ReferenceModelConfig``) with ``DYN_SYSTEM_PORT=0``; it prints one JSON line
``{"system_url": ...}`` once its routes are served and exits when stdin closes. Besides the RL
routes it serves lab-only routes under ``/engine/_test/``: ``state``, ``faults`` (replace the
injected faults), ``configure`` (start over with N engine ranks), ``digests`` (every rank's
per-tensor digests) and ``generate`` (every rank's greedy tokens).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from dynamo.common.rl import RLRouteRegistry, register_rl_routes
from dynamo.runtime import DistributedRuntime

from refit_lab.dynamo_lab.engine_client import Fault, ReferenceEngineClient
from refit_lab.dynamo_lab.rl_handlers import RLAdminHandlers
from refit_lab.dynamo_lab.serving import serve_until_stdin_closes
from refit_lab.reference_engine import ReferenceModelConfig

__all__ = ["lab_routes", "main", "serve"]

Route = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def lab_routes(engine: ReferenceEngineClient) -> dict[str, Route]:
    """The lab-only routes (under ``_test/``) over ``engine``."""

    async def state(body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", **engine.state()}

    async def faults(body: dict[str, Any]) -> dict[str, Any]:
        engine.faults = {name: Fault(**spec) for name, spec in body.get("faults", {}).items()}
        engine.calls.clear()
        return {"status": "ok"}

    async def configure(body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.to_thread(engine.configure, int(body["engine_world_size"]))
        return {"status": "ok"}

    async def digests(body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", "ranks": await asyncio.to_thread(engine.digests)}

    async def generate(body: dict[str, Any]) -> dict[str, Any]:
        prompts, new_tokens = body["prompts"], int(body["max_new_tokens"])
        ranks = await asyncio.to_thread(engine.generate, prompts, new_tokens)
        return {"status": "ok", "ranks": ranks}

    return {
        f"_test/{route.__name__}": route for route in (state, faults, configure, digests, generate)
    }


async def serve(seed: int, config: ReferenceModelConfig) -> None:
    """Serve until stdin closes."""
    runtime = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp")
    engine = ReferenceEngineClient(config, seed)
    handlers = RLAdminHandlers(engine)
    register_rl_routes(runtime, RLRouteRegistry(runtime), handlers.routes(), enable_dispatch=True)
    for name, route in lab_routes(engine).items():
        runtime.register_engine_route(name, route)
    await serve_until_stdin_closes(runtime)


def main() -> None:
    """Entry point: ``SEED CONFIG_JSON``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    asyncio.run(serve(int(sys.argv[1]), ReferenceModelConfig(**json.loads(sys.argv[2]))))


if __name__ == "__main__":
    main()
