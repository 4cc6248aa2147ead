"""The CCI message, and how a stream of them is framed on a socket.

A CCI message (CXL r3.1 Figure 7-19, "CCI Message Format"; the body that DSP0234 carries over MCTP) is a
12-byte little-endian header followed by the payload:

====== ====== ==============================================================================
offset size   field
====== ====== ==============================================================================
0      1      bits[3:0] Message Category (0h request, 1h response); bits[7:4] reserved
1      1      Message Tag: echoed in the response, so a requester can match it to its request
2      1      reserved
3      2      Command Opcode (byte 3 the command, byte 4 the command set: 5101h is 01h, 51h)
5      3      bits[20:0] Message Payload Length; bits[22:21] reserved; bit[23] Background Operation
8      2      Return Code (responses; zero in requests)
10     2      Vendor Specific Extended Status (responses; zero in requests)
12     n      Message Payload, exactly Message Payload Length bytes
====== ====== ==============================================================================

Reserved bits are written as zero and ignored when read, as the specification asks of a receiver.

Stream framing. MCTP packetisation (and its 64-byte baseline transmission unit) is not needed on a reliable
byte stream, so on a unix socket or loopback TCP each CCI message is preceded by a 4-byte little-endian length:
the number of bytes of the CCI message that follows (header and payload, so at least 12). A reader takes the
length, then exactly that many bytes. The length is redundant with the header's payload length on purpose: a
reader finds boundaries without parsing the header, and a disagreement between the two is a detectable error.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.errors import CCIFormatError

HEADER_SIZE = 12
"""Bytes of the CCI message header before the payload."""

MAX_PAYLOAD_LENGTH = (1 << 21) - 1
"""The largest payload the 21-bit Message Payload Length field can describe."""

FRAME_PREFIX_SIZE = 4
"""Bytes of the little-endian length that precede each CCI message on a stream."""

_PAYLOAD_LENGTH_MASK = MAX_PAYLOAD_LENGTH
_BACKGROUND_OPERATION_BIT = 1 << 23
_CATEGORY_MASK = 0x0F


class MessageCategory(IntEnum):
    """Bits[3:0] of byte 0: whether the message asks or answers."""

    REQUEST = 0x0
    RESPONSE = 0x1


def _fits(bits: int) -> Callable[[Any, attrs.Attribute[int], int], None]:
    def check(_: Any, attribute: attrs.Attribute[int], value: int) -> None:
        if not 0 <= value < 1 << bits:
            raise ValueError(f"{attribute.name}={value} does not fit in {bits} bits")

    return check


@attrs.frozen
class CCIMessage:
    """One CCI request or response: the header fields and the raw payload bytes.

    The payload stays bytes here: which FM API payload class decodes it depends on the opcode and the category,
    and a malformed payload must still be answerable (with a return code) once the header is known.
    `return_code` is the raw 16-bit field, not a `ReturnCode`, so that codes of later revisions survive.
    """

    category: MessageCategory
    tag: int = attrs.field(validator=_fits(8))
    opcode: int = attrs.field(validator=_fits(16))
    payload: bytes = b""
    background_operation: bool = False
    return_code: int = attrs.field(default=0, validator=_fits(16))
    vendor_specific_status: int = attrs.field(default=0, validator=_fits(16))

    def __attrs_post_init__(self) -> None:
        if len(self.payload) > MAX_PAYLOAD_LENGTH:
            raise ValueError(f"payload of {len(self.payload)} bytes exceeds the {MAX_PAYLOAD_LENGTH}-byte maximum")

    @classmethod
    def request(cls, opcode: int, payload: bytes = b"", *, tag: int = 0) -> CCIMessage:
        """A request message: return code and vendor status are zero, as the specification asks."""
        return cls(category=MessageCategory.REQUEST, tag=tag, opcode=opcode, payload=payload)

    def response(
        self,
        return_code: int = 0,
        payload: bytes = b"",
        *,
        background_operation: bool = False,
        vendor_specific_status: int = 0,
    ) -> CCIMessage:
        """The response to this request: same tag and opcode, so the requester can match it."""
        return CCIMessage(
            category=MessageCategory.RESPONSE,
            tag=self.tag,
            opcode=self.opcode,
            payload=payload,
            background_operation=background_operation,
            return_code=return_code,
            vendor_specific_status=vendor_specific_status,
        )


def encode_message(message: CCIMessage) -> bytes:
    """The CCI message as bytes: the 12-byte header, then the payload."""
    w = Writer()
    w.u8(int(message.category), "message category")
    w.u8(message.tag, "message tag")
    w.reserved(1)
    w.u16(message.opcode, "command opcode")
    length_field = len(message.payload) | (_BACKGROUND_OPERATION_BIT if message.background_operation else 0)
    w.uint(length_field, 3, "message payload length")
    w.u16(message.return_code, "return code")
    w.u16(message.vendor_specific_status, "vendor specific extended status")
    return w.getvalue() + message.payload


def decode_message(data: bytes) -> CCIMessage:
    """Parses one whole CCI message; a short, long or inconsistent one is a `CCIFormatError`."""
    r = Reader(data, "CCI message")
    category_byte = r.u8("message category")
    tag = r.u8("message tag")
    r.reserved(1)
    opcode = r.u16("command opcode")
    length_field = r.uint(3, "message payload length")
    return_code = r.u16("return code")
    vendor_status = r.u16("vendor specific extended status")
    raw_category = category_byte & _CATEGORY_MASK
    try:
        category = MessageCategory(raw_category)
    except ValueError:
        raise CCIFormatError(f"CCI message: unknown message category {raw_category:#x}") from None
    payload_length = length_field & _PAYLOAD_LENGTH_MASK
    if r.remaining() != payload_length:
        raise CCIFormatError(
            f"CCI message: header declares a {payload_length}-byte payload, but {r.remaining()} bytes follow"
        )
    payload = r.raw(payload_length, "message payload")
    return CCIMessage(
        category=category,
        tag=tag,
        opcode=opcode,
        payload=payload,
        background_operation=bool(length_field & _BACKGROUND_OPERATION_BIT),
        return_code=return_code,
        vendor_specific_status=vendor_status,
    )


def encode_frame(message: CCIMessage) -> bytes:
    """The CCI message as it goes on a stream: its 4-byte little-endian length, then the message."""
    body = encode_message(message)
    return len(body).to_bytes(FRAME_PREFIX_SIZE, "little") + body


class FrameDecoder:
    """Splits a byte stream into CCI messages, whatever the chunking of the reads.

    Feed it what the socket returns; it hands back every message completed so far and keeps the rest. A length
    below the header size or above `max_message_size` is a `CCIFormatError` at once, before any body is
    buffered, so a peer cannot make the reader wait for (or allocate) a frame that can never be valid.
    """

    def __init__(self, max_message_size: int = HEADER_SIZE + MAX_PAYLOAD_LENGTH) -> None:
        if max_message_size < HEADER_SIZE:
            raise ValueError(f"max_message_size must be at least {HEADER_SIZE}")
        self._max = max_message_size
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[CCIMessage]:
        self._buf += data
        messages: list[CCIMessage] = []
        while len(self._buf) >= FRAME_PREFIX_SIZE:
            size = int.from_bytes(self._buf[:FRAME_PREFIX_SIZE], "little")
            if size < HEADER_SIZE:
                raise CCIFormatError(f"frame: length {size} is shorter than the {HEADER_SIZE}-byte CCI header")
            if size > self._max:
                raise CCIFormatError(f"frame: length {size} exceeds the {self._max}-byte maximum")
            end = FRAME_PREFIX_SIZE + size
            if len(self._buf) < end:
                break
            body = bytes(self._buf[FRAME_PREFIX_SIZE:end])
            del self._buf[:end]
            messages.append(decode_message(body))
        return messages

    @property
    def pending(self) -> int:
        """Bytes received that do not yet make a whole frame."""
        return len(self._buf)

    def close(self) -> None:
        """Called at end of stream: a partial frame left over means the peer's last message was truncated."""
        if self._buf:
            raise CCIFormatError(f"frame: stream ended inside a frame ({len(self._buf)} bytes left over)")
