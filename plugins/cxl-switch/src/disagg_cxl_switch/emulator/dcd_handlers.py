"""DCD Management (56h) handlers, reached through Tunnel Management Command to the DCD's port.

The emulated hosts answer at once: an add goes straight into the host's extent list, a release straight out.
"""

from __future__ import annotations

from disagg_cxl_switch.emulator._base import HandlerBase
from disagg_cxl_switch.emulator.capacity import check_budget, check_prescribed, choose_extents, release_prescribed
from disagg_cxl_switch.emulator.errors import CommandError
from disagg_cxl_switch.emulator.reply import Handler, Reply
from disagg_cxl_switch.emulator.state import DC_CAPACITY_UNIT, DynamicCapacityDevice, HostExtent
from disagg_cxl_switch.fmapi import (
    DCRegionConfig,
    Extent,
    GetDCDInfoRequest,
    GetDCDInfoResponse,
    GetDCRegionExtentListsRequest,
    GetDCRegionExtentListsResponse,
    GetHostDCRegionConfigRequest,
    GetHostDCRegionConfigResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    Opcode,
    RemovalPolicy,
    SelectionPolicy,
    SetDCRegionConfigRequest,
)
from disagg_cxl_switch.returncodes import ReturnCode


class DCDHandlers(HandlerBase):
    """The DCD's command set."""

    def dcd_handlers(self) -> dict[int, Handler]:
        return {
            Opcode.GET_DCD_INFO: self._get_dcd_info,
            Opcode.GET_HOST_DC_REGION_CONFIG: self._get_host_dc_region_config,
            Opcode.SET_DC_REGION_CONFIG: self._set_dc_region_config,
            Opcode.GET_DC_REGION_EXTENT_LISTS: self._get_dc_region_extent_lists,
            Opcode.INITIATE_DC_ADD: self._initiate_dc_add,
            Opcode.INITIATE_DC_RELEASE: self._initiate_dc_release,
        }

    def _dcd(self) -> DynamicCapacityDevice:
        if self.state.dcd is None:  # pragma: no cover - only reached through a tunnel to the DCD's port
            raise CommandError(ReturnCode.UNSUPPORTED, "no DCD")
        return self.state.dcd

    def _host(self, host_id: int) -> int:
        if not 0 <= host_id < self._dcd().number_of_hosts:
            raise CommandError(ReturnCode.INVALID_INPUT, f"host {host_id} does not exist")
        return host_id

    def _bump(self, host_id: int) -> None:
        dcd = self._dcd()
        dcd.generation[host_id] = (dcd.generation[host_id] + 1) & 0xFFFFFFFF

    def _get_dcd_info(self, data: bytes) -> Reply:
        GetDCDInfoRequest.decode(data)
        dcd = self._dcd()
        selection = (
            (1 << SelectionPolicy.FREE) | (1 << SelectionPolicy.CONTIGUOUS) | (1 << SelectionPolicy.PRESCRIPTIVE)
        )
        removal = (1 << RemovalPolicy.TAG_BASED) | (1 << RemovalPolicy.PRESCRIPTIVE)
        response = GetDCDInfoResponse(
            number_of_hosts=dcd.number_of_hosts,
            capacity_selection_policies=selection,
            capacity_removal_policies=removal,
            sanitize_on_release_support_mask=(1 << len(dcd.regions)) - 1,
            total_dynamic_capacity=dcd.total_capacity // DC_CAPACITY_UNIT,
            region_block_size_masks=tuple(r.supported_block_size_mask for r in dcd.regions),
        )
        return Reply(payload=response.encode())

    def _get_host_dc_region_config(self, data: bytes) -> Reply:
        request = GetHostDCRegionConfigRequest.decode(data)
        dcd = self._dcd()
        self._host(request.host_id)
        if request.starting_region_index >= len(dcd.regions):
            raise CommandError(ReturnCode.INVALID_INPUT, "starting region index beyond the regions")
        regions = dcd.regions[request.starting_region_index :][: request.region_count]
        response = GetHostDCRegionConfigResponse(
            host_id=request.host_id,
            number_of_available_regions=len(dcd.regions),
            regions=tuple(
                DCRegionConfig(r.base, r.length // DC_CAPACITY_UNIT, r.length, r.block_size, 0, r.sanitize_on_release)
                for r in regions
            ),
            total_supported_extents=dcd.total_supported_extents,
            available_extents=max(0, dcd.total_supported_extents - len(dcd.all_extents())),
            total_supported_tags=dcd.total_supported_tags,
            available_tags=max(0, dcd.total_supported_tags - len(dcd.tags_in_use())),
        )
        return Reply(payload=response.encode())

    def _set_dc_region_config(self, data: bytes) -> Reply:
        request = SetDCRegionConfigRequest.decode(data)
        dcd = self._dcd()
        if not 0 <= request.region_id < len(dcd.regions):
            raise CommandError(ReturnCode.INVALID_INPUT, f"region {request.region_id} does not exist")
        region = dcd.regions[request.region_id]
        size = request.block_size
        if size <= 0 or size & (size - 1) or not region.supported_block_size_mask >> (size.bit_length() - 1) & 1:
            raise CommandError(ReturnCode.INVALID_INPUT, f"block size {size:#x} not supported by the region")
        if any(e.region == request.region_id for e in dcd.all_extents()):
            raise CommandError(ReturnCode.INVALID_INPUT, "region has capacity added to a host")
        region.block_size = size
        region.sanitize_on_release = request.sanitize_on_release
        return Reply()

    def _get_dc_region_extent_lists(self, data: bytes) -> Reply:
        request = GetDCRegionExtentListsRequest.decode(data)
        dcd = self._dcd()
        held = dcd.host_extents[self._host(request.host_id)]
        if request.starting_extent_index > len(held):
            raise CommandError(ReturnCode.INVALID_INPUT, "starting extent index beyond the list")
        window = held[request.starting_extent_index :][: request.extent_count]
        response = GetDCRegionExtentListsResponse(
            host_id=request.host_id,
            starting_extent_index=request.starting_extent_index,
            total_extents=len(held),
            extent_list_generation_number=dcd.generation[request.host_id],
            extents=tuple(Extent(e.start_dpa, e.length, e.tag) for e in window),
        )
        return Reply(payload=response.encode())

    def _initiate_dc_add(self, data: bytes) -> Reply:
        request = InitiateDCAddRequest.decode(data)
        dcd = self._dcd()
        host = self._host(request.host_id)
        if not 0 <= request.region_number < len(dcd.regions):
            raise CommandError(ReturnCode.INVALID_INPUT, f"region {request.region_number} does not exist")
        region = dcd.regions[request.region_number]
        policy = request.selection_policy
        if policy == SelectionPolicy.PRESCRIPTIVE:
            check_prescribed(dcd, region, request.extents)
            spans = [(e.start_dpa, e.length, e.tag if any(e.tag) else request.tag) for e in request.extents]
        elif policy in (SelectionPolicy.FREE, SelectionPolicy.CONTIGUOUS):
            if request.extents:
                raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "extents are only for the prescriptive policy")
            chosen = choose_extents(dcd, region, request.length, contiguous=policy == SelectionPolicy.CONTIGUOUS)
            spans = [(start, length, request.tag) for start, length in chosen]
        else:
            raise CommandError(ReturnCode.INVALID_INPUT, f"selection policy {policy:#x} not supported")
        check_budget(dcd, [tag for _, _, tag in spans])
        offered = [HostExtent(start, length, tag, request.region_number) for start, length, tag in spans]
        dcd.pending_adds[host] = offered
        # The emulated host accepts every offer at once (Add Dynamic Capacity Response with the whole list).
        dcd.host_extents[host].extend(dcd.pending_adds.pop(host))
        self._bump(host)
        return Reply()

    def _initiate_dc_release(self, data: bytes) -> Reply:
        request = InitiateDCReleaseRequest.decode(data)
        dcd = self._dcd()
        host = self._host(request.host_id)
        held = dcd.host_extents[host]
        if request.removal_policy == RemovalPolicy.TAG_BASED:
            released = [e for e in held if e.tag == request.tag]
            if not released:
                raise CommandError(ReturnCode.INVALID_EXTENT_LIST, "the host holds no extent with this tag")
            kept = [e for e in held if e.tag != request.tag]
        elif request.removal_policy == RemovalPolicy.PRESCRIPTIVE:
            kept = release_prescribed(dcd, host, request.extents)
            released = [e for e in held if e not in kept]
        else:
            raise CommandError(ReturnCode.INVALID_INPUT, f"removal policy {request.removal_policy:#x}")
        dcd.pending_releases[host] = released
        # The emulated host gives the capacity back at once (Release Dynamic Capacity for the whole list).
        dcd.pending_releases.pop(host)
        dcd.host_extents[host] = kept
        self._bump(host)
        return Reply()
