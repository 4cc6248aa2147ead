"""An in-memory ledger, for tests, benchmarks and the self-contained demo. Lost when the process ends."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from disagg.model import Composition, Event, Reservation
from disagg.store.base import REQUEST_RETENTION, LedgerState, RequestRecord, Store, check_event_retention


class MemoryStore(Store):
    def __init__(self, event_retention: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._compositions: dict[str, Composition] = {}
        self._reservations: dict[str, Reservation] = {}
        self._events: list[Event] = []
        self._requests: dict[str, RequestRecord] = {}
        self._cordons: dict[str, None] = {}
        self._quarantined: dict[tuple[str, str], None] = {}
        self._retention = check_event_retention(event_retention)

    @property
    def writes_block(self) -> bool:
        """See `Store.writes_block`: a write is a dictionary's."""
        return False

    def load(self) -> LedgerState:
        with self._lock:
            return LedgerState(
                tuple(self._compositions.values()),
                tuple(self._reservations.values()),
                self._events[-1].revision if self._events else 0,
                tuple(self._requests.values()),
                tuple(self._cordons),
                tuple(self._quarantined),
            )

    def put_composition(self, composition: Composition) -> None:
        with self._lock:
            self._compositions[composition.id] = composition

    def delete_composition(self, composition_id: str) -> None:
        with self._lock:
            self._compositions.pop(composition_id, None)

    def put_reservation(self, reservation: Reservation) -> None:
        with self._lock:
            self._reservations[reservation.id] = reservation

    def delete_reservation(self, reservation_id: str) -> None:
        with self._lock:
            self._reservations.pop(reservation_id, None)

    def put_cordon(self, device: str) -> None:
        with self._lock:
            self._cordons[device] = None

    def delete_cordon(self, device: str) -> None:
        with self._lock:
            self._cordons.pop(device, None)

    def put_quarantine(self, pool: str, allocation_id: str) -> None:
        with self._lock:
            self._quarantined[(pool, allocation_id)] = None

    def delete_quarantine(self, pool: str, allocation_id: str) -> None:
        with self._lock:
            self._quarantined.pop((pool, allocation_id), None)

    def put_request(self, record: RequestRecord) -> None:
        with self._lock:
            self._requests.pop(record.id, None)
            self._requests[record.id] = record
            while len(self._requests) > REQUEST_RETENTION:
                del self._requests[next(iter(self._requests))]

    def delete_request(self, request_id: str) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def append_event(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)
            # Trim in halves, not one by one: appending stays O(1) amortised at the retention limit.
            if len(self._events) >= 2 * self._retention:
                del self._events[: len(self._events) - self._retention]

    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]:
        with self._lock:
            first = max(0, len(self._events) - self._retention)
            start = bisect.bisect_right(self._events, revision, lo=first, key=lambda e: e.revision)
            return self._events[start : start + limit]
