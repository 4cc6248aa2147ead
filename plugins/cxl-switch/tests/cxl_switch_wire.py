"""What the emulated switch holds, read over its socket on a connection of the test's own: the truth the driver
tests compare with, rather than anything the driver keeps."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from disagg_cxl_switch.driver.client import CCIClient
from disagg_cxl_switch.fmapi import (
    DCRegionConfig,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    GetLDAllocationsRequest,
    GetLDAllocationsResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    Opcode,
    VPPBBindingStatus,
)


@attrs.frozen
class HeldVPPB:
    """A vPPB that is not unbound: its VCS, status, and the port (and LD, FFh for none) it is bound to."""

    vcs: int
    status: int
    port: int
    ld: int


def ld_units(address: str, mld_port: int) -> list[int]:
    """Each LD's allocation, in units of the MLD's granularity (Get LD Allocations, tunnelled)."""
    client = CCIClient(address)
    try:
        raw = client.tunnel(mld_port, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest())
    finally:
        client.close()
    response = GetLDAllocationsResponse.decode(raw)
    return [a.range_1_allocation_multiplier + a.range_2_allocation_multiplier for a in response.allocations]


def held_vppbs(address: str, vcs_ids: Iterable[int]) -> list[HeldVPPB]:
    """Every vPPB of the VCSs that is bound or being bound (Get Virtual CXL Switch Info)."""
    client = CCIClient(address)
    try:
        raw = client.call(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, GetVirtualCxlSwitchInfoRequest(0, 0xFF, tuple(vcs_ids)))
    finally:
        client.close()
    return [
        HeldVPPB(vcs.vcs_id, v.binding_status, v.bound_port_id, v.bound_ld_id)
        for vcs in GetVirtualCxlSwitchInfoResponse.decode(raw).vcss
        for v in vcs.vppbs
        if v.binding_status != VPPBBindingStatus.UNBOUND
    ]


def dc_extent_bytes(address: str, dcd_port: int, host_id: int) -> int:
    """The dynamic capacity the host holds (Get DC Region Extent Lists, tunnelled)."""
    client = CCIClient(address)
    try:
        raw = client.tunnel(dcd_port, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(host_id, 64, 0))
    finally:
        client.close()
    return sum(e.length for e in GetDCRegionExtentListsResponse.decode(raw).extents)


def dc_extents(address: str, dcd_port: int, host_id: int) -> list[tuple[int, int, bytes]]:
    """The host's DC extents (start DPA, length, tag), from its first 64 (Get DC Region Extent Lists)."""
    client = CCIClient(address)
    try:
        raw = client.tunnel(dcd_port, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(host_id, 64, 0))
    finally:
        client.close()
    return [(e.start_dpa, e.length, e.tag) for e in GetDCRegionExtentListsResponse.decode(raw).extents]


def dc_regions(address: str, dcd_port: int, host_id: int) -> tuple[DCRegionConfig, ...]:
    """The DCD's regions as the host sees them (Get Host DC Region Configuration)."""
    client = CCIClient(address)
    try:
        raw = client.tunnel(dcd_port, Opcode.GET_HOST_DC_REGION_CONFIG, GetHostDCRegionConfigRequest(host_id))
    finally:
        client.close()
    return GetHostDCRegionConfigResponse.decode(raw).regions
