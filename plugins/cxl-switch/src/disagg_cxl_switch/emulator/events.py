"""A bounded log of what happened to the fabric (hot-plug, surprise removal, link down), read by sequence number.

A fabric manager polls it with the vendor-specific Get Event Records command (`vendor.Opcode.GET_EVENT_RECORDS`).
Bounded so that a client that never reads cannot grow the emulator: the oldest records are dropped, and the
reader sees the gap from the sequence numbers.
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum

import attrs

NO_ID = 0xFF
"""Port or host id of a record that concerns no port or no host."""


class EventType(IntEnum):
    """Event Type byte of an emulator event record."""

    HOT_ADD = 0x01
    SURPRISE_REMOVAL = 0x02
    LINK_DOWN = 0x03
    LINK_UP = 0x04
    EXTENT_POISONED = 0x05


@attrs.frozen
class EventRecord:
    """One event: its sequence number (from 1, never reused), type, and the port and host it concerns."""

    sequence: int
    event_type: EventType
    port_id: int = NO_ID
    host_id: int = NO_ID


class EventLog:
    """The last `capacity` events, oldest first."""

    def __init__(self, capacity: int = 256, first: int = 1) -> None:
        """``first``: the sequence number of the first record (a log emptied by a reset goes on numbering, so
        that a reader that kept its place sees the records after it)."""
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._records: deque[EventRecord] = deque(maxlen=capacity)
        self._next = first

    def record(self, event_type: EventType, *, port_id: int = NO_ID, host_id: int = NO_ID) -> EventRecord:
        record = EventRecord(self._next, event_type, port_id, host_id)
        self._next += 1
        self._records.append(record)
        return record

    @property
    def next_sequence(self) -> int:
        return self._next

    @property
    def oldest_sequence(self) -> int:
        """Sequence number of the oldest record still held (`next_sequence` when the log is empty)."""
        return self._records[0].sequence if self._records else self._next

    def read(self, first_sequence: int, max_records: int) -> list[EventRecord]:
        """Records with a sequence number of at least `first_sequence`, at most `max_records` of them."""
        return [r for r in self._records if r.sequence >= first_sequence][:max_records]
