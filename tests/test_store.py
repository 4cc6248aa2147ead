"""Unit tests of the ledger stores (`disagg.store`): the in-memory one and SQLite share one contract."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from disagg.errors import ConfigError
from disagg.model import (
    Allocation,
    Composition,
    CompositionRequest,
    CompositionState,
    DeviceKind,
    DevicePick,
    Event,
    EventType,
    Extent,
    HostRequest,
    MemoryPick,
    Plan,
    Reservation,
    ResourceRequest,
    Selector,
    SelectorOp,
)
from disagg.store import LedgerState, MemoryStore, RequestRecord, SqliteStore, Store

GiB = 1 << 30

RESOURCES = (
    ResourceRequest(DeviceKind.GPU, count=2, selectors=(Selector("model", SelectorOp.EQ, "H200"),), spread="chassis"),
    ResourceRequest(DeviceKind.CXL_MEMORY, amount_bytes=GiB),
)


def _composition(cid: str, generation: int = 1) -> Composition:
    return Composition(
        id=cid,
        name=f"name-{cid}",
        host="h1",
        state=CompositionState.COMPOSED,
        resources=RESOURCES,
        devices=(DevicePick("pcie0/g0", 0, 150), DevicePick("pcie0/g1", 0, 150)),
        allocations=(Allocation(f"{cid}-m0", "cxl0/pool0", "h1", GiB, (Extent(0, GiB),)),),
        generation=generation,
    )


def _reservation(rid: str, expires_at: float = 100.0) -> Reservation:
    return Reservation(
        id=rid,
        request=CompositionRequest(f"req-{rid}", RESOURCES, HostRequest(min_cores=4)),
        plan=Plan("h1", (DevicePick("pcie0/g2", 0, 150),), (MemoryPick("cxl0/pool0", GiB, 1, 300),)),
        expires_at=expires_at,
    )


def _event(revision: int) -> Event:
    return Event(revision, EventType.COMPOSITION_UPDATED, f"c{revision}", f"event {revision}", revision / 2, {"n": "1"})


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "ledger.db")
    yield s
    s.close()


def _by_id(state: LedgerState) -> tuple[dict[str, Composition], dict[str, Reservation]]:
    return {c.id: c for c in state.compositions}, {r.id: r for r in state.reservations}


class TestCompositions:
    """put_composition stores or replaces a composition by id; delete_composition removes it, idempotently."""

    def test_put_and_load(self, store: Store) -> None:
        store.put_composition(_composition("c1"))
        store.put_composition(_composition("c2"))
        comps, _ = _by_id(store.load())
        assert comps == {"c1": _composition("c1"), "c2": _composition("c2")}

    def test_put_replaces(self, store: Store) -> None:
        store.put_composition(_composition("c1"))
        store.put_composition(attrs.evolve(_composition("c1", 2), state=CompositionState.DEGRADED))
        (only,) = store.load().compositions
        assert (only.generation, only.state) == (2, CompositionState.DEGRADED)

    def test_delete(self, store: Store) -> None:
        store.put_composition(_composition("c1"))
        store.put_composition(_composition("c2"))
        store.delete_composition("c1")
        store.delete_composition("c1")
        store.delete_composition("never")
        assert [c.id for c in store.load().compositions] == ["c2"]


class TestReservations:
    """put_reservation stores or replaces a reservation by id; delete_reservation removes it, idempotently."""

    def test_put_and_load(self, store: Store) -> None:
        store.put_reservation(_reservation("r1"))
        store.put_reservation(_reservation("r2"))
        _, res = _by_id(store.load())
        assert res == {"r1": _reservation("r1"), "r2": _reservation("r2")}

    def test_put_replaces(self, store: Store) -> None:
        store.put_reservation(_reservation("r1", 100.0))
        store.put_reservation(_reservation("r1", 200.5))
        (only,) = store.load().reservations
        assert only.expires_at == 200.5

    def test_delete(self, store: Store) -> None:
        store.put_reservation(_reservation("r1"))
        store.delete_reservation("r1")
        store.delete_reservation("r1")
        assert store.load().reservations == ()

    def test_kept_apart_from_compositions(self, store: Store) -> None:
        store.put_composition(_composition("x"))
        store.put_reservation(_reservation("x"))
        store.delete_reservation("x")
        assert [c.id for c in store.load().compositions] == ["x"]


class TestEvents:
    """events_after returns events with a higher revision in revision order, at most ``limit`` of them."""

    def test_empty(self, store: Store) -> None:
        assert list(store.events_after(0)) == []
        assert store.load() == LedgerState()

    def test_after(self, store: Store) -> None:
        for rev in range(1, 6):
            store.append_event(_event(rev))
        assert list(store.events_after(0)) == [_event(r) for r in range(1, 6)]
        assert [e.revision for e in store.events_after(2)] == [3, 4, 5]
        assert list(store.events_after(5)) == []
        assert list(store.events_after(99)) == []

    def test_limit(self, store: Store) -> None:
        for rev in range(1, 6):
            store.append_event(_event(rev))
        assert [e.revision for e in store.events_after(1, limit=2)] == [2, 3]
        assert [e.revision for e in store.events_after(0, limit=100)] == [1, 2, 3, 4, 5]
        assert list(store.events_after(0, limit=0)) == []

    def test_gaps_in_revisions(self, store: Store) -> None:
        for rev in (3, 10, 11, 40):
            store.append_event(_event(rev))
        assert [e.revision for e in store.events_after(4)] == [10, 11, 40]
        assert [e.revision for e in store.events_after(10, limit=1)] == [11]

    def test_last_revision(self, store: Store) -> None:
        assert store.load().last_revision == 0
        for rev in (1, 2, 7):
            store.append_event(_event(rev))
        assert store.load().last_revision == 7

    def test_event_data_survives(self, store: Store) -> None:
        event = Event(1, EventType.COMPOSITION_HEALED, "c1", "healed", 3.25, {"old": "a", "new": "b"})
        store.append_event(event)
        (loaded,) = store.events_after(0)
        assert loaded == event
        assert dict(loaded.data) == {"old": "a", "new": "b"}


class TestMemoryStore:
    """MemoryStore keeps only the newest ``event_retention`` events, and last_revision still counts all."""

    def test_retention(self) -> None:
        store = MemoryStore(event_retention=3)
        for rev in range(1, 8):
            store.append_event(_event(rev))
        assert [e.revision for e in store.events_after(0)] == [5, 6, 7]
        assert store.load().last_revision == 7


class TestSqliteStore:
    """SqliteStore keeps its records across reopening, runs WAL with synchronous=FULL, and names a bad path."""

    def test_survives_reopening(self, tmp_path: Path) -> None:
        path = tmp_path / "ledger.db"
        first = SqliteStore(path)
        first.put_composition(_composition("c1", 3))
        first.put_reservation(_reservation("r1"))
        for rev in (1, 2, 3):
            first.append_event(_event(rev))
        first.close()

        second = SqliteStore(path)
        try:
            state = second.load()
            assert state.compositions == (_composition("c1", 3),)
            assert state.reservations == (_reservation("r1"),)
            assert state.last_revision == 3
            assert [e.revision for e in second.events_after(1)] == [2, 3]
        finally:
            second.close()

    def test_creates_parent_directories(self, tmp_path: Path) -> None:
        path = tmp_path / "a" / "b" / "ledger.db"
        SqliteStore(path).close()
        assert path.is_file()

    def test_pragmas(self, tmp_path: Path) -> None:
        path = tmp_path / "ledger.db"
        store = SqliteStore(path)
        try:
            # synchronous is a property of the connection, so ask the store's own connection.
            assert store._db.execute("PRAGMA synchronous").fetchone() == (2,)
            assert store._db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        finally:
            store.close()
        other = sqlite3.connect(path)
        try:
            # WAL is recorded in the file itself.
            assert other.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        finally:
            other.close()

    def test_parent_is_a_file(self, tmp_path: Path) -> None:
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        path = blocker / "ledger.db"
        with pytest.raises(ConfigError, match="cannot open the ledger") as info:
            SqliteStore(path)
        assert str(path) in info.value.message

    def test_path_is_a_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="cannot open the ledger") as info:
            SqliteStore(tmp_path)
        assert str(tmp_path) in info.value.message

    def test_not_a_database(self, tmp_path: Path) -> None:
        path = tmp_path / "ledger.db"
        path.write_bytes(b"this is not sqlite" * 100)
        with pytest.raises(ConfigError, match="cannot open the ledger"):
            SqliteStore(path)

    def test_failed_write_changes_nothing(self, tmp_path: Path) -> None:
        store = SqliteStore(tmp_path / "ledger.db")
        try:
            store.append_event(_event(1))
            with pytest.raises(sqlite3.IntegrityError):
                store.append_event(_event(1))
            store.put_composition(_composition("c1"))
            assert [e.revision for e in store.events_after(0)] == [1]
            assert [c.id for c in store.load().compositions] == ["c1"]
        finally:
            store.close()


class TestRequests:
    """First answers to request ids are kept, replaced by id, deleted, and survive reopening the ledger."""

    def test_put_load_replace_delete(self, store: Store) -> None:
        store.put_request(RequestRecord("q1", "f1", '{"composition":{}}', 1.0))
        store.put_request(RequestRecord("q2", "f2", '{"compose":{}}', 2.0))
        store.put_request(RequestRecord("q1", "f1", '{"error":"ConflictError"}', 3.0))
        assert [(r.id, r.answer) for r in store.load().requests] == [
            ("q2", '{"compose":{}}'),
            ("q1", '{"error":"ConflictError"}'),
        ]
        store.delete_request("q2")
        store.delete_request("never-there")
        assert [r.id for r in store.load().requests] == ["q1"]

    def test_sqlite_keeps_them_across_reopening(self, tmp_path: Path) -> None:
        first = SqliteStore(tmp_path / "l.db")
        first.put_request(RequestRecord("q", "f", "{}", 5.0))
        first.close()
        again = SqliteStore(tmp_path / "l.db")
        assert again.load().requests == (RequestRecord("q", "f", "{}", 5.0),)
        again.close()
