"""What every group of command handlers shares: the switch state and the lookups that refuse a bad id."""

from __future__ import annotations

from disagg_cxl_switch.emulator.errors import CommandError
from disagg_cxl_switch.emulator.events import EventLog
from disagg_cxl_switch.emulator.state import PhysicalPort, PortRole, SwitchState
from disagg_cxl_switch.returncodes import ReturnCode


class HandlerBase:
    """The state the handlers read and change; `Switch` sets these attributes."""

    state: SwitchState
    events: EventLog

    def _dsp(self, port_id: int) -> PhysicalPort:
        port = self.state.port(port_id)
        if port is None or port.role is not PortRole.DSP:
            raise CommandError(ReturnCode.INVALID_INPUT, f"port {port_id} is not a downstream port")
        return port
