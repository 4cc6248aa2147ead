"""Every emulator command's success path and return-code paths, in process and over a real socket.

The default topology: hosts 0-1 on USPs 0-1, GPUs on DSPs 2-11, the MLD (4 LDs, 64 GiB) on DSP 12, the DCD (two
8 GiB regions) on DSP 13; each VCS has 16 vPPBs, one per DSP and one per LD.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cxl_switch_client import Client, SocketTransport, emulator_process, in_process
from cxl_switch_served import Clock
from disagg_cxl_switch import CCIMessage, MessageCategory
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.background import BACKGROUND_OPERATION_STATUS
from disagg_cxl_switch.emulator.events import EventType
from disagg_cxl_switch.emulator.state import GIB, MIB, ConnectedDeviceType, LTSSMState
from disagg_cxl_switch.emulator.vendor import (
    GetEventRecordsRequest,
    GetEventRecordsResponse,
    HotAddDeviceKind,
    InjectExtentPoisonRequest,
    InjectHotAddRequest,
    InjectLinkDownRequest,
    InjectSurpriseRemovalRequest,
    VendorOpcode,
)
from disagg_cxl_switch.fmapi import (
    LD_ID_NOT_MLD,
    BindVPPBRequest,
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
    GetVirtualCxlSwitchInfoResponse,
    IdentifySwitchDeviceResponse,
    InitiateDCAddRequest,
    InitiateDCReleaseRequest,
    LDAllocation,
    Opcode,
    PhysicalPortControlRequest,
    PortConfigurationState,
    PortOpcode,
    RemovalPolicy,
    SelectionPolicy,
    SetDCRegionConfigRequest,
    SetLDAllocationsRequest,
    SetLDAllocationsResponse,
    TunnelManagementCommandRequest,
    UnbindVPPBRequest,
    VCSState,
    VPPBBindingStatus,
)
from disagg_cxl_switch.returncodes import ReturnCode

RC = ReturnCode

GPU, MLD_PORT, DCD_PORT = 2, 12, 13
TAG_A, TAG_B = b"A" * 16, b"B" * 16
BIND_DELAY_MS = 100


def ticking_clock(step: float = 0.001) -> Callable[[], float]:
    """A clock that advances a millisecond per reading: background operations complete after a fixed number of
    requests, whatever the machine's load."""
    now = 0.0

    def clock() -> float:
        nonlocal now
        now += step
        return now

    return clock


@pytest.fixture(scope="module")
def emulator_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("emu") / "switch.sock"
    with emulator_process(path, "--bind-delay-ms", str(BIND_DELAY_MS)):
        yield path


@pytest.fixture(params=["in-process", "socket"])
def fm(request: pytest.FixtureRequest) -> Iterator[Client]:
    if request.param == "in-process":
        switch = Switch(default_topology(), bind_delay=BIND_DELAY_MS / 1000, clock=ticking_clock())
        yield Client(in_process(switch))
        return
    transport = SocketTransport(request.getfixturevalue("emulator_socket"))
    client = Client(transport)
    assert client.call(VendorOpcode.RESET).return_code == RC.SUCCESS
    yield client
    transport.close()


def ok(response: CCIMessage) -> bytes:
    assert response.return_code == RC.SUCCESS, RC(response.return_code)
    return response.payload


def code(response: CCIMessage) -> RC:
    return RC(response.return_code)


def bind(fm: Client, vcs: int, vppb: int, port: int, ld: int = LD_ID_NOT_MLD) -> RC:
    """Bind and wait for completion; the completion's return code."""
    response = fm.call(Opcode.BIND_VPPB, BindVPPBRequest(vcs, vppb, port, ld))
    if response.return_code != RC.BACKGROUND_COMMAND_STARTED:
        return code(response)
    assert response.background_operation
    return RC(fm.wait_background().return_code)


def vcs_info(fm: Client, vcs: int = 0) -> GetVirtualCxlSwitchInfoResponse:
    return GetVirtualCxlSwitchInfoResponse.decode(
        ok(fm.call(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, GetVirtualCxlSwitchInfoRequest(0, 0xFF, (vcs,))))
    )


def extents(fm: Client, host: int) -> GetDCRegionExtentListsResponse:
    response = fm.tunnel(DCD_PORT, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(host, 100))
    return GetDCRegionExtentListsResponse.decode(ok(response))


def dc_add(fm: Client, request: InitiateDCAddRequest) -> RC:
    return code(fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_ADD, request))


def dc_release(fm: Client, request: InitiateDCReleaseRequest) -> RC:
    return code(fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_RELEASE, request))


def events(fm: Client, first: int = 0) -> GetEventRecordsResponse:
    return GetEventRecordsResponse.decode(ok(fm.call(VendorOpcode.GET_EVENT_RECORDS, GetEventRecordsRequest(first))))


