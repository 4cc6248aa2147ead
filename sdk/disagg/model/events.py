"""Events: what drivers report about hardware, and the composer's ordered, revisioned log."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from disagg.model._enum import ModelEnum
from disagg.model._quick import quick_init
from disagg.model.devices import Health, _freeze_labels


class FabricEventKind(ModelEnum):
    """What a driver reports, after CXL event records (hot plug, surprise removal, link down).

    RESYNC_REQUIRED says that the fabric's state may have changed behind the manager (its switch or management
    endpoint restarted, losing bindings and allocations, with no record of each; a pool's capacity changed):
    the manager reads the whole fabric again at once, its pools' capacities too. Its subject names what
    restarted or changed (a switch or device id, else the fabric); it carries no health.
    """

    DEVICE_HEALTH = "device-health"
    DEVICE_ADDED = "device-added"
    DEVICE_REMOVED = "device-removed"
    LINK_DOWN = "link-down"
    LINK_UP = "link-up"
    RESYNC_REQUIRED = "resync-required"


@attrs.frozen
class FabricEvent:
    """A hardware event from one fabric; ``subject`` is a device id or a link (``a|b``)."""

    fabric: str
    kind: FabricEventKind
    subject: str
    health: Health | None = None
    message: str = ""


class EventType(ModelEnum):
    """Entries in the composer's event log."""

    DEVICE_HEALTH_CHANGED = "DeviceHealthChanged"
    DEVICE_ADDED = "DeviceAdded"
    DEVICE_REMOVED = "DeviceRemoved"
    LINK_STATE_CHANGED = "LinkStateChanged"
    COMPOSITION_CREATED = "CompositionCreated"
    COMPOSITION_STATE_CHANGED = "CompositionStateChanged"
    COMPOSITION_UPDATED = "CompositionUpdated"
    COMPOSITION_DELETED = "CompositionDeleted"
    COMPOSITION_HEALED = "CompositionHealed"
    RESERVATION_CREATED = "ReservationCreated"
    RESERVATION_EXPIRED = "ReservationExpired"
    RESERVATION_RELEASED = "ReservationReleased"
    ROLLBACK_INCOMPLETE = "RollbackIncomplete"
    DEVICE_CORDONED = "DeviceCordoned"
    DEVICE_UNCORDONED = "DeviceUncordoned"
    BINDING_QUARANTINED = "BindingQuarantined"
    ALLOCATION_QUARANTINED = "AllocationQuarantined"


MAX_REVISION = 2**63 - 1
"""The highest revision a ledger can hold: SQLite's and etcd's are int64. A watch from past it is a bad number
(the wire's uint64 carries it), not a log that was reset."""


@quick_init
@attrs.frozen
class Event:
    """One entry of the event log. ``revision`` is strictly increasing; watchers resume from it."""

    revision: int
    type: EventType
    subject: str
    message: str = ""
    time: float = 0.0
    data: Mapping[str, str] = attrs.field(factory=dict, converter=_freeze_labels)


class Revision(int):
    """An event revision, carrying the time of the event at it (0.0 while the log is empty or when not known).
    A listing answers one; a watch from it sends the time too (`WatchEventsRequest.after_time`), so that a log
    reset or restored since, whose revisions now name other events, is refused instead of followed with a gap.
    An ``int`` still, wherever a revision is compared or counted."""

    time: float

    def __new__(cls, revision: int, time: float = 0.0) -> Revision:
        made = super().__new__(cls, revision)
        made.time = time
        return made
