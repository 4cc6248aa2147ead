"""The driver reading port information blocks (Get Physical Port State) that a real switch may send and the
emulator never does: reserved bits set beside the Current Port Configuration State, a Connected Device Type the
driver does not know. Served in-process, the blocks rewritten on their way to the driver."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest
from cxl_switch_served import ServedSwitch
from disagg.errors import FabricUnavailableError
from disagg_cxl_switch import CCIMessage
from disagg_cxl_switch.driver import create_fabric
from disagg_cxl_switch.emulator import Switch, default_topology
from disagg_cxl_switch.emulator.state import GIB
from disagg_cxl_switch.fmapi import GetPhysicalPortStateResponse, Opcode, PortInfo

RESERVED_STATE_BITS = 0xF0
"""Bits[7:4] of the Current Port Configuration State byte: reserved."""
RESERVED_DEVICE_TYPE = 0x7F
"""A Connected Device Type no revision of the FM API defines."""
DEVICES = ["f/port2", "f/port3", "f/port4", "f/port5"]
"""Two GPUs, the MLD and the DCD, behind the downstream ports after the two hosts' upstream ports."""

Rewrite = Callable[[PortInfo], PortInfo]


def rewriting(rewrite: Rewrite) -> Callable[[CCIMessage, CCIMessage], CCIMessage]:
    """Every port block of every Get Physical Port State answer passed through ``rewrite``."""

    def respond(request: CCIMessage, response: CCIMessage) -> CCIMessage:
        if request.opcode != Opcode.GET_PHYSICAL_PORT_STATE:
            return response
        ports = GetPhysicalPortStateResponse.decode(response.payload).ports
        payload = GetPhysicalPortStateResponse(tuple(rewrite(p) for p in ports)).encode()
        return attrs.evolve(response, payload=payload)

    return respond


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedSwitch]:
    state = default_topology(gpus=2, ld_count=4, mld_capacity=4 * GIB, dc_capacity=GIB, dc_regions=1)
    with ServedSwitch(Switch(state, bind_delay=0.0), tmp_path / "s.sock") as switch:
        yield switch


def test_reserved_configuration_state_bits_hide_no_port(served: ServedSwitch) -> None:
    served.respond = rewriting(
        lambda p: attrs.evolve(
            p, current_port_configuration_state=p.current_port_configuration_state | RESERVED_STATE_BITS
        )
    )
    fabric = create_fabric("f", {"address": served.address, "gpus": 2})
    try:
        assert sorted(d.id for d in fabric.discover().devices) == DEVICES
        assert sorted(p.kind.value for p in fabric.discover().pools) == ["dcd", "mld"]
    finally:
        fabric.close()


def test_an_unknown_connected_device_type_is_the_fabric_failing(served: ServedSwitch) -> None:
    """The FM API defines no vendor range of Connected Device Types (values past the last defined are reserved),
    so a value the driver does not know is the switch answering outside the API it speaks."""
    served.respond = rewriting(
        lambda p: attrs.evolve(p, connected_device_type=RESERVED_DEVICE_TYPE) if p.port_id == 3 else p
    )
    with pytest.raises(FabricUnavailableError, match="port 3"):
        create_fabric("f", {"address": served.address, "gpus": 2})