class TestGeneric:
    """Unknown opcodes, wrong categories and Background Operation Status."""

    def test_unknown_opcode_is_unsupported(self, fm: Client) -> None:
        assert code(fm.call(0x1234)) == RC.UNSUPPORTED

    def test_device_command_sets_are_not_on_the_switch_cci(self, fm: Client) -> None:
        assert code(fm.call(Opcode.GET_LD_INFO)) == RC.UNSUPPORTED
        assert code(fm.call(Opcode.GET_DCD_INFO)) == RC.UNSUPPORTED

    def test_a_response_sent_as_request_is_invalid_input(self, fm: Client) -> None:
        message = CCIMessage(MessageCategory.RESPONSE, tag=9, opcode=Opcode.IDENTIFY_SWITCH_DEVICE)
        response = fm.transport(message)
        assert response.tag == 9 and code(response) == RC.INVALID_INPUT

    def test_background_status_before_any_operation(self, fm: Client) -> None:
        status = fm.background_status()
        assert (status.running, status.command_opcode) == (False, 0)

    def test_background_status_with_payload_is_invalid_payload_length(self, fm: Client) -> None:
        assert code(fm.call(BACKGROUND_OPERATION_STATUS, b"\x00")) == RC.INVALID_PAYLOAD_LENGTH

    def test_background_status_byte_0_while_running_and_done(self) -> None:
        """Bit 0 set while running, the percentage in bits[7:1]: half way through a bind is 0x65."""
        clock = Clock()
        fm = Client(in_process(Switch(default_topology(), bind_delay=1.0, clock=clock)))
        assert code(fm.call(Opcode.BIND_VPPB, BindVPPBRequest(0, 0, GPU))) == RC.BACKGROUND_COMMAND_STARTED
        clock.now = 0.5
        assert ok(fm.call(BACKGROUND_OPERATION_STATUS))[0] == 50 << 1 | 1
        clock.now = 1.0
        assert ok(fm.call(BACKGROUND_OPERATION_STATUS))[0] == 100 << 1


class TestPhysicalSwitch:
    """Identify Switch Device, Get Physical Port State and Physical Port Control."""

    def test_identify(self, fm: Client) -> None:
        info = IdentifySwitchDeviceResponse.decode(ok(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)))
        assert (info.number_of_physical_ports, info.number_of_vcss) == (14, 2)
        assert info.active_port_ids == frozenset(range(14)) and info.active_vcs_ids == {0, 1}
        assert (info.total_number_of_vppbs, info.number_of_bound_vppbs) == (32, 0)

    def test_identify_with_payload_is_invalid_payload_length(self, fm: Client) -> None:
        assert code(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE, b"\x01")) == RC.INVALID_PAYLOAD_LENGTH

    def test_port_state(self, fm: Client) -> None:
        request = GetPhysicalPortStateRequest((0, GPU, MLD_PORT, DCD_PORT, 200))
        usp, gpu, mld, dcd, bad = GetPhysicalPortStateResponse.decode(
            ok(fm.call(Opcode.GET_PHYSICAL_PORT_STATE, request))
        ).ports
        assert usp.current_port_configuration_state == PortConfigurationState.USP
        assert (gpu.current_port_configuration_state, gpu.connected_device_type) == (
            PortConfigurationState.DSP,
            ConnectedDeviceType.PCIE,
        )
        assert gpu.ltssm_state == LTSSMState.L0 and gpu.negotiated_link_width == 16
        assert (mld.connected_device_type, mld.supported_ld_count) == (ConnectedDeviceType.CXL_TYPE_3_MLD, 4)
        assert dcd.connected_device_type == ConnectedDeviceType.CXL_TYPE_3_SLD
        assert (bad.port_id, bad.current_port_configuration_state) == (200, PortConfigurationState.INVALID_PORT_ID)

    def test_port_state_count_mismatch_is_invalid_payload_length(self, fm: Client) -> None:
        assert code(fm.call(Opcode.GET_PHYSICAL_PORT_STATE, b"\x03\x00")) == RC.INVALID_PAYLOAD_LENGTH

    def test_perst_takes_the_link_down_and_back(self, fm: Client) -> None:
        ok(fm.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(GPU, PortOpcode.ASSERT_PERST)))
        port = GetPhysicalPortStateResponse.decode(
            ok(fm.call(Opcode.GET_PHYSICAL_PORT_STATE, GetPhysicalPortStateRequest((GPU,))))
        ).ports[0]
        assert port.ltssm_state == LTSSMState.DISABLED and port.link_state_flags & 0x2
        ok(fm.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(GPU, PortOpcode.DEASSERT_PERST)))
        assert [(r.event_type, r.port_id) for r in events(fm).records] == [
            (EventType.LINK_DOWN, GPU),
            (EventType.LINK_UP, GPU),
        ]

    @pytest.mark.parametrize(("ppb", "opcode"), [(0, PortOpcode.RESET_PPB), (200, PortOpcode.RESET_PPB), (GPU, 9)])
    def test_port_control_invalid_input(self, fm: Client, ppb: int, opcode: int) -> None:
        assert code(fm.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(ppb, opcode))) == RC.INVALID_INPUT

    def test_port_control_short_payload(self, fm: Client) -> None:
        assert code(fm.call(Opcode.PHYSICAL_PORT_CONTROL, b"\x02")) == RC.INVALID_PAYLOAD_LENGTH


