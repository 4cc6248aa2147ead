"""Unit tests of the ledger stores (`disagg.store`): the in-memory one, SQLite and etcd share one contract.

The etcd ones run against real `etcd` processes (`etcd_helpers`), one member for the whole module, each test
under its own key prefix; without etcd they are skipped (failed on CI).
"""

from __future__ import annotations

import errno
import http.server
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, cast

import attrs
import etcd3gw
import pytest
from disagg.errors import ConfigError, FabricUnavailableError, InvalidRequestError
from disagg.lockfile import try_lock
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
from disagg.store import EtcdStore, LedgerState, MemoryStore, RequestRecord, SqliteStore, Store, ownership
from disagg.store import etcd as etcd_store
from disagg.store.etcd import LeadershipLostError
from disagg.store.sqlite import _open_error
from etcd_helpers import EtcdCluster, etcd_binary, free_ports, fresh_prefix, one_etcd_member, start_etcd_cluster

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


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    yield from one_etcd_member(tmp_path_factory)


@pytest.fixture
def etcd_prefix() -> str:
    return fresh_prefix()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "sqlite":
        s = SqliteStore(tmp_path / "ledger.db")
    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        s = EtcdStore(cluster.endpoints, prefix=request.getfixturevalue("etcd_prefix"), unfenced=True)
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


def _atomic_held(store: Store) -> tuple[dict[str, int], list[int]]:
    """The compositions' generations and the event revisions the store holds, once its writes are durable."""
    state = store.load()
    return {c.id: c.generation for c in state.compositions}, [e.revision for e in store.events_after(0)]


class TestAtomic:
    """`Store.atomic`, as every ledger keeps it (tests/test_ledger_atomic.py has the composer's use of it)."""

    def test_the_writes_of_a_block_are_all_held_after_it(self, store: Store) -> None:
        with store.atomic():
            store.put_composition(_composition("c1"))
            store.append_event(_event(1))
            store.put_composition(_composition("c2"))
            store.append_event(_event(2))
        assert _atomic_held(store) == ({"c1": 1, "c2": 1}, [1, 2])

    def test_a_nested_block_joins_the_outer_one(self, store: Store) -> None:
        with store.atomic():
            store.put_composition(_composition("c1"))
            with store.atomic():
                store.append_event(_event(1))
            store.put_composition(_composition("c1", 2))
        assert _atomic_held(store) == ({"c1": 2}, [1])

    def test_a_block_left_on_an_error_writes_what_came_before_it(self, store: Store) -> None:
        with pytest.raises(RuntimeError, match="the caller's"), store.atomic():
            store.put_composition(_composition("c1"))
            store.append_event(_event(1))
            raise RuntimeError("the caller's")
        assert _atomic_held(store) == ({"c1": 1}, [1])

    @pytest.mark.parametrize("last", ["put", "delete"])
    def test_the_last_write_of_a_record_in_a_block_is_the_one_held(self, store: Store, last: str) -> None:
        """etcd refuses a transaction that names a key twice: the block keeps the last write of each key."""
        store.put_composition(_composition("c1"))
        with store.atomic():
            store.put_composition(_composition("c1", 2))
            store.delete_composition("c1")
            if last == "put":
                store.put_composition(_composition("c1", 3))
        assert _atomic_held(store) == ({"c1": 3} if last == "put" else {}, [])

    @pytest.mark.parametrize("ledger", ["sqlite", "etcd"])
    def test_a_closed_store_refuses_the_write_where_it_is_made(
        self, ledger: str, tmp_path: Path, request: pytest.FixtureRequest
    ) -> None:
        """Inside the block too, not as it ends: the composer changes nothing in memory for a refused write."""
        store: Store
        if ledger == "sqlite":
            store = SqliteStore(tmp_path / "ledger.db")
        else:
            cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
            store = EtcdStore(cluster.endpoints, prefix=fresh_prefix(), unfenced=True)
        store.close()
        with store.atomic(), pytest.raises(FabricUnavailableError, match="closed"):
            store.put_composition(_composition("c1"))


