"""The in-process SGLang client: an ``sglang.Engine`` driven through its TokenizerManager.

``sglang.Engine`` (``python/sglang/srt/entrypoints/engine.py`` of sgl-project/sglang at
:data:`~refit_sglang.protocol.SGLANG_COMMIT`) has no ``pause_generation`` or
``continue_generation``, and its ``update_weights_from_tensor(named_tensors, load_format,
flush_cache)`` and ``update_weights_from_distributed(names, dtypes, shapes, group_name,
flush_cache, load_format)`` take no ``weight_version``. Each of its methods builds an
``io_struct`` request and runs a ``TokenizerManager`` coroutine on ``engine.loop`` with
``run_until_complete``; the HTTP routes await the same coroutines with structs carrying every
field. So refit makes the Engine's own move with the full structs:
``engine.loop.run_until_complete(engine.tokenizer_manager.<route>(<ReqInput>(**body)[, None]))``
(:data:`~refit_sglang.protocol.TOKENIZER_CALLS`), which pauses with a mode and commits the
weight version exactly as the HTTP server does.

An Engine-like object without a ``tokenizer_manager`` is driven through methods named after
the routes, taking the request fields as keywords (the flattened payloads as
``named_tensors``, as ``sglang.Engine`` names them).

Either way, what refit needs is checked before anything moves: a missing coroutine, request
struct, struct field or keyword is an :class:`~refit_sglang.client.UnsupportedEngineError`,
never a skipped pause or a dropped version.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from typing import Any

from refit_core import BackendNotInstalledError, WorkerError
from refit_sglang.client import SGLangClient, UnsupportedEngineError
from refit_sglang.protocol import REFIT_FIELDS, TOKENIZER_CALLS

__all__ = ["EngineClient"]

_SGLANG_IO_STRUCT = "sglang.srt.managers.io_struct"

_METHOD_ARGUMENT_NAMES: Mapping[str, Mapping[str, str]] = {
    "update_weights_from_tensor": {"serialized_named_tensors": "named_tensors"},
}
"""Where an Engine-like method's keyword differs from the request field."""


class EngineClient(SGLangClient):
    """An in-process ``sglang.Engine`` (or an Engine-like object), one call at a time.

    Its calls run on the caller's thread and cannot be interrupted, so a synchronizer with
    a deadline refuses it.

    Args:
        engine: the engine.
        label: how errors and results name it.
        io_struct: the module (or namespace) holding SGLang's request structs; by default
            ``sglang.srt.managers.io_struct``. Only an engine with a ``tokenizer_manager``
            uses it.

    Raises:
        UnsupportedEngineError: the engine has a ``tokenizer_manager`` but it is None (an
            Engine on a node of rank > 0) or it has no event loop.
        BackendNotInstalledError: ``io_struct`` is needed, not given, and ``sglang`` is not
            importable.
    """

    def __init__(self, engine: Any, label: str = "engine", *, io_struct: Any = None) -> None:
        super().__init__(label)
        self._engine = engine
        self._lock = threading.Lock()
        self._checked: set[str] = set()
        self._calls: _Calls = (
            _TokenizerManagerCalls(engine, label, io_struct)
            if hasattr(engine, "tokenizer_manager")
            else _MethodCalls(engine)
        )

    @property
    def bounded(self) -> bool:
        """An in-process call cannot be interrupted."""
        return False

    @property
    def tp_size(self) -> int:
        """``engine.server_args.tp_size``."""
        return int(self._engine.server_args.tp_size)

    @property
    def device(self) -> str:
        """``engine.server_args.device``."""
        return str(self._engine.server_args.device)

    def require(self, routes: Collection[str]) -> None:
        """Check that every route can be called with the fields refit sets."""
        problems = [problem for route in routes for problem in self._calls.missing(route)]
        if problems:
            raise UnsupportedEngineError(
                f"{self.label} cannot be refit in process: {'; '.join(problems)}"
            )
        self._checked.update(routes)

    def call(self, route: str, body: Mapping[str, object], timeout_s: float | None) -> None:
        """Invoke ``route`` (``timeout_s`` cannot be honoured in process)."""
        if route not in self._checked:
            self.require([route])
        with self._lock:
            try:
                result = self._calls.invoke(route, body)
            except UnsupportedEngineError:
                raise
            except Exception as exc:
                raise WorkerError(
                    f"{type(exc).__name__}: {exc}", worker=self.label, operation=route
                ) from exc
        success, message = _outcome(result)
        if not success:
            raise WorkerError(message, worker=self.label, operation=route)

    def close(self) -> None:
        """Nothing to release: the engine belongs to its creator."""


class _Calls(ABC):
    """One way of calling an in-process engine."""

    @abstractmethod
    def missing(self, route: str) -> list[str]:
        """What prevents calling ``route`` with the fields refit sets (empty: nothing)."""

    @abstractmethod
    def invoke(self, route: str, body: Mapping[str, object]) -> object:
        """Call ``route`` and return what the engine answered."""