class TestVirtualSwitch:
    """Get Virtual CXL Switch Info, Bind vPPB and Unbind vPPB, with their background operations."""

    def test_vcs_info_window_and_invalid_vcs(self, fm: Client) -> None:
        request = GetVirtualCxlSwitchInfoRequest(1, 2, (1, 7))
        response = GetVirtualCxlSwitchInfoResponse.decode(
            ok(fm.call(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, request)), 1, 2
        )
        vcs, bad = response.vcss
        assert (vcs.vcs_id, vcs.vcs_state, vcs.usp_id, vcs.number_of_vppbs, len(vcs.vppbs)) == (1, 1, 1, 16, 2)
        assert bad.vcs_state == VCSState.INVALID_VCS_ID

    def test_bind_runs_in_background_then_binds(self, fm: Client) -> None:
        response = fm.call(Opcode.BIND_VPPB, BindVPPBRequest(0, 3, GPU))
        assert code(response) == RC.BACKGROUND_COMMAND_STARTED and response.background_operation
        assert vcs_info(fm).vcss[0].vppbs[3].binding_status == VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS
        status = fm.background_status()
        assert status.running and status.percentage_complete < 100
        done = fm.wait_background()
        assert (done.command_opcode, done.return_code, done.percentage_complete) == (Opcode.BIND_VPPB, 0, 100)
        entry = vcs_info(fm).vcss[0].vppbs[3]
        assert (entry.binding_status, entry.bound_port_id, entry.bound_ld_id) == (2, GPU, 0xFF)
        info = IdentifySwitchDeviceResponse.decode(ok(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)))
        assert info.number_of_bound_vppbs == 1

    def test_bind_ld(self, fm: Client) -> None:
        assert bind(fm, 1, 0, MLD_PORT, 2) == RC.SUCCESS
        entry = vcs_info(fm, 1).vcss[0].vppbs[0]
        assert (entry.binding_status, entry.bound_port_id, entry.bound_ld_id) == (3, MLD_PORT, 2)
        assert bind(fm, 0, 0, MLD_PORT, 3) == RC.SUCCESS  # another LD of the same MLD, another host

    @pytest.mark.parametrize(
        "request_",
        [
            BindVPPBRequest(5, 0, GPU),  # no such VCS
            BindVPPBRequest(0, 16, GPU),  # no such vPPB
            BindVPPBRequest(0, 0, 1),  # an upstream port
            BindVPPBRequest(0, 0, 200),  # no such port
            BindVPPBRequest(0, 0, GPU, 0),  # an LD id for an SLD
            BindVPPBRequest(0, 0, MLD_PORT),  # no LD id for the MLD
            BindVPPBRequest(0, 0, MLD_PORT, 4),  # no such LD
        ],
    )
    def test_bind_invalid_input(self, fm: Client, request_: BindVPPBRequest) -> None:
        assert code(fm.call(Opcode.BIND_VPPB, request_)) == RC.INVALID_INPUT

    def test_bind_taken_port_ld_or_vppb_is_invalid_input(self, fm: Client) -> None:
        assert bind(fm, 0, 0, GPU) == RC.SUCCESS
        assert bind(fm, 0, 1, MLD_PORT, 0) == RC.SUCCESS
        assert bind(fm, 1, 0, GPU) == RC.INVALID_INPUT  # port bound to host 0
        assert bind(fm, 1, 1, MLD_PORT, 0) == RC.INVALID_INPUT  # LD bound to host 0
        assert bind(fm, 0, 0, GPU + 1) == RC.INVALID_INPUT  # vPPB already bound

    def test_bind_short_payload(self, fm: Client) -> None:
        assert code(fm.call(Opcode.BIND_VPPB, b"\x00\x00\x02")) == RC.INVALID_PAYLOAD_LENGTH

    def test_second_background_command_is_busy(self, fm: Client) -> None:
        assert code(fm.call(Opcode.BIND_VPPB, BindVPPBRequest(0, 0, GPU))) == RC.BACKGROUND_COMMAND_STARTED
        assert code(fm.call(Opcode.BIND_VPPB, BindVPPBRequest(0, 1, GPU + 1))) == RC.BUSY
        assert code(fm.call(Opcode.UNBIND_VPPB, UnbindVPPBRequest(0, 0))) == RC.BUSY
        assert code(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)) == RC.SUCCESS  # foreground commands still run
        assert fm.wait_background().return_code == RC.SUCCESS
        assert bind(fm, 0, 1, GPU + 1) == RC.SUCCESS

    def test_injected_bind_failure_fails_once_at_completion(self, fm: Client) -> None:
        ok(fm.call(VendorOpcode.INJECT_BIND_FAILURE))
        assert bind(fm, 0, 0, GPU) == RC.INTERNAL_ERROR
        assert vcs_info(fm).vcss[0].vppbs[0].binding_status == VPPBBindingStatus.UNBOUND
        assert bind(fm, 0, 0, GPU) == RC.SUCCESS

    def test_unbind(self, fm: Client) -> None:
        assert bind(fm, 0, 4, GPU) == RC.SUCCESS
        response = fm.call(Opcode.UNBIND_VPPB, UnbindVPPBRequest(0, 4, 1))
        assert code(response) == RC.BACKGROUND_COMMAND_STARTED
        status = fm.wait_background()
        assert (status.command_opcode, status.return_code) == (Opcode.UNBIND_VPPB, RC.SUCCESS)
        assert vcs_info(fm).vcss[0].vppbs[4].binding_status == VPPBBindingStatus.UNBOUND
        assert bind(fm, 1, 4, GPU) == RC.SUCCESS  # the port is free for another host

    @pytest.mark.parametrize("request_", [UnbindVPPBRequest(0, 0), UnbindVPPBRequest(3, 0), UnbindVPPBRequest(0, 40)])
    def test_unbind_invalid_input(self, fm: Client, request_: UnbindVPPBRequest) -> None:
        assert code(fm.call(Opcode.UNBIND_VPPB, request_)) == RC.INVALID_INPUT

    def test_unbind_unknown_option_is_invalid_input(self, fm: Client) -> None:
        assert bind(fm, 0, 0, GPU) == RC.SUCCESS
        assert code(fm.call(Opcode.UNBIND_VPPB, UnbindVPPBRequest(0, 0, 3))) == RC.INVALID_INPUT


