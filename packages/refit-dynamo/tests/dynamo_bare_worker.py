"""A Dynamo worker process with nothing behind its system server (starts in about a second):
the worker-down test kills it. Prints ``{"system_url": ...}`` and exits when stdin closes."""

from __future__ import annotations

import asyncio
import json
import sys

from dynamo.runtime import DistributedRuntime


async def serve() -> None:
    """Serve the system server until stdin closes."""
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp")
    sys.stdout.write(json.dumps({"system_url": runtime.system_status_server_url()}) + "\n")
    sys.stdout.flush()
    await loop.run_in_executor(None, sys.stdin.read)
    runtime.shutdown()


if __name__ == "__main__":
    asyncio.run(serve())
