"""The fabric as a driver discovers it: hosts, switches, ports, links, devices and memory pools."""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping

import attrs

from disagg.model._enum import ModelEnum
from disagg.model.devices import (
    AttributeValue,
    Capacity,
    Device,
    _freeze_labels,
    _freeze_mapping,
    attribute_or_label,
)


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

    def attribute(self, key: str) -> AttributeValue | None:
        """Look a host selector key up: an attribute, else a failure-domain label (``rack=r1``), read as a
        selector's value is (``rack=1`` matches the label "1")."""
        return attribute_or_label(self.attributes, self.failure_domains, key)


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


MLD_MAX_LOGICAL_DEVICES = 16
"""The most logical devices CXL lets a multi-logical device expose (Get LD Info's LD Count)."""


@attrs.frozen
class PoolInfo:
    """A device whose capacity is carved into allocations rather than bound whole.

    ``logical_devices`` is an MLD's LD Count as Get LD Info reports it: an MLD holds one allocation per LD, so
    free bytes alone would offer a pool whose LDs are all used. 0 when the pool is not an MLD, or when its
    driver does not report the count (read as the most an MLD has, `MLD_MAX_LOGICAL_DEVICES`).
    """

    id: str
    fabric: str
    device: str
    capacity: Capacity
    kind: PoolKind = PoolKind.DCD
    logical_devices: int = 0

    def __attrs_post_init__(self) -> None:
        if self.kind is not PoolKind.MLD:
            if self.logical_devices:
                raise ValueError(
                    f"pool {self.id} is a {self.kind.value} pool, which has no logical devices, "
                    f"not {self.logical_devices}"
                )
        elif not 0 <= self.logical_devices <= MLD_MAX_LOGICAL_DEVICES:
            raise ValueError(
                f"pool {self.id} is an MLD of {self.logical_devices} logical devices; an MLD has 1 to "
                f"{MLD_MAX_LOGICAL_DEVICES} (0 when not reported)"
            )

    @property
    def ld_count(self) -> int | None:
        """How many allocations the pool holds at once: an MLD's logical devices, `MLD_MAX_LOGICAL_DEVICES`
        when not reported; None for a DCD, which takes any number."""
        if self.kind is not PoolKind.MLD:
            return None
        return self.logical_devices or MLD_MAX_LOGICAL_DEVICES


@attrs.frozen
class Topology:
    """One fabric's discovered state. Values only; the composer builds its indexes from it."""

    fabric: str
    hosts: tuple[Host, ...] = ()
    switches: tuple[Switch, ...] = ()
    devices: tuple[Device, ...] = ()
    links: tuple[Link, ...] = ()
    pools: tuple[PoolInfo, ...] = ()


def switch_reach(topo: Topology) -> dict[str, dict[str, int]]:
    """Per host of ``topo``: the fabric latency to each switch it reaches over links that are up (a host's
    ``switch`` is a link when no link says otherwise; hosts do not forward). The composer places by it, the
    conformance suite expects drivers to bind by it, and a driver can check a bind with it."""
    graph: dict[str, list[tuple[str, int]]] = defaultdict(list)
    explicit: set[tuple[str, str]] = set()
    for link in topo.links:
        if link.up:
            graph[link.a].append((link.b, link.latency_ns))
            graph[link.b].append((link.a, link.latency_ns))
        explicit.add((link.a, link.b))
        explicit.add((link.b, link.a))
    for host in topo.hosts:
        if host.switch and (host.id, host.switch) not in explicit:
            graph[host.id].append((host.switch, 0))
            graph[host.switch].append((host.id, 0))
    switches = {s.id for s in topo.switches}
    host_ids = {h.id for h in topo.hosts}
    reach: dict[str, dict[str, int]] = {}
    for host in topo.hosts:
        dist: dict[str, int] = {host.id: 0}
        heap = [(0, host.id)]
        while heap:
            d, node = heapq.heappop(heap)
            if d > dist.get(node, d):
                continue
            for nxt, lat in graph.get(node, ()):
                if nxt in host_ids and nxt != host.id:
                    continue  # hosts do not forward traffic
                nd = d + lat
                if nd < dist.get(nxt, nd + 1):
                    dist[nxt] = nd
                    heapq.heappush(heap, (nd, nxt))
        reach[host.id] = {node: d for node, d in dist.items() if node in switches}
    return reach