class TestTunnel:
    """Tunnel Management Command reaches the MLD's and the DCD's command sets, and nothing else."""

    @pytest.mark.parametrize("port", [GPU, 0, 200])
    def test_port_without_managed_device_is_invalid_input(self, fm: Client, port: int) -> None:
        request = TunnelManagementCommandRequest(port, CCIMessage.request(Opcode.GET_LD_INFO))
        assert code(fm.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, request)) == RC.INVALID_INPUT

    def test_unknown_target_type_is_invalid_input(self, fm: Client) -> None:
        request = TunnelManagementCommandRequest(MLD_PORT, CCIMessage.request(Opcode.GET_LD_INFO), target_type=1)
        assert code(fm.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, request)) == RC.INVALID_INPUT

    def test_malformed_embedded_message_is_invalid_payload_length(self, fm: Client) -> None:
        body = bytes([MLD_PORT, 0, 5, 0]) + b"\x00" * 5
        assert code(fm.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, body)) == RC.INVALID_PAYLOAD_LENGTH

    def test_link_down_is_retry_required(self, fm: Client) -> None:
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(MLD_PORT)))
        request = TunnelManagementCommandRequest(MLD_PORT, CCIMessage.request(Opcode.GET_LD_INFO))
        assert code(fm.call(Opcode.TUNNEL_MANAGEMENT_COMMAND, request)) == RC.RETRY_REQUIRED

    def test_command_of_another_set_is_unsupported_inside(self, fm: Client) -> None:
        assert code(fm.tunnel(MLD_PORT, Opcode.GET_DCD_INFO)) == RC.UNSUPPORTED
        assert code(fm.tunnel(DCD_PORT, Opcode.IDENTIFY_SWITCH_DEVICE)) == RC.UNSUPPORTED

    def test_malformed_inner_payload_is_answered_inside(self, fm: Client) -> None:
        assert code(fm.tunnel(MLD_PORT, Opcode.GET_LD_INFO, b"\x00")) == RC.INVALID_PAYLOAD_LENGTH


class TestMLD:
    """Get LD Info and Get/Set LD Allocations through the tunnel."""

    def test_ld_info(self, fm: Client) -> None:
        info = GetLDInfoResponse.decode(ok(fm.tunnel(MLD_PORT, Opcode.GET_LD_INFO)))
        assert (info.memory_size, info.ld_count) == (64 * GIB, 4)

    def test_allocations_window(self, fm: Client) -> None:
        all_ = GetLDAllocationsResponse.decode(
            ok(fm.tunnel(MLD_PORT, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest()))
        )
        assert all_.allocations == (LDAllocation(64, 0),) * 4 and all_.memory_granularity == 0
        window = GetLDAllocationsResponse.decode(
            ok(fm.tunnel(MLD_PORT, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest(2, 1)))
        )
        assert (window.number_of_lds, window.start_ld_id, len(window.allocations)) == (4, 2, 1)

    def test_allocations_start_beyond_is_invalid_input(self, fm: Client) -> None:
        response = fm.tunnel(MLD_PORT, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest(4, 1))
        assert code(response) == RC.INVALID_INPUT

    def test_set_allocations(self, fm: Client) -> None:
        request = SetLDAllocationsRequest(0, (LDAllocation(0, 0), LDAllocation(100, 28)))
        applied = SetLDAllocationsResponse.decode(ok(fm.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, request)))
        assert applied.allocations == request.allocations
        now = GetLDAllocationsResponse.decode(
            ok(fm.tunnel(MLD_PORT, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest()))
        ).allocations
        assert now[:2] == request.allocations

    def test_set_allocations_beyond_memory_is_resources_exhausted(self, fm: Client) -> None:
        request = SetLDAllocationsRequest(0, (LDAllocation(65, 0),))
        assert code(fm.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, request)) == RC.RESOURCES_EXHAUSTED

    @pytest.mark.parametrize(
        "request_", [SetLDAllocationsRequest(3, (LDAllocation(1, 0),) * 2), SetLDAllocationsRequest(0, ())]
    )
    def test_set_allocations_outside_the_mld_is_invalid_input(
        self, fm: Client, request_: SetLDAllocationsRequest
    ) -> None:
        assert code(fm.tunnel(MLD_PORT, Opcode.SET_LD_ALLOCATIONS, request_)) == RC.INVALID_INPUT


