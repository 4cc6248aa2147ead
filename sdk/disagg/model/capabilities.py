"""What a driver declares it can do; the composer and the conformance suite act on nothing more."""

from __future__ import annotations

import attrs

from disagg.model._enum import ModelEnum
from disagg.model.devices import DeviceKind


class Feature(ModelEnum):
    """A capability a fabric type may declare."""

    BIND = "bind"
    """Whole devices can be bound to a running host (hot-add)."""
    UNBIND = "unbind"
    """Bound devices can be taken away from a running host (hot-remove)."""
    CARVE = "carve"
    """Pools carve memory into allocations (MLD logical devices, DCD extents)."""
    HEALTH_EVENTS = "health-events"
    """The driver reports device failures as events within ``event_latency_s``."""
    SANITIZE = "sanitize"
    """Devices are sanitized before reuse by another host."""
    FENCING = "fencing"
    """Mutating calls with an older fencing epoch than one seen are refused."""
    FAULT_INJECTION = "fault-injection"
    """Faults can be injected for tests (a simulator or emulator)."""


def _kinds(value: frozenset[DeviceKind] | set[DeviceKind] | tuple[DeviceKind, ...]) -> frozenset[DeviceKind]:
    return frozenset(value)


def _features(value: frozenset[Feature] | set[Feature] | tuple[Feature, ...]) -> frozenset[Feature]:
    return frozenset(value)


@attrs.frozen
class Capabilities:
    """A fabric type's declared capabilities."""

    kinds: frozenset[DeviceKind] = attrs.field(factory=frozenset, converter=_kinds)
    features: frozenset[Feature] = attrs.field(factory=frozenset, converter=_features)
    event_latency_s: float = 1.0

    def supports(self, feature: Feature) -> bool:
        return feature in self.features

    def describe(self) -> str:
        kinds = ",".join(sorted(k.value for k in self.kinds)) or "-"
        feats = ",".join(sorted(f.value for f in self.features)) or "-"
        return f"kinds={kinds} features={feats}"
