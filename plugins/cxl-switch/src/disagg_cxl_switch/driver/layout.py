"""How the switch's ports and VCSs map to the model: which port is which device, which VCS is which host.

Fixed when the driver starts: the ports a switch has do not change, only what is behind them. A PCIe endpoint
does not say on the wire whether it is a GPU, an NVMe drive or a NIC (all are Connected Device Type PCIe), so
the driver takes that from its options, in the emulator's port order (GPUs, then NVMe, then NICs); a CXL
Type-3 single logical device is the DCD and a multi-logical device the MLD, each carved through its pool and
never bound whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
from disagg.errors import ConfigError, FabricUnavailableError
from disagg.interfaces import CallContext
from disagg.model import (
    Capacity,
    Device,
    DeviceKind,
    Health,
    Host,
    Link,
    Port,
    PortKind,
    Switch,
    SwitchKind,
    Topology,
    device_id,
)

from disagg_cxl_switch.driver.client import CCIClient, decode, malformed
from disagg_cxl_switch.driver.options import Options
from disagg_cxl_switch.emulator.state import ConnectedDeviceType, LTSSMState
from disagg_cxl_switch.fmapi import (
    GetPhysicalPortStateRequest,
    GetPhysicalPortStateResponse,
    GetVirtualCxlSwitchInfoRequest,
    GetVirtualCxlSwitchInfoResponse,
    IdentifySwitchDeviceResponse,
    Opcode,
    PortConfigurationState,
    PortInfo,
    VCSInfo,
    VPPBBindingStatus,
)

if TYPE_CHECKING:
    from disagg.model import PoolInfo

HOST_LINK_LATENCY_NS = 150
DEVICE_LINK_LATENCY_NS = 100
_MODELS = {
    DeviceKind.GPU: "emulated PCIe GPU",
    DeviceKind.NVME: "emulated NVMe drive",
    DeviceKind.NIC: "emulated NIC",
}
_MEMORY = {ConnectedDeviceType.CXL_TYPE_3_SLD: "dcd", ConnectedDeviceType.CXL_TYPE_3_MLD: "mld"}
"""Which pool a CXL Type-3 port's memory is carved through; also the ``pool_kind`` attribute of its device."""
_CONFIGURATION_STATE_MASK = 0x0F


@attrs.frozen
class PortView:
    """A downstream port now: whether a device is behind it and whether its link is up."""

    info: PortInfo

    @property
    def present(self) -> bool:
        return self.info.connected_device_type != ConnectedDeviceType.NONE

    @property
    def health(self) -> Health:
        return Health.OK if self.present and self.info.ltssm_state == LTSSMState.L0 else Health.FAILED


