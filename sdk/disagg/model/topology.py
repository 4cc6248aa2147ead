"""The fabric as a driver discovers it: hosts, switches, ports, links, devices and memory pools."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from disagg.model._enum import ModelEnum
from disagg.model.devices import AttributeValue, Capacity, Device, _freeze_labels, _freeze_mapping


class PortKind(ModelEnum):
    """A switch port's role, after the CXL FM API's upstream / downstream switch ports."""

    UPSTREAM = "upstream"
    DOWNSTREAM = "downstream"
    FABRIC = "fabric"


class SwitchKind(ModelEnum):
    PCIE = "pcie"
    CXL = "cxl"


@attrs.frozen
class Port:
    """A physical switch port; ``connected`` names the host, switch or device on its far side."""

    id: str
    kind: PortKind
    connected: str = ""
    up: bool = True


@attrs.frozen
class Switch:
    """A PCIe or CXL switch; ``id`` is fabric-scoped like a device id."""

    id: str
    fabric: str
    kind: SwitchKind = SwitchKind.PCIE
    vendor: str = ""
    model: str = ""
    ports: tuple[Port, ...] = ()
    failure_domains: Mapping[str, str] = attrs.field(factory=dict, converter=_freeze_labels)


@attrs.frozen
class Host:
    """A compute node that devices are bound to.

    Host ids are global (the same host is attached to several fabrics); ``switch`` is where this host
    enters the fabric that reported it, empty when the report comes from the composer's merged view.
    """

    id: str
    cores: int = 0
    memory_bytes: int = 0
    switch: str = ""
    attributes: Mapping[str, AttributeValue] = attrs.field(factory=dict, converter=_freeze_mapping)
    failure_domains: Mapping[str, str] = attrs.field(factory=dict, converter=_freeze_labels)


@attrs.frozen
class Link:
    """A link between two nodes (host or switch ids) with its one-way latency and bandwidth."""

    a: str
    b: str
    latency_ns: int
    bandwidth_gbps: float = 0.0
    up: bool = True


class PoolKind(ModelEnum):
    """How a pool carves capacity: a multi-logical device's LDs, or a dynamic-capacity device's extents."""

    MLD = "mld"
    DCD = "dcd"


@attrs.frozen
class PoolInfo:
    """A device whose capacity is carved into allocations rather than bound whole."""

    id: str
    fabric: str
    device: str
    capacity: Capacity
    kind: PoolKind = PoolKind.DCD


@attrs.frozen
class Topology:
    """One fabric's discovered state. Values only; the composer builds its indexes from it."""

    fabric: str
    hosts: tuple[Host, ...] = ()
    switches: tuple[Switch, ...] = ()
    devices: tuple[Device, ...] = ()
    links: tuple[Link, ...] = ()
    pools: tuple[PoolInfo, ...] = ()
