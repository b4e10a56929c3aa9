"""Clients for SGLang's two surfaces: its HTTP server and an in-process ``sglang.Engine``.

Both take a route name (``pause_generation``, ``update_weights_from_tensor``, ...) and a body
with the fields of SGLang's request struct (:mod:`refit_sglang.protocol`), and raise
:class:`~refit_core.WorkerError` when the engine reports a failure.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from refit_core import RefitTimeoutError, WorkerError

__all__ = ["EngineClient", "HttpClient", "SGLangClient", "clients_for"]

logger = logging.getLogger(__name__)

_ENGINE_ARGUMENT_NAMES: Mapping[str, Mapping[str, str]] = {
    "update_weights_from_tensor": {"serialized_named_tensors": "named_tensors"},
}
"""Where ``sglang.Engine``'s keyword differs from the request field (it takes the serialized
payloads as ``named_tensors`` when ``load_format="flattened_bucket"``)."""


class SGLangClient(ABC):
    """One SGLang server or engine, as refit calls it."""

    def __init__(self, label: str) -> None:
        self.label = label

    @property
    @abstractmethod
    def bounded(self) -> bool:
        """Whether :meth:`call` honours its ``timeout_s``."""

    @property
    @abstractmethod
    def tp_size(self) -> int:
        """Tensor-parallel ranks of the engine (each gets its own copy of a payload)."""

    @abstractmethod
    def call(self, route: str, body: Mapping[str, object], timeout_s: float | None) -> None:
        """Invoke ``route`` with ``body``; WorkerError when SGLang reports a failure."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"


class HttpClient(SGLangClient):
    """An SGLang HTTP server at ``base_url`` (``POST /<route>`` with a JSON body)."""

    def __init__(self, base_url: str, *, control_timeout_s: float = 60.0) -> None:
        super().__init__(base_url.rstrip("/"))
        self._control_timeout_s = control_timeout_s
        self._http = httpx.Client(base_url=self.label)
        self._tp_size: int | None = None

    @property
    def bounded(self) -> bool:
        """Every request carries a timeout."""
        return True

    @property
    def tp_size(self) -> int:
        """``tp_size`` from ``GET /get_server_info`` (asked once)."""
        if self._tp_size is None:
            try:
                reply = self._http.get("/get_server_info", timeout=self._control_timeout_s)
                reply.raise_for_status()
                self._tp_size = int(reply.json()["tp_size"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise WorkerError(
                    f"cannot read tp_size: {exc}", worker=self.label, operation="get_server_info"
                ) from exc
        return self._tp_size

    def call(self, route: str, body: Mapping[str, object], timeout_s: float | None) -> None:
        """POST ``body`` to ``/route``; ``timeout_s`` None means the control timeout."""
        timeout = self._control_timeout_s if timeout_s is None else timeout_s
        try:
            response = self._http.post(f"/{route}", json=dict(body), timeout=timeout)
        except httpx.TimeoutException as exc:
            raise RefitTimeoutError(
                f"{self.label}: {route} got no answer within {timeout:.3g} s",
                is_retryable=True,
                wedged_workers=[self.label],
            ) from exc
        except httpx.HTTPError as exc:
            raise WorkerError(str(exc), worker=self.label, operation=route) from exc
        _check_reply(self.label, route, response.status_code, _json(response))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (its connections are gone)."""
        return self._http.is_closed

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()


class EngineClient(SGLangClient):
    """An in-process ``sglang.Engine``-like object: one method per route, keyword arguments.

    Its calls run on the caller's thread and cannot be bounded, so a synchronizer with a
    deadline refuses it.
    """

    def __init__(self, engine: Any, label: str = "engine") -> None:
        super().__init__(label)
        self._engine = engine

    @property
    def bounded(self) -> bool:
        """An in-process call cannot be interrupted."""
        return False

    @property
    def tp_size(self) -> int:
        """``engine.server_args.tp_size``."""
        return int(self._engine.server_args.tp_size)

    def call(self, route: str, body: Mapping[str, object], timeout_s: float | None) -> None:
        """``engine.<route>(**body)``, with the Engine's own keyword names."""
        method = getattr(self._engine, route, None)
        if method is None:
            raise WorkerError("the engine has no such method", worker=self.label, operation=route)
        renames = _ENGINE_ARGUMENT_NAMES.get(route, {})
        result = method(**{renames.get(k, k): v for k, v in body.items()})
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
            result = {"success": result[0], "message": result[1]}
        _check_reply(self.label, route, 200, result)

    def close(self) -> None:
        """Nothing to release: the engine belongs to its creator."""


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return {"message": response.text}


def _check_reply(label: str, route: str, status: int, reply: object) -> None:
    """WorkerError unless the status is 2xx and any ``success`` field is true."""
    failed = isinstance(reply, dict) and reply.get("success") is False
    if 200 <= status < 300 and not failed:
        return
    message = reply.get("message", reply) if isinstance(reply, dict) else reply
    raise WorkerError(f"HTTP {status}: {message}", worker=label, operation=route)


def clients_for(generation: object) -> list[SGLangClient]:
    """SGLang clients for ``generation``: a base URL, an ``SGLangClient``, an Engine-like
    object (anything with ``update_weights_from_tensor``), or a sequence of these.

    Raises:
        ValueError: ``generation`` is none of these, or an empty sequence.
    """
    items: Sequence[object] = (
        generation
        if isinstance(generation, Sequence) and not isinstance(generation, str)
        else [generation]
    )
    if not items:
        raise ValueError("generation names no SGLang engine")
    clients: list[SGLangClient] = []
    for index, item in enumerate(items):
        if isinstance(item, SGLangClient):
            clients.append(item)
        elif isinstance(item, str):
            clients.append(HttpClient(item))
        elif callable(getattr(item, "update_weights_from_tensor", None)):
            clients.append(EngineClient(item, f"engine {index}"))
        else:
            raise ValueError(
                "generation must be SGLang server URLs, sglang.Engine-like objects or "
                f"SGLangClients, got {type(item).__name__}"
            )
    return clients