@attrs.frozen
class SwitchView:
    fabric: str
    switch_id: str
    vcs_of: dict[str, int]
    host_of: dict[int, str]
    kind_of: dict[int, DeviceKind]
    port_of: dict[str, int]
    device_of: dict[int, str]
    dcd_port: int | None
    mld_port: int | None

    @property
    def carved_ports(self) -> frozenset[int]:
        """The ports whose memory is carved through a pool rather than bound whole."""
        return frozenset(p for p in (self.dcd_port, self.mld_port) if p is not None)

    @classmethod
    def read(cls, client: CCIClient, fabric: str, options: Options) -> SwitchView:
        ident = decode(IdentifySwitchDeviceResponse.decode, client.call(Opcode.IDENTIFY_SWITCH_DEVICE))
        ports = _port_states(client, range(ident.number_of_physical_ports), None)
        vcs_ids = sorted(ident.active_vcs_ids)
        if len(vcs_ids) != len(options.host_names):
            raise ConfigError(
                f"fabric {fabric!r} (driver cxl-switch): the switch has {len(vcs_ids)} VCSs but "
                f"{len(options.host_names)} hosts are named",
                field="hosts",
            )
        host_of = dict(zip(vcs_ids, options.host_names, strict=True))
        slots = [DeviceKind.GPU] * options.gpus + [DeviceKind.NVME] * options.nvme + [DeviceKind.NIC] * options.nics
        kind_of: dict[int, DeviceKind] = {}
        memory: dict[str, int] = {}
        dsps = [p for p in ports if _configuration_state(p) == PortConfigurationState.DSP]
        for index, port in enumerate(dsps):
            pool_kind = _MEMORY.get(_device_type(port))
            if pool_kind is not None and pool_kind not in memory:
                kind_of[port.port_id] = DeviceKind.CXL_MEMORY
                memory[pool_kind] = port.port_id
            elif index < len(slots):
                kind_of[port.port_id] = slots[index]
        device_of = {port: device_id(fabric, f"port{port}") for port in kind_of}
        return cls(
            fabric,
            device_id(fabric, "switch0"),
            {h: v for v, h in host_of.items()},
            host_of,
            kind_of,
            {d: p for p, d in device_of.items()},
            device_of,
            memory.get("dcd"),
            memory.get("mld"),
        )

    def read_port(self, client: CCIClient, port: int, ctx: CallContext | None = None) -> PortView:
        return PortView(_port_states(client, [port], ctx)[0])

    def read_ports(self, client: CCIClient, ctx: CallContext | None = None) -> dict[int, PortView]:
        """Every device's port now, by port id."""
        return {p.port_id: PortView(p) for p in _port_states(client, sorted(self.kind_of), ctx)}

    def vcss(self, client: CCIClient, ctx: CallContext | None = None) -> tuple[VCSInfo, ...]:
        return _vcs_info(client, GetVirtualCxlSwitchInfoRequest(0, 0xFF, tuple(self.host_of)), ctx)

    def bound(self, client: CCIClient, ctx: CallContext | None = None) -> list[tuple[str, int, int]]:
        """(host, vPPB, port) of every vPPB bound whole to one of the driver's device ports."""
        return [
            (self.host_of[vcs.vcs_id], vppb_id, vppb.bound_port_id)
            for vcs in self.vcss(client, ctx)
            for vppb_id, vppb in enumerate(vcs.vppbs)
            if vppb.binding_status == VPPBBindingStatus.BOUND_PHYSICAL_PORT and vppb.bound_port_id in self.device_of
        ]

    def towards(self, client: CCIClient, vcs_id: int, port: int, ctx: CallContext | None) -> tuple[list[int], bool]:
        """The vPPBs of VCS ``vcs_id`` bound whole to ``port``, and whether a Bind or Unbind vPPB of one of its
        vPPBs still runs towards ``port`` (or towards a port the switch does not name while it runs)."""
        held, running = [], False
        for vcs in self.vcss(client, ctx):
            if vcs.vcs_id != vcs_id:
                continue
            for vppb_id, vppb in enumerate(vcs.vppbs):
                if vppb.binding_status == VPPBBindingStatus.BOUND_PHYSICAL_PORT and vppb.bound_port_id == port:
                    held.append(vppb_id)
                elif vppb.binding_status == VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS:
                    running |= vppb.bound_port_id == port or vppb.bound_port_id not in self.device_of
        return held, running

    def holds(
        self, client: CCIClient, vcs_id: int, vppb_id: int, port: int, *, ld: int | None, ctx: CallContext | None
    ) -> bool | None:
        """Whether vPPB ``vppb_id`` of VCS ``vcs_id`` is bound to ``port`` (to its LD ``ld`` when given, else whole);
        None while a bind or unbind of it runs, or when the switch does not report it."""
        vcss = _vcs_info(client, GetVirtualCxlSwitchInfoRequest(vppb_id, 1, (vcs_id,)), ctx)
        entries = [vcs.vppbs[0] for vcs in vcss if vcs.vppbs]
        if len(entries) != 1 or entries[0].binding_status == VPPBBindingStatus.BIND_OR_UNBIND_IN_PROGRESS:
            return None
        entry = entries[0]
        if ld is None:
            return entry.binding_status == VPPBBindingStatus.BOUND_PHYSICAL_PORT and entry.bound_port_id == port
        return (
            entry.binding_status == VPPBBindingStatus.BOUND_LD
            and entry.bound_port_id == port
            and entry.bound_ld_id == ld
        )

    def free_vppb(self, client: CCIClient, vcs_id: int, ctx: CallContext) -> int | None:
        """The lowest unbound vPPB of the VCS, or None when every one is bound or being bound."""
        for vcs in self.vcss(client, ctx):
            if vcs.vcs_id == vcs_id:
                for vppb_id, vppb in enumerate(vcs.vppbs):
                    if vppb.binding_status == VPPBBindingStatus.UNBOUND:
                        return vppb_id
        return None

    def topology(self, client: CCIClient, links_down: set[str], pools: dict[int, list[PoolInfo]]) -> Topology:
        """The fabric now; ``pools`` are the pools that can be described now, by the port of the device they
        carve (a DCD of several regions, one per region), the device's capacity their sum. A pool whose failed
        device has not yet given its geometry is left out (the composer then counts its memory as out of
        reach); its device is listed, failed and without capacity."""
        states = self.read_ports(client)
        carves = {port: kind for kind, port in (("dcd", self.dcd_port), ("mld", self.mld_port)) if port is not None}
        devices = []
        for port, kind in sorted(self.kind_of.items()):
            view = states[port]
            carved = pools.get(port)
            pool_kind = carves.get(port)
            model = _MODELS[kind] if pool_kind is None else f"emulated CXL Type-3 {pool_kind.upper()}"
            attributes: dict[str, int | str] = {"port": port}
            if pool_kind is not None:
                attributes["pool_kind"] = pool_kind
            devices.append(
                Device(
                    id=self.device_of[port],
                    fabric=self.fabric,
                    kind=kind,
                    serial=f"{self.fabric}-port{port}",
                    vendor="disagg",
                    model=model,
                    switch=self.switch_id,
                    link_latency_ns=DEVICE_LINK_LATENCY_NS,
                    attributes=attributes,
                    capacity=_capacity_of(carved) if carved else None,
                    health=view.health,
                )
            )
        hosts = tuple(Host(id=h, switch=self.switch_id) for h in self.vcs_of)
        links = tuple(Link(h, self.switch_id, HOST_LINK_LATENCY_NS, 64.0, up=h not in links_down) for h in self.vcs_of)
        ports = tuple(Port(f"usp{v}", PortKind.UPSTREAM, h, h not in links_down) for h, v in self.vcs_of.items())
        ports += tuple(
            Port(f"port{p}", PortKind.DOWNSTREAM, self.device_of[p], states[p].health is Health.OK)
            for p in sorted(self.kind_of)
        )
        switch = Switch(self.switch_id, self.fabric, SwitchKind.CXL, "disagg", "emulated CXL switch", ports)
        infos = tuple(info for p in sorted(pools) for info in pools[p])
        return Topology(self.fabric, hosts, (switch,), tuple(devices), links, infos)