class TestDCD:
    """DCD Management through the tunnel: configuration, extent lists, add and release."""

    def test_dcd_info(self, fm: Client) -> None:
        info = GetDCDInfoResponse.decode(ok(fm.tunnel(DCD_PORT, Opcode.GET_DCD_INFO)))
        assert (info.number_of_hosts, info.total_dynamic_capacity, len(info.region_block_size_masks)) == (2, 64, 2)
        assert info.capacity_selection_policies == 0b111 and info.capacity_removal_policies == 0b11

    def test_host_region_config(self, fm: Client) -> None:
        request = GetHostDCRegionConfigRequest(1, 1, 1)
        config = GetHostDCRegionConfigResponse.decode(
            ok(fm.tunnel(DCD_PORT, Opcode.GET_HOST_DC_REGION_CONFIG, request))
        )
        assert (config.host_id, config.number_of_available_regions, len(config.regions)) == (1, 2, 1)
        region = config.regions[0]
        assert (region.region_base, region.region_length, region.region_block_size) == (8 * GIB, 8 * GIB, 2 * MIB)
        assert region.region_decode_length == 8 * GIB // (256 * MIB)  # in 256 MiB units, as QEMU sends it
        assert config.available_extents == config.total_supported_extents

    @pytest.mark.parametrize("request_", [GetHostDCRegionConfigRequest(2), GetHostDCRegionConfigRequest(0, 1, 2)])
    def test_host_region_config_invalid_input(self, fm: Client, request_: GetHostDCRegionConfigRequest) -> None:
        assert code(fm.tunnel(DCD_PORT, Opcode.GET_HOST_DC_REGION_CONFIG, request_)) == RC.INVALID_INPUT

    def test_set_region_config(self, fm: Client) -> None:
        ok(fm.tunnel(DCD_PORT, Opcode.SET_DC_REGION_CONFIG, SetDCRegionConfigRequest(0, 64 * MIB, True)))
        config = GetHostDCRegionConfigResponse.decode(
            ok(fm.tunnel(DCD_PORT, Opcode.GET_HOST_DC_REGION_CONFIG, GetHostDCRegionConfigRequest(0)))
        )
        assert config.regions[0].region_block_size == 64 * MIB and config.regions[0].sanitize_on_release

    @pytest.mark.parametrize(("region", "size"), [(2, 2 * MIB), (0, 4096), (0, 3 * MIB), (0, 0)])
    def test_set_region_config_invalid_input(self, fm: Client, region: int, size: int) -> None:
        request = SetDCRegionConfigRequest(region, size)
        assert code(fm.tunnel(DCD_PORT, Opcode.SET_DC_REGION_CONFIG, request)) == RC.INVALID_INPUT

    def test_set_region_config_with_capacity_out_is_invalid_input(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB)) == RC.SUCCESS
        request = SetDCRegionConfigRequest(0, 64 * MIB)
        assert code(fm.tunnel(DCD_PORT, Opcode.SET_DC_REGION_CONFIG, request)) == RC.INVALID_INPUT

    def test_extent_list_window_and_bad_host(self, fm: Client) -> None:
        assert (extents(fm, 0).total_extents, extents(fm, 0).extent_list_generation_number) == (0, 0)
        bad = fm.tunnel(DCD_PORT, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(2, 1))
        assert code(bad) == RC.INVALID_INPUT
        beyond = fm.tunnel(DCD_PORT, Opcode.GET_DC_REGION_EXTENT_LISTS, GetDCRegionExtentListsRequest(0, 1, 1))
        assert code(beyond) == RC.INVALID_INPUT

    def test_add_free_contiguous_and_prescriptive(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 4 * MIB, TAG_A)) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(1, SelectionPolicy.CONTIGUOUS, 0, 2 * MIB, TAG_B)) == RC.SUCCESS
        prescribed = (Extent(8 * GIB + 10 * MIB, 2 * MIB), Extent(8 * GIB, 2 * MIB, TAG_B))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.PRESCRIPTIVE, 1, 0, TAG_A, prescribed)) == RC.SUCCESS
        host0 = extents(fm, 0)
        assert [(e.start_dpa, e.length, e.tag) for e in host0.extents] == [
            (0, 4 * MIB, TAG_A),
            (8 * GIB + 10 * MIB, 2 * MIB, TAG_A),
            (8 * GIB, 2 * MIB, TAG_B),
        ]
        assert host0.extent_list_generation_number == 2
        assert [(e.start_dpa, e.length) for e in extents(fm, 1).extents] == [(4 * MIB, 2 * MIB)]

    @pytest.mark.parametrize(
        "request_",
        [
            InitiateDCAddRequest(2, SelectionPolicy.FREE, 0, 2 * MIB),  # no such host
            InitiateDCAddRequest(0, SelectionPolicy.FREE, 2, 2 * MIB),  # no such region
            InitiateDCAddRequest(0, SelectionPolicy.ENABLE_SHARED_ACCESS, 0, 2 * MIB),
            InitiateDCAddRequest(0, 9, 0, 2 * MIB),  # unknown policy
            InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 0),
            InitiateDCAddRequest(0, SelectionPolicy.CONTIGUOUS, 0, MIB),  # not a whole block
        ],
    )
    def test_add_invalid_input(self, fm: Client, request_: InitiateDCAddRequest) -> None:
        assert dc_add(fm, request_) == RC.INVALID_INPUT

    def test_add_beyond_the_region_is_resources_exhausted(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 8 * GIB + 2 * MIB)) == RC.RESOURCES_EXHAUSTED
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 8 * GIB)) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(1, SelectionPolicy.FREE, 0, 2 * MIB)) == RC.RESOURCES_EXHAUSTED

    @pytest.mark.parametrize(
        "extents_",
        [
            (),
            (Extent(MIB, 2 * MIB),),  # not block-aligned
            (Extent(8 * GIB - 2 * MIB, 4 * MIB),),  # runs out of region 0
            (Extent(0, 4 * MIB), Extent(2 * MIB, 2 * MIB)),  # overlapping each other
            (Extent(0, 2 * MIB),),  # overlapping capacity already added
        ],
    )
    def test_add_bad_prescribed_list_is_invalid_extent_list(self, fm: Client, extents_: tuple[Extent, ...]) -> None:
        assert dc_add(fm, InitiateDCAddRequest(1, SelectionPolicy.FREE, 0, 2 * MIB)) == RC.SUCCESS
        request = InitiateDCAddRequest(0, SelectionPolicy.PRESCRIPTIVE, 0, 0, TAG_A, extents_)
        assert dc_add(fm, request) == RC.INVALID_EXTENT_LIST

    def test_add_free_with_extents_is_invalid_extent_list(self, fm: Client) -> None:
        request = InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, extents=(Extent(0, 2 * MIB),))
        assert dc_add(fm, request) == RC.INVALID_EXTENT_LIST

    def test_release_by_tag(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 4 * MIB, TAG_A)) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_B)) == RC.SUCCESS
        assert dc_release(fm, InitiateDCReleaseRequest(0, RemovalPolicy.TAG_BASED, 0, TAG_A)) == RC.SUCCESS
        assert [e.tag for e in extents(fm, 0).extents] == [TAG_B]
        assert dc_release(fm, InitiateDCReleaseRequest(0, RemovalPolicy.TAG_BASED, 0, TAG_A)) == RC.INVALID_EXTENT_LIST

    def test_release_prescriptive_splits_an_extent(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 6 * MIB, TAG_A)) == RC.SUCCESS
        request = InitiateDCReleaseRequest(0, RemovalPolicy.PRESCRIPTIVE, 2 * MIB, extents=(Extent(2 * MIB, 2 * MIB),))
        assert dc_release(fm, request) == RC.SUCCESS
        assert [(e.start_dpa, e.length) for e in extents(fm, 0).extents] == [(0, 2 * MIB), (4 * MIB, 2 * MIB)]

    @pytest.mark.parametrize(
        "extent", [Extent(MIB, 4096), Extent(MIB, 2 * MIB), Extent(2 * MIB, MIB)], ids=["4k", "start", "length"]
    )
    def test_release_not_block_aligned_is_invalid_extent_list(self, fm: Client, extent: Extent) -> None:
        """A release off the 2 MiB blocks is refused, so later adds still hand out whole blocks."""
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 4 * MIB, TAG_A)) == RC.SUCCESS
        request = InitiateDCReleaseRequest(0, RemovalPolicy.PRESCRIPTIVE, extent.length, extents=(extent,))
        assert dc_release(fm, request) == RC.INVALID_EXTENT_LIST
        assert [(e.start_dpa, e.length) for e in extents(fm, 0).extents] == [(0, 4 * MIB)]

    def test_release_not_held_is_invalid_extent_list(self, fm: Client) -> None:
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_A)) == RC.SUCCESS
        for extents_ in [(Extent(0, 4 * MIB),), (), (Extent(0, 2 * MIB), Extent(0, 2 * MIB))]:
            request = InitiateDCReleaseRequest(1 - 1, RemovalPolicy.PRESCRIPTIVE, 0, extents=extents_)
            assert dc_release(fm, request) == RC.INVALID_EXTENT_LIST
        other_host = InitiateDCReleaseRequest(1, RemovalPolicy.PRESCRIPTIVE, 0, extents=(Extent(0, 2 * MIB),))
        assert dc_release(fm, other_host) == RC.INVALID_EXTENT_LIST

    @pytest.mark.parametrize("request_", [InitiateDCReleaseRequest(2, 0, 0), InitiateDCReleaseRequest(0, 5, 0)])
    def test_release_invalid_input(self, fm: Client, request_: InitiateDCReleaseRequest) -> None:
        assert dc_release(fm, request_) == RC.INVALID_INPUT

    def test_release_count_mismatch_is_invalid_payload_length(self, fm: Client) -> None:
        body = InitiateDCReleaseRequest(0, 0, 0).encode()[:-4] + (1).to_bytes(4, "little")
        assert code(fm.tunnel(DCD_PORT, Opcode.INITIATE_DC_RELEASE, body)) == RC.INVALID_PAYLOAD_LENGTH


