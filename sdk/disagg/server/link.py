"""The link between the gRPC front end and the composer's process: frames on a unix socket pair.

A frame is a header (payload length, call id, kind) and a payload. Each side writes the frames of one turn of its
event loop in one system call (`LinkProtocol.send`), which is what keeps the hop cheap at 32 clients: one write
carries every call that arrived together. Requests and responses go as the bytes gRPC carried, never decoded by the
front end. Control frames (listening, health, stop) are rare and carry JSON.

Front end to composer: `CALL` (method index, absolute deadline on the monotonic clock, request bytes), `CANCEL`
(the client went away or its deadline passed), `CREDIT` (a stream's messages the front end has sent on, so that a
watch's send waits for its client as it does on one process), `LISTENING`, `STOPPED` and `PING`. Composer to front
end: `REPLY`, `MESSAGE`, `HEADERS` (initial metadata), `END` (a status with its trailing metadata), `HEALTH`, `STOP`
and `PONG`, the answer to a `PING`, which tells the front end that the composer's loop still runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import Sequence
from typing import Any, cast

HEADER = struct.Struct("<IIB")
"""Payload length, call id, kind."""
CALL_HEAD = struct.Struct("<Hd")
"""A call's method index and its deadline (`time.monotonic`, NaN for none); the request's bytes follow."""
COUNT = struct.Struct("<I")
MAX_FRAME = 1 << 30
"""Larger than any message gRPC lets through (its receive limit is 4 MiB unless raised): a frame that claims
more is a broken link."""

CALL, CANCEL, CREDIT, LISTENING, STOPPED, PING = 1, 2, 3, 4, 5, 6
REPLY, MESSAGE, HEADERS, END, HEALTH, STOP, PONG = 16, 17, 18, 19, 20, 21, 22

STREAM_CREDIT = 8
"""The messages a stream may send ahead of what the front end has passed on to gRPC."""

Metadata = Sequence[tuple[str, str | bytes]]


def deadline_of(remaining: float | None, now: float) -> float:
    """A call's absolute deadline from what gRPC says remains of it (None: no deadline, sent as NaN)."""
    return math.nan if remaining is None else now + remaining


def encode_metadata(metadata: Metadata) -> list[list[str]]:
    """Metadata as JSON: a binary value (a ``-bin`` key's) in base64, marked by a third element."""
    return [
        [key, base64.b64encode(value).decode(), "b"] if isinstance(value, bytes) else [key, value]
        for key, value in metadata
    ]


def decode_metadata(pairs: list[list[str]]) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((pair[0], base64.b64decode(pair[1]) if len(pair) > 2 else pair[1]) for pair in pairs)


def end_payload(code: int, details: str, trailing: Metadata) -> bytes:
    """`END`'s payload: the status code's number, its details and trailing metadata."""
    return json.dumps([code, details, encode_metadata(trailing)]).encode()


def read_end(payload: bytes) -> tuple[int, str, tuple[tuple[str, str | bytes], ...]]:
    code, details, trailing = json.loads(payload)
    return int(code), str(details), decode_metadata(trailing)


class LinkBrokenError(ConnectionError):
    """The other process sent a frame no link sends: the link is closed."""


class LinkProtocol(asyncio.Protocol):
    """Reads frames and hands each to `frame`; writes frames batched per turn of the loop. `lost` is called once
    when the other end has gone (or sent garbage), with why."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._flushing = False
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's subclasses

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.lost(str(exc) if exc else "the other process closed the link")

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        end = len(buffer)
        size = HEADER.size
        try:
            while end - start >= size:
                length, call, kind = HEADER.unpack_from(buffer, start)
                if length > MAX_FRAME:
                    raise LinkBrokenError(f"a frame of {length} bytes")
                if end - start < size + length:
                    break
                payload = bytes(buffer[start + size : start + size + length])
                start += size + length
                self.frame(kind, call, payload)
        except Exception as exc:
            self.close(f"the link failed: {exc!r}")
            raise
        finally:
            del buffer[:start]

    def send(self, kind: int, call: int, payload: bytes = b"") -> None:
        """Queue a frame; the frames of this turn of the loop go out together. On the loop's thread only."""
        if self.closed:
            return
        self._out.append(HEADER.pack(len(payload), call, kind))
        self._out.append(payload)
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def send_json(self, kind: int, call: int, value: Any) -> None:
        self.send(kind, call, json.dumps(value).encode())

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(out))

    def close(self, why: str) -> None:
        """Close the link from this side; `lost` is told ``why``."""
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            if self._out:
                self.transport.write(b"".join(self._out))
                self._out.clear()
            self.transport.close()
        self.lost(why)

    def frame(self, kind: int, call: int, payload: bytes) -> None:
        raise NotImplementedError

    def lost(self, why: str) -> None:
        raise NotImplementedError
