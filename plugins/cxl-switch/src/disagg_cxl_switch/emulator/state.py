"""The emulated switch's state as plain typed Python: ports, VCSs and vPPBs, the devices behind the ports.

Mutable on purpose: the command handlers change it in place, one request at a time. Nothing here knows the wire
format; `handlers` translates between the FM API payloads and these objects.
"""

from __future__ import annotations

from enum import Enum, IntEnum

import attrs

from disagg_cxl_switch.fmapi import LDAllocation, MemoryGranularity, VPPBBindingStatus

GIB = 1 << 30
MIB = 1 << 20
DC_CAPACITY_UNIT = 256 * MIB
MAX_PHYSICAL_PORTS = 255
"""Identify Switch Device counts the physical ports in one byte."""
MAX_LD_COUNT = 16
"""The most logical devices (LDs) the CXL specification lets one MLD have."""
MAX_VPPBS = 255
"""Get Virtual CXL Switch Info counts a VCS's vPPBs in one byte, and Bind vPPB names one in one byte."""
"""Unit of the total dynamic capacity of Get DCD Info, and the alignment of DC regions."""


class PortRole(Enum):
    """Which side of the switch a physical port faces."""

    USP = "usp"
    DSP = "dsp"


class ConnectedDeviceType(IntEnum):
    """Connected Device Type of a port information block (Get Physical Port State)."""

    NONE = 0x00
    PCIE = 0x01
    CXL_TYPE_1 = 0x02
    CXL_TYPE_2 = 0x03
    CXL_TYPE_3_SLD = 0x04
    CXL_TYPE_3_MLD = 0x05


class LTSSMState(IntEnum):
    """LTSSM State of a port information block."""

    DETECT = 0x00
    POLLING = 0x01
    CONFIGURATION = 0x02
    RECOVERY = 0x03
    L0 = 0x04
    DISABLED = 0x08


class DeviceKind(Enum):
    """What an endpoint is, for the emulator's own bookkeeping (the wire only sees `ConnectedDeviceType`)."""

    HOST = "host"
    GPU = "gpu"
    NVME = "nvme"
    NIC = "nic"
    MLD = "mld"
    DCD = "dcd"


DEVICE_TYPES: dict[DeviceKind, ConnectedDeviceType] = {
    DeviceKind.HOST: ConnectedDeviceType.PCIE,
    DeviceKind.GPU: ConnectedDeviceType.PCIE,
    DeviceKind.NVME: ConnectedDeviceType.PCIE,
    DeviceKind.NIC: ConnectedDeviceType.PCIE,
    DeviceKind.MLD: ConnectedDeviceType.CXL_TYPE_3_MLD,
    DeviceKind.DCD: ConnectedDeviceType.CXL_TYPE_3_SLD,
}

CXL_VERSION_2_0 = 0x02
"""Connected device CXL version bitmask bit for CXL 2.0 (bit 0 is 1.1); PCIe devices report 0."""


@attrs.define
class Device:
    """An endpoint behind a downstream port (or the host behind an upstream port)."""

    kind: DeviceKind
    name: str

    @property
    def device_type(self) -> ConnectedDeviceType:
        return DEVICE_TYPES[self.kind]


@attrs.define
class PhysicalPort:
    """A physical port: its role, what is connected, and whether the link is trained.

    `perst_asserted` is held by Physical Port Control; the link stays down while it is.
    """

    port_id: int
    role: PortRole
    device: Device | None
    link_up: bool = True
    perst_asserted: bool = False
    maximum_link_width: int = 16
    max_link_speed: int = 5  # PCIe 5.0 / CXL 2.0 signalling, 32 GT/s

    @property
    def ltssm_state(self) -> LTSSMState:
        if self.perst_asserted:
            return LTSSMState.DISABLED
        return LTSSMState.L0 if self.link_up else LTSSMState.DETECT


