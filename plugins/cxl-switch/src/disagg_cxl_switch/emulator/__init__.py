"""An emulated CXL switch that answers the FM API over CCI messages, run as its own process.

`state` holds the topology, `handlers.Switch` answers requests against it, `server` serves it on a unix socket
or loopback TCP (``python -m disagg_cxl_switch.emulator``). See docs/cxl-fm-api.md, section "The emulator".
"""

from __future__ import annotations

from disagg_cxl_switch.emulator.config import EmulatorConfig
from disagg_cxl_switch.emulator.handlers import DEFAULT_BIND_DELAY, Switch
from disagg_cxl_switch.emulator.state import SwitchState, default_topology

__all__ = ["DEFAULT_BIND_DELAY", "EmulatorConfig", "Switch", "SwitchState", "default_topology"]
