"""A pooled HTTP client for Dynamo workers' admin routes, with typed failures.

Every call is a single POST with a timeout; nothing is retried, because the admin routes
(join a group, receive weights, pause) are not idempotent.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from typing import Any

import httpx

from refit_dynamo.endpoint import DynamoWorkerEndpoint
from refit_dynamo.errors import DynamoWorkerError, DynamoWorkerTimeoutError

__all__ = ["AdminClient"]

logger = logging.getLogger(__name__)

_MAX_DETAIL_CHARS = 300


class AdminClient:
    """Posts JSON to ``{system_url}/engine/{route}``; thread-safe, connections are pooled.

    Args:
        timeout_s: timeout of every phase of one call (connect, write, read, pool).
        max_connections: connections kept across all workers.
    """

    def __init__(self, timeout_s: float, *, max_connections: int = 64) -> None:
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None

    def post(
        self, worker: DynamoWorkerEndpoint, route: str, payload: Mapping[str, Any], *, rpc: str = ""
    ) -> dict[str, Any]:
        """POST ``payload`` to ``worker``'s ``route``; the answer's JSON object on success.

        ``rpc`` (the ``engine_rpc`` posted) only labels log lines and errors.

        Raises:
            DynamoWorkerTimeoutError: no answer within ``timeout_s``.
            DynamoWorkerError: unreachable worker, HTTP error, malformed answer, or a
                ``status`` other than ``"ok"``.
        """
        label = f"{route} ({rpc})" if rpc else route
        logger.debug("POST %s %s", worker.instance_id, label)
        try:
            response = self._session().post(worker.route_url(route), json=dict(payload))
        except httpx.TimeoutException as exc:
            raise DynamoWorkerTimeoutError(
                f"no answer within {self.timeout_s:g} s ({type(exc).__name__}); the worker may "
                f"still be running {rpc or route}",
                instance_id=worker.instance_id,
                route=route,
            ) from exc
        except httpx.ConnectError as exc:
            raise DynamoWorkerError(
                f"unreachable at {worker.system_url}: {exc}",
                instance_id=worker.instance_id,
                route=route,
                is_retryable=True,
            ) from exc
        except httpx.TransportError as exc:
            raise DynamoWorkerError(
                f"connection failed during {rpc or route}: {type(exc).__name__}: {exc}",
                instance_id=worker.instance_id,
                route=route,
            ) from exc
        return _check(worker, route, rpc, response)

    def close(self) -> None:
        """Close pooled connections; a later call opens new ones."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles as its settings: a copy opens connections of its own."""
        return {"timeout_s": self.timeout_s, "max_connections": self._max_connections}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.timeout_s = state["timeout_s"]
        self._max_connections = state["max_connections"]
        self._lock = threading.Lock()
        self._client = None

    def _session(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                self._client = httpx.Client(
                    timeout=httpx.Timeout(self.timeout_s),
                    limits=httpx.Limits(
                        max_connections=self._max_connections,
                        max_keepalive_connections=self._max_connections,
                    ),
                    transport=httpx.HTTPTransport(retries=0),
                    trust_env=False,
                )
            return self._client


def _check(
    worker: DynamoWorkerEndpoint, route: str, rpc: str, response: httpx.Response
) -> dict[str, Any]:
    """The answer's JSON object, or the typed error it amounts to."""

    def fail(message: str) -> DynamoWorkerError:
        what = f"{rpc}: " if rpc else ""
        return DynamoWorkerError(
            f"{what}{message}",
            instance_id=worker.instance_id,
            route=route,
            status_code=response.status_code,
        )

    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != httpx.codes.OK:
        detail = _detail(body) if isinstance(body, dict) else response.text[:_MAX_DETAIL_CHARS]
        raise fail(f"HTTP {response.status_code}: {detail}")
    if not isinstance(body, dict):
        raise fail(f"answer is not a JSON object: {response.text[:_MAX_DETAIL_CHARS]!r}")
    if body.get("status") != "ok":
        raise fail(f"status {body.get('status')!r}: {_detail(body)}")
    return body


def _detail(body: dict[str, Any]) -> str:
    """The human part of an answer (Dynamo puts it in ``message`` or ``error``)."""
    parts = [str(body[key]) for key in ("error", "message") if body.get(key)]
    return ": ".join(parts)[:_MAX_DETAIL_CHARS] or repr(body)[:_MAX_DETAIL_CHARS]
