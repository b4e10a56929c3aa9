"""One blocking interface over vLLM's two engine front ends, for refit's controller threads.

refit drives an engine from threads of its own: RPCs into its workers, a pause at the next
step boundary with every request kept, dropping the prefix cache (running requests recompute
their prefix), labelling the weights, resuming. An offline ``vllm.LLM`` offers these as
blocking calls (the pause is ``sleep(level=0, mode="keep")``); ``AsyncLLM`` offers them as
coroutines on the application's event loop (``pause_generation(mode="keep")``), which
:class:`AsyncVllm` runs there and waits for, each within a bound. Neither is imported here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["AsyncVllm", "OfflineVllm", "VllmClient", "serialize_sends", "vllm_client"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@runtime_checkable
class VllmClient(Protocol):
    """What refit calls on one vLLM engine; every call blocks until the engine answered."""

    def collective_rpc(self, method: str, timeout_s: float | None, args: tuple[Any, ...]) -> Any:
        """``method(*args)`` on every worker; their results in rank order."""
        ...

    def pause(self) -> None:
        """Stop scheduling at the next step boundary; requests in flight and new ones wait."""
        ...

    def resume(self) -> None:
        """Schedule again."""
        ...

    def drop_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests recompute theirs."""
        ...

    def set_weight_version(self, version: str) -> None:
        """Label the weights (vLLM tags every later output token span with it)."""
        ...

    def weight_version(self) -> str:
        """The label vLLM reports for the weights it serves."""
        ...


class OfflineVllm:
    """An offline ``vllm.LLM`` (its sends serialized: see :func:`serialize_sends`)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        serialize_sends(llm)

    def collective_rpc(self, method: str, timeout_s: float | None, args: tuple[Any, ...]) -> Any:
        """``method(*args)`` on every worker."""
        return self.llm.collective_rpc(method, timeout=timeout_s, args=args)

    def pause(self) -> None:
        """Pause the scheduler in vLLM's ``keep`` mode."""
        self.llm.sleep(level=0, mode="keep")

    def resume(self) -> None:
        """Resume the scheduler."""
        self.llm.wake_up(tags=["scheduling"])

    def drop_prefix_cache(self) -> None:
        """Reset the prefix cache and the running requests' KV."""
        self.llm.reset_prefix_cache(reset_running_requests=True)

    def set_weight_version(self, version: str) -> None:
        """Label the weights."""
        self.llm.llm_engine.set_weight_version(version)

    def weight_version(self) -> str:
        """The weights' label."""
        return str(self.llm.llm_engine.get_weight_version())


class AsyncVllm:
    """A ``vllm.v1.engine.async_llm.AsyncLLM`` whose coroutines run on ``loop`` (the
    application's event loop, running in another thread).

    Args:
        engine: the engine.
        loop: the event loop it serves on.
        timeout_s: bound of every call that carries none of its own.
    """

    def __init__(
        self, engine: Any, loop: asyncio.AbstractEventLoop, *, timeout_s: float = 120.0
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._timeout_s = timeout_s

    def _run(self, call: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:  # waiting here would block the loop the call needs
            call.close()
            raise RuntimeError("AsyncVllm is called from refit's threads, not its event loop")
        future = asyncio.run_coroutine_threadsafe(call, self._loop)
        try:
            return future.result(self._timeout_s if timeout_s is None else timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def collective_rpc(self, method: str, timeout_s: float | None, args: tuple[Any, ...]) -> Any:
        """``method(*args)`` on every worker (waited for a second past ``timeout_s``)."""
        bound = None if timeout_s is None else timeout_s + 1.0
        return self._run(self.engine.collective_rpc(method, timeout=timeout_s, args=args), bound)

    def pause(self) -> None:
        """``pause_generation(mode="keep")``, keeping the KV of requests in flight."""
        self._run(self.engine.pause_generation(mode="keep", clear_cache=False))

    def resume(self) -> None:
        """``resume_generation()``."""
        self._run(self.engine.resume_generation())

    def drop_prefix_cache(self) -> None:
        """Reset the prefix cache and the running requests' KV."""
        self._run(self.engine.reset_prefix_cache(reset_running_requests=True))

    def set_weight_version(self, version: str) -> None:
        """Label the weights."""
        self._run(self.engine.update_weight_version(version))

    def weight_version(self) -> str:
        """The weights' label."""
        return str(self._run(self.engine.get_weight_version()))


def vllm_client(engine: Any) -> VllmClient:
    """``engine`` as a :class:`VllmClient`: a client as is, an offline ``vllm.LLM`` wrapped.

    Raises:
        TypeError: an ``AsyncLLM`` (wrap it in :class:`AsyncVllm` with its event loop), or
            anything else.
    """
    if isinstance(engine, VllmClient):
        return engine
    if hasattr(engine, "llm_engine"):
        return OfflineVllm(engine)
    if hasattr(engine, "pause_generation"):
        raise TypeError("an AsyncLLM runs on an event loop: pass AsyncVllm(engine, loop)")
    raise TypeError(f"not a vLLM engine: {type(engine).__name__}")


def serialize_sends(llm: Any) -> None:
    """Serialize the sends of ``llm``'s engine-core client (idempotent; a client without the
    single sending method of vLLM 0.32's ``SyncMPClient`` is left alone).

    vLLM's offline client sends every request and RPC on one ZMQ socket, which is not
    thread-safe, while refit's controller calls run on threads of their own, possibly beside
    the application's own ``generate``: a lock around the one sending method makes
    concurrent senders queue instead of corrupting the socket (which aborts the process).
    """
    client = llm.llm_engine.engine_core
    send = getattr(client, "_send_input", None)
    if send is None or getattr(send, "refit_serialized", False):
        if send is None:
            logger.warning("%s has no _send_input: its sends are not serialized", type(client))
        return
    lock = threading.Lock()

    @functools.wraps(send)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return send(*args, **kwargs)

    serialized.refit_serialized = True  # type: ignore[attr-defined]
    client._send_input = serialized
