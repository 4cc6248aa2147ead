"""The embedded default ledger: SQLite in WAL mode with synchronous=FULL, writes under BEGIN IMMEDIATE.

Commits are grouped. A write is queued and returns at once; one committer thread applies everything queued
in one transaction, so that concurrent requests share one fsync instead of paying one each. `sync` waits
until everything queued before it is on disk: the composer calls it before a driver call that the ledger
must already know of (write-ahead), and before it answers. Reads see the queued writes as well: `load` syncs
first, and `events_after` adds the queued events to what the database holds.

Records are stored as JSON documents of the model values, so the schema follows the model without migrations
of every field.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from disagg import codec
from disagg.errors import ConfigError, FabricUnavailableError
from disagg.model import Composition, Event, Reservation
from disagg.store.base import REQUEST_RETENTION, LedgerState, RequestRecord, Store

SCHEMA = """
CREATE TABLE IF NOT EXISTS compositions (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reservations (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (revision INTEGER PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, answer TEXT NOT NULL, at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_at ON requests (at);
CREATE TABLE IF NOT EXISTS cordons (device TEXT PRIMARY KEY);
"""

EVENT_RETENTION = 100_000
"""Events kept; a watch from an older revision is told the log was compacted (OUT_OF_RANGE)."""
PRUNE_EVERY = 1_000
"""Appends between two prunes of the event log: pruning in steps keeps appending cheap."""

Statement = tuple[str, tuple[Any, ...]]


class SqliteStore(Store):
    def __init__(self, path: str | Path, *, event_retention: int = EVENT_RETENTION) -> None:
        self.path = Path(path)
        self._retention = event_retention
        self._appended = 0
        self._put_requests = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"cannot open the ledger at {self.path}: {exc}") from exc
        (newest,) = self._db.execute("SELECT COALESCE(MAX(revision), 0) FROM events").fetchone()
        self._newest_event = int(newest)
        self._db_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[Statement] = []
        self._queued_events: list[Event] = []
        self._queued = 0
        """Sequence number of the last statement queued."""
        self._durable = 0
        """Sequence number of the last statement on disk."""
        self._failure: BaseException | None = None
        self._closing = False
        self._committer = threading.Thread(target=self._commit_loop, name="disagg-ledger", daemon=True)
        self._committer.start()

    # ----------------------------------------------------------------- the committer

    def _enqueue(self, *statements: Statement, event: Event | None = None) -> None:
        with self._cond:
            if self._failure is not None:
                raise self._failed()
            if self._closing:
                raise FabricUnavailableError(f"the ledger at {self.path} is closed")
            self._queue.extend(statements)
            self._queued += len(statements)
            if event is not None:
                self._queued_events.append(event)
            self._cond.notify_all()

    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
                upto = self._queued
            try:
                with self._db_lock:
                    self._db.execute("BEGIN IMMEDIATE")
                    try:
                        for sql, params in batch:
                            self._db.execute(sql, params)
                    except BaseException:
                        self._db.execute("ROLLBACK")
                        raise
                    self._db.execute("COMMIT")
            except BaseException as exc:
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()
                return
            committed = {params[0] for sql, params in batch if sql.startswith("INSERT INTO events")}
            with self._cond:
                self._durable = upto
                self._queued_events = [e for e in self._queued_events if e.revision not in committed]
                self._cond.notify_all()

    def _failed(self) -> FabricUnavailableError:
        return FabricUnavailableError(f"the ledger at {self.path} cannot be written: {self._failure!r}")

    def sync(self) -> None:
        """Wait until every write queued so far is on disk; raises `FabricUnavailableError` if it cannot be."""
        with self._cond:
            target = self._queued
            while self._durable < target:
                if self._failure is not None:
                    raise self._failed()
                self._cond.wait()

    # ----------------------------------------------------------------- reads

    def load(self) -> LedgerState:
        self.sync()
        with self._db_lock:
            comps = tuple(codec.loads(d, Composition) for (d,) in self._db.execute("SELECT doc FROM compositions"))
            res = tuple(codec.loads(d, Reservation) for (d,) in self._db.execute("SELECT doc FROM reservations"))
            (last,) = self._db.execute("SELECT COALESCE(MAX(revision), 0) FROM events").fetchone()
            requests = tuple(
                RequestRecord(i, f, a, t)
                for i, f, a, t in self._db.execute(
                    "SELECT id, fingerprint, answer, at FROM "
                    "(SELECT * FROM requests ORDER BY at DESC LIMIT ?) ORDER BY at",
                    (REQUEST_RETENTION,),
                )
            )
            cordons = tuple(d for (d,) in self._db.execute("SELECT device FROM cordons ORDER BY device"))
        return LedgerState(comps, res, int(last), requests, cordons)

    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]:
        with self._cond:
            queued = [e for e in self._queued_events if e.revision > revision]
        with self._db_lock:
            rows = self._db.execute(
                "SELECT doc FROM events WHERE revision > ? ORDER BY revision LIMIT ?", (revision, limit)
            ).fetchall()
        found = {e.revision: e for e in (codec.loads(d, Event) for (d,) in rows)}
        for event in queued:
            found.setdefault(event.revision, event)
        return [found[r] for r in sorted(found)[:limit]]

    # ----------------------------------------------------------------- writes (queued)

    def put_composition(self, composition: Composition) -> None:
        self._enqueue(("INSERT OR REPLACE INTO compositions VALUES (?, ?)", (composition.id, codec.dumps(composition))))

    def delete_composition(self, composition_id: str) -> None:
        self._enqueue(("DELETE FROM compositions WHERE id = ?", (composition_id,)))

    def put_reservation(self, reservation: Reservation) -> None:
        self._enqueue(("INSERT OR REPLACE INTO reservations VALUES (?, ?)", (reservation.id, codec.dumps(reservation))))

    def delete_reservation(self, reservation_id: str) -> None:
        self._enqueue(("DELETE FROM reservations WHERE id = ?", (reservation_id,)))

    def put_cordon(self, device: str) -> None:
        self._enqueue(("INSERT OR REPLACE INTO cordons VALUES (?)", (device,)))

    def delete_cordon(self, device: str) -> None:
        self._enqueue(("DELETE FROM cordons WHERE device = ?", (device,)))

    def put_request(self, record: RequestRecord) -> None:
        statements: list[Statement] = [
            (
                "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?)",
                (record.id, record.fingerprint, record.answer, record.at),
            )
        ]
        self._put_requests += 1
        if self._put_requests % REQUEST_RETENTION == 0:  # forget the oldest now and then, not on every put
            statements.append(
                (
                    "DELETE FROM requests WHERE id NOT IN (SELECT id FROM requests ORDER BY at DESC LIMIT ?)",
                    (REQUEST_RETENTION,),
                )
            )
        self._enqueue(*statements)

    def delete_request(self, request_id: str) -> None:
        self._enqueue(("DELETE FROM requests WHERE id = ?", (request_id,)))

    def append_event(self, event: Event) -> None:
        with self._cond:
            if event.revision <= self._newest_event:
                # Refused here, not in the committer: one bad statement must not fail a whole group of commits.
                raise sqlite3.IntegrityError(f"event revision {event.revision} is not above {self._newest_event}")
            self._newest_event = event.revision
        statements: list[Statement] = [("INSERT INTO events VALUES (?, ?)", (event.revision, codec.dumps(event)))]
        self._appended += 1
        if self._appended % min(PRUNE_EVERY, self._retention) == 0:
            statements.append(("DELETE FROM events WHERE revision <= ?", (event.revision - self._retention,)))
        self._enqueue(*statements, event=event)

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._committer.join()
        with self._db_lock:
            self._db.close()