@attrs.define
class VPPB:
    """A virtual PCI-to-PCI bridge of a VCS: unbound, being (un)bound, or bound to a port or to one LD."""

    vppb_id: int
    binding_status: VPPBBindingStatus = VPPBBindingStatus.UNBOUND
    bound_port_id: int | None = None
    bound_ld_id: int | None = None

    @property
    def is_bound(self) -> bool:
        return self.binding_status in (VPPBBindingStatus.BOUND_PHYSICAL_PORT, VPPBBindingStatus.BOUND_LD)


@attrs.define
class VCS:
    """A virtual CXL switch: one host's view, its upstream port and its vPPBs."""

    vcs_id: int
    usp_id: int
    vppbs: list[VPPB]


@attrs.define
class MultiLogicalDevice:
    """A CXL memory device split into LDs; each LD's share is a pair of multipliers of the granularity."""

    port_id: int
    memory_size: int
    granularity: MemoryGranularity
    allocations: list[LDAllocation]

    @property
    def ld_count(self) -> int:
        return len(self.allocations)

    def allocated_bytes(self, allocations: list[LDAllocation] | None = None) -> int:
        unit = self.granularity.unit_bytes
        return sum(
            (a.range_1_allocation_multiplier + a.range_2_allocation_multiplier) * unit
            for a in (self.allocations if allocations is None else allocations)
        )


@attrs.define
class DCRegion:
    """A dynamic capacity region: a DPA range handed out in blocks of `block_size` bytes."""

    base: int
    length: int
    block_size: int
    supported_block_size_mask: int
    sanitize_on_release: bool = False

    @property
    def end(self) -> int:
        return self.base + self.length


@attrs.define
class HostExtent:
    """A DPA range a host holds, with the tag it was added under; `poisoned` is set by fault injection."""

    start_dpa: int
    length: int
    tag: bytes
    region: int
    poisoned: bool = False

    @property
    def end(self) -> int:
        return self.start_dpa + self.length


@attrs.define
class DynamicCapacityDevice:
    """A DCD shared by the hosts: its regions, each host's accepted extents, and pending adds and releases.

    The emulated hosts answer at once (accept every add, return every release), so `pending_adds` and
    `pending_releases` are empty between commands; they exist so that a later, slower host model has a place
    for its offers.
    """

    port_id: int
    number_of_hosts: int
    regions: list[DCRegion]
    host_extents: dict[int, list[HostExtent]]
    generation: dict[int, int]
    total_supported_extents: int = 512
    total_supported_tags: int = 256
    pending_adds: dict[int, list[HostExtent]] = attrs.Factory(dict)
    pending_releases: dict[int, list[HostExtent]] = attrs.Factory(dict)

    @property
    def total_capacity(self) -> int:
        return sum(r.length for r in self.regions)

    def all_extents(self) -> list[HostExtent]:
        return [e for extents in self.host_extents.values() for e in extents]

    def tags_in_use(self) -> set[bytes]:
        return {e.tag for e in self.all_extents()}


@attrs.define
class SwitchState:
    """The whole switch: physical ports, one VCS per host, the MLD and the DCD (each behind a DSP)."""

    ports: list[PhysicalPort]
    vcss: list[VCS]
    mld: MultiLogicalDevice | None
    dcd: DynamicCapacityDevice | None
    number_of_hdm_decoders: int = 4

    def port(self, port_id: int) -> PhysicalPort | None:
        return self.ports[port_id] if 0 <= port_id < len(self.ports) else None

    def vcs(self, vcs_id: int) -> VCS | None:
        return self.vcss[vcs_id] if 0 <= vcs_id < len(self.vcss) else None

    def vppbs(self) -> list[VPPB]:
        return [v for vcs in self.vcss for v in vcs.vppbs]

    def binding_of(self, port_id: int, ld_id: int | None) -> VPPB | None:
        """The vPPB bound (or being bound) to the port, or to one LD of it; None if free."""
        for vppb in self.vppbs():
            if vppb.binding_status == VPPBBindingStatus.UNBOUND or vppb.bound_port_id != port_id:
                continue
            if ld_id is None or vppb.bound_ld_id == ld_id:
                return vppb
        return None


