"""MLD Port (53h) and MLD Component (54h) command sets: tunnelling to an LD, and carving an MLD into LDs.

CXL r3.1 7.6.7.3 (Tunnel Management Command) and 7.6.7.4 (Get LD Info, Get/Set LD Allocations).
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.cci import CCIMessage, decode_message, encode_message
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.fmapi._base import EmptyPayload
from disagg_cxl_switch.fmapi.opcodes import Opcode

GET_LD_INFO_RESPONSE_SIZE = 11
LD_ALLOCATION_SIZE = 16


class TunnelTargetType(IntEnum):
    """Target Type of Tunnel Management Command; the other values are reserved."""

    PORT_OR_LD_BASED = 0x00


class MemoryGranularity(IntEnum):
    """Memory Granularity of the LD allocations: the unit of the range allocation multipliers."""

    GRANULARITY_256_MIB = 0x0
    GRANULARITY_512_MIB = 0x1
    GRANULARITY_1_GIB = 0x2

    @property
    def unit_bytes(self) -> int:
        return (256 << 20) << self.value


def _read_embedded(r: Reader, size: int, field: str) -> CCIMessage:
    body = r.raw(size, field)
    try:
        return decode_message(body)
    except CCIFormatError as exc:
        raise CCIFormatError(f"{field}: {exc}") from exc


@attrs.frozen
class TunnelManagementCommandRequest:
    """A CCI request to forward to an MLD (or an LD behind it): port or LD id, target type, size, the message.

    Byte 0 is the port id when the switch is the target, or the LD id when an MLD port is; `command_size` is
    implied by the embedded message and checked against it on decode.
    """

    OPCODE: ClassVar[Opcode] = Opcode.TUNNEL_MANAGEMENT_COMMAND

    port_or_ld_id: int
    command: CCIMessage
    target_type: int = TunnelTargetType.PORT_OR_LD_BASED

    def encode(self) -> bytes:
        body = encode_message(self.command)
        w = Writer()
        w.u8(self.port_or_ld_id, "port or LD id")
        w.u8(self.target_type, "target type")
        w.u16(len(body), "command size")
        return w.getvalue() + body

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        target_id = r.u8("port or LD id")
        target_type = r.u8("target type")
        size = r.u16("command size")
        r.expect_records(size, 1, "command size")
        return cls(target_id, _read_embedded(r, size, "tunnelled command"), target_type)


@attrs.frozen
class TunnelManagementCommandResponse:
    """The tunnelled response: its 2-byte length, two reserved bytes, then the embedded CCI response message."""

    OPCODE: ClassVar[Opcode] = Opcode.TUNNEL_MANAGEMENT_COMMAND

    response: CCIMessage

    def encode(self) -> bytes:
        body = encode_message(self.response)
        w = Writer()
        w.u16(len(body), "response length")
        w.reserved(2)
        return w.getvalue() + body

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        size = r.u16("response length")
        r.reserved(2)
        r.expect_records(size, 1, "response length")
        return cls(_read_embedded(r, size, "tunnelled response"))


@attrs.frozen
class GetLDInfoRequest(EmptyPayload):
    """Get LD Info takes no input payload."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_LD_INFO


@attrs.frozen
class GetLDInfoResponse:
    """An MLD's capacity and LD count: memory size (8 bytes), LD count (2), QoS telemetry capability (1)."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_LD_INFO

    memory_size: int
    ld_count: int
    qos_telemetry_capability: int

    def encode(self) -> bytes:
        w = Writer()
        w.u64(self.memory_size, "memory size")
        w.u16(self.ld_count, "LD count")
        w.u8(self.qos_telemetry_capability, "QoS telemetry capability")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        size = r.u64("memory size")
        count = r.u16("LD count")
        qos = r.u8("QoS telemetry capability")
        r.end()
        return cls(size, count, qos)


@attrs.frozen
class LDAllocation:
    """One LD's share of the MLD: range 1 and range 2 allocation multipliers, 8 bytes each, in granularity units."""

    range_1_allocation_multiplier: int
    range_2_allocation_multiplier: int

    def write(self, w: Writer) -> None:
        w.u64(self.range_1_allocation_multiplier, "range 1 allocation multiplier")
        w.u64(self.range_2_allocation_multiplier, "range 2 allocation multiplier")

    @classmethod
    def read(cls, r: Reader) -> LDAllocation:
        return cls(r.u64("range 1 allocation multiplier"), r.u64("range 2 allocation multiplier"))