class TestMemoryStore:
    """MemoryStore keeps only the newest ``event_retention`` events, and last_revision still counts all."""

    def test_retention(self) -> None:
        store = MemoryStore(event_retention=3)
        for rev in range(1, 8):
            store.append_event(_event(rev))
        assert [e.revision for e in store.events_after(0)] == [5, 6, 7]
        assert store.load().last_revision == 7


HOLD_THE_LEDGER = """
import sys
from disagg.store import SqliteStore
store = SqliteStore(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
"""


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
        """Refused before a lock file is made beside it, naming the file to give instead."""
        with pytest.raises(ConfigError, match="is a directory: give the ledger's file") as info:
            SqliteStore(tmp_path)
        assert str(tmp_path / "ledger.db") in info.value.message
        assert not (tmp_path.parent / f"{tmp_path.name}.lock").exists()

    def test_path_is_a_pipe(self, tmp_path: Path) -> None:
        """A FIFO (or a device) was opened and failed as "disk I/O error; is its disk full or failing?", exit 1 for a
        supervisor to restart, where it is a setting: refused as one, before a lock file is made beside it."""
        fifo = tmp_path / "ledger.db"
        os.mkfifo(fifo)
        with pytest.raises(ConfigError, match="is not a regular file") as info:
            SqliteStore(fifo)
        assert info.value.field == "state.path"
        assert not (tmp_path / "ledger.db.lock").exists()

    def test_not_a_database(self, tmp_path: Path) -> None:
        path = tmp_path / "ledger.db"
        path.write_bytes(b"this is not sqlite" * 100)
        with pytest.raises(ConfigError, match=r"cannot open the ledger .* restore it from a backup"):
            SqliteStore(path)

    def test_a_database_that_is_not_a_ledger_is_refused_untouched(self, tmp_path: Path) -> None:
        """Someone else's SQLite file at the ledger's path is refused, and nothing is written into it (the
        ledger's tables used to be added beside its own, and the fabric manager started empty)."""
        path = tmp_path / "ledger.db"
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE inventory (x)")
        before = path.read_bytes()
        with pytest.raises(ConfigError, match=r"not a ledger \(it has inventory\)") as info:
            SqliteStore(path)
        assert info.value.field == "state.path"
        assert path.read_bytes() == before
        SqliteStore(tmp_path / "fresh.db").close()  # the hold was let go: other ledgers open

    def test_a_full_disk_at_start_up_is_the_machine_s_not_a_setting(self, tmp_path: Path) -> None:
        """A disk that is full when the ledger opens is FabricUnavailableError (`disagg serve` exits 1, for its
        supervisor to try again) and says so, not a configuration error (exit 2)."""
        error = _open_error(tmp_path / "ledger.db", sqlite3.OperationalError("database or disk is full"))
        assert isinstance(error, FabricUnavailableError) and "disk full or failing" in error.message
        error = _open_error(tmp_path / "ledger.db", OSError(errno.ENOSPC, "No space left on device"))
        assert isinstance(error, FabricUnavailableError)

    def test_one_process_at_a_time(self, tmp_path: Path) -> None:
        """A second fabric manager on the ledger (another process) is refused, naming the holder, until the
        first has gone; two writers would take each other's devices and fail each other's writes."""
        path = tmp_path / "ledger.db"
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_THE_LEDGER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
            with pytest.raises(ConfigError, match=rf"in use by another fabric manager \(pid {holder.pid}\)"):
                SqliteStore(path)
        finally:
            holder.kill()  # however it ends, its lock goes with it
            holder.wait(10)
        store = SqliteStore(path)
        store.close()

    def test_a_second_store_of_the_process_shares_the_hold(self, tmp_path: Path) -> None:
        """Closing one of two stores a process opened on the ledger keeps it held for the other (a POSIX
        record lock would have been dropped with the first close)."""
        path = tmp_path / "ledger.db"
        first = SqliteStore(path)
        SqliteStore(path).close()
        try:
            other = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from disagg.store import SqliteStore; SqliteStore(sys.argv[1])",
                    str(path),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert other.returncode != 0 and "in use by another fabric manager" in other.stderr
        finally:
            first.close()

    def test_a_damaged_ledger_is_named(self, tmp_path: Path) -> None:
        """A ledger whose pages are damaged is refused with a message, not a traceback (at open, by its quick_check)."""
        path = tmp_path / "ledger.db"
        store = SqliteStore(path)
        for n in range(200):
            store.put_composition(_composition(f"c{n}"))
        store.close()
        with path.open("r+b") as f:
            f.seek(4096)  # the second page, where the first table starts: load reads it
            f.write(b"\xff" * 2048)
        with pytest.raises(ConfigError, match=r"cannot be read .* restore it from a backup"):
            damaged = SqliteStore(path)
            try:
                damaged.load()
            finally:
                damaged.close()

    @pytest.mark.parametrize(
        ("table", "doc"),
        [
            ("compositions", '{"id": "c1", '),
            ("compositions", '{"id": "c1"}'),
            ("compositions", "[1, 2]"),
            ("reservations", '{"id": "r1", "request": 5}'),
        ],
        ids=["truncated", "another-shape", "a-list", "a-reservation-of-another-shape"],
    )
    def test_a_record_that_does_not_decode_is_named(self, tmp_path: Path, table: str, doc: str) -> None:
        """A torn or hand-edited record made the load fail with a raw JSONDecodeError or ClassValidationError."""
        path = tmp_path / "ledger.db"
        SqliteStore(path).close()
        with sqlite3.connect(path) as db:
            db.execute(f"INSERT INTO {table} VALUES ('x1', ?)", (doc,))
        store = SqliteStore(path)
        try:
            with pytest.raises(ConfigError, match=rf"{table} record 'x1' .* restore it from a backup") as info:
                store.load()
            assert info.value.field == "state.path"
        finally:
            store.close()

    @pytest.mark.parametrize(
        "schema",
        [
            "CREATE TABLE events (id INTEGER PRIMARY KEY, payload BLOB)",
            "CREATE TABLE requests (id TEXT PRIMARY KEY, fingerprint TEXT, answer TEXT)",
        ],
        ids=["a-table-of-the-same-name", "a-column-short"],
    )
    def test_a_database_whose_tables_are_named_like_the_ledger_s_is_refused_untouched(
        self, tmp_path: Path, schema: str
    ) -> None:
        """A table named like one of the ledger's but with other columns: the file was put in WAL mode and given
        the ledger's other tables before the error, which said "no such column"."""
        path = tmp_path / "ledger.db"
        with sqlite3.connect(path) as db:
            db.execute(schema)
        before = path.read_bytes()
        with pytest.raises(ConfigError, match=r"is a SQLite database but not a ledger \(its table \w+ has ") as info:
            SqliteStore(path)
        assert info.value.field == "state.path"
        assert path.read_bytes() == before
        assert not path.with_name("ledger.db-wal").exists()
        SqliteStore(tmp_path / "fresh.db").close()  # the hold was let go

    def test_a_ledger_named_through_a_symlink_is_held_once(self, tmp_path: Path) -> None:
        """The lock file was named from the path as given: a second process naming the ledger through a symlink
        locked another file, and both wrote into the one ledger."""
        real = tmp_path / "real" / "ledger.db"
        real.parent.mkdir()
        link = tmp_path / "link.db"
        link.symlink_to(real)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_THE_LEDGER, str(real)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
            with pytest.raises(ConfigError, match=rf"in use by another fabric manager \(pid {holder.pid}\)"):
                SqliteStore(link)
        finally:
            holder.kill()
            holder.wait(10)
        SqliteStore(link).close()
        assert sorted(p.name for p in tmp_path.rglob("*.lock")) == ["ledger.db.lock"]

    def test_a_full_disk_when_the_lock_names_its_holder(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The pid written into the lock file on a full disk raised a raw OSError, and left the file open."""
        opened: list[BinaryIO] = []

        class NoSpace:
            """The lock file, on a disk with no room left for its contents."""

            def __init__(self, found: BinaryIO) -> None:
                self.found = found

            def truncate(self, size: int) -> int:
                return self.found.truncate(size)

            def write(self, data: bytes) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            def flush(self) -> None:
                self.found.flush()

            def close(self) -> None:
                self.found.close()

        def full_disk(path: Path) -> NoSpace | None:
            found = try_lock(path)
            if found is None:
                return None
            opened.append(cast(BinaryIO, found))
            return NoSpace(cast(BinaryIO, found))

        monkeypatch.setattr(ownership, "try_lock", full_disk)
        path = tmp_path / "ledger.db"
        with pytest.raises(FabricUnavailableError, match="disk full or failing"):
            SqliteStore(path)
        assert [f.closed for f in opened] == [True]
        monkeypatch.undo()
        SqliteStore(path).close()  # nothing of the failed open holds the ledger

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


def _raw(cluster: EtcdCluster) -> etcd3gw.Etcd3Client:
    """A plain etcd client on the first member, to look at and change keys behind the store's back."""
    host, port = cluster.endpoints[0].rsplit(":", 1)
    return etcd3gw.client(host=host, port=int(port), timeout=5.0, api_path="/v3/")


def _keys(client: etcd3gw.Etcd3Client, prefix: str) -> list[str]:
    return sorted(meta["key"].decode() for _, meta in client.get_prefix(prefix))


@pytest.fixture
def etcd(etcd_cluster: EtcdCluster, etcd_prefix: str) -> Iterator[EtcdStore]:
    s = EtcdStore(etcd_cluster.endpoints, prefix=etcd_prefix, unfenced=True)
    yield s
    s.close()


class TestEtcdStore:
    """EtcdStore keeps one JSON document per key under its prefix, reads in bounded pages, prunes events and
    request ids in steps, and finds the last revision across gaps without reading the log."""

    def test_key_layout(self, etcd: EtcdStore, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        etcd.put_composition(_composition("c1"))
        etcd.put_reservation(_reservation("r1"))
        etcd.put_request(RequestRecord("q1", "f", "{}", 1.0))
        etcd.append_event(_event(7))
        p = etcd_prefix
        assert _keys(_raw(etcd_cluster), p) == [
            f"{p}compositions/c1",
            f"{p}events/00000000000000000007",
            f"{p}requests/q1",
            f"{p}reservations/r1",
            f"{p}sequence",
        ]

    def test_reads_in_pages(self, etcd: EtcdStore, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(etcd_store, "PAGE", 2)
        for i in range(5):
            etcd.put_composition(_composition(f"c{i}"))
            etcd.put_reservation(_reservation(f"r{i}"))
            etcd.put_request(RequestRecord(f"q{i}", "f", "{}", float(i)))
        for rev in range(1, 8):
            etcd.append_event(_event(rev))
        state = etcd.load()
        assert sorted(c.id for c in state.compositions) == [f"c{i}" for i in range(5)]
        assert sorted(r.id for r in state.reservations) == [f"r{i}" for i in range(5)]
        assert [r.id for r in state.requests] == [f"q{i}" for i in range(5)]
        assert state.last_revision == 7
        assert [e.revision for e in etcd.events_after(0)] == list(range(1, 8))
        assert [e.revision for e in etcd.events_after(1, limit=5)] == [2, 3, 4, 5, 6]

    def test_event_retention(self, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        store = EtcdStore(etcd_cluster.endpoints, prefix=etcd_prefix, event_retention=3, unfenced=True)
        try:
            for rev in range(1, 8):
                store.append_event(_event(rev))
            # Pruned in steps of three, as SqliteStore does: at 6, events up to 3 went; 4 is past the retention
            # too, and is not served though etcd still holds it, as the other ledgers serve the newest three.
            assert [e.revision for e in store.events_after(0)] == [5, 6, 7]
            assert store.load().last_revision == 7
        finally:
            store.close()

    @pytest.mark.parametrize(
        "revisions",
        [(1,), (5,), (1, 2, 3), (2, 3, 50, 51, 1000, 123_457), (10, 11, 12, 13, 400), (1, 2, 3, 4, 9, 10)],
    )
    def test_last_revision_across_gaps(self, etcd: EtcdStore, revisions: tuple[int, ...]) -> None:
        for rev in revisions:
            etcd.append_event(_event(rev))
        assert etcd.load().last_revision == revisions[-1]

    def test_forgets_old_request_ids(
        self, etcd: EtcdStore, etcd_cluster: EtcdCluster, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(etcd_store, "REQUEST_RETENTION", 3)
        monkeypatch.setattr(etcd_store, "TXN_OPS", 2)
        for i in range(1, 9):
            etcd.put_request(RequestRecord(f"q{i}", "f", "{}", float(i)))
        # Forgotten every third put: at 6, all but 4..6 went; 7 and 8 came after.
        assert _keys(_raw(etcd_cluster), f"{etcd_prefix}requests/") == [
            f"{etcd_prefix}requests/q{i}" for i in (4, 5, 6, 7, 8)
        ]
        assert [r.id for r in etcd.load().requests] == ["q6", "q7", "q8"]

    def test_threads_share_it(self, etcd: EtcdStore) -> None:
        def work(n: int) -> None:
            for i in range(10):
                etcd.put_composition(_composition(f"c{n}-{i}"))
                etcd.append_event(_event(100 * n + i + 1))
                etcd.events_after(0, limit=5)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        state = etcd.load()
        assert len(state.compositions) == 40
        assert state.last_revision == 310
        assert len(etcd.events_after(0, limit=100)) == 40

    def test_any_request_id(self, etcd: EtcdStore) -> None:
        record = RequestRecord("ré/q 1", "f", '{"name":"ünï"}', 2.5)
        etcd.put_request(record)
        assert etcd.load().requests == (record,)
        etcd.delete_request(record.id)
        assert etcd.load().requests == ()


class TestEtcdFencing:
    """A fenced EtcdStore writes only while the leader key has the fencing epoch; after another replica took
    the key every write raises LeadershipLostError and changes nothing."""

    def _lead(self, client: etcd3gw.Etcd3Client, key: str, holder: str) -> int:
        client.delete(key)
        client.put(key, holder)
        ((_, meta),) = client.get(key, metadata=True)
        return int(meta["create_revision"])

    def test_writes_while_leading(self, etcd: EtcdStore, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        key = f"{etcd_prefix}leader"
        etcd.fence(key, self._lead(_raw(etcd_cluster), key, "me"))
        etcd.put_composition(_composition("c1"))
        etcd.append_event(_event(1))
        etcd.delete_composition("c1")
        assert etcd.load() == LedgerState(last_revision=1)

    def test_write_after_another_leads(self, etcd: EtcdStore, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        client = _raw(etcd_cluster)
        key = f"{etcd_prefix}leader"
        etcd.fence(key, self._lead(client, key, "me"))
        etcd.put_composition(_composition("c1"))
        etcd.put_request(RequestRecord("q1", "f", "{}", 1.0))
        etcd.append_event(_event(1))
        before = etcd.load()
        self._lead(client, key, "another replica")
        writes = [
            lambda: etcd.put_composition(_composition("c2")),
            lambda: etcd.delete_composition("c1"),
            lambda: etcd.put_reservation(_reservation("r1")),
            lambda: etcd.delete_reservation("r1"),
            lambda: etcd.put_request(RequestRecord("q2", "f", "{}", 2.0)),
            lambda: etcd.delete_request("q1"),
            lambda: etcd.append_event(_event(2)),
        ]
        for write in writes:
            with pytest.raises(LeadershipLostError, match="another replica leads now") as info:
                write()
            assert info.value.reason == "LEADERSHIP_LOST"
            assert isinstance(info.value, FabricUnavailableError)
            assert info.value.metadata["leader_key"] == key
        assert etcd.load() == before

    def test_leader_key_gone(self, etcd: EtcdStore, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        client = _raw(etcd_cluster)
        key = f"{etcd_prefix}leader"
        etcd.fence(key, self._lead(client, key, "me"))
        client.delete(key)  # the lease expired
        with pytest.raises(LeadershipLostError):
            etcd.put_composition(_composition("c1"))
        assert etcd.load().compositions == ()

    def test_epoch_is_a_create_revision(self, etcd: EtcdStore) -> None:
        with pytest.raises(InvalidRequestError, match="create revision"):
            etcd.fence("/disagg/leader", 0)


@pytest.fixture
def etcd_trio(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = start_etcd_cluster(tmp_path, members=3)
    yield cluster
    cluster.stop()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback port that accepts connections and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


class TestEtcdFailover:
    """A call that cannot reach one endpoint, refused or timed out, is tried on the next, and the next calls
    start at the endpoint that answered."""

    def test_member_killed(self, etcd_trio: EtcdCluster, etcd_prefix: str) -> None:
        store = EtcdStore(etcd_trio.endpoints, prefix=etcd_prefix, timeout_s=2.0, unfenced=True)
        try:
            store.put_composition(_composition("c1"))
            store.append_event(_event(1))
            etcd_trio.kill(0)
            etcd_trio.wait_leader()
            store.put_composition(_composition("c2"))
            store.append_event(_event(2))
            state = store.load()
            assert sorted(c.id for c in state.compositions) == ["c1", "c2"]
            assert state.last_revision == 2
            assert [e.revision for e in store.events_after(0)] == [1, 2]
        finally:
            store.close()
        # A store opened after the member died starts at its endpoint, and moves on too.
        again = EtcdStore(etcd_trio.endpoints, prefix=etcd_prefix, timeout_s=2.0)
        try:
            assert [e.revision for e in again.events_after(1)] == [2]
        finally:
            again.close()

    def test_timeout_moves_on(self, etcd_cluster: EtcdCluster, etcd_prefix: str, silent_endpoint: str) -> None:
        store = EtcdStore([silent_endpoint, *etcd_cluster.endpoints], prefix=etcd_prefix, timeout_s=0.3, unfenced=True)
        try:
            store.put_composition(_composition("c1"))
            started = time.monotonic()
            assert [c.id for c in store.load().compositions] == ["c1"]
            assert time.monotonic() - started < 0.3  # no second wait on the silent endpoint
        finally:
            store.close()


class TestEtcdWriteFailure:
    """A write that fails fails the store as a whole (`Store.failure`), as the SQLite ledger's committer does:
    the composer changed its memory before writing, so memory and etcd may differ from then on. Every later
    write was taken as if nothing had happened: a decompose cut off this way left a record that stopped every
    later replica from starting, a compose a COMPOSING composition stuck in memory."""

    def test_a_write_etcd_does_not_answer(self, etcd_cluster: EtcdCluster, etcd_prefix: str) -> None:
        store = EtcdStore(etcd_cluster.endpoints, prefix=etcd_prefix, timeout_s=0.5, unfenced=True)
        member = etcd_cluster.members[0].process
        assert member is not None
        try:
            store.put_composition(_composition("c1"))
            assert store.failure == ""
            member.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(FabricUnavailableError, match="no etcd endpoint answered"):
                    store.delete_composition("c1")
            finally:
                member.send_signal(signal.SIGCONT)
            assert "no etcd endpoint answered" in store.failure
            for write in (lambda: store.put_composition(_composition("c2")), lambda: store.append_event(_event(1))):
                with pytest.raises(FabricUnavailableError, match="failed earlier and takes no more writes"):
                    write()
            assert [c.id for c in store.load().compositions] in (["c1"], [])  # reads go on; the delete may have landed
        finally:
            store.close()

    def test_a_write_etcd_refuses(self) -> None:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        store = EtcdStore([f"127.0.0.1:{server.server_address[1]}"], unfenced=True)
        try:
            with pytest.raises(FabricUnavailableError, match="something refused"):
                store.put_cordon("pcie0/gpu0")
            assert "something refused" in store.failure
        finally:
            store.close()
            server.shutdown()
            server.server_close()


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = b'{"error":"etcdserver: something refused","code":3}'
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class TestEtcdUnavailable:
    """With no endpoint answering every call raises FabricUnavailableError naming them all; a member that answers
    with an error raises it naming that member; never an exception of requests or etcd3gw."""

    def test_no_endpoint_answers(self) -> None:
        endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
        store = EtcdStore(endpoints, timeout_s=1.0, write_patience_s=0, unfenced=True)
        calls = [store.load, lambda: store.put_composition(_composition("c1")), lambda: store.events_after(0)]
        try:
            for call in calls:
                with pytest.raises(FabricUnavailableError, match="no etcd endpoint answered") as info:
                    call()
                assert type(info.value) is FabricUnavailableError and info.value.retryable
                assert all(e in info.value.message for e in endpoints)
        finally:
            store.close()

    def test_refused(self) -> None:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        endpoint = f"127.0.0.1:{server.server_address[1]}"
        store = EtcdStore([endpoint])
        try:
            with pytest.raises(FabricUnavailableError, match="something refused") as info:
                store.load()
            assert endpoint in info.value.message
        finally:
            store.close()
            server.shutdown()
            server.server_close()


class TestEtcdConfig:
    """Endpoints are HOST:PORT (an IPv6 host in brackets); anything else, and a bad option, is a ConfigError."""

    @pytest.mark.parametrize(
        "endpoint",
        [
            *("", "localhost", ":2379", "h:", "h:port", "h:0", "h:65536", "http://h:2379", "::1:2379", "a b:1"),
            *("h:\u00b2", "h:\u0661\u0662\u0663"),  # other scripts' digits: a bare int() error, or port 123
        ],
    )
    def test_bad_endpoint(self, endpoint: str) -> None:
        with pytest.raises(ConfigError, match="is not HOST:PORT") as info:
            EtcdStore(["127.0.0.1:2379", endpoint])
        assert info.value.field == "state.endpoints"

    def test_good_endpoints(self) -> None:
        EtcdStore(["127.0.0.1:2379", "etcd-0.example:2379", "[::1]:2379"]).close()

    @pytest.mark.parametrize(
        ("endpoints", "options", "message"),
        [
            ([], {}, "at least one endpoint"),
            ("127.0.0.1:2379", {}, "not the string"),
            (["127.0.0.1:2379"], {"event_retention": 0}, "event_retention"),
            (["127.0.0.1:2379"], {"timeout_s": 0.0}, "timeout"),
        ],
    )
    def test_bad_options(self, endpoints: list[str], options: dict[str, float], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            EtcdStore(endpoints, **options)  # type: ignore[arg-type]


class TestEtcdMissing:
    """Without the etcd binary the etcd tests are skipped saying what to install, and fail on CI."""

    @pytest.mark.parametrize(("ci", "outcome"), [("true", pytest.fail.Exception), ("", pytest.skip.Exception)])
    def test_missing_etcd(self, monkeypatch: pytest.MonkeyPatch, ci: str, outcome: type[BaseException]) -> None:
        monkeypatch.setattr(shutil, "which", lambda _: None)
        monkeypatch.setenv("CI", ci)
        with pytest.raises(outcome) as info:
            etcd_binary()
        assert "install etcd-server (apt-get install etcd-server)" in str(info.value)


class TestCordons:
    """Cordoned devices are kept, removed by id, and come back with the rest of the ledger."""

    def test_put_delete_load(self, store: Store) -> None:
        store.put_cordon("pcie0/gpu1")
        store.put_cordon("pcie0/gpu0")
        store.put_cordon("pcie0/gpu1")
        store.delete_cordon("pcie0/gpu9")
        assert sorted(store.load().cordons) == ["pcie0/gpu0", "pcie0/gpu1"]
        store.delete_cordon("pcie0/gpu1")
        assert store.load().cordons == ("pcie0/gpu0",)


class TestQuarantines:
    """Quarantined allocations are kept by pool and id, removed by them, and come back with the rest of the
    ledger, whatever characters the ids hold."""

    def test_put_delete_load(self, store: Store) -> None:
        store.put_quarantine("cxl0/mem0", "stray")
        store.put_quarantine("cxl0/mem0", 'odd/"id",x')
        store.put_quarantine("cxl0/mem0", "stray")
        store.put_quarantine("cxl0/mem1", "stray")
        store.delete_quarantine("cxl0/mem0", "absent")
        assert sorted(store.load().quarantined) == [
            ("cxl0/mem0", 'odd/"id",x'),
            ("cxl0/mem0", "stray"),
            ("cxl0/mem1", "stray"),
        ]
        store.delete_quarantine("cxl0/mem0", "stray")
        assert sorted(store.load().quarantined) == [("cxl0/mem0", 'odd/"id",x'), ("cxl0/mem1", "stray")]
