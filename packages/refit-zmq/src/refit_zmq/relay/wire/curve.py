"""Optional CURVE encryption and server authentication (libzmq CurveZMQ) for relay links.

Every relay of a tree holds the same server key pair; producers and the coordinator hold the
server's public key, so they only talk to a holder of the secret key, and everything on the
wire is encrypted. Clients (and relays forwarding to their children) use a fresh key pair
per socket. Client identity stays with the API key MAC, which CURVE then also hides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

__all__ = ["CurveConfig"]

PUBLIC_KEY_ENV = "REFIT_ZMQ_CURVE_PUBLIC_KEY"
SECRET_KEY_ENV = "REFIT_ZMQ_CURVE_SECRET_KEY"


@dataclass(frozen=True, repr=False)
class CurveConfig:
    """The relays' CURVE server key pair (Z85); clients hold only the public key.

    Attributes:
        server_public_key: the relays' public key, 40 Z85 characters.
        server_secret_key: the relays' secret key; None on producers and coordinators.
    """

    server_public_key: bytes
    server_secret_key: bytes | None = None

    def __post_init__(self) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE")
        keys = (self.server_public_key, self.server_secret_key or self.server_public_key)
        if any(len(key) != 40 for key in keys):
            raise ValueError("CURVE keys must be 40 Z85 characters")
        if (
            self.server_secret_key is not None
            and zmq.curve_public(self.server_secret_key) != self.server_public_key
        ):
            raise ValueError("the CURVE secret key does not belong to the public key")

    def __repr__(self) -> str:
        return f"CurveConfig(server_public_key={self.server_public_key.decode()!r})"

    @classmethod
    def generate(cls) -> CurveConfig:
        """A fresh server key pair (for tests and single-job deployments)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def from_env(
        cls, public_var: str = PUBLIC_KEY_ENV, secret_var: str = SECRET_KEY_ENV
    ) -> CurveConfig | None:
        """Keys from the environment: None if ``public_var`` is unset; the secret is optional."""
        public = os.environ.get(public_var)
        if not public:
            return None
        secret = os.environ.get(secret_var)
        return cls(public.encode(), secret.encode() if secret else None)

    @classmethod
    def from_files(cls, certificate: str | os.PathLike[str]) -> CurveConfig:
        """Keys from a ZeroMQ certificate file (``zmq.auth.create_certificates`` format)."""
        public, secret = zmq.auth.load_certificate(Path(certificate))
        return cls(public, secret)

    def public_only(self) -> CurveConfig:
        """This configuration without the secret key (what producers hold)."""
        return CurveConfig(self.server_public_key)

    def secure_server(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` (before bind) a CURVE server with the secret key."""
        if self.server_secret_key is None:
            raise ValueError("a relay needs the CURVE secret key")
        socket.curve_secretkey = self.server_secret_key
        socket.curve_publickey = self.server_public_key
        socket.curve_server = True

    def secure_client(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` (before connect) a CURVE client of the relays, with a fresh key pair."""
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey = self.server_public_key
        socket.curve_publickey = public
        socket.curve_secretkey = secret
