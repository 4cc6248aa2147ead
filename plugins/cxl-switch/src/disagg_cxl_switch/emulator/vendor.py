"""Vendor-specific commands of the emulator (C000h-C005h, C0FFh): event records, fault injection, reset.

Event records use a vendor opcode rather than the generic Get Event Records (0100h): the generic command
carries 128-byte records typed by UUID, of which the events here (hot-plug, surprise removal, link down, a
poisoned extent) would each need a made-up layout anyway. An 8-byte record that says exactly what happened is
simpler to read and does not pretend to conform. Fault injection has no counterpart in the specification.
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.emulator.events import EventRecord, EventType
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.fmapi._base import NoPayload

EVENT_RECORD_SIZE = 8


class VendorOpcode(IntEnum):
    """The emulator's vendor-specific commands."""

    GET_EVENT_RECORDS = 0xC000
    INJECT_LINK_DOWN = 0xC001
    INJECT_SURPRISE_REMOVAL = 0xC002
    INJECT_BIND_FAILURE = 0xC003
    INJECT_EXTENT_POISON = 0xC004
    INJECT_HOT_ADD = 0xC005
    RESET = 0xC0FF


class HotAddDeviceKind(IntEnum):
    """Device Kind byte of Inject Hot-Add: what appears behind the port."""

    GPU = 0x00
    NVME = 0x01
    NIC = 0x02


@attrs.frozen
class GetEventRecordsRequest:
    """First sequence number wanted (4), maximum number of records to return (1)."""

    OPCODE: ClassVar[int] = VendorOpcode.GET_EVENT_RECORDS

    first_sequence: int = 0
    max_records: int = 0xFF

    def encode(self) -> bytes:
        w = Writer()
        w.u32(self.first_sequence, "first sequence number")
        w.u8(self.max_records, "maximum records")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        first = r.u32("first sequence number")
        limit = r.u8("maximum records")
        r.end()
        return cls(first, limit)


@attrs.frozen
class GetEventRecordsResponse:
    """Records returned (1), 3 reserved, oldest sequence number held (4), next sequence number (4), then one
    8-byte record each: sequence number (4), event type (1), port id (1), host id (1), 1 reserved (FFh ids:
    none). A reader that asked from a sequence below the oldest held has missed records."""

    OPCODE: ClassVar[int] = VendorOpcode.GET_EVENT_RECORDS

    oldest_sequence: int
    next_sequence: int
    records: tuple[EventRecord, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(len(self.records), "records returned")
        w.reserved(3)
        w.u32(self.oldest_sequence, "oldest sequence number")
        w.u32(self.next_sequence, "next sequence number")
        for record in self.records:
            w.u32(record.sequence, "sequence number")
            w.u8(record.event_type, "event type")
            w.u8(record.port_id, "port id")
            w.u8(record.host_id, "host id")
            w.reserved(1)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        count = r.u8("records returned")
        r.reserved(3)
        oldest = r.u32("oldest sequence number")
        following = r.u32("next sequence number")
        r.expect_records(count, EVENT_RECORD_SIZE, "records returned")
        records = []
        for _ in range(count):
            sequence = r.u32("sequence number")
            raw_type = r.u8("event type")
            try:
                event_type = EventType(raw_type)
            except ValueError:
                raise CCIFormatError(f"{cls.__name__}: unknown event type {raw_type:#x}") from None
            port_id = r.u8("port id")
            host_id = r.u8("host id")
            r.reserved(1)
            records.append(EventRecord(sequence, event_type, port_id, host_id))
        return cls(oldest, following, tuple(records))


@attrs.frozen
class PortFaultRequest:
    """The physical port id (1) a port fault applies to."""

    OPCODE: ClassVar[int]

    port_id: int

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.port_id, "port id")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        port_id = r.u8("port id")
        r.end()
        return cls(port_id)


@attrs.frozen
class InjectLinkDownRequest(PortFaultRequest):
    """Take the port's link down (LTSSM to Detect) until Physical Port Control resets the PPB."""

    OPCODE: ClassVar[int] = VendorOpcode.INJECT_LINK_DOWN


@attrs.frozen
class InjectSurpriseRemovalRequest(PortFaultRequest):
    """Pull the device from a downstream port without warning; a vPPB bound to it stays bound."""

    OPCODE: ClassVar[int] = VendorOpcode.INJECT_SURPRISE_REMOVAL


@attrs.frozen
class InjectHotAddRequest:
    """Plug a device into an empty downstream port: port id (1), device kind (1, `HotAddDeviceKind`)."""

    OPCODE: ClassVar[int] = VendorOpcode.INJECT_HOT_ADD

    port_id: int
    device_kind: int

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.port_id, "port id")
        w.u8(self.device_kind, "device kind")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        port_id = r.u8("port id")
        kind = r.u8("device kind")
        r.end()
        return cls(port_id, kind)


@attrs.frozen
class InjectBindFailureRequest(NoPayload):
    """Make the next Bind vPPB fail when its background operation completes (Internal Error); a Bind vPPB refused
    at once (Invalid Input, Busy) spends it too. No payload."""

    OPCODE: ClassVar[int] = VendorOpcode.INJECT_BIND_FAILURE


@attrs.frozen
class ResetRequest(NoPayload):
    """Put the switch back to the topology it started with: state, event log, background operation, armed
    faults. A test hook, so that one process serves many tests. No payload."""

    OPCODE: ClassVar[int] = VendorOpcode.RESET


@attrs.frozen
class InjectExtentPoisonRequest:
    """Poison the host's extent containing a DPA: host id (2), 2 reserved, DPA (8)."""

    OPCODE: ClassVar[int] = VendorOpcode.INJECT_EXTENT_POISON

    host_id: int
    dpa: int

    def encode(self) -> bytes:
        w = Writer()
        w.u16(self.host_id, "host id")
        w.reserved(2)
        w.u64(self.dpa, "DPA")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        host_id = r.u16("host id")
        r.reserved(2)
        dpa = r.u64("DPA")
        r.end()
        return cls(host_id, dpa)
