"""Listener addresses: ``host:port`` on TCP, ``unix:/path`` for a unix socket.

The server speaks plaintext and has no authentication yet, so TCP listeners are refused on anything but a
loopback address unless the operator allows remote clients explicitly (``--allow-remote``). A unix socket's
parent directory is created, and a stale socket file (left by a server that died) is removed; a live one,
or a file that is not a socket, is an error. A unix socket's path holds none of ``% ? # ,``, which gRPC reads
as URI syntax (`disagg.wire.sockets.unix_path_refusal`), and no address holds a NUL or bytes that are not UTF-8.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import attrs

from disagg.errors import ConfigError
from disagg.wire.sockets import (
    MAX_PORT,
    address_text_refusal,
    port_from_text,
    prepare_unix_socket,
    unix_path_refusal,
)

UNIX_PREFIX = "unix:"
MAX_UNIX_PATH = 107
"""sun_path holds 108 bytes with the terminating NUL."""


@attrs.frozen
class Listener:
    """A parsed listener address; ``target`` is what grpcio binds."""

    address: str
    target: str
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    def bound(self, port: int) -> str:
        """The address as served: a TCP port of 0 becomes the port the system chose."""
        if self.unix_path is not None:
            return self.address
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listener(address: str, *, allow_remote: bool = False) -> Listener:
    """Check one address; raises `ConfigError` naming it."""
    field = "listen"
    refused = address_text_refusal(address)
    if refused:
        raise ConfigError(f"listener {address!r}: {refused}", field=field)
    if address.startswith(UNIX_PREFIX):
        raw = address[len(UNIX_PREFIX) :]
        if not raw.startswith("/"):
            raise ConfigError(f"listener {address!r}: give an absolute path, unix:/path/to/socket", field=field)
        refused = unix_path_refusal(raw)
        if refused:
            raise ConfigError(f"listener {address!r}: {refused}", field=field)
        if len(raw.encode()) > MAX_UNIX_PATH:
            raise ConfigError(f"listener {address!r}: a unix socket path is at most {MAX_UNIX_PATH} bytes", field=field)
        return Listener(address, address, unix_path=Path(raw))
    if "://" in address:  # its scheme's colon would be taken for an IPv6 address's
        raise ConfigError(f"listener {address!r}: give host:port or unix:/path/to/socket, not a URL", field=field)
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"listener {address!r}: write an IPv6 address in brackets, [::1]:50051", field=field)
    port = port_from_text(port_text)
    if not sep or not host or port is None:
        raise ConfigError(f"listener {address!r}: expected host:port (port 0-{MAX_PORT}) or unix:/path", field=field)
    if not allow_remote and not _is_loopback(host):
        raise ConfigError(
            f"listener {address!r}: the server has no authentication or TLS yet, so it listens on loopback "
            "addresses (127.0.0.1, [::1], localhost) and unix sockets only; pass --allow-remote to listen on "
            f"{host}",
            field=field,
        )
    target = f"[{host}]:{port_text}" if ":" in host else f"{host}:{port_text}"
    return Listener(address, target, host=host, port=port)


__all__ = ["Listener", "parse_listener", "prepare_unix_socket"]
