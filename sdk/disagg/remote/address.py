"""Addresses of driver endpoints: a unix socket, or a loopback TCP port.

The driver channel carries no TLS and no authentication yet, so it is local by design: ``unix:PATH`` (file
permissions guard it) or ``127.0.0.1:PORT``, ``localhost:PORT``, ``[::1]:PORT``. Anything else is refused
with a message that says why.
"""

from __future__ import annotations

from disagg.errors import ConfigError
from disagg.wire.sockets import MAX_PORT, port_from_text, unix_path_refusal

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")


def check_address(address: object, *, field: str = "address", listening: bool = False) -> str:
    """``address`` when it is ``unix:PATH`` or a loopback ``HOST:PORT``; else `ConfigError` naming ``field``.

    Port 0 (any free port) is allowed only when ``listening``.
    """
    if not isinstance(address, str) or not address:
        raise ConfigError(f"{field}: give unix:/path/to/socket or 127.0.0.1:PORT, not {address!r}", field=field)
    if address.startswith("unix:"):
        if not unix_path(address):
            raise ConfigError(f"{field}: {address!r} names no socket path", field=field)
        refused = unix_path_refusal(unix_path(address))
        if refused:  # a driver refuses to listen there, and a channel would reach another path
            raise ConfigError(f"{field}: {address!r}: {refused}", field=field)
        if address.startswith("unix://") and not address.startswith("unix:///"):
            # gRPC reads what follows "unix://" as an absolute path ("unix://run/x" is /run/x), not a relative one.
            raise ConfigError(
                f"{field}: {address!r} is ambiguous: write unix:///absolute/path or unix:relative/path", field=field
            )
        return address
    host, sep, port = address.rpartition(":")
    if not sep or host not in LOOPBACK:
        raise ConfigError(
            f"{field}: {address!r} is not a unix socket or a loopback address; the driver channel has no TLS or "
            "authentication, so it is unix:/path or 127.0.0.1:PORT (localhost, [::1]) only",
            field=field,
        )
    lowest = 0 if listening else 1
    number = port_from_text(port)
    if number is None or number < lowest or port != str(number):
        raise ConfigError(f"{field}: {address!r} needs a port from {lowest} to {MAX_PORT}", field=field)
    return address


def unix_path(address: str) -> str:
    """The file system path of a ``unix:`` address (``unix:rel``, ``unix:/abs`` or ``unix:///abs``)."""
    path = address.removeprefix("unix:")
    if path.startswith("//"):
        path = path[2:]
    return path
