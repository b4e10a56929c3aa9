"""A Dynamo worker process with nothing behind its system server (starts in about a second):
the worker-down test kills it. Prints ``{"system_url": ...}`` and exits when stdin closes."""

from __future__ import annotations

import asyncio

from dynamo.runtime import DistributedRuntime

from refit_lab.dynamo_lab.serving import serve_until_stdin_closes

__all__ = ["serve"]


async def serve() -> None:
    """Serve the system server until stdin closes."""
    await serve_until_stdin_closes(DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp"))


if __name__ == "__main__":
    asyncio.run(serve())
