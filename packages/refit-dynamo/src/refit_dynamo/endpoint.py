"""Where one Dynamo worker's admin routes live."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["DynamoWorkerEndpoint"]


@dataclass(frozen=True)
class DynamoWorkerEndpoint:
    """A Dynamo worker: its instance id and the base URL of its system HTTP server.

    ``system_url`` is an ``http(s)://host[:port]`` URL; a trailing slash is dropped.
    """

    instance_id: str
    system_url: str

    def __post_init__(self) -> None:
        if not isinstance(self.instance_id, str) or not self.instance_id:
            raise ValueError(f"instance_id must be a non-empty string, got {self.instance_id!r}")
        if not isinstance(self.system_url, str):
            raise ValueError(f"system_url must be a string, got {type(self.system_url).__name__}")
        url = self.system_url.rstrip("/")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"system_url {self.system_url!r} is not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"system_url must be an http(s)://host[:port] URL, got {self.system_url!r}"
            )
        if parts.query or parts.fragment or port == 0:
            raise ValueError(f"system_url {self.system_url!r} has a query, fragment or port 0")
        object.__setattr__(self, "system_url", url)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, object]) -> DynamoWorkerEndpoint:
        """Build from a worker's discovery metadata (``instance_id``, ``system_url``).

        Dynamo's instance ids are integers; they are kept as their decimal string.

        Raises:
            ValueError: a field is missing or ill-typed, or the URL is not http(s).
        """
        if not isinstance(metadata, Mapping):
            raise ValueError(f"worker metadata must be a mapping, got {type(metadata).__name__}")
        missing = [key for key in ("instance_id", "system_url") if key not in metadata]
        if missing:
            raise ValueError(f"worker metadata lacks {', '.join(missing)}: {dict(metadata)!r}")
        instance_id = metadata["instance_id"]
        if isinstance(instance_id, bool) or not isinstance(instance_id, int | str):
            raise ValueError(
                f"instance_id must be an int or a string, got {type(instance_id).__name__}"
            )
        system_url = metadata["system_url"]
        if not isinstance(system_url, str):
            raise ValueError(f"system_url must be a string, got {type(system_url).__name__}")
        return cls(str(instance_id), system_url)

    def route_url(self, route: str) -> str:
        """URL of the admin route ``route`` (served under ``/engine/``)."""
        return f"{self.system_url}/engine/{route}"
