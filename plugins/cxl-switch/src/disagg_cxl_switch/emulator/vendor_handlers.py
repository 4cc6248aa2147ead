"""Vendor-specific handlers (C0xxh): event records, fault injection and reset."""

from __future__ import annotations

from disagg_cxl_switch.emulator import vendor
from disagg_cxl_switch.emulator._base import HandlerBase
from disagg_cxl_switch.emulator.errors import CommandError
from disagg_cxl_switch.emulator.events import EventType
from disagg_cxl_switch.emulator.reply import Handler, Reply
from disagg_cxl_switch.emulator.state import Device, DeviceKind
from disagg_cxl_switch.returncodes import ReturnCode


class VendorHandlers(HandlerBase):
    """Reads the event log and breaks things on purpose, for tests."""

    fail_next_bind: bool

    def reset(self) -> None:
        """Back to the starting topology; `Switch` provides it."""
        raise NotImplementedError

    def vendor_handlers(self) -> dict[int, Handler]:
        return {
            vendor.VendorOpcode.GET_EVENT_RECORDS: self._get_event_records,
            vendor.VendorOpcode.INJECT_LINK_DOWN: self._inject_link_down,
            vendor.VendorOpcode.INJECT_SURPRISE_REMOVAL: self._inject_surprise_removal,
            vendor.VendorOpcode.INJECT_BIND_FAILURE: self._inject_bind_failure,
            vendor.VendorOpcode.INJECT_EXTENT_POISON: self._inject_extent_poison,
            vendor.VendorOpcode.INJECT_HOT_ADD: self._inject_hot_add,
            vendor.VendorOpcode.RESET: self._reset,
        }

    def _get_event_records(self, data: bytes) -> Reply:
        request = vendor.GetEventRecordsRequest.decode(data)
        records = tuple(self.events.read(request.first_sequence, request.max_records))
        response = vendor.GetEventRecordsResponse(self.events.oldest_sequence, self.events.next_sequence, records)
        return Reply(payload=response.encode())

    def _inject_link_down(self, data: bytes) -> Reply:
        port = self._dsp(vendor.InjectLinkDownRequest.decode(data).port_id)
        if port.link_up:
            port.link_up = False
            self.events.record(EventType.LINK_DOWN, port_id=port.port_id)
        return Reply()

    def _inject_surprise_removal(self, data: bytes) -> Reply:
        port = self._dsp(vendor.InjectSurpriseRemovalRequest.decode(data).port_id)
        if port.device is None:
            raise CommandError(ReturnCode.INVALID_INPUT, f"no device behind port {port.port_id}")
        port.device = None
        port.link_up = False
        self.events.record(EventType.SURPRISE_REMOVAL, port_id=port.port_id)
        return Reply()

    def _inject_hot_add(self, data: bytes) -> Reply:
        request = vendor.InjectHotAddRequest.decode(data)
        port = self._dsp(request.port_id)
        if port.device is not None:
            raise CommandError(ReturnCode.INVALID_INPUT, f"port {port.port_id} is occupied")
        try:
            kind = DeviceKind[vendor.HotAddDeviceKind(request.device_kind).name]
        except ValueError:
            raise CommandError(ReturnCode.INVALID_INPUT, f"device kind {request.device_kind:#x}") from None
        port.device = Device(kind, f"{kind.value}-hot{port.port_id}")
        port.link_up = not port.perst_asserted
        self.events.record(EventType.HOT_ADD, port_id=port.port_id)
        return Reply()

    def _reset(self, data: bytes) -> Reply:
        vendor.ResetRequest.decode(data)
        self.reset()
        return Reply()

    def _inject_bind_failure(self, data: bytes) -> Reply:
        vendor.InjectBindFailureRequest.decode(data)
        self.fail_next_bind = True
        return Reply()

    def _inject_extent_poison(self, data: bytes) -> Reply:
        request = vendor.InjectExtentPoisonRequest.decode(data)
        dcd = self.state.dcd
        if dcd is None or not 0 <= request.host_id < dcd.number_of_hosts:
            raise CommandError(ReturnCode.INVALID_INPUT, f"host {request.host_id} has no dynamic capacity")
        extent = next((e for e in dcd.host_extents[request.host_id] if e.start_dpa <= request.dpa < e.end), None)
        if extent is None:
            raise CommandError(ReturnCode.INVALID_INPUT, f"DPA {request.dpa:#x} is not held by the host")
        extent.poisoned = True
        self.events.record(EventType.EXTENT_POISONED, port_id=dcd.port_id, host_id=request.host_id)
        return Reply()
