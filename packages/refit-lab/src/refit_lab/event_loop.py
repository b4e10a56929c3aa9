"""An application's asyncio event loop on a thread of its own, as a server runs one for its
``AsyncLLM`` while refit drives the engine from other threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["EventLoopThread"]

_T = TypeVar("_T")


class EventLoopThread:
    """An event loop running forever on a daemon thread until :meth:`close`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, call: Coroutine[Any, Any, _T], timeout_s: float = 300.0) -> _T:
        """Run ``call`` on the loop and wait for its result (at most ``timeout_s``)."""
        return asyncio.run_coroutine_threadsafe(call, self.loop).result(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop and wait for its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout_s)
