"""Hand-written FM API payloads, one per class, from the specification's tables (offset: width, field).

Built with int.to_bytes and literal bytes only, never with the code under test, so that a layout mistake in the
package cannot hide in the expected bytes. Shared by the layout and the error tests.
"""

from __future__ import annotations

from typing import Any

from disagg_cxl_switch.cci import CCIMessage, MessageCategory
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    BindVPPBResponse,
    DCRegionConfig,
    Extent,
    GetDCDInfoRequest,
    GetDCDInfoResponse,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetLDInfoRequest,
    GetLDInfoResponse,
    GetPhysicalPortStateRequest,
    GetPhysicalPortStateResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    IdentifySwitchDeviceRequest,
    IdentifySwitchDeviceResponse,
    InitiateDCAddRequest,
    InitiateDCAddResponse,
    InitiateDCReleaseRequest,
    InitiateDCReleaseResponse,
    LDAllocation,
    PhysicalPortControlRequest,
    PhysicalPortControlResponse,
    PortInfo,
    SetDCRegionConfigRequest,
    SetDCRegionConfigResponse,
    SetLDAllocationsRequest,
    SetLDAllocationsResponse,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    UnbindVPPBRequest,
    UnbindVPPBResponse,
    VCSInfo,
    VPPBInfo,
)


def le(value: int, width: int) -> bytes:
    return value.to_bytes(width, "little")


RSV1 = b"\x00"
TAG_A = bytes(range(0x10, 0x20))
TAG_B = bytes(range(0xF0, 0x100))

# --- 5100h Identify Switch Device response: 49h bytes --------------------------------------------------------
IDENTIFY = (
    le(0x02, 1)  # 00h: 1 ingress port id
    + RSV1  # 01h: 1 reserved
    + le(0x10, 1)  # 02h: 1 number of physical ports
    + le(0x04, 1)  # 03h: 1 number of VCSs
    + bytes([0b0000_0101, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0b1000_0000] + [0] * 14 + [0x80])  # 04h: 32
    + bytes([0b0000_0011] + [0] * 31)  # 24h: 32 active VCS bitmask
    + le(0x0120, 2)  # 44h: 2 total number of vPPBs
    + le(0x0007, 2)  # 46h: 2 number of bound vPPBs
    + le(0x08, 1)  # 48h: 1 number of HDM decoders
)
assert len(IDENTIFY) == 0x49

# --- 5101h Get Physical Port State ---------------------------------------------------------------------------
PORT_STATE_REQUEST = le(2, 1) + bytes([0x03, 0x07])  # 00h: number of ports, 01h: port id list


def _port_block(port_id: int) -> bytes:
    block = (
        le(port_id, 1)  # 00h port id
        + le(0x03, 1)  # 01h current port configuration state (DSP)
        + le(0x06, 1)  # 02h connected device CXL version
        + RSV1  # 03h reserved
        + le(0x04, 1)  # 04h connected device type
        + le(0x07, 1)  # 05h supported CXL modes
        + le(0x10, 1)  # 06h maximum link width
        + le(0x08, 1)  # 07h negotiated link width
        + le(0x3F, 1)  # 08h supported link speeds vector
        + le(0x06, 1)  # 09h max link speed
        + le(0x05, 1)  # 0Ah current link speed
        + le(0x11, 1)  # 0Bh LTSSM state
        + le(0x00, 1)  # 0Ch first negotiated lane number
        + le(0xBEEF, 2)  # 0Dh link state flags (2 bytes)
        + le(0x10, 1)  # 0Fh supported LD count
    )
    assert len(block) == 16
    return block


def _port_info(port_id: int) -> PortInfo:
    return PortInfo(port_id, 0x03, 0x06, 0x04, 0x07, 0x10, 0x08, 0x3F, 0x06, 0x05, 0x11, 0x00, 0xBEEF, 0x10)


PORT_STATE_RESPONSE = le(2, 1) + bytes(3) + _port_block(3) + _port_block(7)

# --- 5200h Get Virtual CXL Switch Info -----------------------------------------------------------------------
VCS_REQUEST = le(0, 1) + le(0xFF, 1) + le(2, 1) + bytes([0, 1])  # start vPPB, limit, count, VCS ids
VCS_RESPONSE = (
    le(2, 1)  # 00h number of VCSs
    + bytes(3)  # 01h reserved
    # VCS 0: id, state enabled, USP id 1, 2 vPPBs, then 4 bytes per vPPB
    + bytes([0, 0x01, 1, 2])
    + bytes([0x02, 5, 0xFF, 0])  # vPPB 0: bound to physical port 5, LD FFh, reserved
    + bytes([0x00, 0, 0, 0])  # vPPB 1: unbound
    # VCS 1: id 1, disabled, USP id 2, no vPPBs
    + bytes([1, 0x00, 2, 0])
)
VCS_INFO = GetVirtualCxlSwitchInfoResponse(
    (
        VCSInfo(0, 0x01, 1, 2, (VPPBInfo(0x02, 5, 0xFF), VPPBInfo(0x00, 0, 0))),
        VCSInfo(1, 0x00, 2, 0, ()),
    )
)