class _TokenizerManagerCalls(_Calls):
    """``engine.tokenizer_manager``'s coroutines with ``io_struct`` requests, run on
    ``engine.loop`` the way ``sglang.Engine``'s own methods run them."""

    def __init__(self, engine: Any, label: str, io_struct: Any) -> None:
        self._manager = engine.tokenizer_manager
        if self._manager is None:
            raise UnsupportedEngineError(
                f"{label}: engine.tokenizer_manager is None (an Engine on a node of rank > 0 "
                "serves no requests; refit the engine on node 0)"
            )
        loop = getattr(engine, "loop", None)
        if not isinstance(loop, asyncio.AbstractEventLoop):
            raise UnsupportedEngineError(f"{label}: the engine has no event loop (engine.loop)")
        self._loop = loop
        self._label = label
        self._structs = _sglang_io_struct() if io_struct is None else io_struct

    def missing(self, route: str) -> list[str]:
        call = TOKENIZER_CALLS.get(route)
        if call is None:
            return [f"refit has no in-process call for route {route!r}"]
        problems = []
        if not inspect.iscoroutinefunction(getattr(self._manager, route, None)):
            problems.append(f"TokenizerManager has no coroutine {route}")
        if call.request_type is not None:
            struct = getattr(self._structs, call.request_type, None)
            if struct is None:
                problems.append(f"io_struct has no {call.request_type}")
            else:
                fields = _field_names(struct)
                problems += [
                    f"{call.request_type} has no field {name!r}"
                    for name in REFIT_FIELDS[route]
                    if name not in fields
                ]
        return problems

    def invoke(self, route: str, body: Mapping[str, object]) -> object:
        if self._loop.is_running():
            raise UnsupportedEngineError(
                f"{self._label}: engine.loop is running (refit called from inside it, or "
                "another thread runs it); an in-process refit runs the loop itself, as "
                "sglang.Engine's methods do"
            )
        call = TOKENIZER_CALLS[route]
        coroutine = getattr(self._manager, route)
        if call.request_type is None:
            return self._loop.run_until_complete(coroutine(**body))
        request = getattr(self._structs, call.request_type)(**_struct_fields(body))
        arguments = (request, None) if call.request_slot else (request,)
        return self._loop.run_until_complete(coroutine(*arguments))


class _MethodCalls(_Calls):
    """An Engine-like object with a method per route taking the request fields."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def missing(self, route: str) -> list[str]:
        method = getattr(self._engine, route, None)
        if not callable(method):
            return [f"the engine has no method {route} (and no tokenizer_manager)"]
        signature = inspect.signature(method)
        renames = _METHOD_ARGUMENT_NAMES.get(route, {})
        refused = []
        for field in REFIT_FIELDS.get(route, ()):
            try:
                signature.bind_partial(**{renames.get(field, field): None})
            except TypeError:
                refused.append(renames.get(field, field))
        return [f"{route}() takes no {name!r}" for name in refused]

    def invoke(self, route: str, body: Mapping[str, object]) -> object:
        renames = _METHOD_ARGUMENT_NAMES.get(route, {})
        return getattr(self._engine, route)(**{renames.get(k, k): v for k, v in body.items()})


def _sglang_io_struct() -> Any:
    try:
        return importlib.import_module(_SGLANG_IO_STRUCT)
    except ImportError as exc:
        raise BackendNotInstalledError(
            f"an in-process SGLang engine is driven with SGLang's request structs "
            f"({_SGLANG_IO_STRUCT}), which cannot be imported here",
            install_hint="pip install sglang",
        ) from exc


def _field_names(struct: Any) -> frozenset[str]:
    """A request struct's fields: ``msgspec.Struct.__struct_fields__``, else its signature."""
    fields = getattr(struct, "__struct_fields__", None)
    if fields is None:
        fields = inspect.signature(struct).parameters
    return frozenset(fields)


def _struct_fields(body: Mapping[str, object]) -> dict[str, object]:
    """``body`` as a struct takes it: serialized payloads as raw bytes (``io_struct`` types
    them ``List[bytes]``; only HTTP callers send base64 text)."""
    fields = dict(body)
    payloads = fields.get("serialized_named_tensors")
    if isinstance(payloads, list):
        fields["serialized_named_tensors"] = [
            base64.b64decode(p) if isinstance(p, str) else p for p in payloads
        ]
    return fields


def _outcome(result: object) -> tuple[bool, str]:
    """(success, message) from what SGLang answers: None (pause, continue), a
    ``(success, message)`` tuple (weight routes), a reply struct with ``success`` (flush), or
    a ``{"success", "message"}`` mapping."""
    if isinstance(result, tuple) and result and isinstance(result[0], bool):
        return result[0], str(result[1]) if len(result) > 1 else ""
    if isinstance(result, Mapping):
        return result.get("success") is not False, str(result.get("message", ""))
    success = getattr(result, "success", True)
    return success is not False, str(getattr(result, "message", ""))
