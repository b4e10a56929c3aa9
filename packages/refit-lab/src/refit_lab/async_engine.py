"""A real vLLM ``AsyncLLM`` serving on an event loop of its own (the engine tier's in-flight
tests and ``refit bench inflight_vllm``); vLLM is imported only when one starts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from refit_lab.event_loop import EventLoopThread

__all__ = ["async_engine"]


@contextmanager
def async_engine(
    path: str, extra: dict[str, Any], *, tp: int = 1, max_model_len: int = 1024
) -> Iterator[tuple[Any, EventLoopThread]]:
    """An ``AsyncLLM`` on the checkpoint at ``path`` (CPU-friendly: eager, bf16, no tokenizer,
    ``tp`` workers, ``extra`` engine arguments) and the loop it serves on; shut down after."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = EventLoopThread()
    arguments = AsyncEngineArgs(
        model=path,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=max_model_len,
        seed=0,
        tensor_parallel_size=tp,
        **extra,
    )

    async def start() -> Any:
        return AsyncLLM.from_engine_args(arguments)

    async def stop(engine: Any) -> None:
        engine.shutdown()  # on its loop, so that its output task ends before the loop does
        await asyncio.sleep(0.1)

    try:
        engine = loop.run(start())
    except BaseException:
        loop.close()
        raise
    try:
        yield engine, loop
    finally:
        loop.run(stop(engine))
        loop.close()
