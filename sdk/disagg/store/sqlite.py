"""The embedded default ledger: SQLite in WAL mode with synchronous=FULL, writes under BEGIN IMMEDIATE.

Records are stored as JSON documents of the model values, so the schema follows the model without migrations
of every field.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from disagg import codec
from disagg.errors import ConfigError
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
"""


EVENT_RETENTION = 100_000
"""Events kept; a watch from an older revision is told the log was compacted (OUT_OF_RANGE)."""
PRUNE_EVERY = 1_000
"""Appends between two prunes of the event log: pruning in steps keeps appending cheap."""


class SqliteStore(Store):
    def __init__(self, path: str | Path, *, event_retention: int = EVENT_RETENTION) -> None:
        self.path = Path(path)
        self._retention = event_retention
        self._appended = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"cannot open the ledger at {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        self._put_requests = 0

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def load(self) -> LedgerState:
        with self._lock:
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
        return LedgerState(comps, res, int(last), requests)

    def put_composition(self, composition: Composition) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO compositions VALUES (?, ?)", (composition.id, codec.dumps(composition)))

    def delete_composition(self, composition_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM compositions WHERE id = ?", (composition_id,))

    def put_reservation(self, reservation: Reservation) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO reservations VALUES (?, ?)", (reservation.id, codec.dumps(reservation)))

    def delete_reservation(self, reservation_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM reservations WHERE id = ?", (reservation_id,))

    def put_request(self, record: RequestRecord) -> None:
        with self._write() as db:
            db.execute(
                "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?)",
                (record.id, record.fingerprint, record.answer, record.at),
            )
            self._put_requests += 1
            if self._put_requests % REQUEST_RETENTION == 0:  # forget the oldest now and then, not on every put
                db.execute(
                    "DELETE FROM requests WHERE id NOT IN (SELECT id FROM requests ORDER BY at DESC LIMIT ?)",
                    (REQUEST_RETENTION,),
                )

    def delete_request(self, request_id: str) -> None:
        with self._write() as db:
            db.execute("DELETE FROM requests WHERE id = ?", (request_id,))

    def append_event(self, event: Event) -> None:
        with self._write() as db:
            db.execute("INSERT INTO events VALUES (?, ?)", (event.revision, codec.dumps(event)))
            self._appended += 1
            if self._appended % min(PRUNE_EVERY, self._retention) == 0:
                db.execute("DELETE FROM events WHERE revision <= ?", (event.revision - self._retention,))

    def events_after(self, revision: int, limit: int = 1000) -> Sequence[Event]:
        with self._lock:
            rows = self._db.execute(
                "SELECT doc FROM events WHERE revision > ? ORDER BY revision LIMIT ?", (revision, limit)
            ).fetchall()
        return [codec.loads(d, Event) for (d,) in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
