"""A Dynamo worker process for tests: Dynamo's real runtime and system server, serving the RL
admin routes over a reference engine.

Run as ``python dynamo_worker.py SEED`` with ``DYN_SYSTEM_PORT=0``; it prints one
JSON line ``{"system_url": ...}`` once its routes are served and exits when stdin closes.
Besides the RL routes it serves test-only routes under ``/engine/_test/``: ``state``,
``faults`` (replace the injected faults) and ``configure`` (start over with N engine ranks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import torch
from dynamo.common.rl import RLRouteRegistry, register_rl_routes
from dynamo.runtime import DistributedRuntime

from dynamo_engine_client import Fault, ReferenceEngineClient
from dynamo_rl_handlers import RLAdminHandlers
from refit_lab.reference_engine import ReferenceModelConfig

MODEL = ReferenceModelConfig()
"""The model every test worker and trainer uses."""


async def serve(seed: int) -> None:
    """Serve until stdin closes."""
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    engine = ReferenceEngineClient(MODEL, seed)
    handlers = RLAdminHandlers(engine)
    register_rl_routes(runtime, RLRouteRegistry(runtime), handlers.routes(), enable_dispatch=True)

    async def state(body: dict[str, Any]) -> dict[str, Any]:
        return {"status": "ok", **engine.state()}

    async def faults(body: dict[str, Any]) -> dict[str, Any]:
        engine.faults = {name: Fault(**spec) for name, spec in body.get("faults", {}).items()}
        engine.calls.clear()
        return {"status": "ok"}

    async def configure(body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.to_thread(engine.configure, int(body["engine_world_size"]))
        return {"status": "ok"}

    runtime.register_engine_route("_test/state", state)
    runtime.register_engine_route("_test/faults", faults)
    runtime.register_engine_route("_test/configure", configure)
    sys.stdout.write(json.dumps({"system_url": runtime.system_status_server_url()}) + "\n")
    sys.stdout.flush()
    await loop.run_in_executor(None, sys.stdin.read)
    runtime.shutdown()


def main() -> None:
    """Entry point: ``SEED``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    asyncio.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
