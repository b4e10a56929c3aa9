"""Whether a relay's process still listens: a TCP connect that is refused means it is gone.

A frozen process still accepts connections (its kernel does), so only a dead or closed relay
is found this way, at once and without any message: what a controller checks while it waits
for a relay, instead of waiting for its timeout.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

__all__ = ["refuses_connections"]

_CONNECT_S = 0.2


def refuses_connections(address: str) -> bool:
    """Whether nothing listens at ``address`` (a ``tcp://host:port`` whose connection is
    refused); False for a listening, unreachable or non-TCP address (unknown)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=_CONNECT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
