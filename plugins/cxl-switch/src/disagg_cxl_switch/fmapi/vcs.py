"""Virtual Switch command set (52h): read VCSs and their vPPBs, bind and unbind vPPBs (CXL r3.1 7.6.7.2)."""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar, Self

import attrs

from disagg_cxl_switch._wire import Reader, Writer
from disagg_cxl_switch.fmapi._base import EmptyPayload
from disagg_cxl_switch.fmapi.opcodes import Opcode

VPPB_INFO_SIZE = 4
VCS_INFO_HEADER_SIZE = 4
LD_ID_NOT_MLD = 0xFFFF
"""The LD ID of Bind vPPB when the physical port is not connected to an MLD."""


class VCSState(IntEnum):
    """VCS State, byte 1 of a VCS information block."""

    DISABLED = 0x00
    ENABLED = 0x01
    INVALID_VCS_ID = 0xFF


class VPPBBindingStatus(IntEnum):
    """vPPB Binding Status, byte 0 of a vPPB entry."""

    UNBOUND = 0x00
    BIND_OR_UNBIND_IN_PROGRESS = 0x01
    BOUND_PHYSICAL_PORT = 0x02
    BOUND_LD = 0x03


class UnbindOption(IntEnum):
    """Unbind Option, bits[3:0] of byte 2 of Unbind vPPB."""

    WAIT_FOR_LINK_DOWN = 0x0
    MANAGED_HOT_REMOVE = 0x1
    SURPRISE_HOT_REMOVE = 0x2


@attrs.frozen
class GetVirtualCxlSwitchInfoRequest:
    """Which VCSs to report, and which window of their vPPBs: start vPPB, vPPB list limit, count, VCS ids."""

    OPCODE: ClassVar[Opcode] = Opcode.GET_VIRTUAL_CXL_SWITCH_INFO

    start_vppb: int
    vppb_list_limit: int
    vcs_ids: tuple[int, ...]

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.start_vppb, "start vPPB")
        w.u8(self.vppb_list_limit, "vPPB list limit")
        w.u8(len(self.vcs_ids), "number of VCSs")
        for vcs_id in self.vcs_ids:
            w.u8(vcs_id, "VCS id")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        start = r.u8("start vPPB")
        limit = r.u8("vPPB list limit")
        count = r.u8("number of VCSs")
        r.expect_records(count, 1, "number of VCSs")
        return cls(start, limit, tuple(r.u8("VCS id") for _ in range(count)))


@attrs.frozen
class VPPBInfo:
    """One 4-byte vPPB entry: binding status, bound port id, bound LD id, one reserved byte.

    The bound LD id is one byte here (FFh when not bound to an LD), unlike the 2-byte LD ID of Bind vPPB.
    """

    binding_status: int
    bound_port_id: int
    bound_ld_id: int

    def write(self, w: Writer) -> None:
        w.u8(self.binding_status, "vPPB binding status")
        w.u8(self.bound_port_id, "vPPB bound port id")
        w.u8(self.bound_ld_id, "vPPB bound LD id")
        w.reserved(1)

    @classmethod
    def read(cls, r: Reader) -> VPPBInfo:
        status = r.u8("vPPB binding status")
        port = r.u8("vPPB bound port id")
        ld = r.u8("vPPB bound LD id")
        r.reserved(1)
        return cls(status, port, ld)


def vppb_entries_returned(number_of_vppbs: int, start_vppb: int, vppb_list_limit: int) -> int:
    """How many vPPB entries a VCS block carries: those from `start_vppb`, at most `vppb_list_limit` of them."""
    return max(0, min(vppb_list_limit, number_of_vppbs - start_vppb))


@attrs.frozen
class VCSInfo:
    """One VCS information block: VCS id, state, USP id, number of vPPBs, then the returned vPPB entries.

    `number_of_vppbs` is the VCS's total, not the number of entries that follow: the entries are the window
    [start vPPB, start vPPB + vPPB list limit) of the request, cut at the total. The block therefore does not
    say its own length, and decoding it needs the request's start vPPB and limit.
    """

    vcs_id: int
    vcs_state: int
    usp_id: int
    number_of_vppbs: int
    vppbs: tuple[VPPBInfo, ...]

    def write(self, w: Writer) -> None:
        w.u8(self.vcs_id, "VCS id")
        w.u8(self.vcs_state, "VCS state")
        w.u8(self.usp_id, "USP id")
        w.u8(self.number_of_vppbs, "number of vPPBs")
        for vppb in self.vppbs:
            vppb.write(w)

    @classmethod
    def read(cls, r: Reader, start_vppb: int, vppb_list_limit: int) -> VCSInfo:
        vcs_id = r.u8("VCS id")
        state = r.u8("VCS state")
        usp_id = r.u8("USP id")
        total = r.u8("number of vPPBs")
        count = vppb_entries_returned(total, start_vppb, vppb_list_limit)
        return cls(vcs_id, state, usp_id, total, tuple(VPPBInfo.read(r) for _ in range(count)))


