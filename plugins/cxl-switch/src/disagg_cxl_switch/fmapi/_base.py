"""What every FM API payload class shares: its opcode, and the empty payload of commands that carry none (also
used by the generic and vendor commands the emulator answers)."""

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
class NoPayload:
    """A command payload that is empty; any byte in it is malformed (Invalid Payload Length). A subclass names
    its opcode: an FM API one (`EmptyPayload`), a generic one or a vendor one."""

    def encode(self) -> bytes:
        return b""

    @classmethod
    def decode(cls, data: bytes) -> Self:
        Reader(data, cls.__name__).end()
        return cls()


@attrs.frozen
class EmptyPayload(NoPayload):
    """An FM API payload the specification leaves empty."""

    OPCODE: ClassVar[Opcode]