class TestEventsAndFaults:
    """The vendor commands: event records and fault injection."""

    def test_link_down_surprise_removal_hot_add_poison(self, fm: Client) -> None:
        n = events(fm).next_sequence  # 1 on a new switch; a reset goes on numbering
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU)))
        ok(fm.call(VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(GPU + 1)))
        port = GetPhysicalPortStateResponse.decode(
            ok(fm.call(Opcode.GET_PHYSICAL_PORT_STATE, GetPhysicalPortStateRequest((GPU + 1,))))
        ).ports[0]
        assert (port.connected_device_type, port.ltssm_state) == (ConnectedDeviceType.NONE, LTSSMState.DETECT)
        assert bind(fm, 0, 0, GPU + 1) == RC.INVALID_INPUT  # nothing to bind to
        ok(fm.call(VendorOpcode.INJECT_HOT_ADD, InjectHotAddRequest(GPU + 1, HotAddDeviceKind.NVME)))
        assert bind(fm, 0, 0, GPU + 1) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(1, SelectionPolicy.FREE, 0, 2 * MIB)) == RC.SUCCESS
        ok(fm.call(VendorOpcode.INJECT_EXTENT_POISON, InjectExtentPoisonRequest(1, MIB)))
        log = events(fm)
        assert [(r.sequence, r.event_type, r.port_id, r.host_id) for r in log.records] == [
            (n, EventType.LINK_DOWN, GPU, 0xFF),
            (n + 1, EventType.SURPRISE_REMOVAL, GPU + 1, 0xFF),
            (n + 2, EventType.HOT_ADD, GPU + 1, 0xFF),
            (n + 3, EventType.EXTENT_POISONED, DCD_PORT, 1),
        ]
        assert (log.oldest_sequence, log.next_sequence) == (n, n + 4)
        request = GetEventRecordsRequest(n + 1, 1)
        tail = GetEventRecordsResponse.decode(ok(fm.call(VendorOpcode.GET_EVENT_RECORDS, request)))
        assert [r.sequence for r in tail.records] == [n + 1]

    def test_a_reset_never_reuses_a_sequence_number(self, fm: Client) -> None:
        """A reader that keeps its place (the driver's poller) must see the records a reset is followed by."""
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU)))
        before = events(fm).next_sequence
        ok(fm.call(VendorOpcode.RESET))
        assert events(fm).records == ()
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU)))
        assert [r.sequence for r in events(fm, before).records] == [before]

    def test_reset_link_with_port_control(self, fm: Client) -> None:
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU)))
        info = IdentifySwitchDeviceResponse.decode(ok(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)))
        assert GPU not in info.active_port_ids
        ok(fm.call(Opcode.PHYSICAL_PORT_CONTROL, PhysicalPortControlRequest(GPU, PortOpcode.RESET_PPB)))
        info = IdentifySwitchDeviceResponse.decode(ok(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)))
        assert GPU in info.active_port_ids

    @pytest.mark.parametrize(
        ("opcode", "payload"),
        [
            (VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(0).encode()),
            (VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(200).encode()),
            (VendorOpcode.INJECT_HOT_ADD, InjectHotAddRequest(GPU, HotAddDeviceKind.GPU).encode()),
            (VendorOpcode.INJECT_EXTENT_POISON, InjectExtentPoisonRequest(0, 0).encode()),
            (VendorOpcode.INJECT_EXTENT_POISON, InjectExtentPoisonRequest(7, 0).encode()),
        ],
    )
    def test_fault_invalid_input(self, fm: Client, opcode: int, payload: bytes) -> None:
        assert code(fm.call(opcode, payload)) == RC.INVALID_INPUT

    def test_hot_add_unknown_kind_is_invalid_input(self, fm: Client) -> None:
        ok(fm.call(VendorOpcode.INJECT_SURPRISE_REMOVAL, InjectSurpriseRemovalRequest(GPU)))
        assert code(fm.call(VendorOpcode.INJECT_HOT_ADD, InjectHotAddRequest(GPU, 9))) == RC.INVALID_INPUT

    @pytest.mark.parametrize(
        "opcode", [VendorOpcode.GET_EVENT_RECORDS, VendorOpcode.INJECT_BIND_FAILURE, VendorOpcode.RESET]
    )
    def test_vendor_payload_length(self, fm: Client, opcode: int) -> None:
        assert code(fm.call(opcode, b"\x00" * 9)) == RC.INVALID_PAYLOAD_LENGTH

    def test_reset_restores_the_start(self, fm: Client) -> None:
        assert bind(fm, 0, 0, GPU) == RC.SUCCESS
        ok(fm.call(VendorOpcode.INJECT_LINK_DOWN, InjectLinkDownRequest(GPU)))
        ok(fm.call(VendorOpcode.RESET))
        assert vcs_info(fm).vcss[0].vppbs[0].binding_status == VPPBBindingStatus.UNBOUND
        assert events(fm).records == ()


