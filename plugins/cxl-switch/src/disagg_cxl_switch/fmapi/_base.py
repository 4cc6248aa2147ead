"""What every FM API payload class shares: its opcode, and the empty payload of commands that carry none."""

from __future__ import annotations

from typing import ClassVar, Protocol, Self

import attrs

from disagg_cxl_switch._wire import Reader
from disagg_cxl_switch.fmapi.opcodes import Opcode


class Payload(Protocol):
    """A request or response payload of one FM API command, encoded exactly as its table in the specification."""

    OPCODE: ClassVar[Opcode]

    def encode(self) -> bytes: ...

    @classmethod
    def decode(cls, data: bytes) -> Self: ...


@attrs.frozen
class EmptyPayload:
    """A payload the specification leaves empty; any byte in it is malformed (Invalid Payload Length)."""

    OPCODE: ClassVar[Opcode]

    def encode(self) -> bytes:
        return b""

    @classmethod
    def decode(cls, data: bytes) -> Self:
        Reader(data, cls.__name__).end()
        return cls()
