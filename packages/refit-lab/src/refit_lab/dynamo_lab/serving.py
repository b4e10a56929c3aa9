"""What every lab Dynamo worker process does once its routes are registered: announce its
system server and serve until stdin closes."""

from __future__ import annotations

import asyncio
import json
import sys

from dynamo.runtime import DistributedRuntime

__all__ = ["serve_until_stdin_closes"]


async def serve_until_stdin_closes(runtime: DistributedRuntime) -> None:
    """Print ``{"system_url": ...}`` on one line, serve until stdin closes, shut down."""
    # In the runtime, absent from its stub (dynamo/_core.pyi).
    url = runtime.system_status_server_url()  # type: ignore[attr-defined]
    sys.stdout.write(json.dumps({"system_url": url}) + "\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    runtime.shutdown()
