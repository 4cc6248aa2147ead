"""Model values to and from the shared wire types of ``disagg.fabric.v1`` (types.proto).

Protobuf messages exist only at the gRPC edge; inside, everything is the model. Conversions from the wire
validate as they go and raise `InvalidRequestError` naming the field, so a bad message never reaches the
composer or a driver.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any, TypeVar

from disagg.errors import InvalidRequestError
from disagg.fabric.v1 import types_pb2 as pb
from disagg.model import (
    Allocation,
    AttributeValue,
    Binding,
    Capabilities,
    Capacity,
    Device,
    DeviceKind,
    Extent,
    Feature,
    Health,
    Host,
    Link,
    PoolInfo,
    PoolKind,
    Port,
    PortKind,
    Switch,
    SwitchKind,
    Topology,
)

E = TypeVar("E")

KIND_TO_WIRE = {
    DeviceKind.GPU: pb.DEVICE_KIND_GPU,
    DeviceKind.CXL_MEMORY: pb.DEVICE_KIND_CXL_MEMORY,
    DeviceKind.NVME: pb.DEVICE_KIND_NVME,
    DeviceKind.NIC: pb.DEVICE_KIND_NIC,
    DeviceKind.FPGA: pb.DEVICE_KIND_FPGA,
    DeviceKind.DPU: pb.DEVICE_KIND_DPU,
}
HEALTH_TO_WIRE = {
    Health.OK: pb.HEALTH_OK,
    Health.DEGRADED: pb.HEALTH_DEGRADED,
    Health.FAILED: pb.HEALTH_FAILED,
    Health.UNKNOWN: pb.HEALTH_UNKNOWN,
}
PORT_TO_WIRE = {
    PortKind.UPSTREAM: pb.PORT_KIND_UPSTREAM,
    PortKind.DOWNSTREAM: pb.PORT_KIND_DOWNSTREAM,
    PortKind.FABRIC: pb.PORT_KIND_FABRIC,
}
SWITCH_TO_WIRE = {SwitchKind.PCIE: pb.SWITCH_KIND_PCIE, SwitchKind.CXL: pb.SWITCH_KIND_CXL}
POOL_TO_WIRE = {PoolKind.MLD: pb.POOL_KIND_MLD, PoolKind.DCD: pb.POOL_KIND_DCD}
FEATURE_TO_WIRE = {
    Feature.BIND: pb.FEATURE_BIND,
    Feature.UNBIND: pb.FEATURE_UNBIND,
    Feature.CARVE: pb.FEATURE_CARVE,
    Feature.HEALTH_EVENTS: pb.FEATURE_HEALTH_EVENTS,
    Feature.SANITIZE: pb.FEATURE_SANITIZE,
    Feature.FENCING: pb.FEATURE_FENCING,
    Feature.FAULT_INJECTION: pb.FEATURE_FAULT_INJECTION,
}


def _invert(table: Mapping[E, int]) -> dict[int, E]:
    return {v: k for k, v in table.items()}


KIND_FROM_WIRE = _invert(KIND_TO_WIRE)
HEALTH_FROM_WIRE = _invert(HEALTH_TO_WIRE)
PORT_FROM_WIRE = _invert(PORT_TO_WIRE)
SWITCH_FROM_WIRE = _invert(SWITCH_TO_WIRE)
POOL_FROM_WIRE = _invert(POOL_TO_WIRE)
FEATURE_FROM_WIRE = _invert(FEATURE_TO_WIRE)


def enum_from_wire(table: Mapping[Any, E], value: int, field: str, what: str) -> E:
    """The model enum for a wire value; UNSPECIFIED and unknown values are an `InvalidRequestError`."""
    try:
        return table[value]
    except KeyError:
        raise InvalidRequestError(f"{field}: {value} is not a valid {what}", field=field) from None


def kind_from_wire(value: int, field: str) -> DeviceKind:
    return enum_from_wire(KIND_FROM_WIRE, value, field, "device kind")


def health_from_wire(value: int, field: str) -> Health:
    return enum_from_wire(HEALTH_FROM_WIRE, value, field, "health")


def attribute_to_wire(value: AttributeValue) -> pb.AttributeValue:
    if isinstance(value, bool):
        return pb.AttributeValue(bool_value=value)
    if isinstance(value, int):
        return pb.AttributeValue(int_value=value)
    if isinstance(value, float):
        return pb.AttributeValue(double_value=value)
    return pb.AttributeValue(string_value=value)


def attribute_from_wire(value: pb.AttributeValue, field: str) -> AttributeValue:
    which = value.WhichOneof("value")
    if which is None:
        raise InvalidRequestError(f"{field}: an attribute value needs one of its fields set", field=field)
    result: AttributeValue = getattr(value, which)
    return result


def attributes_to_wire(attrs: Mapping[str, AttributeValue]) -> dict[str, pb.AttributeValue]:
    return {k: attribute_to_wire(v) for k, v in attrs.items()}


def attributes_from_wire(attrs: Mapping[str, pb.AttributeValue], field: str) -> dict[str, AttributeValue]:
    return {k: attribute_from_wire(v, f"{field}[{k}]") for k, v in attrs.items()}


def capacity_to_wire(cap: Capacity) -> pb.Capacity:
    return pb.Capacity(total_bytes=cap.total_bytes, block_bytes=cap.block_bytes)


def capacity_from_wire(cap: pb.Capacity, field: str) -> Capacity:
    try:
        return Capacity(cap.total_bytes, cap.block_bytes)
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from None


def device_to_wire(dev: Device, *, held_by: str = "", cordoned: bool = False) -> pb.Device:
    msg = pb.Device(
        id=dev.id,
        fabric=dev.fabric,
        kind=KIND_TO_WIRE[dev.kind],
        serial=dev.serial,
        vendor=dev.vendor,
        model=dev.model,
        switch_id=dev.switch,
        link_latency_ns=dev.link_latency_ns,
        attributes=attributes_to_wire(dev.attributes),
        health=HEALTH_TO_WIRE[dev.health],
        failure_domains=dict(dev.failure_domains),
        held_by=held_by,
        cordoned=cordoned,
    )
    if dev.capacity is not None:
        msg.capacity.CopyFrom(capacity_to_wire(dev.capacity))
    return msg


def device_from_wire(msg: pb.Device, field: str = "device") -> Device:
    return Device(
        id=msg.id,
        fabric=msg.fabric,
        kind=kind_from_wire(msg.kind, f"{field}.kind"),
        serial=msg.serial,
        vendor=msg.vendor,
        model=msg.model,
        switch=msg.switch_id,
        link_latency_ns=msg.link_latency_ns,
        attributes=attributes_from_wire(msg.attributes, f"{field}.attributes"),
        capacity=capacity_from_wire(msg.capacity, f"{field}.capacity") if msg.HasField("capacity") else None,
        health=health_from_wire(msg.health, f"{field}.health"),
        failure_domains=dict(msg.failure_domains),
    )


def host_to_wire(host: Host) -> pb.Host:
    return pb.Host(
        id=host.id,
        cores=host.cores,
        memory_bytes=host.memory_bytes,
        switch_id=host.switch,
        attributes=attributes_to_wire(host.attributes),
        failure_domains=dict(host.failure_domains),
    )


def host_from_wire(msg: pb.Host, field: str = "host") -> Host:
    return Host(
        id=msg.id,
        cores=msg.cores,
        memory_bytes=msg.memory_bytes,
        switch=msg.switch_id,
        attributes=attributes_from_wire(msg.attributes, f"{field}.attributes"),
        failure_domains=dict(msg.failure_domains),
    )


def switch_to_wire(sw: Switch) -> pb.Switch:
    return pb.Switch(
        id=sw.id,
        fabric=sw.fabric,
        kind=SWITCH_TO_WIRE[sw.kind],
        vendor=sw.vendor,
        model=sw.model,
        ports=[pb.Port(id=p.id, kind=PORT_TO_WIRE[p.kind], connected=p.connected, up=p.up) for p in sw.ports],
        failure_domains=dict(sw.failure_domains),
    )


def switch_from_wire(msg: pb.Switch, field: str = "switch") -> Switch:
    return Switch(
        id=msg.id,
        fabric=msg.fabric,
        kind=enum_from_wire(SWITCH_FROM_WIRE, msg.kind, f"{field}.kind", "switch kind"),
        vendor=msg.vendor,
        model=msg.model,
        ports=tuple(
            Port(
                p.id, enum_from_wire(PORT_FROM_WIRE, p.kind, f"{field}.ports[{n}].kind", "port kind"), p.connected, p.up
            )
            for n, p in enumerate(msg.ports)
        ),
        failure_domains=dict(msg.failure_domains),
    )


def link_to_wire(link: Link) -> pb.Link:
    return pb.Link(a=link.a, b=link.b, latency_ns=link.latency_ns, bandwidth_gbps=link.bandwidth_gbps, up=link.up)


def link_from_wire(msg: pb.Link) -> Link:
    return Link(msg.a, msg.b, msg.latency_ns, msg.bandwidth_gbps, msg.up)


def pool_info_to_wire(pool: PoolInfo) -> pb.PoolInfo:
    return pb.PoolInfo(
        id=pool.id,
        fabric=pool.fabric,
        device=pool.device,
        capacity=capacity_to_wire(pool.capacity),
        kind=POOL_TO_WIRE[pool.kind],
        logical_devices=pool.logical_devices,
    )


def pool_info_from_wire(msg: pb.PoolInfo, field: str = "pool") -> PoolInfo:
    capacity = capacity_from_wire(msg.capacity, f"{field}.capacity")
    kind = enum_from_wire(POOL_FROM_WIRE, msg.kind, f"{field}.kind", "pool kind")
    try:
        return PoolInfo(msg.id, msg.fabric, msg.device, capacity, kind, msg.logical_devices)
    except ValueError as exc:
        raise InvalidRequestError(f"{field}.logical_devices: {exc}", field=f"{field}.logical_devices") from None


def topology_to_wire(
    topo: Topology, *, held_by: Mapping[str, str] | None = None, cordoned: Container[str] = ()
) -> pb.Topology:
    """``held_by`` (device id to holder) and ``cordoned`` fill the fields only the fabric manager knows."""
    holders = held_by or {}
    return pb.Topology(
        fabric=topo.fabric,
        hosts=[host_to_wire(h) for h in topo.hosts],
        switches=[switch_to_wire(s) for s in topo.switches],
        devices=[device_to_wire(d, held_by=holders.get(d.id, ""), cordoned=d.id in cordoned) for d in topo.devices],
        links=[link_to_wire(link) for link in topo.links],
        pools=[pool_info_to_wire(p) for p in topo.pools],
    )


def topology_from_wire(msg: pb.Topology, field: str = "topology") -> Topology:
    return Topology(
        fabric=msg.fabric,
        hosts=tuple(host_from_wire(h, f"{field}.hosts[{n}]") for n, h in enumerate(msg.hosts)),
        switches=tuple(switch_from_wire(s, f"{field}.switches[{n}]") for n, s in enumerate(msg.switches)),
        devices=tuple(device_from_wire(d, f"{field}.devices[{n}]") for n, d in enumerate(msg.devices)),
        links=tuple(link_from_wire(link) for link in msg.links),
        pools=tuple(pool_info_from_wire(p, f"{field}.pools[{n}]") for n, p in enumerate(msg.pools)),
    )


def binding_to_wire(binding: Binding) -> pb.Binding:
    return pb.Binding(device=binding.device, host=binding.host)


def binding_from_wire(msg: pb.Binding) -> Binding:
    return Binding(msg.device, msg.host)


def allocation_to_wire(alloc: Allocation) -> pb.Allocation:
    return pb.Allocation(
        id=alloc.id,
        pool=alloc.pool,
        host=alloc.host,
        amount_bytes=alloc.amount_bytes,
        extents=[pb.Extent(offset=e.offset, length=e.length) for e in alloc.extents],
    )


def allocation_from_wire(msg: pb.Allocation) -> Allocation:
    return Allocation(
        id=msg.id,
        pool=msg.pool,
        host=msg.host,
        amount_bytes=msg.amount_bytes,
        extents=tuple(Extent(e.offset, e.length) for e in msg.extents),
    )


def capabilities_to_wire(caps: Capabilities) -> pb.Capabilities:
    return pb.Capabilities(
        kinds=sorted(KIND_TO_WIRE[k] for k in caps.kinds),
        features=sorted(FEATURE_TO_WIRE[f] for f in caps.features),
        event_latency_s=caps.event_latency_s,
    )


def capabilities_from_wire(msg: pb.Capabilities, field: str = "capabilities") -> Capabilities:
    return Capabilities(
        kinds=frozenset(kind_from_wire(k, f"{field}.kinds") for k in msg.kinds),
        features=frozenset(enum_from_wire(FEATURE_FROM_WIRE, f, f"{field}.features", "feature") for f in msg.features),
        event_latency_s=msg.event_latency_s,
    )