# --- 5201h Bind vPPB, 5202h Unbind vPPB ----------------------------------------------------------------------
BIND = le(1, 1) + le(3, 1) + le(9, 1) + RSV1 + le(0x0102, 2)  # VCS, vPPB, port, reserved, LD ID (2 bytes)
UNBIND = le(1, 1) + le(3, 1) + le(0x2, 1)  # VCS, vPPB, unbind option (surprise hot-remove)

# --- 5300h Tunnel Management Command -------------------------------------------------------------------------
INNER_REQUEST = bytes([0x00, 0x05, 0x00, 0x00, 0x54, 0x00, 0x00, 0x00, 0, 0, 0, 0])  # Get LD Info, tag 5
TUNNEL_REQUEST = le(4, 1) + le(0, 1) + le(len(INNER_REQUEST), 2) + INNER_REQUEST
INNER_RESPONSE = bytes([0x01, 0x05, 0x00, 0x00, 0x54, 0x01, 0x00, 0x00, 0x03, 0x00, 0, 0]) + b"\x7f"
TUNNEL_RESPONSE = le(len(INNER_RESPONSE), 2) + bytes(2) + INNER_RESPONSE

# --- 5400h Get LD Info, 5401h/5402h LD allocations -----------------------------------------------------------
LD_INFO = le(0x10_0000_0000, 8) + le(16, 2) + le(0x03, 1)  # memory size, LD count, QoS telemetry capability
LD_ALLOC_REQUEST = le(2, 1) + le(4, 1)  # start LD id, LD allocation list limit
LD_ALLOC_RESPONSE = (
    le(16, 1)  # 00h number of LDs
    + le(0x1, 1)  # 01h memory granularity (512 MiB)
    + le(2, 1)  # 02h start LD id
    + le(2, 1)  # 03h LD allocation list length
    + le(4, 8)
    + le(0, 8)  # LD 2: range 1, range 2 allocation multipliers
    + le(1, 8)
    + le(0x0123_4567_89AB_CDEF, 8)  # LD 3
)
SET_LD_ALLOC = le(2, 1) + le(6, 1) + bytes(2) + le(8, 8) + le(0, 8) + le(0, 8) + le(1, 8)  # 2 LDs from 6

# --- 5600h Get DCD Info: 54h bytes ---------------------------------------------------------------------------
DCD_INFO = (
    le(2, 1)  # 00h number of hosts
    + le(2, 1)  # 01h number of supported DC regions
    + bytes(2)  # 02h reserved
    + le(0b0100, 2)  # 04h capacity selection policies supported (prescriptive)
    + bytes(2)  # 06h reserved
    + le(0b0011, 2)  # 08h capacity removal policies supported
    + le(0b01, 1)  # 0Ah sanitize on release configuration support mask
    + RSV1  # 0Bh reserved
    + le(64, 8)  # 0Ch total dynamic capacity, 256 MiB units
    + le(1 << 21, 8)  # 14h region 0 supported block size mask
    + le(1 << 28, 8)  # 1Ch region 1
    + bytes(8 * 6)  # 24h..53h regions 2-7
)
assert len(DCD_INFO) == 0x54

# --- 5601h Get Host DC Region Configuration ------------------------------------------------------------------
HOST_DC_REQUEST = le(0x0102, 2) + le(8, 1) + le(0, 1)  # host id, region count, starting region index
HOST_DC_RESPONSE = (
    le(0x0102, 2)  # 00h host id
    + le(2, 1)  # 02h number of available regions
    + le(1, 1)  # 03h regions returned
    + le(0x1_0000_0000, 8)  # region base
    + le(0x4000_0000, 8)  # region decode length
    + le(0x4000_0000, 8)  # region length
    + le(0x20_0000, 8)  # region block size
    + le(0x08, 1)  # DSMAS flags
    + bytes(3)
    + le(0x01, 1)  # sanitize on release
    + bytes(3)
    + le(512, 4)  # total number of supported extents
    + le(500, 4)  # number of available extents
    + le(0, 4)  # total number of supported tags
    + le(0, 4)  # number of available tags
)
SET_DC_REGION = le(1, 1) + bytes(3) + le(0x20_0000, 8) + le(0x01, 1) + bytes(3)  # region, rsv, block, flags, rsv
assert len(SET_DC_REGION) == 16

# --- 5603h Get DC Region Extent Lists ------------------------------------------------------------------------
EXTENT_LIST_REQUEST = le(1, 2) + bytes(2) + le(10, 4) + le(3, 4)  # host, rsv, extent count, starting index


def _extent(start: int, length: int, tag: bytes, sequence: int) -> bytes:
    raw = le(start, 8) + le(length, 8) + tag + le(sequence, 2) + bytes(6)  # DPA, length, tag, shared seq, rsv
    assert len(raw) == 40
    return raw


