"""FM API command opcodes: the high byte is the command set, the low byte the command within it."""

from __future__ import annotations

from enum import IntEnum


class Opcode(IntEnum):
    """The FM API commands this package encodes (CXL r3.1 section 7.6.7)."""

    # Physical Switch command set (51h)
    IDENTIFY_SWITCH_DEVICE = 0x5100
    GET_PHYSICAL_PORT_STATE = 0x5101
    PHYSICAL_PORT_CONTROL = 0x5102
    # Virtual Switch command set (52h)
    GET_VIRTUAL_CXL_SWITCH_INFO = 0x5200
    BIND_VPPB = 0x5201
    UNBIND_VPPB = 0x5202
    # MLD Port command set (53h)
    TUNNEL_MANAGEMENT_COMMAND = 0x5300
    # MLD Component command set (54h)
    GET_LD_INFO = 0x5400
    GET_LD_ALLOCATIONS = 0x5401
    SET_LD_ALLOCATIONS = 0x5402
    # DCD Management command set (56h)
    GET_DCD_INFO = 0x5600
    GET_HOST_DC_REGION_CONFIG = 0x5601
    SET_DC_REGION_CONFIG = 0x5602
    GET_DC_REGION_EXTENT_LISTS = 0x5603
    INITIATE_DC_ADD = 0x5604
    INITIATE_DC_RELEASE = 0x5605

    @property
    def command_set(self) -> int:
        return self.value >> 8

    @property
    def command(self) -> int:
        return self.value & 0xFF
