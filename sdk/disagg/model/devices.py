"""Devices in a pool: what they are, how healthy, how much capacity they carry."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from disagg.model._enum import ModelEnum
from disagg.model.units import parse_attribute_value, shown

AttributeValue = str | int | float | bool
"""An attribute is a scalar; selectors compare against it."""

CXL_DC_BLOCK_BYTES = 256 * 1024 * 1024
"""Block size of CXL dynamic capacity (256 MiB): the unit memory is carved in."""


class DeviceKind(ModelEnum):
    """What a device is, in the field's words."""

    GPU = "gpu"
    CXL_MEMORY = "cxl-memory"
    NVME = "nvme"
    NIC = "nic"
    FPGA = "fpga"
    DPU = "dpu"

    @classmethod
    def parse(cls, text: str) -> DeviceKind:
        """Accept the value (``cxl-memory``), the name (``CXL_MEMORY``) or a short alias (``cxl``)."""
        key = text.strip().lower().replace("_", "-")
        aliases = {"cxl": "cxl-memory", "mem": "cxl-memory", "memory": "cxl-memory", "ssd": "nvme"}
        key = aliases.get(key, key)
        for kind in cls:
            if kind.value == key:
                return kind
        known = ", ".join(k.value for k in cls)
        raise ValueError(f"unknown device kind {shown(text)}; known kinds: {known}")


class Health(ModelEnum):
    """Device health, after Redfish ``Status.Health`` plus UNKNOWN for an unreachable driver."""

    OK = "OK"
    DEGRADED = "DEGRADED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"


def _freeze_mapping(value: Mapping[str, AttributeValue] | None) -> Mapping[str, AttributeValue]:
    return MappingProxyType(dict(value or {}))


def _freeze_labels(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(value or {}))


@attrs.frozen
class Capacity:
    """Memory a device can carve for hosts: total bytes in blocks of ``block_bytes``."""

    total_bytes: int
    block_bytes: int = CXL_DC_BLOCK_BYTES

    def __attrs_post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        if self.total_bytes < 0 or self.total_bytes % self.block_bytes:
            raise ValueError(
                f"capacity {self.total_bytes} is not a non-negative multiple of the block size {self.block_bytes}"
            )

    @property
    def blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    def round_up(self, amount: int) -> int:
        """The bytes actually carved for a request of ``amount`` bytes."""
        return -(-amount // self.block_bytes) * self.block_bytes


@attrs.frozen
class Device:
    """A composable device as a driver reports it.

    ``id`` is fabric-scoped (``<fabric>/<local-id>``) and stable across discoveries; ``serial`` is what
    matches a device across reboots and re-enumeration (never an OS name such as ``mem0``).
    ``switch`` is the switch the device hangs off, ``link_latency_ns`` the latency of that last hop.
    ``failure_domains`` are labels such as ``chassis``, ``power-feed``, ``rack``.
    """

    id: str
    fabric: str
    kind: DeviceKind
    serial: str
    vendor: str = ""
    model: str = ""
    switch: str = ""
    link_latency_ns: int = 0
    attributes: Mapping[str, AttributeValue] = attrs.field(factory=dict, converter=_freeze_mapping)
    capacity: Capacity | None = None
    health: Health = Health.OK
    failure_domains: Mapping[str, str] = attrs.field(factory=dict, converter=_freeze_labels)

    @property
    def local_id(self) -> str:
        return self.id.split("/", 1)[1] if "/" in self.id else self.id

    def attribute(self, key: str) -> AttributeValue | None:
        """Look a selector key up: the fixed fields first (``vendor``, ``model``, ``serial``), then attributes, then
        failure-domain labels (``chassis=c1``), read as a selector's value is."""
        if key == "vendor":
            return self.vendor
        if key == "model":
            return self.model
        if key == "serial":
            return self.serial
        if key == "kind":
            return self.kind.value
        return attribute_or_label(self.attributes, self.failure_domains, key)


def attribute_or_label(
    attributes: Mapping[str, AttributeValue], labels: Mapping[str, str], key: str
) -> AttributeValue | None:
    """What a selector on ``key`` compares with: the attribute, else the failure-domain label of that name, read
    as a selector's value is (``rack=1`` matches the label "1"), else None. A label that reads as no value a
    selector may hold (a number of more digits than Python reads, a fraction of a byte) is its text: a driver
    reports labels as it likes, and the ValueError crashed every placement that looked at it."""
    value = attributes.get(key)
    if value is None and key in labels:
        try:
            return parse_attribute_value(labels[key])
        except ValueError:
            return labels[key]
    return value


MAX_FABRIC_NAME = 63


def fabric_name_refusal(name: object) -> str | None:
    """Why ``name`` cannot name a fabric, or None. It prefixes every device id (``<fabric>/<device>``), which the
    protocol takes as printable characters without spaces: a name with a space was served, and then every bind
    of its devices refused."""
    if not isinstance(name, str) or not name or len(name) > MAX_FABRIC_NAME:
        return f"a fabric name is 1 to {MAX_FABRIC_NAME} characters, not {name!r}"
    if "/" in name or any(c.isspace() or not c.isprintable() for c in name):
        return f"a fabric name has no '/', space or unprintable character, not {name!r}"
    return None


def device_id(fabric: str, local_id: str) -> str:
    """The stable, fabric-scoped id of a device."""
    if not fabric or "/" in fabric:
        raise ValueError(f"invalid fabric name {fabric!r}")
    if not local_id:
        raise ValueError("empty device id")
    return f"{fabric}/{local_id}"
