"""Physical Switch command set (51h): identify the switch, read port state, control a port (CXL r3.1 7.6.7.1)."""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.fmapi._base import EmptyPayload
from disagg_cxl_switch.fmapi._bitmask import read_bitmask, write_bitmask
from disagg_cxl_switch.fmapi.opcodes import Opcode

_BITMASK_SIZE = 32  # 256 ports / 256 VCSs, one bit each
IDENTIFY_SWITCH_DEVICE_RESPONSE_SIZE = 0x49
PORT_INFO_SIZE = 16


class PortConfigurationState(IntEnum):
    """Current Port Configuration State, bits[3:0] of byte 1 of a port information block."""

    DISABLED = 0x0
    BIND_IN_PROGRESS = 0x1
    UNBIND_IN_PROGRESS = 0x2
    DSP = 0x3
    USP = 0x4
    FABRIC_PORT = 0x5
    INVALID_PORT_ID = 0xF


class PortOpcode(IntEnum):
    """The Port Opcode of Physical Port Control."""

    ASSERT_PERST = 0x00
    DEASSERT_PERST = 0x01
    RESET_PPB = 0x02


@attrs.frozen
class IdentifySwitchDeviceRequest(EmptyPayload):
    """Identify Switch Device takes no input payload."""

    OPCODE: ClassVar[Opcode] = Opcode.IDENTIFY_SWITCH_DEVICE


@attrs.frozen
class IdentifySwitchDeviceResponse:
    """The switch's shape: ports, VCSs, vPPBs and which of them are active (49h bytes).

    The two bitmasks are 32 bytes each; bit n (byte n // 8, bit n % 8) is set when port or VCS n is active. They
    are kept as sets of ids, which is what a fabric manager asks of them.
    """

    OPCODE: ClassVar[Opcode] = Opcode.IDENTIFY_SWITCH_DEVICE

    ingress_port_id: int
    number_of_physical_ports: int
    number_of_vcss: int
    active_port_ids: frozenset[int]
    active_vcs_ids: frozenset[int]
    total_number_of_vppbs: int
    number_of_bound_vppbs: int
    number_of_hdm_decoders: int

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.ingress_port_id, "ingress port id")
        w.reserved(1)
        w.u8(self.number_of_physical_ports, "number of physical ports")
        w.u8(self.number_of_vcss, "number of VCSs")
        write_bitmask(w, self.active_port_ids, _BITMASK_SIZE, "active port bitmask")
        write_bitmask(w, self.active_vcs_ids, _BITMASK_SIZE, "active VCS bitmask")
        w.u16(self.total_number_of_vppbs, "total number of vPPBs")
        w.u16(self.number_of_bound_vppbs, "number of bound vPPBs")
        w.u8(self.number_of_hdm_decoders, "number of HDM decoders")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        ingress = r.u8("ingress port id")
        r.reserved(1)
        ports = r.u8("number of physical ports")
        vcss = r.u8("number of VCSs")
        active_ports = read_bitmask(r, _BITMASK_SIZE, "active port bitmask")
        active_vcss = read_bitmask(r, _BITMASK_SIZE, "active VCS bitmask")
        total = r.u16("total number of vPPBs")
        bound = r.u16("number of bound vPPBs")
        decoders = r.u8("number of HDM decoders")
        r.end()
        return cls(ingress, ports, vcss, active_ports, active_vcss, total, bound, decoders)


