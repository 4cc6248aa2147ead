"""Serves a `Switch` on a unix socket or loopback TCP: length-prefixed CCI frames, one request at a time per
connection, every malformed frame answered with a return code.

Loopback only, by design: the FM API has no authentication, and whoever reaches the socket owns the fabric.
The framing rules (cci.py): a 4-byte little-endian length, then the CCI message. A frame whose length is below
the 12-byte header is read, discarded and answered with Invalid Payload Length (tag and opcode 0, since there is
no header to echo). A frame above the maximum is answered the same way and the connection closed: skipping
megabytes to stay in step would only help a broken peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from pathlib import Path

import attrs
from disagg.wire.sockets import bind_unix_socket, port_from_text

from disagg_cxl_switch.cci import (
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    CCIMessage,
    MessageCategory,
    decode_message,
    encode_frame,
)
from disagg_cxl_switch.emulator.handlers import Switch
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.returncodes import ReturnCode

log = logging.getLogger(__name__)

MAX_MESSAGE_SIZE = HEADER_SIZE + (1 << 16)
"""Largest CCI message accepted: no FM API request the emulator serves comes near 64 KiB."""


@attrs.frozen
class ListenAddress:
    """Where to listen: a unix socket path, or a loopback host and TCP port."""

    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> ListenAddress:
        """``unix:/path`` or ``HOST:PORT`` with HOST a loopback address (127.0.0.0/8, ``[::1]``, localhost)."""
        if text.startswith("unix:"):
            path = text.removeprefix("unix:")
            if not path:
                raise ValueError("unix: needs a path")
            return cls(unix_path=Path(path))
        host, sep, port_text = text.rpartition(":")
        port = port_from_text(port_text)
        if not sep or port is None:
            raise ValueError(f"{text!r} is neither unix:/path nor HOST:PORT")
        host = host.strip("[]")
        if host != "localhost":
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ValueError(f"refusing to listen on {host!r}: loopback addresses or unix sockets only")
        return cls(host=host, port=port)


def _error_response(body: bytes, code: ReturnCode) -> CCIMessage:
    """Answer to a message that did not decode: echo its tag and opcode when the header is whole."""
    if len(body) < HEADER_SIZE:
        return CCIMessage(MessageCategory.RESPONSE, tag=0, opcode=0, return_code=code)
    return CCIMessage(
        MessageCategory.RESPONSE, tag=body[1], opcode=int.from_bytes(body[3:5], "little"), return_code=code
    )


def answer(switch: Switch, body: bytes) -> CCIMessage:
    """The response to one frame's body, whatever its bytes."""
    if len(body) < HEADER_SIZE:
        return _error_response(body, ReturnCode.INVALID_PAYLOAD_LENGTH)
    try:
        request = decode_message(body)
    except CCIFormatError:
        category_known = body[0] & 0x0F in tuple(MessageCategory)
        code = ReturnCode.INVALID_PAYLOAD_LENGTH if category_known else ReturnCode.INVALID_INPUT
        return _error_response(body, code)
    return switch.handle(request)


async def _serve_connection(switch: Switch, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                prefix = await reader.readexactly(FRAME_PREFIX_SIZE)
            except asyncio.IncompleteReadError:
                return
            size = int.from_bytes(prefix, "little")
            if size > MAX_MESSAGE_SIZE:
                writer.write(encode_frame(_error_response(b"", ReturnCode.INVALID_PAYLOAD_LENGTH)))
                await writer.drain()
                return
            try:
                body = await reader.readexactly(size)
            except asyncio.IncompleteReadError:
                return
            writer.write(encode_frame(answer(switch, body)))
            await writer.drain()
    except ConnectionError:
        return
    except Exception:
        log.exception("connection failed")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


SOCKET_MODE = 0o600
"""The emulator's unix socket is its owner's alone: the FM API authenticates no one, so the group the SDK's
sockets are open to (`SOCKET_MODE_MASK`) is too wide here."""


def _bind_unix(path: Path) -> socket.socket:
    """A socket bound at ``path``, owner-only from the moment it exists (`bind_unix_socket`, under the SDK's one
    umask lock: a lock of its own here left the process's umask wrong when the two interleaved)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bind_unix_socket(path, lambda: sock.bind(str(path)), SOCKET_MODE)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve(switch: Switch, address: ListenAddress, *, ready: asyncio.Event | None = None) -> None:
    """Serves until cancelled; a unix socket file is removed on the way out, so the caller must hold the path's
    claim (`prepare_unix_socket`) until this returns, or it may remove another emulator's socket.

    A unix socket is bound owner-only (`_bind_unix`): set closed after the bind, it could be connected to in
    between, and the FM API has no authentication."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_connection(switch, reader, writer)

    if address.unix_path is not None:
        path = address.unix_path
        server = await asyncio.start_unix_server(on_connect, sock=_bind_unix(path))
    else:
        server = await asyncio.start_server(on_connect, host=address.host, port=address.port)
    bound = ", ".join(str(s.getsockname()) for s in server.sockets)
    print(f"cxl-switch emulator listening on {bound}", flush=True)
    if ready is not None:
        ready.set()
    try:
        async with server:
            await server.serve_forever()
    finally:
        if address.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                address.unix_path.unlink()