def _capacity_of(pools: list[PoolInfo]) -> Capacity:
    """A device's capacity: all its pools hold, in the largest of their blocks."""
    return Capacity(sum(p.capacity.total_bytes for p in pools), max(p.capacity.block_bytes for p in pools))


def _configuration_state(port: PortInfo) -> int:
    """Current Port Configuration State: bits[3:0] of its byte; bits[7:4] are reserved, whatever a switch puts
    there."""
    return port.current_port_configuration_state & _CONFIGURATION_STATE_MASK


def _device_type(port: PortInfo) -> ConnectedDeviceType:
    """The port's Connected Device Type. The FM API leaves every value past the defined ones reserved (no vendor
    range), so one the driver does not know is the switch answering outside the API: the fabric failing."""
    try:
        return ConnectedDeviceType(port.connected_device_type)
    except ValueError:
        raise FabricUnavailableError(
            f"the CXL switch reports the reserved Connected Device Type {port.connected_device_type:#04x} on "
            f"port {port.port_id}"
        ) from None


def _port_states(client: CCIClient, ports: Iterable[int], ctx: CallContext | None) -> tuple[PortInfo, ...]:
    """Get Physical Port State of ``ports``: a block for each port asked about and for no other, or `malformed`
    (a port left out, or one not asked about, would be read as another's state)."""
    ids = tuple(ports)
    raw = client.call(Opcode.GET_PHYSICAL_PORT_STATE, GetPhysicalPortStateRequest(ids), ctx)
    got = decode(GetPhysicalPortStateResponse.decode, raw).ports
    _check_ids("Get Physical Port State", "port", ids, [p.port_id for p in got])
    return got


def _vcs_info(
    client: CCIClient, request: GetVirtualCxlSwitchInfoRequest, ctx: CallContext | None
) -> tuple[VCSInfo, ...]:
    """Get Virtual CXL Switch Info: a block for each VCS asked about and for no other, or `malformed`."""
    raw = client.call(Opcode.GET_VIRTUAL_CXL_SWITCH_INFO, request, ctx)
    window = request.start_vppb, request.vppb_list_limit
    got = decode(lambda data: GetVirtualCxlSwitchInfoResponse.decode(data, *window), raw).vcss
    _check_ids("Get Virtual CXL Switch Info", "VCS", request.vcs_ids, [v.vcs_id for v in got])
    return got


def _check_ids(command: str, what: str, asked: Iterable[int], answered: Iterable[int]) -> None:
    if sorted(asked) != sorted(answered):
        raise malformed(f"{command} asked about {what}s {sorted(asked)} answered {sorted(answered)}")