DEFAULT_DC_BLOCK_SIZE = 2 * MIB
DC_BLOCK_SIZE_MASK = (1 << 21) | (1 << 26) | (1 << 28)
"""Block sizes a DC region supports: 2 MiB, 64 MiB and 256 MiB (bit n set: 2^n bytes)."""


def default_topology(
    *,
    hosts: int = 2,
    gpus: int = 10,
    nvme: int = 0,
    nics: int = 0,
    ld_count: int = 4,
    mld_capacity: int = 64 * GIB,
    dc_capacity: int = 16 * GIB,
    dc_regions: int = 2,
) -> SwitchState:
    """A GPU box: one USP per host (ports 0..hosts-1), then DSPs for the GPUs, NVMe drives, NICs, the MLD and
    the DCD, in that order. Each VCS has one vPPB per DSP and one per LD of the MLD, so any host can reach any
    device, and carving LDs for a host leaves it a vPPB for every device.

    The MLD starts split evenly across its LDs (range 1, 256 MiB granularity); `ld_count` 0 leaves it out, as
    `dc_capacity` 0 leaves out the DCD. DC capacity is split evenly over `dc_regions` regions.
    """
    if not 1 <= hosts <= 32:
        raise ValueError("hosts must be 1..32")
    if min(gpus, nvme, nics, ld_count, mld_capacity, dc_capacity) < 0:
        raise ValueError("counts and capacities must not be negative")
    if not 1 <= dc_regions <= 8:
        raise ValueError("dc_regions must be 1..8")
    if ld_count > MAX_LD_COUNT:
        raise ValueError(f"ld_count must be at most {MAX_LD_COUNT}, the most LDs an MLD has")
    ports: list[PhysicalPort] = [
        PhysicalPort(i, PortRole.USP, Device(DeviceKind.HOST, f"host{i}")) for i in range(hosts)
    ]

    def add(kind: DeviceKind, name: str) -> int:
        ports.append(PhysicalPort(len(ports), PortRole.DSP, Device(kind, name)))
        return len(ports) - 1

    for kind, count in ((DeviceKind.GPU, gpus), (DeviceKind.NVME, nvme), (DeviceKind.NIC, nics)):
        for i in range(count):
            add(kind, f"{kind.value}{i}")
    mld = None
    if ld_count:
        granularity = MemoryGranularity.GRANULARITY_256_MIB
        units, rest = divmod(mld_capacity, granularity.unit_bytes * ld_count)
        if units == 0 or rest:
            raise ValueError("mld_capacity must be a positive multiple of 256 MiB times ld_count")
        mld = MultiLogicalDevice(
            add(DeviceKind.MLD, "mld0"), mld_capacity, granularity, [LDAllocation(units, 0) for _ in range(ld_count)]
        )
    dcd = None
    if dc_capacity:
        length, rest = divmod(dc_capacity, dc_regions)
        if rest or length % DC_CAPACITY_UNIT or length == 0:
            raise ValueError("dc_capacity must split into dc_regions regions of whole 256 MiB units")
        regions = [DCRegion(i * length, length, DEFAULT_DC_BLOCK_SIZE, DC_BLOCK_SIZE_MASK) for i in range(dc_regions)]
        dcd = DynamicCapacityDevice(
            add(DeviceKind.DCD, "dcd0"),
            hosts,
            regions,
            host_extents={h: [] for h in range(hosts)},
            generation=dict.fromkeys(range(hosts), 0),
        )
    if len(ports) > MAX_PHYSICAL_PORTS:
        raise ValueError(f"a switch has at most {MAX_PHYSICAL_PORTS} physical ports, {len(ports)} asked")
    vppb_count = len(ports) - hosts + ld_count
    if vppb_count > MAX_VPPBS:
        raise ValueError(f"a VCS has at most {MAX_VPPBS} vPPBs, one per downstream port and LD: {vppb_count} asked")
    vcss = [VCS(h, h, [VPPB(v) for v in range(vppb_count)]) for h in range(hosts)]
    return SwitchState(ports, vcss, mld, dcd)