class TestBudgets:
    """Extent and tag tracking limits (in process: the limits are set on the state)."""

    def test_extent_and_tag_budget_is_resources_exhausted(self) -> None:
        switch = Switch(default_topology(), bind_delay=0)
        assert switch.state.dcd is not None
        switch.state.dcd.total_supported_extents = 1
        switch.state.dcd.total_supported_tags = 1
        fm = Client(in_process(switch))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_A)) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_A)) == RC.RESOURCES_EXHAUSTED
        switch.state.dcd.total_supported_extents = 5
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_B)) == RC.RESOURCES_EXHAUSTED

    @staticmethod
    def _budget(fm: Client) -> tuple[int, int]:
        """Available extents and tags, as Get Host DC Region Configuration reports them."""
        response = fm.tunnel(DCD_PORT, Opcode.GET_HOST_DC_REGION_CONFIG, GetHostDCRegionConfigRequest(0))
        config = GetHostDCRegionConfigResponse.decode(ok(response))
        return config.available_extents, config.available_tags

    def test_new_tags_are_counted_together(self) -> None:
        """Two new tags with one tag slot left: refused whole, not checked one at a time against the old set."""
        switch = Switch(default_topology(), bind_delay=0)
        assert switch.state.dcd is not None
        switch.state.dcd.total_supported_tags = 2
        fm = Client(in_process(switch))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_A)) == RC.SUCCESS
        two = (Extent(64 * MIB, 2 * MIB, TAG_B), Extent(70 * MIB, 2 * MIB, b"C" * 16))
        request = InitiateDCAddRequest(0, SelectionPolicy.PRESCRIPTIVE, 0, 0, bytes(16), two)
        assert dc_add(fm, request) == RC.RESOURCES_EXHAUSTED
        assert self._budget(fm) == (switch.state.dcd.total_supported_extents - 1, 1)
        one_new = (Extent(64 * MIB, 2 * MIB, TAG_B), Extent(70 * MIB, 2 * MIB, TAG_A))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.PRESCRIPTIVE, 0, 0, bytes(16), one_new)) == RC.SUCCESS
        assert self._budget(fm) == (switch.state.dcd.total_supported_extents - 3, 0)

    def test_a_release_that_splits_needs_an_extent_slot(self) -> None:
        """Cutting the middle out of an extent adds one: refused with no slot left, allowed at the ends."""
        switch = Switch(default_topology(), bind_delay=0)
        assert switch.state.dcd is not None
        switch.state.dcd.total_supported_extents = 1
        fm = Client(in_process(switch))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 6 * MIB, TAG_A)) == RC.SUCCESS
        middle = InitiateDCReleaseRequest(0, RemovalPolicy.PRESCRIPTIVE, 2 * MIB, extents=(Extent(2 * MIB, 2 * MIB),))
        assert dc_release(fm, middle) == RC.RESOURCES_EXHAUSTED
        assert [(e.start_dpa, e.length) for e in extents(fm, 0).extents] == [(0, 6 * MIB)]
        assert self._budget(fm) == (0, switch.state.dcd.total_supported_tags - 1)
        end = InitiateDCReleaseRequest(0, RemovalPolicy.PRESCRIPTIVE, 2 * MIB, extents=(Extent(4 * MIB, 2 * MIB),))
        assert dc_release(fm, end) == RC.SUCCESS
        assert [(e.start_dpa, e.length) for e in extents(fm, 0).extents] == [(0, 4 * MIB)]

    def test_counts_never_go_negative(self) -> None:
        """Limits lowered below what is held (a test's knob): the region configuration still answers, with 0."""
        switch = Switch(default_topology(), bind_delay=0)
        assert switch.state.dcd is not None
        fm = Client(in_process(switch))
        assert dc_add(fm, InitiateDCAddRequest(0, SelectionPolicy.FREE, 0, 2 * MIB, TAG_A)) == RC.SUCCESS
        assert dc_add(fm, InitiateDCAddRequest(1, SelectionPolicy.FREE, 0, 2 * MIB, TAG_B)) == RC.SUCCESS
        switch.state.dcd.total_supported_extents = switch.state.dcd.total_supported_tags = 1
        assert self._budget(fm) == (0, 0)