def _write_allocations(w: Writer, allocations: tuple[LDAllocation, ...]) -> None:
    for allocation in allocations:
        allocation.write(w)


def _read_allocations(r: Reader, count: int, field: str) -> tuple[LDAllocation, ...]:
    r.expect_records(count, LD_ALLOCATION_SIZE, field)
    return tuple(LDAllocation.read(r) for _ in range(count))


@attrs.frozen
class GetLDAllocationsRequest:
    """Which LDs to report: start LD id, LD allocation list limit (the r3.0+ form of the request)."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_LD_ALLOCATIONS

    start_ld_id: int = 0
    ld_allocation_list_limit: int = 0xFF

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.start_ld_id, "start LD id")
        w.u8(self.ld_allocation_list_limit, "LD allocation list limit")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        start = r.u8("start LD id")
        limit = r.u8("LD allocation list limit")
        r.end()
        return cls(start, limit)


@attrs.frozen
class GetLDAllocationsResponse:
    """Number of LDs, memory granularity, start LD id, list length, then one 16-byte `LDAllocation` per entry.

    `number_of_lds` is the MLD's total; the list holds the entries from `start_ld_id` on, and its own length
    byte says how many, so the response decodes without the request.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GET_LD_ALLOCATIONS

    number_of_lds: int
    memory_granularity: int
    start_ld_id: int
    allocations: tuple[LDAllocation, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.number_of_lds, "number of LDs")
        w.u8(self.memory_granularity, "memory granularity")
        w.u8(self.start_ld_id, "start LD id")
        w.u8(len(self.allocations), "LD allocation list length")
        _write_allocations(w, self.allocations)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        number = r.u8("number of LDs")
        granularity = r.u8("memory granularity")
        start = r.u8("start LD id")
        length = r.u8("LD allocation list length")
        return cls(number, granularity, start, _read_allocations(r, length, "LD allocation list length"))


@attrs.frozen
class SetLDAllocations:
    """Set LD Allocations request, and its response of the same form: number of LDs, start LD id, two
    reserved bytes, then one `LDAllocation` per LD. The response reports the allocations actually applied.
    """

    OPCODE: ClassVar[Opcode] = Opcode.SET_LD_ALLOCATIONS

    start_ld_id: int
    allocations: tuple[LDAllocation, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(len(self.allocations), "number of LDs")
        w.u8(self.start_ld_id, "start LD id")
        w.reserved(2)
        _write_allocations(w, self.allocations)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        number = r.u8("number of LDs")
        start = r.u8("start LD id")
        r.reserved(2)
        return cls(start, _read_allocations(r, number, "number of LDs"))


@attrs.frozen
class SetLDAllocationsRequest(SetLDAllocations):
    """The allocations to apply."""


@attrs.frozen
class SetLDAllocationsResponse(SetLDAllocations):
    """The allocations applied."""


__all__ = [
    "GET_LD_INFO_RESPONSE_SIZE",
    "LD_ALLOCATION_SIZE",
    "GetLDAllocationsRequest",
    "GetLDAllocationsResponse",
    "GetLDInfoRequest",
    "GetLDInfoResponse",
    "LDAllocation",
    "MemoryGranularity",
    "SetLDAllocationsRequest",
    "SetLDAllocationsResponse",
    "TunnelManagementCommandRequest",
    "TunnelManagementCommandResponse",
    "TunnelTargetType",
]
