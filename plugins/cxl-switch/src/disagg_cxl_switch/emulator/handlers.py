"""The emulated switch's CCI: one handler per opcode, each decoding its request, checking it against the state,
changing the state and encoding the response.

`Switch.handle` is the whole contract: a request `CCIMessage` in, its response out, never an exception. The
switch's own CCI answers the Physical Switch (51h), Virtual Switch (52h) and MLD Port (53h) sets, Background
Operation Status, and the vendor commands; the MLD's (54h) and the DCD's (56h) commands are reached only by
tunnelling (5300h) to their port, as on hardware, where those sets live in the device and not in the switch.
The DCD's handlers are in `dcd_handlers`, the vendor-specific ones in `vendor_handlers`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

from disagg_cxl_switch.cci import CCIMessage, MessageCategory
from disagg_cxl_switch.emulator.background import (
    BACKGROUND_OPERATION_STATUS,
    BackgroundOperations,
    BackgroundOperationStatusRequest,
)
from disagg_cxl_switch.emulator.dcd_handlers import DCDHandlers
from disagg_cxl_switch.emulator.errors import CommandError
from disagg_cxl_switch.emulator.events import EventLog, EventType
from disagg_cxl_switch.emulator.reply import Handler, Reply
from disagg_cxl_switch.emulator.state import (
    CXL_VERSION_2_0,
    ConnectedDeviceType,
    DeviceKind,
    MultiLogicalDevice,
    PortRole,
    SwitchState,
)
from disagg_cxl_switch.emulator.vendor_handlers import VendorHandlers
from disagg_cxl_switch.errors import CCIFormatError
from disagg_cxl_switch.fmapi import (
    LD_ID_NOT_MLD,
    BindVPPBRequest,
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
    Opcode,
    PhysicalPortControlRequest,
    PortConfigurationState,
    PortInfo,
    PortOpcode,
    SetLDAllocationsRequest,
    SetLDAllocationsResponse,
    TunnelManagementCommandRequest,
    TunnelManagementCommandResponse,
    TunnelTargetType,
    UnbindOption,
    UnbindVPPBRequest,
    VCSInfo,
    VCSState,
    VPPBBindingStatus,
    VPPBInfo,
)
from disagg_cxl_switch.fmapi.vcs import vppb_entries_returned
from disagg_cxl_switch.returncodes import ReturnCode

log = logging.getLogger(__name__)

DEFAULT_BIND_DELAY = 0.020
"""Seconds a Bind or Unbind vPPB runs in the background before it completes."""

_NO_ID = 0xFF
_LINK_FLAG_PERST = 1 << 1  # link state flags bit 1: PERST asserted (emulator choice, see docs)
_SUPPORTED_LINK_SPEEDS = 0b11111  # 2.5 to 32 GT/s
_CXL_MODES_68B_FLIT = 0x01


class Switch(DCDHandlers, VendorHandlers):
    """The switch's CCI over a `SwitchState`: handles requests one at a time, in the order given.

    `clock` is injectable so that tests control when background operations complete; `bind_delay` is how long
    Bind and Unbind vPPB run in the background.
    """

    def __init__(
        self,
        state: SwitchState,
        *,
        bind_delay: float = DEFAULT_BIND_DELAY,
        clock: Callable[[], float] = time.monotonic,
        event_capacity: int = 256,
    ) -> None:
        self._initial = copy.deepcopy(state)
        self._clock = clock
        self._event_capacity = event_capacity
        self.bind_delay = bind_delay
        self.reset()
        self._switch_handlers: dict[int, Handler] = {
            BACKGROUND_OPERATION_STATUS: self._background_operation_status,
            Opcode.IDENTIFY_SWITCH_DEVICE: self._identify_switch_device,
            Opcode.GET_PHYSICAL_PORT_STATE: self._get_physical_port_state,
            Opcode.PHYSICAL_PORT_CONTROL: self._physical_port_control,
            Opcode.GET_VIRTUAL_CXL_SWITCH_INFO: self._get_virtual_cxl_switch_info,
            Opcode.BIND_VPPB: self._bind_vppb,
            Opcode.UNBIND_VPPB: self._unbind_vppb,
            Opcode.TUNNEL_MANAGEMENT_COMMAND: self._tunnel_management_command,
            **self.vendor_handlers(),
        }
        self._mld_handlers: dict[int, Handler] = {
            Opcode.GET_LD_INFO: self._get_ld_info,
            Opcode.GET_LD_ALLOCATIONS: self._get_ld_allocations,
            Opcode.SET_LD_ALLOCATIONS: self._set_ld_allocations,
        }
        self._dcd_handlers = self.dcd_handlers()

    def reset(self) -> None:
        """Back to the topology given at construction, with an empty event log and nothing running or armed.
        The log's numbers go on from where they were: they are never reused (a reader would skip new records)."""
        self.state = copy.deepcopy(self._initial)
        before = getattr(self, "events", None)
        self.events = EventLog(self._event_capacity, first=before.next_sequence if before is not None else 1)
        self.background = BackgroundOperations(self._clock)
        self.fail_next_bind = False

    # -- dispatch ---------------------------------------------------------------------------------------------

    def handle(self, request: CCIMessage) -> CCIMessage:
        """The response to one request; every failure is a return code, never an exception."""
        self.background.poll()
        return self._dispatch(self._switch_handlers, request)

    @staticmethod
    def _dispatch(handlers: dict[int, Handler], request: CCIMessage) -> CCIMessage:
        if request.category is not MessageCategory.REQUEST:
            return request.response(ReturnCode.INVALID_INPUT)
        handler = handlers.get(request.opcode)
        if handler is None:
            return request.response(ReturnCode.UNSUPPORTED)
        try:
            reply = handler(request.payload)
        except CCIFormatError as exc:
            log.debug("opcode %04Xh: malformed payload: %s", request.opcode, exc)
            return request.response(ReturnCode.INVALID_PAYLOAD_LENGTH)
        except CommandError as exc:
            log.debug("opcode %04Xh: %s", request.opcode, exc)
            return request.response(exc.return_code)
        except Exception:
            log.exception("opcode %04Xh: handler failed", request.opcode)
            return request.response(ReturnCode.INTERNAL_ERROR)
        return request.response(reply.return_code, reply.payload, background_operation=reply.background)

    # -- lookups ----------------------------------------------------------------------------------------------

    def _mld(self) -> MultiLogicalDevice:
        if self.state.mld is None:  # pragma: no cover - only reached through a tunnel to the MLD's port
            raise CommandError(ReturnCode.UNSUPPORTED, "no MLD")
        return self.state.mld

    # -- generic: Background Operation Status (0002h) ----------------------------------------------------------

    def _background_operation_status(self, data: bytes) -> Reply:
        BackgroundOperationStatusRequest.decode(data)
        return Reply(payload=self.background.status().encode())

    # -- Physical Switch (51h) --------------------------------------------------------------------------------

    def _identify_switch_device(self, data: bytes) -> Reply:
        IdentifySwitchDeviceRequest.decode(data)
        s = self.state
        vppbs = s.vppbs()
        return Reply(
            payload=IdentifySwitchDeviceResponse(
                ingress_port_id=0,
                number_of_physical_ports=len(s.ports),
                number_of_vcss=len(s.vcss),
                active_port_ids=frozenset(p.port_id for p in s.ports if p.link_up and not p.perst_asserted),
                active_vcs_ids=frozenset(v.vcs_id for v in s.vcss),
                total_number_of_vppbs=len(vppbs),
                number_of_bound_vppbs=sum(v.is_bound for v in vppbs),
                number_of_hdm_decoders=s.number_of_hdm_decoders,
            ).encode()
        )

    def _port_info(self, port_id: int) -> PortInfo:
        port = self.state.port(port_id)
        if port is None:
            return PortInfo(port_id, PortConfigurationState.INVALID_PORT_ID, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        device_type = port.device.device_type if port.device else ConnectedDeviceType.NONE
        is_cxl = device_type >= ConnectedDeviceType.CXL_TYPE_1
        up = port.link_up and not port.perst_asserted and port.device is not None
        mld = self.state.mld
        return PortInfo(
            port_id=port.port_id,
            current_port_configuration_state=(
                PortConfigurationState.USP if port.role is PortRole.USP else PortConfigurationState.DSP
            ),
            connected_device_cxl_version=CXL_VERSION_2_0 if is_cxl else 0,
            connected_device_type=device_type,
            supported_cxl_modes=_CXL_MODES_68B_FLIT,
            maximum_link_width=port.maximum_link_width,
            negotiated_link_width=port.maximum_link_width if up else 0,
            supported_link_speeds_vector=_SUPPORTED_LINK_SPEEDS,
            max_link_speed=port.max_link_speed,
            current_link_speed=port.max_link_speed if up else 0,
            ltssm_state=port.ltssm_state,
            first_negotiated_lane_number=0,
            link_state_flags=_LINK_FLAG_PERST if port.perst_asserted else 0,
            supported_ld_count=mld.ld_count
            if mld is not None and device_type == ConnectedDeviceType.CXL_TYPE_3_MLD
            else 0,
        )

    def _get_physical_port_state(self, data: bytes) -> Reply:
        request = GetPhysicalPortStateRequest.decode(data)
        ports = tuple(self._port_info(p) for p in request.port_ids)
        return Reply(payload=GetPhysicalPortStateResponse(ports).encode())

    def _physical_port_control(self, data: bytes) -> Reply:
        request = PhysicalPortControlRequest.decode(data)
        port = self._dsp(request.ppb_id)
        if request.port_opcode == PortOpcode.ASSERT_PERST:
            port.perst_asserted = True
            if port.link_up:
                port.link_up = False
                self.events.record(EventType.LINK_DOWN, port_id=port.port_id)
        elif request.port_opcode in (PortOpcode.DEASSERT_PERST, PortOpcode.RESET_PPB):
            port.perst_asserted = False
            if not port.link_up and port.device is not None:
                port.link_up = True
                self.events.record(EventType.LINK_UP, port_id=port.port_id)
        else:
            raise CommandError(ReturnCode.INVALID_INPUT, f"port opcode {request.port_opcode:#x}")
        return Reply()

    # -- Virtual Switch (52h) ---------------------------------------------------------------------------------

    def _get_virtual_cxl_switch_info(self, data: bytes) -> Reply:
        request = GetVirtualCxlSwitchInfoRequest.decode(data)
        blocks = []
        for vcs_id in request.vcs_ids:
            vcs = self.state.vcs(vcs_id)
            if vcs is None:
                blocks.append(VCSInfo(vcs_id, VCSState.INVALID_VCS_ID, 0, 0, ()))
                continue
            count = vppb_entries_returned(len(vcs.vppbs), request.start_vppb, request.vppb_list_limit)
            window = vcs.vppbs[request.start_vppb : request.start_vppb + count]
            entries = tuple(
                VPPBInfo(
                    v.binding_status,
                    _NO_ID if v.bound_port_id is None else v.bound_port_id,
                    _NO_ID if v.bound_ld_id is None else v.bound_ld_id,
                )
                for v in window
            )
            blocks.append(VCSInfo(vcs.vcs_id, VCSState.ENABLED, vcs.usp_id, len(vcs.vppbs), entries))
        response = GetVirtualCxlSwitchInfoResponse(tuple(blocks))
        return Reply(payload=response.encode(request.start_vppb, request.vppb_list_limit))

    def _refuse_if_busy(self) -> None:
        if self.background.running:
            raise CommandError(ReturnCode.BUSY, "a background operation is running")

    def _bind_vppb(self, data: bytes) -> Reply:
        """Bind vPPB, in the background. An armed Inject Bind Failure is spent by the first Bind vPPB that decodes,
        whatever becomes of it: one refused here must not leave it armed for a later bind, of another device or
        another client, that nobody meant to fail."""
        request = BindVPPBRequest.decode(data)
        fail, self.fail_next_bind = self.fail_next_bind, False
        self._refuse_if_busy()
        vcs = self.state.vcs(request.vcs_id)
        if vcs is None or not 0 <= request.vppb_id < len(vcs.vppbs):
            raise CommandError(ReturnCode.INVALID_INPUT, "no such VCS or vPPB")
        vppb = vcs.vppbs[request.vppb_id]
        if vppb.binding_status != VPPBBindingStatus.UNBOUND:
            raise CommandError(ReturnCode.INVALID_INPUT, "vPPB is not unbound")
        port = self._dsp(request.physical_port_id)
        if port.device is None:
            raise CommandError(ReturnCode.INVALID_INPUT, "no device behind the port")
        mld = self.state.mld
        ld_id: int | None = None
        if port.device.kind is DeviceKind.MLD and mld is not None:
            if request.ld_id == LD_ID_NOT_MLD or request.ld_id >= mld.ld_count:
                raise CommandError(ReturnCode.INVALID_INPUT, f"LD {request.ld_id:#x} does not exist")
            ld_id = request.ld_id
            if self.state.binding_of(port.port_id, ld_id) is not None:
                raise CommandError(ReturnCode.INVALID_INPUT, "LD already bound")
        else:
            if request.ld_id != LD_ID_NOT_MLD:
                raise CommandError(ReturnCode.INVALID_INPUT, "LD id given for a port without an MLD")
            if self.state.binding_of(port.port_id, None) is not None:
                raise CommandError(ReturnCode.INVALID_INPUT, "port already bound")
        vppb.binding_status = VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS
        vppb.bound_port_id, vppb.bound_ld_id = port.port_id, ld_id

        def complete() -> ReturnCode:
            if fail:
                vppb.binding_status = VPPBBindingStatus.UNBOUND
                vppb.bound_port_id = vppb.bound_ld_id = None
                return ReturnCode.INTERNAL_ERROR
            vppb.binding_status = VPPBBindingStatus.BOUND_PHYSICAL_PORT if ld_id is None else VPPBBindingStatus.BOUND_LD
            return ReturnCode.SUCCESS

        self.background.start(Opcode.BIND_VPPB, self.bind_delay, complete)
        return Reply(ReturnCode.BACKGROUND_COMMAND_STARTED, background=True)

    def _unbind_vppb(self, data: bytes) -> Reply:
        request = UnbindVPPBRequest.decode(data)
        self._refuse_if_busy()
        vcs = self.state.vcs(request.vcs_id)
        if vcs is None or not 0 <= request.vppb_id < len(vcs.vppbs):
            raise CommandError(ReturnCode.INVALID_INPUT, "no such VCS or vPPB")
        if request.unbind_option not in tuple(UnbindOption):
            raise CommandError(ReturnCode.INVALID_INPUT, f"unbind option {request.unbind_option:#x}")
        vppb = vcs.vppbs[request.vppb_id]
        if not vppb.is_bound:
            raise CommandError(ReturnCode.INVALID_INPUT, "vPPB is not bound")
        vppb.binding_status = VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS

        def complete() -> ReturnCode:
            vppb.binding_status = VPPBBindingStatus.UNBOUND
            vppb.bound_port_id = vppb.bound_ld_id = None
            return ReturnCode.SUCCESS

        self.background.start(Opcode.UNBIND_VPPB, self.bind_delay, complete)
        return Reply(ReturnCode.BACKGROUND_COMMAND_STARTED, background=True)

    # -- MLD Port (53h) ---------------------------------------------------------------------------------------

    def _tunnel_management_command(self, data: bytes) -> Reply:
        request = TunnelManagementCommandRequest.decode(data)
        if request.target_type != TunnelTargetType.PORT_OR_LD_BASED:
            raise CommandError(ReturnCode.INVALID_INPUT, f"target type {request.target_type:#x}")
        port = self._dsp(request.port_or_ld_id)
        kind = port.device.kind if port.device is not None else None
        if kind is DeviceKind.MLD and self.state.mld is not None:
            handlers = self._mld_handlers
        elif kind is DeviceKind.DCD and self.state.dcd is not None:
            handlers = self._dcd_handlers
        else:
            raise CommandError(ReturnCode.INVALID_INPUT, f"port {port.port_id} has no FM-managed device")
        if not port.link_up or port.perst_asserted:
            raise CommandError(ReturnCode.RETRY_REQUIRED, f"link of port {port.port_id} is down")
        inner = self._dispatch(handlers, request.command)
        return Reply(payload=TunnelManagementCommandResponse(inner).encode())

    # -- MLD Component (54h), through the tunnel --------------------------------------------------------------

    def _get_ld_info(self, data: bytes) -> Reply:
        GetLDInfoRequest.decode(data)
        mld = self._mld()
        return Reply(payload=GetLDInfoResponse(mld.memory_size, mld.ld_count, 0).encode())

    def _get_ld_allocations(self, data: bytes) -> Reply:
        request = GetLDAllocationsRequest.decode(data)
        mld = self._mld()
        if request.start_ld_id >= mld.ld_count:
            raise CommandError(ReturnCode.INVALID_INPUT, f"start LD {request.start_ld_id} does not exist")
        window = mld.allocations[request.start_ld_id :][: request.ld_allocation_list_limit]
        response = GetLDAllocationsResponse(mld.ld_count, mld.granularity, request.start_ld_id, tuple(window))
        return Reply(payload=response.encode())

    def _set_ld_allocations(self, data: bytes) -> Reply:
        request = SetLDAllocationsRequest.decode(data)
        mld = self._mld()
        start, new = request.start_ld_id, request.allocations
        if not new or start + len(new) > mld.ld_count:
            raise CommandError(ReturnCode.INVALID_INPUT, "LD range outside the MLD")
        proposed = list(mld.allocations)
        proposed[start : start + len(new)] = new
        if mld.allocated_bytes(proposed) > mld.memory_size:
            raise CommandError(ReturnCode.RESOURCES_EXHAUSTED, "allocations exceed the MLD's memory")
        mld.allocations = proposed
        return Reply(payload=SetLDAllocationsResponse(start, tuple(new)).encode())
