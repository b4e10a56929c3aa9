"""The shared API key: HMAC-SHA256 of every header, compared in constant time.

The key itself never travels: each message carries the MAC of its header bytes under the key
(the 32 raw bytes of HMAC-SHA256, keyed with the UTF-8 bytes of the key's text); a side
without a key sends and accepts only an empty MAC.
A relay reads the key only from the environment variable it is told to use; the key's value
is never logged, formatted into an error, or kept in a ``repr``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os

from refit_core import AuthenticationError
from refit_zmq.codec.format import BytesLike

__all__ = ["Signer", "api_key_from_env"]

logger = logging.getLogger(__name__)


def api_key_from_env(variable: str | None) -> str | None:
    """The API key held by ``variable`` (None when no variable is named).

    Raises:
        ValueError: the variable is named but unset or empty (a misconfiguration).
    """
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(f"environment variable {variable} holds no API key")
    logger.debug("API key read from %s", variable)
    return key


class Signer:
    """Signs and verifies header MACs under one key; without a key it signs nothing.

    Args:
        key: the shared secret; None disables authentication (loopback development only).
    """

    def __init__(self, key: str | None) -> None:
        if key is not None and not key:
            raise ValueError("an API key must not be empty")
        self._key = None if key is None else key.encode()

    @classmethod
    def from_env(cls, variable: str | None) -> Signer:
        """The key held by ``variable`` (None: no key).

        Raises:
            ValueError: the variable is named but unset or empty (a misconfiguration).
        """
        return cls(api_key_from_env(variable))

    @property
    def enabled(self) -> bool:
        """Whether messages must carry a valid MAC."""
        return self._key is not None

    def sign(self, header: BytesLike) -> bytes:
        """The MAC of ``header`` (empty without a key)."""
        if self._key is None:
            return b""
        return hmac.new(self._key, header, hashlib.sha256).digest()

    def verify(self, header: BytesLike, mac: BytesLike) -> None:
        """Raise AuthenticationError unless ``mac`` is the MAC of ``header`` under the key
        (without a key: unless ``mac`` is empty)."""
        given = bytes(mac)
        if self._key is None:
            if given:
                raise AuthenticationError("message carries a MAC, but this side has no API key")
            return
        if not given:
            raise AuthenticationError("message carries no API key MAC")
        if not hmac.compare_digest(given, self.sign(header)):
            raise AuthenticationError("message MAC does not match the API key")

    def __repr__(self) -> str:
        return f"Signer(enabled={self.enabled})"
