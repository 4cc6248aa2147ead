"""The SQLite ledger keeps its event log and request ids to their retention however often the server restarts,
serves the same events as the in-memory ledger at the retention boundary, and refuses a retention that keeps
nothing, as every ledger does."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg.errors import ConfigError
from disagg.store import MemoryStore, SqliteStore
from disagg.store import sqlite as sqlite_store
from disagg.store.base import RequestRecord
from retention_helpers import (
    assert_same_log,
    assert_timed_resume_at_the_edge_refused_as_on_memory,
    assert_watch_refused_as_on_memory,
    event,
)

LIVES = 20
"""Server lifetimes in a restart test, each shorter than a prune step."""
PER_LIFE = 9


def _rows(ledger: Path, table: str) -> int:
    """Rows of ``table`` on disk, read by a connection of its own (the store is closed)."""
    with contextlib.closing(sqlite3.connect(ledger)) as db:
        (count,) = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
    return int(count)


@contextlib.contextmanager
def _life(ledger: Path, **options: int) -> Iterator[SqliteStore]:
    """One server lifetime of the ledger: opened, written, synced, closed."""
    store = SqliteStore(ledger, **options)
    try:
        yield store
        store.sync()
    finally:
        store.close()


class TestPruningAcrossRestarts:
    """A server that restarts before a prune step of its own still prunes: the step is counted from what the
    ledger holds, not from what one process wrote."""

    @pytest.mark.parametrize(("retention", "step"), [(10, 1_000), (20, 5)])
    def test_event_log(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retention: int, step: int) -> None:
        monkeypatch.setattr(sqlite_store, "PRUNE_EVERY", step)
        ledger = tmp_path / "l.db"
        revision = 0
        for _ in range(LIVES):
            with _life(ledger, event_retention=retention) as store:
                for _ in range(PER_LIFE):
                    revision += 1
                    store.append_event(event(revision))
        assert _rows(ledger, "events") <= retention + min(step, retention) - 1
        with _life(ledger, event_retention=retention) as store:
            kept = [e.revision for e in store.events_after(0, 10 * retention)]
        assert kept == list(range(revision - retention + 1, revision + 1))

    @pytest.mark.parametrize("step_back_s", [0.0, 3_600.0], ids=["steady-clock", "clock-stepped-back"])
    def test_request_ids(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step_back_s: float) -> None:
        """The newest answers are those written last, whatever the wall clock said: kept by their time, the answers
        recorded after the clock was stepped back (each lifetime's clock ``step_back_s`` behind the last's) were
        the ones forgotten at a restart, and their ids accepted for other requests, while older ones were kept."""
        retention = 10
        monkeypatch.setattr(sqlite_store, "REQUEST_RETENTION", retention)
        ledger = tmp_path / "l.db"
        put = 0
        for life in range(LIVES):
            with _life(ledger) as store:
                for _ in range(PER_LIFE):
                    put += 1
                    store.put_request(RequestRecord(f"r{put}", "f", "{}", 1e9 + put - step_back_s * life))
        assert _rows(ledger, "requests") < 2 * retention
        with _life(ledger) as store:
            kept = [r.id for r in store.load().requests]
        assert kept == [f"r{n}" for n in range(put - retention + 1, put + 1)]


class TestRetentionBoundary:
    """What the SQLite ledger serves is cut at the retention as the in-memory ledger's is, whatever rows a
    prune has yet to delete: a watch is served or refused alike on both."""

    @pytest.mark.parametrize("retention", [1, 3, 5])
    def test_events_after_as_memory(self, tmp_path: Path, retention: int) -> None:
        memory = MemoryStore(event_retention=retention)
        store = SqliteStore(tmp_path / "l.db", event_retention=retention)
        try:
            for revision in range(1, 4 * retention + 4):
                memory.append_event(event(revision))
                store.append_event(event(revision))
                assert_same_log(memory, store, revision)  # some events still queued
                store.sync()
                assert_same_log(memory, store, revision)
        finally:
            store.close()

    def test_watch_refused_as_on_memory(self, tmp_path: Path) -> None:
        assert_watch_refused_as_on_memory(SqliteStore(tmp_path / "l.db", event_retention=5))

    def test_timed_resume_at_the_edge_refused_as_on_memory(self, tmp_path: Path) -> None:
        assert_timed_resume_at_the_edge_refused_as_on_memory(SqliteStore(tmp_path / "l.db", event_retention=5))


class TestRetentionAtLeastOne:
    """A retention that keeps no event is a configuration error when the ledger is made, as for etcd, not a
    failure at the first append."""

    @pytest.mark.parametrize("retention", [0, -1])
    def test_memory(self, retention: int) -> None:
        with pytest.raises(ConfigError, match="event_retention must be at least 1"):
            MemoryStore(event_retention=retention)

    @pytest.mark.parametrize("retention", [0, -1])
    def test_sqlite(self, tmp_path: Path, retention: int) -> None:
        ledger = tmp_path / "l.db"
        with pytest.raises(ConfigError, match="event_retention must be at least 1"):
            SqliteStore(ledger, event_retention=retention)
        with _life(ledger, event_retention=1) as store:  # the refused store did not keep the ledger
            store.append_event(event(1))
            store.append_event(event(2))
        assert _rows(ledger, "events") == 1
