"""What the retention tests of the SQLite and etcd ledgers share: the events they append, and the comparisons
that hold each ledger to what the in-memory ledger serves."""

from __future__ import annotations

import pytest
from composer_helpers import composer
from disagg.errors import RevisionCompactedError
from disagg.model import Event, EventType
from disagg.server.watch import Watches, watch_events
from disagg.store import MemoryStore, Store
from server_helpers import FakeContext

GPU = "pcie0/gpu-a0"


def event(revision: int) -> Event:
    return Event(revision, EventType.DEVICE_CORDONED, f"d{revision}")


def assert_same_log(memory: Store, store: Store, newest: int) -> None:
    for after in range(newest + 1):
        assert store.events_after(after) == memory.events_after(after), f"after {after}"


def assert_watch_refused_as_on_memory(store: Store) -> None:
    """The newest 5 of 12 events are 8 to 12: a watch after 6 needs 7, and is refused on ``store`` (of retention
    5) as on the in-memory ledger."""
    for ledger in (MemoryStore(event_retention=5), store):
        comp = composer(store=ledger)
        try:
            for n in range(12):
                (comp.cordon if n % 2 == 0 else comp.uncordon)(GPU)
            comp.store.sync()
            context = FakeContext()
            with pytest.raises(RevisionCompactedError, match="the oldest is 8"):
                next(watch_events(comp, 6, context, Watches(4)))  # type: ignore[arg-type]
            context.cancel()
        finally:
            comp.close()


def assert_timed_resume_at_the_edge_refused_as_on_memory(store: Store) -> None:
    """The newest 5 of 12 events are 8 to 12: a resume after 7 with event 7's time cannot be held against the
    log, which no longer holds 7 (from a log reset since, it would show no gap either), and is refused on
    ``store`` (of retention 5) as on the in-memory ledger; without a time it goes on at 8."""
    for ledger in (MemoryStore(event_retention=5), store):
        comp = composer(store=ledger)
        context = FakeContext()
        try:
            for n in range(12):
                (comp.cordon if n % 2 == 0 else comp.uncordon)(GPU)
                if n == 6:
                    seventh = comp.events(6, 1)[0]
            comp.store.sync()
            with pytest.raises(RevisionCompactedError, match=r"event 7 is no longer retained \(the oldest is 8\)"):
                next(watch_events(comp, 7, context, Watches(4), after_time=seventh.time))  # type: ignore[arg-type]
            untimed = watch_events(comp, 7, context, Watches(4))  # type: ignore[arg-type]
            try:
                assert next(untimed).revision == 8
            finally:
                untimed.close()
        finally:
            context.cancel()
            comp.close()