EXTENT_LIST_RESPONSE = (
    le(1, 2)  # 00h host id
    + bytes(2)  # 02h reserved
    + le(3, 4)  # 04h starting extent index
    + le(2, 4)  # 08h number of extents returned
    + le(5, 4)  # 0Ch total extents
    + le(0x77, 4)  # 10h extent list generation number
    + bytes(4)  # 14h reserved
    + _extent(0x4000_0000, 0x20_0000, TAG_A, 0)
    + _extent(0x4020_0000, 0x40_0000, TAG_B, 0x0102)
)
EXTENTS = (Extent(0x4000_0000, 0x20_0000, TAG_A, 0), Extent(0x4020_0000, 0x40_0000, TAG_B, 0x0102))

# --- 5604h Initiate DC Add, 5605h Initiate DC Release --------------------------------------------------------
DC_ADD = (
    le(1, 2)  # 00h host id
    + le(0x2, 1)  # 02h selection policy (prescriptive)
    + le(0, 1)  # 03h region number
    + le(0x60_0000, 8)  # 04h length
    + TAG_A  # 0Ch tag
    + le(2, 4)  # 1Ch extent count
    + _extent(0x4000_0000, 0x20_0000, TAG_A, 0)
    + _extent(0x4020_0000, 0x40_0000, TAG_B, 0x0102)
)
DC_RELEASE = (
    le(1, 2)  # 00h host id
    + le(0b0011_0001, 1)  # 02h flags: removal policy 1, forced removal (bit 4), sanitize on release (bit 5)
    + RSV1  # 03h reserved
    + le(0x20_0000, 8)  # 04h length
    + TAG_B  # 0Ch tag
    + le(1, 4)  # 1Ch extent count
    + _extent(0x4000_0000, 0x20_0000, TAG_A, 0)
)

CASES: list[tuple[Any, bytes]] = [
    (IdentifySwitchDeviceRequest(), b""),
    (
        IdentifySwitchDeviceResponse(2, 0x10, 4, frozenset({0, 2, 135, 255}), frozenset({0, 1}), 0x120, 7, 8),
        IDENTIFY,
    ),
    (GetPhysicalPortStateRequest((3, 7)), PORT_STATE_REQUEST),
    (GetPhysicalPortStateResponse((_port_info(3), _port_info(7))), PORT_STATE_RESPONSE),
    (PhysicalPortControlRequest(5, 0x02), bytes([5, 0x02])),
    (PhysicalPortControlResponse(), b""),
    (GetVirtualCxlSwitchInfoRequest(0, 0xFF, (0, 1)), VCS_REQUEST),
    (VCS_INFO, VCS_RESPONSE),
    (BindVPPBRequest(1, 3, 9, 0x0102), BIND),
    (BindVPPBResponse(), b""),
    (UnbindVPPBRequest(1, 3, 0x2), UNBIND),
    (UnbindVPPBResponse(), b""),
    (
        TunnelManagementCommandRequest(4, CCIMessage(MessageCategory.REQUEST, 5, 0x5400)),
        TUNNEL_REQUEST,
    ),
    (
        TunnelManagementCommandResponse(CCIMessage(MessageCategory.RESPONSE, 5, 0x5400, b"\x7f", return_code=0x0003)),
        TUNNEL_RESPONSE,
    ),
    (GetLDInfoRequest(), b""),
    (GetLDInfoResponse(0x10_0000_0000, 16, 0x03), LD_INFO),
    (GetLDAllocationsRequest(2, 4), LD_ALLOC_REQUEST),
    (
        GetLDAllocationsResponse(16, 1, 2, (LDAllocation(4, 0), LDAllocation(1, 0x0123_4567_89AB_CDEF))),
        LD_ALLOC_RESPONSE,
    ),
    (SetLDAllocationsRequest(6, (LDAllocation(8, 0), LDAllocation(0, 1))), SET_LD_ALLOC),
    (SetLDAllocationsResponse(6, (LDAllocation(8, 0), LDAllocation(0, 1))), SET_LD_ALLOC),
    (GetDCDInfoRequest(), b""),
    (GetDCDInfoResponse(2, 0b0100, 0b0011, 0b01, 64, (1 << 21, 1 << 28)), DCD_INFO),
    (GetHostDCRegionConfigRequest(0x0102, 8, 0), HOST_DC_REQUEST),
    (
        GetHostDCRegionConfigResponse(
            0x0102, 2, (DCRegionConfig(0x1_0000_0000, 0x4000_0000, 0x4000_0000, 0x20_0000, 0x08, True),), 512, 500, 0, 0
        ),
        HOST_DC_RESPONSE,
    ),
    (SetDCRegionConfigRequest(1, 0x20_0000, True), SET_DC_REGION),
    (SetDCRegionConfigResponse(), b""),
    (GetDCRegionExtentListsRequest(1, 10, 3), EXTENT_LIST_REQUEST),
    (GetDCRegionExtentListsResponse(1, 3, 5, 0x77, EXTENTS), EXTENT_LIST_RESPONSE),
    (InitiateDCAddRequest(1, 0x2, 0, 0x60_0000, TAG_A, EXTENTS), DC_ADD),
    (InitiateDCAddResponse(), b""),
    (
        InitiateDCReleaseRequest(1, 0x1, 0x20_0000, TAG_B, EXTENTS[:1], forced_removal=True, sanitize_on_release=True),
        DC_RELEASE,
    ),
    (InitiateDCReleaseResponse(), b""),
]
