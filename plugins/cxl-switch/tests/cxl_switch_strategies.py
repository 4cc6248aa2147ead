"""Hypothesis strategies for every CCI and FM API type (a uniquely named module: test dirs share one namespace)."""

from __future__ import annotations

from typing import TypeVar

from disagg_cxl_switch.cci import MAX_PAYLOAD_LENGTH, CCIMessage, MessageCategory
from disagg_cxl_switch.fmapi import (
    BindVPPBRequest,
    DCRegionConfig,
    Extent,
    GetDCDInfoResponse,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetLDInfoResponse,
    GetPhysicalPortStateRequest,
    GetPhysicalPortStateResponse,
    GetVirtualCxlSwitchInfoRequest,
    IdentifySwitchDeviceResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    LDAllocation,
    PhysicalPortControlRequest,
    PortInfo,
    SetDCRegionConfigRequest,
    SetLDAllocationsRequest,
    SetLDAllocationsResponse,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    UnbindVPPBRequest,
    VCSInfo,
    VPPBInfo,
)
from hypothesis import strategies as st

u4 = st.integers(0, 0xF)
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)
tags = st.binary(min_size=16, max_size=16)

T = TypeVar("T")


def small_tuples(elements: st.SearchStrategy[T], max_size: int = 6) -> st.SearchStrategy[tuple[T, ...]]:
    return st.lists(elements, max_size=max_size).map(tuple)


def cci_messages(max_payload: int = 64) -> st.SearchStrategy[CCIMessage]:
    return st.builds(
        CCIMessage,
        category=st.sampled_from(MessageCategory),
        tag=u8,
        opcode=u16,
        payload=st.binary(max_size=min(max_payload, MAX_PAYLOAD_LENGTH)),
        background_operation=st.booleans(),
        return_code=u16,
        vendor_specific_status=u16,
    )


port_infos = st.builds(PortInfo, *([u8] * 12), u16, u8)
vppb_infos = st.builds(VPPBInfo, u8, u8, u8)


@st.composite
def vcs_infos(draw: st.DrawFn) -> VCSInfo:
    """A VCS block whose vPPB entries are all of its vPPBs (the window of start 0, limit FFh)."""
    vppbs = draw(small_tuples(vppb_infos))
    return VCSInfo(draw(u8), draw(u8), draw(u8), len(vppbs), vppbs)


ld_allocations = st.builds(LDAllocation, u64, u64)
extents = st.builds(Extent, u64, u64, tags, u16)
dc_region_configs = st.builds(DCRegionConfig, u64, u64, u64, u64, u8, st.booleans())

PAYLOADS: dict[type, st.SearchStrategy[object]] = {
    IdentifySwitchDeviceResponse: st.builds(
        IdentifySwitchDeviceResponse,
        u8,
        u8,
        u8,
        st.frozensets(u8),
        st.frozensets(u8),
        u16,
        u16,
        u8,
    ),
    GetPhysicalPortStateRequest: st.builds(GetPhysicalPortStateRequest, small_tuples(u8)),
    GetPhysicalPortStateResponse: st.builds(GetPhysicalPortStateResponse, small_tuples(port_infos)),
    PhysicalPortControlRequest: st.builds(PhysicalPortControlRequest, u8, u8),
    GetVirtualCxlSwitchInfoRequest: st.builds(GetVirtualCxlSwitchInfoRequest, u8, u8, small_tuples(u8)),
    BindVPPBRequest: st.builds(BindVPPBRequest, u8, u8, u8, u16),
    UnbindVPPBRequest: st.builds(UnbindVPPBRequest, u8, u8, u4),
    TunnelManagementCommandRequest: st.builds(TunnelManagementCommandRequest, u8, cci_messages(), u8),
    TunnelManagementCommandResponse: st.builds(TunnelManagementCommandResponse, cci_messages()),
    GetLDInfoResponse: st.builds(GetLDInfoResponse, u64, u16, u8),
    GetLDAllocationsRequest: st.builds(GetLDAllocationsRequest, u8, u8),
    GetLDAllocationsResponse: st.builds(GetLDAllocationsResponse, u8, u8, u8, small_tuples(ld_allocations)),
    SetLDAllocationsRequest: st.builds(SetLDAllocationsRequest, u8, small_tuples(ld_allocations)),
    SetLDAllocationsResponse: st.builds(SetLDAllocationsResponse, u8, small_tuples(ld_allocations)),
    GetDCDInfoResponse: st.builds(GetDCDInfoResponse, u8, u16, u16, u8, u64, small_tuples(u64, max_size=8)),
    GetHostDCRegionConfigRequest: st.builds(GetHostDCRegionConfigRequest, u16, u8, u8),
    GetHostDCRegionConfigResponse: st.builds(
        GetHostDCRegionConfigResponse, u16, u8, small_tuples(dc_region_configs), u32, u32, u32, u32
    ),
    SetDCRegionConfigRequest: st.builds(SetDCRegionConfigRequest, u8, u64, st.booleans()),
    GetDCRegionExtentListsRequest: st.builds(GetDCRegionExtentListsRequest, u16, u32, u32),
    GetDCRegionExtentListsResponse: st.builds(
        GetDCRegionExtentListsResponse, u16, u32, u32, u32, small_tuples(extents)
    ),
    InitiateDCAddRequest: st.builds(InitiateDCAddRequest, u16, u4, u8, u64, tags, small_tuples(extents)),
    InitiateDCReleaseRequest: st.builds(
        InitiateDCReleaseRequest, u16, u4, u64, tags, small_tuples(extents), st.booleans(), st.booleans()
    ),
}
"""A strategy per payload class that carries fields; the empty payloads are tested separately."""
