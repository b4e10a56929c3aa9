"""An in-process stand-in shaped like ``sglang.Engine``, over a :class:`StandInSGLang`.

Mirrors what refit can reach in sgl-project/sglang at commit ``001067ff…`` (``SGLANG_COMMIT``):

- ``python/sglang/srt/entrypoints/engine.py``: ``Engine.server_args`` (``tp_size``),
  ``Engine.loop`` (the event loop its methods run with ``run_until_complete``),
  ``Engine.tokenizer_manager``, ``Engine.shutdown()``. The Engine itself has no
  ``pause_generation`` / ``continue_generation``, and its weight-update wrappers take no
  ``weight_version``; this stand-in has none of them, so a client calling one fails.
- ``python/sglang/srt/managers/tokenizer_manager.py``: ``async pause_generation(obj)`` and
  ``async continue_generation(obj)`` (return None); the control mixin (read at 00a2ca2e, the
  nearest stored version; the Engine at the commit calls them the same way):
  ``async flush_cache(timeout_s=None)`` answering a ``FlushCacheReqOutput(success,
  message)``, and ``async <weight route>(obj, request)`` answering ``(success, message)``.
  Every coroutine must run on ``Engine.loop`` (the real one's handle loop lives there).
- ``python/sglang/srt/managers/io_struct.py``: the ``*ReqInput`` structs (``msgspec.Struct``,
  ``kw_only``, ``rid`` and ``http_worker_ipc`` from ``BaseReq``) as :data:`IO_STRUCT`, built from
  :data:`refit_sglang.protocol.REQUESTS`: an unknown or missing field is a ``TypeError`` as in
  msgspec, and the stand-in server still validates every field's type.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, ClassVar

from refit_sglang.protocol import REQUESTS, TOKENIZER_CALLS
from sglang_standin import StandInSGLang


class StandInRequest:
    """An ``io_struct`` request: only its fields, given by keyword; keeps those given."""

    route: ClassVar[str]
    __struct_fields__: ClassVar[tuple[str, ...]]

    def __init__(self, **fields: object) -> None:
        unknown = [k for k in fields if k not in self.__struct_fields__]
        if unknown:
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        missing = [k for k, f in REQUESTS[self.route].items() if f.required and k not in fields]
        if missing:
            raise TypeError(f"Missing required argument {missing[0]!r}")
        self.given = fields


def _request_type(name: str, route: str) -> type[StandInRequest]:
    fields = ("rid", "http_worker_ipc", *REQUESTS[route])
    return type(name, (StandInRequest,), {"route": route, "__struct_fields__": fields})


IO_STRUCT = SimpleNamespace(
    **{
        call.request_type: _request_type(call.request_type, route)
        for route, call in TOKENIZER_CALLS.items()
        if call.request_type is not None
    }
)
"""The stand-in's ``sglang.srt.managers.io_struct``: the request structs refit builds."""


def _weight_route(route: str) -> Callable[..., Coroutine[Any, Any, tuple[bool, str]]]:
    """The control mixin's ``async <route>(self, obj, request)`` answering (success, message)."""

    async def serve(
        self: StandInTokenizerManager, obj: StandInRequest, request: object
    ) -> tuple[bool, str]:
        reply = self._serve(route, obj.given)
        return reply["success"], reply["message"]

    serve.__name__ = route
    return serve


class StandInTokenizerManager:
    """``TokenizerManager``'s refit coroutines, served by a :class:`StandInSGLang`."""

    def __init__(self, server: StandInSGLang, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop

    def _serve(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(f"{route} awaited outside the engine's loop")
        return self._server.handle(route, body)

    def _serve_or_raise(self, route: str, request: StandInRequest) -> None:
        reply = self._serve(route, request.given)
        if not reply["success"]:
            raise RuntimeError(reply["message"])

    async def pause_generation(self, obj: StandInRequest) -> None:
        self._serve_or_raise("pause_generation", obj)

    async def continue_generation(self, obj: StandInRequest) -> None:
        self._serve_or_raise("continue_generation", obj)

    async def flush_cache(self, timeout_s: float | None = None) -> SimpleNamespace:
        reply = self._serve("flush_cache", {} if timeout_s is None else {"timeout_s": timeout_s})
        return SimpleNamespace(**reply)

    update_weights_from_tensor = _weight_route("update_weights_from_tensor")
    update_weights_from_distributed = _weight_route("update_weights_from_distributed")
    init_weights_update_group = _weight_route("init_weights_update_group")
    destroy_weights_update_group = _weight_route("destroy_weights_update_group")


class StandInEngine:
    """``sglang.Engine``'s attributes over a :class:`StandInSGLang`; ``shutdown()`` closes
    its loop."""

    def __init__(self, server: StandInSGLang) -> None:
        self.server_args = SimpleNamespace(tp_size=server.tp_size, device="cpu")
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager: StandInTokenizerManager | None = StandInTokenizerManager(
            server, self.loop
        )

    def shutdown(self) -> None:
        self.loop.close()