@attrs.frozen
class GetVirtualCxlSwitchInfoResponse:
    """A count of VCSs, three reserved bytes, then one variable-length `VCSInfo` block per VCS.

    `decode` takes the request's `start_vppb` and `vppb_list_limit` (see `VCSInfo`); their defaults, 0 and FFh,
    fit a request for every vPPB. `encode` checks each block against the same window, so that what is sent can
    be decoded by a requester that knows its own request.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GET_VIRTUAL_CXL_SWITCH_INFO

    vcss: tuple[VCSInfo, ...]

    def encode(self, start_vppb: int = 0, vppb_list_limit: int = 0xFF) -> bytes:
        w = Writer()
        w.u8(len(self.vcss), "number of VCSs")
        w.reserved(3)
        for vcs in self.vcss:
            want = vppb_entries_returned(vcs.number_of_vppbs, start_vppb, vppb_list_limit)
            if len(vcs.vppbs) != want:
                raise ValueError(
                    f"VCS {vcs.vcs_id}: {len(vcs.vppbs)} vPPB entries, but a VCS of {vcs.number_of_vppbs} vPPBs "
                    f"returns {want} for start vPPB {start_vppb} and limit {vppb_list_limit}"
                )
            vcs.write(w)
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes, start_vppb: int = 0, vppb_list_limit: int = 0xFF) -> Self:
        r = Reader(data, cls.__name__)
        count = r.u8("number of VCSs")
        r.reserved(3)
        vcss = tuple(VCSInfo.read(r, start_vppb, vppb_list_limit) for _ in range(count))
        r.end()
        return cls(vcss)


@attrs.frozen
class BindVPPBRequest:
    """Bind a vPPB of a VCS to a physical port, or to one LD of the MLD behind it (6 bytes).

    VCS id, vPPB id, physical port id, one reserved byte, then the 2-byte LD ID (FFFFh when the port does not
    lead to an MLD). The switch may answer Background Command Started and finish the bind later.
    """

    OPCODE: ClassVar[Opcode] = Opcode.BIND_VPPB

    vcs_id: int
    vppb_id: int
    physical_port_id: int
    ld_id: int = LD_ID_NOT_MLD

    def encode(self) -> bytes:
        w = Writer()
        w.u8(self.vcs_id, "VCS id")
        w.u8(self.vppb_id, "vPPB id")
        w.u8(self.physical_port_id, "physical port id")
        w.reserved(1)
        w.u16(self.ld_id, "LD id")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        vcs_id = r.u8("VCS id")
        vppb_id = r.u8("vPPB id")
        port = r.u8("physical port id")
        r.reserved(1)
        ld_id = r.u16("LD id")
        r.end()
        return cls(vcs_id, vppb_id, port, ld_id)


@attrs.frozen
class BindVPPBResponse(EmptyPayload):
    """Bind vPPB returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.BIND_VPPB


@attrs.frozen
class UnbindVPPBRequest:
    """Unbind a vPPB: VCS id, vPPB id, then the unbind option in bits[3:0] of byte 2 (bits[7:4] reserved)."""

    OPCODE: ClassVar[Opcode] = Opcode.UNBIND_VPPB

    vcs_id: int
    vppb_id: int
    unbind_option: int = UnbindOption.WAIT_FOR_LINK_DOWN

    def encode(self) -> bytes:
        if not 0 <= self.unbind_option <= 0xF:
            raise ValueError(f"unbind option={self.unbind_option} does not fit in 4 bits")
        w = Writer()
        w.u8(self.vcs_id, "VCS id")
        w.u8(self.vppb_id, "vPPB id")
        w.u8(self.unbind_option, "unbind option")
        return w.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> Self:
        r = Reader(data, cls.__name__)
        vcs_id = r.u8("VCS id")
        vppb_id = r.u8("vPPB id")
        option = r.u8("unbind option") & 0x0F
        r.end()
        return cls(vcs_id, vppb_id, option)


@attrs.frozen
class UnbindVPPBResponse(EmptyPayload):
    """Unbind vPPB returns no output payload."""

    OPCODE: ClassVar[Opcode] = Opcode.UNBIND_VPPB


__all__ = [
    "LD_ID_NOT_MLD",
    "BindVPPBRequest",
    "BindVPPBResponse",
    "GetVirtualCxlSwitchInfoRequest",
    "GetVirtualCxlSwitchInfoResponse",
    "UnbindOption",
    "UnbindVPPBRequest",
    "UnbindVPPBResponse",
    "VCSInfo",
    "VCSState",
    "VPPBBindingStatus",
    "VPPBInfo",
    "vppb_entries_returned",
]
