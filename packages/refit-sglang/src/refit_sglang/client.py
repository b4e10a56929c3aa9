"""Clients for SGLang's surfaces, as refit calls them, and its HTTP server's client.

Every client takes a route name (``pause_generation``, ``update_weights_from_tensor``, ...)
and a body with the fields of SGLang's request struct (:mod:`refit_sglang.protocol`), and
raises :class:`~refit_core.WorkerError` when the engine reports a failure. The in-process
client is :class:`~refit_sglang.engine_client.EngineClient`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import httpx

from refit_core import RefitError, RefitTimeoutError, WorkerError

__all__ = ["HttpClient", "SGLangClient", "UnsupportedEngineError"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class UnsupportedEngineError(RefitError, TypeError):
    """An SGLang engine lacks what refit needs (a method, a request struct or one of its
    fields, such as ``weight_version``); refit refuses it rather than skip the step."""


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

    @property
    @abstractmethod
    def device(self) -> str:
        """The engine's device type (SGLang's ``server_args.device``: ``cuda``, ``cpu``...)."""

    @abstractmethod
    def require(self, routes: Collection[str]) -> None:
        """Raise :class:`UnsupportedEngineError` unless every route can be served with the
        fields refit sets (checked before a synchronizer moves anything)."""

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
        self._server_info: dict[str, object] | None = None

    @property
    def bounded(self) -> bool:
        """Every request carries a timeout."""
        return True

    def require(self, routes: Collection[str]) -> None:
        """Nothing to check ahead: a server answers for itself (an unknown route or a
        refused field is a failed call)."""

    @property
    def tp_size(self) -> int:
        """``tp_size`` from ``GET /get_server_info`` (asked once)."""
        return self._server_arg("tp_size", int)

    @property
    def device(self) -> str:
        """``device`` from ``GET /get_server_info`` (asked once)."""
        return self._server_arg("device", str)

    def _server_arg(self, name: str, kind: Callable[[Any], _T]) -> _T:
        """One field of the server's ``GET /get_server_info`` (fetched once) as ``kind``."""
        try:
            if self._server_info is None:
                reply = self._http.get("/get_server_info", timeout=self._control_timeout_s)
                reply.raise_for_status()
                info = reply.json()
                if not isinstance(info, dict):
                    raise TypeError(f"server info is a {type(info).__name__}, not an object")
                self._server_info = info
            return kind(self._server_info[name])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise WorkerError(
                f"cannot read {name}: {exc!r}", worker=self.label, operation="get_server_info"
            ) from exc

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