@attrs.frozen
class GetPhysicalPortStateRequest:
    """The ports to report on: a count, then one byte per port id."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_PHYSICAL_PORT_STATE

    port_ids: tuple[int, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(len(self.port_ids), "number of ports")
        for port_id in self.port_ids:
            w.u8(port_id, "port id")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        count = r.u8("number of ports")
        r.expect_records(count, 1, "number of ports")
        return cls(tuple(r.u8("port id") for _ in range(count)))


@attrs.frozen
class PortInfo:
    """One 16-byte port information block of Get Physical Port State.

    Bitfields are kept as the raw bytes the table defines (for example `connected_device_cxl_version` is a
    bitmask of CXL versions, `link_state_flags` a 16-bit set of flags), since their meaning belongs to the
    emulator and the driver, not to the wire layer. Byte 3 is reserved.
    """

    port_id: int
    current_port_configuration_state: int
    connected_device_cxl_version: int
    connected_device_type: int
    supported_cxl_modes: int
    maximum_link_width: int
    negotiated_link_width: int
    supported_link_speeds_vector: int
    max_link_speed: int
    current_link_speed: int
    ltssm_state: int
    first_negotiated_lane_number: int
    link_state_flags: int
    supported_ld_count: int

    def write(self, w: Writer) -> None:
        w.u8(self.port_id, "port id")
        w.u8(self.current_port_configuration_state, "current port configuration state")
        w.u8(self.connected_device_cxl_version, "connected device CXL version")
        w.reserved(1)
        w.u8(self.connected_device_type, "connected device type")
        w.u8(self.supported_cxl_modes, "supported CXL modes")
        w.u8(self.maximum_link_width, "maximum link width")
        w.u8(self.negotiated_link_width, "negotiated link width")
        w.u8(self.supported_link_speeds_vector, "supported link speeds vector")
        w.u8(self.max_link_speed, "max link speed")
        w.u8(self.current_link_speed, "current link speed")
        w.u8(self.ltssm_state, "LTSSM state")
        w.u8(self.first_negotiated_lane_number, "first negotiated lane number")
        w.u16(self.link_state_flags, "link state flags")
        w.u8(self.supported_ld_count, "supported LD count")

    @classmethod
    def read(cls, r: Reader) -> PortInfo:
        port_id = r.u8("port id")
        state = r.u8("current port configuration state")
        version = r.u8("connected device CXL version")
        r.reserved(1)
        return cls(
            port_id,
            state,
            version,
            r.u8("connected device type"),
            r.u8("supported CXL modes"),
            r.u8("maximum link width"),
            r.u8("negotiated link width"),
            r.u8("supported link speeds vector"),
            r.u8("max link speed"),
            r.u8("current link speed"),
            r.u8("LTSSM state"),
            r.u8("first negotiated lane number"),
            r.u16("link state flags"),
            r.u8("supported LD count"),
        )


@attrs.frozen
class GetPhysicalPortStateResponse:
    """A count, three reserved bytes, then one 16-byte `PortInfo` block per port."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_PHYSICAL_PORT_STATE

    ports: tuple[PortInfo, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(len(self.ports), "number of ports")
        w.reserved(3)
        for port in self.ports:
            port.write(w)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        count = r.u8("number of ports")
        r.reserved(3)
        r.expect_records(count, PORT_INFO_SIZE, "number of ports")
        return cls(tuple(PortInfo.read(r) for _ in range(count)))


@attrs.frozen
class PhysicalPortControlRequest:
    """Assert or deassert PERST on a port, or reset its PPB: PPB id, then the port opcode (2 bytes)."""

    OPCODE: ClassVar[Opcode] = Opcode.PHYSICAL_PORT_CONTROL

    ppb_id: int
    port_opcode: int

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.ppb_id, "PPB id")
        w.u8(self.port_opcode, "port opcode")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        ppb_id = r.u8("PPB id")
        port_opcode = r.u8("port opcode")
        r.end()
        return cls(ppb_id, port_opcode)


@attrs.frozen
class PhysicalPortControlResponse(EmptyPayload):
    """Physical Port Control returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.PHYSICAL_PORT_CONTROL


__all__ = [
    "IDENTIFY_SWITCH_DEVICE_RESPONSE_SIZE",
    "PORT_INFO_SIZE",
    "GetPhysicalPortStateRequest",
    "GetPhysicalPortStateResponse",
    "IdentifySwitchDeviceRequest",
    "IdentifySwitchDeviceResponse",
    "PhysicalPortControlRequest",
    "PhysicalPortControlResponse",
    "PortConfigurationState",
    "PortInfo",
    "PortOpcode",
]