class TestTopologyLimits:
    """A topology the FM API's fields cannot carry is refused when it is built, not answered Internal Error."""

    def test_the_largest_switch_answers(self) -> None:
        """255 ports (the MLD on the last), and each VCS 255 vPPBs: 253 DSPs and 2 LDs."""
        fm = Client(in_process(Switch(default_topology(gpus=252, ld_count=2, mld_capacity=4 * GIB, dc_capacity=0))))
        info = IdentifySwitchDeviceResponse.decode(ok(fm.call(Opcode.IDENTIFY_SWITCH_DEVICE)))
        assert (info.number_of_physical_ports, info.total_number_of_vppbs) == (255, 2 * 255)
        (vcs,) = vcs_info(fm).vcss
        assert vcs.number_of_vppbs == len(vcs.vppbs) == 255

    def test_the_largest_mld_answers(self) -> None:
        fm = Client(in_process(Switch(default_topology(gpus=1, ld_count=16, mld_capacity=4 * GIB, dc_capacity=0))))
        inner = fm.tunnel(3, Opcode.GET_LD_ALLOCATIONS, GetLDAllocationsRequest(0, 0xFF))
        assert len(GetLDAllocationsResponse.decode(ok(inner)).allocations) == 16
        assert vcs_info(fm).vcss[0].number_of_vppbs == 1 + 1 + 16

    @pytest.mark.parametrize(
        ("topology", "refusal"),
        [
            ({"gpus": 254, "ld_count": 0, "dc_capacity": 0}, "at most 255 physical ports"),
            ({"gpus": 1, "ld_count": 17, "mld_capacity": 17 * GIB, "dc_capacity": 0}, "ld_count must be at most 16"),
            ({"gpus": 240, "ld_count": 16, "mld_capacity": 4 * GIB, "dc_capacity": 0}, "at most 255 vPPBs"),
        ],
        ids=["ports", "lds", "vppbs"],
    )
    def test_refused(self, topology: dict[str, int], refusal: str) -> None:
        with pytest.raises(ValueError, match=refusal):
            default_topology(**topology)
